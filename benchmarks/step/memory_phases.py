"""Where a step bench run's peak reserved memory comes from, phase by phase (issue 30; for the GPU).

``benchmarks/linear/saved_bytes.py`` counts what the compiled blocks keep for backward on the CPU: it
explains float8's saving over BF16 (8.8 of the 8.9 GiB measured at `llama3_1b` 8 x 2048) but not the
adahop recipes' reserved memory, which is 6-7 GiB above what their saved tensors predict. This runs one
recipe as ``adahop bench --only step`` does (same trainer, case and mode) and records, after each phase
(calibration, the first frozen step: compilation and the eager warm-up, the capture step, the timed
steps), the peak reserved and allocated memory of that phase, the caching allocator's
``inactive_split_bytes`` (free but unusable: fragmentation), each memory pool's reserved and allocated
bytes and its ``pinned_free`` bytes (free inside segments that also hold a live block: a CUDA graph's
private pool cannot use the default pool's), and what the run holds (parameters, gradients, optimizer
state, W's operands kept over an optimizer step). ``--snapshot`` also writes the allocator's history of
the capture step (``torch.cuda.memory._dump_snapshot``; open it at https://pytorch.org/memory_viz).
``--lazy-optimizer-state`` makes the optimizer state at the first step, as before
``train.optim.allocate_state``: for adaptive recipes that step is an eager calibrating one, and the A/B
tells whether its moments pinning freed segments is the excess (benchmarks/linear/2026-12-05-cpu-saved-bytes).

    python benchmarks/step/memory_phases.py --recipe adahop_lv2 --case llama3_1b_8x2048 --out $OUT
    python benchmarks/step/memory_phases.py --recipe bf16 --dry-run   # the plumbing, on the CPU

One recipe per process: each reads the peaks of a fresh allocator. ``memory_phases_h200.sh`` runs the
recipes of issue 30's memory table in one device call.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from collections import defaultdict
from pathlib import Path

import torch

from live_tensors import tensors_in  # this folder's

from adahop.bench.step import CALIBRATION_STEPS, CASES, DRY_RUN, DRY_RUN_CASES, FASTEST_MODES, Settings, _trainer
from adahop.train import trainer as trainer_module

GIB = 2**30


def _pools() -> dict[str, dict[str, float]]:
    """Per memory pool (``default``, the streams' own, or a graph pool's id): GiB reserved, allocated, and
    free inside segments that also hold a live block (``pinned_free``: ``empty_cache`` cannot return them,
    and a graph's private pool cannot use the default pool's), and the segment count."""
    pools: dict[str, dict[str, float]] = defaultdict(lambda: {"reserved": 0.0, "allocated": 0.0, "pinned_free": 0.0})
    for segment in torch.cuda.memory_snapshot():
        pool = segment.get("segment_pool_id", (0, 0))
        row = pools["default" if tuple(pool) == (0, 0) else f"graph {tuple(pool)}"]
        row["reserved"] += segment["total_size"] / GIB
        row["allocated"] += segment["allocated_size"] / GIB
        if segment["allocated_size"]:
            row["pinned_free"] += (segment["total_size"] - segment["allocated_size"]) / GIB
        row["segments"] = row.get("segments", 0) + 1
    return dict(pools)


def _held(trainer) -> dict[str, float]:
    """GiB of what the run holds besides activations: parameters, gradients, optimizer state, and W's
    operands kept over an optimizer step's micro-batches (the graphs' ``GraphOperands``)."""

    def gib(tensors) -> float:
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors if t is not None}
        return sum(storages.values()) / GIB

    params = list(trainer.model.parameters())
    state = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t) and t.dim()]
    graphed = trainer._graphed
    kept = [] if graphed is None or graphed._operands.kept is None else list(tensors_in(graphed._operands.kept))
    return {
        "parameters": gib(params),
        "gradients": gib(p.grad for p in params),
        "optimizer_state": gib(state),
        "kept_w_operands": gib(kept),
    }


def _phase(name: str, cuda: bool, trainer) -> dict:
    """This phase's peaks, the allocator's state at its end and what the run holds then; resets the
    peaks for the next one."""
    if not cuda:
        return {"phase": name, "held_gib": _held(trainer)}
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    row = {
        "phase": name,
        "peak_reserved_gib": stats["reserved_bytes.all.peak"] / GIB,
        "peak_allocated_gib": stats["allocated_bytes.all.peak"] / GIB,
        "reserved_gib": stats["reserved_bytes.all.current"] / GIB,
        "allocated_gib": stats["allocated_bytes.all.current"] / GIB,
        "inactive_split_gib": stats["inactive_split_bytes.all.current"] / GIB,
        "segments": stats["segment.all.current"],
        "pools_gib": _pools(),
        "held_gib": _held(trainer),
    }
    torch.cuda.reset_peak_memory_stats()
    return row


def run(recipe: str, case_key: str, mode: str, settings: Settings, snapshot: Path | None, steady: int) -> list[dict]:
    case = next(c for c in (*CASES, *DRY_RUN_CASES) if c.key == case_key)
    cuda = settings.device == "cuda"
    rows = []
    with tempfile.TemporaryDirectory() as out:
        trainer = _trainer(recipe, case, mode, settings, out)
        rows.append(_phase("model and optimizer built", cuda, trainer))
        for _ in range(2 * CALIBRATION_STEPS):
            if trainer.phase != "calibrating":
                break
            trainer.train_step()
        rows.append(_phase("calibration", cuda, trainer))
        trainer.train_step()  # compiles the blocks; under graphs, the eager warm-up on a side stream
        rows.append(_phase("first frozen step (compile, warm-up)", cuda, trainer))
        if snapshot is not None and cuda:
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        trainer.train_step()  # under graphs: the capture, then its first replay
        if snapshot is not None and cuda:
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
        rows.append(_phase("second frozen step (graph capture)", cuda, trainer))
        for _ in range(steady):
            trainer.train_step()
        rows.append(_phase(f"{steady} steady steps", cuda, trainer))
        rows[-1]["graph_captured"] = trainer.graph_captured
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--recipe", required=True)
    parser.add_argument("--case", default="llama3_1b_8x2048")
    parser.add_argument("--mode", default=FASTEST_MODES[0], help="compile+graph (the fastest mode), compile, ...")
    parser.add_argument("--out", type=Path, help="folder for memory-<recipe>.json (and the snapshot)")
    parser.add_argument("--snapshot", action="store_true", help="record the allocator's history of the capture step")
    parser.add_argument("--steady-steps", type=int, default=4)
    parser.add_argument("--dry-run", action="store_true", help="the tiny model on the CPU: plumbing only")
    parser.add_argument(
        "--lazy-optimizer-state",
        action="store_true",
        help="the optimizer state made by the first step, as before train.optim.allocate_state (the A/B of that fix)",
    )
    a = parser.parse_args()
    name = a.recipe + ("+lazy-state" if a.lazy_optimizer_state else "")
    if a.lazy_optimizer_state:
        trainer_module.allocate_state = lambda optimizer: None
    settings, case, mode = (DRY_RUN, DRY_RUN_CASES[0].key, "eager") if a.dry_run else (Settings(), a.case, a.mode)
    file_name = name.replace("+", "-")  # the device tool returns no file whose name holds a '+'
    snapshot = a.out / f"snapshot-{file_name}.pickle" if a.snapshot and a.out else None
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
    rows = run(a.recipe, case, mode, settings, snapshot, a.steady_steps)
    for row in rows:
        print(json.dumps({"run": name} | row))
    if a.out:
        (a.out / f"memory-{file_name}.json").write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()
