"""Non-finite steps: refused on the device, reported when the host next reads the step's figures.

Checking the loss and the gradient norm on the host before ``optimizer.step()`` (``.item()``)
makes the host wait for the backward to finish, and the device then idles while the host
launches the optimizer. So the check stays on the device: :func:`step_unless_non_finite` folds
each step's verdict into a ``found_inf`` flag that never clears, and while it is set the
optimizer changes nothing, neither for the bad step nor for any step after it. The host reads
the figures of the steps since its last read (:class:`PendingSteps`, one transfer) only when it
needs them anyway: to log, before it evaluates or writes a checkpoint, and at the end; then it
stops, naming the first bad step. So no checkpoint is ever written after a bad step, and the
steps refused in between (their data position and schedule advanced, nothing else) are never
saved: a resume starts from the last good checkpoint.

PyTorch's fused AdamW (the trainer's optimizer on CUDA) honours ``found_inf`` as GradScaler sets
it: its kernel leaves the parameters and moments alone where the flag is 1 and takes back the
step count it added. Any other optimizer (on the CPU: its fused AdamW rounds differently from
the single-tensor one that CPU runs are reproduced with) steps, and is then undone from a copy
of what it writes with ``torch.where``, which keeps an applied step bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def step_unless_non_finite(
    optimizer: torch.optim.Optimizer, found_inf: torch.Tensor, loss: torch.Tensor, grad_norm: torch.Tensor
) -> None:
    """``optimizer.step()``, applied unless ``loss`` or ``grad_norm`` is NaN or infinite or an
    earlier step's was: ``found_inf`` (a float32 scalar on the device, 0 at first) becomes 1
    then and stays 1. Never reads a value on the host."""
    found_inf.masked_fill_(~(loss.isfinite() & grad_norm.isfinite()), 1.0)
    if all(group.get("fused") for group in optimizer.param_groups):
        optimizer.found_inf = found_inf
        try:
            optimizer.step()
        finally:
            del optimizer.found_inf
    else:
        _step_then_undo(optimizer, found_inf.bool())


def _written(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> list[torch.Tensor]:
    """What a step writes for ``param``: the parameter and its state (none before the first step)."""
    state = optimizer.state.get(param, {})
    return [param, *(value for value in state.values() if isinstance(value, torch.Tensor))]


@torch.no_grad()
def _step_then_undo(optimizer: torch.optim.Optimizer, bad: torch.Tensor) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    before = {p: [t.clone() for t in _written(optimizer, p)] for p in params}
    optimizer.step()
    for p in params:
        for i, t in enumerate(_written(optimizer, p)):
            refused = bad.to(t.device)  # a non-fused optimizer keeps its step counts on the host
            if i < len(before[p]):
                t.copy_(torch.where(refused, before[p][i], t))
            else:  # state the first step created: zero, as the optimizer starts it
                t.masked_fill_(refused, 0)


@dataclass(frozen=True)
class StepFigures:
    """One optimizer step's figures, read on the host; ``lr`` is the rate it ran with."""

    step: int
    lr: float
    loss: float
    grad_norm: float

    @property
    def finite(self) -> bool:
        return math.isfinite(self.loss) and math.isfinite(self.grad_norm)


class PendingSteps:
    """The figures of the steps the host has not read yet, left on the device."""

    def __init__(self) -> None:
        self._steps: list[tuple[int, float, torch.Tensor, torch.Tensor]] = []

    def add(self, step: int, lr: float, loss: torch.Tensor, grad_norm: torch.Tensor) -> None:
        self._steps.append((step, lr, loss, grad_norm))

    def read(self) -> list[StepFigures]:
        """Every pending step's figures, oldest first, in one transfer (it waits for the device
        to finish them); none are pending after it."""
        if not self._steps:
            return []
        values = torch.stack([t.float() for *_, loss, norm in self._steps for t in (loss, norm)]).tolist()
        figures = [
            StepFigures(step, lr, values[2 * i], values[2 * i + 1]) for i, (step, lr, *_) in enumerate(self._steps)
        ]
        self._steps.clear()
        return figures
