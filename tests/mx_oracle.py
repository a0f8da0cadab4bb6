"""An MX quantizer written independently of adahop, for bit-exact oracle tests.

Nothing here imports adahop. Scales come from float64 ``frexp`` of the block maximum (the
definitions in ``adahop.formats.scales``' docstring, not its bit tricks), round-to-nearest from
``ml_dtypes`` casts, stochastic rounding from integer arithmetic,
``steps = floor(|y| / quantum * 2**8 + n) // 2**8`` with ``n`` the 8 noise bits, and those bits
from a Philox4x32-10 written here in plain Python integers (Random123's definition) and indexed as
the documented stream (``adahop.formats.philox``): the element at storage offset ``o`` takes byte
``o % 4`` (lowest first) of word ``(o // 4) % 4`` of the call with counter ``(o // 16, 0, 0, 0)``.

``adversarial_blocks`` builds inputs aimed at the places where a plausible bug shows: block maxima
that are exact powers of two (where the floor and ceil rules differ) or sit at the next binade,
and elements whose fixed-point steps plus *their own* Philox noise land exactly on, or a fraction
of a 2**-8 step below, an integer (where truncating differently changes the result).
"""

from __future__ import annotations

import functools

import ml_dtypes
import numpy as np

MASK32 = 0xFFFFFFFF
FORMATS = {  # name: (mbits, emin, emax, max_normal, ml_dtypes type, bits)
    "mxfp4": (1, 0, 2, 6.0, ml_dtypes.float4_e2m1fn, 4),
    "mxfp8_e4m3": (3, -6, 8, 448.0, ml_dtypes.float8_e4m3fn, 8),
    "mxfp8_e5m2": (2, -14, 15, 57344.0, ml_dtypes.float8_e5m2, 8),
}
RULES = ("floor", "ceil", "even", "rceil")


def philox4x32_10(counter: tuple[int, int, int, int], key: tuple[int, int]) -> tuple[int, ...]:
    """Philox4x32-10 (Salmon et al. 2011; Random123 ``philox4x32``) on Python integers."""
    c0, c1, c2, c3 = counter
    k0, k1 = key
    for _ in range(10):
        p0 = 0xD2511F53 * c0
        p1 = 0xCD9E8D57 * c2
        c0, c1, c2, c3 = (p1 >> 32) ^ c1 ^ k0, p1 & MASK32, (p0 >> 32) ^ c3 ^ k1, p0 & MASK32
        k0, k1 = (k0 + 0x9E3779B9) & MASK32, (k1 + 0xBB67AE85) & MASK32
    return c0, c1, c2, c3


@functools.lru_cache(maxsize=16)
def _noise_prefix(seed: int, n: int) -> np.ndarray:
    key = (seed & MASK32, (seed >> 32) & MASK32)
    out = np.empty(-(-n // 16) * 16, dtype=np.int64)
    for call in range(len(out) // 16):
        words = philox4x32_10((call & MASK32, call >> 32, 0, 0), key)
        for w, word in enumerate(words):
            for b in range(4):
                out[16 * call + 4 * w + b] = (word >> (8 * b)) & 0xFF
    out.setflags(write=False)
    return out[:n]


def noise_bits(seed: int | None, n: int) -> np.ndarray:
    """The 8 noise bits (int64) of storage offsets 0..n-1 for ``seed`` (None is 0)."""
    return _noise_prefix((0 if seed is None else seed) % 2**64, n)


def shared_exponents(amax: np.ndarray, fmt: str, rule: str) -> np.ndarray:
    """Unbiased E8M0 exponents (int64) of finite block maxima, clamped to [-127, 127]."""
    mbits, _, emax, max_normal, _, _ = FORMATS[fmt]
    a = np.asarray(amax, dtype=np.float64)
    m, e = np.frexp(a)  # a = m * 2**e, m in [0.5, 1); 0 -> (0, 0)
    floor_log2 = e - 1
    if rule == "floor":
        s = floor_log2 - emax
    elif rule == "ceil":
        s = floor_log2 + (m != 0.5) - emax
    elif rule == "even":  # mantissa rounded to mbits fraction bits, halves up, then floor
        sig = np.floor(m * 2.0 ** (mbits + 1) + 0.5) / 2.0 ** (mbits + 1)
        s = floor_log2 + (sig == 1.0) - emax
    elif rule == "rceil":  # ceil(log2(fp32(amax / max_normal))), the division rounded as float32
        d = (a.astype(np.float32) / np.float32(max_normal)).astype(np.float64)
        md, ed = np.frexp(d)
        s = np.where(d == 0, -127, ed - (md == 0.5))  # the division can underflow to 0
    else:
        raise ValueError(rule)
    s = np.where(a == 0, -127, s)
    return np.clip(s, -127, 127).astype(np.int64)


def to_storage(x: np.ndarray, axis: int, block: int) -> np.ndarray:
    """float64 ``[*other, n_blocks, block]``: block axis last, zero-padded."""
    v = np.moveaxis(np.asarray(x, dtype=np.float64), axis, -1)
    pad = -v.shape[-1] % block
    v = np.pad(v, [(0, 0)] * (v.ndim - 1) + [(0, pad)])
    return v.reshape(*v.shape[:-1], -1, block)


def quantize(
    x, fmt: str, rule: str, rounding: str = "nearest", seed: int | None = None, axis: int = -1, block: int = 32
) -> tuple[np.ndarray, np.ndarray]:
    """(packed element bytes, E8M0 codes) as uint8, in ``MXTensor``'s storage layout.

    ``x`` is a float32/bfloat16/float16 torch tensor or numpy array (its values are exact in
    float64).
    """
    mbits, emin, _, max_normal, ml_type, bits = FORMATS[fmt]
    if hasattr(x, "detach"):
        x = x.detach().cpu().double().numpy()
    v = to_storage(x, axis % np.ndim(x), block)
    amax = np.abs(v).max(-1)
    bad = ~np.isfinite(amax)
    s = shared_exponents(np.where(bad, 0.0, amax), fmt, rule)
    y = np.where(bad[..., None], 0.0, v) * np.exp2(-s.astype(np.float64))[..., None]  # exact
    a = np.abs(y)
    if rounding == "nearest":
        q = np.minimum(a, max_normal)  # ml_dtypes' FP8 casts do not saturate; E2M1's cast rounds
    else:
        _, e = np.frexp(a)
        quantum = np.exp2(np.maximum(e - 1, emin) - mbits).astype(np.float64)
        fixed = np.floor(a / quantum * 2.0**8).astype(np.int64)  # exact: a has 24 bits at most
        n = noise_bits(seed, v.size).reshape(v.shape)
        q = np.minimum(((fixed + n) >> 8) * quantum, max_normal)
    codes = np.copysign(q, y).astype(ml_type).view(np.uint8)
    codes = codes.reshape(*codes.shape[:-2], -1)
    if bits == 4:
        codes = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = np.where(bad, 255, s + 127).astype(np.uint8)
    return codes, scales


def adversarial_blocks(
    fmt: str, rule: str, rows: int, length: int, seed: int | None, rng_seed: int = 0, block: int = 32
) -> np.ndarray:
    """float32 ``[rows, length]`` (blocks along the last axis; ``length % block == 0``).

    Per block: element 0 is the block maximum, a power of two in 40% of blocks, at or one float32
    ulp below a binade (or ``even``-rule) boundary in 20%, random otherwise. Elements 1.. are, in
    shares 40/15/25/10/10: *SR boundaries* (fixed-point steps ``F`` with ``F + n`` equal to an
    integer, or short of it by ``2**-8 - f`` with ``f`` in 1/2, 3/4, 15/16, for the element's
    own noise ``n``), *ties* (grid midpoints and one ulp either side), uniform random magnitudes
    below the maximum, values past ``max_normal`` (they saturate where the rule lets them occur)
    and zeros. Blocks 0, 1 and 2 are a zero block, a NaN block and an Inf block.
    """
    mbits, emin, _, max_normal, _, _ = FORMATS[fmt]
    rng = np.random.default_rng(rng_seed)
    n_blocks = rows * length // block
    shape = (n_blocks, block)

    exp = rng.integers(-30, 30, n_blocks).astype(np.float64)
    kind = rng.random(n_blocks)
    mant = np.where(kind < 0.4, 1.0, 1.0 + rng.integers(0, 2**23, n_blocks) * 2.0**-23)
    edge = (kind >= 0.4) & (kind < 0.6)
    edges = np.array(
        [2.0 - 2.0**-23, 2.0 - 2.0 ** -(mbits + 1), 2.0 - 2.0 ** -(mbits + 1) - 2.0**-23, 1.0 + 2.0**-23, 1.5]
    )
    mant = np.where(edge, edges[rng.integers(0, len(edges), n_blocks)], mant)
    amax = (mant * np.exp2(exp)).astype(np.float32).astype(np.float64)
    s = shared_exponents(amax, fmt, rule).astype(np.float64)
    ya = amax * np.exp2(-s)  # the scaled block maximum
    top = np.floor(np.log2(ya))[:, None] - 1  # binades whose values stay below ya

    # SR boundaries: binade b (b < emin: the subnormal range), steps K - (n + 1 - d - f) / 2**8.
    b = np.floor(rng.random(shape) * (top - (emin - 2))) + (emin - 1)
    normal = b >= emin
    quantum = np.exp2(np.maximum(b, emin) - mbits)
    k_lo = np.where(normal, 2**mbits + 1, 1)
    k = k_lo + np.floor(rng.random(shape) * (2 ** np.where(normal, mbits + 1, mbits) - k_lo + 1))
    n = noise_bits(seed, n_blocks * block).reshape(shape).astype(np.float64)
    d = rng.integers(0, 2, shape)
    f = np.array([0.0, 0.5, 0.75, 0.9375])[rng.integers(0, 4, shape)]
    fixed = k * 2**8 - n - 1 + d + f
    over = fixed >= 2.0 ** (np.where(normal, mbits + 1, mbits) + 8)  # left the binade: d = 0
    fixed = np.where(over, fixed - d, fixed)
    sr = fixed * 2.0**-8 * quantum

    # Ties: midpoints of the grid in binade b, exactly and one float32 ulp either side.
    j = np.where(normal, 2**mbits, 0) + np.floor(rng.random(shape) * np.where(normal, 2**mbits, 2**mbits))
    tie = ((j + 0.5) * quantum).astype(np.float32)
    ulp = rng.integers(-1, 2, shape)
    tie = np.where(
        ulp < 0, np.nextafter(tie, np.float32(0)), np.where(ulp > 0, np.nextafter(tie, np.float32(np.inf)), tie)
    )

    uniform = (rng.random(shape) * ya[:, None]).astype(np.float32)
    past = np.maximum(max_normal, ya[:, None] * (1 - rng.random(shape) * (1 - max_normal / ya[:, None]).clip(0)))
    past = np.minimum(past, ya[:, None]).astype(np.float32)

    pick = rng.random(shape)
    y = np.where(
        pick < 0.4, sr, np.where(pick < 0.55, tie, np.where(pick < 0.8, uniform, np.where(pick < 0.9, past, 0.0)))
    )
    y[:, 0] = ya
    sign = np.where(rng.random(shape) < 0.5, -1.0, 1.0)
    v = (sign * y * np.exp2(s)[:, None]).astype(np.float32)
    assert np.array_equal(v.astype(np.float64), sign * y * np.exp2(s)[:, None]), "not exact in float32"
    flat = v.reshape(-1)
    flat[:block] = 0.0
    flat[block + 3] = np.nan
    flat[2 * block + 7] = -np.inf
    return v.reshape(rows, length)
