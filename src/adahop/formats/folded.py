"""MXFP4 folded into FP8: E4M3 values times one float32 scale per row.

Hopper has no FP4 tensor cores but has a row-wise scaled FP8 GEMM, and every E2M1 value times a
block's power of two relative to its row's largest block is exact in E4M3 (``kernels.fold``
says how far down that holds). This is the operand that GEMM takes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .rowwise import RowwiseFP8

FOLD_BLOCK = 32  # the MXFP4 block, also the only Hadamard block the fused kernel takes


def folds_directly(x: torch.Tensor, *, fmt: str, block_size: int, hadamard_block_size: int) -> bool:
    """Whether quantization can write ``x`` straight into a :class:`FoldedFP8` (the fused kernel's
    cases): a row-major 2-D float matrix, MXFP4 with blocks of 32 filling its rows, no Hadamard or
    a 32-point one."""
    return (
        fmt == "mxfp4"
        and block_size == FOLD_BLOCK
        and hadamard_block_size in (0, FOLD_BLOCK)
        and x.dim() == 2
        and x.shape[1] % FOLD_BLOCK == 0
        and x.stride(1) == 1
        and x.dtype in (torch.bfloat16, torch.float16, torch.float32)
    )


@dataclass
class FoldedFP8(RowwiseFP8):
    """An MXFP4 matrix as E4M3 values times a float32 scale per row: a row-wise FP8 operand that
    also counts what folding lost."""

    lossy_per_row: torch.Tensor  # int32 [rows]: elements that underflowed when folding

    @property
    def n_lossy(self) -> int:
        """Elements whose folded value differs from the MXFP4 value (synchronizes on CUDA)."""
        return int(self.lossy_per_row.sum())
