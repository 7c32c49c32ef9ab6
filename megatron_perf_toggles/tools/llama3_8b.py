"""Llama-3-8B in bf16: the one definition of the model that ``explain`` plans for when given no
command line, that the tests decide on, and that the startup benchmark parses."""

from __future__ import annotations

LLAMA3_8B_BF16 = [
    "--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336",
    "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
    "--seq-length", "8192", "--max-position-embeddings", "8192",
    "--position-embedding-type", "rope", "--rotary-base", "500000",
    "--normalization", "RMSNorm", "--swiglu", "--untie-embeddings-and-output-weights",
    "--disable-bias-linear", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
    "--transformer-impl", "transformer_engine",
    "--tensor-model-parallel-size", "1", "--pipeline-model-parallel-size", "1",
    "--micro-batch-size", "2", "--global-batch-size", "128",
    "--optimizer", "adam",
    "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "100",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8",
    "--clip-grad", "1.0", "--train-iters", "1000",
    "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--mock-data",
    "--tensorboard-dir", "runs/llama3-8b/tensorboard",
]


# What ``explain`` plans when given no command line: the same model as a realistic job for eight
# H100s (80 GB), one node: two-way tensor parallelism with sequence parallelism, four-way data
# parallelism with the distributed optimizer, one sequence of 8192 tokens per micro-batch. It fits
# an H100 with room to spare, so a newcomer's first plan shows the plugin at work, not a warning.
EXAMPLE_WORLD = 8
EXAMPLE_LAYOUT = {"--tensor-model-parallel-size": "2", "--micro-batch-size": "1"}
LLAMA3_8B_EXAMPLE = [*(w for i, w in enumerate(LLAMA3_8B_BF16)
                       if w not in EXAMPLE_LAYOUT and (i == 0 or LLAMA3_8B_BF16[i - 1] not in EXAMPLE_LAYOUT)),
                     *(w for pair in EXAMPLE_LAYOUT.items() for w in pair), "--sequence-parallel"]


def _value(word: str) -> int | float | str:
    for kind in (int, float):
        try:
            return kind(word)
        except ValueError:
            continue
    return word


def llama3_8b_args(*dests: str) -> dict[str, bool | int | float | str]:
    """The values of ``dests`` on the command line above, as Megatron's parser would type them
    (a flag alone is ``True``): a parsed view of the same model for code that decides without a
    parser."""
    values: dict[str, bool | int | float | str] = {}
    for i, word in enumerate(LLAMA3_8B_BF16):
        if word.startswith("--"):
            following = LLAMA3_8B_BF16[i + 1] if i + 1 < len(LLAMA3_8B_BF16) else "--"
            values[word[2:].replace("-", "_")] = True if following.startswith("--") else _value(following)
    missing = [d for d in dests if d not in values]
    if missing:
        raise KeyError(f"Llama-3-8B's command line does not set {', '.join(missing)}")
    return {d: values[d] for d in dests}
