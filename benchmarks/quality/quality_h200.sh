#!/usr/bin/env bash
# Issue 12 quality study, one GPU call: K `adahop train` runs side by side on one H200 (configs/
# quality_125m.toml: 125m, vocab 8192, English text, 1024 x 16 tokens a step, lr 1e-3, warmup 50,
# cosine), then `adahop eval` of every finished run on the held-out file, then a summary.
# Protocol and how to combine the calls: benchmarks/quality/phases.md (the answer so far: docs/quality.md).
#
# Once, on the machine that has ../shared (not the GPU machine), make the git-ignored data folder:
#     python benchmarks/quality/prepare_data.py ../shared/data/english-docs.jsonl.gz --out .data
# (9.9 MB: english-train.jsonl.gz, english-heldout.jsonl.gz, manifest.json; the sha256 sums it
# prints are the same everywhere.) Then the three GPU calls, from the repository root, each with
#     carry: [".data"]
#   call 1:  SEEDS=0 bash benchmarks/quality/quality_h200.sh
#   call 2:  SEEDS=1 bash benchmarks/quality/quality_h200.sh
#   call 3:  SEEDS=2 bash benchmarks/quality/quality_h200.sh
# ($OUT is set by the device tool; elsewhere it defaults to /tmp/quality_h200_out.) Each call trains
# bf16, mxfp4, mxfp4_hadamard, adahop_lv1 and adahop_lv2 at that seed: five runs of 1000 steps
# measured 7.5 minutes side by side, so a call takes about 8.5-9 minutes with tokenizing and eval.
#
# Environment (defaults in brackets):
#   RECIPES ["bf16 mxfp4 mxfp4_hadamard adahop_lv1 adahop_lv2"]   SEEDS [0]   STEPS [1000]
#   K [5]          runs at once; jobs = RECIPES x VARIANTS x SEEDS, started K at a time
#   VARIANTS [""]  ';'-separated TAG:ARGS for knob / ablation runs, e.g.
#                  VARIANTS="rceil:--recipe.scale_rule=rceil;wgrad:--recipe.bf16_gemms=wgrad"
#                  (an entry without ':' adds no arguments; ARGS split on spaces, no quoting; values are
#                  never globbed, so per-layer ablations pass as written, e.g.
#                  "ffn:--recipe.bf16_gemms=forward@*.feed_forward.*;l0:--recipe.bf16_gemms=forward@layers.0.*");
#                  run names are RECIPE-sSEED, or RECIPE-TAG-sSEED
#   EXTRA [""]     adahop train arguments added to every run (split on spaces)
#   COMPILE [0]    1: --training.compile=true (compile time counts against the 10 minutes)
#   ANALYZE [1]    `adahop analyze --no-heatmaps --sequences 2` of every finished run after its eval (CPU:
#                  37 s for the 125m on 2 cores; stopped 50 s before LIMIT): runs/NAME/analysis/report.{md,json},
#                  overview.png
#   PROBE [""]     run names (e.g. "adahop_lv1-s2") whose last checkpoint gets a gradient-error probe after the
#                  evals (benchmarks/quality/gradient_error.py: each weight's gradient under every PROBE_VARIANTS
#                  recipe against the float64 unquantized one, same weights, batches and rounding keys; adaptive
#                  variants take their plans from the run's frozen patterns): runs/NAME/gradient_error.json and
#                  logs/NAME.gradient.log. PROBE_BATCHES [4]. PROBE_VARIANTS: the VARIANTS syntax, each entry
#                  naming its --recipe; default: bf16, mxfp4, iht, lv1, lv2, and lv1 with each role in BF16
#                  (fwd, dgrad, wgrad), with FP32 accumulation for the gradient GEMMs (acc), with rceil scales
#   LIMIT [590]    seconds from the start by which everything must be done (the call has 600)
#   RESERVE [60]   seconds kept after training for eval, copying and the summary: runs that have
#                  not finished by LIMIT - RESERVE are stopped and reported (incomplete/)
#   CONFIG [configs/quality_125m.toml]  TRAIN_DATA [.data/english-train.jsonl.gz]
#   HELDOUT [.data/english-heldout.jsonl.gz]
#   BUNDLE [1]     1: at the end, everything in $OUT but summary.txt and quality_h200.log goes into
#                  $OUT/quality_h200.tgz (the GPU tool returns at most 8 files; unpack with tar xzf); 0: keep it loose
#   .whl/          carried wheels (e.g. torchao for torchao_float8_* recipes) are installed first (not with DRY=1)
#   DRY [0]        1: CPU dry run, a 2-layer dim-64 model, seq 64 x 4, STEPS 6, eval on 2 batches:
#                      DRY=1 OUT=/tmp/q_dry bash benchmarks/quality/quality_h200.sh
#
# Output ($OUT): quality_h200.log (this log), logs/NAME.log (each train and eval), runs/NAME/ for
# every finished run (config.toml, metrics.jsonl, plan.json, loss.png, tb/, eval.json, analysis/; no
# checkpoints: they stay in /tmp), incomplete/NAME/ for runs that failed or ran out of time (their
# metrics so far; never mixed into runs/), compare/ (loss.png, compare.md, runs.json, recipes.json:
# `adahop compare $OUT/runs/* --out $OUT/compare`), summary.txt (benchmarks/quality/summary.py), summary.json.
# With BUNDLE=1 (the default) all of it but the log and summary.txt ends up in quality_h200.tgz.
# Exit status 0 only when every run trained to the end and every eval succeeded.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/quality_h200_out}
DRY=${DRY:-0}
RECIPES=${RECIPES:-"bf16 mxfp4 mxfp4_hadamard adahop_lv1 adahop_lv2"}
SEEDS=${SEEDS:-0}
K=${K:-5}
VARIANTS=${VARIANTS:-}
EXTRA=${EXTRA:-}
COMPILE=${COMPILE:-0}
ANALYZE=${ANALYZE:-1}
PROBE=${PROBE:-}
PROBE_BATCHES=${PROBE_BATCHES:-4}
PROBE_VARIANTS=${PROBE_VARIANTS:-"bf16:--recipe=bf16;mxfp4:--recipe=mxfp4;iht:--recipe=mxfp4_hadamard;lv1:--recipe=adahop_lv1;lv2:--recipe=adahop_lv2;fwd:--recipe=adahop_lv1 --recipe.bf16_gemms=forward;dgrad:--recipe=adahop_lv1 --recipe.bf16_gemms=dgrad;wgrad:--recipe=adahop_lv1 --recipe.bf16_gemms=wgrad;acc:--recipe=adahop_lv1 --recipe.grad_fast_accum=false;rceil:--recipe=adahop_lv1 --recipe.scale_rule=rceil"}
BUNDLE=${BUNDLE:-1}
CONFIG=${CONFIG:-configs/quality_125m.toml}
TRAIN_DATA=${TRAIN_DATA:-.data/english-train.jsonl.gz}
HELDOUT=${HELDOUT:-.data/english-heldout.jsonl.gz}
if [ "$DRY" = 1 ]; then
  STEPS=${STEPS:-6} LIMIT=${LIMIT:-900} RESERVE=${RESERVE:-120}
  DEVICE=cpu
  DRY_ARGS=(--training.device=cpu --model.overrides.dim=64 --model.overrides.n_layers=2
            --model.overrides.n_heads=4 --model.overrides.n_kv_heads=2 --data.seq_len=64 --data.batch_size=4
            --optim.warmup_steps=2 --recipe.calibration_steps=2 --training.pattern_telemetry_every=4
            --logging.log_every=2 --logging.val_every=3 --logging.val_batches=2)
  EVAL_ARGS=(--device cpu --max-batches 2)
else
  STEPS=${STEPS:-1000} LIMIT=${LIMIT:-590} RESERVE=${RESERVE:-60}
  DEVICE=cuda
  DRY_ARGS=()
  EVAL_ARGS=(--device cuda)
fi
read -r -a EXTRA_ARGS <<< "$EXTRA"
[ "$COMPILE" = 1 ] && EXTRA_ARGS+=(--training.compile=true)

T0=$(date +%s)
WORK=/tmp/adahop_quality_$$
mkdir -p "$OUT/logs" "$OUT/runs" "$WORK/rc" "$WORK/runs"
LOG=$OUT/quality_h200.log
exec > >(tee -a "$LOG") 2>&1
elapsed() { echo $(( $(date +%s) - T0 )); }
say() { echo "== $(date -u +%T) (+$(elapsed)s) $*"; }
SITE=""
if [ "$DRY" != 1 ] && ls .whl/*.whl > /dev/null 2>&1; then  # carried wheels (torchao for the float8 peer recipes)
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$WORK/site" .whl/*.whl \
    && SITE=:$WORK/site
fi
export PYTHONPATH=$PWD/src$SITE PYTHONUNBUFFERED=1 ADAHOP_CACHE=$WORK/cache
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1
gpu_line() { command -v nvidia-smi >/dev/null && nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader 2>/dev/null | head -1 | sed 's/^/GPU /'; }

say "commit ${ADAHOP_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}; config $CONFIG; recipes [$RECIPES]; seeds [$SEEDS]; variants [${VARIANTS:-none}]; steps $STEPS; K $K; compile $COMPILE; dry $DRY; extra [${EXTRA_ARGS[*]}]"
say "deadline: all done by +${LIMIT}s, training stops by +$((LIMIT - RESERVE))s"
timeout 120 python3 - <<'PY' || { say "FAILED: imports"; exit 1; }
import sys, torch, adahop
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (cuda {torch.version.cuda}), adahop {adahop.__version__}")
print("device:", torch.cuda.get_device_name() if torch.cuda.is_available() else "no CUDA")
try:
    import triton
    print("triton", triton.__version__)
except ImportError:
    print("no triton")
PY
for f in "$TRAIN_DATA" "$HELDOUT"; do
  if [ ! -f "$f" ]; then
    say "FAILED: no $f: make it with python benchmarks/quality/prepare_data.py ../shared/data/english-docs.jsonl.gz --out .data and carry .data"
    exit 1
  fi
done
[ -f .data/manifest.json ] && { echo "data manifest:"; cat .data/manifest.json; }

# ---- 1. tokenize once, before any run starts (tokenizer + token caches in $ADAHOP_CACHE) ----------
say "tokenizing $TRAIN_DATA and $HELDOUT once (cache $ADAHOP_CACHE); checking the held-out text is disjoint"
timeout 240 python3 - "$CONFIG" "$TRAIN_DATA" "$HELDOUT" "$OUT/data.json" --steps "$STEPS" "${DRY_ARGS[@]}" "${EXTRA_ARGS[@]}" <<'PY' || { say "FAILED: data preparation"; exit 1; }
import json, sys, time
from adahop.data import prepare_data, resolve_source
from adahop.data.dataset import load_tokens
from adahop.train.cli import build_parser, parse_overrides, resolve_config

config, train_data, heldout, report, *rest = sys.argv[1:]
parser = build_parser()
args, extra = parser.parse_known_args(["--config", config, "--data", train_data, *rest])
cfg = resolve_config(args, parse_overrides(extra, parser))  # the runs' own data settings
t = time.time()
data = prepare_data(cfg.data.source, cfg.data.vocab_size, cfg.data.val_fraction, progress=False)
held = load_tokens(resolve_source(heldout), data.tokenizer, progress=False)
eos = data.tokenizer.eos_id
train_docs = list(resolve_source(train_data).documents())
held_docs = set(resolve_source(heldout).documents())
out = {
    "train_source": cfg.data.source, "vocab_size": data.tokenizer.vocab_size, "val_fraction": cfg.data.val_fraction,
    "train_tokens": len(data.train), "val_tokens": len(data.val), "heldout_tokens": len(held),
    "val_starts_at_document_start": bool(data.train[-1] == eos),
    "train_file_documents": len(train_docs), "train_file_duplicate_documents": len(train_docs) - len(set(train_docs)),
    "heldout_documents": len(held_docs), "heldout_documents_in_train_file": len(held_docs & set(train_docs)),
    "tokens_per_step": cfg.data.batch_size * cfg.data.seq_len * cfg.training.grad_accum,
    "seconds": round(time.time() - t, 1),
}
out["epochs_at_steps"] = round(out["tokens_per_step"] * cfg.training.steps / out["train_tokens"], 2)
print(json.dumps(out, indent=1))
open(report, "w").write(json.dumps(out, indent=1) + "\n")
ok = out["val_starts_at_document_start"] and out["heldout_documents_in_train_file"] == 0 and out["train_file_duplicate_documents"] == 0
if not ok:
    sys.exit("the validation split or the held-out file shares text with the training tokens")
PY
say "data ready"

# ---- 2. the runs, K at a time, each under the training deadline --------------------------------
JOBS=()  # "name recipe seed variant-args"
IFS=';' read -r -a VARS <<< "${VARIANTS:-}"
[ ${#VARS[@]} = 0 ] && VARS=("")
for seed in $SEEDS; do
  for v in "${VARS[@]}"; do
    if [[ "$v" == *:* ]]; then tag=${v%%:*}; vargs=${v#*:}; else tag=$v; vargs=""; fi
    for recipe in $RECIPES; do
      name=$recipe${tag:+-$tag}-s$seed
      JOBS+=("$name|$recipe|$seed|$vargs")
    done
  done
done
say "${#JOBS[@]} runs: $(for j in "${JOBS[@]}"; do printf '%s ' "${j%%|*}"; done)"
TRAIN_DEADLINE=$((T0 + LIMIT - RESERVE))

start_run() {  # $1: job spec
  local name recipe seed vargs left
  IFS='|' read -r name recipe seed vargs <<< "$1"
  local -a va; read -r -a va <<< "$vargs"
  left=$((TRAIN_DEADLINE - $(date +%s)))
  if [ "$left" -lt 60 ]; then
    say "$name: not started, ${left}s left before the training deadline"
    echo "not started" > "$WORK/rc/$name"
    return
  fi
  say "$name: start (recipe $recipe, seed $seed${vargs:+, $vargs}; time limit ${left}s)"
  date +%s > "$WORK/runs/$name.start"
  ( OMP_NUM_THREADS=2 TOKENIZERS_PARALLELISM=false timeout -k 15 "$left" python3 -m adahop train --config "$CONFIG" \
      --data "$TRAIN_DATA" --recipe "$recipe" --training.seed="$seed" --steps "$STEPS" --out "$WORK/runs/$name" \
      "${DRY_ARGS[@]}" "${EXTRA_ARGS[@]}" "${va[@]}" > "$OUT/logs/$name.log" 2>&1
    echo $? > "$WORK/rc/$name.tmp"; date +%s > "$WORK/runs/$name.end"; mv "$WORK/rc/$name.tmp" "$WORK/rc/$name" ) &
  PIDS+=($!)
}

running() { local n=0 j; for j in "${STARTED[@]}"; do [ -f "$WORK/rc/${j%%|*}" ] || n=$((n + 1)); done; echo $n; }
progress() {  # each run's last logged step and, from its pace so far, when it would finish
  local j name line at n m start eta
  for j in "${STARTED[@]}"; do
    name=${j%%|*}
    if [ -f "$WORK/rc/$name" ]; then line="done, exit $(cat "$WORK/rc/$name")"
    else
      line=$(grep -oE "step [0-9]+/[0-9]+ +loss [0-9.]+|validation loss [0-9.]+" "$OUT/logs/$name.log" 2>/dev/null | tail -1)
      at=$(grep -oE "step [0-9]+/[0-9]+" "$OUT/logs/$name.log" 2>/dev/null | tail -1)
      start=$(cat "$WORK/runs/$name.start" 2>/dev/null)
      if [ -n "$at" ] && [ -n "$start" ]; then
        n=${at#step }; m=${n#*/}; n=${n%/*}
        if [ "$n" -gt 0 ]; then
          eta=$(( $(date +%s) - T0 + ($(date +%s) - start) * (m - n) / n ))
          line="$line; at this pace done at +${eta}s (training deadline +$((LIMIT - RESERVE))s)"
        fi
      fi
    fi
    printf '   %-28s %s\n' "$name" "${line:-starting}"
  done
  gpu_line | sed 's/^/   /'
}

STARTED=() PIDS=()  # explicit pids: a bare `wait` could wait on the log's tee
next=0 last_report=0
while :; do
  while [ "$next" -lt ${#JOBS[@]} ] && [ "$(running)" -lt "$K" ]; do
    start_run "${JOBS[$next]}"; STARTED+=("${JOBS[$next]}"); next=$((next + 1))
  done
  [ "$(running)" = 0 ] && [ "$next" -ge ${#JOBS[@]} ] && break
  if [ $(( $(date +%s) - last_report )) -ge 30 ]; then say "progress"; progress; last_report=$(date +%s); fi
  sleep 5
done
[ ${#PIDS[@]} -gt 0 ] && wait "${PIDS[@]}"
say "training finished"; progress

# ---- 3. eval on the held-out file, finished runs only, K at a time -------------------------------
FINISHED=() FAILED=()
for j in "${JOBS[@]}"; do
  name=${j%%|*}; rc=$(cat "$WORK/rc/$name" 2>/dev/null || echo missing)
  if [ "$rc" = 0 ] && ls "$WORK/runs/$name/checkpoints/"step_* >/dev/null 2>&1; then FINISHED+=("$name")
  else
    FAILED+=("$name")
    case $rc in 124|137) why="ran out of time (killed at the training deadline)";; *) why="exit $rc";; esac
    say "$name: NOT finished: $why; last lines of logs/$name.log:"
    tail -5 "$OUT/logs/$name.log" 2>/dev/null | cut -c1-300
  fi
done
EVAL_FAILED=()
eval_deadline=$((T0 + LIMIT - 20))
say "eval of ${#FINISHED[@]} finished runs on $HELDOUT (as trained and all-BF16 inference)"
PIDS=()
for name in "${FINISHED[@]}"; do
  left=$((eval_deadline - $(date +%s)))
  [ "$left" -lt 10 ] && { say "$name: no time left for eval"; echo 124 > "$WORK/rc/$name.eval"; continue; }
  ( timeout -k 5 "$left" python3 -m adahop eval "$WORK/runs/$name" --data "$HELDOUT" --out "$WORK/runs/$name/eval.json" \
      "${EVAL_ARGS[@]}" > "$OUT/logs/$name.eval.log" 2>&1; echo $? > "$WORK/rc/$name.eval" ) &
  PIDS+=($!)
  if [ ${#PIDS[@]} -ge "$K" ]; then wait "${PIDS[@]}"; PIDS=(); fi
done
[ ${#PIDS[@]} -gt 0 ] && wait "${PIDS[@]}"
for name in "${FINISHED[@]}"; do
  rc=$(cat "$WORK/rc/$name.eval" 2>/dev/null || echo missing)
  if [ "$rc" != 0 ]; then EVAL_FAILED+=("$name"); say "$name: eval FAILED (exit $rc):"; tail -5 "$OUT/logs/$name.eval.log" | cut -c1-300
  else python3 -c "import json,sys; r=json.load(open(sys.argv[1])); print(f'   {sys.argv[2]:28s} held-out {r[\"tokens\"]} tokens ({r[\"part\"]}): as trained {r[\"as_trained\"][\"loss\"]:.4f}, all-BF16 {r[\"bf16\"][\"loss\"]:.4f}')" "$WORK/runs/$name/eval.json" "$name"; fi
done

# ---- 3b. outlier report of every finished run at its last step (adahop analyze, on the CPU) -------
if [ "$ANALYZE" = 1 ]; then
  say "adahop analyze of ${#FINISHED[@]} runs (patterns and MXFP4 errors at the last step, 2 sequences, no heatmaps)"
  analyze_deadline=$((T0 + LIMIT - 50))  # compare and the summary come after it
  PIDS=()
  for name in "${FINISHED[@]}"; do
    left=$((analyze_deadline - $(date +%s)))
    [ "$left" -lt 10 ] && { say "$name: no time left for analyze"; continue; }
    ( OMP_NUM_THREADS=3 timeout -k 5 "$left" python3 -m adahop analyze "$WORK/runs/$name" --out "$WORK/runs/$name/analysis" \
        --no-heatmaps --sequences 2 > "$OUT/logs/$name.analyze.log" 2>&1 || say "$name: analyze FAILED (exit $?; logs/$name.analyze.log)" ) &
    PIDS+=($!)
    if [ ${#PIDS[@]} -ge "$K" ]; then wait "${PIDS[@]}"; PIDS=(); fi
  done
  [ ${#PIDS[@]} -gt 0 ] && wait "${PIDS[@]}"
fi

# ---- 3c. gradient error of the PROBE runs at their last step, under each PROBE_VARIANTS recipe ------
for name in $PROBE; do
  left=$((T0 + LIMIT - 50 - $(date +%s)))
  if [ ! -d "$WORK/runs/$name/checkpoints" ] || [ "$left" -lt 30 ]; then
    say "$name: no gradient probe (no checkpoint, or ${left}s left)"; continue
  fi
  say "$name: gradient probe, $PROBE_BATCHES batches, variants [$PROBE_VARIANTS]"
  timeout -k 5 "$left" python3 benchmarks/quality/gradient_error.py "$WORK/runs/$name" --device "$DEVICE" \
    --batches "$PROBE_BATCHES" --variants "$PROBE_VARIANTS" --out "$WORK/runs/$name/gradient_error.json" \
    > "$OUT/logs/$name.gradient.log" 2>&1 || say "$name: gradient probe FAILED (exit $?; logs/$name.gradient.log)"
  sed -n '/^parameter kind/,$p' "$OUT/logs/$name.gradient.log"
done

# ---- 4. light files back to $OUT, summary ---------------------------------------------------------
copy_run() {  # $1 name, $2 destination folder
  mkdir -p "$2/$1"
  for f in config.toml metrics.jsonl plan.json loss.png eval.json gradient_error.json analysis tb; do
    [ -e "$WORK/runs/$1/$f" ] && cp -r "$WORK/runs/$1/$f" "$2/$1/"
  done
  local s e; s=$(cat "$WORK/runs/$1.start" 2>/dev/null); e=$(cat "$WORK/runs/$1.end" 2>/dev/null)
  [ -n "$s" ] && [ -n "$e" ] && echo "train wall seconds: $((e - s))" > "$2/$1/timing.txt"
}
for name in "${FINISHED[@]}"; do copy_run "$name" "$OUT/runs"; done
for name in "${FAILED[@]}"; do [ -d "$WORK/runs/$name" ] && copy_run "$name" "$OUT/incomplete"; done
say "train wall times: $(for n in "${FINISHED[@]}" "${FAILED[@]}"; do t=$(cat "$OUT"/*/"$n"/timing.txt 2>/dev/null | grep -oE '[0-9]+$'); printf '%s %ss; ' "$n" "${t:--}"; done)"

if [ ${#FINISHED[@]} -gt 0 ]; then
  timeout 60 python3 -m adahop compare "$OUT"/runs/* --out "$OUT/compare" > "$OUT/logs/compare.log" 2>&1 \
    || say "adahop compare FAILED: $(tail -3 "$OUT/logs/compare.log")"
  timeout 60 python3 benchmarks/quality/summary.py "$OUT" --json "$OUT/summary.json" > "$WORK/summary.md" 2> "$OUT/logs/summary.log" \
    || say "summary.py FAILED: $(tail -3 "$OUT/logs/summary.log")"
fi
{
  echo "# quality_h200 summary ($(date -u +%FT%TZ), $(elapsed) s)"
  echo "commit ${ADAHOP_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}; recipes [$RECIPES]; seeds [$SEEDS]; variants [${VARIANTS:-none}]; steps $STEPS; dry $DRY; extra [${EXTRA_ARGS[*]}]"
  echo "finished: ${#FINISHED[@]} of ${#JOBS[@]} runs (${FINISHED[*]:-none}); not finished: ${FAILED[*]:-none}; eval failed: ${EVAL_FAILED[*]:-none}"
  echo "data: $(tr -d '\n' < "$OUT/data.json" | tr -s ' ')"
  echo
  cat "$WORK/summary.md" 2>/dev/null
} > "$OUT/summary.txt"
say "summary ($OUT/summary.txt)"
cat "$OUT/summary.txt"
rm -rf "$WORK"
if [ "$BUNDLE" = 1 ]; then  # the GPU tool returns at most 8 files from $OUT: everything but the two texts in one archive
  (cd "$OUT" && tar czf quality_h200.tgz --exclude=quality_h200.tgz --exclude=summary.txt --exclude=quality_h200.log -- * \
    && find . -mindepth 1 -maxdepth 1 ! -name quality_h200.tgz ! -name summary.txt ! -name quality_h200.log -exec rm -rf {} +) \
    || say "bundling FAILED: the files stay loose in $OUT"
fi
say "done in $(elapsed)s"
[ ${#FAILED[@]} = 0 ] && [ ${#EVAL_FAILED[@]} = 0 ] && [ ${#FINISHED[@]} -gt 0 ]
