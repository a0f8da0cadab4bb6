"""What the epilogue kernels share on the host: argument checks, outputs, the quantize spec and seed,
all as ``quantize_fold_fp8`` makes them, so the fused kernels write what it writes."""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from adahop.formats.folded import FOLD_BLOCK, FoldedFP8
from adahop.formats.mx import check_quantize_args
from adahop.kernels.launch import INTERPRET, quantize_spec, seed_pointer, zero_seed
from adahop.kernels.quantize_fold import _tile
from adahop.transforms.hadamard import check_hadamard_args


class Epilogue(NamedTuple):
    """A fused kernel's results: the operand, each row's outlier score (``scores=True``) and the BF16
    output the producer would have written (``write_output=True``), else None."""

    folded: FoldedFP8
    scores: torch.Tensor | None
    output: torch.Tensor | None


class FoldLaunch(NamedTuple):
    """The outputs and launch arguments of a fused kernel, as ``quantize_fold_fp8`` prepares them."""

    data: torch.Tensor
    row_scale: torch.Tensor
    lossy: torch.Tensor
    score: torch.Tensor | None
    output: torch.Tensor | None
    signs: torch.Tensor | None
    seed_ptr: torch.Tensor
    hadamard_scale: float
    block_m: int
    block_n: int
    warps: int
    spec: object


def prepare(
    name: str,
    like: torch.Tensor,
    *,
    scale_rule: str,
    rounding: str,
    seed: int | torch.Tensor | None,
    hadamard_block_size: int,
    signs: torch.Tensor | None,
    scores: bool,
    write_output: bool,
) -> FoldLaunch:
    """Check the options (one clear error for what the kernel does not take) and allocate the outputs
    for a bf16 [M, N] result shaped like ``like``."""
    if like.dim() != 2 or like.shape[1] % FOLD_BLOCK or like.stride(1) != 1 or like.shape[1] == 0:
        raise ValueError(
            f"{name} takes row-major 2-D inputs whose rows are whole blocks of {FOLD_BLOCK} elements; "
            f"got shape {tuple(like.shape)}, strides {like.stride()} (make rows a multiple of {FOLD_BLOCK})"
        )
    if hadamard_block_size not in (0, FOLD_BLOCK):
        raise ValueError(f"{name} takes hadamard_block_size 0 or {FOLD_BLOCK}, got {hadamard_block_size}")
    check_quantize_args(like, "mxfp4", FOLD_BLOCK, scale_rule, rounding)
    if hadamard_block_size:
        check_hadamard_args(like.shape[1], hadamard_block_size, signs)
    if not (like.is_cuda or INTERPRET):
        raise RuntimeError(f"{name} runs on CUDA (or under TRITON_INTERPRET=1); use its reference on the CPU")
    M, N = like.shape
    device = like.device
    block_m, block_n, warps = _tile(N, like.is_cuda)
    return FoldLaunch(
        data=torch.empty(M, N, dtype=torch.uint8, device=device),
        row_scale=torch.empty(M, dtype=torch.float32, device=device),
        lossy=torch.empty(M, dtype=torch.int32, device=device),
        score=torch.empty(M, dtype=torch.float32, device=device) if scores else None,
        output=torch.empty(M, N, dtype=torch.bfloat16, device=device) if write_output else None,
        signs=None if signs is None else signs.to(device=device, dtype=torch.float32).contiguous(),
        seed_ptr=seed_pointer(device, seed) if rounding == "stochastic" else zero_seed(device),
        hadamard_scale=1 / math.sqrt(hadamard_block_size) if hadamard_block_size else 1.0,
        block_m=block_m,
        block_n=block_n,
        warps=warps,
        # The quantizer sees the bf16 result, as quantize_fold_fp8 sees the producer's bf16 tensor.
        spec=quantize_spec(
            torch.bfloat16,
            like.is_cuda,
            "mxfp4",
            FOLD_BLOCK,
            scale_rule,
            rounding,
            hadamard_block_size,
            signs is not None,
            scores,
        ),  # fmt: skip
    )


def result(launch: FoldLaunch) -> Epilogue:
    folded = FoldedFP8(launch.data.view(torch.float8_e4m3fn), launch.row_scale, launch.lossy)
    return Epilogue(folded, launch.score, launch.output)
