#!/usr/bin/env bash
# Llama-3 pretraining through the megatron-perf-toggles launcher: the performance toggles are on by
# default and each one is turned off with its environment variable, e.g. GRAD_REDUCE_IN_BF16=0.
#
#   MEGATRON_LM=/path/to/Megatron-LM MODEL_SIZE=8 PRECISION=fp8 bash examples/llama/train_llama3.sh
#
# MODEL_SIZE   8 | 70                     (Llama-3 8B / 70B shapes; NUM_LAYERS overrides the depth)
# PRECISION    bf16 | fp8 | fp8_tensorwise | mxfp8 | nvfp4 | mxfp4
#              (mxfp4 needs AMD's ROCm Megatron-LM fork; nvfp4/mxfp8 need Transformer Engine >= 2.7 and
#              Blackwell-class or MI355X hardware)
# NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT, GPUS_PER_NODE   torchrun topology (defaults: one node)
# TP, PP, MBS, GBS, SEQ_LEN, TRAIN_ITERS, DATA_PATH, TOKENIZER_MODEL, LOG_DIR, CKPT_DIR
# DRY_RUN=1    stop after Megatron's parse and validate and print the toggles' decisions as JSON; runs
#              on any machine, planning for NNODES x GPUS_PER_NODE ranks and the GPU named by GPU
#              (h100, h200, b200, mi300x, mi355x, or an arch such as sm_90 / gfx942; default: the
#              visible one)
# PRINT_ONLY=1 print the command instead of running it
set -euo pipefail

MEGATRON_LM=${MEGATRON_LM:?set MEGATRON_LM to your Megatron-LM checkout}
MODEL_SIZE=${MODEL_SIZE:-8}
PRECISION=${PRECISION:-bf16}
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
TP=${TP:-1}
PP=${PP:-1}
MBS=${MBS:-2}
GBS=${GBS:-128}
SEQ_LEN=${SEQ_LEN:-8192}
TRAIN_ITERS=${TRAIN_ITERS:-1000}
LOG_DIR=${LOG_DIR:-runs/llama3-${MODEL_SIZE}b}
CKPT_DIR=${CKPT_DIR:-}

case "$MODEL_SIZE" in
  8)  LAYERS=32; HIDDEN=4096; FFN=14336; HEADS=32; KV_GROUPS=8 ;;
  70) LAYERS=80; HIDDEN=8192; FFN=28672; HEADS=64; KV_GROUPS=8 ;;
  *) echo "train_llama3.sh: MODEL_SIZE must be 8 or 70, not '$MODEL_SIZE'" >&2; exit 2 ;;
esac
LAYERS=${NUM_LAYERS:-$LAYERS}

# Model and mixed-precision flags (GPT_ARGS) and distributed/training flags (EXTRA_ARGS), the
# buckets the originating ROCm script kept. The toggles themselves need no flags here: the plugin
# registers them and reads their environment variables.
GPT_ARGS=(
  --num-layers "$LAYERS" --hidden-size "$HIDDEN" --ffn-hidden-size "$FFN"
  --num-attention-heads "$HEADS" --group-query-attention --num-query-groups "$KV_GROUPS"
  --seq-length "$SEQ_LEN" --max-position-embeddings "$SEQ_LEN"
  --position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu
  --untie-embeddings-and-output-weights --disable-bias-linear --attention-dropout 0.0 --hidden-dropout 0.0
  --transformer-impl transformer_engine --bf16
)
case "$PRECISION" in
  bf16) ;;
  fp8) GPT_ARGS+=(--fp8-format hybrid --fp8-recipe delayed) ;;
  fp8_tensorwise) GPT_ARGS+=(--fp8-format e4m3 --fp8-recipe tensorwise) ;;
  mxfp8) GPT_ARGS+=(--fp8-format e4m3 --fp8-recipe mxfp8) ;;
  nvfp4) GPT_ARGS+=(--fp4-format e2m1 --fp4-recipe nvfp4) ;;   # layer selection: FP4_SELECTIVE_BF16 etc.
  mxfp4) GPT_ARGS+=(--fp4-format e2m1 --fp4-recipe mxfp4) ;;   # ROCm fork only; bf16 wgrad guard applies
  *) echo "train_llama3.sh: PRECISION must be bf16, fp8, fp8_tensorwise, mxfp8, nvfp4 or mxfp4, not '$PRECISION'" >&2
     exit 2 ;;
esac

EXTRA_ARGS=(
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --use-distributed-optimizer
  --overlap-grad-reduce --overlap-param-gather
  --micro-batch-size "$MBS" --global-batch-size "$GBS" --train-iters "$TRAIN_ITERS"
  --lr 8e-4 --min-lr 8e-5 --lr-decay-style cosine --lr-warmup-iters 100 --weight-decay 0.1
  --adam-beta1 0.9 --adam-beta2 0.95 --adam-eps 1e-5 --clip-grad 1.0
  --log-interval 10 --log-throughput --eval-interval 1000 --eval-iters 0
  --tensorboard-dir "$LOG_DIR/tensorboard"   # tagged with the precision actually used
)
if [ -n "${DATA_PATH:-}" ]; then
  EXTRA_ARGS+=(--data-path "$DATA_PATH" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "${TOKENIZER_MODEL:?set TOKENIZER_MODEL}")
else
  EXTRA_ARGS+=(--mock-data --tokenizer-type NullTokenizer --vocab-size 128256)
fi
if [ -n "$CKPT_DIR" ]; then
  EXTRA_ARGS+=(--save "$CKPT_DIR" --load "$CKPT_DIR" --save-interval 500)
fi

LAUNCH=(torchrun --nproc-per-node "$GPUS_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK"
        --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT")
PLAN=()
if [ "${DRY_RUN:-0}" = 1 ]; then
  LAUNCH=("${PYTHON:-python3}")   # a dry run parses and validates once, on any machine
  PLAN=(--dry-run --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" ${GPU:+--gpu "$GPU"})
fi
CMD=("${LAUNCH[@]}" -m megatron_perf_toggles.run "${PLAN[@]}" "$MEGATRON_LM/pretrain_gpt.py" "${GPT_ARGS[@]}" "${EXTRA_ARGS[@]}")
export PYTHONPATH="$MEGATRON_LM${PYTHONPATH:+:$PYTHONPATH}"
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}

if [ "${PRINT_ONLY:-0}" = 1 ]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
exec "${CMD[@]}"
