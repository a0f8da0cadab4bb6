"""What a training run keeps alive, and what a step allocates on top, phase by phase, counted on the CPU (issue 30).

On the H200 the adaptive recipes reserve 6-7 GiB more than what their compiled blocks keep for backward
explains (benchmarks/linear/2026-12-05-cpu-saved-bytes/README.md), about 7 bytes per linear weight element.
This builds the trainer the step bench builds (``adahop.bench.step._trainer``: fp32 master weights, AdamW,
the recipe's calibration, ``training.compile`` as asked, gradient accumulation as asked) on a small model, and
after each phase (calibrating steps, the freeze, frozen steps, mid-accumulation: between two micro-batches)
lists every live tensor, each storage counted once, by owner:

- ``parameters``, ``gradients``, ``optimizer state``: what every recipe holds;
- ``buffers``: module buffers by name (calibration statistics ``_step_*``, ``hadamard_signs``, rotary tables);
- ``kept W operands``: ``nn.weight_cache``'s eager ``OperandCache`` and compiled ``KeptOperands`` entries;
- ``caches``: tensors held by the kernels' and formats' ``functools`` caches;
- ``trainer``: the trainer's own device tensors; ``other``: anything else (listed by shape).

Every figure is in bytes per linear weight element (the converted layers' ``in * out``), so it reads directly
as GiB at `llama3_1b` (973M linear weights: 1 byte per element is 0.91 GiB). Also per phase: the micro-steps'
peak of allocated bytes above what was live before each (CPU allocator events of ``torch.profiler``), and the
bytes of tensors made since the first step began that are still alive (on a GPU, what an eager calibrating step
makes to keep sits wherever its freed activations were, and keeps those segments reserved: ``allocator_sim.py``).
``--fold-route`` quantizes into the H200's folded E4M3 forms (the reference's products), to count what that
route keeps.

    PYTHONPATH=src python benchmarks/step/live_tensors.py --out benchmarks/linear/2026-12-05-cpu-saved-bytes
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import platform
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from adahop.bench.step import Case, Settings, _trainer
from adahop.nn import adahop_layers

RECIPES = ("bf16", "adahop_lv2", "adahop_lv1_bf16_forward", "adahop_lv1_fp8_forward")
# Small but with weights that outweigh a micro-batch's activations, so W-sized items stand out.
SETTINGS = Settings(
    device="cpu",
    vocab_size=512,
    model_overrides=(("n_layers", 2), ("dim", 256), ("n_heads", 4), ("n_kv_heads", 2), ("max_seq_len", 64)),
)
CALIBRATION_STEPS = 2


def tensors_in(obj, depth: int = 0) -> Iterator[torch.Tensor]:
    """Every tensor reachable from ``obj`` through containers and dataclasses (GemmOperand, MXTensor...)."""
    if depth > 6 or obj is None:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from tensors_in(value, depth + 1)
    elif isinstance(obj, (list, tuple, set)):
        for value in obj:
            yield from tensors_in(value, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from tensors_in(getattr(obj, f.name), depth + 1)
    elif hasattr(obj, "__dict__") and type(obj).__module__.startswith("adahop"):
        yield from tensors_in(vars(obj), depth + 1)


def _key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _cached_tensors() -> list[torch.Tensor]:
    """Tensors held by the ``functools`` caches of adahop's modules: a cache wrapper's referents are its
    ``lru_cache`` results (C implementation) or the dict of its ``functools.cache`` results."""
    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("adahop"):
            continue
        for value in vars(module).values():
            if hasattr(value, "cache_info") and hasattr(value, "__wrapped__"):
                for ref in gc.get_referents(value):
                    found += tensors_in(ref) if isinstance(ref, (torch.Tensor, tuple)) else []
                    found += tensors_in(list(ref.values())) if isinstance(ref, dict) and "__module__" not in ref else []
    return found


def owners(trainer) -> dict[int, tuple[str, torch.Tensor]]:
    """Storage -> (the owner it is charged to, a tensor of it); the first claim wins (parameters before
    what aliases them). Gradients have no Python object until read, so ``gc`` alone would miss them."""
    model, claims = trainer.model, {}

    def claim(category: str, tensors) -> None:
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.untyped_storage().nbytes():
                claims.setdefault(_key(t), (category, t))

    claim("parameters", model.parameters())
    claim("gradients", (p.grad for p in model.parameters()))
    claim("optimizer state", tensors_in(dict(trainer.optimizer.state)))
    for name, buffer in model.named_buffers():
        leaf = name.rsplit(".", 1)[-1]
        claim(f"buffers: {'_step_*' if leaf.startswith('_step_') else leaf}", [buffer])
    for layer in adahop_layers(model).values():
        cache = layer.__dict__.get("_operand_cache")
        if cache is not None:
            claim("kept W operands (eager OperandCache)", tensors_in([e.value for e in cache._entries.values()]))
        claim("kept W operands (KeptOperands)", tensors_in(layer._kept_operands.entries))
        claim("layer state (_extra_state)", [layer._extra_state])
    if trainer._graphed is not None:
        claim("graphs: kept W operands (GraphOperands)", tensors_in(trainer._graphed._operands.kept))
        claim("graphs: static inputs and losses", tensors_in([trainer._graphed._inputs, trainer._graphed._targets]))
        claim("graphs: static inputs and losses", tensors_in(trainer._graphed._losses))
    claim("trainer", tensors_in({k: v for k, v in vars(trainer).items() if isinstance(v, torch.Tensor)}))
    claim("caches (functools)", _cached_tensors())
    return claims


def live(claims: dict[int, tuple[str, torch.Tensor]]) -> dict[int, torch.Tensor]:
    """Every live CPU tensor reachable from Python or claimed by an owner, one per storage."""
    gc.collect()
    found: dict[int, torch.Tensor] = {key: t for key, (_, t) in claims.items()}
    for obj in gc.get_objects():
        try:
            if isinstance(obj, torch.Tensor) and not obj.is_meta and obj.device.type == "cpu":
                if obj.untyped_storage().nbytes():
                    found.setdefault(_key(obj), obj)
        except (RuntimeError, ReferenceError):  # a tensor without storage (a subclass wrapper)
            continue
    return found


def linear_weight_elements(model: nn.Module) -> int:
    """Elements of the weights the recipes convert (every block linear; not the embedding or the LM head)."""
    return sum(m.weight.numel() for name, m in model.named_modules() if isinstance(m, nn.Linear) and "layers" in name)


def account(trainer, phase: str, born_before: set[int] | None = None) -> dict:
    claims = owners(trainer)
    tensors = live(claims)
    per = linear_weight_elements(trainer.model)
    by_owner: dict[str, int] = defaultdict(int)
    other: dict[str, int] = defaultdict(int)
    for key, t in tensors.items():
        nbytes = t.untyped_storage().nbytes()
        owner = claims.get(key, ("other",))[0]
        by_owner[owner] += nbytes
        if owner == "other":
            other[f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"] += nbytes
    row = {
        "phase": phase,
        "trainer_phase": trainer.phase,
        "bytes_per_linear_weight": {k: round(v / per, 4) for k, v in sorted(by_owner.items())},
        "other": {k: round(v / per, 4) for k, v in sorted(other.items(), key=lambda kv: -kv[1])[:12]},
    }
    if born_before is not None:  # tensors born since ``born_before`` was taken, alive now
        row["born_since_bytes_per_linear_weight"] = {}
        for key, t in tensors.items():
            if key not in born_before:
                owner = claims.get(key, ("other",))[0]
                entry = row["born_since_bytes_per_linear_weight"]
                entry[owner] = round(entry.get(owner, 0) + t.untyped_storage().nbytes() / per, 4)
    return row


def peak_of(fn, per: int) -> tuple[object, float]:
    """``fn()``, and the peak of CPU bytes allocated during it above the level at its start, per linear weight."""
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    level = peak = 0
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    for e in sorted(events, key=lambda e: e.start_ns()):
        level += e.nbytes()
        peak = max(peak, level)
    return out, round(peak / per, 4)


def run(recipe: str, compiled: bool, accum: int, n_layers: int = 2, frozen_steps: int = 2) -> list[dict]:
    import adahop.bench.step as step_bench

    case = Case("tiny", 2 if accum == 1 else 1, ((recipe, "eager"),), accum=accum, seq_len=32)
    mode = "compile" if compiled else "eager"
    rows: list[dict] = []
    torch._dynamo.reset()
    with tempfile.TemporaryDirectory() as out:
        previous, step_bench.CALIBRATION_STEPS = step_bench.CALIBRATION_STEPS, CALIBRATION_STEPS
        try:
            overrides = (*SETTINGS.model_overrides, ("n_layers", n_layers))  # the later pair wins
            trainer = _trainer(recipe, case, mode, dataclasses.replace(SETTINGS, model_overrides=overrides), out)
        finally:
            step_bench.CALIBRATION_STEPS = previous
        per = linear_weight_elements(trainer.model)
        rows.append(account(trainer, "built"))
        before_steps = set(live(owners(trainer)))
        micro, seen, peaks = trainer._micro_step, [], []

        def micro_step(*args, **kwargs):  # each micro-batch's peak; mid-accumulation: after a frozen step's first
            loss, peak = peak_of(lambda: micro(*args, **kwargs), per)
            peaks.append(peak)
            if kwargs.get("first") and accum > 1 and trainer.phase != "calibrating" and not seen:
                seen.append(1)
                rows.append(account(trainer, "mid-accumulation (after micro-batch 1 of a frozen step)"))
            return loss

        trainer._micro_step = micro_step

        def step(name: str) -> None:
            peaks.clear()
            trainer.train_step()
            rows.append(account(trainer, name, before_steps) | {"micro_step_peak_bytes_per_linear_weight": max(peaks)})

        calibrating = 0
        while trainer.phase == "calibrating":
            calibrating += 1
            step(f"calibrating step {calibrating}")
            if trainer.phase != "calibrating":
                rows[-1]["phase"] = "freeze step"
        for i in range(frozen_steps):
            step(f"{trainer.phase} step {i + 1} (after the optimizer step)")
        rows[-1]["compiled"] = trainer._compiled
    for row in rows:
        row.update(recipe=recipe, mode=mode, accum=accum, n_layers=n_layers, linear_weight_elements=per)
    return rows


COMMON = ("parameters", "gradients", "optimizer state")  # what every recipe holds


def markdown(rows: list[dict]) -> str:
    """Per run: what it holds beyond parameters, gradients and optimizer state after its last step and
    between two micro-batches, the optimizer state made after the first step began, and the micro-steps'
    transient peak, in bytes per linear weight element."""
    lines = [
        "| recipe | mode | accum | held beyond params, grads, moments after the last step | between micro-batches "
        "| moments made after the first step began | micro-step peak (frozen) |",
        "|---|---|---:|---|---|---:|---:|",
    ]
    runs: dict[tuple, list[dict]] = defaultdict(list)
    for row in rows:
        runs[row["recipe"], row["mode"], row["accum"]].append(row)

    def beyond(row: dict) -> str:
        held = {k: v for k, v in row["bytes_per_linear_weight"].items() if k not in COMMON and v >= 0.02}
        return ", ".join(f"{k} {v:.2f}" for k, v in held.items()) or "-"

    for (recipe, mode, accum), phases in runs.items():
        last = phases[-1]
        mid = next((r for r in phases if r["phase"].startswith("mid")), None)
        born = last.get("born_since_bytes_per_linear_weight", {}).get("optimizer state", 0.0)
        lines.append(
            f"| {recipe} | {mode} | {accum} | {beyond(last)} | {'-' if mid is None else beyond(mid)} | {born:.2f} "
            f"| {last['micro_step_peak_bytes_per_linear_weight']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="folder for live_tensors.json")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES))
    parser.add_argument("--modes", nargs="+", default=["eager", "compile"])
    parser.add_argument("--accum", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--n-layers", type=int, default=2, help="blocks: per-block items fall per linear weight")
    parser.add_argument(
        "--fold-route",
        action="store_true",
        help="operands in the H200's folded E4M3 forms (ops.folds_into_fp8 forced on; the reference's math)",
    )
    a = parser.parse_args()
    if a.fold_route:  # what the fold_fp8 route quantizes into and keeps; the products stay the reference's
        import adahop.ops

        adahop.ops.folds_into_fp8 = lambda device, n: True
    rows = []
    for recipe in a.recipes:
        for mode in a.modes:
            for accum in a.accum:
                for row in run(recipe, mode == "compile", accum, a.n_layers):
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        meta = {"torch": torch.__version__, "python": platform.python_version()}
        (a.out / "live_tensors.json").write_text(json.dumps({**meta, "rows": rows}, indent=1) + "\n")
        (a.out / "live_tensors.md").write_text(markdown(rows))


if __name__ == "__main__":
    main()
