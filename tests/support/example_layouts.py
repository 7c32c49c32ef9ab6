"""NVIDIA's own example layouts, as command-line facts, for dry runs of real multi-GPU jobs.

GPT3_175B is the argument list of Megatron-LM's examples/gpt3/train_gpt3_175b_distributed.sh
(16 nodes x 8 GPUs, TP 8, PP 16), less its batch-size ramp: core 0.13-0.17 pass
``--rampup-batch-size`` with ``--train-iters`` and 0.18+ pass ``--step-batch-size-schedule`` with
``--global-batch-size``, and validate_args rejects both pairings (the 0.18+ script also word-splits
the schedule), so the ramp is left out and the global batch of 1536 kept. LLAMA3_8B is
examples/llama/train_llama3_8b_h100_fp8.sh (8 GPUs, TP 1, fp8, mock data); LLAMA3_70B is the same
recipe at the Llama-3-70B shape with TP 8, PP 4 on 64 GPUs (DP 2).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    name: str
    world_size: int
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = (("CUDA_DEVICE_MAX_CONNECTIONS", "1"),)  # both scripts export it
    tp: int = 1
    pp: int = 1


def gpt3_175b(work: str) -> Layout:
    return Layout("gpt3-175b-tp8-pp16", 128, (
        "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
        "--max-position-embeddings", "2048", "--attention-backend", "auto",
        "--micro-batch-size", "1", "--global-batch-size", "1536", "--train-iters", "500000",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--init-method-std", "0.006",
        "--clip-grad", "1.0", "--fp16", "--lr", "6.0e-5", "--lr-decay-style", "cosine", "--min-lr", "6.0e-6",
        "--lr-warmup-fraction", ".001", "--lr-decay-iters", "430000",
        "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "16",
        "--data-path", f"{work}/data_text_document", "--vocab-file", f"{work}/gpt2-vocab.json",
        "--merge-file", f"{work}/gpt2-merges.txt", "--split", "949,50,1",
        "--log-interval", "100", "--save-interval", "10000", "--eval-interval", "1000",
        "--save", f"{work}/ckpt175", "--load", f"{work}/ckpt175", "--eval-iters", "10",
        "--tensorboard-dir", f"{work}/tb175",
    ), tp=8, pp=16)


def _llama3(work: str, name: str, shape: tuple[str, ...], world: int, tp: int, pp: int) -> Layout:
    parallel = ("--tensor-model-parallel-size", str(tp), "--context-parallel-size", "1", "--sequence-parallel")
    if pp > 1:
        parallel += ("--pipeline-model-parallel-size", str(pp))
    return Layout(name, world, (
        "--use-mcore-models", *shape, "--group-query-attention", "--num-query-groups", "8", "--kv-channels", "128",
        "--seq-length", "8192", "--max-position-embeddings", "8192", "--position-embedding-type", "rope",
        "--rotary-base", "1000000", "--rotary-percent", "1.0", "--attention-dropout", "0.0", "--hidden-dropout", "0.0",
        "--swiglu", "--normalization", "RMSNorm", "--init-method-std", "0.0134", "--attention-backend", "fused",
        "--apply-layernorm-1p", "--untie-embeddings-and-output-weights", "--disable-bias-linear",
        "--micro-batch-size", "1", "--global-batch-size", "128", "--train-samples", "1953125000",
        "--lr-decay-samples", "1949218748", "--lr-warmup-samples", "3906252", "--lr", "0.00015", "--min-lr", "0.00001",
        "--decoupled-lr", "5.0e-4", "--decoupled-min-lr", "4.5e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0",
        "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--bf16", "--grad-reduce-in-bf16",
        "--cross-entropy-loss-fusion", "--calculate-per-token-loss", "--manual-gc", "--empty-unused-memory-level", "1",
        "--exit-duration-in-mins", "235",
        "--fp8-format", "hybrid", "--fp8-amax-history-len", "1024", "--fp8-amax-compute-algo", "max",
        "--fp8-param-gather", *parallel,
        "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
        "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256",
        "--data-cache-path", f"{work}/cache", "--tiktoken-pattern", "v2", "--split", "99,1,0",
        "--no-create-attention-mask-in-dataloader", "--no-mmap-bin-files", "--num-workers", "1",
        "--log-interval", "1", "--eval-iters", "32", "--eval-interval", "100", "--save-interval", "1000",
        "--log-throughput", "--ckpt-format", "torch_dist", "--distributed-timeout-minutes", "60",
        "--save", f"{work}/ckpt-{name}", "--load", f"{work}/ckpt-{name}", "--tensorboard-dir", f"{work}/tb-{name}",
    ), tp=tp, pp=pp)


def llama3_8b(work: str) -> Layout:
    shape = ("--num-layers", "32", "--hidden-size", "4096", "--ffn-hidden-size", "14336", "--num-attention-heads", "32")
    return _llama3(work, "llama3-8b-fp8", shape, 8, 1, 1)


def llama3_70b(work: str) -> Layout:
    shape = ("--num-layers", "80", "--hidden-size", "8192", "--ffn-hidden-size", "28672", "--num-attention-heads", "64")
    return _llama3(work, "llama3-70b-tp8-pp4", shape, 64, 8, 4)


def all_layouts(work: str) -> list[Layout]:
    return [gpt3_175b(work), llama3_8b(work), llama3_70b(work)]
