#!/usr/bin/env bash
# GPU test log with names: the command, commit, versions, then pytest -rA (every test's outcome).
# Usage: benchmarks/gpu-tests/run_gpu_tests.sh LOGFILE [pytest args...]
set -uo pipefail
log=$1; shift
cd "$(dirname "$0")/../.."
{
  echo "# command: PYTHONPATH=\$PWD/src python -m pytest -rA -p no:cacheprovider $*"
  echo "# commit: ${ADAHOP_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
  echo "# date: $(date -u +%FT%TZ)"
  PYTHONPATH=$PWD/src python - <<'PY'
import numpy, torch, triton
print(f"# versions: python {__import__('sys').version.split()[0]}, torch {torch.__version__}, "
      f"triton {triton.__version__}, numpy {numpy.__version__}, cuda {torch.version.cuda}")
print(f"# device: {torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'}")
PY
  PYTHONPATH=$PWD/src python -m pytest -rA -p no:cacheprovider "$@" 2>&1
  echo "# exit status: $?"
} > "$log"
