"""GPU A/B of issue #30's epilogue lever: the producer's Inductor kernel then ``quantize_fold_fp8``, against one
fused kernel that computes and quantizes (with and without writing the bf16 output), at the step's shapes.

    PYTHONPATH=src python benchmarks/quantize/epilogue/epilogue_ab.py --out $OUT     # GPU, <= 150 s on an H200
    DRY=1 PYTHONPATH=src python benchmarks/quantize/epilogue/epilogue_ab.py          # CPU, interpreter, tiny shapes

Shapes: ``llama3_1b`` at 8 x 2048 tokens and ``llama3_3b`` at 4 x 2048 (dims from ``models.llama``): the SwiGLU
product [tokens, hidden] and RMSNorm [tokens, dim] of a float32 residual stream with a float32 weight (the
single-GPU trainer: float32 parameters under bf16 autocast; the linear casts X to bf16). The forward quantizes
as ``GemmConfig.act``: round to nearest, scale rule floor, the 32-point Hadamard (IHT and OE layers) or none
(MXFP4 layers). First the checks, on the GPU: every fused output against ``quantize_fold_fp8`` of the eager
product / the RMSNorm spec (``rmsnorm.py``), bit for bit in every field, on hard rows (NaN, Inf, zeros,
subnormals, outliers) and on full-size random tensors, round to nearest and stochastic, with and without the
Hadamard; silu's rounding over all 65,536 bf16 gates; and, for the record, how often Inductor's product and
eager's RMSNorm differ from what the fused kernels compute. Then the timings: each variant is a CUDA graph of
``CALLS`` calls cycling through enough input copies to exceed L2, replayed ``--repeats`` times under CUDA events,
in the order split, fused, fused + bf16, fused + bf16, fused, split (A B B A); median and range over both runs.
The table gives microseconds per call, the saving per call and per step (calls per step: SwiGLU once per layer,
RMSNorm twice: the attention and FFN norms, whose q/k/v and w1/w3 quantize calls are one call each under
``torch.compile``, as ``gemm.operand.prepare_operand`` arranges). ``--out``: ``epilogue_ab.json`` (rewritten
after every stage) and ``epilogue_ab.md``. A stage that would start past ``--budget`` (110 s) is skipped
and listed.

After the forward's stages, SwiGLU's backward (``swiglu_backward.py``; ``--only backward`` runs it alone), as w1's
and w3's dgrad quantize dY (stochastic rounding, each its own key, H32): checks of both gradients and both
operands against eager autograd and ``quantize_fold_fp8``, bit for bit (one program and one launch per operand,
hard rows and full size; H0 and round to nearest at the first preset), how often Inductor's backward differs from
eager's, then A B C D D C B A timings of the split (``torch.compile``d ``swiglu_grads`` and two
``quantize_fold_fp8`` calls), the fused kernel (at 80 registers, where it spills, and at 128) and one fused launch
per operand, all writing the bf16 gradients (wgrad reads them), plus
Inductor's backward and one quantize call alone; its table is appended to ``epilogue_ab.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

DRY = "--dry-run" in sys.argv or os.environ.get("DRY") == "1"
if DRY:  # before triton is imported
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/quantize: the epilogue package

import torch  # noqa: E402

from adahop.atomic import write_atomic  # noqa: E402
from adahop.bench.common import graph_seconds_per_launch  # noqa: E402
from adahop.kernels.quantize_fold import MAX_REGISTERS, quantize_fold_fp8  # noqa: E402
from adahop.models.llama import RMSNorm, get_model_args  # noqa: E402
from epilogue.inputs import hard_rows, same_bits, same_epilogue  # noqa: E402
from epilogue.rmsnorm import rmsnorm_quantize_fold, rmsnorm_quantize_fold_reference, rmsnorm_reference  # noqa: E402
from epilogue.swiglu import swiglu_product, swiglu_quantize_fold, swiglu_quantize_fold_reference  # noqa: E402
from epilogue.swiglu_backward import (  # noqa: E402
    swiglu_backward_quantize_fold,
    swiglu_backward_quantize_fold_reference,
    swiglu_grads,
)

PRESETS = {"llama3_1b 8x2048": ("llama3_1b", 8 * 2048), "llama3_3b 4x2048": ("llama3_3b", 4 * 2048)}
DRY_SHAPES = {"dry": dict(tokens=16, dim=96, hidden=64, layers=2)}  # one interpreter program of rows
EPS = 1e-5
COPY_TB_PER_S = 4.22  # the H200's measured copy bandwidth (benchmarks/quantize/README.md)
L2_BYTES = 60 << 20  # H200: a graph cycles through at least twice this much input
CALLS = 12  # calls per graph replay
SEED = 1234
SEEDS = dict(seed_gate=SEED, seed_up=SEED + 1)  # w1's and w3's dgrad keys differ


@functools.cache
def compiled_swiglu():
    """One compiled SwiGLU product for every case (a new shape recompiles, a new case does not)."""
    return torch.compile(swiglu_product, dynamic=False)


def preset_shapes() -> dict[str, dict]:
    shapes = {}
    for label, (preset, tokens) in PRESETS.items():
        args = get_model_args(preset)
        shapes[label] = dict(tokens=tokens, dim=args.dim, hidden=args.hidden_dim, layers=args.n_layers)
    return shapes


class Case:
    """One producer at one shape: inputs, the three ways to get its quantized operand, and its bytes."""

    def __init__(
        self,
        producer: str,
        shape: dict,
        device: torch.device,
        hadamard: int,
        compile_producer: bool,
        silu: str = "table",
    ):
        self.producer, self.hadamard = producer, hadamard
        self.label = f"swiglu (silu {silu})" if producer == "swiglu" else producer
        self.silu = silu
        gen = torch.Generator().manual_seed(3)
        m = shape["tokens"]
        self.n = shape["hidden"] if producer == "swiglu" else shape["dim"]
        self.calls_per_step = shape["layers"] * (1 if producer == "swiglu" else 2)
        self.options = dict(scale_rule="floor", rounding="nearest", hadamard_block_size=hadamard)
        if producer == "swiglu":
            make = lambda: (torch.randn(m, self.n, generator=gen) * 2).to(device, torch.bfloat16)  # noqa: E731
            self.input_bytes = 2 * 2 * m * self.n  # gate and up, bf16
            eager = swiglu_product
        else:
            make = lambda: (torch.randn(m, self.n, generator=gen) * torch.randn(m, 1, generator=gen).exp()).to(device)  # noqa: E731
            self.input_bytes = 4 * m * self.n  # the float32 residual stream
            self.norm = RMSNorm(self.n, EPS).to(device)
            with torch.no_grad():
                self.norm.weight.copy_(1 + 0.1 * torch.randn(self.n, generator=gen))
            self.weight = self.norm.weight.detach()
            eager = lambda h: self.norm(h).to(torch.bfloat16)  # noqa: E731
        self.elements = m * self.n
        copies = max(1, -(-2 * L2_BYTES // self.input_bytes)) if device.type == "cuda" else 1
        self.inputs = [tuple(make() for _ in range(2 if producer == "swiglu" else 1)) for _ in range(copies)]
        # Inductor's kernel writes the bf16 output the quantizer reads (eager in the dry run: no compiler needed).
        if compile_producer:  # a norm is a new module in each case
            eager = compiled_swiglu() if producer == "swiglu" else torch.compile(eager, dynamic=False)
        self.producer_fn = eager

    def split(self, args):
        with torch.no_grad():
            return quantize_fold_fp8(self.producer_fn(*args), **self.options)

    def fused(self, args, write: bool, **options):
        options = {**self.options, **options}
        if self.producer == "swiglu":
            return swiglu_quantize_fold(*args, write_product=write, silu=self.silu, **options)
        return rmsnorm_quantize_fold(*args, self.weight, EPS, write_output=write, **options)

    def reference(self, args, write: bool, **options):
        options = {**self.options, **options}
        if self.producer == "swiglu":
            return swiglu_quantize_fold_reference(*args, write_product=write, **options)
        return rmsnorm_quantize_fold_reference(*args, self.weight, EPS, write_output=write, **options)

    def bytes_moved(self, variant: str) -> int:
        """Bytes read and written per call (the E4M3 operand is 1 byte per element; row scales are negligible)."""
        bf16 = 2 * self.elements
        return {"split": self.input_bytes + 2 * bf16 + self.elements, "fused": self.input_bytes + self.elements,
                "fused+bf16": self.input_bytes + bf16 + self.elements}[variant]  # fmt: skip


def check_case(case: Case, device: torch.device, roundings: tuple, hard: bool, full: bool) -> list[dict]:
    """Bit-exactness of the fused kernel (both writes) against the composition, on hard rows and full size."""
    results = []
    inputs = {}
    if hard:
        m, n = (16 if DRY else 64), case.n
        if case.producer == "swiglu":
            inputs["hard rows"] = (hard_rows(m, n, seed=1).to(device), hard_rows(m, n, seed=2).to(device))
        else:
            inputs["hard rows"] = (hard_rows(m, n, seed=3, dtype=torch.float32).to(device),)
    if full:
        inputs["full size"] = case.inputs[0]
    for name, args in inputs.items():
        for rounding in roundings:
            for write in (True, False):
                row = dict(producer=case.label, n=case.n, input=name, rounding=rounding, hadamard=case.hadamard,
                           write=write)  # fmt: skip
                try:
                    got = case.fused(args, write, rounding=rounding, seed=SEED)
                    want = case.reference(args, write, rounding=rounding, seed=SEED)
                    fields = same_epilogue(got, want)
                    row.update(exact=all(fields.values()), fields=fields)
                except Exception as error:  # recorded; the other checks and the timings still run
                    row.update(exact=False, error=repr(error)[:500])
                print(f"check {row}", flush=True)
                results.append(row)
    return results


def silu_checks(device: torch.device, n: int) -> list[dict]:
    """silu's rounding for every bf16 gate (and a random up) through the fused kernel's written product, in
    rows of ``n`` (the timed kernels' row length: no extra compilation)."""
    gate = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).view(-1, n)
    up = torch.randn(gate.shape, generator=torch.Generator().manual_seed(4)).to(torch.bfloat16)
    gate, up = gate.to(device), up.to(device)
    checks = []
    for silu in ("table", "math"):
        got = swiglu_quantize_fold(gate, up, write_product=True, silu=silu).output
        checks.append(dict(check=f"silu {silu} over all bf16 gates", exact=same_bits(got, swiglu_product(gate, up))))
        print(f"check {checks[-1]}", flush=True)
    return checks


def differences(case: Case) -> dict:
    """How often the split path's producer (Inductor on the GPU) and eager differ from what the fused kernel
    computes, on the first full-size input: bf16 elements that differ, and the largest difference in bf16 ulps."""
    args = case.inputs[0]
    with torch.no_grad():
        ours = swiglu_product(*args) if case.producer == "swiglu" else rmsnorm_reference(*args, case.weight, EPS)
        others = {"split producer": case.producer_fn(*args)}
        if case.producer == "rmsnorm":
            others["eager"] = case.norm(*args).to(torch.bfloat16)
    return {name: ulp_differences(ours, other) for name, other in others.items()}


def ulp_differences(a: torch.Tensor, b: torch.Tensor) -> dict:
    """The fraction of finite bf16 elements that differ, and the largest difference in ulps."""
    ulps = (a.view(torch.int16).int() - b.view(torch.int16).int()).abs()
    finite = a.isfinite() & b.isfinite()
    return dict(differ=float((ulps[finite] > 0).float().mean()), max_ulps=int(ulps[finite].max()))


def time_case(case: Case, repeats: int, on_cuda: bool) -> dict:
    """Microseconds per call of every variant, A B B A, and the producer and quantizer alone."""
    calls = CALLS if on_cuda else 1
    pick = [case.inputs[i % len(case.inputs)] for i in range(calls)]
    variants = {
        "split": [lambda a=a: case.split(a) for a in pick],
        "fused": [lambda a=a: case.fused(a, False) for a in pick],
        "fused+bf16": [lambda a=a: case.fused(a, True) for a in pick],
    }
    with torch.no_grad():
        produced = [case.producer_fn(*a) for a in case.inputs]
    alone = {
        "producer alone": [lambda a=a: case.producer_fn(*a) for a in pick],
        "quantize alone": [lambda p=produced[i % len(produced)]: quantize_fold_fp8(p, **case.options) for i in range(calls)],
    }  # fmt: skip
    row = dict(producer=case.label, n=case.n, hadamard=case.hadamard, calls_per_step=case.calls_per_step)
    return time_variants(case, row, variants, alone, repeats, on_cuda)


def time_variants(case, row: dict, variants: dict, alone: dict, repeats: int, on_cuda: bool) -> dict:
    """``row`` with the microseconds per call of every variant (the first is the split), run in the order
    A B .. B A, then of each launch list in ``alone``; each variant's bytes and its saving against the split."""
    times = {name: [] for name in (*variants, *alone)}
    with torch.no_grad():
        for name in (*variants, *reversed(variants)):
            times[name] += graph_seconds_per_launch(variants[name], repeats, on_cuda)
        for name, launches in alone.items():
            times[name] += graph_seconds_per_launch(launches, repeats, on_cuda)
    for name, ts in times.items():
        us = [t * 1e6 for t in ts]
        row[name] = dict(median_us=statistics.median(us), min_us=min(us), max_us=max(us))
    for name in variants:
        row[name]["bytes"] = case.bytes_moved(name)
        row[name]["tb_per_s"] = case.bytes_moved(name) / (row[name]["median_us"] * 1e-6) / 1e12
    for name in list(variants)[1:]:
        saving = row["split"]["median_us"] - row[name]["median_us"]
        row[name]["saving_us"] = saving
        row[name]["saving_ms_per_step"] = saving * case.calls_per_step / 1e3
        saved_bytes = case.bytes_moved("split") - case.bytes_moved(name)
        row[name]["bytes_saving_ms_per_step"] = saved_bytes / (COPY_TB_PER_S * 1e12) * 1e3 * case.calls_per_step
    print(f"time {row}", flush=True)
    return row


def us(v: dict) -> str:
    """Median [min, max] microseconds."""
    return f"{v['median_us']:.1f} [{v['min_us']:.1f}, {v['max_us']:.1f}]"


def table(timings: list[dict]) -> str:
    lines = [
        "| producer | preset | shape | H | split us | producer alone | quantize alone | fused us | fused+bf16 us "
        "| saving per call us (fused / +bf16) | calls per step | saving per step ms (fused / +bf16) | bytes saved at copy bandwidth, ms per step (fused / +bf16) |",  # fmt: skip
        "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in timings:
        f, w = r["fused"], r["fused+bf16"]
        lines.append(
            f"| {r['producer']} | {r['preset']} | {r['shape']} | {r['hadamard']} | {us(r['split'])} | "
            f"{us(r['producer alone'])} | {us(r['quantize alone'])} | {us(f)} | {us(w)} | "
            f"{f['saving_us']:.1f} / {w['saving_us']:.1f} | {r['calls_per_step']} | "
            f"{f['saving_ms_per_step']:.2f} / {w['saving_ms_per_step']:.2f} | "
            f"{f['bytes_saving_ms_per_step']:.2f} / {w['bytes_saving_ms_per_step']:.2f} |"
        )
    per_preset = {}
    for r in timings:  # silu looked up (the default)
        if r["hadamard"] == 32 and "math" not in r["producer"]:
            total = per_preset.setdefault(r["preset"], [0.0, 0.0])
            total[0] += r["fused"]["saving_ms_per_step"]
            total[1] += r["fused+bf16"]["saving_ms_per_step"]
    for preset, (fused, written) in per_preset.items():
        lines.append(f"\n{preset}, H32, SwiGLU (silu table) + RMSNorm: {fused:.2f} ms per step fused, {written:.2f} ms with the bf16 output")  # fmt: skip
    return "\n".join(lines)


def forward_stages(shapes: dict, device: torch.device, repeats: int, over_budget, results: dict, save) -> None:
    """silu's rounding, then per preset the fused SwiGLU and RMSNorm kernels checked, compared and timed."""
    if not over_budget("silu over all bf16 gates"):
        results["checks"] += silu_checks(device, next(iter(shapes.values()))["hidden"])
    # The forward's quantization (round to nearest, H32) first: checks, then timings; then the other options'
    # checks (stochastic rounding, no Hadamard) at the first preset's shapes.
    # What the decision needs first (silu table, both producers, both presets), then silu math.
    timed = [(label, producer, "table") for label in shapes for producer in ("swiglu", "rmsnorm")]
    timed += [(label, "swiglu", "math") for label in shapes]
    for label, producer, silu in timed:
        stage = f"{label} {producer}{' silu math' * (silu == 'math')} H32"
        if over_budget(stage):
            continue
        case = Case(producer, shapes[label], device, 32, compile_producer=not DRY, silu=silu)
        results["checks"] += check_case(case, device, ("nearest",), hard=True, full=True)
        results["differences"][stage] = differences(case)
        timing = time_case(case, repeats, device.type == "cuda")
        timing.update(preset=label, shape=f"{shapes[label]['tokens']}x{case.n}")
        results["timings"].append(timing)
        save()
        del case
    first_label, first = next(iter(shapes.items()))
    for producer in ("swiglu", "rmsnorm"):
        for hadamard, roundings in ((32, ("stochastic",)), (0, ("nearest", "stochastic"))):
            stage = f"{first_label} {producer} H{hadamard} {'/'.join(roundings)} checks"
            if over_budget(stage):
                continue
            case = Case(producer, first, device, hadamard, compile_producer=False)
            results["checks"] += check_case(case, device, roundings, hard=True, full=not DRY)
            save()
            del case


@functools.cache
def compiled_swiglu_grads():
    """SwiGLU's backward as Inductor compiles it (``swiglu_grads``: autograd's formula), one for every case."""
    return torch.compile(swiglu_grads, dynamic=False)


class BackwardCase:
    """SwiGLU's backward at one shape, as w1's and w3's dgrad quantize dY: the split (Inductor's backward, then
    ``quantize_fold_fp8`` of dg and of du, each with its own key) against the fused kernel (both operands from one
    program, or one launch per operand), the bf16 gradients written either way (wgrad reads them)."""

    def __init__(self, shape: dict, device: torch.device, hadamard: int, rounding: str, compile_backward: bool):
        gen = torch.Generator().manual_seed(5)
        m, self.n = shape["tokens"], shape["hidden"]
        self.hadamard, self.rounding = hadamard, rounding
        self.elements, self.calls_per_step = m * self.n, shape["layers"]
        self.options = dict(scale_rule="floor", rounding=rounding, hadamard_block_size=hadamard)
        make = lambda: (torch.randn(m, self.n, generator=gen) * 2).to(device, torch.bfloat16)  # noqa: E731
        copies = max(1, -(-2 * L2_BYTES // (6 * self.elements))) if device.type == "cuda" else 1
        self.inputs = [(make() * 1e-3, make(), make()) for _ in range(copies)]  # d (a gradient's scale), g, u
        self.grads_fn = compiled_swiglu_grads() if compile_backward else swiglu_grads
        # device-side keys: a capture cannot copy a Python int to the GPU
        self.seeds = {name: torch.tensor(key, dtype=torch.int64, device=device) for name, key in SEEDS.items()}

    def split(self, args):
        with torch.no_grad():
            dg, du = self.grads_fn(*args)
            seeds = self.seeds["seed_gate"], self.seeds["seed_up"]
            return [quantize_fold_fp8(dx, seed=seed, **self.options) for dx, seed in zip((dg, du), seeds)]

    def fused(self, args, outputs=("gate", "up"), max_registers=MAX_REGISTERS):
        return swiglu_backward_quantize_fold(
            *args, outputs=outputs, max_registers=max_registers, **self.seeds, **self.options
        )

    def per_operand(self, args):
        return [self.fused(args, outputs=(name,)) for name in ("gate", "up")]

    def bytes_moved(self, variant: str) -> int:
        """Bytes read and written per call: the split reads d, g, u (6 bytes an element), writes dg and du (4), and
        each quantizer reads one back (2) and writes its operand (1); the fused kernel reads d and g again from L2,
        not DRAM; one launch per operand reads d and g twice from DRAM."""
        fused = 6 + 4 + 2
        per_element = {"split": 6 + 4 + 2 * (2 + 1), "fused": fused, "fused r128": fused,
                       "per operand": (6 + 2 + 1) + (4 + 2 + 1)}  # fmt: skip
        return per_element[variant] * self.elements


def check_backward(case: BackwardCase, device: torch.device, hard: bool, full: bool) -> list[dict]:
    """Bit-exactness of both operands and both gradients against eager autograd's gradients and
    ``quantize_fold_fp8``, from one program and from one launch per operand."""
    inputs = {}
    if hard:
        m = 16 if DRY else 64
        inputs["hard rows"] = tuple(hard_rows(m, case.n, seed=s).to(device) for s in (21, 22, 23))
    if full:
        inputs["full size"] = case.inputs[0]
    results = []
    for name, args in inputs.items():
        for outputs in (("gate", "up"), ("gate",), ("up",)):
            row = dict(producer="swiglu backward", n=case.n, input=name, rounding=case.rounding,
                       hadamard=case.hadamard, outputs="+".join(outputs))  # fmt: skip
            try:
                got = case.fused(args, outputs=outputs)
                want = swiglu_backward_quantize_fold_reference(*args, outputs=outputs, **SEEDS, **case.options)
                fields = {f"{k} {f}": ok for k in want for f, ok in same_epilogue(got[k], want[k]).items()}
                row.update(exact=all(fields.values()), fields=fields)
            except Exception as error:  # recorded; the other checks and the timings still run
                row.update(exact=False, error=repr(error)[:500])
            print(f"check {row}", flush=True)
            results.append(row)
    return results


def backward_differences(case: BackwardCase) -> dict:
    """How often the split's backward (Inductor on the GPU) differs from eager autograd's gradients (the fused
    kernel's), on the first full-size input: bf16 elements that differ, and the largest difference in ulps."""
    with torch.no_grad():
        ours, theirs = swiglu_grads(*case.inputs[0]), case.grads_fn(*case.inputs[0])
    return {name: ulp_differences(a, b) for name, a, b in zip(("dg", "du"), ours, theirs)}


def time_backward(case: BackwardCase, repeats: int, on_cuda: bool) -> dict:
    """Microseconds per call: split, fused, one launch per operand, and the split's parts alone."""
    calls = CALLS if on_cuda else 1
    pick = [case.inputs[i % len(case.inputs)] for i in range(calls)]
    variants = {
        "split": [lambda a=a: case.split(a) for a in pick],
        "fused": [lambda a=a: case.fused(a) for a in pick],
        "fused r128": [lambda a=a: case.fused(a, max_registers=128) for a in pick],  # no spills on sm_90
        "per operand": [lambda a=a: case.per_operand(a) for a in pick],
    }
    with torch.no_grad():
        grads = [case.grads_fn(*a)[0] for a in case.inputs]
    alone = {
        "backward alone": [lambda a=a: case.grads_fn(*a) for a in pick],
        "quantize alone": [lambda x=grads[i % len(grads)]: quantize_fold_fp8(x, seed=case.seeds["seed_gate"], **case.options)
                           for i in range(calls)],
    }  # fmt: skip
    row = dict(producer="swiglu backward", n=case.n, hadamard=case.hadamard, rounding=case.rounding,
               calls_per_step=case.calls_per_step)  # fmt: skip
    return time_variants(case, row, variants, alone, repeats, on_cuda)


def backward_table(timings: list[dict]) -> str:
    lines = [
        "| SwiGLU backward | preset | shape | H, rounding | split us | Inductor backward alone | one quantize alone "
        "| fused us (80 / 128 registers) | per operand us | saving per call us (fused 80 / 128 / per operand) "
        "| calls per step | saving per step ms (fused 80 / 128 / per operand) "
        "| bytes saved at copy bandwidth, ms per step (fused) |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in timings:
        f, f128, p = r["fused"], r["fused r128"], r["per operand"]
        lines.append(
            f"| dg, du + both dgrad operands | {r['preset']} | {r['shape']} | {r['hadamard']}, {r['rounding']} | "
            f"{us(r['split'])} | {us(r['backward alone'])} | {us(r['quantize alone'])} | {us(f)} / {us(f128)} | "
            f"{us(p)} | {f['saving_us']:.1f} / {f128['saving_us']:.1f} / {p['saving_us']:.1f} | "
            f"{r['calls_per_step']} | {f['saving_ms_per_step']:.2f} / {f128['saving_ms_per_step']:.2f} / "
            f"{p['saving_ms_per_step']:.2f} | {f['bytes_saving_ms_per_step']:.2f} |"
        )
    return "\n".join(lines)


def backward_stages(shapes: dict, device: torch.device, repeats: int, over_budget, results: dict, save) -> None:
    """After the forward's: per preset, the dgrad's quantization (stochastic rounding, H32: IHT and OE layers)
    checked, compared with Inductor and timed; then round to nearest and H0 checked at the first preset."""
    for label, shape in shapes.items():
        stage = f"{label} swiglu backward H32 stochastic"
        if over_budget(stage):
            continue
        case = BackwardCase(shape, device, 32, "stochastic", compile_backward=not DRY)
        results["checks"] += check_backward(case, device, hard=True, full=True)
        results["differences"][stage] = backward_differences(case)
        timing = time_backward(case, repeats, device.type == "cuda")
        timing.update(preset=label, shape=f"{shape['tokens']}x{case.n}")
        results["backward"].append(timing)
        save()
        del case
    first_label, first = next(iter(shapes.items()))
    for hadamard, rounding in ((0, "stochastic"), (32, "nearest")):
        stage = f"{first_label} swiglu backward H{hadamard} {rounding} checks"
        if over_budget(stage):
            continue
        case = BackwardCase(first, device, hadamard, rounding, compile_backward=False)
        results["checks"] += check_backward(case, device, hard=True, full=not DRY)
        save()
        del case


def run(args) -> int:
    start = time.perf_counter()
    device = torch.device("cpu" if DRY else "cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: run with --dry-run (or DRY=1) on the CPU (Triton's interpreter)", file=sys.stderr)
        return 2
    import triton

    info = dict(torch=torch.__version__, triton=triton.__version__, commit=os.environ.get("ADAHOP_COMMIT", ""),
                device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu (interpreter)")  # fmt: skip
    print(info, flush=True)
    out = Path(args.out) if args.out else None
    results = dict(info=info, checks=[], differences={}, timings=[], backward=[], skipped=[])
    shapes = DRY_SHAPES if DRY else preset_shapes()
    repeats = 2 if DRY else args.repeats

    def save():
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
            write_atomic(out / "epilogue_ab.json", json.dumps(results, indent=1, default=str))

    def over_budget(stage: str) -> bool:
        if time.perf_counter() - start > args.budget:
            results["skipped"].append(stage)
            print(f"skipped (past {args.budget} s): {stage}", flush=True)
            return True
        return False

    if args.only in (None, "forward"):
        forward_stages(shapes, device, repeats, over_budget, results, save)
    if args.only in (None, "backward"):  # after the forward's, so it never crowds them out
        backward_stages(shapes, device, repeats, over_budget, results, save)
    exact = all(c["exact"] for c in results["checks"])
    results["bit_exact"] = exact
    summary = table(results["timings"])
    if results["backward"]:
        summary += "\n\n" + backward_table(results["backward"])
    print(f"\nbit-exact: {exact} ({sum(c['exact'] for c in results['checks'])}/{len(results['checks'])} checks)")
    print(f"differences from the fused kernels' values (fraction of elements, max ulps): {results['differences']}")
    print("\n" + summary)
    print(f"\n{time.perf_counter() - start:.0f} s; skipped: {results['skipped'] or 'nothing'}")
    save()
    if out is not None:
        write_atomic(out / "epilogue_ab.md", summary + "\n")
    return 0 if exact else 1


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="CPU, Triton's interpreter, tiny shapes (or DRY=1)")
    parser.add_argument("--out", help="folder for epilogue_ab.json and epilogue_ab.md (the device's $OUT)")
    parser.add_argument("--repeats", type=int, default=10, help="timed graph replays per run (two runs per variant)")
    parser.add_argument("--budget", type=float, default=110, help="no stage starts after this many seconds")
    parser.add_argument("--only", choices=("forward", "backward"), help="run one half's stages (default: both)")
    return run(parser.parse_args())


if __name__ == "__main__":
    sys.exit(main())
