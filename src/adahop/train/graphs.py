"""A training micro-step (forward, loss, backward) captured once as a CUDA graph and replayed.

A frozen AdaHOP step launches hundreds of small kernels from Python (quantize, fold and GEMM for
every operand of every layer), so in eager mode the GPU waits on the host. Captured, the whole
micro-step is one graph launch with no host work, whatever the recipe (BF16 gets the same).

Capture needs a step that never waits on the host and keeps its memory where the graph left it:

- the stochastic-rounding seeds are drawn on the device (each replay advances CUDA's Philox
  offset, so every replay rounds with fresh noise, reproducibly for a seed);
- gradients accumulate in place into ``.grad`` tensors that stay allocated, so the optimizer
  must zero them with ``zero_grad(set_to_none=False)``;
- the batch is copied into static input tensors; a batch of another shape runs eagerly;
- no tensor of an earlier step's autograd graph may still be alive at capture (it would keep
  AccumulateGrad nodes bound to the default stream); the trainer keeps none.

The first call runs eagerly on a side stream (it compiles Triton kernels and any
``torch.compile``'d blocks and sets up cuBLAS, none of which may happen during capture); the
second captures the graph and replays it; later calls only replay.
"""

from __future__ import annotations

import torch
from torch import nn


class GraphedMicroStep:
    """``step(inputs, targets)`` runs ``model`` forward, ``backward()`` on ``loss * loss_scale``,
    and returns the unscaled loss (a tensor that the next call overwrites: read it first)."""

    def __init__(self, model: nn.Module, *, loss_scale: float = 1.0, autocast_dtype: torch.dtype | None = torch.bfloat16) -> None:
        self.model, self.loss_scale, self.autocast_dtype = model, loss_scale, autocast_dtype
        self._warm = False
        self._graph: torch.cuda.CUDAGraph | None = None
        self._inputs = self._targets = self._loss = None

    @property
    def captured(self) -> bool:
        return self._graph is not None

    def _forward_backward(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        # The autocast cache would keep weight casts made during capture alive past it.
        with torch.autocast("cuda", dtype=self.autocast_dtype or torch.bfloat16,
                            enabled=self.autocast_dtype is not None, cache_enabled=False):
            _, loss = self.model(inputs, targets)
        (loss * self.loss_scale).backward()
        return loss.detach()

    def _capture(self, inputs: torch.Tensor, targets: torch.Tensor) -> None:
        for p in self.model.parameters():
            if p.requires_grad and p.grad is None:
                p.grad = torch.zeros_like(p)  # accumulated into in place by every replay
        self._inputs, self._targets = inputs.clone(), targets.clone()
        self._graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self._graph):
            self._loss = self._forward_backward(self._inputs, self._targets)
        # The eager warm-up's blocks stay cached beside the graph's own pool: give them back.
        torch.cuda.empty_cache()

    def __call__(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if not inputs.is_cuda:
            raise ValueError(f"CUDA graphs need CUDA inputs, got a tensor on {inputs.device}")
        if not self._warm:
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                loss = self._forward_backward(inputs, targets)
            torch.cuda.current_stream().wait_stream(side)
            self._warm = True
            return loss
        if self._graph is None:
            self._capture(inputs, targets)  # records only: the replay below runs this batch
        elif inputs.shape != self._inputs.shape or targets.shape != self._targets.shape:
            return self._forward_backward(inputs, targets)
        else:
            self._inputs.copy_(inputs, non_blocking=True)
            self._targets.copy_(targets, non_blocking=True)
        self._graph.replay()
        return self._loss
