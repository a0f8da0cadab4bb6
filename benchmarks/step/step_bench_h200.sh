#!/usr/bin/env bash
# Issue 30's step bench on one H200 in one GPU call (<= 600 s): optionally the GPU tests first, then
# `adahop bench --only step` on one case, every recipe of RECIPES in its fastest mode (compile + CUDA
# graphs, else compile; a mode that fails stays in the table), with the preparation roofline of every
# adahop run. The commands of the committed runs: each result folder's README.md.
#
# Run from the repository root on the GPU machine, carrying .whl (the torchao wheel for the float8 peers;
# without it their rows say "torchao is not installed"):
#   CASE=llama3_1b_8x2048 RECIPES="bf16 float8_tensorwise adahop_lv2" bash benchmarks/step/step_bench_h200.sh
# DRY=1 runs it on the CPU (`adahop bench --dry-run`: a 2-layer model, a few steps; nothing is measured):
#   DRY=1 OUT=/tmp/step_dry bash benchmarks/step/step_bench_h200.sh
#
# Environment (defaults in brackets):
#   CASE [llama3_1b_8x2048; DRY: tiny_2x32]   one step case (adahop bench --step-cases)
#   RECIPES [bf16 float8_tensorwise float8_rowwise adahop_lv2 adahop_lv1_bf16_forward adahop_lv1_fp8_forward]
#            recipe names; a name this checkout does not register is skipped with a line saying so
#   MODE [fastest]   the mode of every recipe (eager, compile, graph, compile+graph, fastest), or several,
#                    comma-separated, each run for every recipe (the bench ranks them: e.g. "compile,compile+graph")
#   EXTRA_RUNS [""]  more runs after those, RECIPE/MODE comma-separated; a mode ending in -w-each quantizes W
#                    on every micro-batch (training.weight_operands_once_per_step=false), e.g.
#                    "adahop_lv2/fastest-w-each": the A/B of W quantized once per optimizer step; one ending
#                    in -recompute makes wgrad's operands in backward in compiled blocks
#                    (training.recompute_wgrad_operands=true), e.g. "adahop_lv2/fastest-recompute"
#   TESTS [""]       pytest arguments run first through benchmarks/gpu-tests/run_gpu_tests.sh (e.g.
#                    "tests/test_gpu_step.py tests/test_gpu_linear.py"), stopped after TESTS_LIMIT [240] s
#   LIMIT [585]      seconds from the start by which everything is done (the call has 600)
#   ADAHOP_COMMIT [git rev-parse HEAD]   the commit the logs name: pass it on the GPU machine, whose copy of the
#                    checkout once carried stale git metadata (2026-12-05-h200-compiled-loss/)
#
# Output ($OUT, at most 6 files): step_bench.log (this log), gpu-tests.txt, bench.json, bench.md,
# bench.log (the bench's own output) and, when the bench was cut short, bench.partial.json.
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=${DRY:-0}
OUT=${OUT:-/tmp/step_bench_out}
MODE=${MODE:-fastest}
TESTS=${TESTS:-}
TESTS_LIMIT=${TESTS_LIMIT:-240}
LIMIT=${LIMIT:-585}
RECIPES=${RECIPES:-"bf16 float8_tensorwise float8_rowwise adahop_lv2 adahop_lv1_bf16_forward adahop_lv1_fp8_forward"}
if [ "$DRY" = 1 ]; then
  CASE=${CASE:-tiny_2x32}
  DRY_ARG=(--dry-run)
else
  CASE=${CASE:-llama3_1b_8x2048}
  DRY_ARG=()
fi
WORK=/tmp/step_bench_$$
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/step_bench.log") 2>&1
T0=$(date +%s)
say() { echo "== $(date -u +%T) (+$(( $(date +%s) - T0 ))s) $*"; }
export ADAHOP_COMMIT=${ADAHOP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
say "commit $ADAHOP_COMMIT; case $CASE; recipes [$RECIPES]; mode $MODE; extra runs [${EXTRA_RUNS:-none}]; tests [${TESTS:-none}]; dry $DRY"
command -v nvidia-smi > /dev/null && nvidia-smi --query-gpu=name,driver_version --format=csv,noheader

if [ "$DRY" != 1 ] && ls .whl/*.whl > /dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
elif [ "$DRY" != 1 ]; then
  echo "no .whl/: the float8 peers report that torchao is not installed"
fi
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 ADAHOP_CACHE=$WORK/cache

# The recipes this checkout registers (the FP8-forward recipe may be named otherwise, or not be there yet).
RUNS=$(python3 - "$MODE" $RECIPES <<'PY'
import sys
from adahop.bench.step import RECIPES
mode, names = sys.argv[1], sys.argv[2:]
for name in names:
    if name not in RECIPES:
        print(f"skipped: {name} is not a recipe of this checkout (known: {', '.join(RECIPES)})", file=sys.stderr)
print(",".join(f"{n}/{m}" for n in names if n in RECIPES for m in mode.split(",")))
PY
)
[ -n "$RUNS" ] || { say "FAILED: none of [$RECIPES] is a recipe of this checkout"; exit 1; }
[ -n "${EXTRA_RUNS:-}" ] && RUNS="$RUNS,$EXTRA_RUNS"

if [ -n "$TESTS" ]; then
  say "GPU tests: $TESTS (limit ${TESTS_LIMIT}s)"
  # shellcheck disable=SC2086  # TESTS is a list of pytest arguments
  timeout "$TESTS_LIMIT" bash benchmarks/gpu-tests/run_gpu_tests.sh "$OUT/gpu-tests.txt" $TESTS
  echo "tests exit status $? (124: cut by the limit)"
  grep -E "^(PASSED|FAILED|ERROR)|passed|failed" "$OUT/gpu-tests.txt" | tail -3
fi

left=$(( LIMIT - ($(date +%s) - T0) - 10 ))
say "bench: $CASE, $RUNS (limit ${left}s)"
timeout -k 10 "$left" python3 -m adahop bench --only step "${DRY_ARG[@]}" --step-cases "$CASE" --step-runs "$RUNS" \
  --out "$WORK/bench" > "$OUT/bench.log" 2>&1
status=$?
echo "bench exit status $status (124: cut by the limit; bench.partial.json holds the runs that ended)"
grep -E "^  $CASE " "$OUT/bench.log" | cut -c1-240  # one line per run as it ended
for f in bench.json bench.md; do [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/"; done
[ "$status" != 0 ] && [ -f "$WORK/bench.partial.json" ] && cp "$WORK/bench.partial.json" "$OUT/"
[ -f "$OUT/bench.md" ] && sed -n '/^Training steps/,$p' "$OUT/bench.md"
rm -rf "$WORK"
say "done"
[ "$status" = 0 ]
