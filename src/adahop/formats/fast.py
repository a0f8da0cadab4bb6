"""The reference quantizer rearranged for speed: the same bits as the specification, far fewer passes.

:func:`adahop.formats.quantize_mx` (after :func:`adahop.transforms.hadamard_transform`) and
:meth:`MXTensor.dequantize_blocked` stay the readable specification (and what CUDA's
``ops.reference_only()`` runs); this is what the custom ops run on CPU, and
``tests/test_fast_reference.py`` holds it to the specification bit for bit. Every rounding step
is the specification's, but

- the block axis K stays in the middle of a contiguous ``[P, K, Q]`` view (a 2-D input blocked
  along its rows is transposed once), so the Hadamard stages, block maxima and codes are
  whole-row operations, and only the 1-byte codes are moved into storage layout;
- Philox runs once per sixteen elements (:func:`philox.noise_runs`), not once per element;
- element exponents come off the float32 bit fields instead of ``frexp``/``ldexp``, divisions
  by powers of two are multiplications by their exact reciprocals (the same correctly rounded
  results), round-to-nearest-even is the float32 adder's (``2**23 + steps``), and stochastic
  rounding adds the integer noise in int32;
- E2M1 codes are formed arithmetically (``2 * e + steps``, the sign bit shifted in as an
  integer), and decoded by one table gather per byte (two elements, already multiplied by the
  block's scale) instead of one lookup per element and a multiply.
"""

from __future__ import annotations

import functools
import math

import torch

from ..transforms.hadamard import check_hadamard_args, walsh_hadamard_rows
from . import philox
from .elements import decode_e2m1, encode_fp8
from .mx import ELEMENT_FORMATS, MXTensor, check_quantize_args
from .scales import E8M0_NAN, scale_codes, scale_values

_F32_MBITS = 23
_F32_BIAS = 127
_ROUND_BITS = 0x4B000000  # float32 bits of 2**23


def _exp2_bits(biased_exponent: torch.Tensor) -> torch.Tensor:
    """float32 ``2**(e - 127)`` from int32 biased exponents in [1, 254] (0 gives 0.0; in place)."""
    return biased_exponent.bitwise_left_shift_(_F32_MBITS).view(torch.float32)


def _k_major(x: torch.Tensor, axis: int) -> tuple[torch.Tensor, tuple[int, ...]]:
    """float32 ``[P, K, Q]`` contiguous copy-or-view of ``x`` with K = ``x.shape[axis]``, and
    the storage shape ``[*other_dims]``. Storage order (other dims, then K) is ``[P, Q, K]``."""
    other = x.shape[:axis] + x.shape[axis + 1 :]
    p, k = math.prod(x.shape[:axis]), x.shape[axis]
    q = math.prod(x.shape[axis + 1 :])
    v = x.contiguous().view(p, k, q)
    if q == 1 and p > 1:  # blocked along rows: transpose once so that K runs across rows
        v = v.view(p, k).t().contiguous().unsqueeze(0)  # 2-D: torch's blocked transpose copy
    return v.to(torch.float32), other


def _hadamard(v: torch.Tensor, dtype: torch.dtype, block_size: int, signs: torch.Tensor | None) -> torch.Tensor:
    """``hadamard_transform`` along dim 1, rounded to ``dtype`` and back as the spec does."""
    p, k, q = v.shape
    if signs is not None:
        v = (v.view(p, k // block_size, block_size, q) * signs.to(v).view(block_size, 1)).view(p, k, q)
    v = walsh_hadamard_rows(v, block_size)
    v = v.mul_(1 / math.sqrt(block_size))  # a Python scalar multiplies a float32 tensor as float32
    return v if dtype == torch.float32 else v.to(dtype).to(torch.float32)


@functools.lru_cache(maxsize=32)
def _run_counters(p: int, runs: int, q: int, device: torch.device) -> torch.Tensor:
    """Philox counters ``[P, runs, Q]`` of the K-major layout: ``(i * Q + j) * runs + r``. A
    training step quantizes the same few shapes over and over; callers must not write to it."""
    rows = torch.arange(p * q, device=device).view(p, 1, q)
    return rows * runs + torch.arange(runs, device=device).view(1, runs, 1)


def _noise(seed: int, p: int, k: int, q: int, device: torch.device) -> torch.Tensor:
    """int32 noise ``[P, K, Q]`` for the storage-order offsets ``(i * Q + j) * K + k``."""
    if k % philox.VALUES_PER_CALL == 0:  # each call's sixteen offsets lie in one row of K
        counters = _run_counters(p, k // philox.VALUES_PER_CALL, q, device)
        return philox.noise_runs(seed, counters, dim=2).view(p, k, q)
    calls = -(-p * q * k // philox.VALUES_PER_CALL)
    stream = philox.noise_runs(seed, torch.arange(calls, device=device)).flatten()[: p * q * k]
    return stream.view(p, q, k).transpose(1, 2)


def quantize_mx_fast(
    x: torch.Tensor,
    fmt: str = "mxfp4",
    *,
    axis: int = -1,
    block_size: int = 32,
    scale_rule: str = "floor",
    rounding: str = "nearest",
    seed: int | None = None,
    hadamard_block_size: int = 0,
    signs: torch.Tensor | None = None,
) -> MXTensor:
    """``quantize_mx(hadamard_transform(x) if hadamard_block_size else x)``, bit for bit."""
    check_quantize_args(x, fmt, block_size, scale_rule, rounding, axis=axis)
    axis = axis % x.dim()
    if hadamard_block_size:
        check_hadamard_args(x.shape[axis], hadamard_block_size, signs)
    efmt = ELEMENT_FORMATS[fmt]
    v, other = _k_major(x, axis)
    if hadamard_block_size:
        v = _hadamard(v, x.dtype, hadamard_block_size, signs)
    p, k, q = v.shape
    pad = -k % block_size
    if pad:
        v = torch.nn.functional.pad(v, (0, 0, 0, pad))
        k += pad
    nb = k // block_size
    blocks = v.view(p, nb, block_size, q)

    a = blocks.abs()
    amax = a.amax(dim=2, keepdim=True)
    codes_e8m0 = scale_codes(amax, efmt, scale_rule)
    bad = codes_e8m0 == E8M0_NAN
    if bad.any():  # the spec zeroes these blocks: code 0, no sign
        blocks = blocks.masked_fill(bad, 0.0)
        a.masked_fill_(bad, 0.0)
    # |v| / 2**s exactly, as |v| * 2**-s. Every rule keeps s <= 126 for these element formats
    # (float32's largest amax gives 126 under ceil, even and rceil), so 2**-s is a normal float32
    # with biased exponent 254 - code; the zeroed NaN blocks (code 255) get 0.
    a.mul_(_exp2_bits((2 * _F32_BIAS - codes_e8m0.to(torch.int32)).clamp_(min=0)))

    # Element exponent e = max(floor(log2 a), emin), biased; the quantum is 2**(e - mbits).
    exponent = a.view(torch.int32).bitwise_right_shift(_F32_MBITS).clamp_(min=efmt.emin + _F32_BIAS)
    if rounding == "nearest":
        # a / quantum + 2**23 rounds half to even onto the integers (its ulp is 1), so the bits
        # of the sum are _ROUND_BITS + round(a / quantum); a / quantum < 2**(mbits + 2) is exact.
        inv_quantum = _exp2_bits(2 * _F32_BIAS + efmt.mbits - exponent)
        steps = torch.addcmul(a.new_full((), 2.0**_F32_MBITS), a, inv_quantum).view(torch.int32)
        offset = _ROUND_BITS
    else:  # floor((floor(a / quantum * 2**8) + noise) / 2**8), all in integers
        fixed = a.mul_(_exp2_bits(2 * _F32_BIAS + efmt.mbits + philox.NOISE_BITS - exponent)).to(torch.int32)
        noise = _noise(0 if seed is None else seed, p, k, q, v.device).view(p, nb, block_size, q)
        steps = fixed.add_(noise).bitwise_right_shift_(philox.NOISE_BITS)
        offset = 0

    if efmt.bits == 4:
        # E2M1 code 2 * (e - emin) + steps (emin = 0), saturated at 7 (= 6.0), sign in bit 3.
        codes = steps.add_(exponent, alpha=2).sub_(2 * _F32_BIAS + offset).clamp_(max=7)
        codes = codes.sub_(blocks.view(torch.int32) >> 31, alpha=8).to(torch.uint8)  # -1 >> 31 is -1: bit 3
        codes = codes.view(p, k // 2, 2, q)
        data = codes[:, :, 0].bitwise_or(codes[:, :, 1] << 4)
    else:
        quantum = _exp2_bits(exponent.sub_(efmt.mbits))
        values = torch.clamp(steps.sub_(offset).to(torch.float32).mul_(quantum), max=efmt.max_normal)
        data = encode_fp8(torch.copysign(values, blocks), efmt)
    return MXTensor(
        _storage_order(data, p, q, other), _storage_order(codes_e8m0, p, q, other), fmt, axis, block_size, x.shape
    )


def _storage_order(t: torch.Tensor, p: int, q: int, other: tuple[int, ...]) -> torch.Tensor:
    """``[P, n..., Q]`` values as contiguous ``[*other, n]`` (2-D transposes take torch's blocked
    copy); ``n`` is spelled out, not ``-1``, so that an empty tensor keeps its shape."""
    n = math.prod(t.shape[1:-1])
    t = t.view(p, n, q)
    t = t[0].t().contiguous() if p == 1 else t.transpose(1, 2).contiguous()
    return t.view(*other, n)


@functools.cache
def _e2m1_scaled_pair_table(device: torch.device) -> torch.Tensor:
    """The spec's float32 value pairs (low nibble, high nibble) of every byte times every E8M0
    scale, as one int64 at ``256 * scale_code + byte`` (512 KiB: the gather replaces the multiply)."""
    byte = torch.arange(256, dtype=torch.uint8, device=device)
    pairs = torch.stack((decode_e2m1(byte & 0xF), decode_e2m1(byte >> 4)), dim=-1)
    return (pairs * scale_values(byte).view(256, 1, 1)).view(torch.int64).flatten()


def dequantize_blocked_fast(mx: MXTensor) -> torch.Tensor:
    """``mx.dequantize_blocked()``, bit for bit: one gather per byte (and its scale) for E2M1."""
    if mx.element_format.bits != 4:
        return mx.dequantize_blocked()
    rows = mx.data.unflatten(-1, (mx.scales.shape[-1], mx.block_size // 2))
    index = rows + (mx.scales.to(torch.int32) << 8).unsqueeze(-1)
    pairs = _e2m1_scaled_pair_table(mx.device).index_select(0, index.reshape(-1))
    return pairs.view(torch.float32).view(*mx.data.shape[:-1], 2 * mx.data.shape[-1])  # no -1: empty stays empty
