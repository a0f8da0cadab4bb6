"""A training micro-step (forward, loss, backward) captured once as a CUDA graph and replayed.

A frozen AdaHOP step launches hundreds of small kernels from Python (quantize, fold and GEMM for
every operand of every layer), so in eager mode the GPU waits on the host. Captured, the whole
micro-step is one graph launch with no host work, whatever the recipe (BF16 gets the same).

Capture needs a step that never waits on the host and keeps its memory where the graph left it:

- the stochastic-rounding seeds are drawn on the device (each replay advances CUDA's Philox
  offset, so every replay rounds with fresh noise, reproducibly for a seed);
- gradients live in ``.grad`` tensors that the graphs own: the first micro-step of an optimizer
  step runs a graph captured with no ``.grad`` (its backward *writes* the gradients, with no
  zero fill and no add), the later micro-steps (gradient accumulation) a second graph that adds
  into them. So the optimizer must never set them to None, nor zero them: the next first
  micro-step overwrites them;
- the batch is copied into static input tensors; a batch of another shape runs eagerly;
- no tensor of an earlier step's autograd graph may still be alive at capture (it would keep
  AccumulateGrad nodes bound to the default stream); the trainer keeps none.

The first call runs eagerly on a side stream (it compiles Triton kernels and any
``torch.compile``'d blocks and sets up cuBLAS, none of which may happen during capture); the
next first micro-step captures the overwriting graph, the next later one the accumulating graph
(capture order matters: the second graph adds into the tensors the first one writes); after
that, calls only replay.

Inside ``nn.weight_operands_cached`` (the trainer's gradient accumulation) the accumulating graph
reads W's quantized operands where the first graph writes them, instead of quantizing W again
(``nn.weight_cache.GraphOperands``); it replays only after the first graph ran on W as it is now,
else that micro-step runs eagerly.
"""

from __future__ import annotations

import torch
from torch import nn

from ..nn import adahop_layers
from ..nn.weight_cache import GraphOperands


class GraphedMicroStep:
    """``step(inputs, targets, first=...)`` runs ``model`` forward, ``backward()`` on
    ``loss * loss_scale`` and returns the unscaled loss (a tensor that the next call overwrites:
    read it first). ``first``: this micro-step starts an optimizer step, so its gradients replace
    those in ``.grad`` instead of adding to them."""

    def __init__(
        self, model: nn.Module, *, loss_scale: float = 1.0, autocast_dtype: torch.dtype | None = torch.bfloat16
    ) -> None:
        calibrating = [name for name, layer in adahop_layers(model).items() if layer.calibrating]
        if calibrating:
            raise ValueError(
                f"GraphedMicroStep: {len(calibrating)} layers still calibrate (first: {calibrating[0]}), and a graph "
                "would replay calibration forever; capture after the plan froze (step an optimizer, or call "
                "adahop.end_calibration_step after each calibration step)"
            )
        self.model, self.loss_scale, self.autocast_dtype = model, loss_scale, autocast_dtype
        self._warm = False
        self._graphs: dict[bool, torch.cuda.CUDAGraph] = {}  # keyed by ``first``
        self._losses: dict[bool, torch.Tensor] = {}
        self._inputs = self._targets = None
        self._operands = GraphOperands(model)  # W's operands shared by the two graphs

    @property
    def captured(self) -> bool:
        return bool(self._graphs)

    def _params(self) -> list[nn.Parameter]:
        return [p for p in self.model.parameters() if p.requires_grad]

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The autocast cache would keep weight casts made during capture alive past it.
        with torch.autocast(
            "cuda",
            dtype=self.autocast_dtype or torch.bfloat16,
            enabled=self.autocast_dtype is not None,
            cache_enabled=False,
        ):
            _, loss = self.model(inputs, targets)
        (loss * self.loss_scale).backward()
        return loss.detach()

    def _eager(self, inputs: torch.Tensor, targets: torch.Tensor, first: bool) -> torch.Tensor:
        if first:  # in place: the graphs hold these tensors
            for p in self._params():
                if p.grad is not None:
                    p.grad.zero_()
        return self._forward_backward(inputs, targets)

    def _capture(self, inputs: torch.Tensor, targets: torch.Tensor, first: bool) -> None:
        if first:
            for p in self._params():
                p.grad = None  # the backward allocates them in the graph's pool and writes them
            self._inputs, self._targets = inputs.clone(), targets.clone()
        else:
            self._inputs.copy_(inputs)
            self._targets.copy_(targets)
        pool = self._graphs[True].pool() if not first else None  # replayed in turn, never at once
        graph = torch.cuda.CUDAGraph()
        self._operands.before_capture(first)
        with torch.cuda.graph(graph, pool=pool):
            loss = self._forward_backward(self._inputs, self._targets)
        self._operands.after_capture(first)
        self._graphs[first], self._losses[first] = graph, loss
        # The eager warm-up's blocks stay cached beside the graph's own pool: give them back.
        torch.cuda.empty_cache()

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor, *, first: bool = True) -> torch.Tensor:
        if not inputs.is_cuda:
            raise ValueError(f"CUDA graphs need CUDA inputs, got a tensor on {inputs.device}")
        if not self._warm:
            # Blocks cached by earlier eager steps (calibration) belong to the default stream and
            # cannot serve the side stream: give them back before it allocates its own.
            torch.cuda.empty_cache()
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self._eager(inputs, targets, first)
            torch.cuda.current_stream().wait_stream(side)
            self._warm = True
            self._operands.ran(first, replayed=False)
            return loss
        shape_changed = self._inputs is not None and (
            inputs.shape != self._inputs.shape or targets.shape != self._targets.shape
        )
        # Accumulation captures after the first graph, and replays only where its W operands are current.
        if shape_changed or (not first and True not in self._graphs) or not self._operands.may_replay(first):
            loss = self._eager(inputs, targets, first)
            self._operands.ran(first, replayed=False)
            return loss
        if first not in self._graphs:
            self._capture(inputs, targets, first)  # records only: the replay below runs this batch
        else:
            self._inputs.copy_(inputs, non_blocking=True)
            self._targets.copy_(targets, non_blocking=True)
        self._graphs[first].replay()
        self._operands.ran(first, replayed=True)
        return self._losses[first]
