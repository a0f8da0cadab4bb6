"""Static sm_90 figures of the top-k selection kernel (``kernels/select.py``), without a GPU.

The selection runs as one program, so its time is latency: the number of dependent passes over the
keys, each ending in a block-wide reduction (``BAR.SYNC`` between the warps), and the instructions
each thread issues. For each score count Triton compiles the kernel for ``sm_90`` with the warps
``top_rows_triton`` picks and prints its registers, shared memory, the instructions and barriers of
the code and of its loop (one pass), and what one call executes for bfloat16 scores (keys from bit
30 down to bit 16: the low 16 bits of a widened bfloat16 are zero) and for float32 scores using
every bit (30 down to 0). Executed counts take every masked store's branch as not taken (an upper
bound). Run it on two trees to compare them (the H200's Triton is 3.6.0):

    env -u TRITON_INTERPRET PYTHONPATH=/tmp/triton36:src python3 benchmarks/quantize/select_sm90.py
"""

from __future__ import annotations

import re
import subprocess
import tempfile

import triton

import adahop.kernels.select as select
from ptx_fingerprint import compile_kernel
from sass_counts import CUOBJDUMP

_INSTRUCTION = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)([^;]*);")
SIZES = (2048, 8192, 16384)


def passes(high_bit: int, low_bit: int) -> int:
    """Loop iterations for keys whose set bits span ``high_bit`` down to ``low_bit``: one per bit
    for the bisection (it always starts at bit 30), one per digit for the radix select."""
    if "DIGIT_BITS" not in select._top_rows_kernel.arg_names:
        return 31 - low_bit
    return (high_bit - low_bit) // select.DIGIT_BITS + 1


def program(cubin: bytes) -> tuple[list[str], list[str]]:
    """The instruction names of the whole program and of its one loop (from the target of the
    branch back to the branch), from ``cuobjdump -sass`` (Triton's own listing is cut short)."""
    ops = []
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        sass = subprocess.run([CUOBJDUMP, "-sass", file.name], capture_output=True, text=True).stdout
    for m in _INSTRUCTION.finditer(sass):
        ops.append((int(m.group(1), 16), m.group(2), m.group(3).strip()))
    loop = next(
        (target, address)
        for address, op, operand in ops
        if op.startswith("BRA") and operand.startswith("0x") and (target := int(operand, 16)) < address
    )
    kept = [(address, op) for address, op, _ in ops if op != "NOP"]  # NOPs: padding
    return [op for _, op in kept], [op for address, op in kept if loop[0] <= address <= loop[1]]


def resources(compiled) -> tuple[int, int]:
    """Registers per thread and stack bytes (spills)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", cubin.name], capture_output=True, text=True).stdout
    return tuple(int(re.search(rf"{key}:(\d+)", out).group(1)) for key in ("REG", "STACK"))


def main() -> None:
    kernel = select._top_rows_kernel
    digits = "DIGIT_BITS" in kernel.arg_names
    print(
        f"triton {triton.__version__}, sm_90, {f'radix select, {select.DIGIT_BITS}-bit digits' if digits else 'bisection'}"
    )
    print(
        "n | warps | regs | stack | smem | instr (loop) | BAR (loop) | bf16 keys: passes, executed instr, BAR | f32: same"
    )
    for n in SIZES:
        warps = 4 if n <= 2048 else 8 if n <= 8192 else 16  # as top_rows_triton picks
        constexprs = {"N_PAD": n} | ({"DIGIT_BITS": select.DIGIT_BITS} if digits else {})
        compiled = compile_kernel(kernel, constexprs, {"num_warps": warps}, {"score_ptr": "*bf16", "out_ptr": "*i64"})
        ops, body = program(compiled.asm["cubin"])
        bars = sum(op.startswith("BAR") for op in ops)
        body_bars = sum(op.startswith("BAR") for op in body)
        regs, stack = resources(compiled)
        row = f"{n} | {warps} | {regs} | {stack} | {compiled.metadata.shared} | {len(ops)} ({len(body)}) | {bars} ({body_bars})"
        for high, low in ((30, 16), (30, 0)):
            p = passes(high, low)
            row += f" | {p}, {len(ops) + (p - 1) * len(body)}, {bars + (p - 1) * body_bars}"
        print(row, flush=True)


if __name__ == "__main__":
    main()
