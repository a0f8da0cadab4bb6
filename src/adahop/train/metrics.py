"""Run metrics: ``metrics.jsonl`` (the record other tools read), TensorBoard, and ``loss.png``.

``metrics.jsonl`` holds one JSON object per line, each with a ``kind`` and a ``step``:

- ``{"kind": "train", "step", "loss", "lr", "grad_norm", "tokens", "tokens_per_s", "memory_mib", "phase"}``
  every ``logging.log_every`` steps (``loss`` is that step's loss; ``tokens`` counts all tokens
  trained on so far; ``phase`` is ``"calibrating"``, ``"frozen"`` or ``"fixed"``, a recipe of one
  strategy; on CUDA the memory figures are the peaks since the previous record, plus
  ``memory_reserved_mib`` and the process's ``run_peak_reserved_mib``: ``PeakMemory``); a run on several ranks (one record, by rank 0) sums
  ``tokens_per_s`` over ranks, reports the largest rank's memory figures and adds
  ``memory_mib_per_rank``, a list in rank order;
- ``{"kind": "val", "step", "loss", "perplexity"}`` every ``logging.val_every`` steps and at the end;
- ``{"kind": "patterns", "step", "drift_x", "drift_w", "drift_g", "strategy_drift", "layers", "sampled"}``
  every ``training.pattern_telemetry_every`` steps after calibration (see ``telemetry``).

Numbers go to TensorBoard as ``kind/name`` (``patterns/drift_g``); other values (``sampled``) only
to ``metrics.jsonl``.
"""

from __future__ import annotations

import json
import resource
import sys
from pathlib import Path
from typing import Any

import torch

from ..atomic import save_figure, write_atomic

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"
PLOT_FILE = "loss.png"
MIB = 2**20
# ru_maxrss is in KiB on Linux, in bytes on macOS.
_RSS_UNIT = 1 if sys.platform == "darwin" else 1024


class PeakMemory:
    """Peak memory as train records report it. On CUDA each read resets the device's peak
    counters, so a record says what the steps since the previous record needed (the steady state
    once the plan froze, as torchtitan logs it) in ``memory_mib`` (tensors) and
    ``memory_reserved_mib`` (the caching allocator; only this one counts the private pools of
    CUDA graphs, so it is the figure to compare when graphs replay), and
    ``run_peak_reserved_mib`` keeps this process's worst moment so far (calibration's eager
    steps, compilation, graph capture). On the CPU ``memory_mib`` is the process's peak
    resident set, a whole-run figure."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.run_peak_reserved_mib = 0.0

    def read(self) -> dict[str, float]:
        if self.device.type != "cuda":
            return {"memory_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * _RSS_UNIT / MIB}
        interval = {
            "memory_mib": torch.cuda.max_memory_allocated(self.device) / MIB,
            "memory_reserved_mib": torch.cuda.max_memory_reserved(self.device) / MIB,
        }
        torch.cuda.reset_peak_memory_stats(self.device)
        self.run_peak_reserved_mib = max(self.run_peak_reserved_mib, interval["memory_reserved_mib"])
        return interval | {"run_peak_reserved_mib": self.run_peak_reserved_mib}


def read_metrics(path: str | Path) -> list[dict[str, Any]]:
    """The records of a ``metrics.jsonl`` file (or of a run directory's). A last line without its
    newline is a record whose write was cut short (killed process, full disk) and is left out."""
    path = Path(path)
    if path.is_dir():
        path = path / METRICS_FILE
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip() and line.endswith("\n")]


RESUME_KIND = "resume"  # a resumed run's config changes, at the step they apply after


def _kept(record: dict[str, Any], resume_step: int) -> bool:
    return record["step"] < resume_step or (record["step"] == resume_step and record["kind"] != RESUME_KIND)


class MetricsLogger:
    """Appends records to ``metrics.jsonl`` and mirrors their numbers to TensorBoard.

    A run resumed from step ``resume_step`` first drops the records logged after that step
    (work the crash threw away), and a ``resume`` record of an earlier resume from that same step,
    so the file and the event logs read as one uninterrupted run with its config changes.
    """

    def __init__(self, run_dir: str | Path, resume_step: int = 0) -> None:
        from torch.utils.tensorboard import SummaryWriter  # slow import: only when training

        self.path = Path(run_dir) / METRICS_FILE
        resuming = resume_step > 0 and self.path.exists()
        kept = [r for r in read_metrics(self.path) if _kept(r, resume_step)] if resuming else []
        write_atomic(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self._file = open(self.path, "a")
        self._tb = SummaryWriter(Path(run_dir) / TENSORBOARD_DIR, purge_step=resume_step + 1 if resume_step else None)

    def log(self, kind: str, step: int, **values: Any) -> None:
        self._file.write(json.dumps({"kind": kind, "step": step, **values}) + "\n")
        self._file.flush()
        for name, value in values.items():
            if isinstance(value, (int, float)):
                self._tb.add_scalar(f"{kind}/{name}", value, step)

    def close(self) -> None:
        self._file.close()
        self._tb.close()

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def plot_losses(records: list[dict[str, Any]], path: str | Path, title: str = "") -> None:
    """Train and validation loss against step, saved as a PNG."""
    from matplotlib.figure import Figure  # a bare Figure renders with Agg, no pyplot state

    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    for kind, style in (("train", "-"), ("val", "o-")):
        points = [(r["step"], r["loss"]) for r in records if r["kind"] == kind]
        if points:
            ax.plot(*zip(*points), style, label=kind, markersize=4)
    calibrated = [r["step"] for r in records if r["kind"] == "train" and r.get("phase") == "calibrating"]
    if calibrated:
        ax.axvline(max(calibrated), color="gray", linestyle="--", linewidth=1, label="end of calibration")
    ax.set(xlabel="step", ylabel="loss", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
