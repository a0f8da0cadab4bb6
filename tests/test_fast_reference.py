"""``formats.fast`` (what the custom ops run on CPU) against the readable specification, bit for bit.

The specification is ``quantize_mx(hadamard_transform(x))``, ``MXTensor.dequantize_blocked`` and
``philox.noise_bits``; the oracle tests in test_formats.py run on both quantizers as well.
"""

import itertools

import pytest
import torch

from adahop import ops
from adahop.formats import (
    ELEMENT_FORMATS,
    ROUNDING_MODES,
    SCALE_RULES,
    philox,
    quantize_mx,
)
from adahop.formats import fast
from adahop.formats.fast import dequantize_blocked_fast, quantize_mx_fast
from adahop.gemm import QuantSpec, prepare_operand
from adahop.transforms import hadamard_transform, random_signs


def spec_quantize(x, fmt, axis, block_size, scale_rule, rounding, seed, hadamard_block_size=0, signs=None):
    if hadamard_block_size:
        x = hadamard_transform(x, axis=axis, block_size=hadamard_block_size, signs=signs)
    return quantize_mx(x, fmt, axis=axis, block_size=block_size, scale_rule=scale_rule, rounding=rounding, seed=seed)


def assert_same(
    x, fmt, axis=-1, block_size=32, scale_rule="floor", rounding="nearest", seed=0, hadamard_block_size=0, signs=None
):
    want = spec_quantize(x, fmt, axis, block_size, scale_rule, rounding, seed, hadamard_block_size, signs)
    got = quantize_mx_fast(
        x,
        fmt,
        axis=axis,
        block_size=block_size,
        scale_rule=scale_rule,
        rounding=rounding,
        seed=seed,
        hadamard_block_size=hadamard_block_size,
        signs=signs,
    )
    assert (got.fmt, got.axis, got.block_size, got.shape) == (want.fmt, want.axis, want.block_size, want.shape)
    assert got.data.dtype == want.data.dtype and torch.equal(got.data, want.data)
    assert got.scales.dtype == want.scales.dtype and torch.equal(got.scales, want.scales)
    assert got.data.is_contiguous() and got.scales.is_contiguous()
    # NaN blocks included: compare bit patterns
    assert torch.equal(dequantize_blocked_fast(want).view(torch.int32), want.dequantize_blocked().view(torch.int32))


def wide_range(shape, seed, dtype=torch.float32):
    """Normal values over 2**-40 .. 2**40, float32 subnormals, zeros of both signs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp2(torch.randint(-40, 40, shape, generator=g).float())
    flat = x.view(-1)
    flat[::13] *= 2.0**-100  # subnormal float32
    flat[5::17] = 0.0
    flat[7::19] = -0.0
    return x.to(dtype)


def with_specials(x):
    """NaN, +Inf, -Inf and -0.0 in some blocks (a NaN or Inf poisons its whole block)."""
    x = x.clone()
    flat = x.view(-1)
    flat[3], flat[len(flat) // 2], flat[-1] = float("nan"), float("inf"), float("-inf")
    flat[len(flat) // 3] = -float("nan")
    return x


# Layouts: blocks along rows (transposed once), along columns (K-major), a middle axis, 1-D;
# K not a multiple of the block (padding) and block sizes whose rows hold partial Philox calls.
LAYOUTS = [
    ((48, 96), 1, 32),
    ((96, 40), 0, 32),
    ((3, 70, 5), 1, 32),
    ((130,), 0, 32),
    ((6, 50), 1, 10),
    ((30, 7), 0, 6),
]


@pytest.mark.parametrize("rounding", ROUNDING_MODES)
@pytest.mark.parametrize("scale_rule", SCALE_RULES)
@pytest.mark.parametrize("fmt", list(ELEMENT_FORMATS))
def test_every_format_rule_rounding_and_layout(fmt, scale_rule, rounding):
    for i, (shape, axis, block) in enumerate(LAYOUTS):
        if fmt == "mxfp4" and block % 2:
            continue
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = wide_range(shape, seed=i)
            if dtype is not torch.float32:  # keep the values finite in the narrower types
                x = (x / x.abs().amax().clamp_min(1)).to(dtype)
            assert_same(x, fmt, axis, block, scale_rule, rounding, seed=100 + i)
            assert_same(with_specials(x), fmt, axis, block, scale_rule, rounding, seed=100 + i)


@pytest.mark.parametrize("rounding", ROUNDING_MODES)
@pytest.mark.parametrize("fmt", list(ELEMENT_FORMATS))
def test_with_the_inner_hadamard_transform(fmt, rounding):
    for (shape, axis), hb, signed, dtype in itertools.product(
        [((40, 64), 1), ((64, 24), 0), ((2, 128, 3), 1)], (16, 32, 64), (False, True), (torch.float32, torch.bfloat16)
    ):
        x = wide_range(shape, seed=hb).clamp(-1e30, 1e30).to(dtype)
        signs = random_signs(hb, seed=3) if signed else None
        assert_same(x, fmt, axis, 32, "floor", rounding, seed=2**40 + hb, hadamard_block_size=hb, signs=signs)
        assert_same(with_specials(x), fmt, axis, 32, "floor", rounding, seed=5, hadamard_block_size=hb, signs=signs)


@pytest.mark.parametrize("fmt", list(ELEMENT_FORMATS))
def test_ties_saturation_and_extreme_scales(fmt):
    """Every E2M1 midpoint (a tie), values just off them, saturation, and blocks at both ends of
    E8M0's range, for every rule; the sums of stochastic rounding just below an integer."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mids = (grid[1:] + grid[:-1]) / 2
    near = torch.cat([mids, torch.nextafter(mids, torch.zeros(7)), torch.nextafter(mids, torch.full((7,), 9.0))])
    row = torch.cat([torch.tensor([4.0]), near, -near[:7], torch.tensor([7.9, 5.9, 0.1, -0.1])])[:32]
    x = torch.stack([row, row * 2.0**-130, row * 2.0**100, row * 2.0**-149 * 3, row * 3.0e38 / 8])
    x = torch.cat([x, torch.tensor([[3.4e38] * 32, [1e-45] * 32])])
    for rule, rounding in itertools.product(SCALE_RULES, ROUNDING_MODES):
        for seed in (0, 1, 2**64 - 1):
            assert_same(x, fmt, -1, 32, rule, rounding, seed)
            assert_same(x.t().contiguous(), fmt, 0, 32, rule, rounding, seed)


def test_many_random_inputs():
    gen = torch.Generator().manual_seed(0)
    for i in range(40):
        rows, k = torch.randint(1, 20, (2,), generator=gen).tolist()
        k *= 16
        fmt = list(ELEMENT_FORMATS)[i % 3]
        x = wide_range((rows, k), seed=i)
        kw = {"scale_rule": SCALE_RULES[i % 4], "rounding": ROUNDING_MODES[(i // 4) % 2], "seed": i * 7919}
        assert_same(x, fmt, 1, 32, **kw, hadamard_block_size=16 * (i % 2))
        assert_same(x.t().contiguous(), fmt, 0, 16, **kw)


def test_cached_counters_serve_every_call_of_a_shape():
    """The second and later stochastic calls of a shape reuse its Philox counters (an LRU of
    tensors): they must give the spec's bits for every seed, and the counters stay untouched."""
    x = wide_range((64, 96), seed=9)
    for axis, source in ((1, x), (0, x.t().contiguous())):
        for seed in (1, 2, 2**63 + 5, 1):
            assert_same(source, "mxfp4", axis, 32, "floor", "stochastic", seed, hadamard_block_size=32)
    counters = fast._run_counters(1, 12, 64, x.device)
    assert torch.equal(counters, torch.arange(12 * 64).view(64, 12).t().unsqueeze(0))


def test_noise_runs_are_noise_bits():
    for seed in (0, 7, 2**32 + 1, 2**40 + 3, 2**64 - 1):
        counters = torch.tensor([0, 1, 2, 2**29 + 5, 2**32 - 1, 2**32, 2**40 + 9, 2**58 + 17])
        want = philox.noise_bits(seed, counters[:, None] * 16 + torch.arange(16))
        assert torch.equal(philox.noise_runs(seed, counters).long(), want)
        grid = torch.arange(24).view(2, 3, 4) * 1000003
        want = philox.noise_bits(seed, grid.unsqueeze(2) * 16 + torch.arange(16).view(1, 1, 16, 1))
        assert torch.equal(philox.noise_runs(seed, grid, dim=2).long(), want)
        stream = philox.noise_runs(seed, torch.arange(512)).flatten()
        assert torch.equal(stream.long(), philox.noise_bits(seed, torch.arange(8192)))


@pytest.mark.parametrize("strategy,rounding", [("mxfp4", "nearest"), ("iht", "nearest"), ("iht", "stochastic")])
def test_cpu_custom_ops_are_the_reference(strategy, rounding):
    """What AdaHOPLinear runs on CPU (both orientations) against the ops' reference functions."""
    x = wide_range((96, 64), seed=1)
    spec = QuantSpec(rounding=rounding)
    for t in (x, x.t()):
        got = prepare_operand(t, strategy, "L", spec, seed=3).quantized
        source, axis = (t, 1) if t.is_contiguous() else (t.t(), 0)
        hadamard = 32 if strategy == "iht" else 0
        data, scales, _ = ops._quantize_reference(
            source, "mxfp4", axis, 32, "floor", rounding, torch.tensor(3), hadamard, None, False
        )
        assert torch.equal(got.data, data) and torch.equal(got.scales, scales)
    a = prepare_operand(x, strategy, "L", spec, seed=4).quantized
    b = prepare_operand(with_specials(x[:40]), strategy, "R", spec, seed=5).quantized
    got = ops.mx_matmul(a, b, torch.float32)
    want = ops._matmul_reference(a.data, a.scales, b.data, b.scales, "mxfp4", 32, torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
