"""The grouped quantize-fold kernel: each program takes one row tile of one tensor from a work table and runs
``quantize_fold_fp8``'s own device code on it (``row_blocks``, ``store_folded_rows``), so there is no second
copy of the math and each tensor's rows come out exactly as its own launch writes them.

A fold needs whole rows in a program, and a program's tile shape is a compile-time constant, so the row
lengths of one launch are sorted into classes by their padded length (``BLOCK_N``, a power of two): each class
is one branch of the kernel with its own tile, ``ceil(ROW_BLOCKS / NB)`` rows of ``NB`` blocks, and a work
item names its class. Every class keeps one block of 32 per thread, as the per-tensor kernel does, so a
program of 8 warps holds one row of 8192, four of 2048 or sixteen of 512.
"""

from __future__ import annotations

import triton
import triton.language as tl

from adahop.kernels.quantize_blocks import row_blocks
from adahop.kernels.quantize_fold import store_folded_rows

FIELDS = tl.constexpr(8)  # int64 fields per work item: 64 bytes, one cache line
MAX_CLASS = tl.constexpr(10)  # the longest class: log2(NB), NB = BLOCK_N / 32 blocks of a padded row; rows up to 32768


def work_item(
    x_address: int, data_offset: int, row_offset: int, row_start: int, rows: int, cols: int, item_class: int
) -> list[int]:
    """One row of the work table, in the order the kernel reads its fields."""
    return [x_address, data_offset, row_offset, row_start, rows, cols, item_class, 0]


@triton.jit
def _quantize_fold_item(
    table_ptr, item, signs_ptr, out_ptr, row_scale_ptr, lossy_ptr, score_ptr, hadamard_scale,
    CLASSES: tl.constexpr, ROW_BLOCKS: tl.constexpr, SPEC: tl.constexpr,
):  # fmt: skip
    """Work item ``item``: quantize-fold its rows of its tensor with its class's tile."""
    fields = table_ptr + item * FIELDS  # items * FIELDS < 2**31
    # Tensors start 16-byte aligned and rows are whole blocks of 32 (checked on the host): the hints keep the
    # per-tensor kernel's 16-byte loads, which it gets from the JIT's specialization of its arguments.
    x_ptr = tl.multiple_of(tl.load(fields + 0).to(tl.pointer_type(tl.int16)), 16)
    data_offset = tl.multiple_of(tl.load(fields + 1), 32)
    row_offset = tl.load(fields + 2)
    row_start = tl.load(fields + 3).to(tl.int32)
    M = tl.load(fields + 4).to(tl.int32)
    N = tl.multiple_of(tl.load(fields + 5).to(tl.int32), 32)
    item_class = tl.load(fields + 6).to(tl.int32)
    for c in tl.static_range(MAX_CLASS + 1):
        if (CLASSES >> c) & 1:
            if item_class == c:
                NB: tl.constexpr = 1 << c
                BLOCK_M: tl.constexpr = (ROW_BLOCKS + NB - 1) // NB
                rows = row_start + tl.arange(0, BLOCK_M)
                blocks = tl.arange(0, NB)
                v0, v1, v2, v3, inv_scale, limit, sign_weight, scale_codes, score = row_blocks(
                    x_ptr, signs_ptr, rows, blocks, M, N, N, hadamard_scale, SPEC
                )
                store_folded_rows(
                    v0, v1, v2, v3, inv_scale, limit, sign_weight, scale_codes, score,
                    rows, blocks, M, N, 0, out_ptr + data_offset, row_scale_ptr + row_offset,
                    lossy_ptr + row_offset, score_ptr + row_offset, SPEC,
                )  # fmt: skip


@triton.jit
def _grouped_quantize_fold_kernel(
    table_ptr,
    signs_ptr,
    out_ptr,
    row_scale_ptr,
    lossy_ptr,
    score_ptr,
    n_items,
    hadamard_scale,
    CLASSES: tl.constexpr,
    ROW_BLOCKS: tl.constexpr,
    PERSISTENT: tl.constexpr,
    SPEC: tl.constexpr,
):
    """Work item ``program_id`` of the table, or with ``PERSISTENT`` items ``program_id, program_id +
    num_programs, ...`` (``work_item``): quantize-fold ``rows`` rows of the tensor at ``x_address`` (bf16
    bits) from ``row_start``, into the output buffers at ``data_offset`` (bytes) and ``row_offset`` (rows). ``CLASSES``:
    a bit per log2(NB) in the table, so that only their branches are compiled."""
    if PERSISTENT:
        for item in range(tl.program_id(0), n_items, tl.num_programs(0)):
            _quantize_fold_item(
                table_ptr, item, signs_ptr, out_ptr, row_scale_ptr, lossy_ptr, score_ptr, hadamard_scale,
                CLASSES, ROW_BLOCKS, SPEC,
            )  # fmt: skip
    else:
        _quantize_fold_item(
            table_ptr, tl.program_id(0), signs_ptr, out_ptr, row_scale_ptr, lossy_ptr, score_ptr, hadamard_scale,
            CLASSES, ROW_BLOCKS, SPEC,
        )  # fmt: skip
