#!/usr/bin/env bash
# torchtitan 0.2.2's own trainer (torchrun, 1 GPU, NCCL) on its llama3 debug model with adahop's
# model converter: ~300 steps with checkpoints, then a resume from the last one for 100 more.
# The log in $OUT shows the losses, the frozen plan (torchtitan's log + adahop_plan.json), the plan
# inside the DCP checkpoints (read back with no model built) and that the resumed run's layers
# came back frozen and did not calibrate again.
#
# Run from the repository root on the GPU machine, carrying .whl (wheels and titan-assets):
#     OUT=/some/dir bash benchmarks/torchtitan/torchtitan_h200.sh
# Needs in .whl/: torchtitan-0.2.2, tyro, docstring_parser, typeguard, shtab, typing_extensions,
# torchdata, tomli wheels; titan-assets/tokenizer/ (torchtitan v0.2.2 tests/assets/tokenizer) and
# titan-assets/english-docs-1k.jsonl.gz (1000 documents of ../shared/data/english-docs.jsonl.gz).
# Overrides: STEPS (300), MORE (100), INTERVAL (100), SEQ (2048), BATCH (8), RECIPE (adahop_lv2);
# TITAN_MAIN (default: -m torchtitan.train) runs another entry point: the CPU dry run is
#     OUT=/tmp/o STEPS=40 MORE=10 INTERVAL=20 SEQ=128 BATCH=2 \
#       TITAN_MAIN=benchmarks/torchtitan/cpu_dry_run.py bash benchmarks/torchtitan/torchtitan_h200.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/torchtitan_h200_out}
mkdir -p "$OUT"
STEPS=${STEPS:-300} MORE=${MORE:-100} INTERVAL=${INTERVAL:-100} SEQ=${SEQ:-2048} BATCH=${BATCH:-8}
RECIPE=${RECIPE:-adahop_lv2}
read -r -a MAIN <<< "${TITAN_MAIN:--m torchtitan.train}"
WORK=/tmp/adahop_titan_$$
SITE=/tmp/site
LOG=$OUT/torchtitan_h200.log
mkdir -p "$WORK"
exec > >(tee -a "$LOG") 2>&1
T0=$(date +%s)
say() { echo "== $(date -u +%T) (+$(( $(date +%s) - T0 ))s) $*"; }

say "commit ${ADAHOP_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}; steps $STEPS + $MORE resumed, checkpoint every $INTERVAL, batch $BATCH x $SEQ"
say "installing the carried wheels into $SITE"
ls -la .whl .whl/titan-assets
timeout 120 python3 -m pip install -q --upgrade --no-index --no-deps --no-compile --target "$SITE" .whl/*.whl || { echo "FAILED: pip install"; exit 1; }
export PYTHONPATH=$SITE:$PWD/src
if ! timeout 60 python3 -c "import datasets" 2>/dev/null; then
  echo "no 'datasets' on this machine: using the local-files stand-in benchmarks/torchtitan/shim/datasets"
  export PYTHONPATH=$PWD/benchmarks/torchtitan/shim:$PYTHONPATH
fi
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
timeout 120 python3 - <<'PY' || { echo "FAILED: imports"; exit 1; }
import sys, torch, triton, torchtitan, tyro, torchdata, datasets, adahop
from adahop.integrations import torchtitan as tt
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (cuda {torch.version.cuda}), triton {triton.__version__}, "
      f"torchtitan {torchtitan.__version__} (adahop API {tt.API}), tyro {tyro.__version__}, datasets {datasets.__version__} "
      f"from {datasets.__file__}")
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "NO CUDA")
PY

DATA=$WORK/data
mkdir -p "$DATA"
gzip -dc .whl/titan-assets/english-docs-1k.jsonl.gz > "$DATA/data.jsonl" || { echo "FAILED: data"; exit 1; }
say "data: $(wc -l < "$DATA/data.jsonl") documents, $(du -h "$DATA/data.jsonl" | cut -f1) (torchtitan's c4_test loader, --training.dataset_path)"

DUMP=$WORK/outputs
if command -v torchrun >/dev/null; then TORCHRUN=(torchrun); else TORCHRUN=(python3 -m torch.distributed.run); fi
titan() {  # $1: total steps, $2: log file, $3: time limit (s)
  timeout -k 10 "$3" "${TORCHRUN[@]}" --standalone --nproc-per-node=1 "${MAIN[@]}" \
    --job.config_file benchmarks/torchtitan/debug_model_adahop.toml \
    --job.dump_folder "$DUMP" \
    --model.hf_assets_path .whl/titan-assets/tokenizer \
    --training.dataset_path "$DATA" \
    --training.steps "$1" --training.seq_len "$SEQ" --training.local_batch_size "$BATCH" \
    --checkpoint.interval "$INTERVAL" --metrics.log_freq 10 --adahop.recipe "$RECIPE" \
    --comm.init_timeout_seconds 120 --comm.train_timeout_seconds 120 > "$2" 2>&1
  local rc=$?
  grep -E "torchtitan version|backend|Mixed precision|adahop|step: |checkpoint|Training starts|Training completed|Error|error" "$2" | grep -v "^\s*$" | cut -c1-220
  if grep -q "adahop: plan (recipe" "$2"; then sed -n '/adahop: plan (recipe/,/^\[titan\]/p' "$2" | sed '$d' | head -60; fi
  return $rc
}

say "run 1: torchtitan.train, steps 1..$STEPS"
titan "$STEPS" "$OUT/run1.log" 240; RC1=$?
say "run 1 exit status $RC1"
cp "$DUMP/adahop_plan.json" "$OUT/" 2>/dev/null || echo "no adahop_plan.json written"
ls "$DUMP/checkpoint" 2>/dev/null

say "DCP checkpoint after run 1: the plan read from the checkpoint files"
timeout 120 python3 benchmarks/torchtitan/check_dcp.py "$DUMP/checkpoint" --plan "$DUMP/adahop_plan.json" > "$OUT/check_dcp_run1.txt" 2>&1; RCC1=$?
cat "$OUT/check_dcp_run1.txt"

say "run 2: resume from the latest checkpoint, steps $((STEPS + 1))..$((STEPS + MORE))"
titan "$((STEPS + MORE))" "$OUT/run2.log" 120; RC2=$?
say "run 2 exit status $RC2"
timeout 120 python3 benchmarks/torchtitan/check_dcp.py "$DUMP/checkpoint" --plan "$DUMP/adahop_plan.json" > "$OUT/check_dcp_run2.txt" 2>&1; RCC2=$?
cat "$OUT/check_dcp_run2.txt"

losses() { grep -oE "step: +[0-9]+ +loss: +[0-9.]+" "$1" | awk '{print $2":"$4}' | tr '\n' ' '; }
{
  echo "# torchtitan_h200 summary ($(date -u +%FT%TZ), $(( $(date +%s) - T0 )) s)"
  echo "run 1 (fresh, $STEPS steps): exit $RC1; losses step:loss: $(losses "$OUT/run1.log")"
  echo "run 2 (resumed, to $((STEPS + MORE))): exit $RC2; losses: $(losses "$OUT/run2.log")"
  echo "plan frozen in run 1: $(grep -c 'every layer has frozen its plan' "$OUT/run1.log") time(s); $(grep -h -o 'adahop: every layer has frozen.*' "$OUT/run1.log" | head -1)"
  echo "run 2 loaded: $(grep -h -o 'Loading the checkpoint from.*' "$OUT/run2.log" | head -1); starts: $(grep -h -o 'Training starts at step.*' "$OUT/run2.log" | head -1)"
  echo "run 2 layers: $(grep -h -o 'adahop: [0-9]* of [0-9]* layers resumed.*' "$OUT/run2.log" | head -1); froze again in run 2: $(grep -c 'every layer has frozen its plan' "$OUT/run2.log") time(s)"
  echo "DCP plan check after run 1: exit $RCC1: $(tail -1 "$OUT/check_dcp_run1.txt")"
  echo "DCP plan check after run 2: exit $RCC2: $(tail -1 "$OUT/check_dcp_run2.txt")"
} > "$OUT/summary.txt"
say "summary"
cat "$OUT/summary.txt"
rm -rf "$WORK"
[ "$RC1" = 0 ] && [ "$RC2" = 0 ] && [ "$RCC1" = 0 ] && [ "$RCC2" = 0 ]
