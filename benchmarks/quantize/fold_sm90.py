"""The fold kernel compiled for sm_90 on the CPU: registers, spills, loop sizes and grids per operand.

For every operand ``adahop.ops.fold_fp8`` folds in a ``llama3_1b`` (8 x 2048 tokens) and ``llama3_3b``
(4 x 2048) step under uniform IHT (wgrad's dYᵀ and Xᵀ with K = tokens, dgrad's Wᵀ with K = out), the
launch ``fold_to_fp8`` makes on an H200 (132 SMs): its tile, its grid and the grid in waves of resident
programs (``kernels.fold.RESIDENT_PROGRAMS_PER_SM`` a SM), then each distinct compiled variant's
registers and spills (``ptxas -v``, the ptxas Triton bundles) and the SASS instructions of each loop body
in code order (the scale scan, the normal fold, the exact fold), with the fold loops' instructions per
element. Static counts, not timings: nothing here ran on a GPU.

    env -u TRITON_INTERPRET PYTHONPATH=src python benchmarks/quantize/fold_sm90.py

Counts depend on the Triton version (this machine's 3.9; the H200's 3.6).
"""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import triton
from triton.compiler import ASTSource

from adahop.kernels import fold
from ptx_fingerprint import PACKED_FOLD_POINTERS, SM90  # this folder's script: the same kernel, its pointer types

H200_SMS = 132
ELEMENTS_PER_PIECE = 2 * fold.PIECE_BYTES
# (model, tokens, dim, ffn, kv_dim) of the presets at the bench's batch.
MODELS = (("llama3_1b 8x2048", 16384, 2048, 8192, 512), ("llama3_3b 4x2048", 8192, 3072, 8192, 1024))


def operands(tokens: int, dim: int, ffn: int, kv: int) -> list[tuple[str, int, int]]:
    """(name, rows, K) of the folded operands of one block, distinct shapes only."""
    linears = {"wq": (dim, dim), "wk": (dim, kv), "wo": (dim, dim), "w1": (dim, ffn), "w2": (ffn, dim)}
    shapes = {}
    for name, (n_in, n_out) in linears.items():
        shapes.setdefault((n_out, tokens), f"{name} dYᵀ")
        shapes.setdefault((n_in, tokens), f"{name} Xᵀ")
        shapes.setdefault((n_in, n_out), f"{name} Wᵀ")
    return [(label, rows, k) for (rows, k), label in shapes.items()]


def launch(rows: int, k: int) -> tuple[fold.FoldConfig, tuple[int, int]]:
    """The config and grid ``fold_to_fp8`` picks for an H200."""
    row_pieces = k // ELEMENTS_PER_PIECE
    config = fold.fold_plan(rows, row_pieces, H200_SMS)
    return config, fold.fold_grid(rows, row_pieces, config)[1]


def compile_variant(config: fold.FoldConfig, split: bool):
    names = fold._fold_kernel.arg_names
    constexprs = dict(
        HALF_BLOCK=16, BLOCK_R=config.block_r, CHUNK=config.chunk, SCALE_CHUNK=config.scale_chunk, SPLIT=split
    )
    signature = {n: "constexpr" if n in constexprs else PACKED_FOLD_POINTERS.get(n, "i32") for n in names}
    source = ASTSource(fold._fold_kernel, signature, constexprs={(names.index(n),): v for n, v in constexprs.items()})
    options = {"num_warps": config.num_warps, "maxnreg": config.max_registers}
    return triton.compile(source, target=SM90, options=options)


def ptxas_usage(ptx: str) -> str:
    """ptxas' register and spill line for the kernel's PTX (the bundled ptxas that reads its PTX
    version: Triton 3.9 writes PTX 9.x, which only its ``ptxas-blackwell`` (CUDA 13) reads)."""
    bin_dir = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "fold.ptx"
        path.write_text(ptx)
        for ptxas in ("ptxas", "ptxas-blackwell"):
            run = subprocess.run(
                [str(bin_dir / ptxas), "-arch=sm_90a", "-v", str(path), "-o", str(Path(tmp) / "fold.cubin")],
                capture_output=True,
                text=True,
            )
            if run.returncode == 0:
                break
        else:
            raise RuntimeError(run.stderr)
    out = run.stderr
    used = re.search(r"Used (\d+) registers", out)
    spills = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", out)
    stack = re.search(r"(\d+) bytes stack frame", out)
    return (
        f"{used.group(1)} registers, {stack.group(1)} B stack, spills {spills.group(1)} B out / {spills.group(2)} B in"
    )


def loop_bodies(sass: str) -> list[tuple[int, int]]:
    """(instructions, local-memory spill accesses) of each loop body (a label and the branch back
    to it) in code order, leaving out the one-instruction trap loop after the exit."""
    lines = sass.splitlines()
    labels, bodies = {}, []
    for i, line in enumerate(lines):
        if m := re.match(r"^(\w+):$", line.strip()):
            labels[m.group(1)] = i
        elif (m := re.search(r"BRA (\w+);", line)) and m.group(1) in labels and labels[m.group(1)] < i:
            body = [b for b in lines[labels[m.group(1)] + 1 : i + 1] if re.match(r"^[0-9a-f-]{2}:", b.strip())]
            body = [b for b in body if "NOP" not in b]
            if len(body) > 1:
                bodies.append((len(body), sum(1 for b in body if re.search(r"\b(LDL|STL)\b", b))))
    return bodies


def main() -> None:
    print(f"triton {triton.__version__}, sm_90, {H200_SMS} SMs, a wave = {fold.RESIDENT_PROGRAMS_PER_SM} programs a SM")
    print()
    print("| model | operand | rows x K | block_r x chunk | parts | grid | waves |")
    print("|---|---|---|---|---:|---|---:|")
    variants = {}
    for model, tokens, dim, ffn, kv in MODELS:
        for label, rows, k in operands(tokens, dim, ffn, kv):
            config, grid = launch(rows, k)
            variants[config.block_r, config.chunk, grid[1] > 1] = config
            waves = grid[0] * grid[1] / (H200_SMS * fold.RESIDENT_PROGRAMS_PER_SM)
            print(
                f"| {model} | {label} | {rows} x {k} | {config.block_r} x {config.chunk} | {grid[1]} "
                f"| {grid[0]} x {grid[1]} = {grid[0] * grid[1]} | {waves:.2f} |"
            )
    print()
    print("| block_r x chunk, split | ptxas | loop bodies (instructions) | fold loops: instructions / element |")
    print("|---|---|---|---|")
    for (_, _, split), config in sorted(variants.items()):
        compiled = compile_variant(config, split)
        bodies = loop_bodies(compiled.asm["sass"])
        elements_per_thread = config.block_r * config.chunk * ELEMENTS_PER_PIECE / (32 * config.num_warps)
        per_element = ", ".join(f"{n / elements_per_thread:.1f}" for n, _ in bodies[1:])
        loops = ", ".join(f"{n} ({spills} spill)" if spills else str(n) for n, spills in bodies)
        print(
            f"| {config.block_r} x {config.chunk}{', split' if split else ''} | {ptxas_usage(compiled.asm['ptx'])} "
            f"| {loops} | {per_element} |"
        )


if __name__ == "__main__":
    main()
