"""Orthogonal transforms applied along a GEMM's contraction dimension."""

from .hadamard import HADAMARD_BLOCK_SIZES, hadamard_matrix, hadamard_rotation, hadamard_transform, random_signs

__all__ = ["HADAMARD_BLOCK_SIZES", "hadamard_matrix", "hadamard_rotation", "hadamard_transform", "random_signs"]
