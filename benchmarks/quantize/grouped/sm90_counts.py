"""sm_90 compile check of the grouped quantize-fold kernel, without a GPU: registers, spills (stack bytes),
static SASS instructions and the width of its global loads, against ``quantize_fold_fp8``'s own kernel.

Compiled with Triton's bundled ``ptxas``, pointers and integer arguments specialized as multiples of 16, as
the JIT does at training shapes. A grouped kernel for one row length (one class) is compared per element with
the per-tensor kernel at that length: the difference is the work table's cost. The grouped kernels of the
presets' weight lists (several classes, one branch each) are checked for registers, spills and 16-byte loads.
Use the GPU machine's Triton (3.6.0 on the H200) or CI's:

    env -u TRITON_INTERPRET PYTHONPATH=/tmp/triton36:src python3 benchmarks/quantize/grouped/sm90_counts.py
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/quantize: sass_counts, epilogue

import torch  # noqa: E402
import triton  # noqa: E402

from adahop.kernels import quantize_fold as qf  # noqa: E402
from adahop.kernels.launch import quantize_spec  # noqa: E402
from epilogue.sm90_counts import FOLD_TYPES, compile_for_sm90  # noqa: E402
from grouped.kernel import _grouped_quantize_fold_kernel  # noqa: E402
from grouped.launcher import WIDE_REGISTERS  # noqa: E402
from grouped.shapes import linear_weight_shapes  # noqa: E402
from sass_counts import per_element, resource_usage  # noqa: E402

GROUPED_TYPES = {"table_ptr": "*i64", "signs_ptr": "*fp32", "out_ptr": "*u8", "row_scale_ptr": "*i32",
                 "lossy_ptr": "*i32", "score_ptr": "*i32", "n_items": "i32", "hadamard_scale": "fp32"}  # fmt: skip
_GLOBAL_LOAD = re.compile(r"\bld\.global(?:\.\w+)*?(\.v[248])?\.(?:b|u|s|f)(\d+)\b")


def load_bytes(compiled) -> Counter:
    """PTX global loads by bytes per load (``ld.global.v4.b32``: 16)."""
    widths = Counter()
    for vector, bits in _GLOBAL_LOAD.findall(compiled.asm["ptx"]):
        widths[int(vector[2:] if vector else 1) * int(bits) // 8] += 1
    return widths


def classes_of(lengths) -> tuple[int, int, int]:
    """(CLASSES bits, ROW_BLOCKS, warps) of a grouped launch over rows of ``lengths`` on CUDA."""
    longest = triton.next_power_of_2(max(lengths))
    rows, _, warps = qf._tile(longest, True)
    classes = 0
    for n in lengths:
        classes |= 1 << ((triton.next_power_of_2(n) // 32).bit_length() - 1)
    return classes, rows * longest // 32, warps


def variants():
    """(name, compiled kernel, elements per program or None) of each kernel compared."""
    presets = {p: sorted({shape[1] for _, shape in linear_weight_shapes(p)}) for p in ("llama3_1b", "llama3_3b")}
    for hb in (0, 32):
        spec = quantize_spec(torch.bfloat16, True, "mxfp4", 32, "floor", "nearest", hb, False, False)
        options = {"maxnreg": qf.MAX_REGISTERS}
        for n in (2048, 8192):
            block_m, block_n, warps = qf._tile(n, True)
            constexprs = dict(BLOCK_M=block_m, BLOCK_N=block_n, SPEC=spec, score_ptr=None)
            compiled = compile_for_sm90(
                qf._quantize_fold_rows_kernel,
                {**FOLD_TYPES, "x_ptr": "*i16"},
                constexprs,
                {**options, "num_warps": warps},
            )
            yield f"quantize_fold_fp8 rows {n} H{hb}", compiled, block_m * block_n
            classes, row_blocks, warps = classes_of([n])
            constexprs = dict(CLASSES=classes, ROW_BLOCKS=row_blocks, PERSISTENT=False, SPEC=spec)
            compiled = compile_for_sm90(
                _grouped_quantize_fold_kernel, GROUPED_TYPES, constexprs, {**options, "num_warps": warps}
            )
            yield f"grouped, rows {n} only H{hb}", compiled, row_blocks * 32
        for preset, lengths in presets.items():
            classes, row_blocks, warps = classes_of(lengths)
            for persistent, registers in ((False, qf.MAX_REGISTERS), (True, qf.MAX_REGISTERS), (False, WIDE_REGISTERS)):
                constexprs = dict(CLASSES=classes, ROW_BLOCKS=row_blocks, PERSISTENT=persistent, SPEC=spec)
                compiled = compile_for_sm90(
                    _grouped_quantize_fold_kernel, GROUPED_TYPES, constexprs, {"maxnreg": registers, "num_warps": warps}
                )
                variant = " persistent" if persistent else f" {registers} reg" if registers != qf.MAX_REGISTERS else ""
                yield f"grouped{variant} {preset} {lengths} H{hb}", compiled, None


def main() -> None:
    print(f"triton {triton.__version__}, sm_90, bf16 in, folded E4M3 out, round to nearest; per program: warps,")
    print("elements; per thread: registers, stack bytes (spills); static SASS instructions (per element where")
    print("one row length); PTX global loads by bytes per load")
    for name, compiled, elements in variants():
        usage = resource_usage(compiled)
        total, _ = per_element(compiled, 32 * compiled.metadata.num_warps)  # instructions per thread
        per_elem = f"{total * 32 * compiled.metadata.num_warps / elements:6.2f}/elem" if elements else " " * 11
        loads = " ".join(f"{b}B x{k}" for b, k in sorted(load_bytes(compiled).items()))
        print(f"{name:<44} w{compiled.metadata.num_warps:<2} | reg {usage['REG']:3d} stack {usage['STACK']:3d} | "
              f"{total:5.0f} instr {per_elem} | loads {loads}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
