"""A run directory written by ``adahop train``, read back as loss curves and its recipe."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from ..recipes import RECIPES
from ..train.metrics import METRICS_FILE, read_metrics


def recipe_label(recipe: dict) -> str:
    """A recipe's name, with the fields that differ from the registered recipe of that name:
    ``adahop_lv2 (bf16_gemms=['wgrad'])``; runs with one label are seeds of one recipe."""
    name = recipe.get("name", "unknown")
    base = RECIPES[name].to_dict() if name in RECIPES else {}
    changed = [f"{k}={v}" for k, v in recipe.items() if k in base and k != "name" and base[k] != v]
    return f"{name} ({', '.join(changed)})" if changed else name


@dataclass
class RunRecord:
    """What a finished (or running) run logged: train and validation curves and its recipe."""

    path: Path
    recipe: str
    group: str = ""  # the recipe_label: runs with the same group differ only in their seed (and length)
    seed: int | None = None
    train_steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.recipe if self.path.name == self.recipe else f"{self.recipe} ({self.path.name})"

    def final_train_loss(self, window: float = 0.1) -> float:
        """Mean train loss over the last ``window`` fraction of logged steps (noise-robust)."""
        if not self.train_loss:
            return float("nan")
        n = max(1, int(len(self.train_loss) * window))
        return sum(self.train_loss[-n:]) / n

    def final_val_loss(self) -> float:
        return self.val_loss[-1] if self.val_loss else float("nan")


def read_run(run_dir: str | Path) -> RunRecord:
    """Load ``config.toml`` and ``metrics.jsonl`` of a run; clear errors if they are missing."""
    path = Path(run_dir)
    if not (path / METRICS_FILE).is_file():
        raise FileNotFoundError(f"{path} is not an adahop run directory: no {METRICS_FILE}")
    config_file = path / "config.toml"
    config = tomllib.loads(config_file.read_text()) if config_file.is_file() else {}
    recipe = config.get("recipe", {})
    run = RunRecord(path, recipe.get("name", "unknown"), recipe_label(recipe), config.get("training", {}).get("seed"))
    try:
        records = read_metrics(path)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path / METRICS_FILE}: not valid JSON lines ({e})") from None
    curves = {"train": (run.train_steps, run.train_loss), "val": (run.val_steps, run.val_loss)}
    for rec in (r for r in records if r["kind"] in curves):  # other kinds (pattern telemetry) are no loss
        steps, losses = curves[rec["kind"]]
        steps.append(rec["step"])
        losses.append(rec["loss"])
    return run
