"""Issue #30's lever "Hadamard on the tensor cores": the grid spec, its prototype kernels, and what they cost.

``grid_hadamard/spec.py`` is the spec (today's transform of grid-rounded blocks, exact in any summation
order), ``grid_hadamard/kernels.py`` the prototype MXFP4 quantizers whose 32-point Hadamard is a bfloat16
``tl.dot``. Modes:

    PYTHONPATH=src python benchmarks/quantize/hadamard_tensor_cores.py --out $OUT      # GPU: time and check
    PYTHONPATH=src python benchmarks/quantize/hadamard_tensor_cores.py --dry-run       # CPU, interpreter
    env -u TRITON_INTERPRET PYTHONPATH=/tmp/triton36:src python benchmarks/quantize/hadamard_tensor_cores.py --compile
    PYTHONPATH=src python benchmarks/quantize/hadamard_tensor_cores.py --changes       # CPU: grid vs today's spec

The GPU mode times today's row-/column-wise kernels (``quantize_mx_triton``, hadamard 32) against the
prototype at ``llama3_1b`` 8 x 2048's shapes, both rounding modes: each timed launch sequence is a CUDA
graph over enough input copies to exceed L2, timed by CUDA events; median and range of repeats, achieved
TB/s (bf16 read, MXFP4 codes and E8M0 scales written). Before timing it checks each prototype output bit
for bit against ``quantize_mx(grid_hadamard_transform(x))`` (and the float64 oracle), and a tensor of
special blocks (NaN, Inf, zeros, ties, tiny and huge maxima). ``--dry-run`` runs the same path on tiny
shapes in Triton's interpreter, with wall-clock timing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

if "--dry-run" in sys.argv:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402

from adahop.bench.common import graph_seconds_per_launch  # noqa: E402
from adahop.formats.mx import MXTensor, quantize_mx  # noqa: E402
from adahop.kernels.quantize import quantize_launch  # noqa: E402
from adahop.transforms.hadamard import hadamard_transform, random_signs  # noqa: E402
from grid_hadamard.kernels import grid_launch  # noqa: E402
from grid_hadamard.spec import grid_hadamard_oracle, grid_hadamard_transform, grid_round  # noqa: E402

# llama3_1b at 8 x 2048 tokens: X and dY of the projections (dim 2048, hidden 8192, K/V 512), Xᵀ-like.
GPU_SHAPES = {"x 16384x2048": (16384, 2048), "dy 16384x8192": (16384, 8192), "dy_kv 16384x512": (16384, 512),
              "xT 2048x16384": (2048, 16384)}  # fmt: skip
DRY_SHAPES = {"tiny 64x128": (64, 128)}
L2_BYTES = 60 << 20  # H100 50 MB, H200 60 MB: the graph cycles through more input than this, twice
SEED = 1234
# Prototype tilings timed (row-wise: block_m x block_n, warps; column-wise: block_n columns, warps).
GRID_TILINGS = {
    1: (dict(block_m=8, block_n=256, num_warps=2), dict(block_m=16, block_n=256, num_warps=4)),
    0: (dict(block_n=64, num_warps=2), dict(block_n=128, num_warps=4)),
}


def storage_bytes(m: int, n: int) -> int:
    """bf16 in, MXFP4 codes and E8M0 scales out."""
    return m * n * 2 + m * n // 2 + m * n // 32


def reference(x: torch.Tensor, axis: int, rounding: str, signs: torch.Tensor | None, oracle: bool = False) -> MXTensor:
    transform = grid_hadamard_oracle if oracle else grid_hadamard_transform
    return quantize_mx(transform(x, axis=axis, signs=signs), axis=axis, rounding=rounding, seed=SEED)


def same(a: MXTensor, b: MXTensor) -> bool:
    return torch.equal(a.data, b.data) and torch.equal(a.scales, b.scales)


def special_blocks(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """64 x 256 of blocks (32 along either axis) that stress the spec: NaN, +-Inf, zeros and -0, exact
    ties on the grid, subnormal, tiny (< 2**-100) and huge (>= 2**119 and just below) maxima, and
    sums that need every bit down to the grid unit."""
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(64, 256, generator=gen, dtype=torch.float64)
    x[:32, :32], x[32:, 32:64], x[:, 64:96] = float("nan"), float("inf"), 0.0
    x[7, 70], x[40, 75] = -0.0, float("-inf")
    x[:32, 96:128] = torch.randint(-4, 5, (32, 32), generator=gen) * 2.0**-16 + 0.5 * 2.0**-15  # grid ties
    x[:32, 96], x[32:, 96] = 1.0, -1.0
    big = 2.0 ** (15 if dtype == torch.float16 else 118)
    x[:, 128:160] *= 2.0 ** (-24 if dtype == torch.float16 else -130)
    x[:, 160:192] *= 2.0 ** (-14 if dtype == torch.float16 else -105)
    x[:32, 192:224] = x[:32, 192:224].sign() * big * 1.9  # maxima just below 2**119 (bf16/fp32)
    x[32:, 192:224] = x[32:, 192:224] * big * 4  # 2**120 and more: NaN blocks
    # Widest sums: 31 values of 255/128 (8 bits) and one grid unit per row and per column block, so a
    # sum needs all 21 bits down to the unit: an accumulator that kept fewer would drop it.
    x[:32, 224:256] = torch.where(torch.eye(32, dtype=torch.bool), 2.0**-15, 255 / 128)
    if dtype == torch.float16:
        x = torch.where(x.isfinite(), x.clamp(-65504, 65504), x)
    return x.to(device=device, dtype=dtype)


def check(shapes: dict, device: torch.device, dtypes: tuple, tilings: int) -> list[dict]:
    """Bit-exactness of the prototype against the reference and the oracle: the special blocks in every
    dtype, ``shapes`` (random, row scales spread over e**N(0, 1)) in bfloat16, the first of them in every
    dtype; bfloat16 in the first ``tilings`` tilings, float16 and float32 in the first."""
    results = []
    gen = torch.Generator().manual_seed(0)
    signs = random_signs(32, 5, device=device)
    for dtype in dtypes:
        inputs = {"special": special_blocks(dtype, device)}
        for name, (m, n) in list(shapes.items())[: None if dtype == torch.bfloat16 else 1]:
            inputs[name] = (torch.randn(m, n, generator=gen) * torch.randn(m, 1, generator=gen).exp()).to(device, dtype)
        for name, x in inputs.items():
            for axis in (1, 0):
                for rounding in ("nearest", "stochastic"):
                    want = reference(x, axis, rounding, signs)
                    oracle = reference(x, axis, rounding, signs, oracle=True)
                    for tiles in GRID_TILINGS[axis][: tilings if dtype == torch.bfloat16 else 1]:
                        row = dict(dtype=str(dtype), input=name, axis=axis, rounding=rounding, tiles=tiles)
                        try:  # one call on the GPU: a failure is recorded, the rest still runs
                            kernel, grid, args, out = grid_launch(
                                x, axis=axis, rounding=rounding, seed=SEED, signs=signs, **tiles
                            )
                            kernel[grid](**args)
                            row.update(exact=same(out, want), exact_oracle=same(out, oracle))
                        except Exception as error:
                            row.update(exact=False, exact_oracle=False, error=repr(error)[:500])
                        print(f"check {row}", flush=True)
                        results.append(row)
    return results


def today_call(x: torch.Tensor, axis: int, rounding: str, signs: torch.Tensor, seed: torch.Tensor):
    launch = quantize_launch(x, "mxfp4", rowwise=axis == 1, colwise=axis == 0, block_size=32, scale_rule="floor",
                             rounding=rounding, seed=seed, hadamard_block_size=32, signs=signs, scores=False,
                             tiling=None)  # fmt: skip
    return lambda: launch.kernel[launch.grid](**launch.arguments)


def grid_call(x: torch.Tensor, axis: int, rounding: str, signs: torch.Tensor, seed: torch.Tensor, **tiles):
    kernel, grid, args, _ = grid_launch(x, axis=axis, rounding=rounding, seed=seed, signs=signs, **tiles)
    return lambda: kernel[grid](**args)


def time_all(shapes: dict, device: torch.device, repeats: int, tilings: int) -> list[dict]:
    on_cuda = device.type == "cuda"
    signs = random_signs(32, 5, device=device)
    seed = torch.tensor(SEED, dtype=torch.int64, device=device)
    gen = torch.Generator().manual_seed(1)
    results = []
    for name, (m, n) in shapes.items():
        copies = max(1, -(-2 * L2_BYTES // (m * n * 2))) if on_cuda else 1
        xs = [torch.randn(m, n, generator=gen).to(device, torch.bfloat16) for _ in range(copies)]
        for axis in (1, 0):
            for rounding in ("nearest", "stochastic"):
                variants = {"today": [today_call(x, axis, rounding, signs, seed) for x in xs]}
                for tiles in GRID_TILINGS[axis][:tilings]:
                    label = "grid " + "x".join(str(v) for v in tiles.values())
                    variants[label] = [grid_call(x, axis, rounding, signs, seed, **tiles) for x in xs]
                for label, launches in variants.items():
                    try:
                        times = graph_seconds_per_launch(launches, repeats, on_cuda)
                    except Exception as error:
                        print(f"{name} axis {axis} {rounding} {label}: {error!r}", flush=True)
                        results.append(
                            dict(shape=name, axis=axis, rounding=rounding, kernel=label, error=repr(error)[:500])
                        )
                        continue
                    median = statistics.median(times)
                    row = dict(shape=name, axis=axis, rounding=rounding, kernel=label, copies=copies,
                               median_us=median * 1e6, min_us=min(times) * 1e6, max_us=max(times) * 1e6,
                               tb_per_s=storage_bytes(m, n) / median / 1e12)  # fmt: skip
                    print(f"{name:<16} {'row' if axis else 'col'} {rounding:<10} {label:<16} {row['median_us']:9.1f} us "
                          f"[{row['min_us']:.1f}, {row['max_us']:.1f}]  {row['tb_per_s']:.2f} TB/s", flush=True)  # fmt: skip
                    results.append(row)
        del xs
    return results


def run(args) -> int:
    device = torch.device("cpu" if args.dry_run else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run on the CPU (Triton's interpreter)", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else None
    info = dict(torch=torch.__version__, device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu")
    import triton

    info["triton"] = triton.__version__
    print(info, flush=True)
    shapes = DRY_SHAPES if args.dry_run else GPU_SHAPES
    dtypes = (torch.bfloat16,) if args.dry_run else (torch.bfloat16, torch.float16, torch.float32)
    tilings = 1 if args.dry_run else len(GRID_TILINGS[0])  # warps mean nothing in the interpreter
    checks = check({} if args.dry_run else shapes, device, dtypes, tilings)
    exact = all(c["exact"] and c["exact_oracle"] for c in checks)
    print(f"bit-exact: {exact} ({sum(c['exact'] and c['exact_oracle'] for c in checks)}/{len(checks)} cases)")
    save(out, dict(info=info, checks=checks))
    timings = time_all(shapes, device, repeats=1 if args.dry_run else args.repeats, tilings=tilings)
    save(out, dict(info=info, checks=checks, timings=timings))
    return 0 if exact else 1


def save(out: Path | None, results: dict) -> None:
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        tmp = out / "hadamard_tensor_cores.json.tmp"
        tmp.write_text(json.dumps(results, indent=1, default=str))
        tmp.replace(out / "hadamard_tensor_cores.json")


def compile_figures() -> None:
    """sm_90 registers, spills, shared memory, barriers and SASS instructions per element: today's
    row-/column-wise H32 kernels (as their launch plans pick them) against the prototype's tilings."""
    from ptx_fingerprint import POINTERS, compile_kernel, variants
    from sass_counts import per_element, resource_usage

    from adahop.kernels.launch import quantize_spec
    from grid_hadamard.kernels import _grid_cols_kernel, _grid_rows_kernel

    def show(name, compiled, elements):
        total, ops = per_element(compiled, elements)
        threads = 32 * compiled.metadata.num_warps
        usage = resource_usage(compiled)
        top = ", ".join(f"{op} {k * threads / elements:.1f}" for op, k in ops.most_common(7))
        print(f"{name:<44} w{compiled.metadata.num_warps} {elements:5d} | reg {usage['REG']:3d} stack {usage['STACK']:3d} "
              f"smem {compiled.metadata.shared:5d} bar {ops['BAR']:2d} | {total:5.1f}  {top}")  # fmt: skip

    import triton

    print(f"triton {triton.__version__}, sm_90, bf16 in, MXFP4 out, 32-point Hadamard, no signs, 256 x 512 tiles:")
    print("per thread registers, stack bytes; shared memory bytes, barriers; SASS instructions per element")
    for name, kernel, constexprs, options, pointers in variants():
        today = kernel.__name__ in ("_quantize_rows_kernel", "_quantize_cols_kernel")
        if today and name.endswith("hadamard 32"):  # without scores
            compiled = compile_kernel(kernel, constexprs, options, pointers, aligned=True)
            elements = constexprs.get("BLOCK_M", 32) * constexprs["BLOCK_N"]
            show("today " + " ".join(name.split()[1:3]), compiled, elements)
    pointers = {**POINTERS, "h_ptr": "*bf16"}
    for rounding in ("nearest", "stochastic"):
        spec = quantize_spec(torch.bfloat16, True, "mxfp4", 32, "floor", rounding, 32, False, False)
        for tiles in GRID_TILINGS[1]:
            constexprs = dict(BLOCK_M=tiles["block_m"], BLOCK_N=tiles["block_n"], SPEC=spec)
            compiled = compile_kernel(_grid_rows_kernel, constexprs, {"num_warps": tiles["num_warps"]}, pointers, True)
            show(
                f"grid rowwise {rounding} {tiles['block_m']}x{tiles['block_n']}",
                compiled,
                tiles["block_m"] * tiles["block_n"],
            )
        for tiles in GRID_TILINGS[0]:
            constexprs = dict(STRIDE_M=512, BLOCK_N=tiles["block_n"], SPEC=spec)
            compiled = compile_kernel(_grid_cols_kernel, constexprs, {"num_warps": tiles["num_warps"]}, pointers, True)
            show(f"grid colwise {rounding} 32x{tiles['block_n']}", compiled, 32 * tiles["block_n"])


def linear_tensors() -> dict[str, torch.Tensor]:
    """X, W and dY of every projection of the repository's ``tiny`` Llama (random init, bf16, CPU), one
    forward and backward on random tokens: the operands the quantizer sees, blocks along ``in``/tokens."""
    from adahop.models.llama import build_model

    torch.manual_seed(0)
    model = build_model("tiny").to(torch.bfloat16)
    tensors = {}

    def keep(name):
        def forward_hook(module, inputs, output):
            tensors[f"{name} X"] = inputs[0].detach().flatten(0, -2)

        def backward_hook(module, grad_input, grad_output):
            tensors[f"{name} dY"] = grad_output[0].detach().flatten(0, -2)

        return forward_hook, backward_hook

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.startswith("layers."):
            forward_hook, backward_hook = keep(name)
            module.register_forward_hook(forward_hook)
            module.register_full_backward_hook(backward_hook)
            tensors[f"{name} W"] = module.weight.detach()
    tokens = torch.randint(0, model.args.vocab_size, (4, 256))
    _, loss = model(tokens, targets=torch.roll(tokens, -1, 1))
    loss.backward()
    return tensors


def changes() -> None:
    """How often and how much the grid changes today's results: bf16 inputs, blocks of 32 along the last
    axis. Inputs the grid moves; Hadamard outputs (bf16) that differ, the share of those one bf16 ulp
    apart and the largest difference relative to its block's maximum output; MXFP4 codes and scales
    (nearest) that differ; and, before the rounding to bf16, each spec's RMS error against the exact
    transform relative to the RMS output (float32 today: about 2**-24; the grid: about 2**-17)."""
    gen = torch.Generator().manual_seed(3)
    synthetic = {
        "gaussian": torch.randn(4096, 1024, generator=gen),
        "student-t nu=3": torch.distributions.StudentT(3.0).sample((4096, 1024)),
        "student-t nu=1.5": torch.distributions.StudentT(1.5).sample((4096, 1024)),
        "outlier channels x100": torch.randn(4096, 1024, generator=gen) * torch.where(torch.rand(1024, generator=gen) < 0.01, 100.0, 1.0),
        "lognormal sigma=3": torch.randn(4096, 1024, generator=gen) * (torch.randn(4096, 1024, generator=gen) * 3).exp(),
    }  # fmt: skip
    groups = {k: [v.to(torch.bfloat16)] for k, v in synthetic.items()}
    for name, t in linear_tensors().items():
        groups.setdefault(f"tiny llama {name.split()[-1]}", []).append(t.contiguous())
    print("bf16, blocks of 32 along the last axis; fractions of elements (codes: of MXFP4 codes; scales: of blocks)")
    print(f"{'tensors':<22} {'inputs moved':>12} {'H out differ':>12} {'1 ulp':>6} {'max/blockmax':>12} "
          f"{'codes differ':>12} {'scales differ':>13} {'f32 err today':>13} {'f32 err grid':>12}")  # fmt: skip
    for name, tensors in groups.items():
        moved = differ = one_ulp = codes = scales = total = blocks = 0
        worst, err = 0.0, {"today": 0.0, "grid": 0.0, "norm": 0.0}
        for x in tensors:
            today, grid = hadamard_transform(x), grid_hadamard_transform(x)
            moved += (grid_round(x) != x).sum().item()
            diff = today != grid
            differ += diff.sum().item()
            bits = (today.view(torch.int16).int() - grid.view(torch.int16).int()).abs()
            one_ulp += (diff & (bits == 1) & (today.sign() == grid.sign())).sum().item()
            block_max = today.float().abs().unflatten(-1, (-1, 32)).amax(-1, keepdim=True)
            delta = (today.float() - grid.float()).abs().unflatten(-1, (-1, 32)) / block_max
            worst = max(worst, delta.nan_to_num(0.0).max().item())
            q_today, q_grid = quantize_mx(today), quantize_mx(grid)
            codes += (q_today.codes() != q_grid.codes()).sum().item()
            scales += (q_today.scales != q_grid.scales).sum().item()
            exact = hadamard_transform(x.double())
            err["today"] += (hadamard_transform(x.float()).double() - exact).square().sum().item()
            err["grid"] += (grid_hadamard_transform(x.float()).double() - exact).square().sum().item()
            err["norm"] += exact.square().sum().item()
            total, blocks = total + x.numel(), blocks + x.numel() // 32
        rel = {k: (err[k] / err["norm"]) ** 0.5 for k in ("today", "grid")}
        print(f"{name:<22} {moved / total:12.2e} {differ / total:12.2e} {one_ulp / max(differ, 1):6.3f} {worst:12.2e} "
              f"{codes / total:12.2e} {scales / blocks:13.2e} {rel['today']:13.2e} {rel['grid']:12.2e}")  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    parser.add_argument("--compile", action="store_true", help="sm_90 compile figures, no GPU needed")
    parser.add_argument("--changes", action="store_true", help="what the grid changes versus today's spec (CPU)")
    parser.add_argument("--out", help="folder for hadamard_tensor_cores.json (the device's $OUT)")
    parser.add_argument("--repeats", type=int, default=15, help="timed graph replays per case")
    args = parser.parse_args()
    if args.compile:
        compile_figures()
        return 0
    if args.changes:
        changes()
        return 0
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
