"""Low-precision FSDP2 all-gather of ``AdaHOPLinear`` weights.

With FSDP2 every rank holds a dim-0 shard of each weight (whole rows of W [out, in]), gathers the
whole weight before the layer runs, and then quantizes it again on every rank. Here each rank
quantizes its own rows once per gather into what the layer's GEMMs read, and FSDP2 gathers that:

- the forward's W in ``recipe.forward_fmt``: MX blocks along ``in``, or E4M3 with a scale per row
  (``fp8_e4m3_rowwise``); both, and the inner Hadamard (IHT), run along each row, so a shard of
  whole rows quantizes to exactly the rows of the whole weight's codes;
- dgrad's Wᵀ, blocked along ``out``: exact when each rank's rows hold whole MX (and Hadamard)
  blocks, i.e. ``out / ranks`` is a multiple of 32; sent transposed so the ranks' pieces
  concatenate along dim 0 as FSDP2 gathers;
- with ``weight_blocks="2d"`` one square-tile quantization serves both GEMMs: only it is
  gathered (``out / ranks`` a multiple of the tile), and Wᵀ is its transpose.

An OE-right forward also gets its top rows of W in high precision: every row's score and each
rank's own top rows are gathered, and the whole weight's top rows picked among those.

So training is bit-identical to the BF16 (high-precision) gather. A layer keeps the
high-precision gather where it reads all of W in high precision: while it calibrates, where its
plan runs the forward in BF16 or OE-left (which multiplies the other side's rows by the dense W)
or dgrad in BF16 or with outlier extraction, where W rounds
stochastically (noise keyed by an element's place in the whole weight), where a rank's rows do
not hold whole blocks, and on a step whose pattern hooks read W (telemetry). The choice is made
per layer at each forward's gather, from the layer's plan; backward's re-gather repeats it.

Bytes per weight element per gather: BF16 2, MX FP4 with both orientations 2 x (1/2 + 1/32)
= 1.06 (1.9x less), with ``weight_blocks="2d"`` 0.53 (3.8x less), a row-wise FP8 forward with
an MX FP4 Wᵀ 1.53 (1.3x less). ``benchmarks/distributed/``
measures a model's bytes per step.

Use: call :func:`low_precision_all_gather` on the model before ``fully_shard`` (the trainer does
when ``training.fsdp_low_precision_all_gather`` is on). It wraps each weight in
:class:`LowPrecisionShard`, a ``torch.Tensor`` subclass through which every op reaches the plain
weight (the optimizer updates it, its state and gradients are plain tensors), and which
implements FSDP2's ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather``; the unsharded weight is
a :class:`~adahop.nn.gathered.GatheredWeight`. ``state_dict()`` holds the plain weight.

A format is an object with ``refusal(layer, rows)``, ``quantize(layer, shard)`` and ``assemble``;
:data:`GATHER_FORMATS` lists them, tried in order. FSDP2 allocates its gather buffers for the
first format it sees; when a layer's format changes (calibration freezes, a telemetry step) they
are reallocated at the next forward.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.distributed as dist
import torch.utils._pytree as pytree
from torch import nn
from torch.distributed.tensor import DTensor

from .. import ops
from ..formats import MXTensor
from ..formats.rowwise import ROWWISE_FP8, RowwiseFP8
from ..formats.tiles import tiles_along_cols
from ..gemm.operand import GemmOperand, prepare_operand, prepare_weight_tiles
from ..policy.calibration import PatternRecorder
from ..policy.strategies import Strategy
from .convert import adahop_layers
from .gathered import GatheredWeight, WeightOperands
from .linear import AdaHOPLinear
from .weight_cache import operand_cache

log = logging.getLogger(__name__)

# GEMM strategies that read W only through its quantized operand (BF16 and OE-left need all of W in high precision).
QUANTIZED_ONLY = (Strategy.MXFP4, Strategy.IHT)


class QuantizedWeightGather:
    """W as the quantized operands the layer's forward and dgrad read: the forward's in
    ``recipe.forward_fmt`` (MX, or FP8 with a scale per row), dgrad's in ``recipe.fmt``."""

    name = "quantized"

    def refusal(self, layer: AdaHOPLinear, rows: int) -> str | None:
        """Why this format cannot serve ``layer`` with ``rows`` rows per rank bit for bit (None: it can)."""
        plan, recipe = layer.running_plan, layer.recipe
        if plan.forward not in (*QUANTIZED_ONLY, Strategy.OE_RIGHT) or plan.dgrad not in QUANTIZED_ONLY:
            return f"its plan reads W in high precision (forward {plan.forward.value}, dgrad {plan.dgrad.value})"
        if "stochastic" in (recipe.rounding, recipe.backward_rounding):
            return "W rounds stochastically, with noise keyed by each element's place in the whole weight"
        align = self._rows_per_block(layer)
        if rows % align:
            return f"a rank's {rows} rows are not whole blocks of {align} along out"
        return None

    @staticmethod
    def _rows_per_block(layer: AdaHOPLinear) -> int:
        recipe = layer.recipe
        if recipe.weight_blocks == "2d" or layer.running_plan.dgrad is not Strategy.IHT:
            return recipe.block_size
        return math.lcm(recipe.block_size, recipe.hadamard_block_size)

    def quantize(self, layer: AdaHOPLinear, shard: torch.Tensor) -> tuple[list[torch.Tensor], tuple]:
        """This rank's rows as all-gather inputs (dim 0 along ``out``) and what ``assemble`` needs.

        An OE-right forward (top ``oe_k`` rows of W over the whole weight, kept in high precision)
        also sends every row's score and this rank's own top rows: each of the whole weight's top
        rows is among its rank's, so ``assemble`` picks them exactly as the layer would."""
        act, _, saved = layer._specs
        plan, oe_k = layer.running_plan, layer.recipe.oe_k
        if layer.recipe.weight_blocks == "2d":
            tiles = prepare_weight_tiles(shard, plan.forward, plan.dgrad, act)[0].quantized
            return _parts(tiles), (_layout(tiles),)
        w = prepare_operand(shard, plan.forward, "R", act, oe_k=oe_k)
        wt = prepare_operand(shard.t(), plan.dgrad, "R", saved, oe_k=oe_k).quantized  # MX, storage [in, rows]
        inputs = [*_parts(w.quantized), wt.data.t(), wt.scales.t()]
        if w.rows is None:
            return inputs, (_layout(w.quantized), _layout(wt), None)
        selection = (min(oe_k, layer.out_features), w.rows.numel(), shard.shape[0])  # k, each rank's k, its rows
        return [*inputs, w.scores, w.rows, w.extracted], (_layout(w.quantized), _layout(wt), selection)

    def assemble(
        self, outputs: tuple[torch.Tensor, ...], layouts: tuple, rows: int
    ) -> tuple[GemmOperand, GemmOperand, tuple[torch.Tensor, ...]]:
        """(forward R, dgrad R, the tensors made from the gathered ones) of the whole weight."""
        w = GemmOperand(quantized=_operand(outputs[:2], layouts[0], rows))
        if len(layouts) == 1:  # square tiles: Wᵀ is their transpose
            wt = tiles_along_cols(w.quantized)
            return w, GemmOperand(quantized=wt), (wt.data, wt.scales)
        data, scales = (t.t().clone(memory_format=torch.contiguous_format) for t in outputs[2:4])
        wt = _operand((data, scales), layouts[1], rows)
        made = (data, scales)
        if layouts[2] is not None:  # OE-right: the whole weight's top rows, among the ranks' own
            k, per_rank, rank_rows = layouts[2]
            scores, candidates, candidate_rows = outputs[4:]
            owners = torch.arange(candidates.numel(), device=candidates.device) // per_rank
            where = torch.full((rows,), -1, dtype=torch.int64, device=candidates.device)
            where[candidates + owners * rank_rows] = torch.arange(candidates.numel(), device=candidates.device)
            w.rows = ops.top_rows(scores, k)  # as prepare_operand picks them from the whole weight
            w.extracted = candidate_rows[where[w.rows]]
            made += (w.rows, w.extracted)
        return w, GemmOperand(quantized=wt), made


def _parts(q: MXTensor | RowwiseFP8) -> list[torch.Tensor]:
    """A quantized operand of this rank's rows as tensors whose dim 0 runs along those rows."""
    return [q.data, q.scales] if isinstance(q, MXTensor) else [q.data, q.row_scale]


def _layout(q: MXTensor | RowwiseFP8) -> tuple:
    """What rebuilds the operand from its gathered parts, besides the row count."""
    return (q.fmt, q.axis, q.block_size, q.shape[1]) if isinstance(q, MXTensor) else (ROWWISE_FP8,)


def _operand(parts: tuple[torch.Tensor, ...], layout: tuple, rows: int) -> MXTensor | RowwiseFP8:
    if layout[0] == ROWWISE_FP8:
        return RowwiseFP8(*parts)
    fmt, axis, block_size, cols = layout
    return MXTensor(*parts, fmt, axis, block_size, torch.Size((rows, cols)))


# Tried in order for each layer; the first that serves it bit for bit is gathered.
GATHER_FORMATS: list = [QuantizedWeightGather()]
_logged: set[str] = set()


def _observed(layer: AdaHOPLinear) -> bool:
    """Whether pattern hooks read this layer's weight on this forward (calibration, telemetry)."""
    return any(isinstance(getattr(hook, "__self__", None), PatternRecorder) for hook in layer._forward_hooks.values())


def choose_format(layer: AdaHOPLinear, rows: int):
    """The format ``layer``'s weight is gathered in now, or None for the high-precision gather."""
    plan = layer.running_plan  # the plan the next forward runs (a late BF16 forward reads W whole)
    if plan is None or plan.all_bf16 or _observed(layer):
        return None
    refusals = []
    for fmt in GATHER_FORMATS:
        reason = fmt.refusal(layer, rows)
        if reason is None:
            return fmt
        refusals.append(reason)
    reason = "; ".join(refusals)
    if reason not in _logged:  # one line per reason, not per layer and step
        _logged.add(reason)
        log.info("FSDP2 gathers W in high precision where %s (e.g. %s)", reason, layer)
    return None


def _fsdp_param(layer: nn.Module):
    """FSDP2's record of ``layer.weight`` (torch 2.13 internals: FSDP2 has no public call to
    re-create a parameter's all-gather buffers)."""
    from torch.distributed._composable_state import _module_state_mapping

    for state_ref in list(_module_state_mapping.values()):
        state = state_ref() if callable(state_ref) else state_ref
        for group in getattr(state, "_fsdp_param_groups", ()):
            for param in group.fsdp_params:
                if param._module_info.module is layer and param._module_info.param_name == "weight":
                    return param
    raise RuntimeError(f"{layer} is not under fully_shard")


def _reallocate_gather(layer: nn.Module) -> None:
    """Make FSDP2 size its all-gather buffers and unsharded weight anew at the next gather. A
    gradient the old unsharded weight holds (micro-batches without gradient sync) moves to
    FSDP2's own accumulator, to which later micro-batches add and which it reduce-scatters."""
    param = _fsdp_param(layer)
    param.all_gather_outputs = []
    param._unsharded_inner_tensors = []
    old = getattr(param, "_unsharded_param", None)
    if old is not None and old.grad is not None:
        if param.unsharded_accumulated_grad is None:
            param.unsharded_accumulated_grad = old.grad
        else:
            param.unsharded_accumulated_grad += old.grad
    if old is not None:
        del param._unsharded_param


# Ops FSDP2 applies to a parameter when it shards it (and moves or copies it): their results stay shards.
_SHARD_OPS = {
    torch.ops.aten.detach.default,
    torch.ops.aten.alias.default,
    torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default,
    torch.ops.aten.slice.Tensor,
    torch.ops.aten.split.Tensor,
    torch.ops.aten.split_with_sizes.default,
    torch.ops.aten.new_zeros.default,
    torch.ops.aten.empty_like.default,
    torch.ops.aten.clone.default,
    torch.ops.aten._to_copy.default,
    torch.ops.aten._pin_memory.default,
}


class LowPrecisionShard(torch.Tensor):
    """A weight (or FSDP2's shard of it) that FSDP2 gathers as its layer's quantized operands.

    Every op runs on the plain tensor inside; only the ops FSDP2 shards a parameter with keep
    the wrapper. ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` are FSDP2's extension points."""

    @staticmethod
    def __new__(cls, tensor: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            tensor.size(),
            strides=tensor.stride(),
            storage_offset=tensor.storage_offset(),
            dtype=tensor.dtype,
            device=tensor.device,
            requires_grad=tensor.requires_grad,
        )

    def __init__(self, tensor: torch.Tensor):
        self._tensor = tensor

    def __repr__(self) -> str:
        return f"LowPrecisionShard({self._tensor})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        plain_args, plain_kwargs = pytree.tree_map_only(LowPrecisionShard, lambda t: t._tensor, (args, kwargs or {}))
        out = func(*plain_args, **plain_kwargs)
        if args and isinstance(args[0], LowPrecisionShard) and out is plain_args[0]:
            return args[0]  # an in-place op returns its own argument
        if func not in _SHARD_OPS:
            return out
        return pytree.tree_map_only(torch.Tensor, LowPrecisionShard, out)

    def __tensor_flatten__(self):
        return ["_tensor"], None

    @staticmethod
    def __tensor_unflatten__(inner_tensors, meta, outer_size, outer_stride):
        return LowPrecisionShard(inner_tensors["_tensor"])

    # ---- FSDP2's all-gather extension ----------------------------------------------------
    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        rows, ranks = self._tensor.shape[0], mesh.size()
        if rows * ranks != outer_size[0]:
            raise RuntimeError(
                f"low-precision all-gather needs whole rows of {tuple(outer_size)} on each of {ranks} ranks "
                f"(FSDP2 Shard(0), {outer_size[0]} divisible by {ranks}); this rank holds {tuple(self.shape)}"
            )
        param_dtype = mp_policy.param_dtype or self.dtype
        if ranks == 1:  # FSDP2 copies one rank's single input without gathering: nothing to save
            return (self._tensor.to(param_dtype),), None
        if torch._C._current_graph_task_id() != -1 and hasattr(module, "_gathered_as"):
            key = module._gathered_as  # backward's re-gather serves the forward it recomputes, if any
        else:
            autocast = torch.is_autocast_enabled(self.device.type)
            source_dtype = torch.get_autocast_dtype(self.device.type) if autocast else param_dtype
            key = (choose_format(module, rows), module.running_plan, source_dtype)
            if getattr(module, "_gathered_as", key) != key:
                _reallocate_gather(module)
            module._gathered_as = key
        fmt, plan, source_dtype = key
        if fmt is None:
            return (self._tensor.to(param_dtype),), None  # what FSDP2 itself gathers

        def quantize():
            shard = self._tensor.to(param_dtype).to(source_dtype)  # the gather's cast, then autocast's
            return fmt.quantize(module, shard)

        # Once per optimizer step under weight_operands_cached: the shard changes only at the update.
        inputs, layouts = operand_cache(module).get(
            "shard", self._tensor, (fmt, plan, source_dtype, param_dtype), quantize
        )
        return tuple(t.contiguous() for t in inputs), (fmt, layouts, plan, source_dtype, outer_size)

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        if metadata is None:  # the whole weight, gathered in high precision
            return None if out is not None else (outputs[0], ())
        fmt, layouts, plan, source_dtype, shape = metadata
        forward, dgrad, made = fmt.assemble(outputs, layouts, shape[0])
        if out is not None:  # FSDP2 re-gathered into the same buffers; refill what was made from them
            with torch.autograd._unsafe_preserve_version_counter(out.operands.made):
                for old, new in zip(out.operands.made, made):
                    old.copy_(new)
            return None
        operands = WeightOperands(forward, dgrad, plan, source_dtype, made)
        return GatheredWeight(operands, shape, param_dtype), made


def _plain_weight(module: nn.Module, state_dict: dict, prefix: str, local_metadata: dict) -> None:
    """``state_dict`` holds the weight as a plain tensor (a DTensor of one under FSDP2)."""
    key = prefix + "weight"
    value = state_dict.get(key)
    if isinstance(value, DTensor) and isinstance(value._local_tensor, LowPrecisionShard):
        state_dict[key] = DTensor.from_local(
            value._local_tensor._tensor, value.device_mesh, value.placements, shape=value.shape, stride=value.stride()
        )
    elif isinstance(value, LowPrecisionShard):
        state_dict[key] = value._tensor


def low_precision_all_gather(model: nn.Module, world_size: int | None = None) -> list[str]:
    """Let FSDP2 gather the weight of every ``AdaHOPLinear`` in ``model`` as its quantized GEMM
    operands. Call before ``fully_shard`` and before building the optimizer. ``world_size``:
    the ranks FSDP2 shards over (default: the process group's); a weight whose rows do not
    split evenly over them keeps the high-precision gather. Returns the names of the layers
    whose weights are gathered this way (each per step as its plan allows); none on one rank."""
    ranks = world_size or dist.get_world_size()
    if ranks == 1:
        log.info("FSDP2 on one rank gathers nothing: the low-precision all-gather stays off")
        return []
    wrapped = []
    for name, layer in adahop_layers(model).items():
        weight = layer.weight
        if isinstance(weight, (LowPrecisionShard, DTensor)):
            continue  # already wrapped, or sharded already (fully_shard came first)
        if weight.shape[0] % ranks:
            log.info("FSDP2 gathers %s.weight in high precision: %d rows over %d ranks", name, weight.shape[0], ranks)
            continue
        layer.weight = nn.Parameter(LowPrecisionShard(weight.data), requires_grad=weight.requires_grad)
        layer.register_state_dict_post_hook(_plain_weight)
        wrapped.append(name)
    return wrapped


def low_precision_weights(model: nn.Module) -> int:
    """How many of ``model``'s parameters are wrapped for the low-precision all-gather."""
    return sum(
        isinstance(p._local_tensor if isinstance(p, DTensor) else p, LowPrecisionShard) for p in model.parameters()
    )


def gathered_format(layer: AdaHOPLinear) -> str:
    """The name of the format ``layer``'s weight was last gathered in ("bf16": high precision)."""
    key = getattr(layer, "_gathered_as", None)
    return "bf16" if key is None or key[0] is None else key[0].name


__all__ = [
    "GATHER_FORMATS",
    "LowPrecisionShard",
    "QuantizedWeightGather",
    "gathered_format",
    "low_precision_all_gather",
]
