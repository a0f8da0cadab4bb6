"""Outlier patterns of a 2-D tensor in storage layout: ``row``, ``col`` or ``none``.

AdaHOP picks a GEMM strategy from where an operand's outliers lie. A *row* pattern means a
few rows carry most of the magnitude (typical of gradients dY [tokens, out]: a few tokens get
large gradients); a *col* pattern means a few columns do (typical of activations X
[tokens, in]: the channel outliers). The method leaves the statistic open; ours is

    line magnitude  m_i = mean |t| over line i, leaving out the line's largest element
    score               = max_i m_i / median_i m_i      (lower median over non-zero lines)
    pattern             = the direction with the larger score if it is >= threshold, else none

with the threshold 2.0 that a secondary source mentions. Why these choices:

- A mean of magnitudes (L1), not the abs-max or L2 norm: a pattern is a line whose *typical*
  magnitude is large: such a line crushes many MX blocks, not one.
- Leaving out each line's largest element makes the statistic blind to isolated spikes: a lone
  huge value would otherwise lift its row and its column alike.
- The median, not the mean: robust to the outlier lines themselves. All-zero lines (padding
  tokens, dead units) are left out of the median: they cost nothing to quantize.
- Lines shorter than :data:`MIN_LINE_LENGTH` (one MX block) give no score (1.0): the mean of a
  few magnitudes is too noisy (Gaussian noise with 16-element rows scores about 2 over 1e5 rows).
- An all-zero or empty tensor scores 1.0 in both directions (``none``). Exactly equal scores
  above the threshold are ``none`` too: no direction dominates.
- NaN or Inf anywhere raises ``ValueError``: a pattern voted from a broken step is noise, and a
  silent ``none`` would hide the broken step.

Cost: one ``abs`` pass, four float32-accumulated reductions (sum and max per row and per
column) and a single host sync; it never sorts or copies the tensor beyond the ``abs``.

**Calibration merges before it decides** (:func:`line_stats`, :func:`merged_scores`). A training
step's X and dY are split over micro-batches and data-parallel ranks; calibration decides each
operand's pattern once per step from the statistics of the whole step. Columns (features) are
complete on every share, so their sums and maxima add up exactly; rows (tokens) are each whole on
one share, so the row maximum merges exactly and the row median is read from a histogram of the
row magnitudes, 32 bins per octave (the float32 bit pattern's exponent and top 5 mantissa bits),
to within 1.1%. The merged statistics are device tensors (no host sync, ``torch.compile``-able);
one process and N ranks that see the same global batch get the same scores, up to float32
summation order.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Literal

import torch

Pattern = Literal["row", "col", "none"]
PATTERNS: tuple[Pattern, ...] = ("row", "col", "none")

DEFAULT_THRESHOLD = 2.0
MIN_LINE_LENGTH = 32
_NO_SCORE = 1.0


class NonFiniteTensorError(ValueError):
    """``pattern_stats`` was given a tensor holding NaN or Inf."""


@dataclass
class PatternStats:
    """The numbers behind one pattern decision."""

    shape: tuple[int, int]
    row_score: float  # largest row magnitude / median row magnitude
    col_score: float  # same for columns
    top_row: int  # index of the largest row (-1 for an empty tensor)
    top_col: int
    threshold: float
    pattern: Pattern

    def to_dict(self) -> dict:
        return asdict(self)


def check_pattern(value: str) -> Pattern:
    """``value`` if it names a pattern, else a ``ValueError`` listing the valid ones."""
    if value not in PATTERNS:
        raise ValueError(f"unknown pattern {value!r}; valid: {list(PATTERNS)}")
    return value


def _spike_free_means(magnitude: torch.Tensor, dim: int) -> torch.Tensor:
    """Mean of each line's magnitudes along ``dim`` without its largest one (float32)."""
    n = magnitude.shape[dim]
    total = magnitude.sum(dim=dim, dtype=torch.float32)
    largest = magnitude.amax(dim=dim).float()
    return (total - largest) / max(n - 1, 1)


def _line_scores(line_means: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(max / median over non-zero lines, argmax) as 0-d tensors; 1.0 when all lines are 0."""
    top_value, top_index = line_means.max(dim=0)
    median = line_means.masked_fill(line_means == 0, math.nan).nanmedian()
    score = torch.where(torch.isnan(median), _NO_SCORE, top_value / median)
    return score, top_index


def _scored_directions(shape: tuple[int, int], row_score: float, col_score: float) -> tuple[float, float]:
    """Lines shorter than ``MIN_LINE_LENGTH`` give no score (1.0)."""
    n_rows, n_cols = shape
    return (
        _NO_SCORE if n_cols < MIN_LINE_LENGTH else row_score,
        _NO_SCORE if n_rows < MIN_LINE_LENGTH else col_score,
    )


def _decide(row_score: float, col_score: float, threshold: float) -> Pattern:
    """The pattern for a pair of scores: the larger one wins if it reaches ``threshold``."""
    if max(row_score, col_score) < threshold or row_score == col_score:
        return "none"
    return "row" if row_score > col_score else "col"


def pattern_stats(t: torch.Tensor, threshold: float = DEFAULT_THRESHOLD) -> PatternStats:
    """Row/column outlier scores and the pattern of a 2-D floating tensor (see module doc)."""
    if t.dim() != 2:
        raise ValueError(f"pattern_stats expects a 2-D tensor in storage layout, got shape {tuple(t.shape)}")
    if not t.is_floating_point():
        raise ValueError(f"pattern_stats expects a floating tensor, got {t.dtype}")
    if not (math.isfinite(threshold) and threshold > 1.0):
        raise ValueError(f"threshold must be a finite number > 1 (scores are >= 1), got {threshold}")
    n_rows, n_cols = t.shape
    if t.numel() == 0:
        return PatternStats((n_rows, n_cols), _NO_SCORE, _NO_SCORE, -1, -1, threshold, "none")

    magnitude = t.detach().abs()
    row_means = _spike_free_means(magnitude, dim=1)
    col_means = _spike_free_means(magnitude, dim=0)
    row_score, top_row = _line_scores(row_means)
    col_score, top_col = _line_scores(col_means)
    finite = torch.isfinite(row_means).all() & torch.isfinite(col_means).all()
    summary = torch.stack([v.double() for v in (row_score, col_score, top_row, top_col, finite)])
    row_score, col_score, top_row, top_col, finite = summary.tolist()  # one host sync
    if not finite:
        raise NonFiniteTensorError(f"pattern_stats: tensor of shape {(n_rows, n_cols)} holds NaN or Inf")

    row_score, col_score = _scored_directions((n_rows, n_cols), row_score, col_score)
    pattern = _decide(row_score, col_score, threshold)
    return PatternStats((n_rows, n_cols), row_score, col_score, int(top_row), int(top_col), threshold, pattern)


HIST_SHIFT = 18  # a positive float32's bits >> 18: 8 exponent bits and the top 5 mantissa bits
HIST_BINS = 1 << (31 - HIST_SHIFT)  # 8192 bins, 32 per octave; bin 0 holds zero (and subnormal) lines


def stats_sizes(n_cols: int) -> tuple[int, int]:
    """Lengths of the ``(sums, maxes)`` vectors of :func:`line_stats` for ``n_cols`` columns."""
    return 1 + n_cols + HIST_BINS, 2 + n_cols


def line_stats(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The mergeable statistics of a 2-D tensor's lines, as two float64 device vectors.

    ``sums`` (merged by adding): ``[rows, column sums of |t| (n_cols), row-magnitude histogram
    (HIST_BINS)]``; ``maxes`` (merged by maximum): ``[non-finite flag, largest row magnitude,
    column maxima of |t| (n_cols)]``. Sums accumulate in float32 as :func:`pattern_stats` does.
    """
    n_rows, n_cols = t.shape
    magnitude = t.detach().abs()
    row_means = _spike_free_means(magnitude, dim=1)
    col_sums = magnitude.sum(dim=0, dtype=torch.float32)
    col_max = magnitude.amax(dim=0).float()
    keys = (row_means.view(torch.int32) >> HIST_SHIFT).clamp(0, HIST_BINS - 1).sort().values
    # A histogram by counting keys below each bin edge: deterministic (no atomic adds) on CUDA.
    below = torch.searchsorted(keys, torch.arange(HIST_BINS + 1, device=t.device, dtype=keys.dtype))
    histogram = below.diff()
    nonfinite = ~(torch.isfinite(row_means).all() & torch.isfinite(col_sums).all())
    rows = torch.full((1,), n_rows, dtype=torch.float64, device=t.device)
    sums = torch.cat([rows, col_sums.double(), histogram.double()])
    maxes = torch.cat([nonfinite.double().reshape(1), row_means.max().double().reshape(1), col_max.double()])
    return sums, maxes


def _binned_median(histogram: torch.Tensor) -> torch.Tensor:
    """The lower median of the non-zero lines (bins 1..) as its bin's middle value; NaN when none."""
    counts = histogram[1:]
    cumulative = counts.cumsum(0)
    total = cumulative[-1]
    k = torch.div(total - 1, 2, rounding_mode="floor")
    index = torch.searchsorted(cumulative, k.reshape(1), right=True).clamp(max=counts.numel() - 1) + 1
    bits = (index.to(torch.int32) << HIST_SHIFT) | (1 << (HIST_SHIFT - 1))
    return torch.where(total > 0, bits.view(torch.float32).double(), math.nan).reshape(())


def merged_scores(sums: torch.Tensor, maxes: torch.Tensor) -> torch.Tensor:
    """``[rows, row score, column score, non-finite]`` (float64, on the device) from merged
    :func:`line_stats`; the line-length rules (``MIN_LINE_LENGTH``) are :func:`decide`'s."""
    n_cols = maxes.numel() - 2
    rows, col_sums, histogram = sums[0], sums[1 : 1 + n_cols], sums[1 + n_cols :]
    col_means = (col_sums - maxes[2:]) / (rows - 1).clamp(min=1)
    col_score, _ = _line_scores(col_means)
    median = _binned_median(histogram)
    row_score = torch.where(torch.isnan(median), _NO_SCORE, maxes[1] / median)
    return torch.stack([rows, row_score, col_score.double(), maxes[0]])


def decide(shape: tuple[int, int], row_score: float, col_score: float, threshold: float) -> Pattern:
    """The pattern of a ``[rows, cols]`` operand from its scores: a direction whose lines are
    shorter than ``MIN_LINE_LENGTH`` has no score (see the module doc)."""
    return _decide(*_scored_directions(shape, row_score, col_score), threshold)


def detect_pattern(t: torch.Tensor, threshold: float = DEFAULT_THRESHOLD) -> Pattern:
    """``"row"``, ``"col"`` or ``"none"`` for a 2-D tensor in storage layout (see module doc)."""
    return pattern_stats(t, threshold).pattern
