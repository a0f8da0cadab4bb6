"""Outlier-row selection: the rule (``policy.selection``) against Python's own sort, and the
Triton kernel bit for bit against the rule (interpreter on CPU, native on the GPU)."""

import math

import pytest
import torch
import triton

from adahop import ops
from adahop.kernels.select import DIGIT_BITS, _top_rows_kernel, top_rows_triton
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
    """In every score dtype (the kernel bisects only down to the lowest bit some score sets)."""
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


def full_precision_ties(n: int, seed: int) -> torch.Tensor:
    """Ties among float32 values that use every mantissa bit (bf16-rounded ties leave the low
    16 bits of every key zero, so the bisection's last steps never matter there), half of them
    next to a value one ulp below (keys that differ in the lowest bit only), random signs."""
    g = torch.Generator().manual_seed(seed)
    values = torch.rand(4, generator=g) + 0.5
    values = torch.cat([values, torch.nextafter(values, torch.zeros(()))])  # one ulp below each
    s = values[torch.randint(0, len(values), (n,), generator=g)]
    return torch.where(torch.rand(n, generator=g) < 0.5, -s, s)


def kernel_writes(s: torch.Tensor, k: int) -> torch.Tensor:
    """The kernel launched on an output of n + 8 slots preset to -7: what it writes past slot k
    shows (``top_rows_triton`` gives it exactly k, where a stray write corrupts memory)."""
    out = torch.full((s.numel() + 8,), -7, dtype=torch.int64, device=DEVICE)
    n_pad = triton.next_power_of_2(s.numel())
    _top_rows_kernel[(1,)](s.to(DEVICE).contiguous(), out, s.numel(), k, N_PAD=n_pad, DIGIT_BITS=DIGIT_BITS)
    return out.cpu()


@pytest.mark.parametrize("n, k", [(2, 1), (40, 7), (1000, 64), (1000, 500)])
def test_ties_in_every_bit_and_negative_scores(n, k):
    """The rule ranks |score| (the kernel drops the sign bit); ties and one-ulp neighbours
    across the k-th place, on keys whose lowest bit is set."""
    for seed in range(3):
        s = full_precision_ties(n, seed)
        ref = top_rows_reference(s, k)
        assert ref.tolist() == oracle(s, k)
        out = kernel_writes(s, k)
        assert torch.equal(out[:k], ref) and (out[k:] == -7).all()


def test_by_hand_magnitudes_ties_and_neighbours():
    by_hand = torch.tensor([-5.0, 1.0, 3.0, -3.0, float.fromhex("0x1.000002p0"), float.fromhex("-0x1.000002p0")])
    assert top_rows_reference(by_hand, 1).tolist() == [0] and top_rows_reference(by_hand, 2).tolist() == [0, 2]
    # |1 + 2**-23| twice (an odd key) tied across the 4th place, 1.0 (one ulp below) left out
    assert top_rows_reference(by_hand, 4).tolist() == [0, 2, 3, 4]
    for k in range(1, 7):
        out = kernel_writes(by_hand, k)
        assert torch.equal(out[:k], top_rows_reference(by_hand, k)) and (out[k:] == -7).all()


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5, 6])
def test_nans_of_any_payload_tie(k):
    """Every NaN ranks equal (the rule sorts them so): NaNs of different payloads and signs,
    with the k-th place among them, go by row order, not by their bits."""
    patterns = [0x3F800000, 0x7FC00001, 0x7F800000, 0xFFC00000, 0x7F800001, 0x7FFFFFFF, 0x00000000]
    s = torch.tensor(patterns, dtype=torch.int64).to(torch.int32).view(torch.float32)
    ref = top_rows_reference(s, k)
    assert ref.tolist() == oracle(s, k)
    out = kernel_writes(s, k)
    assert torch.equal(out[:k], ref) and (out[k:] == -7).all()


def test_op_routes_agree_and_errors_say_what_is_wrong():
    s = scores_with_ties(300, 1)
    assert torch.equal(ops.top_rows(s.to(DEVICE), 10).cpu(), top_rows_reference(s, 10))
    with pytest.raises(ValueError, match="0 < k <= 300"):
        top_rows_reference(s, 301)
    with pytest.raises(ValueError, match="1-D float32, bfloat16 or float16"):
        top_rows_reference(s.double(), 3)


def check_kernel(s: torch.Tensor, k: int) -> None:
    ref = top_rows_reference(s, k)
    out = kernel_writes(s, k)
    assert torch.equal(out[:k], ref) and (out[k:] == -7).all(), (s, k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_k_on_small_adversarial_vectors(dtype):
    """Every k from 1 to n, n not a power of two: all keys equal, all zero (+0 and -0), NaNs of
    both signs, infinities, a subnormal, and runs of equal values across the k-th place."""
    # A subnormal, but the interpreter flushes bfloat16 subnormals to zero when it widens them
    # (the GPU's conversion is exact): the smallest normal there.
    tiny = torch.finfo(dtype).smallest_normal / (1 if dtype == torch.bfloat16 else 8)
    nan, inf = float("nan"), float("inf")
    vectors = [
        [2.5] * 7,
        [0.0, -0.0, 0.0, -0.0, 0.0],
        [nan, 1.0, -nan, inf, -inf, 1.0, 0.0, tiny, -tiny],
        [3.0, 3.0, 1.0, 3.0, 1.0, 1.0, 3.0, 0.0, 1.0, 3.0, 3.0],
        [tiny, 0.0, tiny, -tiny, 0.0, tiny],
    ]
    for values in vectors:
        s = torch.tensor(values).to(dtype)
        for k in range(1, len(values) + 1):
            check_kernel(s, k)


def test_keys_that_differ_only_in_low_bits():
    """float32 scores one ulp apart around every digit boundary of the radix select (the low bits
    decide, and the highest key bit set is below bit 30), ties among them, k at every place."""
    base = torch.tensor(1.0).view(torch.int32)
    offsets = torch.tensor([0, 1, 31, 32, 33, 1023, 1024, 1, 32, 0, 1025, 31])
    s = (base + offsets).to(torch.int32).view(torch.float32)
    for k in range(1, len(offsets) + 1):
        check_kernel(s, k)
        check_kernel(s / 1024, k)  # below 2.0: key bit 30 clear
    g = torch.Generator().manual_seed(3)
    bits = torch.randint(0, 1 << 10, (1000,), generator=g, dtype=torch.int32)  # subnormals: keys < 2**10
    for k in (1, 64, 999, 1000):
        check_kernel(bits.view(torch.float32), k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_many_ties_at_the_threshold(dtype):
    """Thousands of equal scores straddle the k-th place among random ones (n = 3000, not a
    power of two), with the largest few distinct."""
    g = torch.Generator().manual_seed(11)
    s = torch.rand(3000, generator=g)
    s[torch.randperm(3000, generator=g)[:2000]] = 0.5
    s[:5] = torch.tensor([9.0, 8.0, 7.0, 8.0, 9.0])
    s = s.to(dtype)
    for k in (1, 5, 6, 64, 1500, 2999, 3000):
        check_kernel(s, k)


@pytest.mark.parametrize("n", [32768, 40000])
def test_largest_vectors_all_tied(n):
    """Counts at the edges of the ranking scan: up to 32,768 scores it packs the rows above and
    the ties in 16 bits each (a count of 32,768 sets the sign bit), beyond that it scans them
    apart. Every score equal, then all but three."""
    s = torch.full((n,), 3.0)
    check_kernel(s, n - 1)  # the last row's tie count is n: it must be left out
    s[[5, n // 2, n - 1]] = torch.tensor([4.0, 5.0, float("nan")])
    check_kernel(s, n - 2)
