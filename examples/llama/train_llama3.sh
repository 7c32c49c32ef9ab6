#!/usr/bin/env bash
# Llama-3 pretraining through the megatron-perf-toggles launcher.
#
# The user interface is the one of the ROCm Megatron-LM examples/llama/train_llama3.sh this
# project comes from: the same variables with the same defaults, set in the environment or as
# KEY=VALUE arguments, e.g.
#
#   MEGATRON_LM=/path/to/Megatron-LM bash examples/llama/train_llama3.sh MODEL_SIZE=8 TP=1 TE_FP8=1
#
# The performance toggles are NOT turned into flags here: the plugin reads their variables itself
# (on by default, VAR=0 turns one off), checks their spelling and applies its guards:
#   GRADIENT_ACCUMULATION_FUSION GRAD_REDUCE_IN_BF16 DDP_AVERAGE_IN_COLLECTIVE
#   CROSS_ENTROPY_LOSS_FUSION CROSS_ENTROPY_FUSION_IMPL FUSED_SINGLE_QKV_ROPE
#   FP4_SELECTIVE_BF16 FP4_BF16_START FP4_BF16_END (FP4 layer selection; by recipe when unset)
# The log directory is tagged by the precision in use; a LOG_DIR that already names it is kept.
#
# Precision: TE_FP8=1 with TE_FP8_RECIPE=delayed|tensorwise|mxfp8, or TE_FP4=1 with
# TE_FP4_RECIPE=nvfp4|mxfp4 (mxfp4 needs the ROCm fork); neither: bf16.
# Only here (not in the originating script): MEGATRON_LM (the checkout, required), GPUS_PER_NODE
# (default: the GPUs torch sees), TIME_STAMP (default: now), PYTHON, DRY_RUN=1 (parse and validate
# only, print the plan; MEGATRON_PERF_TOGGLES_DRY_RUN_OUTPUT=json for the JSON record; plans for NNODES x GPUS_PER_NODE ranks on any machine, and for
# the GPU named by GPU=h100|h200|b200|mi300x|mi355x or an arch such as sm_90 / gfx942) and
# PRINT_ONLY=1 (print the command instead of running it).
set -uo pipefail

die() { echo "train_llama3.sh: $*" >&2; exit 2; }

for ARGUMENT in "$@"; do   # KEY=VALUE arguments become environment variables
  case "$ARGUMENT" in
    *=*) export "${ARGUMENT%%=*}=${ARGUMENT#*=}" ;;
    *) die "arguments are KEY=VALUE, not '$ARGUMENT'" ;;
  esac
done

export GPU_MAX_HW_QUEUES=${GPU_MAX_HW_QUEUES:-2}
export TORCH_NCCL_HIGH_PRIORITY=${TORCH_NCCL_HIGH_PRIORITY:-1}
export NCCL_CHECKS_DISABLE=${NCCL_CHECKS_DISABLE:-1}
export NCCL_IB_GID_INDEX=${NCCL_IB_GID_INDEX:-3}
export NCCL_CROSS_NIC=${NCCL_CROSS_NIC:-0}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export NCCL_PROTO=${NCCL_PROTO:-Simple}
export RCCL_MSCCL_ENABLE=${RCCL_MSCCL_ENABLE:-0}
export TOKENIZERS_PARALLELISM=${TOKENIZERS_PARALLELISM:-false}
export HSA_NO_SCRATCH_RECLAIM=${HSA_NO_SCRATCH_RECLAIM:-1}
if [ -z "${NCCL_IB_HCA:-}" ] && command -v rdma >/dev/null 2>&1; then
  # The first eight RDMA links, if the rdma tool lists any.
  NCCL_IB_HCA=$(rdma link show 2>/dev/null | awk '{split($2, l, "/"); if (n < 8 && l[1] != "") {printf "%s%s", (n ? "," : ""), l[1]; n++}}')
fi
[ -n "${NCCL_IB_HCA:-}" ] && export NCCL_IB_HCA

MEGATRON_LM=${MEGATRON_LM:?set MEGATRON_LM to your Megatron-LM checkout}
PYTHON=${PYTHON:-python3}
TIME_STAMP=${TIME_STAMP:-$(date +"%Y-%m-%d_%H-%M-%S")}
EXP_NAME=${EXP_NAME:-perf}
TEE_OUTPUT=${TEE_OUTPUT:-1}
USE_FLASH_ATTN=${USE_FLASH_ATTN:-0}
NO_TRAINING=${NO_TRAINING:-0}          # 1: only summarise an existing log
ENABLE_PROFILING=${ENABLE_PROFILING:-0}
MASTER_ADDR=${MASTER_ADDR:-localhost}
MASTER_PORT=${MASTER_PORT:-6000}
NNODES=${NNODES:-1}
NODE_RANK=${NODE_RANK:-0}
MODEL_SIZE=${MODEL_SIZE:-70}
TP=${TP:-8}
PP=${PP:-1}
CP=${CP:-1}
MBS=${MBS:-1}
BS=${BS:-8}
SEQ_LENGTH=${SEQ_LENGTH:-2048}
TOTAL_ITERS=${TOTAL_ITERS:-12}
SEQ_PARALLEL=${SEQ_PARALLEL:-1}
CONTI_PARAMS=${CONTI_PARAMS:-0}        # fork flag; upstream Megatron has no such argument
TE_FP8=${TE_FP8:-0}
TE_FP8_RECIPE=${TE_FP8_RECIPE:-delayed}
TE_FP4=${TE_FP4:-0}
TE_FP4_RECIPE=${TE_FP4_RECIPE:-nvfp4}
FP4_PARAM_GATHER=${FP4_PARAM_GATHER:-0}
GEMM_TUNING=${GEMM_TUNING:-1}
MCORE=${MCORE:-1}
OPTIMIZER=${OPTIMIZER:-adam}
FSDP=${FSDP:-0}
RECOMPUTE=${RECOMPUTE:-0}
TOKENIZER_TYPE=${TOKENIZER_TYPE:-HuggingFaceTokenizer}
TOKENIZER_MODEL=${TOKENIZER_MODEL:-NousResearch/Meta-Llama-3-8B}
ROPE_FUSION=${ROPE_FUSION:-1}
LOG_INTERVAL=${LOG_INTERVAL:-1}
EVAL_INTERVAL=${EVAL_INTERVAL:-5000}
SAVE_INTERVAL=${SAVE_INTERVAL:-5000}
EVAL_ITERS=${EVAL_ITERS:--1}
CKPT_FORMAT=${CKPT_FORMAT:-torch}
DATA_CACHE_PATH=${DATA_CACHE_PATH:-/root/cache}
MEGATRON_FSDP=${MEGATRON_FSDP:-0}
FP8_PARAM_GATHER=${FP8_PARAM_GATHER:-0}
FP8_TRANSPOSE_CACHE=${FP8_TRANSPOSE_CACHE:-0}
ENABLE_HSDP=${ENABLE_HSDP:-0}
HSDP_NUM_REPLICAS=${HSDP_NUM_REPLICAS:-2}
SAVE_CKPT_PATH=${SAVE_CKPT_PATH:-}
LOAD_CKPT_PATH=${LOAD_CKPT_PATH:-}

on() {  # a script switch (not a toggle): 1 or 0, nothing else
  case "$2" in 1) return 0 ;; 0) return 1 ;; *) die "$1 must be 0 or 1, not '$2'" ;; esac
}

if [ -z "${GPUS_PER_NODE:-}" ]; then
  GPUS_PER_NODE=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
  [ "$GPUS_PER_NODE" -gt 0 ] 2>/dev/null || GPUS_PER_NODE=8
fi

case "$MODEL_SIZE" in
  8)  HIDDEN_SIZE=4096; FFN_HIDDEN_SIZE=14336; NUM_LAYERS=32; NUM_HEADS=32; NUM_KV_HEADS=8 ;;
  70) HIDDEN_SIZE=8192; FFN_HIDDEN_SIZE=28672; NUM_LAYERS=80; NUM_HEADS=64; NUM_KV_HEADS=8 ;;
  *) die "MODEL_SIZE must be 8 or 70, not '$MODEL_SIZE'" ;;
esac

if on TE_FP8 "$TE_FP8" && on TE_FP4 "$TE_FP4"; then die "TE_FP8=1 and TE_FP4=1: choose one precision"; fi
PRECISION_ARGS=()
if on TE_FP8 "$TE_FP8"; then
  case "$TE_FP8_RECIPE" in
    delayed) PRECISION_ARGS=(--fp8-recipe delayed --fp8-format hybrid --fp8-margin 0 --fp8-interval 1
                             --fp8-amax-history-len 1024 --fp8-amax-compute-algo max --attention-softmax-in-fp32) ;;
    tensorwise) PRECISION_ARGS=(--fp8-recipe tensorwise --fp8-format hybrid) ;;
    mxfp8) PRECISION_ARGS=(--fp8-recipe mxfp8 --fp8-format e4m3); export NVTE_ROCM_ENABLE_MXFP8=1 ;;
    *) die "TE_FP8_RECIPE must be delayed, tensorwise or mxfp8, not '$TE_FP8_RECIPE'" ;;
  esac
  if on FP8_PARAM_GATHER "$FP8_PARAM_GATHER"; then
    PRECISION_ARGS+=(--fp8-param-gather)
    # MXFP8 param all-gather through the DDP buffer needs the gradient buffer's storage.
    if [ "$TE_FP8_RECIPE" = mxfp8 ] && ! on FSDP "$FSDP" && ! on MEGATRON_FSDP "$MEGATRON_FSDP"; then
      PRECISION_ARGS+=(--reuse-grad-buf-for-mxfp8-param-ag)
    fi
  fi
  on FP8_TRANSPOSE_CACHE "$FP8_TRANSPOSE_CACHE" && PRECISION_ARGS+=(--keep-fp8-transpose-cache)
elif on TE_FP4 "$TE_FP4"; then
  case "$TE_FP4_RECIPE" in
    nvfp4|mxfp4) PRECISION_ARGS=(--fp4-format e2m1 --fp4-recipe "$TE_FP4_RECIPE") ;;
    *) die "TE_FP4_RECIPE must be nvfp4 or mxfp4, not '$TE_FP4_RECIPE'" ;;
  esac
  on FP4_PARAM_GATHER "$FP4_PARAM_GATHER" && PRECISION_ARGS+=(--fp4-param-gather)
fi
if on TE_FP4 "$TE_FP4"; then PREC_TAG=$TE_FP4_RECIPE
elif on TE_FP8 "$TE_FP8"; then
  case "$TE_FP8_RECIPE" in delayed) PREC_TAG=fp8 ;; tensorwise) PREC_TAG=fp8_tensorwise ;; *) PREC_TAG=$TE_FP8_RECIPE ;; esac
else PREC_TAG=bf16; fi

if on FSDP "$FSDP" || on MEGATRON_FSDP "$MEGATRON_FSDP"; then
  unset CUDA_DEVICE_MAX_CONNECTIONS
  if [ "$TP" -gt 1 ]; then echo "train_llama3.sh: FSDP with TP is not recommended: TP=1" >&2; TP=1; fi
  if on FSDP "$FSDP" && on SEQ_PARALLEL "$SEQ_PARALLEL"; then
    echo "train_llama3.sh: FSDP2 and sequence parallelism want different CUDA_DEVICE_MAX_CONNECTIONS: SEQ_PARALLEL=0" >&2
    SEQ_PARALLEL=0
  fi
fi
if on ENABLE_HSDP "$ENABLE_HSDP"; then
  on MEGATRON_FSDP "$MEGATRON_FSDP" || die "ENABLE_HSDP=1 needs MEGATRON_FSDP=1"
  [ "$HSDP_NUM_REPLICAS" -ge 2 ] 2>/dev/null || die "HSDP_NUM_REPLICAS must be 2 or more with ENABLE_HSDP=1"
fi

# Where logs go: the precision tag is a component of the default, so the plugin keeps it as is.
LOG_DIR=${LOG_DIR:-experiment/${NNODES}nodes_rank${NODE_RANK}_train_${MODEL_SIZE}B_mbs${MBS}_bs${BS}_tp${TP}_pp${PP}_cp${CP}_iter${TOTAL_ITERS}/${PREC_TAG}/${TIME_STAMP}}
TRAIN_LOG=$LOG_DIR/output_${EXP_NAME}.log

if on GEMM_TUNING "$GEMM_TUNING"; then
  export TE_HIPBLASLT_TUNING_RUN_COUNT=10 TE_HIPBLASLT_TUNING_ALGO_COUNT=50
fi

# Model and mixed-precision flags (GPT_ARGS) and distributed/training flags (EXTRA_ARGS): the
# buckets of the originating script. `megatron-perf-toggles flags --group gpt|extra` prints
# where each toggle's flag belongs, for scripts that pass them explicitly.
GPT_ARGS=(
  --tensor-model-parallel-size "$TP" --pipeline-model-parallel-size "$PP" --context-parallel-size "$CP"
  --num-layers "$NUM_LAYERS" --hidden-size "$HIDDEN_SIZE" --ffn-hidden-size "$FFN_HIDDEN_SIZE"
  --num-attention-heads "$NUM_HEADS" --seq-length "$SEQ_LENGTH" --max-position-embeddings 131072
  --untie-embeddings-and-output-weights --position-embedding-type rope --no-position-embedding
  --swiglu --no-bias-swiglu-fusion --disable-bias-linear --init-method-std 0.02
  --attention-dropout 0.0 --hidden-dropout 0.0 --normalization RMSNorm
  --micro-batch-size "$MBS" --global-batch-size "$BS" --train-iters "$TOTAL_ITERS"
  --bf16 --no-masked-softmax-fusion
)
on RECOMPUTE "$RECOMPUTE" && GPT_ARGS+=(--recompute-num-layers "$NUM_LAYERS" --recompute-granularity full --recompute-method block)
on ROPE_FUSION "$ROPE_FUSION" || GPT_ARGS+=(--no-rope-fusion)

TRAIN_ARGS=(--lr 1e-4 --min-lr 1e-5 --lr-decay-iters 320000 --lr-decay-style cosine --weight-decay 1.0e-1 --clip-grad 1.0)
case "$OPTIMIZER" in
  adam) TRAIN_ARGS+=(--optimizer adam --adam-beta1 0.9 --adam-beta2 0.95) ;;
  sgd) TRAIN_ARGS+=(--optimizer sgd) ;;
  *) die "OPTIMIZER must be adam or sgd, not '$OPTIMIZER'" ;;
esac

DATA_ARGS=(--tokenizer-type "$TOKENIZER_TYPE" --tokenizer-model "$TOKENIZER_MODEL" --dataloader-type cyclic
           --tensorboard-dir "$LOG_DIR" --num-workers "$([ "$SEQ_LENGTH" -le 8192 ] && echo 8 || echo 24)")
if [ -n "${DATA_PATH+set}" ]; then DATA_ARGS+=(--data-path $DATA_PATH); else DATA_ARGS+=(--mock-data); fi
[ "$NNODES" -gt 1 ] && DATA_ARGS+=(--data-cache-path "$DATA_CACHE_PATH")

OUTPUT_ARGS=(--log-interval "$LOG_INTERVAL" --log-throughput --no-save-optim --no-save-rng --eval-iters "$EVAL_ITERS"
             --eval-interval 320000 --save-interval 200000)
if [ -n "$SAVE_CKPT_PATH" ]; then
  OUTPUT_ARGS+=(--save-interval "$SAVE_INTERVAL" --eval-interval "$EVAL_INTERVAL" --ckpt-format "$CKPT_FORMAT" --save "$SAVE_CKPT_PATH")
fi
CKPT_LOAD_ARGS=()
if [ -n "$LOAD_CKPT_PATH" ]; then
  CKPT_LOAD_ARGS=(--exit-on-missing-checkpoint --no-load-optim --no-load-rng --use-checkpoint-args --load "$LOAD_CKPT_PATH")
fi

EXTRA_ARGS=(--group-query-attention --num-query-groups "$NUM_KV_HEADS" --distributed-backend nccl
            --distributed-timeout-minutes 120 --overlap-grad-reduce --rerun-mode disabled)
if on FSDP "$FSDP"; then
  EXTRA_ARGS+=(--use-torch-fsdp2)
elif [ "$OPTIMIZER" = adam ]; then
  EXTRA_ARGS+=(--use-distributed-optimizer --overlap-param-gather)
fi
on ENABLE_PROFILING "$ENABLE_PROFILING" && EXTRA_ARGS+=(--profile --use-pytorch-profiler)
if on USE_FLASH_ATTN "$USE_FLASH_ATTN"; then EXTRA_ARGS+=(--use-flash-attn); else EXTRA_ARGS+=(--attention-backend fused); fi
on SEQ_PARALLEL "$SEQ_PARALLEL" && EXTRA_ARGS+=(--sequence-parallel)
on CONTI_PARAMS "$CONTI_PARAMS" && EXTRA_ARGS+=(--use-contiguous-parameters-in-local-ddp)
on MCORE "$MCORE" && EXTRA_ARGS+=(--use-mcore-models)
if on TE_FP8 "$TE_FP8" || on TE_FP4 "$TE_FP4"; then EXTRA_ARGS+=(--transformer-impl transformer_engine); fi
EXTRA_ARGS+=("${PRECISION_ARGS[@]}")
if on MEGATRON_FSDP "$MEGATRON_FSDP"; then
  EXTRA_ARGS+=(--use-megatron-fsdp --ckpt-format fsdp_dtensor --data-parallel-sharding-strategy optim_grads_params
               --fsdp-double-buffer)
  on ENABLE_HSDP "$ENABLE_HSDP" && EXTRA_ARGS+=(--num-distributed-optimizer-instances "$HSDP_NUM_REPLICAS")
fi
LOGGING_ARGS=()
if [ -n "${WANDB_API_KEY:-}" ]; then
  LOGGING_ARGS=(--wandb-project LLama --wandb-exp-name "LLama_${MODEL_SIZE}B" --wandb-save-dir logs/wandb)
fi

# ${a[@]+"${a[@]}"}: an empty array under set -u on bash < 4.4 (macOS) is not an error.
MEGATRON_ARGS=("${GPT_ARGS[@]}" "${DATA_ARGS[@]}" "${OUTPUT_ARGS[@]}" "${EXTRA_ARGS[@]}" "${TRAIN_ARGS[@]}"
               ${LOGGING_ARGS[@]+"${LOGGING_ARGS[@]}"} ${CKPT_LOAD_ARGS[@]+"${CKPT_LOAD_ARGS[@]}"})
LAUNCH=(torchrun --nproc_per_node "$GPUS_PER_NODE" --nnodes "$NNODES" --node_rank "$NODE_RANK"
        --master_addr "$MASTER_ADDR" --master_port "$MASTER_PORT")
PLAN=()
# A misspelt DRY_RUN must never start a real launch: 0 or 1 only.
on DRY_RUN "${DRY_RUN:-0}" && DRY_RUN=1 || DRY_RUN=0
on PRINT_ONLY "${PRINT_ONLY:-0}" && PRINT_ONLY=1 || PRINT_ONLY=0
if [ "$DRY_RUN" = 1 ]; then
  LAUNCH=("$PYTHON")   # a dry run parses and validates once, on any machine, for the whole job
  PLAN=(--dry-run --nnodes "$NNODES" --nproc-per-node "$GPUS_PER_NODE" ${GPU:+--gpu "$GPU"})
fi
CMD=("${LAUNCH[@]}" -m megatron_perf_toggles.run ${PLAN[@]+"${PLAN[@]}"} "$MEGATRON_LM/pretrain_gpt.py" "${MEGATRON_ARGS[@]}")
export PYTHONPATH="$MEGATRON_LM${PYTHONPATH:+:$PYTHONPATH}"

if [ "$PRINT_ONLY" = 1 ]; then
  printf '%q ' "${CMD[@]}"; echo
  exit 0
fi
if [ "$DRY_RUN" = 1 ]; then
  exec "${CMD[@]}"
fi

mkdir -p "$LOG_DIR"
echo "$TRAIN_LOG"
TRAIN_RC=0
if ! on NO_TRAINING "$NO_TRAINING"; then
  if on TEE_OUTPUT "$TEE_OUTPUT"; then
    "${CMD[@]}" 2>&1 | tee "$TRAIN_LOG"
  else
    "${CMD[@]}" > "$TRAIN_LOG" 2>&1
  fi
  TRAIN_RC=$?
  [ "$TRAIN_RC" -ne 0 ] && echo "ERROR: training failed with exit code $TRAIN_RC" | tee -a "$TRAIN_LOG"
fi

# Means over the logged iterations, without the first two (warm-up) and the last one.
mean_of() {
  grep -Eo "$1 [^|]*" "$TRAIN_LOG" | grep -Eo '[0-9.]+ *$' |
    awk '{v[NR] = $1} END {s = 0; n = 0; for (i = 3; i < NR; i++) {s += v[i]; n++}; if (n) printf "%.6f", s / n; else printf "n/a"}'
}
if [ -f "$TRAIN_LOG" ]; then
  TFLOPS=$(mean_of 'throughput per GPU \(TFLOP/s/GPU\):')
  ITER_MS=$(mean_of 'elapsed time per iteration \(ms\):')
  echo "throughput per GPU: $TFLOPS" | tee -a "$TRAIN_LOG"
  echo "elapsed time per iteration: $ITER_MS" | tee -a "$TRAIN_LOG"
  if [ "$ITER_MS" != n/a ]; then
    awk -v bs="$BS" -v sl="$SEQ_LENGTH" -v ms="$ITER_MS" -v ws="$((GPUS_PER_NODE * NNODES))" \
      'BEGIN {printf "tokens/GPU/s: %.6f\n", bs * sl * 1000 / (ms * ws)}' | tee -a "$TRAIN_LOG"
  fi
fi
exit "$TRAIN_RC"
