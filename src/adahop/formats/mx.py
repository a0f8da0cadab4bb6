"""The reference MX quantizer: ``quantize_mx`` and ``MXTensor``.

This pure-PyTorch code *is* the specification of adahop's numerics; the Triton kernels are
tested bit-for-bit against it. Per block of ``block_size`` consecutive elements along ``axis``:

1. ``amax`` = max |v| of the block; a block holding NaN or Inf gets scale code 255 and
   dequantizes to NaN as a whole (its element codes are 0).
2. shared exponent ``s`` from the scale rule (see :mod:`adahop.formats.scales`).
3. each element ``v / 2**s`` is rounded onto the element grid (round-to-nearest-even, or
   stochastic with Philox noise keyed by ``seed`` and the element's index) and saturated.

Storage puts the block axis last: ``data`` is ``[*other_dims, padded_len]`` (for FP4 two
elements per byte, the lower-index element in the low nibble) and ``scales`` is
``[*other_dims, n_blocks]``. A block axis that is not a multiple of ``block_size`` is padded
with zeros; ``dequantize`` returns the original shape.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import philox
from .elements import (
    E2M1,
    E4M3,
    E5M2,
    ElementFormat,
    decode_e2m1,
    decode_fp8,
    encode_e2m1,
    encode_fp8,
    round_to_element,
)
from .scales import SCALE_RULES, E8M0_NAN, scale_codes, scale_values

ELEMENT_FORMATS: dict[str, ElementFormat] = {"mxfp4": E2M1, "mxfp8_e4m3": E4M3, "mxfp8_e5m2": E5M2}
ROUNDING_MODES = ("nearest", "stochastic")
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class MXTensor:
    """A tensor in an MX format: packed element codes plus one E8M0 scale per block."""

    data: torch.Tensor  # uint8, block axis last (FP4: two codes per byte)
    scales: torch.Tensor  # uint8 E8M0 codes, [*other_dims, n_blocks]
    fmt: str
    axis: int  # block axis in the original shape (non-negative)
    block_size: int
    shape: torch.Size  # original shape

    @property
    def element_format(self) -> ElementFormat:
        return ELEMENT_FORMATS[self.fmt]

    @property
    def nbytes(self) -> int:
        return self.data.numel() * self.data.element_size() + self.scales.numel()

    @property
    def device(self) -> torch.device:
        return self.data.device

    def codes(self) -> torch.Tensor:
        """Unpacked element codes (uint8), ``[*other_dims, padded_len]``."""
        if self.element_format.bits == 8:
            return self.data
        return torch.stack((self.data & 0xF, self.data >> 4), dim=-1).flatten(-2)

    def dequantize_blocked(self) -> torch.Tensor:
        """float32 values in storage layout (block axis last, padding kept)."""
        fmt = self.element_format
        codes = self.codes()
        values = decode_e2m1(codes) if fmt.bits == 4 else decode_fp8(codes, fmt)
        blocks = values.unflatten(-1, (-1, self.block_size))
        return (blocks * scale_values(self.scales).unsqueeze(-1)).flatten(-2)

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Values in the original shape and layout."""
        values = self.dequantize_blocked()[..., : self.shape[self.axis]]
        return values.movedim(-1, self.axis).to(dtype)

    def __repr__(self) -> str:
        return (
            f"MXTensor(fmt={self.fmt}, shape={tuple(self.shape)}, axis={self.axis}, "
            f"block_size={self.block_size}, nbytes={self.nbytes}, device={self.device})"
        )


def pack_codes(codes: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Element codes (uint8, block axis last) as ``MXTensor.data``: FP4 two per byte, the
    lower-index element in the low nibble; FP8 one per byte."""
    if fmt.bits == 8:
        return codes.contiguous()
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def storage_shapes(outer: int, length: int, fmt: str, block_size: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """(codes bytes, E8M0 scales) shapes of ``outer`` rows of ``length`` elements blocked along
    the rows, the block axis padded to whole blocks (the storage of a 2-D MXTensor)."""
    padded = -(-length // block_size) * block_size
    return (outer, padded * ELEMENT_FORMATS[fmt].bits // 8), (outer, padded // block_size)


def check_quantize_args(
    x: torch.Tensor, fmt: str, block_size: int, scale_rule: str, rounding: str, axis: int = -1
) -> None:
    """Raise a clear error for arguments the MX formats do not define."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"quantize_mx expects a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"quantize_mx supports {_INPUT_DTYPES} inputs, got {x.dtype}")
    if x.dim() == 0:
        raise ValueError("quantize_mx needs at least one dimension")
    if not -x.dim() <= axis < x.dim():
        raise IndexError(
            f"quantize_mx: axis {axis} is out of range for a {x.dim()}-D tensor (expected -{x.dim()} to {x.dim() - 1})"
        )
    if fmt not in ELEMENT_FORMATS:
        raise ValueError(f"unknown MX format {fmt!r}; choose one of {tuple(ELEMENT_FORMATS)}")
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"unknown scale_rule {scale_rule!r}; choose one of {SCALE_RULES}")
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding {rounding!r}; choose one of {ROUNDING_MODES}")
    if block_size <= 0 or (fmt == "mxfp4" and block_size % 2):
        raise ValueError(f"block_size must be positive (and even for mxfp4), got {block_size}")


def to_blocks(x: torch.Tensor, axis: int, block_size: int) -> torch.Tensor:
    """float32 view of ``x`` with the block axis moved last, zero-padded, split into blocks."""
    v = x.movedim(axis, -1).to(torch.float32)
    pad = -v.shape[-1] % block_size
    if pad:
        v = torch.nn.functional.pad(v, (0, pad))
    return v.unflatten(-1, (-1, block_size))


def quantize_mx(
    x: torch.Tensor,
    fmt: str = "mxfp4",
    *,
    axis: int = -1,
    block_size: int = 32,
    scale_rule: str = "floor",
    rounding: str = "nearest",
    seed: int | None = None,
) -> MXTensor:
    """Quantize ``x`` to an MX format with blocks of ``block_size`` along ``axis``.

    Args:
        fmt: ``"mxfp4"`` (E2M1), ``"mxfp8_e4m3"`` or ``"mxfp8_e5m2"``.
        scale_rule: ``"floor"`` (OCP), ``"ceil"``, ``"even"`` or ``"rceil"``; see
            :mod:`adahop.formats.scales`.
        rounding: ``"nearest"`` (ties to even) or ``"stochastic"`` (unbiased where the scale
            rule does not clip; deterministic for a given ``seed``, default 0). ``seed`` keys only
            stochastic rounding; nearest rounding has no noise to key (callers pass one key per operand).
    """
    check_quantize_args(x, fmt, block_size, scale_rule, rounding, axis)
    axis = axis % x.dim()
    efmt = ELEMENT_FORMATS[fmt]
    blocks = to_blocks(x, axis, block_size)

    amax = blocks.abs().amax(dim=-1)
    codes_e8m0 = scale_codes(amax, efmt, scale_rule)
    bad = codes_e8m0 == E8M0_NAN
    scaled = blocks / scale_values(torch.where(bad, 0, codes_e8m0)).unsqueeze(-1)
    scaled = torch.where(bad.unsqueeze(-1), 0.0, scaled)

    noise = None
    if rounding == "stochastic":
        offsets = torch.arange(scaled.numel(), device=x.device).view(scaled.shape)
        noise = philox.uniform(0 if seed is None else seed, offsets)
    q = round_to_element(scaled, efmt, noise).flatten(-2)
    codes = encode_e2m1(q) if efmt.bits == 4 else encode_fp8(q, efmt)
    return MXTensor(pack_codes(codes, efmt), codes_e8m0, fmt, axis, block_size, x.shape)
