"""The grouped quantize-fold prototype of ``benchmarks/quantize/grouped`` (issue #30's "fewer launches"): one
launch over a list of tensors of different shapes writes, for each, exactly what ``quantize_fold_fp8`` writes
for it alone (every field, bit for bit, Triton interpreter), rejects what it does not take in one line, and
``grouped_ab.py --dry-run`` keeps the GPU script working."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adahop.kernels.quantize_fold import quantize_fold_fp8
from adahop.transforms import random_signs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "quantize"))

from grouped.inputs import MIXED_SHAPES, mixed_hard_tensors, same_fold  # noqa: E402
from grouped.launcher import MAX_COLS, grouped_quantize_fold_fp8, plan_grouped_fold  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow|divide by zero):RuntimeWarning")


def assert_each_equals_its_own_launch(tensors, got, got_scores=None, **options) -> None:
    assert len(got) == len(tensors)
    for i, x in enumerate(tensors):
        want = quantize_fold_fp8(x, **options)
        want, want_scores = want if options.get("scores") else (want, None)
        checks = same_fold(got[i], want, None if got_scores is None else got_scores[i], want_scores)
        assert all(checks.values()), (i, tuple(x.shape), checks)


@pytest.mark.parametrize("hadamard_block_size", (0, 32))
def test_one_launch_equals_a_launch_per_tensor_on_mixed_shapes_and_hard_rows(hadamard_block_size):
    tensors = mixed_hard_tensors(seed=1)
    plan = plan_grouped_fold(tensors, hadamard_block_size=hadamard_block_size)
    assert plan.items > len(tensors) and plan.programs == plan.items  # some tensors take several programs
    plan.launch()
    assert [tuple(f.shape) for f in plan.outputs] == list(MIXED_SHAPES)
    assert any(bool(f.lossy_per_row.any()) for f in plan.outputs)  # the fold's exact path ran
    assert_each_equals_its_own_launch(tensors, plan.outputs, hadamard_block_size=hadamard_block_size)


def test_scores_signs_another_scale_rule_and_a_persistent_grid():
    tensors = mixed_hard_tensors(seed=2)
    options = dict(scale_rule="even", hadamard_block_size=32, signs=random_signs(32, seed=3), scores=True)
    folded, scores = grouped_quantize_fold_fp8(tensors, programs=3, **options)
    assert_each_equals_its_own_launch(tensors, folded, scores, **options)


def test_launching_again_quantizes_the_tensors_current_values():
    tensors = [torch.randn(8, 64).to(torch.bfloat16), torch.randn(4, 32).to(torch.bfloat16)]
    plan = plan_grouped_fold(tensors)
    plan.launch()
    tensors[1].mul_(-3)  # in place: the table holds the addresses, as a captured graph replays them
    plan.launch()
    assert_each_equals_its_own_launch(tensors, plan.outputs)


@pytest.mark.slow  # about 15 s: the interpreter runs a 16-row tile of the longest class
def test_the_longest_rows_it_takes_beside_the_shortest():
    tensors = [torch.randn(2, MAX_COLS).to(torch.bfloat16), torch.randn(3, 32).to(torch.bfloat16)]
    assert_each_equals_its_own_launch(tensors, grouped_quantize_fold_fp8(tensors))


def test_inputs_the_kernel_does_not_take_get_one_clear_error():
    good = torch.zeros(4, 64, dtype=torch.bfloat16)
    bad = {
        "non-empty list": [],
        "tensor 1 (4, 64) has dtype torch.float32": [good, good.float()],
        "tensor 0 (4, 48) has 48 columns": [torch.zeros(4, 48, dtype=torch.bfloat16)],
        f"has {MAX_COLS + 32} columns": [good, torch.zeros(1, MAX_COLS + 32, dtype=torch.bfloat16)],
        "tensor 1 (64, 4) has strides (1, 64)": [good, good.t()],
        "tensor 0 (4, 64) starts 2 bytes past a 16-byte boundary": [
            torch.zeros(257, dtype=torch.bfloat16)[1:].view(4, 64)
        ],
        "3 dimensions": [good[None]],
        "is a list": [[1.0]],
    }
    for expected, tensors in bad.items():
        with pytest.raises(ValueError) as raised:
            plan_grouped_fold(tensors)
        assert expected in str(raised.value) and "\n" not in str(raised.value), str(raised.value)
    with pytest.raises(ValueError, match="hadamard_block_size 0 or 32"):
        plan_grouped_fold([good], hadamard_block_size=16)
    with pytest.raises(ValueError, match="unknown scale_rule"):
        plan_grouped_fold([good], scale_rule="up")


@pytest.mark.slow  # about 60 s: the GPU script's checks and timings in the interpreter
def test_gpu_script_dry_run_is_bit_exact(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "quantize" / "grouped" / "grouped_ab.py"),
            "--dry-run",
            "--out",
            str(tmp_path),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "bit-exact: True (8/8 checks)" in run.stdout, run.stdout[-3000:]
    assert (tmp_path / "grouped_ab.md").read_text().count("llama3_1b (dry)") == 2  # H32 and H0
