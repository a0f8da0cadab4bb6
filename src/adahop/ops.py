"""``torch.library`` custom ops: the single dispatch point between the reference and the kernels.

``adahop::quantize_mx`` and ``adahop::mx_matmul`` run the pure-PyTorch reference on any device
and the Triton kernels on CUDA; a GEMM runs the route ``policy.routes.gemm_route`` names. The
wrappers below take a ``formats.QuantSpec`` and flatten it, here and only here, into the
primitive arguments the op schemas need. The fake (meta) implementations give shapes without
computing, so a model built from ``AdaHOPLinear`` traces under ``torch.compile`` with each op as
one node. Triton is imported only when a CUDA kernel actually runs.

The quantize ops can also return each stored row's outlier score (``policy.selection.row_scores``)
from the same read (``scores=True``), which outlier extraction selects its rows by; otherwise
that output is empty.

The stochastic-rounding seed is a 0-dim int64 tensor, not a Python int, so a compiled graph
does not specialise on (and recompile for) every training step; round to nearest passes None,
so two layers quantizing one input (``wq``/``wk``/``wv``) make equal calls that the compiled
joint graph merges (CSE). The kernels read it from device
memory, so a step captured as a CUDA graph draws new noise on every replay.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from .formats import MXTensor, QuantSpec, quantize_mx, quantize_mx_tiles
from .formats.fast import dequantize_blocked_fast, quantize_mx_fast
from .formats.folded import FOLD_BLOCK, FoldedFP8
from .formats.rowwise import ROWWISE_FP8, ROWWISE_K_ALIGN, RowwiseFP8, quantize_fp8_rowwise
from .formats.mx import storage_shapes
from .policy.routes import GemmRoute, gemm_route
from .policy.selection import row_scores, top_rows_reference
from .transforms import hadamard_transform

_kernels_enabled = True


@contextlib.contextmanager
def reference_only() -> Iterator[None]:
    """Run the reference implementation on CUDA too (to check kernels against it)."""
    global _kernels_enabled
    previous, _kernels_enabled = _kernels_enabled, False
    try:
        yield
    finally:
        _kernels_enabled = previous


def _kernels_for(*tensors: torch.Tensor) -> bool:
    """Whether a Triton/cuBLAS kernel runs on ``tensors``: not under ``reference_only``, and not
    on an empty tensor (an empty batch takes the reference, which handles every shape)."""
    return _kernels_enabled and all(t.numel() for t in tensors)


def _eager_cuda(t: torch.Tensor) -> bool:
    """Call the CUDA implementation directly: in eager mode the custom-op dispatch adds tens of
    microseconds per call (measured), and a training step makes hundreds of these calls. Under
    ``torch.compile`` the ops stay graph nodes with their fake implementations."""
    return t.is_cuda and not torch.compiler.is_compiling()


def _seed_value(seed: torch.Tensor | None) -> int:
    return 0 if seed is None else int(seed)


def _no_scores(x: torch.Tensor) -> torch.Tensor:
    """The scores output of a quantize op asked for none."""
    return x.new_empty(0, dtype=torch.float32)


def _scores_output(x: torch.Tensor, dim: int, scores: bool) -> torch.Tensor:
    """The scores output of a quantize op's reference: ``row_scores`` along ``dim``, or none."""
    return row_scores(x, dim) if scores else _no_scores(x)


# ---- quantize -----------------------------------------------------------------------------
def _quantize_reference(x, fmt, axis, block_size, scale_rule, rounding, seed, hadamard_block_size, signs, scores):
    score = _scores_output(x, axis % 2, scores)
    if hadamard_block_size:
        x = hadamard_transform(x, axis=axis, block_size=hadamard_block_size, signs=signs)
    q = quantize_mx(
        x,
        fmt,
        axis=axis,
        block_size=block_size,
        scale_rule=scale_rule,
        rounding=rounding,
        seed=_seed_value(seed),
    )
    return q.data, q.scales, score


@torch.library.custom_op("adahop::quantize_mx", mutates_args=())
def quantize_mx_op(
    x: torch.Tensor,
    fmt: str,
    axis: int,
    block_size: int,
    scale_rule: str,
    rounding: str,
    seed: torch.Tensor | None,
    hadamard_block_size: int,
    signs: torch.Tensor | None,
    scores: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, scales, scores) of ``quantize_mx(hadamard_transform(x) if hadamard_block_size else x)``
    for 2-D x; scores (float32) only if ``scores``, else empty."""
    return _quantize_reference(x, fmt, axis, block_size, scale_rule, rounding, seed, hadamard_block_size, signs, scores)


@quantize_mx_op.register_kernel("cuda")
def _quantize_mx_cuda(x, fmt, axis, block_size, scale_rule, rounding, seed, hadamard_block_size, signs, scores):
    if not _kernels_for(x):
        return _quantize_reference(
            x, fmt, axis, block_size, scale_rule, rounding, seed, hadamard_block_size, signs, scores
        )
    from .kernels.quantize import quantize_mx_triton

    out = quantize_mx_triton(
        x,
        fmt,
        axis=axis,
        block_size=block_size,
        scale_rule=scale_rule,
        rounding=rounding,
        seed=seed,
        hadamard_block_size=hadamard_block_size,
        signs=signs,
        scores=scores,
    )
    q, score = out if scores else (out, _no_scores(x))
    return q.data, q.scales, score


@quantize_mx_op.register_kernel("cpu")
def _quantize_mx_cpu(x, fmt, axis, block_size, scale_rule, rounding, seed, hadamard_block_size, signs, scores):
    """The reference's bits by the faster route of ``formats.fast`` (tests/test_fast_reference.py)."""
    q = quantize_mx_fast(
        x,
        fmt,
        axis=axis,
        block_size=block_size,
        scale_rule=scale_rule,
        rounding=rounding,
        seed=_seed_value(seed),
        hadamard_block_size=hadamard_block_size,
        signs=signs,
    )
    return q.data, q.scales, _scores_output(x, axis % 2, scores)


@quantize_mx_op.register_fake
def _(x, fmt, axis, block_size, scale_rule, rounding, seed, hadamard_block_size, signs, scores):
    outer, length = (x.shape[0], x.shape[1]) if axis % 2 == 1 else (x.shape[1], x.shape[0])
    data_shape, scales_shape = storage_shapes(outer, length, fmt, block_size)
    return (
        x.new_empty(data_shape, dtype=torch.uint8),
        x.new_empty(scales_shape, dtype=torch.uint8),
        x.new_empty(outer if scores else 0, dtype=torch.float32),
    )


def quantize_2d(
    x: torch.Tensor, spec: QuantSpec, *, axis: int, seed: torch.Tensor | None, scores: bool = False
) -> MXTensor | tuple[MXTensor, torch.Tensor]:
    """``quantize_mx_op`` of 2-D ``x`` by ``spec`` (its Hadamard transform included), as an ``MXTensor``;
    ``scores``: with each stored row's outlier score (float32) from the same pass."""
    args = (
        x,
        spec.fmt,
        axis,
        spec.block_size,
        spec.scale_rule,
        spec.rounding,
        seed,
        spec.hadamard_block_size,
        spec.hadamard_signs,
        scores,
    )
    data, scales, score = _quantize_mx_cuda(*args) if _eager_cuda(x) else quantize_mx_op(*args)
    q = MXTensor(data, scales, spec.fmt, axis % 2, spec.block_size, x.shape)
    return (q, score) if scores else q


# ---- quantize in square tiles (2-D weight blocks) ----------------------------------------------
@torch.library.custom_op("adahop::quantize_mx_tiles", mutates_args=())
def quantize_tiles_op(
    x: torch.Tensor, fmt: str, tile_size: int, scale_rule: str, rounding: str, seed: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, scales) blocked along the rows, then along the columns, of ``quantize_mx_tiles(x)``.

    The reference on every device, CUDA included: not a fused kernel (it quantizes weights,
    small next to the activations, once per step)."""
    along_rows, along_cols = quantize_mx_tiles(
        x, fmt, tile_size=tile_size, scale_rule=scale_rule, rounding=rounding, seed=int(seed)
    )
    return along_rows.data, along_rows.scales, along_cols.data, along_cols.scales


@quantize_tiles_op.register_fake
def _(x, fmt, tile_size, scale_rule, rounding, seed):
    rows, cols = x.shape
    shapes = (*storage_shapes(rows, cols, fmt, tile_size), *storage_shapes(cols, rows, fmt, tile_size))
    return tuple(x.new_empty(shape, dtype=torch.uint8) for shape in shapes)


def quantize_tiles_2d(x: torch.Tensor, spec: QuantSpec, *, seed: torch.Tensor) -> tuple[MXTensor, MXTensor]:
    """``quantize_tiles_op`` in square ``spec.block_size`` tiles (no Hadamard: a tile serves both
    orientations) as two ``MXTensor`` s, blocked along dim 1 and along dim 0."""
    if spec.hadamard_block_size:
        raise ValueError("square-tile quantization takes no Hadamard transform; pass spec.unrotated")
    fmt, tile = spec.fmt, spec.block_size
    row_data, row_scales, col_data, col_scales = quantize_tiles_op(x, fmt, tile, spec.scale_rule, spec.rounding, seed)
    return (
        MXTensor(row_data, row_scales, fmt, 1, tile, x.shape),
        MXTensor(col_data, col_scales, fmt, 0, tile, x.shape),
    )


# ---- quantize straight into the folded FP8 operand -------------------------------------------
def _quantize_fold_reference(x, scale_rule, rounding, seed, hadamard_block_size, signs, scores):
    from .kernels.fold import fold_to_fp8_reference

    data, scales, score = _quantize_reference(
        x, "mxfp4", 1, 32, scale_rule, rounding, seed, hadamard_block_size, signs, scores
    )
    folded = fold_to_fp8_reference(MXTensor(data, scales, "mxfp4", 1, 32, x.shape))
    return folded.data.view(torch.uint8), folded.row_scale, folded.lossy_per_row, score


@torch.library.custom_op("adahop::quantize_fold_fp8", mutates_args=())
def quantize_fold_op(
    x: torch.Tensor,
    scale_rule: str,
    rounding: str,
    seed: torch.Tensor | None,
    hadamard_block_size: int,
    signs: torch.Tensor | None,
    scores: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 bytes, row scales, lossy counts, scores) of the fold of row-wise MXFP4 ``quantize_mx_op``."""
    return _quantize_fold_reference(x, scale_rule, rounding, seed, hadamard_block_size, signs, scores)


@quantize_fold_op.register_kernel("cuda")
def _quantize_fold_cuda(x, scale_rule, rounding, seed, hadamard_block_size, signs, scores):
    if not _kernels_for(x):
        return _quantize_fold_reference(x, scale_rule, rounding, seed, hadamard_block_size, signs, scores)
    from .kernels.quantize_fold import quantize_fold_fp8

    out = quantize_fold_fp8(
        x,
        scale_rule=scale_rule,
        rounding=rounding,
        seed=seed,
        hadamard_block_size=hadamard_block_size,
        signs=signs,
        scores=scores,
    )
    folded, score = out if scores else (out, _no_scores(x))
    return folded.data.view(torch.uint8), folded.row_scale, folded.lossy_per_row, score


@quantize_fold_op.register_fake
def _(x, scale_rule, rounding, seed, hadamard_block_size, signs, scores):
    rows = x.shape[0]
    return (
        x.new_empty(x.shape, dtype=torch.uint8),
        x.new_empty(rows, dtype=torch.float32),
        x.new_empty(rows, dtype=torch.int32),
        x.new_empty(rows if scores else 0, dtype=torch.float32),
    )


def quantize_fold_2d(
    x: torch.Tensor, spec: QuantSpec, *, seed: torch.Tensor | None, scores: bool = False
) -> FoldedFP8 | tuple[FoldedFP8, torch.Tensor]:
    """MXFP4 (blocks of 32 along rows) of row-major ``x`` by ``spec``, already folded for the FP8 GEMM:
    the cases of ``formats.folded.folds_directly``; ``scores``: with each row's outlier score."""
    if (spec.fmt, spec.block_size) != ("mxfp4", FOLD_BLOCK):  # the op's schema has neither: it is MXFP4 only
        raise ValueError(f"only MXFP4 with blocks of {FOLD_BLOCK} folds into FP8, got {spec}")
    args = (x, spec.scale_rule, spec.rounding, seed, spec.hadamard_block_size, spec.hadamard_signs, scores)
    data, row_scale, lossy, score = _quantize_fold_cuda(*args) if _eager_cuda(x) else quantize_fold_op(*args)
    folded = FoldedFP8(data.view(torch.float8_e4m3fn), row_scale, lossy)
    return (folded, score) if scores else folded


# ---- row-wise scaled FP8 (E4M3, a power-of-two scale per row) --------------------------------
def _quantize_rowwise_reference(x, hadamard_block_size, signs, scores):
    score = _scores_output(x, 1, scores)
    if hadamard_block_size:
        x = hadamard_transform(x, axis=1, block_size=hadamard_block_size, signs=signs)
    q = quantize_fp8_rowwise(x)
    return q.data.view(torch.uint8), q.row_scale, score


@torch.library.custom_op("adahop::quantize_fp8_rowwise", mutates_args=())
def quantize_rowwise_op(
    x: torch.Tensor, hadamard_block_size: int, signs: torch.Tensor | None, scores: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 bytes, row scales, scores) of ``formats.rowwise.quantize_fp8_rowwise`` of 2-D ``x``
    (after its Hadamard transform along the rows if ``hadamard_block_size``); scores of ``x``
    itself, only if ``scores``."""
    return _quantize_rowwise_reference(x, hadamard_block_size, signs, scores)


@quantize_rowwise_op.register_kernel("cuda")
def _quantize_rowwise_cuda(x, hadamard_block_size, signs, scores):
    if not _kernels_for(x):
        return _quantize_rowwise_reference(x, hadamard_block_size, signs, scores)
    from .kernels.quantize_rowwise import quantize_fp8_rowwise_triton

    score = _no_scores(x)
    if hadamard_block_size:  # not fused: the transform's own pass, then the kernel
        score = _scores_output(x, 1, scores)
        x = hadamard_transform(x, axis=1, block_size=hadamard_block_size, signs=signs)
    elif scores:
        q, score = quantize_fp8_rowwise_triton(x, scores=True)
        return q.data.view(torch.uint8), q.row_scale, score
    q = quantize_fp8_rowwise_triton(x)
    return q.data.view(torch.uint8), q.row_scale, score


@quantize_rowwise_op.register_fake
def _(x, hadamard_block_size, signs, scores):
    rows, k = x.shape
    return (
        x.new_empty((rows, -(-k // ROWWISE_K_ALIGN) * ROWWISE_K_ALIGN), dtype=torch.uint8),
        x.new_empty(rows, dtype=torch.float32),
        x.new_empty(rows if scores else 0, dtype=torch.float32),
    )


def quantize_rowwise_2d(
    x: torch.Tensor, spec: QuantSpec, *, scores: bool = False
) -> RowwiseFP8 | tuple[RowwiseFP8, torch.Tensor]:
    """Row-wise scaled E4M3 of row-major 2-D ``x`` (``spec.fmt == "fp8_e4m3_rowwise"``, its
    Hadamard transform included), the operand of the row-wise FP8 GEMM; ``scores``: with each
    row's outlier score."""
    if spec.fmt != ROWWISE_FP8:
        raise ValueError(f"quantize_rowwise_2d takes the {ROWWISE_FP8!r} format, got {spec}")
    if spec.rounding != "nearest":
        raise ValueError(f"{ROWWISE_FP8} rounds to nearest, got rounding={spec.rounding!r}")
    args = (x, spec.hadamard_block_size, spec.hadamard_signs, scores)
    data, row_scale, score = _quantize_rowwise_cuda(*args) if _eager_cuda(x) else quantize_rowwise_op(*args)
    q = RowwiseFP8(data.view(torch.float8_e4m3fn), row_scale)
    return (q, score) if scores else q


def route_of(device: torch.device, n: int, fmt: str = "mxfp4", block_size: int = 32) -> GemmRoute:
    """``policy.routes.gemm_route`` under this module's switch (``reference_only``): the route
    every GEMM below runs."""
    return gemm_route(device, n, fmt, block_size, kernels=_kernels_enabled)


def folds_into_fp8(device: torch.device, n: int) -> bool:
    """Whether an MXFP4 GEMM with ``n`` output columns on ``device`` takes the fold_fp8 route, so
    that operands it consumes right away are best quantized straight into folded FP8."""
    return route_of(device, n) == GemmRoute.FOLD_FP8


# ---- outlier rows -------------------------------------------------------------------------
@torch.library.custom_op("adahop::top_rows", mutates_args=())
def top_rows_op(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (ascending) of the ``k`` largest scores, ties to the lower index (``policy.selection``)."""
    return top_rows_reference(scores, k)


@top_rows_op.register_kernel("cuda")
def _top_rows_cuda(scores, k):
    from .kernels.select import MAX_ROWS, top_rows_triton

    if not _kernels_for(scores) or scores.numel() > MAX_ROWS:
        return top_rows_reference(scores, k)  # the same rule, by a sort
    return top_rows_triton(scores, k)


@top_rows_op.register_fake
def _(scores, k):
    return scores.new_empty(k, dtype=torch.int64)


def top_rows(scores: torch.Tensor, k: int) -> torch.Tensor:
    """``top_rows_op`` (direct call on eager CUDA)."""
    return _top_rows_cuda(scores, k) if _eager_cuda(scores) else top_rows_op(scores, k)


# ---- matmul -------------------------------------------------------------------------------
def _mx(data: torch.Tensor, scales: torch.Tensor, fmt: str, block_size: int) -> MXTensor:
    """An MXTensor over the padded, block-axis-last storage (the padding multiplies as zeros)."""
    padded = scales.shape[1] * block_size
    return MXTensor(data, scales, fmt, 1, block_size, torch.Size((data.shape[0], padded)))


def _matmul_reference(a_data, a_scales, b_data, b_scales, fmt, block_size, out_dtype):
    a = _mx(a_data, a_scales, fmt, block_size).dequantize_blocked()
    b = _mx(b_data, b_scales, fmt, block_size).dequantize_blocked()
    return (a @ b.T).to(out_dtype)


@torch.library.custom_op("adahop::mx_matmul", mutates_args=())
def mx_matmul_op(
    a_data: torch.Tensor,
    a_scales: torch.Tensor,
    b_data: torch.Tensor,
    b_scales: torch.Tensor,
    fmt: str,
    block_size: int,
    out_dtype: torch.dtype,
    fast_accum: bool,
) -> torch.Tensor:
    """``A @ B.T`` of two MX operands stored block-axis-last ([M, K'] and [N, K']), float32 math.
    ``fast_accum``: the fold_fp8 route's cuBLAS accumulation (``kernels.gemm.route_matmul``);
    the reference always accumulates in float32."""
    return _matmul_reference(a_data, a_scales, b_data, b_scales, fmt, block_size, out_dtype)


@mx_matmul_op.register_kernel("cuda")
def _mx_matmul_cuda(a_data, a_scales, b_data, b_scales, fmt, block_size, out_dtype, fast_accum):
    route = route_of(a_data.device, b_data.shape[0], fmt, block_size)
    if route == GemmRoute.REFERENCE or not _kernels_for(a_data, b_data):
        return _matmul_reference(a_data, a_scales, b_data, b_scales, fmt, block_size, out_dtype)
    from .kernels.gemm import route_matmul

    a, b = _mx(a_data, a_scales, fmt, block_size), _mx(b_data, b_scales, fmt, block_size)
    return route_matmul(a, b, out_dtype=out_dtype, route=route, fast_accum=fast_accum)


@mx_matmul_op.register_kernel("cpu")
def _mx_matmul_cpu(a_data, a_scales, b_data, b_scales, fmt, block_size, out_dtype, fast_accum):
    """``_matmul_reference`` with the faster, bit-identical dequantization of ``formats.fast``."""
    a = dequantize_blocked_fast(_mx(a_data, a_scales, fmt, block_size))
    b = dequantize_blocked_fast(_mx(b_data, b_scales, fmt, block_size))
    return (a @ b.T).to(out_dtype)


@mx_matmul_op.register_fake
def _(a_data, a_scales, b_data, b_scales, fmt, block_size, out_dtype, fast_accum):
    return a_data.new_empty((a_data.shape[0], b_data.shape[0]), dtype=out_dtype)


def reference_matmul(a: MXTensor | RowwiseFP8, b: MXTensor | RowwiseFP8, out_dtype: torch.dtype) -> torch.Tensor:
    """``A @ B.T`` as float32 products of the dequantized operands on any device (the reference
    route, never a fold or FP8 tensor cores): ``recipe.forward_gemm = "reference"``."""
    a, b = (t.dequantize_blocked() if isinstance(t, MXTensor) else t.dequantize() for t in (a, b))
    return output_as(a @ b.T, out_dtype)


def mx_matmul(a: MXTensor, b: MXTensor, out_dtype: torch.dtype, *, fast_accum: bool = True) -> torch.Tensor:
    """``A @ B.T`` for operands blocked along their last dim (K), through ``mx_matmul_op``."""
    if a.fmt != b.fmt or a.block_size != b.block_size or a.scales.shape[1] != b.scales.shape[1]:
        raise ValueError(f"incompatible MX operands: {a} and {b}")
    if route_of(a.data.device, b.shape[0], a.fmt, a.block_size) == GemmRoute.FOLD_FP8:
        # Each operand folded by its own fold_fp8 call, not inside this op: an operand several GEMMs
        # read (Xᵀ of wq/wk/wv) is then folded once by the compiled graph's merge of equal calls.
        # The same kernels, so the same bits.
        return folded_matmul(a, b, out_dtype, fast_accum=fast_accum)
    args = (a.data, a.scales, b.data, b.scales, a.fmt, a.block_size, out_dtype, fast_accum)
    return _mx_matmul_cuda(*args) if _eager_cuda(a.data) else mx_matmul_op(*args)


# ---- fold, and the GEMM of folded operands -------------------------------------------------
def _fold_reference(data, scales, block_size):
    from .kernels.fold import fold_to_fp8_reference

    folded = fold_to_fp8_reference(_mx(data, scales, "mxfp4", block_size))
    return folded.data.view(torch.uint8), folded.row_scale, folded.lossy_per_row


@torch.library.custom_op("adahop::fold_fp8", mutates_args=())
def fold_op(
    data: torch.Tensor, scales: torch.Tensor, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(E4M3 bytes, row scales, lossy counts) of an MXFP4 operand stored block-axis-last."""
    return _fold_reference(data, scales, block_size)


@fold_op.register_kernel("cuda")
def _fold_cuda(data, scales, block_size):
    if not _kernels_for(data):
        return _fold_reference(data, scales, block_size)
    from .kernels.fold import fold_to_fp8

    folded = fold_to_fp8(_mx(data, scales, "mxfp4", block_size))
    return folded.data.view(torch.uint8), folded.row_scale, folded.lossy_per_row


@fold_op.register_fake
def _(data, scales, block_size):
    rows = data.shape[0]
    return (
        data.new_empty((rows, scales.shape[1] * block_size)),
        data.new_empty(rows, dtype=torch.float32),
        data.new_empty(rows, dtype=torch.int32),
    )


def fold_fp8(mx: MXTensor) -> FoldedFP8:
    """An MXFP4 operand blocked along its last dim, folded for the FP8 GEMM.

    One call per fold, also for the MXFP4 GEMMs of the fold route (``mx_matmul``): in a compiled graph
    equal calls are merged, so an operand several GEMMs read is folded once (the Xᵀ that ``wq``/``wk``/
    ``wv`` share in a compiled block). Eagerly nothing is kept between calls: FSDP2's low-precision
    gather refills the packed operands in place with their version counters preserved (``nn.fsdp``),
    so a memo on the codes tensor could hand out a fold of last step's weight."""
    args = (mx.data, mx.scales, mx.block_size)
    data, row_scale, lossy = _fold_cuda(*args) if _eager_cuda(mx.data) else fold_op(*args)
    return FoldedFP8(data.view(torch.float8_e4m3fn), row_scale, lossy)


def folded_matmul(
    a: RowwiseFP8 | MXTensor, b: RowwiseFP8 | MXTensor, out_dtype: torch.dtype, *, fast_accum: bool = True
) -> torch.Tensor:
    """``A @ B.T`` where at least one side is row-scaled E4M3: folded MXFP4 (an MX side is folded
    first) or ``fp8_e4m3_rowwise``. The fold_fp8 route runs cuBLAS's row-wise scaled FP8 GEMM
    (``fast_accum`` as in ``mx_matmul``); the reference route the same products in float32.
    Folded operands take no other route; row-wise FP8 takes the reference where cuBLAS cannot."""
    folding = any(isinstance(t, (FoldedFP8, MXTensor)) for t in (a, b))
    route = route_of(a.data.device, b.shape[0], "mxfp4" if folding else ROWWISE_FP8)
    if route not in (GemmRoute.FOLD_FP8, GemmRoute.REFERENCE):
        raise ValueError(
            f"folded operands need the fold_fp8 route, and {route} was chosen for "
            f"{b.shape[0]} output columns on {a.data.device}"
        )
    a, b = (fold_fp8(t) if isinstance(t, MXTensor) else t for t in (a, b))
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"row-wise FP8 operands differ in K: {tuple(a.shape)} and {tuple(b.shape)}")
    if route == GemmRoute.FOLD_FP8 and _kernels_for(a.data, b.data):
        from .kernels.gemm import fold_fp8_matmul

        return fold_fp8_matmul(a, b, out_dtype, fast_accum)
    return output_as(a.dequantize() @ b.dequantize().T, out_dtype)


def output_as(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``out`` in ``dtype``, never as an alias of itself: with torch 2.11 a custom autograd Function
    whose forward returns ``t.to(t.dtype)`` (an alias) gets zero incoming gradients under
    ``torch.compile`` (seen on the H200's torch; 2.13 is fine)."""
    return out if out.dtype == dtype else out.to(dtype)
