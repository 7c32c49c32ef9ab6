"""The built-in Llama-3-8B bf16 command line, so ``explain`` works on a machine with nothing else."""

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
    "--lr", "3e-4", "--min-lr", "3e-5", "--lr-decay-style", "cosine", "--lr-warmup-iters", "100",
    "--weight-decay", "0.1", "--adam-beta1", "0.9", "--adam-beta2", "0.95", "--adam-eps", "1e-8",
    "--clip-grad", "1.0", "--train-iters", "1000",
    "--bf16", "--use-distributed-optimizer", "--overlap-grad-reduce", "--overlap-param-gather",
    "--tokenizer-type", "NullTokenizer", "--vocab-size", "128256", "--mock-data",
    "--tensorboard-dir", "runs/llama3-8b/tensorboard",
]
