"""The backward half of the epilogue prototype (``benchmarks/quantize/epilogue/swiglu_backward.py``): one kernel
turns SwiGLU's output gradient into eager autograd's bf16 gradients of gate and up, bit for bit, and into
``quantize_fold_fp8`` of each (w1's and w3's dgrad operands), bit for bit in every field (Triton interpreter)."""

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from adahop.transforms import random_signs

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "quantize"))

from epilogue.device import bf16_bits, bf16_value  # noqa: E402
from epilogue.inputs import hard_rows, same_bits, same_epilogue  # noqa: E402
from epilogue.swiglu_backward import (  # noqa: E402
    silu_backward_bits,
    swiglu_backward_quantize_fold,
    swiglu_backward_quantize_fold_reference,
    swiglu_grads,
)

pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow|divide by zero):RuntimeWarning")
ROWS, COLS = 21, 96  # a partial program of rows; 3 blocks in a 4-block tile: BLOCK_N > N


def autograd_grads(grad, gate, up):
    gate, up = gate.clone().requires_grad_(), up.clone().requires_grad_()
    (F.silu(gate) * up).backward(grad)
    return gate.grad, up.grad


def hard_inputs(cols: int = COLS):
    return tuple(hard_rows(ROWS, cols, seed=seed) for seed in (11, 12, 13))


def assert_same(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name in want:
        checks = same_epilogue(got[name], want[name])
        assert all(checks.values()), (name, checks)


def test_the_reference_gradients_are_autograds_bit_for_bit():
    d, g, u = hard_inputs()
    for got, want in zip(swiglu_grads(d, g, u), autograd_grads(d, g, u)):
        assert same_bits(got, want)


@pytest.mark.parametrize("rounding", ("nearest", "stochastic"))
@pytest.mark.parametrize("hadamard_block_size", (0, 32))
def test_both_operands_equal_quantize_fold_of_autograds_gradients(rounding, hadamard_block_size):
    """Hard rows in d, g and u (outliers, NaN, Inf, zeros, -0, subnormals); each operand its own key."""
    d, g, u = hard_inputs()
    options = dict(rounding=rounding, seed_gate=7, seed_up=8, hadamard_block_size=hadamard_block_size)
    options["scores"] = rounding == "nearest"  # OE-left's dgrad records dY's row scores
    got = swiglu_backward_quantize_fold(d, g, u, **options)
    assert_same(got, swiglu_backward_quantize_fold_reference(d, g, u, **options))
    for name, want in zip(("gate", "up"), autograd_grads(d, g, u)):
        assert same_bits(got[name].output, want)


@pytest.mark.parametrize("outputs", (("gate",), ("up",)))
def test_one_launch_per_operand_with_silu_computed_and_signed_hadamard(outputs):
    d, g, u = hard_inputs(64)
    options = dict(rounding="stochastic", seed_gate=3, seed_up=5, hadamard_block_size=32,
                   signs=random_signs(32, seed=2), silu="math", write_grads=False, outputs=outputs)  # fmt: skip
    got = swiglu_backward_quantize_fold(d, g, u, **options)
    assert all(e.output is None and e.scores is None for e in got.values())
    assert_same(got, swiglu_backward_quantize_fold_reference(d, g, u, **options))


def test_the_two_keys_round_the_two_operands_differently():
    d, g, u = (torch.randn(16, 64, generator=torch.Generator().manual_seed(s)).bfloat16() for s in (1, 2, 3))
    options = dict(rounding="stochastic", write_grads=False, outputs=("up",))
    a = swiglu_backward_quantize_fold(d, g, u, seed_up=1, **options)["up"].folded.data.view(torch.uint8)
    b = swiglu_backward_quantize_fold(d, g, u, seed_up=2, **options)["up"].folded.data.view(torch.uint8)
    assert not torch.equal(a, b)


@triton.jit
def _dgate_kernel(d_ptr, g_ptr, u_ptr, out_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    d, g, u = tl.load(d_ptr + offs), tl.load(g_ptr + offs), tl.load(u_ptr + offs)
    dy = bf16_bits(bf16_value(d) * bf16_value(u), False)
    tl.store(out_ptr + offs, silu_backward_bits(dy, g, False))


def test_gate_gradient_rounds_as_eager_for_every_bf16_gate():
    """All 65,536 bf16 gates (NaNs, infinities and subnormals among them), each with random d and u over
    40 binades, twice: the kernel's dg against autograd's, bit for bit."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    for seed in (1, 2):
        d = hard_rows(8, gate.numel() // 8, seed=seed).flatten()
        u = hard_rows(8, gate.numel() // 8, seed=seed + 10).flatten()
        out = torch.empty_like(gate)
        _dgate_kernel[(1,)](*(t.view(torch.int16) for t in (d, gate, u, out)), N=gate.numel())
        assert same_bits(out, autograd_grads(d, gate, u)[0])


def test_inputs_the_kernel_does_not_take_get_one_clear_error():
    bf = torch.zeros(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bf16 grad, gate and up of one shape"):
        swiglu_backward_quantize_fold(bf, bf, bf.float())
    with pytest.raises(ValueError, match="bf16 grad, gate and up of one shape"):
        swiglu_backward_quantize_fold(bf, bf, bf[:2])
    with pytest.raises(ValueError, match="contiguous"):
        swiglu_backward_quantize_fold(bf.t(), bf.t(), bf.t())
    with pytest.raises(ValueError, match="whole blocks of 32"):
        swiglu_backward_quantize_fold(*(bf[:, :40].clone() for _ in range(3)))
    with pytest.raises(ValueError, match="hadamard_block_size 0 or 32"):
        swiglu_backward_quantize_fold(bf, bf, bf, hadamard_block_size=16)
    with pytest.raises(ValueError, match="outputs must be"):
        swiglu_backward_quantize_fold(bf, bf, bf, outputs=("down",))
    with pytest.raises(ValueError, match="silu must be one of"):
        swiglu_backward_quantize_fold(bf, bf, bf, silu="fast")
