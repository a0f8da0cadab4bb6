"""Reading a run directory written by ``adahop train``: its config and metrics."""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RunRecord:
    """What a finished (or running) run logged: train and validation curves and its recipe."""

    path: Path
    recipe: str
    train_steps: list[int] = field(default_factory=list)
    train_loss: list[float] = field(default_factory=list)
    val_steps: list[int] = field(default_factory=list)
    val_loss: list[float] = field(default_factory=list)

    @property
    def label(self) -> str:
        return f"{self.recipe} ({self.path.name})"

    def final_train_loss(self, window: float = 0.1) -> float:
        """Mean train loss over the last ``window`` fraction of logged steps (noise-robust)."""
        if not self.train_loss:
            return float("nan")
        n = max(1, int(len(self.train_loss) * window))
        return sum(self.train_loss[-n:]) / n

    def final_val_loss(self) -> float:
        return self.val_loss[-1] if self.val_loss else float("nan")


def recipe_name(config: dict) -> str:
    recipe = config.get("recipe", "unknown")
    return recipe.get("name", "custom") if isinstance(recipe, dict) else str(recipe)


def read_run(run_dir: str | Path) -> RunRecord:
    """Load ``config.toml`` and ``metrics.jsonl`` of a run; clear errors if they are missing."""
    path = Path(run_dir)
    metrics = path / "metrics.jsonl"
    if not metrics.is_file():
        raise FileNotFoundError(f"{path} is not an adahop run directory: no metrics.jsonl")
    config_file = path / "config.toml"
    config = tomllib.loads(config_file.read_text()) if config_file.is_file() else {}
    run = RunRecord(path, recipe_name(config))
    for lineno, line in enumerate(metrics.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{metrics}:{lineno}: not valid JSON ({e})") from None
        if rec.get("kind") == "train" and "loss" in rec:
            run.train_steps.append(rec["step"])
            run.train_loss.append(rec["loss"])
        elif rec.get("kind") == "val" and "val_loss" in rec:
            run.val_steps.append(rec["step"])
            run.val_loss.append(rec["val_loss"])
    return run
