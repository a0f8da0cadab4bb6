"""End-to-end training steps: tokens/s of a Llama per recipe against BF16, and where the time goes.

The layer benchmark isolates the linear layers; this one runs whole optimizer steps (embedding,
attention, norms, AdamW, the per-layer Python) the way ``adahop train`` does: fp32 master weights,
bf16 autocast, fused AdamW, the embedded corpus. Adaptive recipes calibrate first; timing starts
after every layer has frozen its plan. One step per recipe is profiled and its CUDA time split
into kernel families, so a slowdown can be traced to what causes it. BF16 and AdaHOP level 2 also
run with their transformer blocks compiled after calibration (``training.compile``), and are
compared with each other.
"""

from __future__ import annotations

import multiprocessing
import time
from collections import defaultdict
from concurrent.futures import ProcessPoolExecutor

import torch

from ..nn import adahop_layers, convert_model

PRESET = "llama3_1b"
BATCH, SEQ_LEN = 4, 2048
RECIPES = ("bf16", "mxfp4", "mxfp4_hadamard", "adahop_lv2")
COMPILED_RECIPES = ("bf16", "adahop_lv2")  # also timed with torch.compile'd blocks
CALIBRATION_STEPS = 4  # forwards: enough to freeze a plan, not to judge its quality
WARMUP_STEPS, TIMED_STEPS = 3, 10
# Kernel families by name fragment, first match wins; the rest is "other".
FAMILIES = (
    ("quantize (Triton)", ("_quantize_",)),
    ("fold (Triton)", ("_fold_kernel",)),
    ("FP8 GEMM", ("f8", "fp8", "e4m3")),
    ("attention", ("flash", "fmha", "attention", "sdpa")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "sm90_xmma", "matmul")),
    ("optimizer", ("adam",)),
    ("top-k / index", ("topk", "index", "gather", "scatter", "sort", "radix")),
    ("norm / reduce", ("norm", "reduce")),
    ("elementwise", ("elementwise", "vectorized", "unrolled")),
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
        "top_kernels": kernels[:12],
        "top_host_ops": host[:15],
    }


def measure(recipe: str, preset: str, data, compiled: bool = False) -> dict:
    """Tokens/s of ``recipe`` (timed after calibration), its peak memory and a profiled step;
    ``compiled`` compiles the blocks once calibration is over (warm-up steps absorb the compile)."""
    from ..data import BatchLoader
    from ..models import build_model

    torch.manual_seed(0)
    model = build_model(preset, vocab_size=data.tokenizer.vocab_size).cuda()
    convert_model(model, {"name": recipe, "calibration_steps": CALIBRATION_STEPS})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    loader = BatchLoader(data.train, batch_size=BATCH, seq_len=SEQ_LEN, seed=0)

    def step() -> None:
        inputs, targets = (t.cuda(non_blocking=True) for t in next(loader))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = model(inputs, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(CALIBRATION_STEPS):
        step()
    assert not any(m.calibrating for m in adahop_layers(model).values()), "calibration did not finish"
    if compiled:
        model.compile_blocks()
    for _ in range(WARMUP_STEPS):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(TIMED_STEPS):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / TIMED_STEPS
    return {
        "tokens_per_s": BATCH * SEQ_LEN / seconds,
        "step_ms": seconds * 1e3,
        "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
        "profile": _profile(step),
    }


def measure_in_fresh_process(recipe: str, preset: str, compiled: bool = False) -> dict:
    """:func:`measure` in a process of its own. A step of many small launches is host-bound, and
    its Python runs measurably slower in a process that has already run other benchmarks (the
    same adahop_lv2 step took 190 ms in a fresh process and 274 ms after the other sections, on
    the same kind of H200)."""
    from ..data import prepare_data

    return measure(recipe, preset, prepare_data("stdlib", progress=False), compiled)


def run(
    preset: str = PRESET, recipes: tuple[str, ...] = RECIPES, compiled_recipes: tuple[str, ...] = COMPILED_RECIPES
) -> dict:
    """Every recipe's :func:`measure`, each in a fresh process, with its speed relative to BF16
    (a compiled recipe relative to compiled BF16)."""
    results: dict = {"preset": preset, "batch": BATCH, "seq_len": SEQ_LEN, "recipes": {}}
    context = multiprocessing.get_context("spawn")
    runs = [(r, False) for r in recipes] + [(r, True) for r in compiled_recipes]
    for recipe, compiled in runs:
        with ProcessPoolExecutor(1, mp_context=context) as pool:
            result = pool.submit(measure_in_fresh_process, recipe, preset, compiled).result()
        results["recipes"][f"{recipe}+compile" if compiled else recipe] = result | {"compiled": compiled}
    for r in results["recipes"].values():
        base = results["recipes"]["bf16+compile" if r["compiled"] else "bf16"]["tokens_per_s"]
        r["speedup_vs_bf16"] = r["tokens_per_s"] / base
    if "adahop_lv2" in results["recipes"]:
        results["train_step_speedup_vs_bf16"] = results["recipes"]["adahop_lv2"]["speedup_vs_bf16"]
    if "adahop_lv2+compile" in results["recipes"]:
        results["train_step_speedup_vs_bf16_compiled"] = results["recipes"]["adahop_lv2+compile"]["speedup_vs_bf16"]
    return results
