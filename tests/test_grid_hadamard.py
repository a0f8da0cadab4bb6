"""The grid Hadamard of ``benchmarks/quantize/grid_hadamard`` (issue #30's tensor-core lever, a prototype
outside ``src``): the reference equals an independent float64 matmul oracle bit for bit (so the
butterfly's order and a BLAS's give the same bits), the grid is exact in the input dtype, and the
prototype kernels (Triton interpreter) equal the reference quantizer; ``hadamard_tensor_cores.py
--dry-run`` keeps the GPU script working."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from adahop.formats.mx import quantize_mx
from adahop.transforms.hadamard import random_signs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "quantize"))

from grid_hadamard.kernels import quantize_grid_triton  # noqa: E402
from grid_hadamard.spec import MAX_EXPONENT, grid_hadamard_oracle, grid_hadamard_transform, grid_round  # noqa: E402
from hadamard_tensor_cores import special_blocks  # noqa: E402

DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int16 if t.element_size() == 2 else torch.int32)


def heavy_tailed(dtype: torch.dtype, shape=(64, 256)) -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(shape, generator=gen) * (torch.randn(shape, generator=gen) * 3).exp()
    return x.clamp(-6e4, 6e4).to(dtype) if dtype == torch.float16 else x.to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [32, 256])
def test_reference_equals_the_float64_matmul_oracle(dtype, block_size):
    for x in (special_blocks(dtype, torch.device("cpu")), heavy_tailed(dtype)):
        for axis in (1, 0):
            for signs in (None, random_signs(block_size, 3)):
                if x.shape[axis] % block_size:
                    continue
                ref = grid_hadamard_transform(x, axis=axis, block_size=block_size, signs=signs)
                oracle = grid_hadamard_oracle(x, axis=axis, block_size=block_size, signs=signs)
                assert torch.equal(bits(ref), bits(oracle)), (dtype, block_size, axis, signs is None)


@pytest.mark.parametrize("dtype", DTYPES)
def test_grid_values_are_exact_in_the_input_dtype_and_never_minus_zero(dtype):
    x = torch.cat((special_blocks(dtype, torch.device("cpu")), heavy_tailed(dtype)), 0)
    q = grid_round(x, signs=random_signs(32, 1))
    assert torch.equal(bits(q.float().to(dtype)), bits(q))
    assert not (bits(q) == bits(torch.tensor(-0.0, dtype=dtype))).any()
    blocks = q.float().unflatten(-1, (-1, 32))
    finite = blocks.isfinite().all(-1, keepdim=True)
    amax = x.float().unflatten(-1, (-1, 32)).abs().amax(-1, keepdim=True).where(finite, 1.0)  # before rounding
    grid = torch.exp2(torch.floor(torch.log2(amax)).clamp(min=-100) - 15)
    on_grid = torch.remainder(blocks.where(finite, 0.0), grid) == 0
    assert on_grid.all() and (blocks.abs() <= 2**16 * grid).where(finite, True).all()


def test_blocks_with_a_maximum_of_2_to_the_119_become_nan():
    below, at = torch.full((1, 32), 2.0**MAX_EXPONENT * 1.99), torch.full((1, 32), 2.0 ** (MAX_EXPONENT + 1))
    assert grid_hadamard_transform(below).isfinite().all()
    assert grid_hadamard_transform(at).isnan().all()
    assert grid_hadamard_transform(torch.cat((below[:, :31], torch.tensor([[float("inf")]])), 1)).isnan().all()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_prototype_kernels_split_wide_grid_values_into_two_exact_bf16_dots(dtype):
    """bfloat16 input runs in the script's dry run below; float16 and float32 take the hi + lo path."""
    x, signs = special_blocks(dtype, torch.device("cpu")), random_signs(32, 2)
    for axis, rounding in ((1, "nearest"), (0, "stochastic")):
        q = quantize_grid_triton(x, axis=axis, rounding=rounding, seed=9, signs=signs, block_m=16, block_n=128)
        ref = quantize_mx(grid_hadamard_transform(x, axis=axis, signs=signs), axis=axis, rounding=rounding, seed=9)
        assert torch.equal(q.data, ref.data) and torch.equal(q.scales, ref.scales), (dtype, axis)


def test_gpu_script_dry_run_is_bit_exact():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    script = ROOT / "benchmarks" / "quantize" / "hadamard_tensor_cores.py"
    run = subprocess.run(
        [sys.executable, str(script), "--dry-run"], env=env, capture_output=True, text=True, timeout=900
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "bit-exact: True (4/4 cases)" in run.stdout
    assert run.stdout.count(" us [") == 8  # 2 orientations x 2 roundings x (today, prototype)
