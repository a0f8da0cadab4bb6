"""Triton device functions for MX formats, encoders and decoders, written to match :mod:`adahop.formats` bit for bit.

Every step is integer arithmetic on float32 bit patterns or a float32 operation whose rounding
is pinned down (adds, multiplies by powers of two), so results agree between the GPU and
``TRITON_INTERPRET=1``: no libdevice, no ``.to(tl.bfloat16)`` / FP8 casts (wrong in the
interpreter), and no fused multiply-add hazards (every product that could be contracted into
an FMA is exact). The one exception, ``round_to_bf16``, uses the hardware cast when compiled.
"""

import triton
import triton.language as tl

from ..formats import philox, scales

F32_MBITS = tl.constexpr(23)
F32_BIAS = tl.constexpr(127)
F32_ABS_MASK = tl.constexpr(0x7FFFFFFF)
F32_MANTISSA_MASK = tl.constexpr(0x7FFFFF)
F32_INF_BITS = tl.constexpr(0x7F800000)
E8M0_NAN = tl.constexpr(scales.E8M0_NAN)
# Adding 1.5 * 2**23 (bits 0x4B400000) rounds a float32 in [0, 2**22) to an integer, ties to even.
RNE_MAGIC_BITS = tl.constexpr(0x4B400000)
RNE_MAGIC = tl.constexpr(12582912.0)  # the same constant as a float: 1.5 * 2**23
NOISE_BITS = tl.constexpr(philox.NOISE_BITS)  # random bits per element, four per Philox word
NOISE_MASK = tl.constexpr((1 << philox.NOISE_BITS) - 1)


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
def round_to_input_dtype(v, ROUND_TO: tl.constexpr, NATIVE: tl.constexpr):
    """Round float32 ``v`` to the input's dtype ("bf16", "fp16", or "" for float32), as float32."""
    if ROUND_TO == "bf16":
        v = round_to_bf16(v, NATIVE)
    elif ROUND_TO == "fp16":
        v = v.to(tl.float16).to(tl.float32)
    return v


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
def max_keeping_nan(a, b):
    """``max`` that returns NaN if either side is NaN (a block holding a NaN must become NaN);
    with ``tl.abs`` applied first, one instruction per element on the GPU."""
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def exponent_field(bits):
    """Unbiased float32 exponent of non-negative bit patterns (int32); subnormals read -127."""
    return ((bits >> F32_MBITS) & 0xFF).to(tl.int32) - F32_BIAS


@triton.jit
def shared_exponent(amax_bits, RULE: tl.constexpr, EMAX: tl.constexpr, MAX_NORMAL: tl.constexpr, MBITS: tl.constexpr):
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
        e = exponent_field(descale)
        mantissa = descale & F32_MANTISSA_MASK
        # A subnormal descale is mantissa * 2**-149: above 2**-127 only when mantissa > 2**22.
        up = tl.where(e == -F32_BIAS, mantissa > 0x400000, mantissa != 0)
        s = e + up.to(tl.int32)
    return tl.minimum(tl.maximum(s, -F32_BIAS), F32_BIAS)


@triton.jit
def exp2_int(e):
    """Exact float32 ``2**e`` for int32 ``e`` in the normal range [-126, 127]."""
    return ((e + F32_BIAS) << F32_MBITS).to(tl.float32, bitcast=True)


@triton.jit
def _philox_words(seed, counters):
    """Philox4x32-10 of int64 counters ``(counter mod 2**32, counter >> 32, 0, 0)``."""
    zero = counters.to(tl.uint32) * 0
    return tl.philox(seed, counters.to(tl.uint32), (counters >> 32).to(tl.uint32), zero, zero)


@triton.jit
def philox_noise(seed, offsets):
    """8-bit noise (uint32) at int64 ``offsets``, equal to ``formats.philox.noise_bits``.

    One Philox call per element (byte ``offset % 4`` of word ``(offset // 4) % 4`` of counter
    ``offset // 16``); for runs of sixteen offsets that share a call, ``philox_noise_runs`` is
    sixteen times cheaper.
    """
    w0, w1, w2, w3 = _philox_words(seed, offsets >> 4)
    word = (offsets >> 2) & 3
    bits = tl.where(word < 2, tl.where(word == 0, w0, w1), tl.where(word == 2, w2, w3))
    return (bits >> ((offsets & 3) * NOISE_BITS).to(tl.uint32)) & NOISE_MASK


@triton.jit
def _word_bytes(words):
    """The four bytes of each of ``words`` along two new axes [..., 2, 2], lowest first once the
    two are flattened."""
    b0, b1 = words & NOISE_MASK, (words >> NOISE_BITS) & NOISE_MASK
    b2, b3 = (words >> 2 * NOISE_BITS) & NOISE_MASK, words >> 3 * NOISE_BITS
    return tl.join(tl.join(b0, b2), tl.join(b1, b3))


@triton.jit
def philox_noise_runs(seed, counters):
    """8-bit noise ``[R, 16 * G]`` for the offsets ``16 * counters + (0, ..., 15)`` of ``counters [R, G]``.

    Each Philox call's four words go to sixteen neighbouring elements, lowest byte first.
    """
    R: tl.constexpr = counters.shape[0]
    G: tl.constexpr = counters.shape[1]
    w0, w1, w2, w3 = _philox_words(seed, counters)
    words = tl.reshape(tl.join(tl.join(w0, w2), tl.join(w1, w3)), [R, 4 * G])  # w0 w1 w2 w3
    return tl.reshape(_word_bytes(words), [R, 16 * G])


@triton.jit
def philox_noise_slices(seed, counters):
    """8-bit noise of two 8-wide slices ``[R, NB, 8]`` that share the Philox call at ``counters
    [R, NB]``: the offsets ``16 * counters + (0, ..., 7)`` (words 0, 1) and ``+ (8, ..., 15)``
    (words 2, 3)."""
    R: tl.constexpr = counters.shape[0]
    NB: tl.constexpr = counters.shape[1]
    w0, w1, w2, w3 = _philox_words(seed, counters)
    first = tl.reshape(_word_bytes(tl.join(w0, w1)), [R, NB, 8])
    second = tl.reshape(_word_bytes(tl.join(w2, w3)), [R, NB, 8])
    return first, second


@triton.jit
def encode_elements(y, noise, limit, sign_weight, STOCHASTIC: tl.constexpr, MBITS: tl.constexpr, EMIN: tl.constexpr):
    """Element codes (uint32) of finite float32 ``y`` already divided by the block scale.

    Rounds ``|y| / quantum`` to an integer number of steps (nearest-even, or ``floor(steps +
    noise / 2**8)`` for 8-bit integer ``noise``) exactly as
    ``formats.elements.round_to_element`` and reads the code off directly:
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
    first_code = (binade - (EMIN + F32_BIAS)) << MBITS  # the code of 2**e
    if STOCHASTIC:
        # Steps in fixed point with 8 fraction bits, truncated (exact: a power-of-two multiply, then
        # floor); adding the integer noise and dropping 8 bits is the exact floor(steps + noise).
        top = tl.full(binade.shape, MBITS + NOISE_BITS + 2 * F32_BIAS, tl.uint32)
        fixed_scale = ((top - binade) << F32_MBITS).to(tl.float32, bitcast=True)  # 2**(mbits-e+8)
        fixed = (tl.abs(y) * fixed_scale).to(tl.uint32)
        code = ((fixed + noise) >> NOISE_BITS) + first_code
    else:
        top = tl.full(binade.shape, MBITS + 2 * F32_BIAS, tl.uint32)
        inv_quantum = ((top - binade) << F32_MBITS).to(tl.float32, bitcast=True)  # 2**(mbits - e)
        # Adding 1.5 * 2**23 plus the even first_code rounds the steps to an integer, ties to even.
        magic = (first_code + RNE_MAGIC_BITS).to(tl.float32, bitcast=True)
        code = (tl.abs(y) * inv_quantum + magic).to(tl.uint32, bitcast=True) - RNE_MAGIC_BITS
    return tl.minimum(code, limit) + (bits >> 31) * sign_weight


@triton.jit
def encode_e2m1_nearest(y, limit, sign_weight):
    """E2M1 codes (uint32) of finite float32 ``y`` already divided by the block scale, ties to even.

    The same codes as ``encode_elements`` for MXFP4 with fewer integer operations (this
    kernel's bottleneck). On ``|y| < 8`` the E2M1 code is a concave piecewise-linear function:
    ``code = round(min(2|y|, |y| + 2, |y| / 2 + 4))`` (steps of 0.5 up to 2, of 1 up to 4, of 2
    above), and an even code is an even mantissa, so ties to even carry over. Each line is
    rounded by one fused multiply-add with the magic constant (the product is exact, the sum
    rounds once); rounding is monotone, so the minimum of the rounded lines, taken on their bit
    patterns (all in one binade), is the rounded minimum. ``limit`` saturates (7) or zeroes a
    NaN/Inf block (0), whatever the lines gave there.
    """
    a = tl.abs(y)
    line1 = (a * 2.0 + RNE_MAGIC).to(tl.uint32, bitcast=True)
    line2 = (a + (RNE_MAGIC + 2.0)).to(tl.uint32, bitcast=True)
    line3 = (a * 0.5 + (RNE_MAGIC + 4.0)).to(tl.uint32, bitcast=True)
    code = tl.minimum(tl.minimum(line1, line2), line3) - RNE_MAGIC_BITS
    return tl.minimum(code, limit) + (y.to(tl.uint32, bitcast=True) >> 31) * sign_weight


@triton.jit
def pack_codes(codes, BITS: tl.constexpr, PER_UNIT: tl.constexpr):
    """Pack ``PER_UNIT`` codes of ``BITS`` bits along the last axis into one uint32, first lowest."""
    ROWS: tl.constexpr = codes.shape[0]
    N: tl.constexpr = codes.shape[1]
    groups = tl.reshape(codes, [ROWS, N // PER_UNIT, PER_UNIT])
    return tl.sum(groups << (tl.arange(0, PER_UNIT) * BITS)[None, None, :], axis=2)


# ---- decoders: reading MX storage (integer arithmetic and bitcasts only, exact in the interpreter,
# whose float8 ``.to`` casts round wrongly) --------------------------------------------------------
_FP32_HALF_BITS = tl.constexpr(0x3F000000)  # 0.5 in float32
_FP32_NAN_BITS = tl.constexpr(0x7FC00000)
_E4M3_HALF_BITS = tl.constexpr(0x30)  # 0.5 in E4M3: exponent field 6, bias 7


@triton.jit
def unpack_fp4(packed):
    """[R, C] bytes -> [R, 2C] E2M1 codes, the low nibble first (the MXTensor layout)."""
    codes = tl.join(packed & 0xF, packed >> 4)
    return tl.reshape(codes, (packed.shape[0], 2 * packed.shape[1]))


@triton.jit
def e2m1_to_fp32(codes):
    """float32 values of E2M1 codes, built from bits: 0.5 * q for q < 2, else q << 22 added to 0.5."""
    q = (codes & 7).to(tl.int32)
    bits = tl.where(q < 2, q * _FP32_HALF_BITS, (q << 22) + _FP32_HALF_BITS)
    bits = bits | ((codes & 8).to(tl.int32) << 28)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def e2m1_to_e4m3(codes):
    """E4M3 bit patterns (uint8) of E2M1 codes; every E2M1 value is exact in E4M3.

    An E2M1 code ``q = 2 * exp + mantissa`` maps to ``q << 2`` re-biased by 0.5's pattern;
    the subnormal 0.5 (q = 1) and zero are the two exceptions.
    """
    q = codes & 7
    mag = tl.where(q < 2, q * _E4M3_HALF_BITS, (q << 2) + _E4M3_HALF_BITS)
    return mag | ((codes & 8) << 4)


@triton.jit
def e8m0_to_fp32(codes):
    """float32 ``2**(code - 127)`` of E8M0 codes, exact (code 0 is subnormal); NaN for 255."""
    c = codes.to(tl.int32)
    bits = tl.where(c == 0, 1 << 22, c << 23)
    bits = tl.where(c == 255, _FP32_NAN_BITS, bits)
    return bits.to(tl.float32, bitcast=True)
