#!/usr/bin/env bash
# Issue 30: where each recipe's peak reserved memory comes from, phase by phase (benchmarks/step/memory_phases.py),
# one fresh process per recipe, on one H200. Run from the repository root on the GPU machine, carrying .whl
# (the torchao wheel, as step_bench_h200.sh). Writes $OUT/memory-<case>/memory-<recipe>.json and a log.
#
#   CASE=llama3_1b_8x2048 RECIPES="bf16 float8_tensorwise adahop_lv1_bf16_forward adahop_lv2" \
#     SNAPSHOT=adahop_lv2 bash benchmarks/step/memory_phases_h200.sh        # ~6 min
# A recipe written RECIPE+lazy-state runs with the optimizer state made by the first step (as before
# train.optim.allocate_state): the A/B of that fix, e.g. RECIPES="adahop_lv2 adahop_lv2+lazy-state".
#   DRY=1 OUT=/tmp/phases bash benchmarks/step/memory_phases_h200.sh          # the plumbing, on the CPU
set -uo pipefail
CASE=${CASE:-llama3_1b_8x2048}
RECIPES=${RECIPES:-bf16 float8_tensorwise adahop_lv1_bf16_forward adahop_lv2}
SNAPSHOT=${SNAPSHOT:-}  # the recipe whose capture step's allocator history is written (large: one recipe)
DRY=${DRY:-0}
OUT=${OUT:?set OUT}
if [ "$DRY" != 1 ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
dir=$OUT/memory-$CASE
mkdir -p "$dir"
for run in $RECIPES; do
  recipe=${run%+lazy-state}
  args=(--recipe "$recipe" --case "$CASE" --out "$dir")
  [ "$run" != "$recipe" ] && args+=(--lazy-optimizer-state)
  [ "$DRY" = 1 ] && args+=(--dry-run)
  [ "$run" = "$SNAPSHOT" ] && args+=(--snapshot)
  echo "== $(date -u +%T) $run"
  python3 benchmarks/step/memory_phases.py "${args[@]}" 2>&1 | tee -a "$dir/memory.log" | grep '"phase"' \
    || echo "$run failed (see $dir/memory.log)"
done
