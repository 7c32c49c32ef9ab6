#!/usr/bin/env bash
# The layer-level check on one GPU, on the shapes whose whole runs ablate measured (so the two can be
# set side by side), then the MoE sweep of router and permute fusion. Writes under OUT:
#   bash bench/layers_gpu.sh MEGATRON_TREE OUT [SWEEP_BUDGET_S]   (0: no sweep)
# TOGGLES=a,b (registry names) narrows the layer check to those toggles.
set -uo pipefail
tree=${1:?usage: layers_gpu.sh MEGATRON_TREE OUT [SWEEP_BUDGET_S]} out=${2:?OUT} budget=${3:-200}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 NO_VCS_VERSION=1  # else Megatron appends the enclosing checkout's git revision to its version
python3 -c "import torch; print(torch.__version__, torch.cuda.get_device_name(0))"
for shape in moe/speed-a ablate/one-at-a-time; do
  name=$(basename "$shape")
  only=(); [ -n "${TOGGLES:-}" ] && only=(--toggles "$TOGGLES")
  python3 -m megatron_perf_toggles layers --megatron "$tree" --ablate-results "docs/benchmarks/raw/$shape.json" \
    "${only[@]}" --out "$out/$name" 2>&1 | tee "$out/$name.log"
done
[ "$budget" = 0 ] && exit 0  # 0: the layer check alone
python3 bench/moe_sweep.py --megatron "$tree" --out "$out/sweep" --budget-s "$budget" 2>&1 | tee "$out/sweep.log"
