"""``GatheredWeight``: the unsharded weight FSDP2 hands an ``AdaHOPLinear`` when it gathered the
GEMM operands instead of the high-precision weight (``adahop.nn.fsdp``).

It has the weight's shape and dtype (so autograd, FSDP2 and the layer's checks see a weight) but
no values: only the prepared operands of the forward GEMM (W, blocked along ``in``) and of dgrad
(Wᵀ, blocked along ``out``), quantized on each rank from its shard exactly as the layer would have
quantized the whole weight. The layer's GEMMs read them; any other use raises, since a
dequantized stand-in would silently change the numerics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..gemm.operand import GemmOperand
from ..policy.strategies import LayerPlan


@dataclass
class WeightOperands:
    """What a layer's GEMMs read of W: the forward's R, dgrad's R, and what they were made for."""

    forward: GemmOperand
    dgrad: GemmOperand
    plan: LayerPlan  # the plan they were quantized for
    source_dtype: torch.dtype  # the dtype W had when quantized (the forward's weight dtype)
    made: tuple[torch.Tensor, ...] = ()  # tensors built from the gathered ones: refilled in place on re-gathers


# Ops FSDP2 and autograd apply to the unsharded parameter itself: aliases of the whole tensor.
_ALIASES = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.as_strided.default}


class GatheredWeight(torch.Tensor):
    """An ``[out, in]`` weight known only through its quantized GEMM operands."""

    @staticmethod
    def __new__(cls, operands: WeightOperands, shape: torch.Size, dtype: torch.dtype, requires_grad: bool = False):
        device = operands.forward.quantized.data.device
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=device, requires_grad=requires_grad)

    def __init__(self, operands: WeightOperands, shape: torch.Size, dtype: torch.dtype, requires_grad: bool = False):
        self.operands = operands

    def __repr__(self) -> str:
        return f"GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype}, plan={self.operands.plan.to_dict()})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        weight = args[0]
        if func in _ALIASES and (func is not torch.ops.aten.as_strided.default or tuple(args[1]) == weight.shape):
            return GatheredWeight(weight.operands, weight.shape, weight.dtype)
        same_place = kwargs.get("device") in (None, weight.device) and kwargs.get("layout") in (None, torch.strided)
        if (
            func is torch.ops.aten._to_copy.default
            and same_place
            and kwargs.get("dtype") == weight.operands.source_dtype
        ):
            # The forward's autocast cast: the operands were quantized from W in this dtype already.
            return GatheredWeight(weight.operands, weight.shape, weight.operands.source_dtype)
        raise RuntimeError(  # not TypeError: Python turns that into "unsupported operand" for t + 1
            f"{func} on a weight that FSDP2 gathered as quantized GEMM operands "
            f"(quantized from {weight.operands.source_dtype}); only AdaHOPLinear's GEMMs read it. "
            "Turn the low-precision all-gather off for this model (adahop.nn.fsdp, docs/distributed.md)"
        )


def gathered_operands(weight: torch.Tensor, plan: LayerPlan) -> tuple[GemmOperand, GemmOperand] | None:
    """(forward R, dgrad R) when FSDP2 gathered ``weight`` quantized for ``plan``; None for a plain weight."""
    if not isinstance(weight, GatheredWeight):
        return None
    ops = weight.operands
    if ops.plan != plan or ops.source_dtype != weight.dtype:
        raise RuntimeError(
            f"the weight was gathered quantized for plan {ops.plan.to_dict()} from {ops.source_dtype}, "
            f"and the layer now runs {plan.to_dict()} on {weight.dtype}; change plans between steps, not inside one"
        )
    return ops.forward, ops.dgrad
