"""Issue #30's lever "one read, both orientations" (``benchmarks/quantize/bothways``): the calls per step it would
replace are counted from a frozen plan as training makes them, and ``bothways_ab.py --dry-run`` keeps the GPU
script working (every bit-exactness check it makes on the device passes in the interpreter)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "quantize" / "bothways" / "bothways_ab.py"


def _layer(name, in_features, out_features, forward, dgrad, wgrad, forward_fmt=None):
    return dict(name=name, in_features=in_features, out_features=out_features, forward=forward, dgrad=dgrad,
                wgrad=wgrad, forward_fmt=forward_fmt)  # fmt: skip


def test_fusion_calls_follow_the_plan():
    sys.path.insert(0, str(SCRIPT.parents[1]))
    from bothways.bothways_ab import fusion_calls

    layers = [
        # q/k/v read one X: one X call, and each its own dY (wk/wv's 512 wide)
        _layer("layers.0.attention.wq", 2048, 2048, "iht", "oe_left", "iht"),
        _layer("layers.0.attention.wk", 2048, 512, "iht", "oe_left", "iht"),
        _layer("layers.0.attention.wv", 2048, 512, "iht", "oe_left", "iht"),
        _layer("layers.0.attention.wo", 2048, 2048, "iht", "oe_left", "bf16"),  # wgrad in BF16: nothing to fuse
        # w1/w3 share X, but different strategies make different calls
        _layer("layers.1.feed_forward.w1", 2048, 8192, "iht", "iht", "oe_right"),
        _layer("layers.1.feed_forward.w3", 2048, 8192, "oe_left", "iht", "oe_right"),
        _layer("layers.1.feed_forward.w2", 8192, 2048, "bf16", "bf16", "iht"),  # neither X's nor dY's fold
        _layer(
            "layers.2.feed_forward.w2", 8192, 2048, "mxfp4", "iht", "iht", forward_fmt="fp8_e4m3_rowwise"
        ),  # dY only
    ]
    calls = fusion_calls(layers)
    assert calls == {("X", 2048): 3, ("dY", 2048): 2, ("dY", 512): 2, ("dY", 8192): 2}


@pytest.mark.slow  # about a minute in the interpreter: three cases' checks and timings
def test_gpu_script_dry_run_is_bit_exact(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--dry-run", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "bit-exact: True" in run.stdout
    assert "| case |" in (tmp_path / "bothways_ab.md").read_text()
    assert (tmp_path / "bothways_ab.json").exists()
