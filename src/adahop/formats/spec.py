"""``QuantSpec``: how one tensor is quantized, the single object every layer above passes on.

A recipe turns into specs once per layer (``Recipe.quant_spec``); operand preparation hands a
spec to ``adahop.ops``, which flattens it into the primitive arguments of its custom ops (a
``torch.library`` schema takes no dataclasses). Its defaults are the library's defaults:
``Recipe`` takes its own from here.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class QuantSpec:
    """MX format, block size, scale rule, rounding and inner Hadamard transform of one tensor.

    ``hadamard_block_size`` 0 means no transform (the one convention from here to the kernels).
    ``hadamard_signs`` (random-sign variant) is a tensor, so it stays out of equality and hashing.
    """

    fmt: str | None = "mxfp4"  # None keeps the tensor in high precision (transform-only ablations)
    block_size: int = 32
    scale_rule: str = "floor"  # E8M0 scale of every MX block (formats.scales)
    rounding: str = "nearest"
    hadamard_block_size: int = 32
    hadamard_signs: torch.Tensor | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.hadamard_signs is not None and not self.hadamard_block_size:
            raise ValueError("hadamard_signs are only used with a hadamard_block_size")
        # Built once here, not per GEMM: strategies that skip the transform ask for it every call.
        plain = (
            self
            if not self.hadamard_block_size
            else dataclasses.replace(self, hadamard_block_size=0, hadamard_signs=None)
        )
        object.__setattr__(self, "_unrotated", plain)

    @property
    def unrotated(self) -> QuantSpec:
        """This spec without the Hadamard transform (and so without its signs)."""
        return self._unrotated


DEFAULT_SPEC = QuantSpec()
