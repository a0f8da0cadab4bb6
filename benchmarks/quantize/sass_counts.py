"""Static sm_90 resources and instruction counts per element of the quantize kernels, without a GPU.

For each bf16 MXFP4 launch that ``quantize_mx_triton`` and ``quantize_fold_fp8`` pick (the variants of
``ptx_fingerprint.py``, at a shape whose tiles cover the tensor), Triton compiles the kernel for
``sm_90`` with the ``ptxas`` it bundles, specialized as the JIT does at training shapes (pointers and
sizes multiples of 16). The script prints the registers per thread (they set the occupancy), the
stack (spilled registers), the shared memory and barriers (a layout change through shared memory),
and the instructions of one program (no loops in these kernels; both sides of a branch, such as the
fused fold's rare exact path, are counted) divided by the elements it handles:
the quantizer is bound by the instructions it issues and by the latency its occupancy can hide, so
these predict its speed before a GPU run. They depend on the Triton version: use the GPU machine's
(3.6.0 on the H200 here), e.g.

    python -m venv --system-site-packages /tmp/t36 && /tmp/t36/bin/pip install triton==3.6.0
    env -u TRITON_INTERPRET PYTHONPATH=src /tmp/t36/bin/python benchmarks/quantize/sass_counts.py

``--fingerprint`` prints a hash of each variant's SASS instead (every ``ptx_fingerprint.py`` variant): a refactor
that moves kernel code into a device function can add empty labels to the PTX (the inlined call's blocks), which
``ptxas`` erases; equal SASS hashes before and after show the GPU runs the same code.
"""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter

import triton

from ptx_fingerprint import compile_kernel, variants

_INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z0-9_.]+)")
CUOBJDUMP = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")


def resource_usage(compiled) -> dict[str, int]:
    """Registers per thread and stack bytes (spills) from ``cuobjdump --dump-resource-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        out = subprocess.run([CUOBJDUMP, "--dump-resource-usage", cubin.name], capture_output=True, text=True).stdout
    return {key: int(re.search(rf"{key}:(\d+)", out).group(1)) for key in ("REG", "STACK")}


def sass_of(compiled) -> str:
    """``cuobjdump -sass`` of the cubin, not ``compiled.asm["sass"]``: Triton's disassembly parser
    (``tools/disasm.py``, 3.6) matches 4-digit addresses only, so it stops at the 4096th instruction of a
    longer kernel."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(compiled.asm["cubin"])
        cubin.flush()
        return subprocess.run([CUOBJDUMP, "-sass", cubin.name], capture_output=True, text=True, check=True).stdout


def per_element(compiled, elements_per_program: int) -> tuple[float, Counter]:
    """Static SASS instructions per element, and per opcode."""
    ops = Counter()
    sass = sass_of(compiled)
    for line in sass.splitlines():
        if m := _INSTRUCTION.match(line):
            ops[m.group(1).split(".")[0]] += 1
    ops.pop("NOP", None)
    threads = 32 * compiled.metadata.num_warps
    return sum(ops.values()) * threads / elements_per_program, ops


def fingerprints() -> None:
    """A hash of each variant's SASS (instructions and their encodings, in order): where a refactor changes the
    PTX only in ways ptxas erases (an inlined call's empty label), the code the GPU runs is unchanged."""
    for name, kernel, constexprs, options, pointers in variants():
        code = "\n".join(line for line in sass_of(compile_kernel(kernel, constexprs, options, pointers)).splitlines()
                         if _INSTRUCTION.match(line))  # fmt: skip
        print(f"{name}: {hashlib.sha256(code.encode()).hexdigest()[:16]} ({len(code)} chars)")


def main() -> None:
    if "--fingerprint" in sys.argv:
        fingerprints()
        return
    print(f"triton {triton.__version__}, sm_90, bf16 in, MXFP4 out; per program: warps, elements;")
    print("per thread: registers, stack bytes; shared memory bytes, barriers; instructions per element")
    for name, kernel, constexprs, options, pointers in variants():
        if "BLOCK_N" not in constexprs:
            continue  # the fold of packed MXFP4: not a quantize kernel
        compiled = compile_kernel(kernel, constexprs, options, pointers, aligned=True)
        elements = constexprs.get("BLOCK_M", 32) * constexprs["BLOCK_N"]  # the column-wise kernel: 32 rows
        total, ops = per_element(compiled, elements)
        usage = resource_usage(compiled)
        barriers = ops["BAR"]
        warps = compiled.metadata.num_warps
        top = ", ".join(f"{op} {n * 32 * warps / elements:.1f}" for op, n in ops.most_common(5))
        print(
            f"{name:<58} w{warps} {elements:5d} | reg {usage['REG']:3d} stack {usage['STACK']:3d} "
            f"smem {compiled.metadata.shared:5d} bar {barriers} | {total:5.1f}  {top}"
        )


if __name__ == "__main__":
    main()
