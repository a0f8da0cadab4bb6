"""Every quantize kernel variant the launch plans pick compiles for sm_90 on this CPU-only machine
(``benchmarks/quantize/ptx_fingerprint.py``, in a subprocess: the test session runs Triton's interpreter,
whose functions cannot be compiled). The interpreter tests check what the kernels compute; this
checks that the same code is also valid for Triton's compiler, which accepts less Python."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_quantize_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "quantize" / "ptx_fingerprint.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    lines = run.stdout.splitlines()
    # 3 orientations x 2 roundings x 2 Hadamard settings, the fused fold kernel's 4, the fold's 2
    # (rows whole or split into parts); recording outlier scores: each single orientation's 4 and the
    # fused fold kernel's 4; float32 input with scores: the row-wise and fused fold kernels' 2 each.
    assert len(lines) == 18 + 12 + 4 and all(": " in line and "(0 chars)" not in line for line in lines), run.stdout
