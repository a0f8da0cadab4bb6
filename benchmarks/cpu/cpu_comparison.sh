#!/usr/bin/env bash
# The CPU comparison in benchmarks/cpu/comparison/README.md: five recipes, the tiny model, the embedded corpus.
# Two runs at a time, one thread each (a 2-core machine). SKIP_DONE=1 keeps finished runs.
set -euo pipefail
STEPS=${STEPS:-300}
OUT=${OUT:-runs/cpu-comparison}
run() {
  if [ "${SKIP_DONE:-0}" = 1 ] && [ -f "$OUT/$1/loss.png" ]; then return; fi
  OMP_NUM_THREADS=1 adahop train --recipe "$1" --steps "$STEPS" --out "$OUT/$1" \
    --logging.val_every=50 --logging.val_batches=16 --checkpoint.interval="$STEPS" > "$OUT/$1.log" 2>&1
}
mkdir -p "$OUT"
run bf16 & run mxfp4 & wait
run mxfp4_hadamard & run adahop_lv1 & wait
run adahop_lv2
adahop compare "$OUT"/{bf16,mxfp4,mxfp4_hadamard,adahop_lv1,adahop_lv2} --out benchmarks/cpu/comparison/compare
adahop analyze "$OUT"/adahop_lv2 --out benchmarks/cpu/comparison/outliers
