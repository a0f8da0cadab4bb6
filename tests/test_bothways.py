"""Issue #30's lever "one read, both orientations" (``benchmarks/quantize/bothways``): the prototype kernel writes,
from one read, exactly what ``quantize_fold_fp8`` (rows) and ``quantize_mx_triton(axis=0)`` (columns) write, in
every field (Triton interpreter, hard values, rows walked in several chunks); the calls per step it would replace
are counted from a frozen plan as training makes them; ``bothways_ab.py --dry-run`` keeps the GPU script working."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adahop.kernels.quantize import quantize_mx_triton
from adahop.kernels.quantize_fold import quantize_fold_fp8
from adahop.transforms import random_signs

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "quantize" / "bothways" / "bothways_ab.py"
sys.path.insert(0, str(SCRIPT.parents[1]))

from bothways.kernel import quantize_fold_rows_and_cols  # noqa: E402
from epilogue.inputs import hard_rows, same_bits  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow|divide by zero):RuntimeWarning")


def assert_same(got, rows, cols, row_scores=None, col_scores=None):
    """Every field of the prototype's output equals the separate kernels' (scores: float32 bits, NaN any NaN)."""
    assert torch.equal(got.folded.data.view(torch.uint8), rows.data.view(torch.uint8))
    assert torch.equal(got.folded.row_scale.view(torch.int32), rows.row_scale.view(torch.int32))
    assert torch.equal(got.folded.lossy_per_row, rows.lossy_per_row)
    assert torch.equal(got.cols.data, cols.data) and torch.equal(got.cols.scales, cols.scales)
    assert (got.cols.axis, got.cols.shape) == (cols.axis, cols.shape)
    for ours, theirs in ((got.row_scores, row_scores), (got.col_scores, col_scores)):
        assert (ours is None) == (theirs is None) and (ours is None or same_bits(ours, theirs))


@pytest.mark.parametrize("staged", (False, True))
@pytest.mark.parametrize("rounding", ("nearest", "stochastic"))
@pytest.mark.parametrize("hadamard_block_size", (0, 32))
def test_one_read_equals_fold_rows_and_column_kernels(rounding, hadamard_block_size, staged):
    # 160 columns in chunks of 64: three chunks, the last partial; NaN, Inf, zeros, subnormals, an outlier, and
    # blocks far below their row's largest (the fold's exact path, with lossy counts) in rows 0-7
    x = hard_rows(64, 160, seed=5)
    options = dict(rounding=rounding, hadamard_block_size=hadamard_block_size)
    scores = dict(row_scores=True, col_scores=True)
    got = quantize_fold_rows_and_cols(x, row_seed=3, col_seed=4, block_n=64, staged=staged, **scores, **options)
    rows, row_scores = quantize_fold_fp8(x, seed=3, scores=True, **options)
    cols, col_scores = quantize_mx_triton(x, axis=0, seed=4, scores=True, **options)
    assert rows.lossy_per_row.sum() > 0  # the exact path ran
    assert_same(got, rows, cols, row_scores, col_scores)
    if staged:  # the second pass folded the rows' packed MXFP4, which is quantize_mx_triton's
        packed = quantize_mx_triton(x, axis=1, seed=3, **options)
        assert torch.equal(got.packed_rows.data, packed.data) and torch.equal(got.packed_rows.scales, packed.scales)
    else:
        assert got.packed_rows is None


def test_each_orientation_takes_its_own_options():
    # X as training takes it: rows H32 round to nearest (the forward's IHT), columns without a Hadamard and
    # stochastic (an MXFP4 wgrad with backward_rounding="stochastic"); random signs; 48 rows: a partial strip
    x = hard_rows(48, 96, seed=6)
    signs = random_signs(32, seed=2)
    got = quantize_fold_rows_and_cols(
        x, hadamard_block_size=32, signs=signs, col_rounding="stochastic", col_hadamard_block_size=0, col_seed=9,
        scale_rule="even",
    )  # fmt: skip
    rows = quantize_fold_fp8(x, hadamard_block_size=32, signs=signs, scale_rule="even")
    cols = quantize_mx_triton(x, axis=0, rounding="stochastic", seed=9, scale_rule="even")
    assert_same(got, rows, cols)


def test_inputs_it_does_not_take_get_one_line():
    with pytest.raises(ValueError, match="whole blocks of 32"):
        quantize_fold_rows_and_cols(torch.zeros(64, 48, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="whole blocks of 32"):
        quantize_fold_rows_and_cols(torch.zeros(64, 64, dtype=torch.bfloat16), col_hadamard_block_size=16)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        quantize_fold_rows_and_cols(torch.zeros(64, 64, dtype=torch.bfloat16), block_n=48)
    with pytest.raises(ValueError):  # a 32-point Hadamard down columns of 48 rows
        quantize_fold_rows_and_cols(torch.zeros(48, 64, dtype=torch.bfloat16), hadamard_block_size=32)


def _layer(name, in_features, out_features, forward, dgrad, wgrad, forward_fmt=None):
    return dict(name=name, in_features=in_features, out_features=out_features, forward=forward, dgrad=dgrad,
                wgrad=wgrad, forward_fmt=forward_fmt)  # fmt: skip


def test_fusion_calls_follow_the_plan():
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


def test_a_variant_that_fails_is_recorded_and_the_others_are_timed():
    from bothways.bothways_ab import VARIANT_BYTES, table, time_case

    class FakeCase:  # time_case's view of a case; one variant raises, as a kernel that fails to compile would
        label, operand, n, m, rounding, inputs = "X 4x32", "X", 32, 4, "nearest", [torch.zeros(4, 32)]

        def variants(self):
            def fail(x):
                raise RuntimeError("out of resources")

            return {name: (fail if name == "fused" else torch.clone) for name in VARIANT_BYTES}

    row = time_case(FakeCase(), repeats=1, on_cuda=False)
    assert "out of resources" in row["fused"]["error"] and "saving_us" in row["fused w8"]
    assert "| failed |" in table([row], {})


@pytest.mark.slow  # about a minute in the interpreter: three cases' checks (34) and timings
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
