"""AdamW with decoupled weight decay on matrices, and a linear-warmup cosine-decay schedule."""

from __future__ import annotations

import functools
import math

import torch
from torch import nn
from torch.optim.lr_scheduler import LambdaLR

from .config import OptimConfig


def build_optimizer(model: nn.Module, cfg: OptimConfig, device: torch.device) -> torch.optim.AdamW:
    """AdamW; weight decay applies to matrices (linear and embedding weights), not to norm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=cfg.betas, fused=runs_fused(device))


def allocate_state(optimizer: torch.optim.AdamW) -> None:
    """AdamW's state for every parameter that has none, made now as its first step would make it:
    zero moments, and the step count on the device for the fused kernel, on the host otherwise.

    Why before the first step: made by that step, the moments (8 bytes per parameter) are allocated
    on the GPU inside the blocks its forward and backward just freed, and the caching allocator
    cannot return a segment while any block of it is in use. After eager calibrating steps the
    captured graphs allocate a private pool of their own, so the free part of those segments can stay
    reserved, unused, for the whole run (issue 30). Made first, the moments get segments of their own.
    """
    for group in optimizer.param_groups:
        # torch's own choice (torch.optim.Adam._init_group); tests/test_optim_state.py compares with it
        default = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
        step_dtype = torch.float32 if group["fused"] else default
        on_device = group["fused"] or group["capturable"]
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            state["step"] = torch.zeros((), dtype=step_dtype, device=p.device if on_device else "cpu")
            for name in ("exp_avg", "exp_avg_sq", *(("max_exp_avg_sq",) if group["amsgrad"] else ())):
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)


def runs_fused(device: torch.device) -> bool:
    """PyTorch's fused AdamW on CUDA (one kernel, and ``found_inf`` refuses a step on the device);
    the single-tensor one elsewhere (the CPU's fused kernel rounds differently from it)."""
    return device.type == "cuda"


def lr_multiplier(step: int, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> float:
    """Factor on the peak lr for optimizer step ``step`` (0-based): linear warmup to 1 over
    ``warmup_steps``, then a cosine down to ``min_lr_ratio`` at ``total_steps``."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    return min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer, cfg: OptimConfig, total_steps: int, start_step: int = 0
) -> LambdaLR:
    """The schedule of ``cfg`` over ``total_steps``, positioned at ``start_step`` (a resumed run):
    a pure function of the config and the step, so a resumed run follows its current config."""
    schedule = functools.partial(
        lr_multiplier, warmup_steps=cfg.warmup_steps, total_steps=total_steps, min_lr_ratio=cfg.min_lr_ratio
    )
    for group in optimizer.param_groups:
        group["initial_lr"] = cfg.lr
    return LambdaLR(optimizer, schedule, last_epoch=start_step - 1)


def apply_hyperparameters(optimizer: torch.optim.AdamW, cfg: OptimConfig) -> None:
    """Set ``cfg``'s betas and weight decay on an optimizer whose state was loaded from a
    checkpoint (which restores the values it was saved with); the lr comes from the schedule.
    The checkpoint also restores how the saving process ran AdamW: a CPU run's checkpoint resumed
    on CUDA would stay unfused, a CUDA run's on the CPU fused. Run it as this process would."""
    matrices, norms = optimizer.param_groups
    matrices.update(betas=cfg.betas, weight_decay=cfg.weight_decay)
    norms.update(betas=cfg.betas, weight_decay=0.0)
    for group in optimizer.param_groups:
        if not group["params"]:
            continue
        device = group["params"][0].device
        group.update(fused=runs_fused(device), foreach=None, capturable=False)  # as build_optimizer makes it
        for p in group["params"]:  # the fused kernel reads its step counts on the device, the other on the host
            state = optimizer.state.get(p, {})
            if torch.is_tensor(state.get("step")):
                state["step"] = state["step"].to(device if group["fused"] else "cpu", torch.float32)
