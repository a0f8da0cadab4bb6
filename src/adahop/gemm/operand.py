"""GEMM operands prepared for one AdaHOP strategy.

Every GEMM of a linear layer is written in one orientation, ``C = L @ R.T`` with ``L`` [M, K]
and ``R`` [N, K], so both operands have the contraction dimension K last and MX blocks run
along their rows:

| GEMM    | L          | R          | K   |
|---------|------------|------------|-----|
| forward | X [T, in]  | W [out, in]| in  |
| dgrad   | dY [T, out]| Wᵀ [in, out]| out |
| wgrad   | dYᵀ [out, T]| Xᵀ [in, T]| T   |

In the method's notation (``C = A B``) ``A = L`` and ``B = Rᵀ``: OE-left extracts rows of L,
OE-right extracts columns of B, i.e. rows of R. So both extractions take *rows* here.

A prepared operand holds what the GEMM needs and no more: the quantized operand (after the
inner Hadamard transform), the extracted rows in high precision, and the high-precision operand
itself only when the other side's outlier path needs it. The method zeroes extracted rows before
quantizing; with blocks along K every row is quantized on its own, so zeroing changes nothing
the output keeps (those outputs are overwritten) and the full-size pass is skipped. For the same
reason the selection need not come first: the quantize kernel records each row's score (its
abs-max, ``policy.selection``) while it reads the operand, instead of a separate pass over it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import ops
from ..formats import MXTensor, QuantSpec
from ..formats.folded import folds_directly
from ..formats.rowwise import ROWWISE_FP8, RowwiseFP8
from ..policy.selection import row_scores
from ..policy.strategies import Strategy
from ..transforms import hadamard_transform


@dataclass
class GemmOperand:
    """One side of ``C = L @ R.T``, prepared along its last dimension (K)."""

    # RowwiseFP8 for the fp8_e4m3_rowwise format (FoldedFP8 is one), a Tensor when spec.fmt is None
    quantized: MXTensor | RowwiseFP8 | torch.Tensor | None = None
    dense: torch.Tensor | None = None  # high-precision operand (BF16 GEMM, or the other side's OE)
    rows: torch.Tensor | None = None  # indices of extracted outlier rows
    extracted: torch.Tensor | None = None  # those rows, in high precision
    scores: torch.Tensor | None = None  # every row's outlier score they were chosen by (not saved for backward)

    def pack(self) -> tuple[list[torch.Tensor], tuple]:
        """Tensors for ``ctx.save_for_backward`` (so saved-tensor hooks see them) plus metadata."""
        q = self.quantized
        if isinstance(q, MXTensor):
            parts, meta = [q.data, q.scales], (q.fmt, q.axis, q.block_size, q.shape)
        else:
            parts, meta = [q], None
        parts += [self.dense, self.rows, self.extracted]
        return parts, meta

    @classmethod
    def unpack(cls, parts: list[torch.Tensor | None], meta: tuple | None) -> GemmOperand:
        if meta is None:
            quantized, rest = parts[0], parts[1:]
        else:
            quantized, rest = MXTensor(parts[0], parts[1], *meta), parts[2:]
        return cls(quantized, *rest)


def _rotate_and_quantize(
    t: torch.Tensor, spec: QuantSpec, rotate: bool, seed: torch.Tensor | None, fold: bool, scores: bool = False
) -> MXTensor | RowwiseFP8 | torch.Tensor | tuple[MXTensor | RowwiseFP8 | torch.Tensor, torch.Tensor]:
    """Inner Hadamard (if ``rotate``: ``spec``'s, else none) and MX quantization along the last
    dim, one fused op; ``fold``: straight into the folded FP8 operand where the fused kernel serves ``t``.
    ``scores``: also each row's outlier score (``policy.selection.row_scores``), from the same op."""
    if not rotate:
        spec = spec.unrotated
    hb = spec.hadamard_block_size
    if hb and t.shape[-1] % hb:  # zero padding of K leaves L @ R.T (and every row's abs-max) unchanged
        t = torch.nn.functional.pad(t, (0, -t.shape[-1] % hb))
    if spec.fmt is None:  # the transform-only ablation: no quantize pass to record scores
        out = hadamard_transform(t, block_size=hb, signs=spec.hadamard_signs) if hb else t
        return (out, row_scores(t)) if scores else out
    if spec.fmt == ROWWISE_FP8:  # a scale per row of [rows, K]: the row-wise FP8 GEMM's operand as it is
        return ops.quantize_rowwise_2d(t.contiguous(), spec, scores=scores)
    if fold and folds_directly(t, fmt=spec.fmt, block_size=spec.block_size, hadamard_block_size=hb):
        return ops.quantize_fold_2d(t, spec, seed=seed, scores=scores)
    # A transposed view (Xᵀ, dYᵀ, Wᵀ) is quantized along dim 0 of its row-major source, no copy.
    transposed = not t.is_contiguous() and t.t().is_contiguous()
    source, axis = (t.t(), 0) if transposed else (t.contiguous(), 1)
    return ops.quantize_2d(source, spec, axis=axis, seed=seed, scores=scores)


def prepare_operand(
    t: torch.Tensor,
    strategy: Strategy,
    side: str,
    spec: QuantSpec,
    *,
    oe_k: int = 64,
    seed: torch.Tensor | int = 0,
    fold: bool = False,
) -> GemmOperand:
    """Prepare ``t`` ([rows, K]) as the ``side`` ("L" or "R") operand of a GEMM run with ``strategy``.

    The operand keeps its high-precision form only when the strategy needs it: the other side's
    extracted rows are multiplied with it in high precision. ``fold``: the GEMM consumes this operand
    right away on folded FP8 (``ops.folds_into_fp8``), so a row-major one is quantized straight
    into that form; operands kept for later (saved for backward) stay packed MXFP4.
    """
    if side not in ("L", "R"):
        raise ValueError(f"side must be 'L' or 'R', got {side!r}")
    strategy = Strategy(strategy)
    if strategy is Strategy.BF16:
        return GemmOperand(dense=t)
    extracts_here = (strategy is Strategy.OE_LEFT and side == "L") or (strategy is Strategy.OE_RIGHT and side == "R")
    extracts_other = strategy in (Strategy.OE_LEFT, Strategy.OE_RIGHT) and not extracts_here
    rotate = strategy is not Strategy.MXFP4
    op = GemmOperand(dense=t if extracts_other else None)
    # No seed to round to nearest: layers sharing an input then make equal calls (merged by compile;
    # a call that also records scores differs from one that does not).
    seed = None if spec.rounding == "nearest" else torch.as_tensor(seed, dtype=torch.int64)
    if extracts_here:
        # Rows are quantized independently (blocks and Hadamard blocks run along K), so the
        # extracted rows need not be zeroed first: their products are overwritten in tn_matmul.
        op.quantized, op.scores = _rotate_and_quantize(t, spec, rotate, seed, fold, scores=True)
        op.rows = ops.top_rows(op.scores, min(oe_k, t.shape[0]))
        op.extracted = t[op.rows]
    else:
        op.quantized = _rotate_and_quantize(t, spec, rotate, seed, fold)
    return op


def prepare_weight_tiles(
    weight: torch.Tensor, forward: Strategy, dgrad: Strategy, spec: QuantSpec
) -> tuple[GemmOperand, GemmOperand]:
    """W [out, in] as the forward's R and Wᵀ as dgrad's R from one quantization in square
    ``spec.block_size`` tiles (``recipe.weight_blocks = "2d"``): the two GEMMs see the same
    quantized W. Only for GEMMs that leave W unrotated (MXFP4, or BF16, which takes W as it is):
    IHT and OE rotate along K, which is ``in`` in the forward and ``out`` in dgrad."""
    forward, dgrad = Strategy(forward), Strategy(dgrad)
    if {forward, dgrad} - {Strategy.MXFP4, Strategy.BF16}:
        raise ValueError(
            f"2-D weight blocks need MXFP4 or BF16 forward and dgrad GEMMs, got {forward.value} and {dgrad.value}"
        )
    along_in = along_out = None
    if Strategy.MXFP4 in (forward, dgrad):
        along_in, along_out = ops.quantize_tiles_2d(weight, spec.unrotated, seed=torch.zeros((), dtype=torch.int64))
    w = GemmOperand(dense=weight) if forward is Strategy.BF16 else GemmOperand(quantized=along_in)
    wt = GemmOperand(dense=weight.t()) if dgrad is Strategy.BF16 else GemmOperand(quantized=along_out)
    return w, wt
