"""The training loop: AdamW, warmup + cosine, clipping, accumulation, bf16 autocast on CUDA.

Calibration needs no code here: under an adaptive recipe each ``AdaHOPLinear`` records
outlier patterns during its first ``recipe.calibration_steps`` training forwards (computing in
high precision) and then freezes its plan. The trainer only notices the freeze, logs the plan
table and saves ``plan.json``.

Everything a step depends on (weights, optimizer and schedule, data position, each layer's
plan and votes, the random generators that seed stochastic rounding) is in the checkpoint, so
on CPU a resumed run reproduces the uninterrupted one bit for bit.
"""

from __future__ import annotations

import logging
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from ..models import num_params
from ..nn import adahop_layers, model_plan
from .builders import build_data, build_model_from_config, resolve_device
from .checkpoint import (
    checkpoint_path,
    latest_checkpoint,
    load_checkpoint,
    prune_checkpoints,
    save_checkpoint,
    set_rng_state,
    training_state,
)
from .config import ConfigError, TrainConfig
from .graphs import GraphedMicroStep
from .metrics import PLOT_FILE, MetricsLogger, peak_memory_mib, plot_losses, read_metrics
from .optim import build_lr_scheduler, build_optimizer

log = logging.getLogger(__name__)

CONFIG_FILE = "config.toml"
PLAN_FILE = "plan.json"


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; that update was not applied."""


@dataclass
class TrainResult:
    run_dir: Path
    step: int
    train_loss: float
    val_loss: float


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """Builds a run from a config (fresh, or resumed from its latest checkpoint) and trains it."""

    def __init__(self, cfg: TrainConfig, *, resume: bool = False, progress: bool = True) -> None:
        cfg.validate()
        self.cfg, self.run_dir, self.progress = cfg, cfg.run_dir, progress
        latest = latest_checkpoint(self.run_dir)
        if latest is not None and not resume:  # checked before the slow setup
            raise ConfigError(
                f"{self.run_dir} already holds checkpoints (latest: {latest.name}); "
                "pass --resume to continue that run, or --out DIR to start a new one"
            )
        self.device = resolve_device(cfg.training.device)
        seed_everything(cfg.training.seed)
        self.data = build_data(cfg, progress)
        self.model = build_model_from_config(cfg, self.device)
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optim, cfg.training.steps)
        self.layers = list(adahop_layers(self.model).values())
        self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len * cfg.training.grad_accum
        self.step = 0
        self._plan_saved = self._compiled = False
        self._graphed: GraphedMicroStep | None = None
        if latest is not None:
            self._resume_from(latest)
        elif resume:
            log.info("no checkpoint in %s: starting from step 0", self.run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / CONFIG_FILE).write_text(cfg.to_toml())

    # ---- checkpoints --------------------------------------------------------------------------
    def _resume_from(self, path: Path) -> None:
        state = load_checkpoint(
            path, self.model, self.optimizer, self.scheduler, self.data.train, config=self.cfg.to_dict()
        )
        set_rng_state(state["rng"])
        self.step = state["step"]
        log.info("resumed from %s at step %d", path, self.step)

    def save(self) -> Path:
        state = training_state(
            self.step, self.model, self.optimizer, self.scheduler, self.data.train, self.cfg.to_dict()
        )
        path = save_checkpoint(checkpoint_path(self.run_dir, self.step), state)
        prune_checkpoints(self.run_dir, self.cfg.checkpoint.keep_last)
        return path

    # ---- calibration --------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        return "calibrating" if any(layer.calibrating for layer in self.layers) else "frozen"

    def _maybe_save_plan(self) -> None:
        if self._plan_saved or self.phase == "calibrating":
            return
        plan = model_plan(self.model)
        plan.save(self.run_dir / PLAN_FILE)
        log.info("strategy plan frozen (step %d, recipe %s):\n%s", self.step, self.cfg.recipe.name, plan.summary())
        self._plan_saved = True

    def _maybe_compile(self) -> None:
        """Compile the transformer blocks once no layer calibrates: a calibrating layer runs
        Python hooks every step, a frozen plan never changes again."""
        if self._compiled or not self.cfg.training.compile or self.phase == "calibrating":
            return
        self.model.compile_blocks(self.cfg.training.compile_backend)
        self._compiled = True
        log.info("compiled %d transformer blocks (backend %s)", len(self.model.layers), self.cfg.training.compile_backend)

    def _maybe_graph(self) -> None:
        """Replay micro-steps as a CUDA graph once no layer calibrates (calibration votes on the
        host every step; a frozen step never waits on it)."""
        if self._graphed is not None or not self.cfg.training.cuda_graph or self.device.type != "cuda":
            return
        if self.phase == "calibrating":
            return
        dtype = torch.bfloat16 if self.cfg.training.autocast else None
        self._graphed = GraphedMicroStep(self.model, loss_scale=1 / self.cfg.training.grad_accum, autocast_dtype=dtype)

    @property
    def graph_captured(self) -> bool:
        return self._graphed is not None and self._graphed.captured

    # ---- steps --------------------------------------------------------------------------------
    def _autocast(self) -> torch.autocast:
        enabled = self.device.type == "cuda" and self.cfg.training.autocast
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=enabled)

    def _micro_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward and backward of one micro-batch (gradients accumulate); returns its loss."""
        if self._graphed is not None:
            return self._graphed(inputs, targets)
        with self._autocast():
            _, loss = self.model(inputs, targets)
        (loss / self.cfg.training.grad_accum).backward()
        return loss.detach()

    def train_step(self) -> tuple[float, float]:
        """One optimizer step over ``grad_accum`` micro-batches; returns (loss, grad norm)."""
        self._maybe_compile()
        self._maybe_graph()
        accum = self.cfg.training.grad_accum
        loss_sum = torch.zeros((), device=self.device)
        for _ in range(accum):
            inputs, targets = (t.to(self.device, non_blocking=True) for t in next(self.data.train))
            loss_sum += self._micro_step(inputs, targets)
        loss = (loss_sum / accum).item()
        max_norm = self.cfg.optim.grad_clip or math.inf  # inf: measure the norm, clip nothing
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm).item()
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):
            what = f"loss is {loss}" if not math.isfinite(loss) else f"gradient norm is {grad_norm}"
            raise NonFiniteLossError(
                f"{what} at step {self.step + 1} with recipe {self.cfg.recipe.name!r} "
                f"(lr {self.scheduler.get_last_lr()[0]:.3g}); stopped before applying the update. "
                f"Last good checkpoint: {latest_checkpoint(self.run_dir) or 'none written yet'}"
            )
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=self._graphed is None)  # a graph accumulates in place
        return loss, grad_norm

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-token loss over the fixed validation batches."""
        self.model.eval()
        total, count = 0.0, 0
        for inputs, targets in self.data.val:
            with self._autocast():
                _, loss = self.model(inputs.to(self.device), targets.to(self.device))
            total += loss.item() * targets.numel()
            count += targets.numel()
        self.model.train()
        return total / count

    # ---- loop ---------------------------------------------------------------------------------
    def _describe(self) -> str:
        cfg, args = self.cfg, self.model.args
        return (
            f"model {cfg.model.preset} ({num_params(self.model) / 1e6:.1f}M parameters, {args.n_layers} layers, "
            f"dim {args.dim}), recipe {cfg.recipe.name}, data {self.data.source} "
            f"({len(self.data.train.tokens) / 1e6:.1f}M train tokens), device {self.device}, "
            f"{cfg.training.steps} steps of {self.tokens_per_step} tokens"
        )

    def _log_train(self, metrics: MetricsLogger, loss: float, lr: float, grad_norm: float, tokens_per_s: float) -> None:
        memory = peak_memory_mib(self.device)
        metrics.log(
            "train", self.step, loss=loss, lr=lr, grad_norm=grad_norm, tokens=self.step * self.tokens_per_step,
            tokens_per_s=tokens_per_s, memory_mib=memory, phase=self.phase,
        )
        log.info(
            "step %d/%d  loss %.4f  lr %.2e  grad_norm %.3f  %s tok/s  %s MiB  %s", self.step,
            self.cfg.training.steps, loss, lr, grad_norm, f"{tokens_per_s:,.0f}", f"{memory:,.0f}", self.phase,
        )

    def _validate(self, metrics: MetricsLogger) -> float:
        loss = self.evaluate()
        metrics.log("val", self.step, loss=loss, perplexity=math.exp(loss))
        log.info("step %d  validation loss %.4f  perplexity %.2f", self.step, loss, math.exp(loss))
        return loss

    def train(self) -> TrainResult:
        """Train to ``training.steps``: log, validate and checkpoint on their intervals and after
        the last step; always leave ``loss.png`` behind, even when stopped by an error."""
        cfg, every = self.cfg, self.cfg.logging
        steps = cfg.training.steps
        log.info(self._describe())
        self.model.train()
        loss = val_loss = math.nan
        timed_steps, step_time = 0, 0.0  # since the last log, in train_step only (no eval, no saving)
        bar = tqdm(total=steps, initial=self.step, desc=cfg.recipe.name, unit="step", disable=not self.progress)
        try:
            with MetricsLogger(self.run_dir, self.step) as metrics, bar:
                while self.step < steps:
                    lr = self.scheduler.get_last_lr()[0]
                    start = time.perf_counter()
                    loss, grad_norm = self.train_step()
                    timed_steps, step_time = timed_steps + 1, step_time + time.perf_counter() - start
                    self.step += 1
                    self._maybe_save_plan()
                    tokens_per_s = timed_steps * self.tokens_per_step / step_time
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", phase=self.phase, refresh=False)
                    bar.update()
                    last = self.step == steps
                    if self.step % every.log_every == 0 or last:
                        self._log_train(metrics, loss, lr, grad_norm, tokens_per_s)
                        timed_steps, step_time = 0, 0.0
                    if self.step % every.val_every == 0 or last:
                        val_loss = self._validate(metrics)
                    if self.step % cfg.checkpoint.interval == 0 or last:
                        self.save()
        finally:
            title = f"{cfg.model.preset} / {cfg.recipe.name}"
            plot_losses(read_metrics(self.run_dir), self.run_dir / PLOT_FILE, title)
        return TrainResult(self.run_dir, self.step, loss, val_loss)
