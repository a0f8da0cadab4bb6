"""The epilogue prototype of ``benchmarks/quantize/epilogue`` (issue #30's "quantize where the tensor is
produced", outside ``src``): the fused SwiGLU and RMSNorm quantize-fold kernels equal the composition they
replace, ``quantize_fold_fp8(producer output)``, bit for bit in every field (Triton interpreter), their bf16
outputs equal the producer's, and ``epilogue_ab.py --dry-run`` keeps the GPU script working."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from adahop.models.llama import RMSNorm
from adahop.transforms import random_signs

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks" / "quantize"))

from epilogue.inputs import hard_rows, same_bits, same_epilogue  # noqa: E402
from epilogue.rmsnorm import rmsnorm_quantize_fold, rmsnorm_quantize_fold_reference, rmsnorm_reference  # noqa: E402
from epilogue.swiglu import silu_product, silu_table, swiglu_quantize_fold, swiglu_quantize_fold_reference  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow|divide by zero):RuntimeWarning")
ROWS, COLS = 21, 96  # a partial program of rows; 3 blocks in a 4-block tile: BLOCK_N > N


def assert_same(got, want) -> None:
    checks = same_epilogue(got, want)
    assert all(checks.values()), checks


@pytest.mark.parametrize("rounding", ("nearest", "stochastic"))
@pytest.mark.parametrize("hadamard_block_size", (0, 32))
def test_swiglu_equals_quantize_fold_of_the_eager_product(rounding, hadamard_block_size):
    gate, up = hard_rows(ROWS, COLS, seed=1), hard_rows(ROWS, COLS, seed=2)
    options = dict(rounding=rounding, seed=7, hadamard_block_size=hadamard_block_size, write_product=True)
    options["scores"] = rounding == "nearest"  # OE-left's forward records row scores from the same read
    assert_same(swiglu_quantize_fold(gate, up, **options), swiglu_quantize_fold_reference(gate, up, **options))


def test_swiglu_with_silu_computed_without_the_product_and_with_signed_hadamard():
    gate, up = hard_rows(ROWS, 64, seed=3), hard_rows(ROWS, 64, seed=4)
    options = dict(rounding="stochastic", seed=3, hadamard_block_size=32, signs=random_signs(32, seed=1), silu="math")
    got = swiglu_quantize_fold(gate, up, **options)
    assert got.output is None and got.scores is None
    assert_same(got, swiglu_quantize_fold_reference(gate, up, **options))


@triton.jit
def _silu_product_kernel(g_ptr, u_ptr, table_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    tl.store(out_ptr + offs, silu_product(tl.load(g_ptr + offs), tl.load(u_ptr + offs), table_ptr, False))


@pytest.mark.parametrize("silu", ("table", "math"))
def test_silu_product_rounds_as_eager_for_every_bf16_gate(silu):
    """All 65,536 bf16 gates (silu depends on nothing else), times 1 and times a random up."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    table = silu_table(gate.device) if silu == "table" else None
    for up in (torch.ones_like(gate), hard_rows(8, gate.numel() // 8, seed=5).flatten()):
        out = torch.empty_like(gate)
        _silu_product_kernel[(1,)](
            gate.view(torch.int16), up.view(torch.int16), table, out.view(torch.int16), N=gate.numel()
        )
        assert same_bits(out, F.silu(gate) * up)


@pytest.mark.parametrize("rounding", ("nearest", "stochastic"))
@pytest.mark.parametrize("hadamard_block_size", (0, 32))
def test_rmsnorm_of_a_float32_residual_equals_quantize_fold_of_the_spec(rounding, hadamard_block_size):
    """Single-GPU training: a float32 residual stream and weight (autocast), X cast to bf16 by the linear."""
    h, weight = hard_rows(ROWS, COLS, seed=6, dtype=torch.float32), 1 + 0.1 * torch.randn(COLS)
    options = dict(rounding=rounding, seed=5, hadamard_block_size=hadamard_block_size, write_output=True)
    got = rmsnorm_quantize_fold(h, weight, 1e-5, **options)
    assert_same(got, rmsnorm_quantize_fold_reference(h, weight, 1e-5, **options))


@pytest.mark.parametrize("h_dtype,w_dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16)])
def test_rmsnorm_of_bf16_inputs_equals_quantize_fold_of_the_spec(h_dtype, w_dtype):
    """FSDP2's bf16 parameters (and a bf16 weight on a float32 stream): the model's casts in between."""
    h, weight = hard_rows(ROWS, 64, seed=8, dtype=h_dtype), torch.rand(64).to(w_dtype) + 0.5
    options = dict(rounding="stochastic", seed=9, hadamard_block_size=32, scores=True, write_output=True)
    assert_same(rmsnorm_quantize_fold(h, weight, 1e-6, **options), rmsnorm_quantize_fold_reference(h, weight, 1e-6, **options))  # fmt: skip


@pytest.mark.parametrize("h_dtype", (torch.float32, torch.bfloat16))
def test_rmsnorm_spec_matches_the_models_rmsnorm_within_one_bf16_ulp(h_dtype):
    """The spec pins down the sum order and rsqrt that eager leaves to the device: it differs from
    ``models.llama.RMSNorm`` (then the cast to bf16) only where those roundings land differently."""
    gen = torch.Generator().manual_seed(0)
    h = (torch.randn(256, 3072, generator=gen) * torch.randn(256, 1, generator=gen).exp()).to(h_dtype)
    norm = RMSNorm(3072, 1e-5).to(h_dtype)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.1 * torch.randn(3072, generator=gen))
        eager = norm(h).to(torch.bfloat16)
    spec = rmsnorm_reference(h, norm.weight.detach(), 1e-5)
    ulps = (eager.view(torch.int16).int() - spec.view(torch.int16).int()).abs()
    assert ulps.max() <= 1 and (ulps > 0).float().mean() < 1e-3


def test_inputs_the_kernels_do_not_take_get_one_clear_error():
    bf = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        swiglu_quantize_fold(bf[:, :40].clone(), bf[:, :40].clone())
    with pytest.raises(ValueError, match="bf16 gate and up of one shape"):
        swiglu_quantize_fold(bf, bf.half())
    with pytest.raises(ValueError, match="contiguous"):
        swiglu_quantize_fold(bf.t(), bf.t())
    with pytest.raises(ValueError, match="silu must be one of"):
        swiglu_quantize_fold(bf, bf, silu="fast")
    with pytest.raises(ValueError, match="hadamard_block_size 0 or 32"):
        swiglu_quantize_fold(bf, bf, hadamard_block_size=16)
    with pytest.raises(ValueError, match="h \\[M, N\\] and weight \\[N\\]"):
        rmsnorm_quantize_fold(bf, torch.ones(32), 1e-5)
    with pytest.raises(ValueError, match="whole blocks of 32"):
        rmsnorm_quantize_fold(bf[:, :48].clone(), torch.ones(48), 1e-5)


@pytest.mark.slow  # about 40 s: both producers' checks and timings, then SwiGLU's backward, in the interpreter
def test_gpu_script_dry_run_is_bit_exact(tmp_path):
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    script = ROOT / "benchmarks" / "quantize" / "epilogue" / "epilogue_ab.py"
    run = subprocess.run(
        [sys.executable, str(script), "--dry-run", "--out", str(tmp_path)],
        env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "bit-exact: True" in run.stdout
    assert (tmp_path / "epilogue_ab.json").exists() and "| producer |" in run.stdout
    assert "| SwiGLU backward |" in (tmp_path / "epilogue_ab.md").read_text()  # the backward stage ran too
