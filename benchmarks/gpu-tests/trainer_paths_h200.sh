#!/usr/bin/env bash
# The trainer's stop, checkpoint, resume and calibration paths on one GPU, as a user meets them
# (issues 33 and 34 changed them; the CPU suite pins training.device=cpu). One GPU call, about 3 minutes:
#   1. an uninterrupted run: `small`, compile from step 0 through calibration (30 steps) and after the freeze,
#      CUDA graphs, strict determinism, a checkpoint every 20 steps;
#   2. the same run SIGTERMed after its step 40 record: it must exit 143 after a checkpoint, with one line;
#   3. `--resume` of run 2 to the end: exit 0; its last train and val losses against run 1's;
#   4. `adahop export --hf` of run 1 (held-out loss of the model as trained and of the plain model).
# Usage (repository root, GPU machine): OUT=/tmp/paths bash benchmarks/gpu-tests/trainer_paths_h200.sh
# Output: $OUT/trainer_paths.log (every command, its exit status and its last lines) and $OUT/summary.txt.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/trainer_paths}
RECIPE=${RECIPE:-adahop_lv1_fp8_forward}
STEPS=${STEPS:-80}
MODEL=${MODEL:-small}
DEVICE=${DEVICE:-cuda}  # DEVICE=cpu MODEL=tiny RECIPE=bf16 checks the script itself
W=/tmp/trainer_paths_$$
mkdir -p "$OUT" "$W"
exec > >(tee -a "$OUT/trainer_paths.log") 2>&1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 ADAHOP_CACHE=$W/cache
T0=$(date +%s)
say() { echo "== $(date -u +%T) (+$(( $(date +%s) - T0 ))s) $*"; }
say "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown); recipe $RECIPE; $STEPS steps"
ARGS=(--model "$MODEL" --recipe "$RECIPE" --steps "$STEPS" --training.device="$DEVICE" --training.compile=true
      --training.cuda_graph=true --training.deterministic=true --checkpoint.interval=20 --logging.log_every=5
      --logging.val_every=40)

say "1. uninterrupted run"
python3 -m adahop train "${ARGS[@]}" --out "$W/full" > "$W/full.log" 2>&1
echo "exit status $? (want 0)"; tail -5 "$W/full.log"

say "2. the same run, SIGTERM after its step-40 record"
python3 -m adahop train "${ARGS[@]}" --out "$W/cut" > "$W/cut.log" 2>&1 &
pid=$!
for _ in $(seq 600); do
  grep -q '"kind": "train", "step": 40' "$W/cut/metrics.jsonl" 2>/dev/null && break
  kill -0 $pid 2>/dev/null || break
  sleep 0.2
done
kill -TERM $pid; wait $pid; cut_status=$?
echo "exit status $cut_status (want 143)"; tail -3 "$W/cut.log"; ls "$W/cut/checkpoints"

say "3. resume to the end"
python3 -m adahop train "${ARGS[@]}" --out "$W/cut" --resume > "$W/resume.log" 2>&1
echo "exit status $? (want 0)"; tail -5 "$W/resume.log"

say "4. export to Hugging Face"
python3 -m adahop export "$W/full" --hf "$W/hf" 2>&1 | tail -4
ls "$W/hf"

python3 - "$W/full/metrics.jsonl" "$W/cut/metrics.jsonl" "$cut_status" <<'PY' | tee "$OUT/summary.txt"
import json, sys
def last(path, kind):
    rows = [json.loads(line) for line in open(path)]
    rows = [r for r in rows if r.get("kind") == kind]
    return rows[-1] if rows else {}
full, cut = sys.argv[1], sys.argv[2]
print(f"SIGTERM exit status: {sys.argv[3]} (want 143)")
for kind in ("train", "val"):
    a, b = last(full, kind), last(cut, kind)
    same = a.get("step") == b.get("step") and a.get("loss") == b.get("loss")
    print(f"last {kind}: uninterrupted step {a.get('step')} loss {a.get('loss')}; "
          f"SIGTERM + resume step {b.get('step')} loss {b.get('loss')}; identical: {same}")
phases = [json.loads(line).get("phase") for line in open(full) if '"kind": "train"' in line]
print("phases of the uninterrupted run:", " ".join(p or "-" for p in phases))
PY
rm -rf "$W"
say "done"
