"""Fused (Hadamard +) MX quantization: one read of a 2-D tensor, packed codes and E8M0 scales out.

``quantize_mx_triton(x, ...)`` equals, bit for bit,
``quantize_mx(hadamard_transform(x, axis=axis, block_size=hb, signs=signs) if hb else x, ...)``
for every format, scale rule and rounding mode, with stochastic-rounding noise drawn from the
same Philox stream (``formats.philox``) at the same offsets. ``quantize_mx_triton_both`` writes
the row-wise copy (blocks along ``in``, for the forward GEMM) and the column-wise copy (blocks
along tokens, for wgrad/dgrad) from a single read.

Hadamard decision: the transform runs as a fixed-order butterfly (``log2(hb)`` add/subtract
stages on float32, then one multiply by ``1/sqrt(hb)``), and ``hadamard_transform`` is defined
by the same butterfly, so the two agree bit for bit on every device. A ``tl.dot`` against ``H``
sums in an order set by the tensor cores and could only match to an ulp or two, flipping codes.
Kernels (this module plans and launches them). ``quantize_general._quantize_mx_kernel`` is the
general one (any format, block size, Hadamard size, both orientations from one read). Two MXFP4
kernels for the shapes training uses keep every block inside one thread:
``quantize_mxfp4._quantize_rows_kernel`` (row-wise) and ``quantize_mxfp4._quantize_cols_kernel``
(column-wise), with or without the 32-point Hadamard; in the general kernel Triton spreads a
block over lanes and pays in shuffles and selects. Their device functions are in
``quantize_blocks`` and ``mx_math``.
Cost. On sm_90 quantization is bound by the instructions it issues (the integer-logic pipe,
16 lanes per scheduler, most of all), not by memory, so: E2M1 rounding to nearest is the
minimum of three FMA-rounded lines (``mx_math.encode_e2m1_nearest``); stochastic rounding
takes 8 noise bits per element, sixteen elements per Philox4x32-10 call, added in fixed point;
block maxima are float maxima that keep NaN. ``benchmarks/quantize/sass_counts.py`` prints the static
instruction counts per element; ``adahop bench --only quantize`` measures each kernel against
copy bandwidth (results in ``benchmarks/quantize/``).

The tensor is processed in ``[block_m, block_n]`` tiles; a tile's block axis holds whole MX
blocks and whole Hadamard blocks. Runs on CUDA, or on CPU tensors under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import triton

from ..formats.mx import ELEMENT_FORMATS, MXTensor, check_quantize_args, storage_shapes
from ..transforms.hadamard import check_hadamard_args
from .launch import QuantizeSpec, cdiv, quantize_spec, seed_pointer, zero_seed
from .quantize_general import _quantize_mx_kernel
from .quantize_mxfp4 import _quantize_cols_kernel, _quantize_rows_kernel
from .quantize_tiling import GENERAL_COLWISE_TILING, H32_SR_MAX_REGISTERS, QuantizeTiling, default_tiling


@dataclass(frozen=True)
class _LaunchPlan:
    """What a quantize call needs besides its tensors: it depends only on shapes and options,
    so it is built (and checked) once per distinct call and cached; a training step makes
    hundreds of calls, and the Python that builds this costs more than the launch itself."""

    kernel: triton.JITFunction
    grid: tuple[int, int]
    row_shapes: tuple[tuple[int, int], tuple[int, int]] | None  # (codes bytes, scales) per orientation
    col_shapes: tuple[tuple[int, int], tuple[int, int]] | None
    word_units: bool  # the kernel writes codes as int32 words (else bytes)
    sizes: dict[str, int]  # the kernel's integer arguments, by name
    outputs: tuple[tuple[str, str] | None, tuple[str, str] | None]  # (codes, scales) argument names per orientation
    hadamard_scale: float
    constexprs: dict


@functools.lru_cache(maxsize=4096)
def _launch_plan(
    M: int,
    N: int,
    strides: tuple[int, int],
    spec: QuantizeSpec,
    rowwise: bool,
    colwise: bool,
    signs_shape: tuple[int, ...] | None,
    tiling: QuantizeTiling | None,
) -> _LaunchPlan:
    fmt, block_size, hb, on_cuda = spec.fmt, spec.block_size, spec.hadamard, spec.native_casts
    if block_size & (block_size - 1):
        raise ValueError(f"the fused quantizer needs a power-of-two block_size, got {block_size}")
    if spec.scores and rowwise and colwise:
        raise ValueError("scores are recorded for one orientation at a time")
    if spec.has_signs and not hb:
        raise ValueError("signs are only used with a hadamard_block_size")
    if hb:
        signs = None if signs_shape is None else torch.empty(signs_shape, device="meta")
        for length in (N,) * rowwise + (M,) * colwise:
            check_hadamard_args(length, hb, signs)
    efmt = ELEMENT_FORMATS[fmt]
    kernel = None
    if efmt.bits == 4 and block_size == 32 and strides[1] == 1 and hb in (0, 32) and rowwise != colwise:
        kernel = _quantize_rows_kernel if rowwise else _quantize_cols_kernel  # whole blocks in a thread
        if rowwise and not hb and not spec.stochastic:
            # Fewer instructions, yet slower on the H200 than the general kernel
            # (benchmarks/quantize/2026-12-02-h200-pass10-quantize-ab.txt).
            kernel = None
    orientation = "both" if rowwise and colwise else "rowwise" if rowwise else "colwise"
    if tiling is None:
        general_colwise = kernel is None and orientation == "colwise" and on_cuda
        tiling = (
            GENERAL_COLWISE_TILING
            if general_colwise
            else default_tiling(orientation, torch.device("cuda" if on_cuda else "cpu"), bool(hb))
        )
    whole_blocks = max(block_size, hb)  # a tile's block axis holds whole MX and Hadamard blocks
    tiling = tiling.fit(whole_blocks if colwise else 1, whole_blocks if rowwise else 1)

    m_padded, n_padded = cdiv(M, block_size) * block_size, cdiv(N, block_size) * block_size
    constexprs = dict(SPEC=spec, num_warps=tiling.num_warps, maxnreg=tiling.max_registers)
    grid = (cdiv(M, tiling.block_m), cdiv(N, tiling.block_n))
    hadamard_scale = 1 / math.sqrt(hb) if hb else 1.0
    per_unit = spec.codes_per_unit
    if kernel is _quantize_rows_kernel:
        sizes = dict(M=M, N=N, stride_m=strides[0], n_padded=n_padded)
        outputs = (("data_ptr", "scale_ptr"), None)
        constexprs.update(BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n)
        if spec.stochastic and spec.hadamard and tiling.max_registers is None:
            constexprs["maxnreg"] = H32_SR_MAX_REGISTERS
    elif kernel is _quantize_cols_kernel:
        grid = (cdiv(M, 32), cdiv(N, tiling.block_n))
        sizes = dict(M=M, N=N, m_padded=m_padded)
        outputs = (None, ("data_ptr", "scale_ptr"))
        masked = M % 32 != 0 or N % tiling.block_n != 0
        constexprs.update(STRIDE_M=strides[0], BLOCK_N=tiling.block_n, MASKED=masked)
        if spec.stochastic and spec.hadamard and not (masked or spec.scores) and tiling.max_registers is None:
            constexprs["maxnreg"] = H32_SR_MAX_REGISTERS
    else:
        kernel = _quantize_mx_kernel
        sizes = dict(M=M, N=N, stride_m=strides[0], stride_n=strides[1], m_padded=m_padded, n_padded=n_padded)
        outputs = (("row_data_ptr", "row_scale_ptr"), ("col_data_ptr", "col_scale_ptr"))
        constexprs.update(ROWWISE=rowwise, COLWISE=colwise, BLOCK_M=tiling.block_m, BLOCK_N=tiling.block_n)
    return _LaunchPlan(
        kernel,
        grid,
        storage_shapes(M, N, fmt, block_size) if rowwise else None,
        storage_shapes(N, M, fmt, block_size) if colwise else None,
        per_unit * efmt.bits == 32,
        sizes,
        outputs,
        hadamard_scale,
        constexprs,
    )


class QuantizeLaunch(NamedTuple):
    """One quantize call, ready to go: ``kernel[grid](**arguments)`` writes ``row`` and ``col``
    (the orientations asked for; None for the other)."""

    kernel: triton.JITFunction
    grid: tuple[int, int]
    arguments: dict  # every kernel parameter by name, and the launch options (num_warps)
    row: MXTensor | None
    col: MXTensor | None
    score: torch.Tensor | None  # each stored row's outlier score, when asked


def quantize_launch(
    x: torch.Tensor,
    fmt: str,
    *,
    rowwise: bool,
    colwise: bool,
    block_size: int,
    scale_rule: str,
    rounding: str,
    seed: int | torch.Tensor | None,
    hadamard_block_size: int,
    signs: torch.Tensor | None,
    scores: bool,
    tiling: QuantizeTiling | None,
) -> QuantizeLaunch:
    """The launch that quantizes ``x``, prepared (arguments checked, outputs allocated) but not
    made: what ``_quantize`` runs, and what ``benchmarks/linear/host_overhead.py`` times on its own."""
    check_quantize_args(x, fmt, block_size, scale_rule, rounding)
    if x.dim() != 2:
        raise ValueError(f"the fused quantizer takes 2-D tensors, got shape {tuple(x.shape)}")
    M, N = x.shape
    signs_shape = None if signs is None else tuple(signs.shape)
    has_signs = signs is not None
    spec = quantize_spec(
        x.dtype, x.is_cuda, fmt, block_size, scale_rule, rounding, hadamard_block_size, has_signs, scores
    )
    plan = _launch_plan(M, N, x.stride(), spec, rowwise, colwise, signs_shape, tiling)
    # Zeros: the kernels raise each score to their part's abs-max (atomically, as float32 bits).
    score = torch.zeros(M if rowwise else N, dtype=torch.float32, device=x.device) if scores else None
    args = dict(
        x_ptr=x.view(torch.int16) if x.dtype == torch.bfloat16 else x,
        signs_ptr=x if signs is None else signs.to(device=x.device, dtype=torch.float32).contiguous(),
        score_ptr=None if score is None else score.view(torch.int32),
    )
    results = []
    for axis, shapes, names in ((1, plan.row_shapes, plan.outputs[0]), (0, plan.col_shapes, plan.outputs[1])):
        if shapes is None:
            results.append(None)
            if names is not None:  # the general kernel, told not to write this orientation
                args |= dict.fromkeys(names)
            continue
        data = torch.empty(shapes[0], dtype=torch.uint8, device=x.device)
        scales = torch.empty(shapes[1], dtype=torch.uint8, device=x.device)
        args |= {names[0]: data.view(torch.int32) if plan.word_units else data, names[1]: scales}
        results.append(MXTensor(data, scales, fmt, axis, block_size, x.shape))
    seed_ptr = seed_pointer(x.device, seed) if rounding == "stochastic" else zero_seed(x.device)
    args.update(plan.sizes, seed_ptr=seed_ptr, hadamard_scale=plan.hadamard_scale, **plan.constexprs)
    return QuantizeLaunch(plan.kernel, plan.grid, args, results[0], results[1], score)


def _quantize(x: torch.Tensor, fmt: str, **options) -> tuple[MXTensor | None, MXTensor | None, torch.Tensor | None]:
    launch = quantize_launch(x, fmt, **options)
    launch.kernel[launch.grid](**launch.arguments)
    return launch.row, launch.col, launch.score


def quantize_mx_triton(
    x: torch.Tensor,
    fmt: str = "mxfp4",
    *,
    axis: int = -1,
    block_size: int = 32,
    scale_rule: str = "floor",
    rounding: str = "nearest",
    seed: int | torch.Tensor | None = None,
    hadamard_block_size: int = 0,
    signs: torch.Tensor | None = None,
    scores: bool = False,
    tiling: QuantizeTiling | None = None,
) -> MXTensor | tuple[MXTensor, torch.Tensor]:
    """Fused ``quantize_mx(hadamard_transform(x) if hadamard_block_size else x, ...)`` of 2-D ``x``.

    ``axis=-1`` (or 1) puts blocks along rows; ``axis=0`` blocks along columns, stored
    transposed (``data`` is ``[cols, rows_padded / 2]`` for MXFP4), which is the operand
    layout that dgrad and wgrad contract over. The Hadamard rotation acts along ``axis`` too.
    ``scores``: also return each stored row's outlier score, ``policy.selection.row_scores``
    along ``axis`` (float32), from the same read.
    """
    if axis not in (-2, -1, 0, 1):
        raise ValueError(f"axis must be one of (-2, -1, 0, 1) for a 2-D tensor, got {axis}")
    rowwise = axis % 2 == 1
    row, col, score = _quantize(
        x,
        fmt,
        rowwise=rowwise,
        colwise=not rowwise,
        block_size=block_size,
        scale_rule=scale_rule,
        rounding=rounding,
        seed=seed,
        hadamard_block_size=hadamard_block_size,
        signs=signs,
        scores=scores,
        tiling=tiling,
    )
    q = row if rowwise else col
    return (q, score) if scores else q


def quantize_mx_triton_both(
    x: torch.Tensor,
    fmt: str = "mxfp4",
    *,
    block_size: int = 32,
    scale_rule: str = "floor",
    rounding: str = "nearest",
    seed: int | torch.Tensor | None = None,
    hadamard_block_size: int = 0,
    signs: torch.Tensor | None = None,
    tiling: QuantizeTiling | None = None,
) -> tuple[MXTensor, MXTensor]:
    """``(quantize_mx_triton(x, axis=1, ...), quantize_mx_triton(x, axis=0, ...))``, one read."""
    row, col, _ = _quantize(
        x,
        fmt,
        rowwise=True,
        colwise=True,
        block_size=block_size,
        scale_rule=scale_rule,
        rounding=rounding,
        seed=seed,
        hadamard_block_size=hadamard_block_size,
        signs=signs,
        scores=False,
        tiling=tiling,
    )
    return row, col
