"""End-to-end training steps: tokens/s of a Llama per recipe and mode against BF16 and torchao's float8, and where the time goes.

Each run builds an ``adahop train`` :class:`~adahop.train.Trainer` (fp32 master weights, bf16
autocast, fused AdamW, clipping, the embedded corpus, the preset's own vocabulary: 128,256 for
Llama 3) and times its ``train_step``, so the bench measures what the trainer does. Adaptive
recipes calibrate first; timing starts once every layer has frozen its plan. Modes: ``eager``;
``compile`` (``training.compile``: each block ``torch.compile``'d); ``graph``
(``training.cuda_graph``: each micro-step replayed as one CUDA graph); ``compile+graph``; and
``fastest``, which tries ``FASTEST`` in order and keeps the first that runs, the failures staying
in the table. Every case runs BF16 and the peers this way: torchao's float8 training (tensorwise
and rowwise scaling), the FP8 recipe a Hopper user would pick, on the same model with the LM head
in BF16, when torchao can be imported.

Every timed step is timed on its own (CUDA events at the step boundaries), so the table gives the
spread beside the mean; ratios are given in wall time and in the profiled step's CUDA time, against
BF16 and float8 tensorwise, each in its fastest mode. One step per run is profiled and its CUDA
time split into kernel families, so a slowdown can be traced to what causes it, and the 4-bit
preparation is set against its memory floor (``roofline``). Each run is a fresh process: a
host-bound step runs measurably slower in a process that has already run other benchmarks.
"""

from __future__ import annotations

import json
import math
import multiprocessing
import statistics
import tempfile
import time
from collections import Counter, defaultdict
from concurrent.futures import ProcessPoolExecutor
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from ..atomic import write_atomic
from ..recipes import DEFAULT_RECIPE
from ..recipes import RECIPES as REGISTERED_RECIPES
from . import roofline

SEQ_LEN = 2048
CALIBRATION_STEPS = 4  # forwards: enough to freeze a plan, not to judge its quality
MODES = ("eager", "compile", "graph", "compile+graph")
FASTEST = "fastest"
FASTEST_MODES = ("compile+graph", "compile")  # what ``fastest`` tries, in order
# A mode's suffixes (either or both, e.g. "fastest-w-each", "fastest-recompute"): W quantized on every
# micro-batch (training.weight_operands_once_per_step=false), the A/B of the default under accumulation;
# wgrad's operands recomputed in backward in compiled blocks (training.recompute_wgrad_operands=true).
W_EACH = "-w-each"
RECOMPUTE = "-recompute"
SUFFIXES = (W_EACH, RECOMPUTE)
# The bench's names of the peer, torchao's float8 training: registered recipes, so the bench and
# adahop train convert with one function (adahop.integrations.float8)
PEERS = {"float8_tensorwise": "torchao_float8_tensorwise", "float8_rowwise": "torchao_float8_rowwise"}
HEADLINE_RECIPE = "adahop_lv2"
REFERENCES = ("bf16", "float8_tensorwise")  # every run's ratios are to these, each in its fastest mode


def base_mode(mode: str) -> str:
    """``mode`` without its ``SUFFIXES``."""
    while mode.endswith(SUFFIXES):
        mode = next(mode.removesuffix(suffix) for suffix in SUFFIXES if mode.endswith(suffix))
    return mode


@dataclass(frozen=True)
class Settings:
    """How a bench run measures: device, steps, data and model size (the defaults are the GPU bench's;
    ``DRY_RUN`` checks the plumbing on the CPU)."""

    device: str = "cuda"
    warmup_steps: int = 4
    timed_steps: int = 16
    fastest_modes: tuple[str, ...] = FASTEST_MODES
    data: str = "stdlib"
    vocab_size: int | None = None  # None: the preset's
    model_overrides: tuple[tuple[str, int], ...] = ()


DRY_RUN = Settings(
    device="cpu",
    warmup_steps=1,
    timed_steps=3,
    fastest_modes=("graph", "eager"),  # the CPU captures no graph: the fallback runs
    vocab_size=512,
    model_overrides=(("n_layers", 2), ("dim", 64), ("n_heads", 2), ("n_kv_heads", 1), ("max_seq_len", 64)),
)


@dataclass(frozen=True)
class Case:
    """One model shape and batch (``accum`` micro-batches of ``batch`` sequences per optimizer
    step), and the (recipe, mode) runs timed on it."""

    preset: str
    batch: int
    runs: tuple[tuple[str, str], ...]
    accum: int = 1
    seq_len: int = SEQ_LEN

    @property
    def key(self) -> str:
        base = f"{self.preset}_{self.batch}x{self.seq_len}"
        return base if self.accum == 1 else f"{base}_accum{self.accum}"

    @property
    def tokens_per_step(self) -> int:
        return self.batch * self.seq_len * self.accum


# Every case runs the references and the peers in their fastest mode, then the recipes it is about.
# A run takes 40-90 s (process start, model, calibration, compilation, ~25 steps), so one 10-minute
# machine call takes one case (``--step-cases``); any recipe and mode can be named with --step-runs.
_PEER_RUNS = tuple((r, FASTEST) for r in ("bf16", "float8_tensorwise", "float8_rowwise"))
FP8_FORWARD_RECIPE = "adahop_lv1_fp8_forward"  # issue 31's candidate: the forward in E4M3, lv1's backward
_ADAHOP_RUNS = ((HEADLINE_RECIPE, FASTEST), (DEFAULT_RECIPE, FASTEST), (FP8_FORWARD_RECIPE, FASTEST))
CASES = (
    Case("llama3_1b", 8, _PEER_RUNS + _ADAHOP_RUNS),
    Case("llama3_3b", 4, _PEER_RUNS + _ADAHOP_RUNS),
    Case("llama3_1b", 2, _PEER_RUNS[:2] + _ADAHOP_RUNS, accum=4),  # 8 x 2048 as real runs accumulate it
    Case("llama3_1b", 4, _PEER_RUNS + _ADAHOP_RUNS + (("mxfp4_hadamard", FASTEST),)),
)
# The dry run's cases: a fallback from a mode that fails, accumulation, a peer that cannot run here.
DRY_RUN_CASES = (
    Case("tiny", 2, (("bf16", FASTEST), ("float8_tensorwise", FASTEST), (HEADLINE_RECIPE, FASTEST)), seq_len=32),
    Case("tiny", 1, (("bf16", "eager"), (HEADLINE_RECIPE, "eager")), accum=2, seq_len=32),
)
RECIPES = (*REGISTERED_RECIPES, *(p for p in PEERS if p not in REGISTERED_RECIPES))
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


# A gap longer than this is the GPU waiting on something other than the next launch. A kernel queued
# behind another (in a CUDA graph, or eager launches running ahead) starts a few microseconds after
# it ends; a longer gap is the host: a launch outside the graph, a sync, the optimizer's host side.
LONG_GAP_US = 5.0


class Kernel(NamedTuple):
    """One device kernel of the profiled step: when it ran (us), whether it prepares operands, its name."""

    start_us: float
    end_us: float
    preparation: bool  # ``roofline.kernel_family(name) is not None``
    name: str = ""


# How many of a step's longest gaps the profile names (with the kernels on either side).
LONGEST_GAPS = 8


def gpu_idle(kernels: list[Kernel]) -> dict:
    """Where the step's device time goes between kernels: why the wall step exceeds the summed
    kernel time. ``gpu_span_ms``: first start to last end; ``gpu_busy_ms``: the union of the kernels'
    intervals (kernels on several streams overlap: the summed ``cuda_ms`` counts them twice);
    ``gpu_idle_ms``: span - busy, split into gaps with a preparation kernel just before (the one
    that ends last) or just after (the next to start) and the rest; the number of gaps, and of those
    over ``LONG_GAP_US`` with their idle time; ``gpu_longest_gaps``: the ``LONGEST_GAPS`` longest, each
    with where it falls in the step and the kernels it lies between, which say what the GPU waited
    for. Fewer launches can remove the short gaps only. No kernels (the CPU): ``{}``."""
    if not kernels:
        return {}
    ordered = sorted(kernels)
    first = ordered[0]
    start, end, last = first.start_us, first.end_us, first  # ``last``: the kernel that ends last so far
    busy = idle_preparation = idle_other = 0.0
    gaps = 0
    long_gaps = []  # (gap, where it starts, the kernel before, the kernel after)
    for kernel in ordered[1:]:
        if kernel.start_us > end:  # a gap: close the busy interval
            gap = kernel.start_us - end
            busy += end - start
            gaps += 1
            if last.preparation or kernel.preparation:
                idle_preparation += gap
            else:
                idle_other += gap
            if gap > LONG_GAP_US:
                long_gaps.append((gap, end - first.start_us, last.name, kernel.name))
            start, end, last = kernel.start_us, kernel.end_us, kernel
        elif kernel.end_us > end:
            end, last = kernel.end_us, kernel
    busy += end - start
    long_gaps.sort(key=lambda g: -g[0])
    return {
        "gpu_span_ms": (end - first.start_us) / 1e3,
        "gpu_busy_ms": busy / 1e3,
        "gpu_idle_ms": (idle_preparation + idle_other) / 1e3,
        "gpu_idle_next_to_preparation_ms": idle_preparation / 1e3,
        "gpu_idle_other_ms": idle_other / 1e3,
        "gpu_gaps": gaps,
        "gpu_long_gaps": len(long_gaps),
        "gpu_idle_long_gaps_ms": sum(g[0] for g in long_gaps) / 1e3,
        "gpu_longest_gaps": [
            {"ms": gap / 1e3, "at_ms": at / 1e3, "after": after, "before": before}
            for gap, at, after, before in long_gaps[:LONGEST_GAPS]
        ],
    }


def _is_kernel(evt) -> bool:
    """A device-side event that runs work: not a GPU-side user annotation (e.g.
    "Optimizer.step#AdamW.step"), which spans kernels already counted."""
    annotation = getattr(evt, "is_user_annotation", False) or "#" in evt.key
    return evt.device_type == torch.autograd.DeviceType.CUDA and not annotation


def _profile(step, device: torch.device) -> dict:
    """Device time of one step by kernel family (and by preparation family, ``roofline``), its
    largest kernels, the host-side operators that took the most CPU time (a step that is
    slower than its CUDA time is host-bound) and the idle time between its kernels (``gpu_idle``).
    On the CPU there are no kernels: only the host side."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    with profile(activities=[ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if cuda else [])]) as prof:
        step()
        if cuda:
            torch.cuda.synchronize()
    by_family: dict[str, float] = defaultdict(float)
    preparation: dict[str, dict] = defaultdict(lambda: {"ms": 0.0, "calls": 0})
    kernels, host = [], []
    for evt in prof.key_averages():
        if evt.self_cpu_time_total > 0:
            host.append({"name": evt.key[:120], "self_cpu_ms": evt.self_cpu_time_total / 1e3, "calls": evt.count})
        ms = evt.self_device_time_total / 1e3
        if ms <= 0 or not _is_kernel(evt):
            continue
        by_family[family(evt.key)] += ms
        kernels.append({"name": evt.key[:120], "ms": ms, "calls": evt.count})
        if (prep := roofline.kernel_family(evt.key)) is not None:
            preparation[prep]["ms"] += ms
            preparation[prep]["calls"] += evt.count
    kernels.sort(key=lambda k: -k["ms"])
    host.sort(key=lambda h: -h["self_cpu_ms"])
    timeline = [
        Kernel(evt.time_range.start, evt.time_range.end, roofline.kernel_family(evt.key) is not None, evt.key[:100])
        for evt in prof.events()
        if _is_kernel(evt) and evt.time_range.end > evt.time_range.start
    ]
    return gpu_idle(timeline) | {
        "cuda_ms": sum(by_family.values()),
        "families_ms": dict(sorted(by_family.items(), key=lambda kv: -kv[1])),
        "preparation": dict(preparation),
        "top_kernels": kernels[:40],
        "top_host_ops": host[:15],
    }


def plan_mix(model: torch.nn.Module) -> dict[str, int]:
    """How many layers of each kind (``wq``, ``w1``, ...) run each (forward, dgrad, wgrad)
    strategy triple: what the step's quantization work depends on."""
    from ..nn import model_plan

    triples = Counter(
        f"{name.rsplit('.', 1)[-1]} " + "/".join(s.value for s in plan.strategies().values())
        for name, plan in model_plan(model).items()
    )
    return dict(triples.most_common())


def plan_layers(model: torch.nn.Module) -> list[dict]:
    """Every converted layer's name, shape and frozen strategies: what ``roofline`` derives bytes from."""
    from ..nn import adahop_layers

    return [
        {
            "name": name,
            "in_features": layer.in_features,
            "out_features": layer.out_features,
            **{gemm: s.value for gemm, s in layer.plan.strategies().items()},
            "forward_fmt": layer.recipe.forward_fmt,
        }
        for name, layer in adahop_layers(model).items()
        if layer.plan is not None
    ]


def _trainer(recipe: str, case: Case, mode: str, settings: Settings, out: str):
    from ..models import MODEL_PRESETS
    from ..recipes import get_recipe
    from ..train import Trainer
    from ..train.config import DataConfig, ModelConfig, TrainConfig, TrainingConfig

    vocab = settings.vocab_size or MODEL_PRESETS[case.preset].vocab_size
    cfg = TrainConfig(
        model=ModelConfig(case.preset, overrides=dict(settings.model_overrides)),
        data=DataConfig(source=settings.data, seq_len=case.seq_len, batch_size=case.batch, vocab_size=vocab),
        training=TrainingConfig(
            steps=1_000_000,
            device=settings.device,
            grad_accum=case.accum,
            weight_operands_once_per_step=W_EACH not in mode,
            recompute_wgrad_operands=RECOMPUTE in mode,
            compile="compile" in base_mode(mode),
            cuda_graph="graph" in base_mode(mode),
        ),
        recipe=get_recipe({"name": PEERS.get(recipe, recipe), "calibration_steps": CALIBRATION_STEPS}),
        out=out,
    )
    return Trainer(cfg, progress=False)  # a torchao_float8 recipe's model is converted by torchao


class _StepTimer:
    """Per-step times without waiting on the device: CUDA events at the step boundaries (in the
    steady state their intervals are the steps' wall periods), host clock on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self.marks: list = []

    def mark(self) -> None:
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self.marks.append(event)
        else:
            self.marks.append(time.perf_counter())

    def step_ms(self) -> list[float]:
        if self.cuda:
            torch.cuda.synchronize()
            return [a.elapsed_time(b) for a, b in zip(self.marks, self.marks[1:])]
        return [(b - a) * 1e3 for a, b in zip(self.marks, self.marks[1:])]


def _memory_gib(device: torch.device) -> tuple[float | None, float | None]:
    """(peak allocated, peak reserved) GiB since the last reset; None on the CPU."""
    if device.type != "cuda":
        return None, None
    return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30


def measure(recipe: str, case: Case, mode: str, settings: Settings = Settings(), plan: str | None = None) -> dict:
    """Tokens/s of ``recipe`` in ``mode`` on ``case`` (timed after calibration and warm-up steps,
    which also absorb compilation and graph capture), every timed step's time, peak memory and a
    profiled step. A mode that did not take effect (no graph captured) is an error, not a result.
    ``plan``: a frozen plan's JSON (``ModelPlan.to_json``) to run instead of calibrating one."""
    from ..nn import load_plan, model_plan
    from ..policy.calibration import ModelPlan

    device = torch.device(settings.device)
    cuda = device.type == "cuda"
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(recipe, case, mode, settings, out)
        if plan is not None:
            load_plan(trainer.model, ModelPlan.from_json(plan))
        max_calibration, calibration_steps = 2 * CALIBRATION_STEPS, 0
        for _ in range(max_calibration):
            if trainer.phase != "calibrating":
                break
            trainer.train_step()
            calibration_steps += 1
        if trainer.phase == "calibrating":
            raise RuntimeError(f"{recipe}: calibration did not finish in {max_calibration} steps")
        for _ in range(settings.warmup_steps):
            trainer.train_step()
        if "graph" in mode and not trainer.graph_captured:
            raise RuntimeError(f"mode {mode}: no CUDA graph was captured on {device.type}")
        if cuda:
            torch.cuda.synchronize()
        # The whole run's peak (calibration, compilation, graph capture) before the steady state's.
        run_peak_reserved_gib = _memory_gib(device)[1]
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        timer = _StepTimer(device)
        start = time.perf_counter()
        timer.mark()
        losses = []
        for _ in range(settings.timed_steps):
            losses.append(trainer.train_step()[0])  # on the device: the step never waits
            timer.mark()
        step_ms = timer.step_ms()
        seconds = (time.perf_counter() - start) / settings.timed_steps
        losses = torch.stack(losses).tolist()
        peak_allocated, peak_reserved = _memory_gib(device)
        result = {
            "tokens_per_s": case.tokens_per_step / seconds,
            "step_ms": seconds * 1e3,
            "step_ms_each": step_ms,
            "step_ms_median": statistics.median(step_ms),
            "step_ms_min": min(step_ms),
            "step_ms_max": max(step_ms),
            "peak_allocated_gib": peak_allocated,
            "peak_reserved_gib": peak_reserved,
            "run_peak_reserved_gib": None if peak_reserved is None else max(run_peak_reserved_gib, peak_reserved),
            "final_loss": losses[-1],
            "losses_finite": all(math.isfinite(x) for x in losses),
            "cuda_graph_captured": trainer.graph_captured,
            "plan_mix": plan_mix(trainer.model),
            "layers": plan_layers(trainer.model),
            "calibration_steps": calibration_steps,
            "plan_reused": plan is not None,
            "plan": model_plan(trainer.model).to_json() if trainer.phase == "frozen" else None,
            "tokens_per_micro_step": case.batch * case.seq_len,
            "accum": case.accum,
            "merged": "compile" in mode,  # compiled blocks merge equal quantize calls
            "weight_operands_once_per_step": trainer.cfg.training.weight_operands_once_per_step and case.accum > 1,
            "recompute_wgrad_operands": trainer.cfg.training.recompute_wgrad_operands and "compile" in mode,
            "shared_folds": True,  # and the folds of a shared Xᵀ with them (ops.fold_fp8, a node of its own)
            "profile": _profile(trainer.train_step, device),
        }
    return result


def _gib(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def _spread(r: dict) -> str:
    """The timed steps' median and range, ms (results before per-step times were kept: nothing)."""
    if "step_ms_median" not in r:
        return "-"
    return f"{r['step_ms_median']:.1f} [{r['step_ms_min']:.1f}-{r['step_ms_max']:.1f}]"


def _one_line(r: dict) -> str:
    """A run's figures as soon as it ends (a run cut off by a time limit keeps what it printed)."""
    if "error" in r:
        return r["error"]
    fams = ", ".join(f"{f} {ms:.1f}" for f, ms in r["profile"]["families_ms"].items())
    return (
        f"{r['tokens_per_s']:,.0f} tok/s, step {r['step_ms']:.1f} ms (median [range] {_spread(r)}), "
        f"CUDA {r['profile']['cuda_ms']:.1f} ms, peak {_gib(r['peak_allocated_gib'])}/{_gib(r['peak_reserved_gib'])}"
        f"{_run_peak(r)} GiB, graph {r['cuda_graph_captured']}; {fams}"
    )


def _run_peak(r: dict) -> str:
    """The whole run's reserved peak where it exceeds the timed steps' (results before it was kept: nothing)."""
    run_peak, steady = r.get("run_peak_reserved_gib"), r.get("peak_reserved_gib")
    return f" ({run_peak:.1f})" if run_peak is not None and steady is not None and run_peak > steady + 0.05 else ""


def _failure(err: BaseException) -> dict:
    return {"error": f"{type(err).__name__}: {str(err)[:300]}"}


def _run_one(recipe: str, case: Case, mode: str, settings: Settings, plan: str | None = None) -> dict:
    """``measure`` in a fresh process; a failure is returned as ``{"error": ...}``."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context) as pool:
        try:
            return pool.submit(measure, recipe, case, mode, settings, plan).result()
        except Exception as err:  # one failing run must not lose the others
            return _failure(err)


def run_case(case: Case, on_run: Callable[[dict], None] = lambda runs: None, settings: Settings = Settings()) -> dict:
    """Every run of ``case`` in a fresh process (``fastest``: each of ``settings.fastest_modes``
    until one runs; the ones that failed stay in the table), with its ratios to the references.
    A recipe's later runs (its A/B modes) run the plan its first run calibrated: a calibration
    near a threshold can freeze other strategies in another process, and the A/B would then
    compare two plans."""
    from importlib.util import find_spec

    from ..recipes import get_recipe

    runs: dict[str, dict] = {}
    plans: dict[str, str] = {}  # recipe -> the plan its first successful run froze
    for recipe, requested in case.runs:
        base = base_mode(requested)
        for mode in [m + requested[len(base) :] for m in settings.fastest_modes] if base == FASTEST else (requested,):
            name = f"{recipe}/{mode}"
            if get_recipe(PEERS.get(recipe, recipe)).torchao_float8 and find_spec("torchao") is None:
                runs[name] = {"error": "torchao is not installed"}
            else:
                runs[name] = _run_one(recipe, case, mode, settings, plans.get(recipe))
            if (plan := runs[name].pop("plan", None)) is not None:
                plans.setdefault(recipe, plan)
            runs[name] |= {"recipe": recipe, "mode": mode}
            on_run(runs)
            print(f"  {case.key} {name}: {_one_line(runs[name])}", flush=True)
            if "error" not in runs[name] or runs[name]["error"] == "torchao is not installed":
                break
    add_ratios(runs)
    from ..models import MODEL_PRESETS

    return {
        "preset": case.preset,
        "vocab_size": settings.vocab_size or MODEL_PRESETS[case.preset].vocab_size,
        "batch": case.batch,
        "accum": case.accum,
        "seq_len": case.seq_len,
        "runs": runs,
        "best_mode": {recipe: r["mode"] for recipe, r in best_runs(runs).items()},
    }


def add_ratios(runs: dict[str, dict]) -> None:
    """Each successful run's speed (wall and CUDA time) and reserved memory relative to each reference
    in its fastest mode, and to BF16 in the same mode."""
    best = best_runs(runs)
    for r in runs.values():
        if "error" in r:
            continue
        for reference in REFERENCES:
            base = best.get(reference)
            if base is None:
                continue
            suffix = "bf16_best" if reference == "bf16" else reference
            r[f"speedup_vs_{suffix}"] = r["tokens_per_s"] / base["tokens_per_s"]
            if r["profile"]["cuda_ms"] and base["profile"]["cuda_ms"]:  # none on the CPU
                r[f"cuda_speedup_vs_{suffix}"] = base["profile"]["cuda_ms"] / r["profile"]["cuda_ms"]
            if r.get("run_peak_reserved_gib") and base.get("run_peak_reserved_gib"):
                r[f"run_peak_reserved_ratio_vs_{suffix}"] = r["run_peak_reserved_gib"] / base["run_peak_reserved_gib"]
        same_mode = runs.get(f"bf16/{r['mode']}")
        if same_mode is not None and "error" not in same_mode:
            r["speedup_vs_bf16_same_mode"] = r["tokens_per_s"] / same_mode["tokens_per_s"]
            if r["peak_reserved_gib"] and same_mode["peak_reserved_gib"]:
                r["peak_reserved_ratio_vs_bf16_same_mode"] = r["peak_reserved_gib"] / same_mode["peak_reserved_gib"]


def best_runs(runs: dict[str, dict]) -> dict[str, dict]:
    """Per recipe, its fastest successful run."""
    best: dict[str, dict] = {}
    for r in runs.values():
        if "error" not in r and r["tokens_per_s"] > best.get(r["recipe"], {}).get("tokens_per_s", 0):
            best[r["recipe"]] = r
    return best


def _ratio(case: dict, recipe: str, reference: str, key: str = "tokens_per_s") -> float | None:
    best = best_runs(case["runs"])
    if recipe in best and reference in best and best[recipe].get(key) and best[reference].get(key):
        return best[recipe][key] / best[reference][key]
    return None


def _copy_gb_per_s() -> float:
    """The device's copy bandwidth (bytes read + written), the roofline's ceiling."""
    from .common import copy_gb_per_s

    return copy_gb_per_s()


def add_rooflines(results: dict, copy_gb_per_s: float) -> None:
    """Each adahop run's preparation roofline, at the bandwidth measured in the same bench run."""
    for case in results["cases"].values():
        for r in case["runs"].values():
            if "error" not in r and (table := roofline.roofline(r, copy_gb_per_s)) is not None:
                r["roofline"] = table


def run(cases: tuple[Case, ...] = CASES, partial: Path | None = None, settings: Settings = Settings()) -> dict:
    """Every case, and the headline ratios (best mode against best mode). ``partial``: a JSON
    file rewritten (atomically) after every run, so a run cut off by a time limit keeps the rest."""
    from ..data import prepare_data
    from ..models import MODEL_PRESETS

    for vocab in sorted({settings.vocab_size or MODEL_PRESETS[c.preset].vocab_size for c in cases}):
        prepare_data(settings.data, vocab, progress=False)  # tokenize once; every run reads the cache
    results: dict = {"seq_len": SEQ_LEN, "data": settings.data, "timed_steps": settings.timed_steps, "cases": {}}
    copy_bw = None
    if settings.device == "cuda":
        with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
            copy_bw = results["copy_gb_per_s"] = pool.submit(_copy_gb_per_s).result()  # a process of its own
    for case in cases:

        def save(runs: dict, key: str = case.key) -> None:
            if partial is not None:
                write_atomic(partial, json.dumps(results | {"partial": {key: runs}}, indent=1))

        results["cases"][case.key] = run_case(case, save, settings)
        if partial is not None:
            write_atomic(partial, json.dumps(results, indent=1))
    if copy_bw is not None:
        add_rooflines(results, copy_bw)
    headlines = {
        "train_step_speedup_vs_bf16": ("llama3_1b_4x2048", "bf16", "tokens_per_s"),
        "train_step_speedup_vs_bf16_1b_8x": ("llama3_1b_8x2048", "bf16", "tokens_per_s"),
        "train_step_speedup_vs_bf16_3b": ("llama3_3b_4x2048", "bf16", "tokens_per_s"),
        "train_step_speedup_vs_float8": ("llama3_1b_4x2048", "float8_tensorwise", "tokens_per_s"),
        "train_step_speedup_vs_float8_1b_8x": ("llama3_1b_8x2048", "float8_tensorwise", "tokens_per_s"),
        "train_step_speedup_vs_float8_3b": ("llama3_3b_4x2048", "float8_tensorwise", "tokens_per_s"),
        "peak_memory_ratio_vs_bf16": ("llama3_1b_8x2048", "bf16", "peak_reserved_gib"),
        "run_peak_memory_ratio_vs_bf16": ("llama3_1b_8x2048", "bf16", "run_peak_reserved_gib"),
        "run_peak_memory_ratio_vs_float8": ("llama3_1b_8x2048", "float8_tensorwise", "run_peak_reserved_gib"),
    }
    for name, (key, reference, metric) in headlines.items():
        if key in results["cases"] and (value := _ratio(results["cases"][key], HEADLINE_RECIPE, reference, metric)):
            results[name] = value
    return results


def select_cases(keys: list[str], runs: list[str] | None = None, cases: tuple[Case, ...] = CASES) -> tuple[Case, ...]:
    """The cases named by ``keys`` (``Case.key``; all when empty), in the order given. With
    ``runs``, each runs exactly those named: "recipe/mode" in every case, "CASE:recipe/mode" in
    one (mode one of ``MODES`` or ``fastest``, optionally followed by ``SUFFIXES``); otherwise its
    default runs."""
    known = {c.key: c for c in cases}
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ValueError(f"unknown step cases {unknown}; choose from {sorted(known)}")
    chosen = tuple(known[k] for k in keys) or cases
    if runs is None:
        return chosen
    parsed = []
    for name in runs:
        case_key, _, run = name.rpartition(":")
        recipe, _, mode = run.partition("/")
        if recipe not in RECIPES or base_mode(mode) not in (*MODES, FASTEST) or (case_key and case_key not in known):
            raise ValueError(
                f"unknown step run {name!r}; write [CASE:]RECIPE/MODE with RECIPE one of {RECIPES}, "
                f"MODE one of {(*MODES, FASTEST)} (+ {W_EACH!r}: W quantized every micro-batch, + {RECOMPUTE!r}: wgrad's "
                f"operands recomputed in compiled blocks) and CASE one "
                f"of {sorted(known)}"
            )
        parsed.append((case_key, (recipe, mode)))
    return tuple(
        Case(c.preset, c.batch, tuple(r for k, r in parsed if k in ("", c.key)), c.accum, c.seq_len) for c in chosen
    )


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value:.2f}x"


def _case_title(case: dict) -> str:
    accum = case.get("accum", 1)
    batch = f"{case['batch']} x {case['seq_len']}"
    return f"`{case['preset']}`, " + (f"{accum} micro-batches of {batch}" if accum > 1 else f"micro-batch {batch}")


def markdown(step: dict) -> list[str]:
    """This section of the bench summary: one table per case, one memory table, one of GPU idle time,
    the rooflines."""
    lines: list[str] = []
    for key, case in step["cases"].items():
        vocab = case.get("vocab_size", step.get("vocab_size"))  # older results: one for every case
        lines += [
            "",
            f"Training steps of {_case_title(case)} (vocabulary {vocab}), `adahop train`'s step timed after "
            f"calibration ({step.get('timed_steps', 12)} steps: mean, and median [range] of each step); speed "
            "relative to BF16 and to float8 tensorwise, each in its fastest mode, in wall time and in the "
            "profiled step's CUDA time; CUDA ms by kernel family:",
            "",
            "| recipe / mode | tokens/s | vs bf16 (wall / CUDA) | vs float8 tw (wall / CUDA) | vs bf16 same mode | "
            "step ms | median [range] ms | CUDA ms | peak alloc / reserved GiB (whole run) | CUDA ms by family |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, r in case["runs"].items():
            if "error" in r:
                lines.append(f"| {name} | failed: {r['error'][:120]} | | | | | | | | |")
                continue
            fams = ", ".join(f"{f} {ms:.1f}" for f, ms in r["profile"]["families_ms"].items())
            lines.append(
                f"| {name} | {r['tokens_per_s']:,.0f} | {_x(r.get('speedup_vs_bf16_best'))} / "
                f"{_x(r.get('cuda_speedup_vs_bf16_best'))} | {_x(r.get('speedup_vs_float8_tensorwise'))} / "
                f"{_x(r.get('cuda_speedup_vs_float8_tensorwise'))} | {_x(r.get('speedup_vs_bf16_same_mode'))} | "
                f"{r['step_ms']:.1f} | {_spread(r)} | {r['profile']['cuda_ms']:.1f} | "
                f"{_gib(r['peak_allocated_gib'])} / {_gib(r['peak_reserved_gib'])}{_run_peak(r)} | {fams} |"
            )
    lines += memory_markdown(step)
    lines += idle_markdown(step)
    for key, case in step["cases"].items():
        for name, r in case["runs"].items():
            if "roofline" in r:
                lines += roofline.markdown(f"{key} {name}", r["roofline"])
    return lines


def memory_markdown(step: dict) -> list[str]:
    """Peak reserved memory of every recipe in its fastest mode, every case, in one table."""
    rows = []
    for key, case in step["cases"].items():
        for recipe, r in best_runs(case["runs"]).items():
            rows.append(
                f"| {key} | {recipe} / {r['mode']} | {_gib(r['peak_reserved_gib'])} | "
                f"{_gib(r.get('run_peak_reserved_gib'))} | {_x(r.get('run_peak_reserved_ratio_vs_bf16_best'))} | "
                f"{_x(r.get('run_peak_reserved_ratio_vs_float8_tensorwise'))} |"
            )
    if not rows:
        return []
    return [
        "",
        "Peak reserved memory, every recipe in its fastest mode (GiB; the whole run includes calibration, "
        "compilation and graph capture; ratios of the whole run's peaks):",
        "",
        "| case | recipe / mode | timed steps | whole run | vs bf16 | vs float8 tw |",
        "|---|---|---:|---:|---:|---:|",
        *rows,
    ]


# The idle table names each run's longest gaps, kernel names cut to this many characters.
LISTED_GAPS = 3
NAME_CHARS = 48


def idle_markdown(step: dict) -> list[str]:
    """The profiled step's GPU span, busy and idle time beside the wall step, every run with kernels
    (none on the CPU: no table)."""
    rows, longest = [], []
    for key, case in step["cases"].items():
        for name, r in case["runs"].items():
            if "error" in r or "gpu_span_ms" not in (p := r["profile"]):
                continue
            rows.append(
                f"| {key} | {name} | {r['step_ms']:.1f} | {p['gpu_span_ms']:.1f} | {p['gpu_busy_ms']:.1f} | "
                f"{p['gpu_idle_ms']:.2f} | {p['gpu_idle_next_to_preparation_ms']:.2f} | {p['gpu_gaps']} | "
                f"{p['gpu_long_gaps']} / {p['gpu_idle_long_gaps_ms']:.2f} |"
            )
            gaps = "; ".join(
                f"{g['ms']:.2f} at {g['at_ms']:.1f} (`{g['after'][:NAME_CHARS]}` -> `{g['before'][:NAME_CHARS]}`)"
                for g in p.get("gpu_longest_gaps", [])[:LISTED_GAPS]
            )
            if gaps:
                longest.append(f"- {key} {name}: {gaps}")
    if not rows:
        return []
    return [
        "",
        "GPU idle inside the step: the profiled step's first kernel start to last kernel end (span), the union "
        "of its kernels (busy) and the gaps between them (idle), the gaps with a preparation kernel on either "
        f"side, and the gaps over {LONG_GAP_US:g} us (waits on the host, not launch latency). Wall is the timed "
        "steps' mean: wall - span is time before the step's first kernel or after its last (host work between "
        "steps), as far as profiling leaves the step's time unchanged:",
        "",
        "| case | recipe / mode | wall ms | span ms | busy ms | idle ms | idle next to preparation ms | gaps | "
        f"gaps > {LONG_GAP_US:g} us: n / ms |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        *(
            ["", "The longest gaps of each run (ms, at ms into the step, the kernel before -> after):", "", *longest]
            if longest
            else []
        ),
    ]
