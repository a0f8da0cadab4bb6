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
from adahop.formats.elements import E2M1, E4M3, E5M2, round_to_element
from adahop.formats.fast import quantize_mx_fast

import mx_oracle

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
    x[2:4] = x[2:4].clamp(-1.9, 1.9)
    x[2, ::32] = 2.0  # power-of-two block maxima: the floor and ceil scales differ here
    x[3, 1::32] = -(2.0**-7)
    got = quantize(x, fmt).dequantize(torch.float64)
    assert torch.equal(got, oracle_floor(x, fmt))


@pytest.mark.parametrize("fmt", list(ML_DTYPES))
def test_every_rounding_tie_and_saturation(fmt, quantize):
    """Midpoints between every pair of E2M1 grid values, and values past 6.

    Each block's amax is 7.9 (4.0 and 7.9 share a binade, so the floor scale is 2**0 for FP4 and
    6.5, 7.0 and 7.9 saturate to 6); rows 1 and 2 are that block times 2**-130 and 2**100.
    """
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
    x[2:6] = x[2:6].clamp(-0.9, 0.9)
    x[2:6, ::32] = torch.tensor([[1.0], [-(2.0**-9)], [2.0**12], [1.0 - 2**-24]])  # powers of two, and just below
    scale, data = mx_tensor.to_mx(x, elem, 32, getattr(ScaleCalculationMode, rule.upper()))
    q = quantize(x, fmt, scale_rule=rule)
    assert torch.equal(q.scales, scale.view(torch.uint8))
    assert torch.equal(q.data, data.view(torch.uint8))


@pytest.mark.parametrize("fmt", list(ML_DTYPES))
def test_rceil_on_blocks_whose_descale_is_a_float32_subnormal(fmt):
    """amax / max_normal below 2**-126: ceil(log2) of the subnormal, as torchao and the oracle
    (adahop gave 2**-126 for every nonzero subnormal descale until issue 17)."""
    mx_tensor = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    from torchao.prototype.mx_formats.config import ScaleCalculationMode

    elem = {"mxfp4": torch.float4_e2m1fn_x2, "mxfp8_e4m3": torch.float8_e4m3fn, "mxfp8_e5m2": torch.float8_e5m2}[fmt]
    m = MAX_NORMAL[fmt]
    maxima = torch.tensor([m * 2.0**-127, m * 1.5 * 2.0**-127, m * 0.99 * 2.0**-126, m * 2.0**-130, 1e-45, 1e-39])
    x = torch.zeros(len(maxima), 32)
    x[:, 0] = maxima.float()
    x[:, 1] = -maxima.float() / 3
    q = quantize_mx(x, fmt, scale_rule="rceil")
    data, scales = mx_oracle.quantize(x, fmt, "rceil")
    assert np.array_equal(q.scales.numpy(), scales) and np.array_equal(q.data.numpy(), data)
    scale, _ = mx_tensor.to_mx(x, elem, 32, ScaleCalculationMode.RCEIL)
    assert torch.equal(q.scales, scale.view(torch.uint8))
    assert q.scales[:, 0].tolist()[:3] == [0, 1, 1]


@pytest.mark.parametrize("rule", ["ceil", "rceil"])
def test_ceil_rules_never_clip(rule, quantize):
    x = wide_range((32, 128), seed=5)
    q = quantize(x, scale_rule=rule)
    blocks = x.view(32, 4, 32)
    scale = torch.exp2(q.scales.double() - 127)
    assert (blocks.abs().amax(-1).double() / scale <= 6.0).all()


def test_stochastic_rounding_is_reproducible(quantize):
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    a = quantize(x, rounding="stochastic", seed=11)
    b = quantize(x, rounding="stochastic", seed=11)
    c = quantize(x, rounding="stochastic", seed=12)
    assert torch.equal(a.data, b.data) and not torch.equal(a.data, c.data)


def element_quantum_oracle(a: np.ndarray, fmt: str) -> np.ndarray:
    """Grid spacing 2**(max(floor(log2 a), emin) - mbits) by float64 frexp (not adahop's)."""
    mbits, emin = mx_oracle.FORMATS[fmt][:2]
    _, e = np.frexp(a)
    return np.exp2(np.maximum(e - 1, emin) - mbits)


@pytest.mark.usefixtures("one_thread")  # int64 Philox on 256k elements: 2 threads are slower when busy
@pytest.mark.parametrize("rule", mx_oracle.RULES)
@pytest.mark.parametrize("fmt", list(ML_DTYPES))
def test_stochastic_rounding_is_unbiased(fmt, rule):
    """The mean of n draws of each element is within 5 of its own standard errors of the value.

    The draws are n copies of one Gaussian [4, 64] in one call (each copy has its own noise
    offsets). Each element's quantum and rounding probability come from the scale of *its*
    block, read off the output (the oracle tests pin scales down): blocks do not share a scale.
    Values a rule lets past ``max_normal`` saturate in every draw, and are checked to.
    """
    n = 1000
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    x[0, :32] *= 2.0**-20
    x[1, 32] = 4.0  # a power-of-two block maximum
    draws = quantize_mx(x.expand(n, 4, 64), fmt, rounding="stochastic", seed=5, scale_rule=rule)
    values = draws.dequantize(torch.float64).numpy()
    mean = values.mean(0)
    scale = np.exp2(draws.scales[0].numpy().astype(np.float64) - 127).repeat(32, axis=-1)
    xd = x.double().numpy()
    a = np.abs(xd) / scale
    quantum = element_quantum_oracle(a, fmt)
    p = a / quantum - np.floor(a / quantum)  # probability of rounding up
    sigma = quantum * scale * np.sqrt(p * (1 - p) / n)
    inside = a <= MAX_NORMAL[fmt]
    bound = 5 * sigma + 2.0**-8 * quantum * scale  # plus the bias of noise on a 2**-8 grid (float32 input)
    assert (np.abs(mean - xd)[inside] <= bound[inside]).all()
    saturated = np.copysign(MAX_NORMAL[fmt] * scale, xd)[~inside]
    assert (values[:, ~inside] == saturated).all()
    assert inside.all() or rule in ("floor", "even")  # ceil and rceil never clip
    rn = quantize_mx(x, fmt, scale_rule=rule).dequantize(torch.float64).numpy()
    assert np.abs(mean - xd)[inside].mean() < np.abs(rn - xd)[inside].mean() / 10


@pytest.mark.parametrize("fmt", (E2M1, E4M3, E5M2), ids=lambda f: f.name)
def test_stochastic_rounding_adds_the_noise_exactly(fmt):
    """round_to_element against integer arithmetic, floor(|v| / quantum * 2**8 + n) // 2**8.

    Float32 inputs with all 24 bits, over the element range and its subnormals; two thirds of
    the noise values are chosen so that the sum lands exactly on an integer or one 2**-8 step
    below it, where truncating the fixed-point steps any other way changes the result.
    """
    name = {"e2m1": "mxfp4", "e4m3": "mxfp8_e4m3", "e5m2": "mxfp8_e5m2"}[fmt.name]
    rng = np.random.default_rng(1)
    size = 1 << 15
    a = np.exp2(rng.uniform(fmt.emin - fmt.mbits - 2, math.log2(fmt.max_normal) + 0.3, size))
    v = (a * np.where(rng.random(size) < 0.5, -1, 1)).astype(np.float32)
    a = np.abs(v).astype(np.float64)
    quantum = element_quantum_oracle(a, name)
    fixed = np.floor(a / quantum * 2.0**8).astype(np.int64)  # exact: a power-of-two scaling
    choice = rng.integers(0, 3, size)
    n = np.where(choice == 0, (-fixed - 1) % 2**8, np.where(choice == 1, (-fixed) % 2**8, rng.integers(0, 2**8, size)))
    want = np.copysign(np.minimum(((fixed + n) >> 8) * quantum, fmt.max_normal), v)
    got = round_to_element(torch.from_numpy(v), fmt, torch.from_numpy(n / 2.0**8).float())
    assert np.array_equal(got.double().numpy(), want)
    assert np.array_equal(np.signbit(got.numpy()), np.signbit(v))


def every_value(dtype: torch.dtype, low: float, high: float) -> torch.Tensor:
    """Every value of ``dtype`` in [low, high], as float32 (each exact in float32)."""
    bits = torch.arange(2**16, dtype=torch.int32).to(torch.int16).view(dtype)
    v = bits.float()
    return v[(v >= low) & (v <= high)].unique()


def sr_shortfall(y: torch.Tensor, fmt) -> tuple[np.ndarray, np.ndarray]:
    """How far each value's mean over all 256 noise values, through the reference's rounding,
    falls short of it in magnitude (positive: toward zero), and its quantum (float64 frexp, not
    adahop's). float64 is exact here: every rounded value is a multiple of the smallest quantum
    below ``256 * max_normal``, at most 2**40 such steps, and the inputs have at most 11 bits."""
    noise = torch.arange(256, dtype=torch.float32) / 256
    rounded = round_to_element(y[:, None].expand(-1, 256), fmt, noise.expand(len(y), -1)).double().numpy()
    a = y.double().numpy()
    assert np.array_equal(np.signbit(rounded), np.signbit(a)[:, None].repeat(256, 1))  # the sign is kept
    _, e = np.frexp(np.abs(a))
    return np.abs(a) - np.abs(rounded).sum(1) / 256, np.exp2(np.maximum(e - 1, fmt.emin) - fmt.mbits)


@pytest.mark.parametrize("fmt", (E2M1, E4M3, E5M2), ids=lambda f: f.name)
def test_8_bit_noise_is_exactly_unbiased_on_bfloat16_inputs(fmt):
    """Every bfloat16 value from six binades below half the smallest quantum up to ``max_normal``
    (both signs), rounded with each of the 256 noise values: the mean is the value exactly from
    half the smallest quantum up (``|y| / quantum`` has at most 8 fractional bits there); below,
    it falls short by less than ``quantum / 256``, toward zero, and does fall short (the threshold
    is tight). float16 values, with 3 more significant bits, keep the bound everywhere. The block
    scale is a power of two, so a quantizer's scaled bfloat16 inputs are such values.
    """
    exact_from = 2.0 ** (fmt.emin - fmt.mbits - 1)  # half the smallest quantum: 0.25 for E2M1
    for dtype, low in ((torch.bfloat16, exact_from * 2**-6), (torch.float16, 2.0**-24)):
        y = every_value(dtype, low, fmt.max_normal)
        y = torch.cat((y, -y))
        short, quantum = sr_shortfall(y, fmt)
        assert ((short >= 0) & (short < quantum / 256)).all()
        if dtype == torch.bfloat16:
            exact = y.abs().numpy() >= exact_from
            assert (short[exact] == 0).all()
            assert (short[~exact] > 0).any()


@pytest.mark.parametrize("rounding", ("nearest", "stochastic"))
@pytest.mark.parametrize("rule", mx_oracle.RULES)
@pytest.mark.parametrize("fmt", list(ML_DTYPES))
def test_bit_exact_with_the_independent_oracle(fmt, rule, rounding):
    """Packed codes and scales equal ``tests/mx_oracle.py``'s byte for byte on adversarial blocks
    (power-of-two and binade-edge maxima, SR boundaries for the real Philox noise, ties,
    saturation, zero/NaN/Inf blocks), blocked along rows and along columns."""
    seed = 2**64 - 5 if rounding == "stochastic" else None
    x = torch.from_numpy(mx_oracle.adversarial_blocks(fmt, rule, 32, 256, seed=seed, rng_seed=3))
    for t, axis in ((x, -1), (x.t(), 0)):  # the storage layout is x itself both times
        q = quantize_mx(t, fmt, axis=axis, scale_rule=rule, rounding=rounding, seed=seed)
        data, scales = mx_oracle.quantize(t, fmt, rule, rounding, seed, axis=axis)
        assert np.array_equal(q.scales.numpy(), scales)
        assert (q.data.numpy() != data).sum() == 0


def test_oracle_philox_known_answers_and_adahop_stream():
    """The test's own Philox reproduces Random123's known-answer vectors, and adahop's noise
    bits are the documented indexing of it."""
    kat = {
        ((0, 0, 0, 0), (0, 0)): (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8),
        ((0xFFFFFFFF,) * 4, (0xFFFFFFFF,) * 2): (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD),
        ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0xA4093822, 0x299F31D0)):
            (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1),
    }  # fmt: skip
    for (counter, key), words in kat.items():
        assert mx_oracle.philox4x32_10(counter, key) == words
    for seed in (0, 9, 2**33 + 1, 2**64 - 5):
        n = 4096
        assert np.array_equal(philox.noise_bits(seed, torch.arange(n)).numpy(), mx_oracle.noise_bits(seed, n))


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
        c = [(prod_b >> np.uint64(32)) ^ c[1] ^ k0, prod_b & mask, (prod_a >> np.uint64(32)) ^ c[3] ^ k1, prod_a & mask]
        k0, k1 = (k0 + np.uint64(0x9E3779B9)) & mask, (k1 + np.uint64(0xBB67AE85)) & mask
    return np.stack(c, axis=-1)


def test_philox_matches_published_known_answer():
    # Random123 kat_vectors, philox4x32-10: counter 0, key 0.
    words = philox.philox4x32(0, torch.tensor([0]))[0].tolist()
    assert words == [0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8]


@pytest.mark.parametrize("seed", [0, 7, 2**40 + 3, 2**64 - 1])
def test_noise_uses_all_four_bytes_of_all_four_philox_words_in_order(seed):
    offsets = torch.cat((torch.arange(17), torch.tensor([2**32 + 1, 2**34 - 1, 2**40 + 6, 2**62 + 3, 2**63 - 1])))
    o = offsets.numpy().astype(np.uint64)
    counters = o // np.uint64(16)
    ctr = np.zeros((len(counters), 4), dtype=np.uint64)
    ctr[:, 0], ctr[:, 1] = counters & np.uint64(0xFFFFFFFF), counters >> np.uint64(32)
    words = numpy_philox4x32_10(seed, ctr)[np.arange(len(o)), ((o // np.uint64(4)) % np.uint64(4)).astype(int)]
    byte = (words >> (np.uint64(8) * (o % np.uint64(4)))) & np.uint64(0xFF)
    assert np.array_equal(philox.noise_bits(seed, offsets).numpy().astype(np.uint64), byte)
    want = byte.astype(np.float64) / 2**8
    assert np.array_equal(philox.uniform(seed, offsets).numpy().astype(np.float64), want)


def test_uniform_noise_statistics():
    """Mean, variance and neighbour correlations of 2**20 draws within 5 standard errors of those
    of the uniform distribution on the 256 values k / 2**8."""
    n = 1 << 20
    u = philox.uniform(12345, torch.arange(n)).double()
    assert torch.equal(u * 2**8, torch.floor(u * 2**8)) and 0 <= u.min() and u.max() < 1
    mean, var = (1 - 2**-8) / 2, (1 - 2**-16) / 12
    assert abs(u.mean().item() - mean) < 5 * math.sqrt(var / n)
    assert abs(u.var().item() - var) < 5 * math.sqrt((1 / 80 - 1 / 144) / n)
    c = u - mean
    calls = c.view(-1, 16)
    pairs = {
        "lag 1": (c[:-1], c[1:]),
        "same word": (calls[:, 0], calls[:, 1]),  # two bytes of one Philox word
        "same word, far bytes": (calls[:, 4], calls[:, 7]),
        "same call": (calls[:, 3], calls[:, 4]),  # neighbouring words of one call
        "next call": (calls[:-1, 15], calls[1:, 0]),
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


@pytest.mark.parametrize("axis", [2, 5, -3])
def test_axis_out_of_range_is_rejected_not_wrapped(axis, quantize):
    with pytest.raises(IndexError, match=f"axis {axis} is out of range for a 2-D tensor"):
        quantize(torch.randn(4, 32), axis=axis)
