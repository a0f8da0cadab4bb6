"""End-to-end training steps: tokens/s of a Llama per recipe and mode against BF16, and where the time goes.

Each run builds an ``adahop train`` :class:`~adahop.train.Trainer` (fp32 master weights, bf16
autocast, fused AdamW, clipping, the embedded corpus) and times its ``train_step``, so the bench
measures what the trainer does. Adaptive recipes calibrate first; timing starts once every
layer has frozen its plan. Modes: ``eager``; ``compile`` (``training.compile``: each block
``torch.compile``'d); ``graph`` (``training.cuda_graph``: each micro-step replayed as one CUDA
graph); ``compile+graph``. Every recipe is compared with BF16 in BF16's fastest mode. The peer
is torchao's float8 training (tensorwise and rowwise scaling), the FP8 recipe a Hopper user
would pick, on the same model with the LM head in BF16, when torchao can be imported.

One step per run is profiled and its CUDA time split into kernel families, so a slowdown can be
traced to what causes it. Each run is a fresh process: a host-bound step runs measurably slower
in a process that has already run other benchmarks.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from ..atomic import write_atomic
from ..recipes import RECIPES as REGISTERED_RECIPES

SEQ_LEN = 2048
VOCAB_SIZE = 32768  # the tokenizer of configs/llama3_*_h200.toml
CALIBRATION_STEPS = 4  # forwards: enough to freeze a plan, not to judge its quality
MAX_CALIBRATION_STEPS = 2 * CALIBRATION_STEPS
WARMUP_STEPS, TIMED_STEPS = 4, 12
MODES = ("eager", "compile", "graph", "compile+graph")
PEERS = {"float8_tensorwise": "tensorwise", "float8_rowwise": "rowwise"}  # torchao recipe names
HEADLINE_RECIPE = "adahop_lv2"


@dataclass(frozen=True)
class Case:
    """One model shape and micro-batch, and the (recipe, mode) runs timed on it."""

    preset: str
    batch: int
    runs: tuple[tuple[str, str], ...]

    @property
    def key(self) -> str:
        return f"{self.preset}_{self.batch}x{SEQ_LEN}"


# The default runs, most telling first (a run cut short by a time limit still has the headline
# pair). A run takes 30-50 s (process start, model, compilation, ~20 steps): these 14 fit a
# 10-minute machine call. Any other recipe and mode can be named with --step-runs.
_HEADLINE = (("bf16", "compile"), ("adahop_lv2", "compile+graph"))
CASES = (
    Case(
        "llama3_1b",
        4,
        _HEADLINE
        + (
            ("float8_tensorwise", "compile"),
            ("float8_rowwise", "compile"),
            ("mxfp4_hadamard", "compile+graph"),
            ("bf16", "compile+graph"),
            ("adahop_lv2", "eager"),
            ("bf16", "eager"),
        ),
    ),
    Case("llama3_1b", 8, _HEADLINE),
    Case("llama3_3b", 4, _HEADLINE + (("float8_tensorwise", "compile"), ("mxfp4_hadamard", "compile+graph"))),
)
RECIPES = (*REGISTERED_RECIPES, *PEERS)  # every registered recipe, then the peers
# Kernel families by name fragment, first match wins; the rest is "other".
FAMILIES = (
    ("quantize (Triton)", ("_quantize_",)),
    ("fold (Triton)", ("_fold_kernel",)),
    ("FP8 GEMM", ("f8", "fp8", "e4m3")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul")),
    ("optimizer", ("adam",)),
    ("top-k / index", ("topk", "top_rows", "index", "gather", "scatter", "sort", "radix")),
    ("norm / reduce", ("norm", "reduce")),
    ("elementwise", ("elementwise", "vectorized", "unrolled", "triton_poi", "triton_per", "triton_red")),
)


def family(kernel: str) -> str:
    name = kernel.lower()
    for label, keys in FAMILIES:
        if any(k in name for k in keys):
            return label
    return "other"


def _profile(step) -> dict:
    """CUDA time of one step by kernel family, its largest kernels, and the host-side operators
    that took the most CPU time (a step that is slower than its CUDA time is host-bound)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    by_family: dict[str, float] = defaultdict(float)
    kernels, host = [], []
    for evt in prof.key_averages():
        if evt.self_cpu_time_total > 0:
            host.append({"name": evt.key[:120], "self_cpu_ms": evt.self_cpu_time_total / 1e3, "calls": evt.count})
        ms = evt.self_device_time_total / 1e3
        # GPU-side user annotations (e.g. "Optimizer.step#AdamW.step") span kernels already counted.
        annotation = getattr(evt, "is_user_annotation", False) or "#" in evt.key
        if ms <= 0 or evt.device_type != torch.autograd.DeviceType.CUDA or annotation:
            continue
        by_family[family(evt.key)] += ms
        kernels.append({"name": evt.key[:120], "ms": ms, "calls": evt.count})
    kernels.sort(key=lambda k: -k["ms"])
    host.sort(key=lambda h: -h["self_cpu_ms"])
    return {
        "cuda_ms": sum(by_family.values()),
        "families_ms": dict(sorted(by_family.items(), key=lambda kv: -kv[1])),
        "top_kernels": kernels[:40],
        "top_host_ops": host[:15],
    }


def plan_mix(model: torch.nn.Module) -> dict[str, int]:
    """How many layers of each kind (``wq``, ``w1``, ...) run each (forward, dgrad, wgrad)
    strategy triple: what the step's quantization work depends on."""
    from ..nn import model_plan

    triples = Counter(
        f"{name.rsplit('.', 1)[-1]} " + "/".join(s.label for s in plan.strategies().values())
        for name, plan in model_plan(model).items()
    )
    return dict(triples.most_common())


def _to_float8(model: torch.nn.Module, scaling: str) -> None:
    """torchao's float8 training on every linear layer but the LM head (as torchtitan does)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    config = Float8LinearConfig.from_recipe_name(scaling)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda _, fqn: fqn != "output")


def _trainer(recipe: str, preset: str, batch: int, mode: str, out: str):
    from ..recipes import get_recipe
    from ..train import Trainer
    from ..train.config import DataConfig, ModelConfig, TrainConfig, TrainingConfig

    base = "bf16" if recipe in PEERS else recipe
    cfg = TrainConfig(
        model=ModelConfig(preset),
        data=DataConfig(seq_len=SEQ_LEN, batch_size=batch, vocab_size=VOCAB_SIZE),
        training=TrainingConfig(steps=1_000_000, device="cuda", compile="compile" in mode, cuda_graph="graph" in mode),
        recipe=get_recipe({"name": base, "calibration_steps": CALIBRATION_STEPS}),
        out=out,
    )
    trainer = Trainer(cfg, progress=False)
    if recipe in PEERS:
        _to_float8(trainer.model, PEERS[recipe])
    return trainer


def measure(recipe: str, preset: str, batch: int, mode: str) -> dict:
    """Tokens/s of ``recipe`` in ``mode`` (timed after calibration and warm-up steps, which also
    absorb compilation and graph capture), its peak memory and a profiled step."""
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(recipe, preset, batch, mode, out)
        for _ in range(MAX_CALIBRATION_STEPS):
            if trainer.phase != "calibrating":
                break
            trainer.train_step()
        if trainer.phase == "calibrating":
            raise RuntimeError(f"{recipe}: calibration did not finish in {MAX_CALIBRATION_STEPS} steps")
        for _ in range(WARMUP_STEPS):
            trainer.train_step()
        torch.cuda.synchronize()
        # The whole run's peak (calibration, compilation, graph capture) before the steady state's.
        run_peak_reserved_gib = torch.cuda.max_memory_reserved() / 2**30
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        losses = [trainer.train_step()[0] for _ in range(TIMED_STEPS)]  # on the device: the step never waits
        torch.cuda.synchronize()
        seconds = (time.perf_counter() - start) / TIMED_STEPS
        losses = torch.stack(losses).tolist()
        result = {
            "tokens_per_s": batch * SEQ_LEN / seconds,
            "step_ms": seconds * 1e3,
            "peak_allocated_gib": torch.cuda.max_memory_allocated() / 2**30,
            "peak_reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
            "run_peak_reserved_gib": max(run_peak_reserved_gib, torch.cuda.max_memory_reserved() / 2**30),
            "final_loss": losses[-1],
            "losses_finite": all(math.isfinite(x) for x in losses),
            "cuda_graph_captured": trainer.graph_captured,
            "plan_mix": plan_mix(trainer.model),
            "profile": _profile(trainer.train_step),
        }
    return result


def _one_line(r: dict) -> str:
    """A run's figures as soon as it ends (a run cut off by a time limit keeps what it printed)."""
    if "error" in r:
        return r["error"]
    fams = ", ".join(f"{f} {ms:.1f}" for f, ms in r["profile"]["families_ms"].items())
    return (
        f"{r['tokens_per_s']:,.0f} tok/s, step {r['step_ms']:.1f} ms, CUDA {r['profile']['cuda_ms']:.1f} ms, "
        f"peak {r['peak_allocated_gib']:.1f}/{r['peak_reserved_gib']:.1f}{_run_peak(r)} GiB, "
        f"graph {r['cuda_graph_captured']}; {fams}"
    )


def _run_peak(r: dict) -> str:
    """The whole run's reserved peak where it exceeds the timed steps' (results before it was kept: nothing)."""
    run_peak = r.get("run_peak_reserved_gib")
    return f" ({run_peak:.1f})" if run_peak is not None and run_peak > r["peak_reserved_gib"] + 0.05 else ""


def _failure(err: BaseException) -> dict:
    return {"error": f"{type(err).__name__}: {str(err)[:300]}"}


def run_case(case: Case, on_run: Callable[[dict], None] = lambda runs: None) -> dict:
    """Every run of ``case`` in a fresh process, with its tokens/s relative to BF16's fastest mode."""
    from importlib.util import find_spec

    context = multiprocessing.get_context("spawn")
    runs: dict[str, dict] = {}
    for recipe, mode in case.runs:
        name = f"{recipe}/{mode}"
        if recipe in PEERS and find_spec("torchao") is None:
            runs[name] = {"error": "torchao is not installed"}
            continue
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            try:
                runs[name] = pool.submit(measure, recipe, case.preset, case.batch, mode).result()
            except Exception as err:  # one failing run must not lose the others
                runs[name] = _failure(err)
        runs[name] |= {"recipe": recipe, "mode": mode}
        on_run(runs)
        print(f"  {case.key} {name}: {_one_line(runs[name])}", flush=True)
    best = best_runs(runs)
    base = best.get("bf16")
    for r in runs.values():
        if "error" not in r and base is not None:
            r["speedup_vs_bf16_best"] = r["tokens_per_s"] / base["tokens_per_s"]
            same_mode = runs.get(f"bf16/{r['mode']}")
            if same_mode is not None and "error" not in same_mode:
                r["speedup_vs_bf16_same_mode"] = r["tokens_per_s"] / same_mode["tokens_per_s"]
                r["peak_reserved_ratio_vs_bf16_same_mode"] = r["peak_reserved_gib"] / same_mode["peak_reserved_gib"]
    return {
        "preset": case.preset,
        "batch": case.batch,
        "seq_len": SEQ_LEN,
        "runs": runs,
        "best_mode": {recipe: r["mode"] for recipe, r in best.items()},
    }


def best_runs(runs: dict[str, dict]) -> dict[str, dict]:
    """Per recipe, its fastest successful run."""
    best: dict[str, dict] = {}
    for r in runs.values():
        if "error" not in r and r["tokens_per_s"] > best.get(r["recipe"], {}).get("tokens_per_s", 0):
            best[r["recipe"]] = r
    return best


def _ratio(case: dict, recipe: str, reference: str, key: str = "tokens_per_s") -> float | None:
    best = best_runs(case["runs"])
    if recipe in best and reference in best:
        return best[recipe][key] / best[reference][key]
    return None


def run(cases: tuple[Case, ...] = CASES, partial: Path | None = None) -> dict:
    """Every case, and the headline ratios (best mode against best mode). ``partial``: a JSON
    file rewritten (atomically) after every run, so a run cut off by a time limit keeps the rest."""
    from ..data import prepare_data

    prepare_data("stdlib", VOCAB_SIZE, progress=False)  # tokenize once; every run reads the cache
    results: dict = {"seq_len": SEQ_LEN, "vocab_size": VOCAB_SIZE, "cases": {}}
    for case in cases:

        def save(runs: dict, key: str = case.key) -> None:
            if partial is not None:
                write_atomic(partial, json.dumps(results | {"partial": {key: runs}}, indent=1))

        results["cases"][case.key] = run_case(case, save)
    headlines = {
        "train_step_speedup_vs_bf16": ("llama3_1b_4x2048", "bf16", "tokens_per_s"),
        "train_step_speedup_vs_bf16_1b_8x": ("llama3_1b_8x2048", "bf16", "tokens_per_s"),
        "train_step_speedup_vs_bf16_3b": ("llama3_3b_4x2048", "bf16", "tokens_per_s"),
        "train_step_speedup_vs_float8": ("llama3_1b_4x2048", "float8_tensorwise", "tokens_per_s"),
        "train_step_speedup_vs_float8_3b": ("llama3_3b_4x2048", "float8_tensorwise", "tokens_per_s"),
        "peak_memory_ratio_vs_bf16": ("llama3_1b_8x2048", "bf16", "peak_reserved_gib"),
        "run_peak_memory_ratio_vs_bf16": ("llama3_1b_8x2048", "bf16", "run_peak_reserved_gib"),
    }
    for name, (key, reference, field) in headlines.items():
        if key in results["cases"] and (value := _ratio(results["cases"][key], HEADLINE_RECIPE, reference, field)):
            results[name] = value
    return results


def select_cases(keys: list[str], runs: list[str] | None = None) -> tuple[Case, ...]:
    """The cases named by ``keys`` (``Case.key``; all when empty), in the order given. With
    ``runs``, each runs exactly those named: "recipe/mode" in every case, "CASE:recipe/mode" in
    one; otherwise its default runs."""
    known = {c.key: c for c in CASES}
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ValueError(f"unknown step cases {unknown}; choose from {sorted(known)}")
    cases = tuple(known[k] for k in keys) or CASES
    if runs is None:
        return cases
    parsed = []
    for name in runs:
        case_key, _, run = name.rpartition(":")
        recipe, _, mode = run.partition("/")
        if recipe not in RECIPES or mode not in MODES or (case_key and case_key not in known):
            raise ValueError(
                f"unknown step run {name!r}; write [CASE:]RECIPE/MODE with RECIPE one of {RECIPES}, "
                f"MODE one of {MODES} and CASE one of {sorted(known)}"
            )
        parsed.append((case_key, (recipe, mode)))
    return tuple(Case(c.preset, c.batch, tuple(r for k, r in parsed if k in ("", c.key))) for c in cases)


def markdown(step: dict) -> list[str]:
    """This section of the bench summary: one table per case."""
    lines: list[str] = []
    for key, case in step["cases"].items():
        lines += [
            "",
            f"Training steps of `{case['preset']}`, micro-batch {case['batch']} x {case['seq_len']} "
            f"(vocabulary {step['vocab_size']}), `adahop train`'s step timed after calibration; "
            "speed relative to BF16 in its fastest mode and in the same mode; CUDA ms of one profiled "
            "step by kernel family:",
            "",
            "| recipe / mode | tokens/s | vs best bf16 | vs bf16 same mode | step ms | CUDA ms | "
            "peak alloc / reserved GiB (whole run) | CUDA ms by family |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for name, r in case["runs"].items():
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error'][:120]} | | | | | | |")
                continue
            fams = ", ".join(f"{f} {ms:.1f}" for f, ms in r["profile"]["families_ms"].items())
            same = r.get("speedup_vs_bf16_same_mode")
            lines.append(
                f"| {name} | {r['tokens_per_s']:,.0f} | {r.get('speedup_vs_bf16_best', math.nan):.2f}x | "
                f"{'-' if same is None else f'{same:.2f}x'} | {r['step_ms']:.1f} | {r['profile']['cuda_ms']:.1f} | "
                f"{r['peak_allocated_gib']:.1f} / {r['peak_reserved_gib']:.1f}{_run_peak(r)} | {fams} |"
            )
    return lines
