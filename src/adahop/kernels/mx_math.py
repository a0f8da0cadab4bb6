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
F32_INF_BITS = tl.constexpr(0x7F800000)
E8M0_NAN = tl.constexpr(255)
# Adding 1.5 * 2**23 (bits 0x4B400000) rounds a float32 in [0, 2**22) to an integer, ties to even.
RNE_MAGIC_BITS = tl.constexpr(0x4B400000)
UNIFORM_SHIFT = tl.constexpr(8)  # keep the top 24 bits of a Philox word (adahop.formats.philox)
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
def uniform_from_bits(bits):
    """[0, 1) noise from 32-bit random words: the top 24 bits, exactly as ``formats.philox``."""
    return (bits >> UNIFORM_SHIFT).to(tl.float32) * UNIFORM_STEP


@triton.jit
def _philox_words(seed, counters):
    """Philox4x32-10 of int64 counters ``(counter mod 2**32, counter >> 32, 0, 0)``."""
    zero = counters.to(tl.uint32) * 0
    return tl.philox(seed, counters.to(tl.uint32), (counters >> 32).to(tl.uint32), zero, zero)


@triton.jit
def philox_uniform(seed, offsets):
    """Noise at int64 ``offsets``, bit-identical to ``formats.philox.uniform(seed, offsets)``.

    One Philox call per element (word ``offset % 4`` of counter ``offset // 4``); for runs of
    four offsets that share a call, ``philox_uniform_runs`` is four times cheaper.
    """
    w0, w1, w2, w3 = _philox_words(seed, offsets >> 2)
    word = offsets & 3
    bits = tl.where(word < 2, tl.where(word == 0, w0, w1), tl.where(word == 2, w2, w3))
    return uniform_from_bits(bits)


@triton.jit
def philox_uniform_runs(seed, counters):
    """Noise ``[R, 4 * G]`` for the offsets ``4 * counters + (0, 1, 2, 3)`` of int64 ``counters [R, G]``.

    Each Philox call's four words go to four neighbouring elements, in order.
    """
    R: tl.constexpr = counters.shape[0]
    G: tl.constexpr = counters.shape[1]
    w0, w1, w2, w3 = _philox_words(seed, counters)
    words = tl.join(tl.join(w0, w2), tl.join(w1, w3))  # [R, G, 2, 2] = w0 w1 w2 w3 row-major
    return uniform_from_bits(tl.reshape(words, [R, 4 * G]))


@triton.jit
def encode_elements(y, noise, limit, sign_weight, STOCHASTIC: tl.constexpr, MBITS: tl.constexpr,
                    EMIN: tl.constexpr):
    """Element codes (uint32) of finite float32 ``y`` already divided by the block scale.

    Rounds ``|y| / quantum`` to an integer number of steps (nearest-even, or ``floor(steps +
    noise)``) exactly as ``formats.elements.round_to_element`` and reads the code off directly:
    ``((e - emin) << mbits) + steps``, where a carry out of the mantissa moves into the exponent.
    The magnitude saturates at ``limit`` (the code of ``max_normal``; 0 zeroes a NaN/Inf block)
    and the sign bit adds ``sign_weight``. Written with shifts, adds and multiplies, which the
    GPU runs on its multiply-add pipe, rather than masks and selects, which share the integer
    logic pipe that bounds this kernel.
    """
    bits = y.to(tl.uint32, bitcast=True)
    # Biased exponent of the binade whose grid spacing applies (subnormals share emin's).
    binade = tl.maximum((bits << 1) >> (F32_MBITS + 1), EMIN + F32_BIAS)
    # (a constexpr on the left of a tensor stays a constexpr in the interpreter)
    top = tl.full(binade.shape, MBITS + 2 * F32_BIAS, tl.uint32)
    inv_quantum = ((top - binade) << F32_MBITS).to(tl.float32, bitcast=True)  # 2**(mbits - e)
    first_code = (binade - (EMIN + F32_BIAS)) << MBITS  # the code of 2**e
    if STOCHASTIC:
        # |y| * inv_quantum is exact, so the fused multiply-add rounds only the sum, as torch does.
        code = (tl.abs(y) * inv_quantum + noise).to(tl.uint32) + first_code  # truncation is floor
    else:
        # Adding 1.5 * 2**23 plus the even first_code rounds the steps to an integer, ties to even.
        magic = (first_code + RNE_MAGIC_BITS).to(tl.float32, bitcast=True)
        code = (tl.abs(y) * inv_quantum + magic).to(tl.uint32, bitcast=True) - RNE_MAGIC_BITS
    return tl.minimum(code, limit) + (bits >> 31) * sign_weight


@triton.jit
def pack_codes(codes, BITS: tl.constexpr, PER_UNIT: tl.constexpr):
    """Pack ``PER_UNIT`` codes of ``BITS`` bits along the last axis into one uint32, first lowest."""
    ROWS: tl.constexpr = codes.shape[0]
    N: tl.constexpr = codes.shape[1]
    groups = tl.reshape(codes, [ROWS, N // PER_UNIT, PER_UNIT])
    return tl.sum(groups << (tl.arange(0, PER_UNIT) * BITS)[None, None, :], axis=2)
