"""Capture X, W and dY of every linear layer for one batch and measure their outlier structure.

For each tensor (in storage layout: X [tokens, in], W [out, in], dY [tokens, out]) the report
holds the pattern statistic behind AdaHOP's decision and what MXFP4 does to it: the relative
quantization error along its GEMM contraction dimension, plain and after the inner Hadamard
transform, so one can see where rotation helps and where it cannot.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..formats import quantize_mx
from ..policy import pattern_stats
from ..policy.strategies import ROLES
from ..transforms import hadamard_transform

HEATMAP_SIZE = 128


def downsample_abs(t: torch.Tensor, size: int) -> torch.Tensor:
    """|t| max-pooled so neither side exceeds ``size`` (max keeps outliers visible)."""
    a = t.detach().float().abs()
    kr, kc = -(-a.shape[0] // size), -(-a.shape[1] // size)
    a = torch.nn.functional.pad(a, (0, -a.shape[1] % kc, 0, -a.shape[0] % kr))
    return torch.nn.functional.max_pool2d(a[None, None], (kr, kc))[0, 0]


@dataclass
class TensorReport:
    shape: tuple[int, ...]
    pattern: str
    row_score: float
    col_score: float
    mxfp4_rel_error: float
    iht_rel_error: float
    heatmap: torch.Tensor = field(repr=False)  # |t| max-pooled to at most HEATMAP_SIZE^2

    def to_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "heatmap"}
        d["shape"] = list(self.shape)
        return d


@dataclass
class LayerReport:
    name: str
    tensors: dict[str, TensorReport]
    strategies: dict[str, str] | None  # frozen plan of the layer, if any

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "tensors": {r: t.to_dict() for r, t in self.tensors.items()},
            "strategies": self.strategies,
        }


def _rel_error(t: torch.Tensor, rotate: bool) -> float:
    """MXFP4 error along the last dim: the K of the forward GEMM for X and W, of dgrad for dY."""
    t = t.float()
    pad = -t.shape[-1] % 32
    if pad:
        t = torch.nn.functional.pad(t, (0, pad))
    if rotate:
        t = hadamard_transform(t)
    q = quantize_mx(t).dequantize()
    return ((q - t).norm() / t.norm().clamp_min(1e-30)).item()


def tensor_report(t: torch.Tensor) -> TensorReport:
    t = t.detach().reshape(-1, t.shape[-1])
    stats = pattern_stats(t)
    return TensorReport(
        shape=tuple(t.shape),
        pattern=stats.pattern,
        row_score=float(stats.row_score),
        col_score=float(stats.col_score),
        mxfp4_rel_error=_rel_error(t, rotate=False),
        iht_rel_error=_rel_error(t, rotate=True),
        heatmap=downsample_abs(t, HEATMAP_SIZE),
    )


def capture_linear_tensors(
    model: nn.Module, run_batch: Callable[[nn.Module], torch.Tensor]
) -> dict[str, dict[str, torch.Tensor]]:
    """Run ``run_batch(model) -> loss`` forward and backward; return {layer: {"x","w","g": tensor}}."""
    captured: dict[str, dict[str, torch.Tensor]] = {}
    handles = []

    def hook(name: str):
        def on_forward(module, args, output):
            slot = captured.setdefault(name, {})
            slot["x"] = args[0].detach()
            slot["w"] = module.weight.detach()
            if output.requires_grad:
                output.register_hook(lambda g: slot.__setitem__("g", g.detach()))

        return on_forward

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear):
            handles.append(module.register_forward_hook(hook(name)))
    try:
        model.train()
        model.zero_grad(set_to_none=True)
        run_batch(model).backward()
    finally:
        for h in handles:
            h.remove()
        model.zero_grad(set_to_none=True)
    return captured


def analyze_model(model: nn.Module, run_batch: Callable[[nn.Module], torch.Tensor]) -> list[LayerReport]:
    """Outlier report of every linear layer (LM head included) for one batch."""
    modules = dict(model.named_modules())
    reports = []
    for name, tensors in capture_linear_tensors(model, run_batch).items():
        plan = getattr(modules[name], "plan", None)
        reports.append(
            LayerReport(
                name,
                {role: tensor_report(tensors[role]) for role in ROLES if role in tensors},
                None if plan is None else {g: s.value for g, s in plan.strategies().items()},
            )
        )
    return reports
