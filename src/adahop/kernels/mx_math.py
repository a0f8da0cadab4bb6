"""Triton device functions for MX quantization, written to match :mod:`adahop.formats` bit for bit.

Every step is integer arithmetic on float32 bit patterns or a float32 operation whose rounding
is pinned down (adds, multiplies by powers of two), so results agree between the GPU and
``TRITON_INTERPRET=1``: no libdevice, no ``.to(tl.bfloat16)`` / FP8 casts (wrong in the
interpreter), and no fused multiply-add hazards (every product that could be contracted into
an FMA is exact). The one exception, ``round_to_bf16``, uses the hardware cast when compiled.
"""

import triton
import triton.language as tl

F32_MBITS = tl.constexpr(23)
F32_BIAS = tl.constexpr(127)
F32_ABS_MASK = tl.constexpr(0x7FFFFFFF)
F32_MANTISSA_MASK = tl.constexpr(0x7FFFFF)
F32_EXP_MASK = tl.constexpr(0x7F800000)
F32_INF_BITS = tl.constexpr(0x7F800000)
E8M0_NAN = tl.constexpr(255)
# Adding then subtracting 1.5 * 2**23 rounds a float32 in [0, 2**22) to an integer, ties to even.
RNE_MAGIC = tl.constexpr(12582912.0)
RNE_MAGIC_BITS = tl.constexpr(0x4B400000)
UNIFORM_SHIFT = tl.constexpr(8)  # keep the top 24 Philox bits (adahop.formats.philox)
UNIFORM_STEP = tl.constexpr(5.9604644775390625e-08)  # 2**-24


@triton.jit
def bf16_bits_to_float(bits):
    """float32 value of bfloat16 bit patterns loaded as int16 (exact, subnormals included)."""
    wide = bits.to(tl.uint16, bitcast=True).to(tl.uint32) << 16
    return wide.to(tl.float32, bitcast=True)


@triton.jit
def round_to_bf16(v, NATIVE: tl.constexpr):
    """Round float32 to the nearest bfloat16 (ties to even), returned as float32; NaN stays NaN.

    ``NATIVE`` uses the hardware conversion (one instruction per two values on the GPU); the
    interpreter's ``.to(tl.bfloat16)`` truncates, so there the rounding is done on the bits.
    """
    if NATIVE:
        return v.to(tl.bfloat16).to(tl.float32)
    bits = v.to(tl.uint32, bitcast=True)
    rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    is_nan = (bits & F32_ABS_MASK) > F32_INF_BITS
    return tl.where(is_nan, bits, rounded).to(tl.float32, bitcast=True)


@triton.jit
def walsh_hadamard_butterfly(v, STAGES: tl.constexpr):
    """Unnormalized ``v @ H`` along the last axis (length ``2**STAGES``).

    Same stages in the same order as :func:`adahop.transforms.hadamard.walsh_hadamard_butterfly`:
    stage ``h`` maps ``(v[i], v[i + h])`` to ``(a + b, a - b)``.
    """
    ROWS: tl.constexpr = v.shape[0]
    N: tl.constexpr = v.shape[1]
    for stage in tl.static_range(STAGES):
        pairs = tl.reshape(v, [ROWS * N // (2 << stage), 2, 1 << stage])  # (v[i], v[i + h])
        pairs = tl.permute(pairs, (0, 2, 1))
        a, b = tl.split(pairs)
        v = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 2, 1)), [ROWS, N])
    return v


@triton.jit
def exponent_field(bits):
    """Unbiased float32 exponent of non-negative bit patterns (int32); subnormals read -127."""
    return ((bits >> F32_MBITS) & 0xFF).to(tl.int32) - F32_BIAS


@triton.jit
def shared_exponent(amax_bits, RULE: tl.constexpr, EMAX: tl.constexpr, MAX_NORMAL: tl.constexpr,
                    MBITS: tl.constexpr):
    """E8M0 exponent of finite block maxima given as float32 bits, as in ``formats.scales``."""
    if RULE == "floor":
        s = exponent_field(amax_bits) - EMAX
    elif RULE == "ceil":
        s = exponent_field(amax_bits) + ((amax_bits & F32_MANTISSA_MASK) != 0).to(tl.int32) - EMAX
    elif RULE == "even":
        HALF_ULP: tl.constexpr = (F32_MANTISSA_MASK + 1) >> (MBITS + 1)
        s = exponent_field((amax_bits + HALF_ULP) & ~F32_MANTISSA_MASK) - EMAX
    else:  # "rceil": the division is correctly rounded, like torch's
        amax = amax_bits.to(tl.float32, bitcast=True)
        descale = tl.math.div_rn(amax, MAX_NORMAL).to(tl.int32, bitcast=True)
        s = exponent_field(descale) + ((descale & F32_MANTISSA_MASK) != 0).to(tl.int32)
    return tl.minimum(tl.maximum(s, -F32_BIAS), F32_BIAS)


@triton.jit
def exp2_int(e):
    """Exact float32 ``2**e`` for int32 ``e`` in the normal range [-126, 127]."""
    return ((e + F32_BIAS) << F32_MBITS).to(tl.float32, bitcast=True)


@triton.jit
def philox_uniform(seed, offsets):
    """Noise in [0, 1), bit-identical to ``formats.philox.uniform(seed, offsets)`` (int64)."""
    lo = offsets.to(tl.uint32)
    hi = (offsets >> 32).to(tl.uint32)
    zero = lo * 0
    bits, _, _, _ = tl.philox(seed, lo, hi, zero, zero)
    return (bits >> UNIFORM_SHIFT).to(tl.float32) * UNIFORM_STEP


@triton.jit
def encode_elements(scaled, noise, STOCHASTIC: tl.constexpr, MBITS: tl.constexpr,
                    EMIN: tl.constexpr, MAX_CODE: tl.constexpr, SIGN_SHIFT: tl.constexpr):
    """Element codes (uint8) of finite float32 values already divided by their block scale.

    Rounds ``|v| / quantum`` to an integer number of steps (nearest-even, or ``floor(steps +
    noise)``) exactly as ``formats.elements.round_to_element``, then reads the code off directly:
    ``((e - emin) << mbits) + steps``, where a carry out of the mantissa moves into the exponent
    and saturation is a clamp at the code of ``max_normal``. Works on exponent bits so that
    ``e``, ``1 / quantum`` and the code's exponent field cost a few integer operations.
    """
    bits = scaled.to(tl.uint32, bitcast=True)
    # Biased exponent field of the binade whose grid spacing applies (subnormals share emin's).
    binade = tl.maximum(bits & F32_EXP_MASK, (EMIN + F32_BIAS) << F32_MBITS)
    inv_quantum_exp = tl.full(binade.shape, (MBITS + 2 * F32_BIAS) << F32_MBITS, tl.uint32)
    inv_quantum = (inv_quantum_exp - binade).to(tl.float32, bitcast=True)  # 2**(mbits - e)
    steps = tl.abs(scaled) * inv_quantum  # a power-of-two multiple: exact
    if STOCHASTIC:
        steps = (steps + noise).to(tl.uint32)  # truncation is floor here
    else:
        steps = (steps + RNE_MAGIC).to(tl.uint32, bitcast=True) - RNE_MAGIC_BITS
    code = (binade >> (F32_MBITS - MBITS)) - ((EMIN + F32_BIAS) << MBITS) + steps
    sign = (bits >> (31 - SIGN_SHIFT)) & (1 << SIGN_SHIFT)
    return (tl.minimum(code, MAX_CODE) | sign).to(tl.uint8)


@triton.jit
def pack_nibbles(codes):
    """Pack 4-bit codes along the last axis two per byte, the even element in the low nibble."""
    ROWS: tl.constexpr = codes.shape[0]
    N: tl.constexpr = codes.shape[1]
    lo, hi = tl.split(tl.reshape(codes, [ROWS, N // 2, 2]))
    return lo | (hi << 4)
