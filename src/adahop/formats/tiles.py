"""Square-tile MX quantization of a matrix: one E8M0 scale per ``tile x tile`` tile.

A weight W [out, in] is read blocked along ``in`` by the forward GEMM and along ``out`` by dgrad.
With 1-D blocks it is quantized twice, and the two GEMMs see different values (quantize and
transpose do not commute). A square tile's scale is valid in both orientations, so one
quantization serves both: :func:`quantize_mx_tiles` returns the same values as two
:class:`MXTensor` s, one blocked along the rows and one along the columns.

The scale comes from the tile's amax by the usual scale rules, and the elements are rounded and
encoded as :func:`quantize_mx` does: it does the work, on the tiles laid out as blocks of
``tile**2`` elements (each tile row-major). So stochastic noise is keyed by an element's offset
in that tile layout.
"""

from __future__ import annotations

import torch

from .mx import ELEMENT_FORMATS, MXTensor, check_quantize_args, pack_codes, quantize_mx


def quantize_mx_tiles(
    x: torch.Tensor,
    fmt: str = "mxfp4",
    *,
    tile_size: int = 32,
    scale_rule: str = "floor",
    rounding: str = "nearest",
    seed: int | None = None,
) -> tuple[MXTensor, MXTensor]:
    """``x`` [R, C] with one scale per ``tile_size x tile_size`` tile (edges zero-padded).

    Returns (blocked along dim 1, blocked along dim 0), both with blocks of ``tile_size``: the
    same element codes and tile scales in two storage layouts, so their ``dequantize()`` are equal.
    """
    if x.dim() != 2:
        raise ValueError(f"quantize_mx_tiles expects a 2-D tensor, got shape {tuple(x.shape)}")
    check_quantize_args(x, fmt, tile_size, scale_rule, rounding)
    t, (rows, cols) = tile_size, x.shape
    padded = torch.nn.functional.pad(x, (0, -cols % t, 0, -rows % t))
    nr, nc = padded.shape[0] // t, padded.shape[1] // t
    tiles = padded.view(nr, t, nc, t).permute(0, 2, 1, 3).reshape(nr, nc, t * t)
    q = quantize_mx(tiles, fmt, block_size=t * t, scale_rule=scale_rule, rounding=rounding, seed=seed)
    codes = q.codes().view(nr, nc, t, t).permute(0, 2, 1, 3).reshape(nr * t, nc * t)
    scales = q.scales.view(nr, nc)
    efmt = ELEMENT_FORMATS[fmt]
    along_rows = MXTensor(
        pack_codes(codes[:rows], efmt), scales.repeat_interleave(t, dim=0)[:rows].contiguous(), fmt, 1, t, x.shape
    )
    return along_rows, tiles_along_cols(along_rows)


def tiles_along_cols(along_rows: MXTensor) -> MXTensor:
    """A tile quantization blocked along dim 0, from the same one blocked along dim 1 (the first
    output of :func:`quantize_mx_tiles`): codes transposed, one scale per tile. So a tile
    quantization can be stored, sent or gathered once and read in both orientations."""
    t, (rows, cols) = along_rows.block_size, along_rows.shape
    codes = along_rows.codes().t()[:cols]  # the zero-padded rows of the last tile row encode as code 0
    codes = torch.nn.functional.pad(codes, (0, -rows % t))
    tile_scales = along_rows.scales[::t]  # [row tiles, column tiles]
    return MXTensor(
        pack_codes(codes, along_rows.element_format),
        tile_scales.t().repeat_interleave(t, dim=0)[:cols].contiguous(),
        along_rows.fmt,
        0,
        t,
        along_rows.shape,
    )
