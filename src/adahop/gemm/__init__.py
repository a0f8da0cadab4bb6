"""GEMMs of one strategy: operand preparation (transform, extraction, quantization) and the product."""

from .matmul import tn_matmul
from .operand import GemmOperand, QuantSpec, prepare_operand

__all__ = ["GemmOperand", "QuantSpec", "prepare_operand", "tn_matmul"]
