#!/usr/bin/env bash
# Issue 11's re-check on one H200 in one GPU call (about 500 s): the GPU tests of the paths changed since
# the last measurement; FSDP2 over NCCL through calibration with its recomputed steps (distributed_h200.sh,
# 40 steps, exact resume); then `adahop bench --only step` at llama3_1b 8x2048 with BF16, adahop_lv2 and
# uniform IHT (every saved operand MXFP4): speed, the timed steps' memory and the whole run's
# (`run_peak_memory_ratio_vs_bf16`, which calibration set before it recomputed its activations).
# Everything lands in $OUT/step_recheck.tgz plus $OUT/step_recheck.log (the device tool returns at most 8 files).
# The three parts' limits (160 + 190 + 200 s, measured 120 + 166 + 147 s on 2026-12-04) keep the call under the
# device tool's 600 s, so the archive is always packed.
#
# Run from the repository root on the GPU machine, carrying .whl (torchao for the float8 peer, see
# benchmarks/torchtitan/torchtitan_h200.sh):   bash benchmarks/step/step_recheck_h200.sh
# Overrides: TESTS (the pytest files), RUNS (the bench's --step-runs), CASES (--step-cases).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/step_recheck_out}
WORK=/tmp/step_recheck
TESTS=${TESTS:-"tests/test_recompute.py tests/test_gpu_step.py tests/test_gpu_linear.py tests/test_ops.py"}
CASES=${CASES:-llama3_1b_8x2048}
RUNS=${RUNS:-bf16/compile,adahop_lv2/compile+graph,mxfp4_hadamard/compile+graph}
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/step_recheck.log") 2>&1
T0=$(date +%s)
say() { echo "== $(date -u +%T) (+$(( $(date +%s) - T0 ))s) $*"; }
export ADAHOP_COMMIT=${ADAHOP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
say "commit $ADAHOP_COMMIT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

if ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
else
  echo "no .whl/: the bench runs without the torchao peer"
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1

say "GPU tests: $TESTS"
# shellcheck disable=SC2086  # TESTS is a list of paths
timeout 160 bash benchmarks/gpu-tests/run_gpu_tests.sh "$WORK/gpu-tests.txt" $TESTS
tail -3 "$WORK/gpu-tests.txt"

say "FSDP2 over NCCL, 40 steps of the 125m through calibration (recomputed), resume at 20"
# three runs of about 35 s each plus start-up and the comparison: 130 s cut the comparison on 2026-12-04
OUT=$WORK/dist STEPS=40 ARGS=--training.deterministic=true timeout 190 bash benchmarks/distributed/distributed_h200.sh | tail -6

say "bench: $CASES, $RUNS"
timeout 200 python3 -m adahop.cli bench --only step --step-cases "$CASES" --step-runs "$RUNS" \
  --out "$WORK/bench" > "$WORK/bench.log" 2>&1
echo "bench exit status $?"
grep "tok/s" "$WORK/bench.log" | cut -c1-220
cat "$WORK/bench.md" 2>/dev/null | grep "^| llama3" || true

say "pack"
tar czf "$OUT/step_recheck.tgz" -C /tmp step_recheck
say "done"
