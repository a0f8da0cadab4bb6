"""W's quantized GEMM operands made once per optimizer step, not once per micro-batch.

Under gradient accumulation every micro-batch's forward quantizes W again (the forward's R and
the Wᵀ saved for dgrad, or under FSDP2's low-precision gather this rank's shard of both), though
W only changes at the optimizer step. Inside :func:`weight_operands_cached` a layer keeps what it
made and hands it to the next micro-batch (and to an activation-checkpointing recompute) while W
is unchanged, which is bit for bit what quantizing again would give: a quantization of the same
tensor with the same seed.

"Unchanged" is W's version counter and storage: the optimizer's in-place update, ``load_state_dict``
(an in-place copy) and any other in-place write bump the version; a new tensor has another
storage (the entry holds the old one, so its address cannot be reused). Operands that take noise
drawn per forward (``recipe.backward_rounding = "stochastic"``: Wᵀ) are never kept. The cached
operands are freed when the block ends.

Where a layer's forward Python does not run on every micro-batch (``torch.compile``'d blocks, and
CUDA graphs, which replay what was captured), the check cannot be made per forward. There the
model's forward decides, before each micro-batch, per layer (:class:`KeptOperands`): ``MAKE``
(quantize W and keep what was made) or ``REUSE`` (read what the layer's last ``MAKE`` kept, which
was made from W as it is now: same storage and version). A compiled block is traced once per mode
(its guards read it), so the two variants are two graphs and the step's later micro-batches run
the one without W's quantize ops. Under CUDA graphs (``train.graphs``) the graph that starts an
optimizer step is always captured with ``MAKE`` and the accumulating one with ``REUSE`` of exactly
what that capture made (:class:`GraphOperands`): those tensors live in the graphs' shared memory
pool, the first graph rewrites them on every replay, and the accumulating graph replays only after
the first one ran on the current W.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor

_active = 0  # depth of weight_operands_cached blocks


@dataclass
class _Entry:
    source: torch.Tensor  # an alias of the tensor quantized: keeps its storage (and address) alive
    version: int
    key: Any
    value: Any


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def caching() -> bool:
    """Whether a layer checks its kept W operands on each forward: inside the block, run eagerly
    (not traced, not captured; those decide per micro-batch: :class:`KeptOperands`)."""
    if not _active or torch.compiler.is_compiling():
        return False
    return not capturing()


def unchanged(alias: torch.Tensor, version: int, tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` is still what ``alias`` (kept alive, so its address is not reused) held at
    ``version``: the same storage, not written since."""
    return alias.data_ptr() == tensor.data_ptr() and version == tensor._version


class OperandCache:
    """One layer's kept operands, per source tensor kind (``slot``), valid while W is unchanged."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}
        self.made = 0  # operands made (misses), for tests and the step bench
        # The layer's own W is kept unless FSDP2 shards it: its unsharded weight is refilled in place
        # at each gather (set by weight_operands_cached; the shard's operands are kept instead).
        self.layer_weight = True

    def get(self, slot: str, source: torch.Tensor, key: Any, make: Callable[[], Any]) -> Any:
        """``make()``'s result for ``source`` as it is now and ``key``; made again only when ``source``
        was written since (or another tensor took its place), ``key`` differs, or caching is off."""
        if not caching():
            return make()
        entry = self._entries.get(slot)
        if entry is not None and entry.key == key and unchanged(entry.source, entry.version, source):
            return entry.value
        self.made += 1
        value = make()
        self._entries[slot] = _Entry(source.detach(), source._version, key, value)
        return value

    def clear(self) -> None:
        self._entries.clear()


def operand_cache(module: nn.Module) -> OperandCache:
    cache = module.__dict__.get("_operand_cache")
    if cache is None:
        cache = module.__dict__["_operand_cache"] = OperandCache()
    return cache


OFF, MAKE, REUSE = "off", "make", "reuse"


class KeptOperands:
    """One layer's W operands for a compiled or captured forward, by ``mode``: ``OFF`` (quantize,
    keep nothing), ``MAKE`` (quantize and keep) or ``REUSE`` (read what ``MAKE`` kept). Set before
    each micro-batch (:func:`weight_operands_cached`, :class:`GraphOperands`), never by the forward."""

    def __init__(self) -> None:
        self.mode = OFF
        self.entries: dict[str, tuple[Any, Any]] = {}  # slot -> (key, operand), filled by a MAKE forward
        self.source: tuple[torch.Tensor, int] | None = None  # W (an alias) and its version at that MAKE

    def operand(self, slot: str, key: Any, make: Callable[[], Any]) -> Any:
        """What ``MAKE`` kept for ``slot`` and ``key`` under ``REUSE``, else ``make()`` (kept under ``MAKE``)."""
        if self.mode == REUSE:
            entry = self.entries.get(slot)
            if entry is not None and entry[0] == key:
                return entry[1]
        value = make()
        if self.mode == MAKE:
            self.entries[slot] = (key, value)
        return value

    def made_from(self, weight: torch.Tensor) -> bool:
        """Whether the kept operands were made from ``weight`` as it is now."""
        if not self.entries or self.source is None:
            return False
        return unchanged(*self.source, weight)

    def start(self, weight: torch.Tensor) -> None:
        """Before a micro-batch: ``REUSE`` what was made from W as it is now, else ``MAKE`` afresh."""
        if self.made_from(weight):
            self.mode = REUSE
        else:
            self.mode = MAKE
            self.entries.clear()
            self.source = (weight.detach(), weight._version)

    def reset(self) -> None:
        self.mode, self.source = OFF, None
        self.entries.clear()


def kept_layers(model: nn.Module) -> list[tuple[nn.Module, KeptOperands]]:
    """``model``'s layers that keep W operands (``AdaHOPLinear``), with their :class:`KeptOperands`;
    not those FSDP2 shards (their unsharded weight is refilled at each gather: they quantize it)."""
    return [
        (m, m._kept_operands)
        for m in model.modules()
        if isinstance(getattr(m, "_kept_operands", None), KeptOperands) and not isinstance(m.weight, DTensor)
    ]


@contextlib.contextmanager
def weight_operands_cached(model: nn.Module) -> Iterator[None]:
    """Within the block (one optimizer step's micro-batches), each ``AdaHOPLinear`` of ``model``
    quantizes W once while W is unchanged; the kept operands are freed at the end. Compiled or
    captured layers decide at each call of ``model`` (so W must change only between those calls)."""
    global _active
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            operand_cache(module).layer_weight = not isinstance(weight, DTensor)
    layers = kept_layers(model)

    def before_forward(_module: nn.Module, _args: Any) -> None:
        if capturing():  # GraphOperands set the modes for the capture
            return
        for layer, kept in layers:
            kept.start(layer.weight)

    hook = model.register_forward_pre_hook(before_forward)
    _active += 1
    try:
        yield
    finally:
        _active -= 1
        hook.remove()
        for _, kept in layers:
            kept.reset()
        for module in model.modules():
            cache = module.__dict__.get("_operand_cache")
            if cache is not None:
                cache.clear()


class GraphOperands:
    """W's operands over a :class:`~adahop.train.graphs.GraphedMicroStep`'s two graphs.

    Inside :func:`weight_operands_cached`, the graph that starts an optimizer step is captured with
    every layer on ``MAKE``; what that capture kept lives in the graphs' shared pool and is held
    here for the graphs' lifetime. The accumulating graph is captured with ``REUSE`` of exactly
    those tensors, if W is unchanged since (else with ``MAKE`` of its own, never trusted later): it
    then reads W's operands where the first graph writes them on every replay. So it may replay only
    after the first graph ran on W as it is now (:meth:`may_replay`); else the micro-step runs eagerly.
    """

    def __init__(self, model: nn.Module) -> None:
        self.layers = kept_layers(model)
        self.kept: list[dict[str, tuple[Any, Any]]] | None = None  # the first capture's operands
        self.reuses = False  # the accumulating graph reads them
        self.made_at: list[int] | None = None  # W's versions when the first graph last ran

    def _versions(self) -> list[int]:
        return [layer.weight._version for layer, _ in self.layers]

    def before_capture(self, first: bool) -> None:
        if not _active:  # outside weight_operands_cached: the layers quantize W in both graphs
            return
        unchanged = self.kept is not None and self.made_at == self._versions()
        for i, (_, kept) in enumerate(self.layers):
            kept.reset()
            if not first and unchanged:
                kept.mode = REUSE
                kept.entries.update(self.kept[i])
            else:
                kept.mode = MAKE  # an accumulating graph's own are never REUSEd (no source)
        self.reuses = not first and unchanged

    def after_capture(self, first: bool) -> None:
        if first and _active:
            self.kept = [dict(kept.entries) for _, kept in self.layers]
            self.made_at = self._versions()
        for _, kept in self.layers:  # held above; the next forward's hook decides afresh
            kept.reset()

    def ran(self, first: bool, replayed: bool) -> None:
        """After a micro-step: the first graph's replay rewrote the kept operands from W as it is now."""
        if first:
            self.made_at = self._versions() if replayed and self.kept is not None else None

    def may_replay(self, first: bool) -> bool:
        """Whether the graph may replay now: the accumulating one, if it reads the first one's
        operands, only after the first graph ran on W as it is now."""
        return first or not self.reuses or (self.made_at is not None and self.made_at == self._versions())
