"""The fused Triton quantizer, bit for bit against ``quantize_mx(hadamard_transform(x))``.

Without a GPU the kernels run in Triton's interpreter (``tests/conftest.py`` sets
``TRITON_INTERPRET=1``); shapes stay small because the interpreter pays per program.
"""

import pytest
import torch
import triton
import triton.language as tl

import mx_oracle

from adahop.formats import ELEMENT_FORMATS, SCALE_RULES, MXTensor, philox, quantize_mx
from adahop.kernels.mx_math import philox_noise
from adahop.kernels.quantize import quantize_mx_triton, quantize_mx_triton_both
from adahop.kernels.quantize_tiling import CUDA_TILINGS, QuantizeTiling
from adahop.transforms.hadamard import (
    HADAMARD_BLOCK_SIZES,
    hadamard_matrix,
    hadamard_transform,
    random_signs,
)

# NaN/Inf blocks run through the element arithmetic before their codes are zeroed; numpy (the
# interpreter) warns about those lanes.
pytestmark = pytest.mark.filterwarnings("ignore:(invalid value|overflow):RuntimeWarning")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SMALL_TILES = QuantizeTiling(block_m=32, block_n=32, num_warps=1)  # many programs, partial tiles


def reference(x, *, axis=-1, hadamard_block_size=0, signs=None, **kwargs) -> MXTensor:
    if hadamard_block_size:
        x = hadamard_transform(x, axis=axis, block_size=hadamard_block_size, signs=signs)
    return quantize_mx(x, axis=axis, **kwargs)


def assert_same(got: MXTensor, want: MXTensor) -> None:
    assert (got.fmt, got.axis, got.block_size, got.shape) == (want.fmt, want.axis, want.block_size, want.shape)
    assert torch.equal(got.scales.cpu(), want.scales), "E8M0 scales differ"
    mismatch = (got.data.cpu() != want.data).sum().item()
    assert mismatch == 0, f"{mismatch} of {want.data.numel()} data bytes differ"


def hard_matrix(rows: int, cols: int, dtype=torch.float32) -> torch.Tensor:
    """Random values over 60 binades, with a zero block, subnormals, a NaN and an Inf block."""
    gen = torch.Generator().manual_seed(rows * cols)
    binades = torch.randint(-30, 30, (rows, 1), generator=gen)
    x = torch.randn(rows, cols, generator=gen) * torch.exp2(binades)
    x[0, :] = 0.0
    x[1, :40] = 1e-39  # float32 subnormals (zero in bfloat16/float16)
    x[2, 5] = float("nan")
    x[3, 33] = float("-inf")
    x[:, 1] = 0.0  # a zero in every block of column-wise blocks in the first tile
    return x.to(dtype)


def check(x: torch.Tensor, tiling: QuantizeTiling | None = None, **kwargs) -> None:
    got = quantize_mx_triton(x.to(DEVICE), tiling=tiling, **kwargs)
    assert_same(got, reference(x, **kwargs))


@pytest.mark.parametrize("fmt", tuple(ELEMENT_FORMATS))
@pytest.mark.parametrize("scale_rule", SCALE_RULES)
@pytest.mark.parametrize("axis", (-1, 0))
def test_round_to_nearest_every_format_and_rule(fmt, scale_rule, axis):
    check(hard_matrix(70, 100), fmt=fmt, scale_rule=scale_rule, axis=axis)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("axis", (-1, 0))
def test_input_dtypes_odd_shapes_and_small_tiles(dtype, axis):
    check(hard_matrix(45, 77, dtype), axis=axis, tiling=SMALL_TILES)


@pytest.mark.parametrize("rounding", ("nearest", "stochastic"))
def test_every_bfloat16_bit_pattern(rounding):
    """All 65536 bfloat16 values (NaN and Inf blocks included), in rows and in columns."""
    x = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    x = x.view(256, 256)
    for axis in (-1, 0):
        check(x, axis=axis, rounding=rounding, seed=3)


def test_e2m1_ties_and_their_neighbours():
    """Every E2M1 midpoint, exactly and one float32 ulp either side, under a block scale of 1."""
    mids = torch.arange(0, 33, dtype=torch.float32) / 4  # 0, 0.25, ..., 8 (every quarter)
    around = torch.stack((mids.nextafter(torch.tensor(-1.0)), mids, mids.nextafter(torch.tensor(9.0))), 1)
    vals = around.flatten()[1:-1]  # 97 values in [0, 8)
    vals = torch.cat((vals, -vals))
    blocks = vals[: len(vals) // 31 * 31].view(-1, 31)
    x = torch.cat((torch.full((len(blocks), 1), 4.0), blocks), 1)  # amax 4 -> scale 2**0
    check(x.contiguous())


def test_saturating_blocks_and_strided_input():
    x = hard_matrix(64, 96)
    x[:, 10] = 7.9 * torch.exp2(torch.arange(64.0) - 32)  # lands in (6, 8) after a floor scale
    for axis in (-1, 0):
        check(x.t(), axis=axis)  # non-contiguous view
        check(x, axis=axis, scale_rule="floor", fmt="mxfp8_e5m2")


@pytest.mark.parametrize("fmt", ("mxfp4", "mxfp8_e4m3"))
@pytest.mark.parametrize("axis", (-1, 0))
@pytest.mark.parametrize("seed", (None, 3, 2**40 + 5, -1))
def test_stochastic_rounding_matches_reference_noise(fmt, axis, seed):
    check(hard_matrix(50, 90), fmt=fmt, axis=axis, rounding="stochastic", seed=seed)


# Every format and scale rule under stochastic rounding, blocks alternately along rows and
# columns (MXFP4 takes the row-wise and the column-wise kernels, FP8 the general one), plus two
# round-to-nearest cases; one interpreter call each (~3 s, most of it fixed cost).
ORACLE_CASES = [
    (fmt, rule, "stochastic", (-1, 0)[i % 2]) for fmt in ELEMENT_FORMATS for i, rule in enumerate(SCALE_RULES)
]
ORACLE_CASES += [("mxfp4", "floor", "nearest", -1), ("mxfp8_e5m2", "even", "nearest", 0)]


@pytest.mark.parametrize("fmt, rule, rounding, axis", ORACLE_CASES)
def test_kernels_bit_exact_with_the_independent_oracle(fmt, rule, rounding, axis):
    """Packed codes and scales equal ``tests/mx_oracle.py``'s (not the reference's) on adversarial
    blocks: power-of-two and binade-edge maxima, elements whose fixed-point steps plus their own
    Philox noise land on or just short of an integer, ties, saturation, zero/NaN/Inf blocks."""
    seed = 2**40 + 9 if rounding == "stochastic" else None
    x = torch.from_numpy(mx_oracle.adversarial_blocks(fmt, rule, 32, 128, seed=seed, rng_seed=5))
    x = x if axis == -1 else x.t()  # the storage layout (the adversarial one) is x either way
    got = quantize_mx_triton(x.to(DEVICE), fmt=fmt, axis=axis, scale_rule=rule, rounding=rounding, seed=seed)
    data, scales = mx_oracle.quantize(x, fmt, rule, rounding, seed, axis=axis)
    assert torch.equal(got.scales.cpu(), torch.from_numpy(scales)), "E8M0 scales differ"
    mismatch = (got.data.cpu().numpy() != data).sum()
    assert mismatch == 0, f"{mismatch} of {data.size} data bytes differ"


@pytest.mark.parametrize("fmt, block_size", [("mxfp4", 2), ("mxfp4", 4), ("mxfp8_e5m2", 1)])
@pytest.mark.parametrize("rounding", ("nearest", "stochastic"))
def test_blocks_smaller_than_a_word_or_a_philox_call(fmt, block_size, rounding):
    """Byte stores where a block is under 32 bits; one Philox call per element under 4 elements."""
    for axis in (-1, 0):
        check(hard_matrix(33, 40), fmt=fmt, block_size=block_size, rounding=rounding, seed=5, axis=axis)


def test_stochastic_rounding_is_seeded():
    x = torch.randn(64, 128, device=DEVICE)
    draw = lambda seed: quantize_mx_triton(x, rounding="stochastic", seed=seed).data
    assert torch.equal(draw(11), draw(11))
    assert not torch.equal(draw(11), draw(12))


@triton.jit
def _philox_noise_kernel(out_ptr, offsets_ptr, seed, N: tl.constexpr):
    i = tl.arange(0, N)
    tl.store(out_ptr + i, philox_noise(seed, tl.load(offsets_ptr + i)).to(tl.int32))


def test_philox_noise_beyond_32_bit_offsets():
    offsets = [0, 1, 2**31, 2**32 - 1, 2**32, 2**32 + 7, 2**40 + 3, 2**33]
    offsets = torch.tensor(offsets, device=DEVICE)
    out = torch.empty(len(offsets), dtype=torch.int32, device=DEVICE)
    _philox_noise_kernel[(1,)](out, offsets, 1234, N=len(offsets))
    assert torch.equal(out.cpu().long(), philox.noise_bits(1234, offsets.cpu()))


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("rounding", ("nearest", "stochastic"))
def test_rowwise_h32_kernel_odd_shapes_and_bad_values(dtype, rounding):
    """The slice-per-thread row-wise H32 kernel: padding, partial tiles, NaN/Inf, subnormals, signs."""
    signs = random_signs(32, seed=9) if rounding == "stochastic" else None
    check(hard_matrix(33, 96, dtype), SMALL_TILES, hadamard_block_size=32, signs=signs, rounding=rounding, seed=21)
    check(hard_matrix(40, 512, dtype), hadamard_block_size=32, signs=signs, rounding=rounding, seed=21)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("rounding", ("nearest", "stochastic"))
def test_colwise_kernel_whole_and_partial_tiles(dtype, rounding):
    """The column-wise MXFP4 kernel with its GPU tile (64 columns): unchecked loads and stores where
    the tiles cover x exactly, masked ones where a tile or a block is partial; NaN/Inf, subnormals, signs."""
    tiling = CUDA_TILINGS["colwise", True]
    signs = random_signs(32, seed=9) if rounding == "stochastic" else None
    for cols in (128, 96):  # 96: a partial last tile
        x = hard_matrix(64, cols, dtype)
        check(x, tiling, axis=0, hadamard_block_size=32, signs=signs, rounding=rounding, seed=21)
    check(hard_matrix(45, 64, dtype), tiling, axis=0, rounding=rounding, seed=21)  # a partial last block


@pytest.mark.parametrize("hadamard_block_size", HADAMARD_BLOCK_SIZES)
@pytest.mark.parametrize("with_signs", (False, True))
def test_hadamard_rowwise_bf16(hadamard_block_size, with_signs):
    signs = random_signs(hadamard_block_size, seed=5) if with_signs else None
    x = hard_matrix(40, 512, torch.bfloat16)
    check(x, hadamard_block_size=hadamard_block_size, signs=signs)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16, torch.float16))
@pytest.mark.parametrize("rounding", ("nearest", "stochastic"))
def test_hadamard_columnwise(dtype, rounding):
    x = hard_matrix(256, 48, dtype)
    signs = random_signs(128, seed=2)
    check(x, axis=0, hadamard_block_size=128, signs=signs, rounding=rounding, seed=9, scale_rule="rceil")


def test_hadamard_with_padding_and_overflow():
    x = hard_matrix(48, 80)  # 80 = 5 Hadamard blocks of 16, padded to 96 for MX
    x[4, :16] = 3e38  # the butterfly overflows to Inf, and Inf - Inf = NaN
    x[5, 16:32] = torch.tensor([3e38, -3e38] * 8)
    for dtype in (torch.float32, torch.bfloat16):
        check(x.to(dtype), hadamard_block_size=16, signs=random_signs(16, seed=1))


@pytest.mark.parametrize("hadamard_block_size", (0, 32))
def test_both_orientations_from_one_read(hadamard_block_size):
    x = hard_matrix(96, 64, torch.bfloat16)
    kwargs = {"scale_rule": "even", "rounding": "stochastic", "seed": 4}
    kwargs["hadamard_block_size"] = hadamard_block_size
    rowwise, colwise = quantize_mx_triton_both(x.to(DEVICE), **kwargs)
    assert_same(rowwise, reference(x, axis=1, **kwargs))
    assert_same(colwise, reference(x, axis=0, **kwargs))


@pytest.mark.parametrize("min_m, min_n", [(1, 32), (1, 256), (128, 1), (128, 128)])
def test_tiling_fit_holds_whole_blocks_at_the_same_work_per_thread(min_m, min_n):
    base = QuantizeTiling(block_m=32, block_n=128, num_warps=4)
    tiling = base.fit(min_m, min_n)
    assert tiling.block_m >= min_m and tiling.block_n >= min_n
    assert tiling.block_m * tiling.block_n // tiling.num_warps == 32 * 128 // 4


@pytest.mark.parametrize("n", HADAMARD_BLOCK_SIZES)
def test_butterfly_reference_is_the_orthonormal_rotation(n):
    """The butterfly that defines ``hadamard_transform`` equals ``v @ H / sqrt(n)`` in float64."""
    v = torch.randint(-1000, 1000, (4, n), dtype=torch.float64)
    h = hadamard_matrix(n, dtype=torch.float64)
    rotated = hadamard_transform(v, block_size=n)
    assert torch.allclose(rotated, (v @ h) / n**0.5, rtol=1e-15, atol=0)
    assert torch.allclose(hadamard_transform(rotated, block_size=n), v, rtol=1e-13, atol=1e-10)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"fmt": "nvfp4"}, "choose one of"),
        ({"axis": 2}, "axis must be one of"),
        ({"block_size": 24}, "power-of-two block_size"),
        ({"hadamard_block_size": 48}, "block_size must be one of"),
        ({"hadamard_block_size": 64}, "not a multiple of block_size 64"),
        ({"signs": torch.ones(32)}, "only used with a hadamard_block_size"),
    ],
)
def test_errors_name_the_valid_choices(kwargs, message):
    with pytest.raises(ValueError, match=message):
        quantize_mx_triton(torch.zeros(32, 96, device=DEVICE), **kwargs)
    with pytest.raises(ValueError, match="2-D"):
        quantize_mx_triton(torch.zeros(2, 32, 32, device=DEVICE))
