"""Inputs of the grouped kernel's checks, shared by the tests and the GPU script: a list of mixed shapes with
hard rows, and a field-by-field comparison of a tensor's grouped output with its own launch's."""

from __future__ import annotations

import torch

from adahop.formats.folded import FoldedFP8
from epilogue.inputs import hard_rows, same_bits

# Row lengths of 1, 2, 3 (padded to 4), 8 and 16 blocks; rows that fill no tile, several, and part of one.
MIXED_SHAPES = ((21, 96), (8, 256), (40, 32), (9, 64), (20, 512), (3, 96))


def mixed_hard_tensors(seed: int, device: torch.device | str = "cpu") -> list[torch.Tensor]:
    """``MIXED_SHAPES`` as bf16 tensors: hard rows (NaN, Inf, zeros, -0, subnormals, outliers, the fold's exact
    path) where a tensor has the 8 rows they need, else random rows over many binades."""
    tensors = []
    for i, (rows, cols) in enumerate(MIXED_SHAPES):
        if rows >= 8:
            tensors.append(hard_rows(rows, cols, seed=seed + i))
        else:
            gen = torch.Generator().manual_seed(seed + i)
            scale = torch.exp2(torch.randint(-30, 30, (rows, 1), generator=gen).float())
            tensors.append((torch.randn(rows, cols, generator=gen) * scale).to(torch.bfloat16))
    return [t.to(device) for t in tensors]


def same_fold(
    got: FoldedFP8, want: FoldedFP8, got_scores: torch.Tensor | None = None, want_scores: torch.Tensor | None = None
) -> dict[str, bool]:
    """Field by field: E4M3 bytes, row scales (bits), lossy counts, scores (NaN matching NaN). On the tensors'
    device: the GPU script compares gigabytes."""
    checks = {
        "data": torch.equal(got.data.view(torch.uint8), want.data.view(torch.uint8)),
        "row_scale": torch.equal(got.row_scale.view(torch.int32), want.row_scale.view(torch.int32)),
        "lossy": torch.equal(got.lossy_per_row, want.lossy_per_row),
    }
    if want_scores is not None:
        checks["scores"] = got_scores is not None and same_bits(got_scores, want_scores)
    return checks
