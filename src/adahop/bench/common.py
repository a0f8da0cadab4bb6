"""Shared benchmark plumbing: timing, bandwidth baseline, environment record."""

from __future__ import annotations

import datetime
import math
import platform

import torch
from torch import nn


def ms_of(fn, warmup: int = 25, rep: int = 100) -> float:
    """Median milliseconds of ``fn()`` on the current CUDA device (L2 flushed between runs)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=warmup, rep=rep, return_mode="median")


def geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def tflops(m: int, n: int, k: int, ms: float) -> float:
    return 2 * m * n * k / ms / 1e9


def copy_gb_per_s(nbytes: int = 1 << 30) -> float:
    """Device-to-device copy bandwidth, bytes read + written: the memory-bound baseline."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return 2 * nbytes / ms_of(lambda: dst.copy_(src)) / 1e6


def environment() -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU (a CPU dry run)",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def saved_activation_bytes(module: nn.Module, x: torch.Tensor) -> int:
    """Bytes autograd saves for backward in ``module(x)``, parameters (and views of them) excluded."""
    params = {p.untyped_storage().data_ptr() for p in module.parameters()}
    total = 0

    def pack(t: torch.Tensor) -> torch.Tensor:
        nonlocal total
        if t.untyped_storage().data_ptr() not in params:
            total += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        module(x)
    return total
