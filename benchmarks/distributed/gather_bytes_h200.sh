#!/usr/bin/env bash
# Bytes FSDP2 all-gathers per step with the high-precision (BF16) and the low-precision gather of
# AdaHOPLinear weights (adahop.nn.fsdp), on 2 GPUs over NCCL, and whether the losses stay identical.
# Prepared, not yet run: needs a machine with at least 2 GPUs (the CPU result is in README.md).
#
# Run from the repository root on the GPU machine (nothing to carry):
#     OUT=/some/dir bash benchmarks/distributed/gather_bytes_h200.sh
# Overrides: NPROC (2), PRESET (125m), STEPS (4: the last is measured, after calibration), SEQ (1024), BATCH (4).
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gather_bytes_h200_out}
NPROC=${NPROC:-2} PRESET=${PRESET:-125m} STEPS=${STEPS:-4} SEQ=${SEQ:-1024} BATCH=${BATCH:-4}
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv > "$OUT/gpu.txt" || true
git rev-parse HEAD > "$OUT/commit.txt" 2>/dev/null || true
PYTHONPATH=src torchrun --standalone --nproc-per-node="$NPROC" benchmarks/distributed/gather_bytes.py \
  --preset "$PRESET" --steps "$STEPS" --seq "$SEQ" --batch "$BATCH" --out "$OUT" 2>&1 | tee "$OUT/log.txt"
