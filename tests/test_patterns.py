"""Outlier-pattern statistic: planted patterns, noise, spikes, edge cases, float64 reference."""

import numpy as np
import pytest
import torch

from adahop.policy.patterns import (
    DEFAULT_THRESHOLD,
    MIN_LINE_LENGTH,
    decide,
    detect_pattern,
    line_stats,
    merged_scores,
    pattern_stats,
)


def reference_scores(t: torch.Tensor) -> tuple[float, float]:
    """The documented statistic in float64 numpy, written from the module docstring."""

    def score(lines: np.ndarray) -> float:  # one line per row of `lines`
        if lines.shape[1] < MIN_LINE_LENGTH:
            return 1.0
        mags = np.sort(np.abs(lines), axis=1)[:, :-1].mean(axis=1)  # drop each line's largest
        nonzero = np.sort(mags[mags > 0])
        if nonzero.size == 0:
            return 1.0
        return mags.max() / nonzero[(nonzero.size - 1) // 2]  # lower median, as torch.median

    a = t.double().numpy()
    return score(a), score(a.T)


def gaussian(shape, seed):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def laplace(shape, seed):
    gen = torch.Generator().manual_seed(seed)
    return torch.empty(shape).exponential_(generator=gen) - torch.empty(shape).exponential_(generator=gen)


@pytest.mark.parametrize("shape", [(512, 256), (4096, 64), (64, 4096), (128, 2048)])
@pytest.mark.parametrize("factor", [4.0, 20.0])
def test_planted_rows_and_columns(shape, factor):
    gen = torch.Generator().manual_seed(1)
    rows = torch.randperm(shape[0], generator=gen)[:3]
    cols = torch.randperm(shape[1], generator=gen)[:3]

    t = gaussian(shape, 0)
    t[rows] *= factor
    stats = pattern_stats(t)
    assert stats.pattern == "row" and stats.top_row in rows.tolist()
    assert stats.row_score == pytest.approx(reference_scores(t)[0], rel=1e-5)

    t = gaussian(shape, 0)
    t[:, cols] *= factor
    stats = pattern_stats(t)
    assert stats.pattern == "col" and stats.top_col in cols.tolist()
    assert stats.col_score == pytest.approx(reference_scores(t)[1], rel=1e-5)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("shape", [(8192, 32), (32, 8192), (1024, 1024), (2048, 256), (300, 77)])
def test_noise_has_no_pattern(shape, seed):
    for t in (gaussian(shape, seed), laplace(shape, seed)):
        stats = pattern_stats(t)
        assert stats.pattern == "none", stats
        ref_row, ref_col = reference_scores(t)
        assert (stats.row_score, stats.col_score) == pytest.approx((ref_row, ref_col), rel=1e-5)


@pytest.mark.parametrize("shape", [(512, 512), (4096, 256), (256, 4096)])
def test_isolated_spikes_are_not_a_pattern(shape):
    t = gaussian(shape, 0)
    t[3, 7] = 1e4
    t[100, 200] = -1e6
    assert detect_pattern(t) == "none"


def test_score_tracks_the_planted_factor_and_the_threshold():
    t = gaussian((2048, 512), 0)
    t[:, 5] *= 3.0
    score = pattern_stats(t).col_score
    assert 2.5 < score < 3.5
    assert detect_pattern(t, threshold=score * 1.01) == "none"
    assert detect_pattern(t, threshold=score * 0.99) == "col"


def test_zero_lines_are_left_out_of_the_median():
    t = gaussian((1024, 256), 0)
    t[::2] = 0  # half the tokens are padding
    assert detect_pattern(t) == "none"
    t[1] *= 10
    assert detect_pattern(t) == "row"


@pytest.mark.parametrize("shape", [(0, 64), (64, 0), (7, 5), (1, 1)])
def test_empty_zero_and_tiny_tensors(shape):
    for t in (torch.zeros(shape), torch.ones(shape), gaussian(shape, 0)):
        stats = pattern_stats(t)
        assert stats.pattern == "none" and stats.row_score == stats.col_score == 1.0


def test_short_lines_give_no_score_but_long_ones_still_decide():
    t = gaussian((4096, MIN_LINE_LENGTH - 1), 0)
    t[:, 3] *= 10
    t[17] *= 10
    stats = pattern_stats(t)
    assert stats.row_score == 1.0 and stats.pattern == "col"


def test_bf16_matches_float32_of_the_same_values():
    t = gaussian((1024, 512), 0)
    t[:, 9] *= 6
    b = t.bfloat16()
    got, ref = pattern_stats(b), pattern_stats(b.float())
    assert got.pattern == ref.pattern == "col"
    assert (got.row_score, got.col_score) == pytest.approx((ref.row_score, ref.col_score), rel=1e-5)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_raises(bad):
    t = gaussian((128, 64), 0)
    t[5, 6] = bad
    with pytest.raises(ValueError, match="NaN or Inf"):
        pattern_stats(t)


def test_bad_inputs():
    with pytest.raises(ValueError, match="2-D"):
        pattern_stats(torch.randn(8))
    with pytest.raises(ValueError, match="2-D"):
        pattern_stats(torch.randn(2, 8, 8))
    with pytest.raises(ValueError, match="floating"):
        pattern_stats(torch.ones(64, 64, dtype=torch.int32))
    with pytest.raises(ValueError, match="threshold"):
        pattern_stats(torch.randn(64, 64), threshold=1.0)


def test_stats_to_dict():
    d = pattern_stats(gaussian((64, 64), 0)).to_dict()
    assert d["shape"] == (64, 64) and d["threshold"] == DEFAULT_THRESHOLD and d["pattern"] == "none"
    assert set(d) == {"shape", "row_score", "col_score", "top_row", "top_col", "threshold", "pattern"}


@pytest.mark.parametrize("planted", ["row", "col", "none", "zero rows"])
def test_statistics_merged_from_parts_score_as_the_whole_tensor(planted):
    """What calibration sums over micro-batches and ranks: the parts of a tensor split by rows give
    the whole's scores (rows exactly, columns up to summation order), close to ``pattern_stats``."""
    t = gaussian((512, 96), 0)
    if planted == "row":
        t[[7, 300]] *= 10
    elif planted == "col":
        t[:, 5] *= 10
    elif planted == "zero rows":
        t[:200] = 0
    whole = merged_scores(*line_stats(t)).tolist()
    parts = [line_stats(part) for part in t.split([100, 300, 112])]
    sums, maxes = sum(p[0] for p in parts), torch.stack([p[1] for p in parts]).amax(0)
    merged = merged_scores(sums, maxes).tolist()
    assert merged[:2] == whole[:2] and merged[0] == 512 and merged[3] == 0  # rows, row score, finite
    assert merged[2] == pytest.approx(whole[2], rel=1e-6)
    exact = pattern_stats(t)
    assert whole[1] == pytest.approx(exact.row_score, rel=0.011)  # the binned row median
    assert whole[2] == pytest.approx(exact.col_score, rel=1e-6)
    expected = {"row": "row", "col": "col"}.get(planted, "none")
    assert decide(tuple(t.shape), merged[1], merged[2], DEFAULT_THRESHOLD) == exact.pattern == expected


def test_merged_statistics_flag_non_finite_values():
    t = gaussian((64, 64), 0)
    t[3, 4] = float("nan")
    assert merged_scores(*line_stats(t))[3] == 1
