"""Outlier-row selection: the rule (``policy.selection``) against Python's own sort, and the
Triton kernel bit for bit against the rule (interpreter on CPU, native on the GPU)."""

import math

import pytest
import torch

from adahop import ops
from adahop.kernels.select import top_rows_triton
from adahop.policy.selection import top_rows_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def oracle(scores: torch.Tensor, k: int) -> list[int]:
    """Largest first, NaN above all, equal scores in row order; then ascending rows."""
    values = [abs(v) for v in scores.tolist()]
    key = [(0, 0.0, i) if math.isnan(v) else (1, -v, i) for i, v in enumerate(values)]
    return sorted(i for *_, i in sorted(key)[:k])


def scores_with_ties(n: int, seed: int) -> torch.Tensor:
    """Few distinct values (ties everywhere), zeros, Inf, NaN, -0.0 and bf16-rounded maxima."""
    g = torch.Generator().manual_seed(seed)
    s = torch.randint(0, 6, (n,), generator=g).float() * torch.rand((), generator=g).add(0.5)
    s = s.bfloat16().float()
    special = torch.randint(0, n, (3,), generator=g)
    s[special[0]], s[special[1]] = float("inf"), -0.0
    if seed % 2:
        s[special[2]] = float("nan")
    return s


@pytest.mark.parametrize("n, k", [(1, 1), (7, 3), (64, 64), (100, 1), (1000, 64), (4096, 64), (8192, 256)])
def test_reference_is_the_rule(n, k):
    for seed in range(3):
        s = scores_with_ties(n, seed)
        assert top_rows_reference(s, k).tolist() == oracle(s, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("n, k", [(1, 1), (7, 3), (33, 32), (64, 64), (1000, 64), (8192, 64), (12288, 100)])
def test_kernel_equals_reference(n, k, dtype):
    """In every score dtype (the kernel bisects only the bits a bfloat16 or float16 score can set)."""
    for seed in range(2):
        s = scores_with_ties(n, seed).to(dtype).to(DEVICE)
        assert torch.equal(top_rows_triton(s, k).cpu(), top_rows_reference(s.cpu(), k))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_kernel_on_distinct_scores(dtype):
    """Random scores over many binades (every bit of the key matters), the dtype's largest
    value and its smallest subnormal."""
    g = torch.Generator().manual_seed(5)
    s = (torch.rand(5000, generator=g) * torch.exp2(torch.randint(-20, 12, (5000,), generator=g).float())).to(dtype)
    s[17], s[18] = torch.finfo(dtype).max, torch.finfo(dtype).smallest_normal / 4
    got = top_rows_triton(s.to(DEVICE), 64).cpu()
    assert torch.equal(got, top_rows_reference(s, 64)) and 17 in got.tolist()
    assert torch.equal(top_rows_triton(s.to(DEVICE), 4999).cpu(), top_rows_reference(s, 4999))


def test_op_routes_agree_and_errors_say_what_is_wrong():
    s = scores_with_ties(300, 1)
    assert torch.equal(ops.top_rows(s.to(DEVICE), 10).cpu(), top_rows_reference(s, 10))
    with pytest.raises(ValueError, match="0 < k <= 300"):
        top_rows_reference(s, 301)
    with pytest.raises(ValueError, match="1-D float32, bfloat16 or float16"):
        top_rows_reference(s.double(), 3)
