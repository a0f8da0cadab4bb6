"""``benchmarks/linear/host_overhead.py`` is a GPU script; its ``--dry-run`` checks on the CPU the kernel
launches it makes itself (in a subprocess: the dry run needs Triton's interpreter whatever the
machine has)."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_host_overhead_launches_name_every_kernel_parameter_in_order():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "linear" / "host_overhead.py"), "--dry-run"],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    kernels = [line.split(":")[1].split(",")[0].strip() for line in run.stdout.splitlines()]
    assert kernels == ["_quantize_rows_kernel", "_quantize_cols_kernel", "_quantize_mx_kernel"], run.stdout
