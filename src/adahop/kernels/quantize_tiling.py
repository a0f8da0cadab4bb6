"""Tile shapes of the quantize kernels: launch configuration only, no device code.

Each program quantizes one ``[block_m, block_n]`` tile whose block axis holds whole MX and
Hadamard blocks; the CUDA choices come from the H200 sweep in ``benchmarks/quantize/``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

MAX_WARPS = 32  # 1024 threads, the most a CUDA block can hold


@dataclass(frozen=True)
class QuantizeTiling:
    """Tile shape, warps and register cap of one program; both tile sides are powers of two."""

    block_m: int = 32
    block_n: int = 128
    num_warps: int = 4
    max_registers: int | None = None  # per thread (ptxas' maxnreg); None: the compiler's choice

    def fit(self, min_m: int, min_n: int) -> QuantizeTiling:
        """This tiling grown to at least ``min_m x min_n`` (whole MX and Hadamard blocks).

        The other side shrinks to keep the elements per thread (and so the registers) of the
        configured tile; warps are added only when both sides must grow.
        """
        area = self.block_m * self.block_n
        block_m = max(min_m, area // max(self.block_n, min_n))
        block_n = max(min_n, area // block_m)
        num_warps = min(self.num_warps * block_m * block_n // area, MAX_WARPS)
        return QuantizeTiling(block_m, block_n, num_warps, self.max_registers)


# The interpreter pays milliseconds per program: give each one a large tile.
INTERPRETER_TILING = QuantizeTiling(block_m=128, block_n=256, num_warps=1)
# Per orientation and Hadamard, the tiling with the least round-to-nearest plus stochastic time in
# the H200 sweep benchmarks/quantize/2026-12-03-h200-quantize-sweep.json (the top few of each case
# are within 1-3%, the run-to-run noise); the column-wise tile was set after the sweep, from the
# compiled kernel (benchmarks/quantize/2026-12-05-sm90-colwise-compile.md), and is not timed yet.
# Row-wise MXFP4 (block 32) with a Hadamard or stochastic rounding and column-wise MXFP4 run their
# own kernels, which keep whole blocks in a thread; the column-wise one reads ``block_n`` columns
# of one block of 32 rows, one column per thread (so ``block_n`` is 32 per warp). Two warps: at
# its 48 registers (RN) an SM holds 21 such programs, 42 warps; one-warp programs would stop at
# the 32 programs an SM can hold.
CUDA_TILINGS = {
    ("rowwise", False): QuantizeTiling(block_m=16, block_n=128, num_warps=1),
    ("rowwise", True): QuantizeTiling(block_m=8, block_n=256, num_warps=2),
    ("colwise", False): QuantizeTiling(block_m=32, block_n=64, num_warps=2),
    ("colwise", True): QuantizeTiling(block_m=32, block_n=64, num_warps=2),
    ("both", False): QuantizeTiling(block_m=16, block_n=128, num_warps=1),
    ("both", True): QuantizeTiling(block_m=32, block_n=128, num_warps=4),
}
# With the Hadamard and stochastic rounding, the whole-block kernels are capped at 64 registers
# (32 warps an SM) where ptxas does not spill at 64 (Triton 3.6, sm_90): the row-wise kernel (80
# uncapped with 8-bit noise: 24 warps) and the column-wise one on whole tiles without scores (72 with
# 16-bit noise; 64 uncapped since), the same instructions either way, so a 16384 x 512 dY takes 2
# waves instead of 3. Without the Hadamard the column-wise kernel spills at 64 and takes 72
# (benchmarks/quantize/2026-12-05-sm90-colwise-compile.md, 2026-12-05-sr-noise-sm90.md).
H32_SR_MAX_REGISTERS = 64
# Column-wise cases the general kernel serves (other formats and block sizes): a block must not
# span warps (Triton lays warps along a tile's rows and reduces across them through shared
# memory, several times slower on the H200), so the tile takes one warp.
GENERAL_COLWISE_TILING = QuantizeTiling(block_m=32, block_n=64, num_warps=1)


def default_tiling(orientation: str, device: torch.device, hadamard: bool = False) -> QuantizeTiling:
    """The tiling ``quantize_mx_triton`` uses for ``orientation`` ("rowwise", "colwise", "both")."""
    return CUDA_TILINGS[orientation, hadamard] if device.type == "cuda" else INTERPRETER_TILING
