#!/usr/bin/env bash
# Issue 11 item 3: does `adahop train` log the tokens/s that `adahop bench --only step` measures?
# One GPU call: the bench's llama3_1b 4x2048 headline pair (bf16 compiled, adahop_lv2 compiled +
# CUDA graphs), then `adahop train` with the same model, batch and modes for STEPS steps, and a
# table of the trainer's logged tokens/s (median of the records after the plan froze and the
# first SKIP steps) against the bench's, each recipe and their ratio.
#
# Run from the repository root on the GPU machine, carrying .whl (the bench imports torchao when
# it can; nothing here needs it):   OUT=/some/dir bash benchmarks/step/trainer_vs_bench_h200.sh
# The trainer runs at the vocabulary the bench uses, the preset's (128,256 since 2026-12-05).
# Overrides: STEPS (60), SKIP (20), BATCH (4).
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/trainer_vs_bench_out}
STEPS=${STEPS:-60} SKIP=${SKIP:-20} BATCH=${BATCH:-4}
mkdir -p "$OUT"
exec > >(tee -a "$OUT/trainer_vs_bench.log") 2>&1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 ADAHOP_CACHE=${ADAHOP_CACHE:-/tmp/adahop_cache}
T0=$(date +%s)
say() { echo "== $(date -u +%T) (+$(( $(date +%s) - T0 ))s) $*"; }
say "commit ${ADAHOP_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}; llama3_1b ${BATCH}x2048, $STEPS steps"

say "bench"
python3 -m adahop.cli bench --only step --step-cases "llama3_1b_${BATCH}x2048" \
  --step-runs bf16/compile,adahop_lv2/compile+graph --out "$OUT/bench" > "$OUT/bench_stdout.log" 2>&1
echo "bench exit status $?"

train() {  # recipe, then extra arguments
  local recipe=$1; shift
  say "train $recipe $*"
  python3 -m adahop.cli train --model llama3_1b --recipe "$recipe" --out "/tmp/tvb-$recipe" \
    --data.seq_len=2048 --data.batch_size="$BATCH" --data.vocab_size=128256 --training.steps="$STEPS" \
    --training.grad_accum=1 --training.device=cuda --training.compile=true \
    --checkpoint.interval=1000000 --logging.log_every=5 --logging.val_every=1000000 --logging.val_batches=1 \
    "$@" > "$OUT/train-$recipe.log" 2>&1
  echo "train $recipe exit status $?"
  cp "/tmp/tvb-$recipe/metrics.jsonl" "$OUT/metrics-$recipe.jsonl" 2>/dev/null
}
train bf16 --training.cuda_graph=false
train adahop_lv2 --training.cuda_graph=true

say "summary"
OUT=$OUT SKIP=$SKIP BATCH=$BATCH python3 - <<'PY' | tee "$OUT/summary.md"
import json, os, statistics
out, skip, batch = os.environ["OUT"], int(os.environ["SKIP"]), int(os.environ["BATCH"])
case = f"llama3_1b_{batch}x2048"
try:
    report = json.load(open(f"{out}/bench.json"))
    bench = report.get("step", report)["cases"][case]["runs"]
except (OSError, KeyError, ValueError) as e:
    bench = {}
    print(f"bench result missing ({e!r})")
rows, memory, trained = [], [], {}
nan = float("nan")
for recipe, mode in (("bf16", "compile"), ("adahop_lv2", "compile+graph")):
    try:
        records = [json.loads(line) for line in open(f"{out}/metrics-{recipe}.jsonl")]
    except OSError:
        records = []
    frozen = [r for r in records if r["kind"] == "train" and r["step"] > skip and r.get("phase") == "frozen"]
    trained[recipe] = statistics.median(r["tokens_per_s"] for r in frozen) if frozen else nan
    b = bench.get(f"{recipe}/{mode}", {})
    benched = b.get("tokens_per_s", nan)
    rows.append(f"| {recipe} / {mode} | {benched:,.0f} | {trained[recipe]:,.0f} ({len(frozen)} records) | {trained[recipe] / benched:.3f} |")
    # GiB: the trainer's reserved peaks of its frozen records (each since the one before) and of the whole run
    steady = statistics.median(r.get("memory_reserved_mib", nan) for r in frozen) / 1024 if frozen else nan
    run_peak = max((r.get("run_peak_reserved_mib", r.get("memory_reserved_mib", nan)) for r in records), default=nan) / 1024
    memory.append(f"| {recipe} / {mode} | {b.get('peak_reserved_gib', nan):.1f} / {b.get('run_peak_reserved_gib', nan):.1f} | {steady:.1f} / {run_peak:.1f} |")
print(f"| run ({case}) | bench tok/s | trainer tok/s (median after step {skip}) | trainer / bench |")
print("|---|---|---|---|")
print("\n".join(rows))
print("\n| run | bench reserved GiB: timed steps / whole run | trainer reserved GiB: frozen records' median / whole run |")
print("|---|---|---|")
print("\n".join(memory))
b = bench.get("bf16/compile", {}).get("tokens_per_s", float("nan"))
a = bench.get("adahop_lv2/compile+graph", {}).get("tokens_per_s", float("nan"))
print(f"\nadahop_lv2 / bf16: bench {a / b:.3f}, trainer {trained['adahop_lv2'] / trained['bf16']:.3f}")
PY
say "done"
