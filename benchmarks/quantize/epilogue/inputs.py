"""Inputs that stress the epilogue kernels, shared by the tests and the GPU script's checks."""

from __future__ import annotations

import torch


def hard_rows(rows: int, cols: int, seed: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Rows over 40 binades, an outlier row, a NaN and an Inf element, a zero row, -0, subnormal bf16
    values and a row far below the rest (rows and columns past 8 and 64 where they fit)."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen) * torch.exp2(torch.randint(-20, 20, (rows, 1), generator=gen))
    x[0, 3] *= 2.0**30  # an outlier
    x[1, 5] = float("nan")
    x[2, min(40, cols - 1)] = float("inf")
    x[3] = 0.0
    x[4, ::3] = -0.0
    x[5] = torch.randn(cols, generator=gen) * 2.0**-130  # bf16 and float32 subnormals
    x[6] *= 2.0**-60
    x[7, : cols // 2] *= 2.0**-24  # blocks far below the row's largest: the fold's exact path
    return x.to(dtype)


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal bit patterns, a NaN matching any NaN (eager's NaN bits differ by device and code path)."""
    both_nan = a.isnan() & b.isnan()
    width = torch.int16 if a.element_size() == 2 else torch.int32
    return a.shape == b.shape and bool(((a.view(width) == b.view(width)) | both_nan).all())


def same_epilogue(got, want) -> dict[str, bool]:
    """Field by field: E4M3 bytes, row scales (bits), lossy counts, scores, output."""
    checks = {
        "data": torch.equal(got.folded.data.view(torch.uint8).cpu(), want.folded.data.view(torch.uint8).cpu()),
        "row_scale": torch.equal(got.folded.row_scale.view(torch.int32).cpu(), want.folded.row_scale.view(torch.int32).cpu()),
        "lossy": torch.equal(got.folded.lossy_per_row.cpu(), want.folded.lossy_per_row.cpu()),
    }  # fmt: skip
    if want.scores is not None:
        checks["scores"] = got.scores is not None and same_bits(got.scores.cpu(), want.scores.cpu())
    if want.output is not None:
        checks["output"] = got.output is not None and same_bits(got.output.cpu(), want.output.cpu())
    return checks
