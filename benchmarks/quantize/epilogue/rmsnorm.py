"""RMSNorm computed and quantized straight into the folded FP8 operand of the next GEMMs (wq/wk/wv or
w1/w3's X) in one pass, optionally also writing the bf16 X.

``models.llama.RMSNorm`` is ``(xf * rsqrt(mean(xf**2) + eps)).type_as(x) * weight`` with
``xf = x.float()``; the linear layer then casts its input to bf16 (autocast), so X is
``bf16(round_to(h.dtype, xf * r) * weight)`` for float32 or bf16 ``h`` and ``weight``. Two of its
roundings are not pinned down by eager PyTorch: the mean's summation order (a device's reduction
tree) and ``rsqrt`` (CUDA's ``rsqrtf`` is approximate). This prototype's spec, the same on the CPU and
the GPU, fixes both: the squares summed as a complete binary tree over the row in order (adjacent
pairs first, zeros past N up to a power of two), an IEEE division by N, and ``r = 1 / sqrt(ms + eps)``
with an IEEE square root and division (``eps`` as float32). ``rmsnorm_reference`` is that spec in
PyTorch; how often it differs from eager's RMSNorm is measured, not assumed
(tests/test_epilogue_prototype.py, ``epilogue_ab.py``). The quantization is ``quantize_fold_fp8``'s
own device code, so the operand is ``quantize_fold_fp8(rmsnorm_reference(h, weight, eps))``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from adahop.kernels.mx_math import bf16_bits_to_float, round_to_bf16
from adahop.kernels.quantize_fold import MAX_REGISTERS, quantize_fold_fp8

from .device import bf16_bits, quantize_fold_slices, slice_offsets
from .launch import Epilogue, prepare, result


@triton.jit
def _load_float(ptr, offs, ok, IS_BF16: tl.constexpr):
    if IS_BF16:
        return bf16_bits_to_float(tl.load(ptr + offs, mask=ok, other=0))
    return tl.load(ptr + offs, mask=ok, other=0.0)


@triton.jit
def _halve(t):
    """Sum adjacent pairs along the last axis: [R, L] -> [R, L / 2]."""
    R: tl.constexpr = t.shape[0]
    L: tl.constexpr = t.shape[1]
    a, b = tl.split(tl.reshape(t, [R, L // 2, 2]))
    return a + b


@triton.jit
def _slice_tree(sq):
    """[R, NB, 8] -> [R, NB]: each slice's 8 values summed as a binary tree, adjacent pairs first."""
    R: tl.constexpr = sq.shape[0]
    NB: tl.constexpr = sq.shape[1]
    t = tl.reshape(sq, [R * NB, 8])
    t = _halve(_halve(_halve(t)))
    return tl.reshape(t, [R, NB])


@triton.jit
def _row_tree(t, LEVELS: tl.constexpr):
    """[R, 2**LEVELS] -> [R]: the binary tree over the row, in order."""
    for _ in tl.static_range(LEVELS):
        t = _halve(t)
    return tl.reshape(t, [t.shape[0]])


@triton.jit
def _normalized_slice(xk, wk, r, out_ptr, offs, ok, H_BF16: tl.constexpr, WRITE: tl.constexpr, NATIVE: tl.constexpr):
    """X's bf16 bits for one slice: ``round_to(h.dtype, xf * r) * weight`` rounded to bf16."""
    y = xk * r[:, None, None]
    if H_BF16:  # .type_as(x)
        y = round_to_bf16(y, NATIVE)
    bits = bf16_bits(y * wk[None, :, :], NATIVE)
    if WRITE:
        tl.store(out_ptr + offs, bits, mask=ok)
    return bits


@triton.jit
def _rmsnorm_quantize_fold_kernel(
    h_ptr,
    weight_ptr,
    x_ptr,
    signs_ptr,
    out_ptr,
    row_scale_ptr,
    lossy_ptr,
    score_ptr,
    M,
    N,
    stride_m,
    eps,
    seed_ptr,
    hadamard_scale,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPEC: tl.constexpr,
    H_BF16: tl.constexpr,
    W_BF16: tl.constexpr,
    WRITE_X: tl.constexpr,
):
    NB: tl.constexpr = BLOCK_N // 32
    NATIVE: tl.constexpr = SPEC.native_casts
    seed = tl.load(seed_ptr)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    blocks = tl.arange(0, NB)
    o0, k0 = slice_offsets(rows, blocks, M, N, stride_m, 0)
    o1, k1 = slice_offsets(rows, blocks, M, N, stride_m, 1)
    o2, k2 = slice_offsets(rows, blocks, M, N, stride_m, 2)
    o3, k3 = slice_offsets(rows, blocks, M, N, stride_m, 3)
    h0 = _load_float(h_ptr, o0, k0, H_BF16)
    h1 = _load_float(h_ptr, o1, k1, H_BF16)
    h2 = _load_float(h_ptr, o2, k2, H_BF16)
    h3 = _load_float(h_ptr, o3, k3, H_BF16)
    # Squares summed in the spec's tree: within each slice, over the block's four slices, over the row.
    s0, s1 = _slice_tree(h0 * h0), _slice_tree(h1 * h1)
    s2, s3 = _slice_tree(h2 * h2), _slice_tree(h3 * h3)
    total = _row_tree((s0 + s1) + (s2 + s3), LEVELS=NB.bit_length() - 1)
    ms = tl.div_rn(total, N.to(tl.float32))
    r = tl.div_rn(1.0, tl.sqrt_rn(ms + eps))

    # The weight's slices ([NB, 8], the same for every row), and X = the model's output cast to bf16.
    w_offs, w_ok = slice_offsets(tl.zeros([1], tl.int32), blocks, 1, N, 0, 0)
    w0 = tl.reshape(_load_float(weight_ptr, w_offs, w_ok, W_BF16), [NB, 8])
    w1 = tl.reshape(_load_float(weight_ptr, w_offs + 8, w_ok, W_BF16), [NB, 8])
    w2 = tl.reshape(_load_float(weight_ptr, w_offs + 16, w_ok, W_BF16), [NB, 8])
    w3 = tl.reshape(_load_float(weight_ptr, w_offs + 24, w_ok, W_BF16), [NB, 8])
    x_offs = (rows.to(tl.int64) * N)[:, None, None] + ((blocks * 32)[None, :, None] + tl.arange(0, 8)[None, None, :])
    x0 = _normalized_slice(h0, w0, r, x_ptr, x_offs, k0, H_BF16, WRITE_X, NATIVE)
    x1 = _normalized_slice(h1, w1, r, x_ptr, x_offs + 8, k1, H_BF16, WRITE_X, NATIVE)
    x2 = _normalized_slice(h2, w2, r, x_ptr, x_offs + 16, k2, H_BF16, WRITE_X, NATIVE)
    x3 = _normalized_slice(h3, w3, r, x_ptr, x_offs + 24, k3, H_BF16, WRITE_X, NATIVE)
    quantize_fold_slices(
        x0, x1, x2, x3, rows, blocks, M, N, seed, signs_ptr, hadamard_scale,
        out_ptr, row_scale_ptr, lossy_ptr, score_ptr, SPEC,
    )  # fmt: skip


def rmsnorm_quantize_fold(
    h: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    *,
    scale_rule: str = "floor",
    rounding: str = "nearest",
    seed: int | torch.Tensor | None = None,
    hadamard_block_size: int = 0,
    signs: torch.Tensor | None = None,
    scores: bool = False,
    write_output: bool = False,
) -> Epilogue:
    """``quantize_fold_fp8(rmsnorm_reference(h, weight, eps), ...)`` for [M, N] ``h`` and [N] ``weight``
    (float32 or bf16 each) in one kernel; ``write_output``: also the bf16 X (``Epilogue.output``)."""
    kinds = (torch.float32, torch.bfloat16)
    if h.dtype not in kinds or weight.dtype not in kinds or weight.shape != h.shape[-1:] or h.dim() != 2:
        raise ValueError(
            f"rmsnorm_quantize_fold takes h [M, N] and weight [N], each float32 or bf16; got h {h.dtype} "
            f"{tuple(h.shape)}, weight {weight.dtype} {tuple(weight.shape)}"
        )
    launch = prepare(
        "rmsnorm_quantize_fold", h, scale_rule=scale_rule, rounding=rounding, seed=seed,
        hadamard_block_size=hadamard_block_size, signs=signs, scores=scores, write_output=write_output,
    )  # fmt: skip
    M, N = h.shape
    h_bf16, w_bf16 = h.dtype == torch.bfloat16, weight.dtype == torch.bfloat16
    _rmsnorm_quantize_fold_kernel[(triton.cdiv(M, launch.block_m),)](
        h.view(torch.int16) if h_bf16 else h,
        weight.contiguous().view(torch.int16) if w_bf16 else weight.contiguous(),
        None if launch.output is None else launch.output.view(torch.int16),
        h if launch.signs is None else launch.signs,
        launch.data,
        launch.row_scale.view(torch.int32),
        launch.lossy,
        launch.score,
        M,
        N,
        h.stride(0),
        eps,
        launch.seed_ptr,
        launch.hadamard_scale,
        BLOCK_M=launch.block_m,
        BLOCK_N=launch.block_n,
        SPEC=launch.spec,
        H_BF16=h_bf16,
        W_BF16=w_bf16,
        WRITE_X=write_output,
        num_warps=launch.warps,
        maxnreg=MAX_REGISTERS,
        enable_fp_fusion=False,  # no square contracted into the tree's adds: the spec rounds each
    )
    return result(launch)


def tree_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over the last axis as a complete binary tree in order (adjacent pairs first), zero-padded
    to a power of two: the spec's order, whatever the device."""
    n = t.shape[-1]
    t = torch.nn.functional.pad(t, (0, triton.next_power_of_2(n) - n))
    while t.shape[-1] > 1:
        t = t[..., 0::2] + t[..., 1::2]
    return t[..., 0]


def rmsnorm_reference(h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """The spec (module docstring): the model's RMSNorm with its sum order and rsqrt pinned down, then
    the linear layer's cast to bf16."""
    xf = h.float()
    ms = tree_sum(xf * xf) / xf.shape[-1]
    r = 1 / torch.sqrt(ms + torch.tensor(eps, dtype=torch.float32, device=h.device))
    return ((xf * r[..., None]).type_as(h) * weight).to(torch.bfloat16)


def rmsnorm_quantize_fold_reference(h: torch.Tensor, weight: torch.Tensor, eps: float, **options) -> Epilogue:
    """The composition the fused kernel replaces: the RMSNorm spec, then ``quantize_fold_fp8``."""
    write = options.pop("write_output", False)
    x = rmsnorm_reference(h, weight, eps)
    out = quantize_fold_fp8(x, **options)
    folded, score = out if options.get("scores") else (out, None)
    return Epilogue(folded, score, x if write else None)
