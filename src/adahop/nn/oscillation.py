"""Weight de-oscillation (TetraJet-v2's OsciReset) as an optimizer post-step hook: ``recipe.osci_reset``.

A master weight that sits on a rounding boundary of the forward's quantizer flips its quantized
value back and forth as small updates push it across and back; the forward then sees noise the
optimizer did not ask for. After every optimizer step this hook quantizes each converted layer's
weight as its forward GEMM does (the forward's format, and its Hadamard where the forward's strategy
rotates), and keeps, per element, the last quantized value (bf16: every MX and row-wise FP8 value is
exact there), the direction of its last change (int8) and an EMA of direction reversals (bf16,
momentum ``OSCI_MOMENTUM``): 5 bytes per weight, device work only, no host sync. An element whose
reversal rate exceeds the threshold is reset to its quantized value, the centre of its quantization
bin (in the rotated domain when the forward rotates, then rotated back), and its EMA restarts.

Approximations, each cheap and stated: quantization is along ``in`` in 1-D blocks even under
``weight_blocks="2d"``; a block-scale change between steps counts as a move; under FSDP2 each rank
tracks its own rows (whole rows: blocks, scales and the Hadamard run along them).

The state goes into checkpoints (:meth:`OsciReset.state_dict`), so a resumed run resets the same
elements an uninterrupted one does; under FSDP2 the per-element tensors are DTensors sharded as
their weights are, which a sharded checkpoint reshards for any number of ranks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.distributed.tensor import empty as dtensor_empty

from .. import ops
from ..formats.rowwise import ROWWISE_FP8
from ..policy.strategies import Strategy
from ..transforms import hadamard_transform
from .convert import adahop_layers
from .linear import AdaHOPLinear

OSCI_MOMENTUM = 0.01  # the reversal-rate EMA's weight on the newest step (a window of ~100 steps)


@dataclasses.dataclass
class _Track:
    last: torch.Tensor  # bf16: the quantized weight after the previous step
    direction: torch.Tensor  # int8: sign of its last change, 0 before any
    rate: torch.Tensor  # bf16: EMA of direction reversals per step


class OsciReset:
    """Reset weights whose forward-quantized value oscillates (reversal rate above ``threshold``)
    to the centre of their quantization bin; ``attach(optimizer)`` runs it after every step."""

    def __init__(self, model: nn.Module, threshold: float, momentum: float = OSCI_MOMENTUM) -> None:
        self.layers = adahop_layers(model)
        self.threshold, self.momentum = threshold, momentum
        self.tracks: dict[str, _Track] = {}
        self.resets: torch.Tensor | None = None  # int64 on the weights' device: elements reset so far

    def state_dict(self) -> dict[str, Any]:
        """``{"tracks": {"<layer>.<field>": tensor}, "resets": count or None}``: what a resumed run
        needs to go on exactly. Under FSDP2 the tracks are DTensors sharded as their layer's weight
        and ``resets`` is this rank's count."""
        tracks = {}
        for name, track in self.tracks.items():
            weight = self.layers[name].weight
            for field in _FIELDS:
                tracks[f"{name}.{field}"] = _sharded_as(weight, getattr(track, field))
        return {"tracks": tracks, "resets": self.resets}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore :meth:`state_dict`; its tracks may be DTensors or whole tensors (under FSDP2 each
        rank keeps its own rows). A layer this model lacks is a ``KeyError``."""
        fields: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state["tracks"].items():
            name, field = key.rsplit(".", 1)
            fields.setdefault(name, {})[field] = _own_rows(self._layer(name).weight, value)
        self.tracks = {name: _Track(**track) for name, track in fields.items()}
        resets = state["resets"]
        self.resets = None if resets is None else resets.to(self._device())

    def empty_track(self, key: str, size: torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A tensor to load the saved track ``key`` of whole shape ``size`` into (a sharded
        checkpoint loads into given tensors): a DTensor sharded as its layer's weight under FSDP2."""
        weight = self._layer(key.rsplit(".", 1)[0]).weight
        if isinstance(weight, DTensor):
            return dtensor_empty(size, dtype=dtype, device_mesh=weight.device_mesh, placements=weight.placements)
        return torch.empty(size, dtype=dtype, device=weight.device)

    def _layer(self, name: str) -> AdaHOPLinear:
        if name not in self.layers:
            raise KeyError(f"the de-oscillation state names layer {name!r}, which this model does not have")
        return self.layers[name]

    def _device(self) -> torch.device:
        return next(iter(self.layers.values())).weight.device

    def attach(self, optimizer: torch.optim.Optimizer):
        """Run ``step`` after every ``optimizer.step()``; returns the hook's handle."""
        return optimizer.register_step_post_hook(lambda *_: self.step())

    @torch.no_grad()
    def step(self) -> None:
        for name, layer in self.layers.items():
            plan = layer.running_plan
            if plan is not None and plan.forward is not Strategy.BF16:  # a forward that quantizes W
                self._step_layer(name, layer, plan.forward)

    def _step_layer(self, name: str, layer: AdaHOPLinear, forward: Strategy) -> None:
        weight = layer.weight.data
        w = weight.to_local() if isinstance(weight, DTensor) else weight
        spec = layer._specs[0]
        hb = spec.hadamard_block_size if forward is not Strategy.MXFP4 else 0
        w_rot = _rotate(w.float(), hb, spec.hadamard_signs)
        q = _fake_quantize(w_rot, dataclasses.replace(spec.unrotated, rounding="nearest"))
        track = self.tracks.get(name)
        if track is None or track.last.shape != q.shape:
            self.tracks[name] = _Track(
                q.bfloat16(), torch.zeros_like(q, dtype=torch.int8), torch.zeros_like(q).bfloat16()
            )
            return
        direction = torch.sign(q - track.last.float()).to(torch.int8)
        moved = direction != 0
        reversed_ = moved & (track.direction != 0) & (direction != track.direction)
        rate = track.rate.float() * (1 - self.momentum) + self.momentum * reversed_
        reset = rate > self.threshold
        if hb:  # move the rotated weight onto q there: rotate the difference back
            w.add_(_unrotate(torch.where(reset, q - w_rot, 0.0), hb, spec.hadamard_signs, w.shape[1]).to(w.dtype))
        else:  # exactly onto q
            w.copy_(torch.where(reset, q, w_rot).to(w.dtype))
        track.direction = torch.where(reset, 0, torch.where(moved, direction, track.direction))
        track.rate = torch.where(reset, 0.0, rate).bfloat16()
        track.last = q.bfloat16()
        count = reset.sum()
        self.resets = count if self.resets is None else self.resets + count


_FIELDS = tuple(f.name for f in dataclasses.fields(_Track))


def _sharded_as(weight: torch.Tensor, track: torch.Tensor) -> torch.Tensor:
    """``track`` (this rank's rows of a layer) as a DTensor sharded as ``weight`` is, when it is one."""
    if not isinstance(weight, DTensor):
        return track
    shape = torch.Size((weight.shape[0], *track.shape[1:]))
    return DTensor.from_local(
        track, weight.device_mesh, weight.placements, run_check=False, shape=shape, stride=(track.shape[1], 1)
    )


def _own_rows(weight: torch.Tensor, track: torch.Tensor) -> torch.Tensor:
    """This rank's rows of a saved track (a DTensor, or a whole tensor), on the weight's device."""
    if isinstance(track, DTensor):
        return track.to_local()
    if isinstance(weight, DTensor):  # a whole tensor: every rank has it, each keeps its rows (no communication)
        return distribute_tensor(
            track.to(weight.device), weight.device_mesh, weight.placements, src_data_rank=None
        ).to_local()
    return track.to(weight.device)


def _fake_quantize(w: torch.Tensor, spec) -> torch.Tensor:
    """``w`` [out, in'] quantized along ``in`` by the (unrotated, round-to-nearest) forward ``spec``, as float32."""
    if spec.fmt == ROWWISE_FP8:
        return ops.quantize_rowwise_2d(w, spec).dequantize()[:, : w.shape[1]]
    return ops.quantize_2d(w.contiguous(), spec, axis=1, seed=None).dequantize()


def _rotate(w: torch.Tensor, hb: int, signs: torch.Tensor | None) -> torch.Tensor:
    """``w`` as the forward's Hadamard sees it (zero-padded along ``in`` to whole blocks)."""
    if not hb:
        return w
    return hadamard_transform(nn.functional.pad(w, (0, -w.shape[1] % hb)), block_size=hb, signs=signs)


def _unrotate(v: torch.Tensor, hb: int, signs: torch.Tensor | None, width: int) -> torch.Tensor:
    """The inverse of ``_rotate`` (``Q = diag(signs) H / sqrt(n)`` is orthonormal: ``Q⁻¹ = H diag(signs) / sqrt(n)``)."""
    if not hb:
        return v
    out = hadamard_transform(v, block_size=hb)
    if signs is not None:
        out = (out.unflatten(1, (-1, hb)) * signs.to(out.device)).flatten(1)
    return out[:, :width]
