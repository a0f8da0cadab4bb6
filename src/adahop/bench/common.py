"""Shared benchmark plumbing: timing, bandwidth baseline, environment record."""

from __future__ import annotations

import datetime
import math
import platform

import torch


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
        "gpu": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }
