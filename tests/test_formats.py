"""The reference MX quantizer against independent oracles.

Oracle 1 (float64 + ml_dtypes): the OCP floor scale from the exponent of amax computed in float64,
elements cast by ml_dtypes (round-to-nearest-even, saturating). Oracle 2: torchao's ``to_mx``.
Each quantizer test runs on the specification and on ``formats.fast``, the route the custom ops take
on CPU (test_fast_reference.py compares the two bit for bit).
"""

import math

import ml_dtypes
import numpy as np
import pytest
import torch

from adahop import quantize_mx
from adahop.formats import philox
from adahop.formats.elements import E2M1, E4M3, element_quantum, round_to_element
from adahop.formats.fast import quantize_mx_fast

ML_DTYPES = {
    "mxfp4": ml_dtypes.float4_e2m1fn,
    "mxfp8_e4m3": ml_dtypes.float8_e4m3fn,
    "mxfp8_e5m2": ml_dtypes.float8_e5m2,
}
EMAX = {"mxfp4": 2, "mxfp8_e4m3": 8, "mxfp8_e5m2": 15}
MAX_NORMAL = {"mxfp4": 6.0, "mxfp8_e4m3": 448.0, "mxfp8_e5m2": 57344.0}


def oracle_floor(x: torch.Tensor, fmt: str, axis: int = -1, block: int = 32) -> torch.Tensor:
    """Dequantized values per the OCP spec, computed independently in float64 + ml_dtypes."""
    v = x.double().movedim(axis, -1)
    n = v.shape[-1]
    pad = -n % block
    v = torch.nn.functional.pad(v, (0, pad)).unflatten(-1, (-1, block))
    amax = v.abs().amax(-1, keepdim=True)
    exp = torch.where(amax > 0, torch.floor(torch.log2(amax)), torch.full_like(amax, -1000.0))
    shared = torch.clamp(exp - EMAX[fmt], -127, 127)
    scaled = (v / 2.0**shared).numpy()
    mx = np.clip(scaled, -MAX_NORMAL[fmt], MAX_NORMAL[fmt])  # ml_dtypes fp8 casts do not saturate
    elem = torch.from_numpy(mx.astype(ML_DTYPES[fmt]).astype(np.float64))
    out = (elem * 2.0**shared).flatten(-2)[..., :n]
    return out.movedim(-1, axis)


@pytest.fixture(params=["spec", "fast"])
def quantize(request):
    return quantize_mx if request.param == "spec" else quantize_mx_fast


def wide_range(shape, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    mag = torch.exp2(torch.randint(-40, 40, shape, generator=g).float())
    x = torch.randn(shape, generator=g) * mag
    return x.to(dtype)


@pytest.mark.parametrize("fmt", list(ML_DTYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_floor_matches_ml_dtypes_oracle(fmt, dtype, quantize):
    x = torch.randn(16, 96, generator=torch.Generator().manual_seed(1)).to(dtype)
    x[0] *= 1e-3
    x[1, :32] = 0.0  # a zero block
    got = quantize(x, fmt).dequantize(torch.float64)
    assert torch.equal(got, oracle_floor(x, fmt))


@pytest.mark.parametrize("fmt", list(ML_DTYPES))
def test_every_rounding_tie_and_saturation(fmt, quantize):
    """Each block holds amax 4 (scale 1 for FP4) plus midpoints between every pair of grid values."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mids = (grid[1:] + grid[:-1]) / 2  # 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0: all ties
    vals = torch.cat([mids, -mids, torch.tensor([6.5, 7.0, 7.9, -7.0, 5.9, 0.1, -0.1])])
    x = torch.cat([torch.tensor([4.0]), vals, torch.zeros(32 - 1 - len(vals))]).repeat(3, 1)
    x[1] *= 2.0**-130  # tiny blocks: scale clamped at 2**-127
    x[2] *= 2.0**100
    got = quantize(x, fmt).dequantize(torch.float64)
    assert torch.equal(got, oracle_floor(x, fmt))
    if fmt == "mxfp4":
        row = got[0]
        assert row[1:8].tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # ties to even
        assert row[15:18].tolist() == [6.0, 6.0, 6.0]  # saturation, never Inf


@pytest.mark.parametrize("fmt", list(ML_DTYPES))
def test_wide_dynamic_range_and_fp32_subnormals(fmt, quantize):
    x = wide_range((8, 256))
    x[3] = torch.randn(256) * 1e-39  # fp32 subnormals
    x[4, :16] = torch.tensor(1e-45)  # the smallest subnormal
    got = quantize(x, fmt).dequantize(torch.float64)
    assert torch.equal(got, oracle_floor(x, fmt))


@pytest.mark.parametrize("shape,axis", [((5, 70), -1), ((70, 5), 0), ((3, 33, 4), 1), ((1,), 0)])
def test_odd_sizes_and_axes(shape, axis, quantize):
    x = wide_range(shape, seed=3)
    q = quantize(x, "mxfp4", axis=axis)
    assert q.shape == x.shape
    assert q.dequantize().shape == x.shape
    n_blocks = math.ceil(x.shape[axis] / 32)
    other = [s for i, s in enumerate(x.shape) if i != axis % x.dim()]
    assert q.scales.shape == (*other, n_blocks)
    assert q.data.shape == (*other, n_blocks * 16)
    assert torch.equal(q.dequantize(torch.float64), oracle_floor(x, "mxfp4", axis=axis))


def test_packing_low_nibble_first_and_nbytes(quantize):
    x = torch.zeros(32)
    x[0], x[1], x[31] = 4.0, -0.5, 1.0  # amax 4 -> scale 2**0
    q = quantize(x)
    assert q.data[0].item() == (0b1001 << 4) | 0b0110  # -0.5 high nibble, 4.0 low nibble
    assert q.data[15].item() == 0b0010 << 4
    assert q.scales.tolist() == [127]
    assert q.nbytes == 16 + 1


def test_nan_and_inf_poison_only_their_block(quantize):
    x = torch.randn(2, 96)
    x[0, 5] = float("nan")
    x[1, 70] = float("inf")
    q = quantize(x)
    assert q.scales[0].tolist()[0] == 255 and q.scales[1].tolist()[2] == 255
    d = q.dequantize()
    assert torch.isnan(d[0, :32]).all() and torch.isnan(d[1, 64:]).all()
    assert torch.isfinite(d[0, 32:]).all() and torch.isfinite(d[1, :64]).all()


TORCHAO_MODES = ["floor", "ceil", "even", "rceil"]


@pytest.mark.parametrize("rule", TORCHAO_MODES)
@pytest.mark.parametrize("fmt", list(ML_DTYPES))
def test_bit_exact_with_torchao(rule, fmt, quantize):
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    elem = {
        "mxfp4": torch.float4_e2m1fn_x2,
        "mxfp8_e4m3": torch.float8_e4m3fn,
        "mxfp8_e5m2": torch.float8_e5m2,
    }[fmt]
    # torchao divides by max(scale, 2**-126), so blocks at the scale floor are left out.
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(7))
    x *= torch.exp2(torch.randint(-30, 30, (64, 1), generator=torch.Generator().manual_seed(8)))
    x[0, :32] = 0.0
    x[1, :32] = torch.tensor([0.25, 0.75, 1.25, 2.5, 3.5, 5.0, 7.0, 4.0] * 4)
    scale, data = mx_tensor.to_mx(x, elem, 32, getattr(ScaleCalculationMode, rule.upper()))
    q = quantize(x, fmt, scale_rule=rule)
    assert torch.equal(q.scales, scale.view(torch.uint8))
    assert torch.equal(q.data, data.view(torch.uint8))


@pytest.mark.parametrize("rule", ["ceil", "rceil"])
def test_ceil_rules_never_clip(rule, quantize):
    x = wide_range((32, 128), seed=5)
    q = quantize(x, scale_rule=rule)
    blocks = x.view(32, 4, 32)
    scale = torch.exp2(q.scales.double() - 127)
    assert (blocks.abs().amax(-1).double() / scale <= 6.0).all()


def test_stochastic_rounding_is_unbiased_and_reproducible(quantize):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    x[:, 0] = 3.0  # fixed amax per first block so the scale rule never clips below it
    x[:, 32] = -3.0
    a = quantize(x, rounding="stochastic", seed=11, scale_rule="rceil")
    b = quantize(x, rounding="stochastic", seed=11, scale_rule="rceil")
    c = quantize(x, rounding="stochastic", seed=12, scale_rule="rceil")
    assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)
    n = 2000
    mean = sum(
        quantize(x, rounding="stochastic", seed=s, scale_rule="rceil").dequantize(torch.float64)
        for s in range(n)
    ) / n
    rn_err = (quantize(x, scale_rule="rceil").dequantize(torch.float64) - x.double()).abs().mean()
    # The mean of n draws lands within a few standard errors (<= quantum / (2 sqrt n)) of x.
    quantum = torch.exp2(torch.floor(torch.log2(x.double().abs().clamp_min(0.5))) - 1)
    assert ((mean - x.double()).abs() <= 5 * quantum / (2 * math.sqrt(n)) + 1e-12).all()
    assert (mean - x.double()).abs().mean() < rn_err / 10


@pytest.mark.parametrize("fmt", (E2M1, E4M3))
def test_stochastic_rounding_adds_the_noise_exactly(fmt):
    """floor(|v| / quantum + noise) in exact (float64) arithmetic, float32 inputs with all 24 bits."""
    gen = torch.Generator().manual_seed(1)
    v = (torch.rand(1 << 16, generator=gen) * fmt.max_normal).float()
    v[:4] = torch.tensor([0.7500001, 1.9999999, 3.4999998, 1e-30])  # sums just below an integer
    noise = torch.randint(0, 1 << 16, v.shape, generator=gen).float() / 2**16
    noise[:4] = 1 - 2**-16
    got = round_to_element(v, fmt, noise).double()
    quantum = element_quantum(v, fmt).double()
    want = torch.clamp(torch.floor(v.double() / quantum + noise.double()) * quantum, max=fmt.max_normal)
    assert torch.equal(got, want)


def test_stochastic_rounding_values_straddle_the_grid(quantize):
    x = torch.full((1, 32), 2.4)
    x[0, 0] = 4.0
    draws = torch.stack([quantize(x, rounding="stochastic", seed=s).dequantize()[0, 1] for s in range(200)])
    assert set(draws.tolist()) == {2.0, 3.0}  # only the two neighbours
    assert abs(draws.double().mean().item() - 2.4) < 0.1


def numpy_philox4x32_10(key: int, counters: np.ndarray) -> np.ndarray:
    """Philox4x32-10 for 128-bit counters ``[n, 4]`` (uint32), from the Random123 definition."""
    mask = np.uint64(0xFFFFFFFF)
    c = [counters[:, i].astype(np.uint64) for i in range(4)]
    k0, k1 = np.uint64(key & 0xFFFFFFFF), np.uint64(key >> 32)
    for _ in range(10):
        prod_a = np.uint64(0xD2511F53) * c[0]  # < 2**64: exact in uint64
        prod_b = np.uint64(0xCD9E8D57) * c[2]
        c = [(prod_b >> np.uint64(32)) ^ c[1] ^ k0, prod_b & mask,
             (prod_a >> np.uint64(32)) ^ c[3] ^ k1, prod_a & mask]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return np.stack(c, axis=-1)


def test_philox_matches_published_known_answer():
    # Random123 kat_vectors, philox4x32-10: counter 0, key 0.
    words = philox.philox4x32(0, torch.tensor([0]))[0].tolist()
    assert words == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3, 2**64 - 1])
def test_noise_uses_both_halves_of_all_four_philox_words_in_order(seed):
    offsets = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 2**32 + 1, 2**34 - 1, 2**40 + 6, 2**62 + 3])
    o = offsets.numpy().astype(np.uint64)
    counters = o // np.uint64(8)
    ctr = np.zeros((len(counters), 4), dtype=np.uint64)
    ctr[:, 0], ctr[:, 1] = counters & np.uint64(0xFFFFFFFF), counters >> np.uint64(32)
    words = numpy_philox4x32_10(seed, ctr)[np.arange(len(o)), ((o // np.uint64(2)) % np.uint64(4)).astype(int)]
    halves = (words >> (np.uint64(16) * (o % np.uint64(2)))) & np.uint64(0xFFFF)
    assert np.array_equal(philox.noise_bits(seed, offsets).numpy().astype(np.uint64), halves)
    want = halves.astype(np.float64) / 2**16
    assert np.array_equal(philox.uniform(seed, offsets).numpy().astype(np.float64), want)


def test_uniform_noise_statistics():
    """Mean, variance and neighbour correlations of 2**20 draws within 5 standard errors."""
    n = 1 << 20
    u = philox.uniform(12345, torch.arange(n)).double()
    assert torch.equal(u * 2**16, torch.floor(u * 2**16)) and 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 5 * math.sqrt(1 / 12 / n)
    assert abs(u.var().item() - 1 / 12) < 5 * math.sqrt((1 / 80 - 1 / 144) / n)
    c = u - 0.5
    calls = c.view(-1, 8)
    pairs = {
        "lag 1": (c[:-1], c[1:]),
        "same word": (calls[:, 0], calls[:, 1]),  # the two halves of one Philox word
        "same call": (calls[:, 1], calls[:, 2]),  # neighbouring words of one call
        "next call": (calls[:-1, 7], calls[1:, 0]),
        "next seed": (c, philox.uniform(12346, torch.arange(n)).double() - 0.5),
    }
    for name, (a, b) in pairs.items():
        corr = (a * b).mean() / (a.std() * b.std())
        assert abs(corr.item()) < 5 / math.sqrt(len(a)), name


@pytest.mark.parametrize(
    "kwargs,err",
    [
        ({"fmt": "mxfp3"}, ValueError),
        ({"scale_rule": "round"}, ValueError),
        ({"rounding": "up"}, ValueError),
        ({"block_size": 0}, ValueError),
    ],
)
def test_bad_arguments_are_clear_errors(kwargs, err, quantize):
    with pytest.raises(err, match="choose one of|must be"):
        quantize(torch.randn(4, 32), **kwargs)


def test_integer_input_is_rejected(quantize):
    with pytest.raises(TypeError, match="supports"):
        quantize(torch.arange(32))
