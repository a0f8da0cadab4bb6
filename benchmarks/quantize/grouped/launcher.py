"""The host side of the grouped quantize-fold: argument checks, the work table and the output buffers, built
once for a list of tensors (``plan_grouped_fold``), then one launch per call of ``GroupedFold.launch``.

The table holds the tensors' addresses, so a plan is for those tensors as they are: launching again
quantizes their current values (as a captured CUDA graph does), and the plan keeps them alive. The outputs are
views of one buffer per field (E4M3 bytes, row scales, lossy counts, scores), a ``FoldedFP8`` per tensor.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import triton

from adahop.formats.folded import FOLD_BLOCK, FoldedFP8
from adahop.formats.mx import check_quantize_args
from adahop.kernels.launch import INTERPRET, cdiv, quantize_spec
from adahop.kernels.quantize_fold import MAX_REGISTERS, _tile
from adahop.transforms.hadamard import check_hadamard_args

from .kernel import MAX_CLASS, _grouped_quantize_fold_kernel, work_item

NAME = "grouped_quantize_fold_fp8"
MAX_COLS = FOLD_BLOCK << MAX_CLASS.value  # the longest row a class covers
# A register cap where Triton 3.6 does not spill the grouped kernel at the presets' row lengths
# (sm90_counts.py; at 80 it spills 8-24 bytes a thread): 2 programs of 8 warps an SM instead of 3.
WIDE_REGISTERS = 96


@dataclass
class GroupedFold:
    """One grouped launch, prepared: ``launch()`` writes ``outputs`` (and ``scores``) from ``tensors``."""

    tensors: tuple[torch.Tensor, ...]  # kept alive: the table holds their addresses
    outputs: list[FoldedFP8]
    scores: list[torch.Tensor] | None
    table: torch.Tensor  # [items, FIELDS] int64
    buffers: tuple[torch.Tensor, ...]  # E4M3 bytes, row scales (as int32 bits), lossy counts, scores
    signs: torch.Tensor | None
    programs: int
    persistent: bool  # programs loop over the items (else one item each)
    max_registers: int  # ptxas' per-thread cap
    hadamard_scale: float
    classes: int
    row_blocks: int
    warps: int
    spec: object

    @property
    def items(self) -> int:
        return self.table.shape[0]

    def launch(self) -> None:
        if not self.items:
            return
        data, row_scale, lossy, score = self.buffers
        _grouped_quantize_fold_kernel[(self.programs,)](
            self.table,
            data if self.signs is None else self.signs,  # read only with signs
            data,
            row_scale,
            lossy,
            row_scale if score is None else score,  # written only with scores
            self.items,
            self.hadamard_scale,
            CLASSES=self.classes,
            ROW_BLOCKS=self.row_blocks,
            PERSISTENT=self.persistent,
            SPEC=self.spec,
            num_warps=self.warps,
            maxnreg=self.max_registers,
        )


def check_inputs(tensors: Sequence[torch.Tensor]) -> None:
    """One line for what the kernel does not take: it reads row-major bf16 matrices whose rows are whole
    blocks of 32, from 16-byte aligned addresses, all on one CUDA device (or the CPU under the interpreter)."""
    if isinstance(tensors, torch.Tensor) or not tensors:
        raise ValueError(f"{NAME} takes a non-empty list of 2-D tensors, got {type(tensors).__name__}")
    device = tensors[0].device if isinstance(tensors[0], torch.Tensor) else None
    for i, x in enumerate(tensors):
        problem = None
        if not isinstance(x, torch.Tensor):
            problem = f"is a {type(x).__name__}"
        elif x.dtype != torch.bfloat16 or x.dim() != 2:
            problem = f"has dtype {x.dtype} and {x.dim()} dimensions (cast it to a 2-D bfloat16 tensor)"
        elif not x.is_contiguous():
            problem = f"has strides {x.stride()} (pass x.contiguous())"
        elif x.data_ptr() % 16:
            problem = f"starts {x.data_ptr() % 16} bytes past a 16-byte boundary (pass x.clone())"
        elif x.shape[1] % FOLD_BLOCK or not 0 < x.shape[1] <= MAX_COLS:
            problem = f"has {x.shape[1]} columns (rows must be whole blocks of {FOLD_BLOCK}, at most {MAX_COLS})"
        elif x.device != device:
            problem = f"is on {x.device}, tensor 0 on {device} (one launch runs on one device)"
        elif not (x.is_cuda or INTERPRET):
            problem = "is on the CPU (the kernel runs on CUDA, or under TRITON_INTERPRET=1)"
        if problem:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else ""
            raise ValueError(f"{NAME}: tensor {i} {shape} {problem}")


def plan_grouped_fold(
    tensors: Sequence[torch.Tensor],
    *,
    scale_rule: str = "floor",
    hadamard_block_size: int = 0,
    signs: torch.Tensor | None = None,
    scores: bool = False,
    programs: int | None = None,
    max_registers: int = MAX_REGISTERS,
) -> GroupedFold:
    """The grouped launch of ``quantize_fold_fp8(x, scale_rule=..., rounding="nearest", ...)`` over
    ``tensors``; ``programs``: a persistent grid of that many programs looping over the work items,
    instead of one program per item; ``max_registers``: the per-thread register cap (the per-tensor kernel's by
    default). Round to nearest only: W needs no Philox key."""
    check_inputs(tensors)
    x0 = tensors[0]
    check_quantize_args(x0, "mxfp4", FOLD_BLOCK, scale_rule, "nearest")
    if hadamard_block_size not in (0, FOLD_BLOCK):
        raise ValueError(f"{NAME} takes hadamard_block_size 0 or {FOLD_BLOCK}, got {hadamard_block_size}")
    if hadamard_block_size:
        check_hadamard_args(FOLD_BLOCK, hadamard_block_size, signs)
    if programs is not None and programs <= 0:
        raise ValueError(f"{NAME}: programs must be positive (or None: one per work item), got {programs}")
    device, on_cuda = x0.device, x0.is_cuda
    # One block of 32 per thread, as the per-tensor kernel: its warps for the longest row set the program's
    # size, and shorter rows share a program (the interpreter, which pays per program, takes many rows).
    longest = triton.next_power_of_2(max(x.shape[1] for x in tensors))
    rows_of_longest, _, warps = _tile(longest, on_cuda)
    row_blocks = rows_of_longest * longest // FOLD_BLOCK
    items, classes, data_offset, row_offset = [], 0, 0, 0
    for x in tensors:
        M, N = x.shape
        item_class = (triton.next_power_of_2(N) // FOLD_BLOCK).bit_length() - 1
        block_m = cdiv(row_blocks, 1 << item_class)
        items += [work_item(x.data_ptr(), data_offset, row_offset, r, M, N, item_class) for r in range(0, M, block_m)]
        classes |= 1 << item_class
        data_offset, row_offset = data_offset + M * N, row_offset + M
    data = torch.empty(data_offset, dtype=torch.uint8, device=device)
    row_scale = torch.empty(row_offset, dtype=torch.float32, device=device)
    lossy = torch.empty(row_offset, dtype=torch.int32, device=device)
    score = torch.empty(row_offset, dtype=torch.float32, device=device) if scores else None
    outputs, score_views, data_offset, row_offset = [], [], 0, 0
    for x in tensors:
        M, N = x.shape
        rows = slice(row_offset, row_offset + M)
        view = data[data_offset : data_offset + M * N].view(M, N).view(torch.float8_e4m3fn)
        outputs.append(FoldedFP8(view, row_scale[rows], lossy[rows]))
        score_views.append(None if score is None else score[rows])
        data_offset, row_offset = data_offset + M * N, row_offset + M
    table = torch.tensor(items, dtype=torch.int64).reshape(len(items), -1).to(device)
    return GroupedFold(
        tensors=tuple(tensors),
        outputs=outputs,
        scores=score_views if scores else None,
        table=table,
        buffers=(data, row_scale.view(torch.int32), lossy, score),
        signs=None if signs is None else signs.to(device=device, dtype=torch.float32).contiguous(),
        programs=len(items) if programs is None else min(programs, len(items)),
        persistent=programs is not None,
        max_registers=max_registers,
        hadamard_scale=1 / math.sqrt(hadamard_block_size) if hadamard_block_size else 1.0,
        classes=classes,
        row_blocks=row_blocks,
        warps=warps,
        spec=quantize_spec(
            torch.bfloat16,
            on_cuda,
            "mxfp4",
            FOLD_BLOCK,
            scale_rule,
            "nearest",
            hadamard_block_size,
            signs is not None,
            scores,
        ),  # fmt: skip
    )


def grouped_quantize_fold_fp8(
    tensors: Sequence[torch.Tensor], **options
) -> list[FoldedFP8] | tuple[list[FoldedFP8], list[torch.Tensor]]:
    """``[quantize_fold_fp8(x, **options) for x in tensors]`` in one launch (``plan_grouped_fold``'s options);
    with ``scores=True`` also each tensor's row scores."""
    plan = plan_grouped_fold(tensors, **options)
    plan.launch()
    return (plan.outputs, plan.scores) if plan.scores is not None else plan.outputs
