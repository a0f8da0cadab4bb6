"""GEMMs of one strategy: operand preparation (transform, extraction, quantization) and the product."""

from ..formats.spec import QuantSpec
from .matmul import tn_matmul
from .operand import GemmOperand, prepare_operand, prepare_weight_tiles

__all__ = ["GemmOperand", "QuantSpec", "prepare_operand", "prepare_weight_tiles", "tn_matmul"]
