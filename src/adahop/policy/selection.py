"""Which rows outlier extraction takes: the specification that the selection kernel matches.

A row's score is its abs-max (``row_scores``; NaN if the row holds one). The ``k`` rows with the
largest score are taken, ties broken toward the lower row index, NaN above every number (every
NaN equal); returned in ascending row order. ``torch.topk`` leaves ties to the implementation,
and a tie decides which row goes to the BF16 path, so the rule is written out here and the CUDA
kernels (``kernels/select.py``, and the quantize kernels that record scores) are tested against it.
"""

from __future__ import annotations

import torch


SCORE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def row_scores(t: torch.Tensor, dim: int = 1) -> torch.Tensor:
    """Each line's abs-max along ``dim`` (``dim=1``: each row's) in float32, exact for every input
    dtype; NaN where the line holds a NaN."""
    return torch.linalg.vector_norm(t.detach(), float("inf"), dim=dim).float()  # no |t| copy


def check_top_rows_args(scores: torch.Tensor, k: int) -> None:
    if scores.dim() != 1 or scores.dtype not in SCORE_DTYPES:
        raise ValueError(
            f"top_rows takes a 1-D float32, bfloat16 or float16 score vector, got {scores.dtype} of shape {tuple(scores.shape)}"
        )
    if not 0 < k <= scores.numel():
        raise ValueError(f"top_rows needs 0 < k <= {scores.numel()} (the number of rows), got k={k}")


def top_rows_reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices (int64, ascending) of the ``k`` largest ``|scores|`` (NaN largest; ties to the
    lower index). Scores keep the dtype of the rows they score: a row's abs-max is exact in it."""
    check_top_rows_args(scores, k)
    # A stable descending sort keeps equal scores in index order; sort puts NaN above all.
    order = torch.sort(scores.float().abs(), descending=True, stable=True).indices[:k]
    return torch.sort(order).values
