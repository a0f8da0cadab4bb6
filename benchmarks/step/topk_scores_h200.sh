#!/usr/bin/env bash
# Issue 11 lever "outlier selection", one GPU call: outlier-extraction row scores recorded by the
# quantize kernels (this tree, A) against a baseline tree that scores with a separate pass (B).
#   1. the GPU tests of what changed (scores at full size, selection, ops, the layer, CUDA graphs),
#      with names and durations: gpu-tests.txt;
#   2. `adahop bench --only step` on llama3_1b 4x2048, bf16 and adahop_lv2 under compile + CUDA
#      graphs, alternately on A and on B (A B B A A B ..., each bench its own processes, each run a
#      fresh one), as many as fit before LIMIT: bench-N-SIDE.{json,md,log};
#   3. summary.md / summary.json: per bench tokens/s, lv2/bf16, CUDA ms and the kernel families
#      that OE touches; per side the medians; A against B.
#
# Once, where the repository is (not the GPU machine), make the baseline's source folder
# (git-ignored), e.g. from the commit this branch started from:
#     rm -rf .baseline && mkdir .baseline && git archive 9422663 src | tar -x -C .baseline
# Then one GPU call from the repository root, carry [".baseline"]:
#     BASELINE_SRC=.baseline/src BASELINE_COMMIT=9422663 bash benchmarks/step/topk_scores_h200.sh
# ($OUT is set by the device tool; elsewhere it defaults to /tmp/topk_scores_out.)
#
# Environment (defaults in brackets): BASELINE_SRC (required), BASELINE_COMMIT [unknown],
#   ADAHOP_COMMIT [git HEAD, or unknown], LIMIT [530] seconds from the start by which every bench
#   must have ended, TESTS_LIMIT [150] seconds for the GPU tests, BENCH_GUESS [120] seconds a
#   bench is assumed to take until one has been timed (a bench is started only when the longest
#   so far fits before LIMIT; one still running at LIMIT is stopped, its finished runs kept in
#   bench-N-SIDE.partial.json),
#   DRY [0] 1: on the CPU, the same steps with CPU tests and a stand-in for the bench (it imports
#   adahop from the side's tree, prints which, and writes a bench report of made-up numbers), so
#   the tree switching, the timing and the summary run:  DRY=1 BASELINE_SRC=... bash benchmarks/step/topk_scores_h200.sh
# Exit status 0 when the tests passed and each side has at least one bench.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/topk_scores_out}
DRY=${DRY:-0}
LIMIT=${LIMIT:-530}
TESTS_LIMIT=${TESTS_LIMIT:-150}
BENCH_GUESS=${BENCH_GUESS:-120}
A_SRC=$PWD/src
B_SRC=$(cd "${BASELINE_SRC:?set BASELINE_SRC to the baseline tree\'s src folder}" && pwd) || exit 2
A_COMMIT=${ADAHOP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
B_COMMIT=${BASELINE_COMMIT:-unknown}
CASE=llama3_1b_4x2048
RUNS=bf16/compile+graph,adahop_lv2/compile+graph
mkdir -p "$OUT"
exec > >(tee -a "$OUT/topk_scores.log") 2>&1
export PYTHONUNBUFFERED=1 ADAHOP_CACHE=${ADAHOP_CACHE:-/tmp/adahop_cache}
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
say() { echo "== $(date -u +%T) (+$(elapsed)s) $*"; }
say "A = this tree ($A_COMMIT, $A_SRC); B = baseline ($B_COMMIT, $B_SRC); DRY=$DRY LIMIT=${LIMIT}s"

say "GPU tests"
if [ "$DRY" = 1 ]; then
  TESTS=(tests/test_select.py tests/test_kernel_scores.py -k "not layer")
else
  TESTS=(tests/test_kernel_scores.py tests/test_select.py tests/test_ops.py tests/test_gpu_linear.py
         tests/test_gpu_step.py tests/test_kernel_quantize_fold.py)
fi
ADAHOP_COMMIT=$A_COMMIT timeout "$TESTS_LIMIT" bash benchmarks/gpu-tests/run_gpu_tests.sh "$OUT/gpu-tests.txt" \
  --durations=15 "${TESTS[@]}"
tests_status=$?
echo "tests exit status $tests_status (124: stopped at ${TESTS_LIMIT}s)"; tail -n 3 "$OUT/gpu-tests.txt"

bench() {  # N SIDE SRC SECONDS: one bench of the two runs on the tree SRC, stopped after SECONDS
  local name="bench-$1-$2"
  if [ "$DRY" = 1 ]; then
    PYTHONPATH=$3 NAME="$OUT/$name" SIDE=$2 timeout "$4" python3 - <<'PY'
import json, os, adahop
side, name = os.environ["SIDE"], os.environ["NAME"]
print(f"stand-in bench: adahop from {os.path.dirname(adahop.__file__)}")
def run(tok, cuda, topk):
    fams = {"GEMM": 39.7, "quantize (Triton)": 23.5, "top-k / index": topk, "norm / reduce": 2.6}
    kernels = [{"name": "_top_rows_kernel", "ms": 2.4, "calls": 102},
               {"name": "triton_red_fused_linalg_vector_norm_mul_silu_5", "ms": 0.7, "calls": 4}]
    return {"tokens_per_s": tok, "step_ms": 8192e3 / tok, "profile": {"cuda_ms": cuda, "families_ms": fams, "top_kernels": kernels}}
lv2 = run(70500, 108.3, 0.9) if side == "A" else run(69900, 109.6, 0.9)
runs = {"bf16/compile+graph": run(69250, 109.8, 0.0), "adahop_lv2/compile+graph": lv2}
json.dump({"step": {"cases": {"llama3_1b_4x2048": {"runs": runs}}}, "adahop": adahop.__file__}, open(name + ".json", "w"))
PY
  else
    PYTHONPATH=$3 timeout "$4" python3 -m adahop.cli bench --only step --step-cases "$CASE" --step-runs "$RUNS" \
      --out "$OUT/$name" > "$OUT/$name.log" 2>&1
  fi
  local status=$?
  echo "$name exit status $status (124: stopped at its limit)"
  [ "$DRY" = 1 ] || grep -E "^  $CASE " "$OUT/$name.log"
}

n=0 longest=$BENCH_GUESS
for side in A B B A A B B A A B; do
  left=$(( LIMIT - $(elapsed) ))
  if [ "$longest" -gt "$left" ]; then
    say "no time for another bench (${left}s left, the longest takes ${longest}s)"
    break
  fi
  n=$((n + 1))
  src=$A_SRC; [ "$side" = B ] && src=$B_SRC
  say "bench $n on $side"
  start=$(date +%s)
  PYTHONPATH=$src python3 -c "import adahop; print('adahop from', adahop.__file__)"
  bench "$n" "$side" "$src" "$left"
  took=$(( $(date +%s) - start ))
  if [ "$n" = 1 ] || [ "$took" -gt "$longest" ]; then longest=$took; fi
done

say "summary"
OUT=$OUT CASE=$CASE A_COMMIT=$A_COMMIT B_COMMIT=$B_COMMIT python3 - <<'PY' | tee "$OUT/summary.md"
import glob, json, os, re, statistics
out, case = os.environ["OUT"], os.environ["CASE"]
LV2, BF16 = "adahop_lv2/compile+graph", "bf16/compile+graph"
FAMILIES = ("quantize (Triton)", "top-k / index", "norm / reduce", "elementwise")

def load(path):
    """A bench report, or its partial file when the bench was stopped: the runs of CASE."""
    for p in (path, path.replace(".json", ".partial.json")):
        try:
            report = json.load(open(p))
        except (OSError, ValueError):
            continue
        step = report.get("step", report)
        runs = step.get("cases", {}).get(case, {}).get("runs") or step.get("partial", {}).get(case)
        if runs:
            return runs
    return {}

def figures(runs):
    lv2, bf16 = runs.get(LV2, {}), runs.get(BF16, {})
    if "tokens_per_s" not in lv2:
        return None
    prof = lv2["profile"]
    kernels = prof.get("top_kernels", [])
    row = {
        "lv2_tok_s": lv2["tokens_per_s"],
        "bf16_tok_s": bf16.get("tokens_per_s", float("nan")),
        "lv2_cuda_ms": prof["cuda_ms"],
        "top_rows_ms": sum(k["ms"] for k in kernels if k["name"] == "_top_rows_kernel"),
        "vector_norm_ms": sum(k["ms"] for k in kernels if "vector_norm" in k["name"]),
    }
    row["lv2_vs_bf16"] = row["lv2_tok_s"] / row["bf16_tok_s"]
    row |= {f: prof["families_ms"].get(f, 0.0) for f in FAMILIES}
    return row

benches = []
for path in sorted(glob.glob(f"{out}/bench-*-[AB].json") + glob.glob(f"{out}/bench-*-[AB].partial.json")):
    n, side = re.search(r"bench-(\d+)-([AB])", path).groups()
    if any(b["n"] == int(n) for b in benches):
        continue
    row = figures(load(path.replace(".partial", "")))
    if row:
        benches.append({"n": int(n), "side": side} | row)
benches.sort(key=lambda b: b["n"])
cols = ["lv2_tok_s", "bf16_tok_s", "lv2_vs_bf16", "lv2_cuda_ms", *FAMILIES, "top_rows_ms", "vector_norm_ms"]
fmt = lambda v: f"{v:,.0f}" if v > 1000 else f"{v:.3f}" if v < 10 and v == v else f"{v:.2f}"
print(f"# OE scores from the quantize pass: A = {os.environ['A_COMMIT']} against B = {os.environ['B_COMMIT']}, {case}\n")
print("| bench | side | " + " | ".join(cols) + " |")
print("|---" * (len(cols) + 2) + "|")
for b in benches:
    print(f"| {b['n']} | {b['side']} | " + " | ".join(fmt(b[c]) for c in cols) + " |")
median = {s: {c: statistics.median(b[c] for b in benches if b["side"] == s) for c in cols}
          for s in "AB" if any(b["side"] == s for b in benches)}
print("\nMedians per side (top_rows and vector_norm: only kernels among a run's 40 largest):\n")
print("| side | " + " | ".join(cols) + " |")
print("|---" * (len(cols) + 1) + "|")
for s, m in median.items():
    print(f"| {s} | " + " | ".join(fmt(m[c]) for c in cols) + " |")
result = {"benches": benches, "median": median}
if len(median) == 2:
    a, b = median["A"], median["B"]
    result |= {
        "lv2_tok_s_A_over_B": a["lv2_tok_s"] / b["lv2_tok_s"],
        "lv2_vs_bf16_A_over_B": a["lv2_vs_bf16"] / b["lv2_vs_bf16"],
        "lv2_cuda_ms_A_minus_B": a["lv2_cuda_ms"] - b["lv2_cuda_ms"],
    }
    print(f"\nA/B: adahop_lv2 tokens/s {result['lv2_tok_s_A_over_B']:.4f}, lv2/bf16 "
          f"{result['lv2_vs_bf16_A_over_B']:.4f}, lv2 CUDA ms {result['lv2_cuda_ms_A_minus_B']:+.2f} "
          f"({len(benches)} benches)")
else:
    print("\nA/B: not both sides measured")
json.dump(result, open(f"{out}/summary.json", "w"), indent=1)
PY
sides=$(ls "$OUT"/bench-*-A.*json "$OUT"/bench-*-B.*json 2>/dev/null | sed -E 's/.*bench-[0-9]+-([AB]).*/\1/' | sort -u | tr -d '\n')
say "done (tests $tests_status, benched sides: ${sides:-none})"
[ "$tests_status" = 0 ] && [ "$sides" = AB ]
