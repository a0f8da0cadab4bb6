"""Fold MXFP4 block scales into FP8 element values, leaving one float32 scale per row.

Hopper has no FP4 tensor cores, but it has a row-wise scaled FP8 GEMM. Every E2M1 value times
``2**(block_exp - row_ref_exp + FOLD_OFFSET)`` is exact in E4M3 as long as the block is at most
``EXACT_BINADES`` binades below the row's largest block (``6 * 2**6 = 384 <= 448`` at the top,
``0.5 * 2**(6 - 14) = 2**-9``, E4M3's smallest subnormal, at the bottom). The leftover ``2**(row_ref_exp -
FOLD_OFFSET)`` is the row's scale. Blocks further down lose their smallest elements to
round-to-nearest-even underflow; the fold counts those elements per row instead of hiding them.

``fold_to_fp8`` runs a Triton kernel (one read of the packed codes and scales, one write of
FP8) on CUDA or under ``TRITON_INTERPRET=1``; ``adahop.ops.fold_fp8`` chooses between it and
``fold_to_fp8_reference``. Its grid is rows x parts of a row (``fold_plan``): a wgrad operand has
a few thousand rows of K = tokens, so long rows are split until the grid fills the GPU; each part
reads its rows' whole scale codes (a byte per 32 elements) for the reference exponent.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ..formats import MXTensor
from ..formats.folded import FoldedFP8
from ..formats.elements import E4M3, decode_e2m1, encode_fp8
from ..formats.scales import E8M0_BIAS, E8M0_NAN
from .launch import INTERPRET, cdiv
from .mx_math import e2m1_to_fp32

FOLD_OFFSET = 6  # c for E4M3: the largest E2M1 value 6 * 2**6 = 384 stays below 448
EXACT_BINADES = 14  # blocks up to this far below their row's reference fold exactly
# Blocks further below than this flush to zero entirely (6 * 2**-16 < 2**-10, half the smallest
# E4M3 subnormal); clamping the shift there keeps every intermediate exact in float32.
FLUSH_SHIFT = -16
PIECE_BYTES = 8  # packed bytes per thread access: 8 in, 16 E4M3 codes (one 16-byte store) out
# The launch plan (``fold_plan``): pieces per loop step of a program (one a thread at 4 warps: with
# two, ptxas spills the byte-table gathers' addresses at 64 registers; benchmarks/quantize/fold_sm90.py),
# the narrowest step along a row, and how many 4-warp programs an SM holds at 64 registers a thread
# (its 64K registers), which is what one wave of the grid is counted in.
TILE_PIECES = 128
MIN_CHUNK = 16
RESIDENT_PROGRAMS_PER_SM = 8
H200_SMS = 132  # the SM count the interpreter plans for

# The same numbers as Triton compile-time constants, plus the E4M3 facts the kernel needs.
_OFFSET = tl.constexpr(FOLD_OFFSET)
_FLUSH = tl.constexpr(FLUSH_SHIFT)
_E4M3_NAN_PAIR = tl.constexpr(0x7F7F)
_PIECE = tl.constexpr(PIECE_BYTES)
_MIN_NORMAL_SHIFT = tl.constexpr(-5)  # 0.5 * 2**-5 = 2**-6, E4M3's smallest normal
_E4M3_MIN_NORMAL = tl.constexpr(2.0**-6)
_E4M3_SUBNORMAL_STEPS = tl.constexpr(512.0)  # 1 / 2**-9, the subnormal quantum
_RNE_MAGIC = tl.constexpr(12582912.0)  # 1.5 * 2**23: (x + magic) - magic rounds to even


def check_fold_operand(mx: MXTensor) -> None:
    """Folding needs a 2-D MXFP4 matrix blocked along its rows (the GEMM's K axis)."""
    if not isinstance(mx, MXTensor):
        raise TypeError(f"expected an MXTensor, got {type(mx).__name__}")
    if mx.fmt != "mxfp4":
        raise ValueError(f"folding into FP8 needs fmt='mxfp4', got {mx.fmt!r}")
    if len(mx.shape) != 2 or mx.axis != 1:
        raise ValueError(
            f"expected a 2-D MXTensor with blocks along axis 1 (K last), got shape "
            f"{tuple(mx.shape)} with axis={mx.axis}; quantize the transposed copy with axis=-1"
        )


def fold_to_fp8_reference(mx: MXTensor) -> FoldedFP8:
    """Pure PyTorch fold; the specification the Triton kernel is tested against."""
    check_fold_operand(mx)
    codes = mx.scales.to(torch.int32)
    finite = codes != E8M0_NAN
    ref = torch.where(finite, codes, 0).amax(dim=-1, keepdim=True)
    shift = torch.clamp(codes - ref + FOLD_OFFSET, min=FLUSH_SHIFT)
    blocks = decode_e2m1(mx.codes()).unflatten(-1, (-1, mx.block_size))
    exact = blocks * torch.ldexp(torch.ones_like(blocks[..., 0]), shift).unsqueeze(-1)
    exact = torch.where(finite.unsqueeze(-1), exact, float("nan")).flatten(-2)
    data = exact.to(torch.float8_e4m3fn)
    lossy = (data.to(torch.float32) != exact) & ~exact.isnan()
    row_scale = torch.ldexp(torch.ones_like(exact[:, 0]), ref.squeeze(-1) - E8M0_BIAS - FOLD_OFFSET)
    return FoldedFP8(data, row_scale, lossy.sum(dim=-1, dtype=torch.int32))


@functools.cache
def byte_pair_lut(device: torch.device) -> torch.Tensor:
    """int32 [256]: for a packed byte, its two E2M1 codes as E4M3 bits (low byte first) in the
    low 16 bits, and 0x01 in bits 16 / 24 where the element is nonzero (whose exponent moves)."""
    byte = torch.arange(256, dtype=torch.uint8)
    codes = torch.stack((byte & 0xF, byte >> 4))  # low nibble, high nibble
    e4m3 = encode_fp8(decode_e2m1(codes), E4M3).to(torch.int32)  # exact: E2M1 values are E4M3 values
    nonzero = ((codes & 7) != 0).to(torch.int32)
    lut = e4m3[0] | (e4m3[1] << 8) | (nonzero[0] << 16) | (nonzero[1] << 24)
    return lut.to(device)


@triton.jit
def _e4m3_bits_of_folded(x):
    """E4M3 bits of ``x >= 0``, an E2M1 value times a power of two (so at most 2 significant bits).

    Normal results are exact: re-bias float32's exponent and keep 3 mantissa bits. Below E4M3's
    smallest normal, round to the subnormal grid with ties to even.
    """
    steps = x * _E4M3_SUBNORMAL_STEPS
    subnormal = ((steps + _RNE_MAGIC) - _RNE_MAGIC).to(tl.int32)
    bits = x.to(tl.int32, bitcast=True)
    normal = (((bits >> 23) - (127 - 7)) << 3) | ((bits >> 20) & 7)
    return tl.where(x < _E4M3_MIN_NORMAL, subnormal, normal), steps != subnormal.to(tl.float32)


@triton.jit
def _fold_nibbles(codes, shift):
    """E4M3 bits of ``e2m1(codes) * 2**shift`` rounded to nearest even, and which ones lost bits."""
    pow2 = ((shift + 127) << 23).to(tl.float32, bitcast=True)  # 2**shift, normal for shift >= -16
    mag, lossy = _e4m3_bits_of_folded(tl.abs(e2m1_to_fp32(codes)) * pow2)
    return mag | ((codes & 8).to(tl.int32) << 4), lossy


@triton.jit
def _reference_exponents(scales_ptr, rows, row_ok, n_blocks, first_block, last_block, SCALE_CHUNK: tl.constexpr):
    """Each row's reference exponent (its largest finite E8M0 code, over the whole row) and its
    smallest code among blocks ``[first_block, last_block)``, the part this program folds.

    A scale code is one byte per 32 elements, so every program of a split row reads its rows'
    codes in full: the reference needs no second pass and no communication between programs.
    """
    scale_rows = scales_ptr + rows.to(tl.int64)[:, None] * n_blocks
    ref = tl.zeros(rows.shape, dtype=tl.int32)
    low = tl.full(rows.shape, 255, dtype=tl.int32)
    for b0 in range(0, n_blocks, SCALE_CHUNK):
        blk = b0 + tl.arange(0, SCALE_CHUNK)[None, :]
        codes = tl.load(scale_rows + blk, mask=row_ok[:, None] & (blk < n_blocks), other=255).to(tl.int32)
        ref = tl.maximum(ref, tl.max(tl.where(codes == 255, 0, codes), axis=1))
        in_part = (blk >= first_block) & (blk < last_block)
        low = tl.minimum(low, tl.min(tl.where(in_part, codes, 255), axis=1))
    return ref, low


@triton.jit
def _fold_rows(
    data_ptr,
    scales_ptr,
    lut_ptr,
    out_ptr,
    rows,
    row_ok,
    ref,
    n_blocks,
    start,
    stop,
    HALF_BLOCK: tl.constexpr,
    CHUNK: tl.constexpr,
    EXACT: tl.constexpr,
):
    """Fold pieces ``[start, stop)`` of ``rows`` in [rows, pieces, 8 bytes] tiles,
    each packed byte into a pair of E4M3 codes.

    A thread reads 8 packed bytes and writes 16 E4M3 codes: one 16-byte store, and the same
    register layout for both (no shuffle through shared memory). ``EXACT=False`` serves rows
    whose blocks all stay normal E4M3 numbers: a table gives a byte's two unshifted codes and the
    shift is added to both exponent fields at once. ``EXACT=True`` rounds far-below blocks onto
    the subnormal grid and counts the elements that lose bits.
    """
    pieces_per_block: tl.constexpr = HALF_BLOCK // _PIECE
    row_bytes = rows.to(tl.int64)[:, None, None] * (n_blocks * HALF_BLOCK)
    scale_rows = scales_ptr + rows.to(tl.int64)[:, None, None] * n_blocks
    byte = tl.arange(0, _PIECE)[None, None, :]
    n_lossy = tl.zeros(rows.shape, dtype=tl.int32)
    for p0 in range(start, stop, CHUNK):
        piece = p0 + tl.arange(0, CHUNK)[None, :, None]
        ok = row_ok[:, None, None] & (piece < stop)
        codes = tl.load(scale_rows + piece // pieces_per_block, mask=ok, other=0).to(tl.int32)
        nan = codes == 255
        # Exponent shift of each block relative to the row's reference (none where masked).
        shift = tl.where(nan | ~ok, _OFFSET, codes - ref[:, None, None] + _OFFSET)
        offs = row_bytes + piece * _PIECE + byte
        packed = tl.load(data_ptr + offs, mask=ok, other=0)
        if EXACT:
            flushed = tl.maximum(shift, _FLUSH)
            lo, lossy_lo = _fold_nibbles(packed & 0xF, flushed)
            hi, lossy_hi = _fold_nibbles(packed >> 4, flushed)
            pair = lo | (hi << 8)
            lossy = (lossy_lo.to(tl.int32) + lossy_hi.to(tl.int32)) * (ok & ~nan)
            n_lossy += tl.sum(tl.sum(lossy, axis=2), axis=1)
        else:
            entry = tl.load(lut_ptr + packed)
            pair = (entry & 0xFFFF) + (entry >> 16) * (shift << 3)
        pair = tl.where(nan, _E4M3_NAN_PAIR, pair)
        tl.store(out_ptr + offs, pair.to(tl.int16), mask=ok)
    return n_lossy


@triton.jit
def _fold_kernel(
    data_ptr,
    scales_ptr,
    lut_ptr,
    out_ptr,
    row_scale_ptr,
    lossy_ptr,
    n_rows,
    n_blocks,
    split_pieces,
    HALF_BLOCK: tl.constexpr,
    BLOCK_R: tl.constexpr,
    CHUNK: tl.constexpr,
    SCALE_CHUNK: tl.constexpr,
    SPLIT: tl.constexpr,
):
    """Program (i, j) folds rows ``[i * BLOCK_R, (i + 1) * BLOCK_R)``, pieces ``[j * split_pieces,
    (j + 1) * split_pieces)`` of each. ``SPLIT``: rows have more than one part (grid axis 1 > 1),
    so the parts add their lossy counts into a zeroed array; otherwise each program stores them."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    row_ok = rows < n_rows
    part = tl.program_id(1)
    pieces_per_block: tl.constexpr = HALF_BLOCK // _PIECE
    start = part * split_pieces
    stop = tl.minimum(start + split_pieces, n_blocks * pieces_per_block)
    first_block = start // pieces_per_block
    last_block = (stop + pieces_per_block - 1) // pieces_per_block

    ref, low = _reference_exponents(scales_ptr, rows, row_ok, n_blocks, first_block, last_block, SCALE_CHUNK)
    # 2**(ref - 127 - FOLD_OFFSET) from bits; a subnormal float32 when the biased exponent is <= 0.
    scale_exp = ref - _OFFSET
    scale_bits = tl.where(scale_exp > 0, scale_exp << 23, 1 << (22 + scale_exp))
    if part == 0:
        tl.store(row_scale_ptr + rows, scale_bits, mask=row_ok)

    # One decision per program keeps the common loop free of rounding work and reductions.
    if tl.min(low - ref) + _OFFSET >= _MIN_NORMAL_SHIFT:
        n_lossy = _fold_rows(
            data_ptr, scales_ptr, lut_ptr, out_ptr, rows, row_ok, ref, n_blocks, start, stop, HALF_BLOCK, CHUNK, False
        )
    else:
        n_lossy = _fold_rows(
            data_ptr, scales_ptr, lut_ptr, out_ptr, rows, row_ok, ref, n_blocks, start, stop, HALF_BLOCK, CHUNK, True
        )
    if SPLIT:
        tl.atomic_add(lossy_ptr + rows, n_lossy, mask=row_ok & (n_lossy > 0), sem="relaxed")
    else:
        tl.store(lossy_ptr + rows, n_lossy, mask=row_ok)


@dataclass(frozen=True)
class FoldConfig:
    """Tile of the fold kernel: rows per program, 8-byte pieces of each row per loop step, parts
    each row is split into (programs along K), warps and the per-thread register cap (ptxas'
    maxnreg; None: the compiler's choice)."""

    block_r: int = 4
    chunk: int = 32
    splits: int = 1
    scale_chunk: int = 128
    num_warps: int = 4
    max_registers: int | None = 64  # more resident warps on long rows (results: 2026-12-04-h200-quantize-kernels)


def _next_pow2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def fold_plan(n_rows: int, row_pieces: int, n_sms: int) -> FoldConfig:
    """The tile and grid for an operand of ``n_rows`` rows of ``row_pieces`` 8-byte pieces.

    Every loop step covers ``TILE_PIECES`` pieces: long rows take one row per program (a wide
    tile), short rows several. Rows are then split into parts (a power of two) until the grid
    holds at least one wave of resident programs, so an operand with few long rows (a wgrad
    operand: K = tokens) still keeps every SM busy; no part is shorter than one loop step.
    """
    chunk = min(TILE_PIECES, max(MIN_CHUNK, _next_pow2(row_pieces)))
    block_r = TILE_PIECES // chunk
    row_programs, steps = cdiv(n_rows, block_r), cdiv(row_pieces, chunk)
    splits = 1
    while row_programs * splits < n_sms * RESIDENT_PROGRAMS_PER_SM and 2 * splits <= steps:
        splits *= 2
    return FoldConfig(block_r=block_r, chunk=chunk, splits=splits)


def fold_grid(n_rows: int, row_pieces: int, config: FoldConfig) -> tuple[int, tuple[int, int]]:
    """Pieces in each part of a row and the grid (row blocks, parts): parts are whole loop steps,
    so only a row's last part is short."""
    split_pieces = max(1, cdiv(cdiv(row_pieces, config.splits), config.chunk)) * config.chunk
    return split_pieces, (cdiv(n_rows, config.block_r), cdiv(row_pieces, split_pieces))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else H200_SMS


def planned_config(mx: MXTensor) -> FoldConfig:
    """``fold_plan`` for ``mx`` (its rows as stored, padded to whole blocks) on its device."""
    n_rows, n_blocks = mx.scales.shape
    return fold_plan(n_rows, n_blocks * mx.block_size // (2 * PIECE_BYTES), _sm_count(mx.data.device))


def fold_to_fp8(mx: MXTensor, config: FoldConfig | None = None) -> FoldedFP8:
    """Fold an [R, K] MXFP4 matrix (blocks along K) into E4M3 data and per-row scales;
    ``config``: the tile and grid (default: ``fold_plan`` for the shape and the device)."""
    check_fold_operand(mx)
    if not (mx.device.type == "cuda" or INTERPRET):
        raise RuntimeError(
            f"fold_to_fp8 runs on CUDA (or under TRITON_INTERPRET=1), got a tensor on {mx.device}; "
            "use fold_to_fp8_reference, or adahop.ops.fold_fp8 which picks one"
        )
    if mx.block_size % (2 * PIECE_BYTES):
        raise ValueError(f"fold_to_fp8 needs blocks of a multiple of {2 * PIECE_BYTES} elements, got {mx.block_size}")
    n_rows, n_blocks = mx.scales.shape
    device = mx.data.device
    config = config or planned_config(mx)
    split_pieces, grid = fold_grid(n_rows, n_blocks * mx.block_size // (2 * PIECE_BYTES), config)
    parts = grid[1]
    data = torch.empty(n_rows, n_blocks * mx.block_size // 2, dtype=torch.int16, device=device)
    # Separate tensors, not views of one: adahop::fold_fp8's outputs may not alias each other.
    row_scale = torch.empty(n_rows, dtype=torch.float32, device=device)
    lossy = (torch.zeros if parts > 1 else torch.empty)(n_rows, dtype=torch.int32, device=device)
    _fold_kernel[grid](
        mx.data.contiguous(),
        mx.scales.contiguous(),
        byte_pair_lut(device),
        data,
        row_scale.view(torch.int32),
        lossy,
        n_rows,
        n_blocks,
        split_pieces,
        HALF_BLOCK=mx.block_size // 2,
        BLOCK_R=config.block_r,
        CHUNK=config.chunk,
        SCALE_CHUNK=config.scale_chunk,
        SPLIT=parts > 1,
        num_warps=config.num_warps,
        maxnreg=config.max_registers,
    )
    return FoldedFP8(data.view(torch.float8_e4m3fn), row_scale, lossy)
