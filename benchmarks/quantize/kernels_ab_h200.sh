#!/usr/bin/env bash
# Issue 30's quantize-kernel levers on one H200 in one GPU call (<= 600 s): the GPU kernel tests (bit for bit at
# full size), then `quantize_kernels.py` on a baseline tree and on this one, A B B A. (Its 2026-12-05 run also ran
# the tensor-core Hadamard and epilogue prototypes; their stages left with their code after 471db8e.)
#
# The baseline is the code the 2026-12-05 step bench measured (8e927ec): the A/B then times every kernel lever
# built on the CPU since (column-wise quantizer, split fold, 8-bit SR noise) at the step's shapes. Before the call,
# on the CPU machine (`.baseline/` is git-ignored and travels with `carry`):
#   rm -rf .baseline && mkdir -p .baseline && git archive 8e927ec src | tar -x -C .baseline
#   run(command="bash benchmarks/quantize/kernels_ab_h200.sh", carry=[".baseline"], timeout_s=600)
# DRY=1 prints what the GPU call would run.
#
# Environment: OUT [/tmp/kernels_ab_out], BASELINE_SRC [.baseline/src], TESTS_LIMIT [180] s for the tests,
# AB_LIMIT [45] s per quantize_kernels.py run.
# Output ($OUT): kernels_ab.log, gpu-tests.txt, kernels_runs.txt (the four quantize_kernels.py outputs, each under
# a header), kernels_ab.md (the table: microseconds per call, both runs, current / baseline).
set -uo pipefail
cd "$(dirname "$0")/../.."
DRY=${DRY:-0}
OUT=${OUT:-/tmp/kernels_ab_out}
BASELINE_SRC=${BASELINE_SRC:-.baseline/src}
TESTS_LIMIT=${TESTS_LIMIT:-180}
AB_LIMIT=${AB_LIMIT:-45}
WORK=/tmp/kernels_ab_$$  # the per-run outputs; $OUT gets them joined in one file
mkdir -p "$OUT" "$WORK"
exec > >(tee -a "$OUT/kernels_ab.log") 2>&1
T0=$(date +%s)
say() { echo "== $(date -u +%T) (+$(( $(date +%s) - T0 ))s) $*"; }
export ADAHOP_COMMIT=${ADAHOP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
say "commit $ADAHOP_COMMIT; baseline $BASELINE_SRC; dry $DRY"

if [ "$DRY" = 1 ]; then
  [ -d "$BASELINE_SRC/adahop" ] || echo "no $BASELINE_SRC/adahop: make it before the GPU call (see the header)"
  say "would run: run_gpu_tests.sh (kernel tests), quantize_kernels.py A B B A"
  exit 0
fi
if [ ! -d "$BASELINE_SRC/adahop" ]; then
  echo "no $BASELINE_SRC/adahop: make it on the CPU machine and carry .baseline (see this script's header)"
  exit 2
fi

say "GPU kernel tests (stopped after ${TESTS_LIMIT}s)"
timeout "$TESTS_LIMIT" bash benchmarks/gpu-tests/run_gpu_tests.sh "$OUT/gpu-tests.txt" \
  tests/test_kernel_quantize_fold.py tests/test_kernel_scores.py tests/test_kernels_compile.py tests/test_kernel_quantize.py
tail -n 3 "$OUT/gpu-tests.txt"

for run in baseline:1 current:1 current:2 baseline:2; do  # A B B A
  tree=${run%:*} n=${run#*:}
  src=$PWD/src
  [ "$tree" = baseline ] && src=$(cd "$BASELINE_SRC" && pwd)
  say "quantize_kernels.py on $tree ($src)"
  PYTHONPATH=$src timeout "$AB_LIMIT" python benchmarks/quantize/quantize_kernels.py > "$WORK/kernels-$tree-$n.txt" 2>&1
  cat "$WORK/kernels-$tree-$n.txt"
  { echo "## kernels-$tree-$n ($src)"; cat "$WORK/kernels-$tree-$n.txt"; echo; } >> "$OUT/kernels_runs.txt"
done
python - "$OUT" "$WORK" <<'PY'
import pathlib, re, statistics, sys
out, work = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
def read(name):
    p = work / name
    rows = {}
    for line in (p.read_text().splitlines() if p.exists() else []):
        m = re.match(r"(.+?)\s+([0-9.]+) us$", line)
        if m:
            rows[m.group(1).strip()] = float(m.group(2))
    return rows
runs = {t: [read(f"kernels-{t}-{i}.txt") for i in (1, 2)] for t in ("baseline", "current")}
def times(tree, case):
    return [r[case] for r in runs[tree] if case in r]
every = sorted({c for rs in runs.values() for r in rs for c in r})
lines = ["| case | baseline us (runs) | current us (runs) | current / baseline (medians) |", "|---|---:|---:|---:|"]
for c in every:
    b, k = times("baseline", c), times("current", c)
    ratio = f"{statistics.median(k) / statistics.median(b):.3f}" if b and k else "n/a"
    lines.append(f"| {c} | {', '.join(f'{t:.1f}' for t in b)} | {', '.join(f'{t:.1f}' for t in k)} | {ratio} |")
lines.append("\nA case with one run in a column lost the other (failed or cut: kernels_ab.log).")
(out / "kernels_ab.md").write_text("\n".join(lines) + "\n")
print("\n".join(lines))
PY

say "done"
