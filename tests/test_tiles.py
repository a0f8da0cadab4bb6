"""Square-tile MX quantization (``quantize_mx_tiles``, 2-D weight blocks) against float64 math."""

import numpy as np
import pytest
import torch

import mx_oracle
from adahop.formats import ELEMENT_FORMATS, SCALE_RULES, quantize_mx_tiles

T = 32


def planted(rows=70, cols=100, seed=0):
    """Tiles whose maxima sit on binade edges (power of two, just below one, the FP4 6 * 2**k) and
    vary by orders of magnitude, with partial tiles at both edges."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=g) * torch.exp2(torch.randint(-6, 6, (rows, 1), generator=g).float())
    edges = [2.0**5, 2.0**5 * (1 - 2.0**-20), 6.0 * 2.0**-3, 3.0, 7.0 * 2.0**8]
    for i, (r, c) in enumerate([(0, 0), (5, 40), (33, 70), (64, 10), (rows - 1, cols - 1)]):
        r, c = r % rows, c % cols
        tile = x[r // T * T : r // T * T + T, c // T * T : c // T * T + T]
        tile.clamp_(-edges[i] / 2, edges[i] / 2)
        x[r, c] = -edges[i]
    return x


def float64_tiles(x: torch.Tensor, fmt: str, rule: str) -> tuple[np.ndarray, np.ndarray]:
    """(E8M0 exponent per tile, round-to-nearest values) from float64 math, tile by tile."""
    mbits, emin, emax, max_normal, ml_type, _ = mx_oracle.FORMATS[fmt]
    v = x.double().numpy()
    rows, cols = v.shape
    nr, nc = -(-rows // T), -(-cols // T)
    exps = np.zeros((nr, nc), dtype=np.int64)
    values = np.zeros_like(v)
    for i in range(nr):
        for j in range(nc):
            tile = v[i * T : (i + 1) * T, j * T : (j + 1) * T]
            s = int(mx_oracle.shared_exponents(np.abs(tile).max(), fmt, rule))
            y = tile * 2.0**-s
            q = np.copysign(np.minimum(np.abs(y), max_normal), y).astype(ml_type).astype(np.float64)
            exps[i, j], values[i * T : (i + 1) * T, j * T : (j + 1) * T] = s, q * 2.0**s
    return exps, values


@pytest.mark.parametrize("fmt", list(ELEMENT_FORMATS))
@pytest.mark.parametrize("rule", SCALE_RULES)
def test_tile_scales_and_elements_match_float64_math(fmt, rule):
    x = planted()
    along_rows, along_cols = quantize_mx_tiles(x, fmt, scale_rule=rule)
    exps, values = float64_tiles(x, fmt, rule)
    codes = torch.from_numpy(exps + 127).to(torch.uint8)
    assert torch.equal(along_rows.scales, codes.repeat_interleave(T, 0)[: x.shape[0]])  # [rows, tiles along cols]
    assert torch.equal(along_cols.scales, codes.T.repeat_interleave(T, 0)[: x.shape[1]])  # [cols, tiles along rows]
    for q in (along_rows, along_cols):
        assert torch.equal(q.dequantize(torch.float64), torch.from_numpy(values))


@pytest.mark.parametrize("fmt", list(ELEMENT_FORMATS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_two_views_are_exact_transposes(fmt, dtype):
    x = planted(rows=96, cols=45).to(dtype)
    along_rows, along_cols = quantize_mx_tiles(x, fmt, scale_rule="even", rounding="stochastic", seed=7)
    assert (along_rows.axis, along_cols.axis, along_rows.shape) == (1, 0, x.shape)
    forward_w = along_rows.dequantize_blocked()[:, :45]  # storage [rows, cols]
    dgrad_wt = along_cols.dequantize_blocked()[:, :96]  # storage [cols, rows]
    assert torch.equal(forward_w, dgrad_wt.T)


def test_stochastic_rounding_is_keyed_by_the_tile_layout():
    """Noise of element (r, c) is that of offset (tile index) * T**2 + (r % T) * T + c % T, as the
    oracle quantizes the tiles laid out as blocks of T**2 elements."""
    x = planted(rows=64, cols=64)
    got = quantize_mx_tiles(x, "mxfp4", scale_rule="floor", rounding="stochastic", seed=123)[0]
    tiles = x.numpy().reshape(2, T, 2, T).transpose(0, 2, 1, 3).reshape(2, 2, T * T)
    data, scales = mx_oracle.quantize(tiles, "mxfp4", "floor", "stochastic", seed=123, block=T * T)
    codes = np.stack((data & 0xF, data >> 4), -1).reshape(2, 2, T, T).transpose(0, 2, 1, 3).reshape(64, 64)
    want = (codes[:, 0::2] | (codes[:, 1::2] << 4)).astype(np.uint8)
    assert torch.equal(got.data, torch.from_numpy(want))
    assert torch.equal(got.scales, torch.from_numpy(scales.reshape(2, 2)).repeat_interleave(T, 0))


def test_a_non_finite_tile_is_nan_in_both_views_and_others_stay_finite():
    x = torch.randn(64, 64)
    x[40, 3] = float("inf")
    for q in quantize_mx_tiles(x):
        v = q.dequantize()
        assert torch.isnan(v[32:, :32]).all() and torch.isfinite(v[:32]).all() and torch.isfinite(v[:, 32:]).all()


def test_bad_arguments():
    with pytest.raises(ValueError, match="2-D tensor"):
        quantize_mx_tiles(torch.randn(2, 32, 32))
    with pytest.raises(ValueError, match="scale_rule"):
        quantize_mx_tiles(torch.randn(32, 32), scale_rule="round")
