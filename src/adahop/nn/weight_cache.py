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
drawn per forward (``recipe.backward_rounding = "stochastic"``: Wᵀ) are never kept. The cache is
off while ``torch.compile`` traces and while a CUDA graph is captured (the graph would replay
a hit forever); the cached operands are freed when the block ends.
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


def caching() -> bool:
    """Whether a layer may reuse W's operands now: inside the block, not traced, not captured."""
    if not _active or torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


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
        if (
            entry is not None
            and entry.key == key
            and entry.source.data_ptr() == source.data_ptr()
            and entry.version == source._version
        ):
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


@contextlib.contextmanager
def weight_operands_cached(model: nn.Module) -> Iterator[None]:
    """Within the block (one optimizer step's micro-batches), each ``AdaHOPLinear`` of ``model``
    quantizes W once while W is unchanged; the kept operands are freed at the end."""
    global _active
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(weight, torch.Tensor):
            operand_cache(module).layer_weight = not isinstance(weight, DTensor)
    _active += 1
    try:
        yield
    finally:
        _active -= 1
        for module in model.modules():
            cache = module.__dict__.get("_operand_cache")
            if cache is not None:
                cache.clear()
