"""The training loop: AdamW, warmup + cosine, clipping, accumulation, bf16 autocast on CUDA.

Calibration needs no code here: under an adaptive recipe each ``AdaHOPLinear`` measures outlier
patterns in its backward during its first ``recipe.calibration_steps`` training steps (computing in
high precision), votes once per step right before ``optimizer.step()`` and freezes its plan there.
The trainer only notices the freeze, logs the plan table and saves ``plan.json``. After it, every ``training.pattern_telemetry_every`` steps, it
samples the patterns again and logs how far they drifted from the plan (``telemetry``). Those
voting steps run uncompiled, calibration's at BF16 width: with ``training.recompute_pattern_steps``
each block recomputes its activations in backward there (votes are cast in backward, so a
recompute counts nothing twice), so they keep only the blocks' inputs.

The step itself reads no value back from the device (calibrating layers and pattern telemetry
do, on their steps): a non-finite loss or gradient norm is refused there (that update and every
later one), and the loop, which reads the steps' figures only to log, validate or checkpoint,
stops at that read, naming the step (``nonfinite``).

Everything a step depends on (weights, optimizer and schedule, data position, each layer's
plan and votes, the random generators that seed stochastic rounding) is in the checkpoint, so
on CPU a resumed run reproduces the uninterrupted one bit for bit.

Given a distributed :class:`ParallelEnv` (``torchrun``, see ``distributed``) the same loop
trains data-parallel: the model is sharded with FSDP2, each rank trains on its share of every
global batch, losses are averaged over ranks, checkpoints are sharded (``sharded_checkpoint``)
and rank 0 alone logs and writes the run's records. Calibration statistics are merged over
ranks before each step's vote, so every rank freezes the same plan, the one a single process
would freeze on the same global batch.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from tqdm import tqdm

from ..atomic import remove_stale_temp_files, write_atomic
from ..models import num_params
from ..nn import OsciReset, adahop_layers, load_plan, model_plan, set_bf16_forward, weight_operands_cached
from ..nn.compiling import compile_options, reserve_compiled_graphs
from ..policy import NonFiniteTensorError
from .builders import autocast_for, build_data, build_model_from_config, data_fingerprint, mean_loss, resolve_device
from .checkpoint import (
    check_matches,
    config_changes,
    newest_readable,
    noise_layout_change,
    restore_state,
    save_checkpoint,
    training_state,
)
from .checkpoint_files import CHECKPOINT_DIR, checkpoint_path, latest_checkpoint, list_checkpoints, prune_checkpoints
from .config import ConfigError, TrainConfig, read_plan
from .distributed import (
    ParallelEnv,
    PeerFailedError,
    all_ranks_mean,
    describe_sharding,
    gather_floats,
    main_rank_first,
    shard_model,
    use_training_timeout,
)
from .graphs import GraphedMicroStep
from .metrics import METRICS_FILE, PLOT_FILE, RESUME_KIND, MetricsLogger, PeakMemory, plot_losses, read_metrics
from .nonfinite import PendingSteps, StepFigures, step_unless_non_finite
from .optim import allocate_state, apply_hyperparameters, build_lr_scheduler, build_optimizer
from .rng import set_rng_state
from .sharded_checkpoint import load_full, load_sharded, remove_partial_checkpoints, restore_rng, save_sharded
from .stopping import StopRequest, Terminated
from .telemetry import RECORD_KIND, calibrated_layers, drift_record, sample_patterns

log = logging.getLogger(__name__)

CONFIG_FILE = "config.toml"
PLAN_FILE = "plan.json"


class NonFiniteLossError(RuntimeError):
    """The loss or the gradient norm became NaN or infinite; that update, and any after it, was not applied."""


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


def use_deterministic_kernels() -> None:
    """Process-wide: PyTorch picks deterministic kernels from here on. Strict, not ``warn_only``:
    under ``warn_only`` the backward of flash and memory-efficient attention (SDPA on CUDA, whose
    atomic adds order differently from run to run) only warns and keeps its nondeterministic
    kernel. So an op with no deterministic kernel stops the run, naming itself. The cuBLAS
    workspace setting counts only before the process's first cuBLAS call."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


class Trainer:
    """Builds a run from a config (fresh, or resumed from its latest checkpoint) and trains it;
    ``env`` (from ``distributed.process_group``) makes it one rank of a data-parallel run;
    ``stop`` (set by SIGTERM, see ``stopping``) ends it early at a step boundary, checkpointed."""

    def __init__(
        self,
        cfg: TrainConfig,
        *,
        resume: bool = False,
        progress: bool = True,
        env: ParallelEnv | None = None,
        accept_changed_data: bool = False,
        stop: StopRequest | None = None,
    ) -> None:
        cfg.validate()
        self.env = env or ParallelEnv(resolve_device(cfg.training.device))
        self.stop = stop or StopRequest()
        self.cfg, self.run_dir, self.progress = cfg, cfg.run_dir, progress and self.env.is_main
        self.device = self.env.device
        self._config_changes: list[str] = []  # a resume's applied changes, until recorded in metrics.jsonl
        # Rank 0 first: it renames unreadable checkpoints aside and fills the tokenizer cache.
        with main_rank_first(self.env):
            checkpoint = self._check_run_dir(resume)  # before the slow setup: every refusal comes first
            # A fresh run freezes training.plan's plans; a resumed one keeps its checkpoint's.
            plan = read_plan(cfg.training.plan) if cfg.training.plan and checkpoint is None else None
            # Model initialisation has its own seed; the global generators (stochastic rounding)
            # differ per rank, so ranks round their shares with independent noise.
            seed_everything(cfg.training.seed + cfg.training.rounding_seed_offset + self.env.rank)
            if cfg.training.deterministic:
                use_deterministic_kernels()
            self.data = build_data(cfg, self.progress, rank=self.env.rank, world_size=self.env.world_size)
            self.data.train.accepts_other_tokens = accept_changed_data
            # Rank 0 fingerprints the data and compares it with the checkpoint's (the others get it below).
            self.data_fingerprint = data_fingerprint(self.data) if self.env.is_main else None
            if checkpoint is not None and self.env.is_main:
                self._check_data(checkpoint[0], checkpoint[1].get("data_fingerprint"), accept_changed_data)
        if self.env.distributed:
            shared = [self.data_fingerprint]
            dist.broadcast_object_list(shared, src=0)
            self.data_fingerprint = shared[0]
        self.model = build_model_from_config(cfg, self.device)
        if self.env.distributed:
            low_precision = cfg.training.fsdp_low_precision_all_gather
            if low_precision and cfg.training.compile:
                low_precision = False
                if self.env.is_main:
                    log.info("training.fsdp_low_precision_all_gather is off under training.compile (not traced yet)")
            shard_model(self.model, self.device, low_precision_all_gather=low_precision)
            if self.env.is_main:
                log.info("distributed: %s", describe_sharding(self.model))
            if cfg.training.cuda_graph and self.device.type == "cuda" and self.env.is_main:
                log.info(
                    "training.cuda_graph is off under FSDP2 (%d ranks): a graph would not capture its collectives",
                    self.env.world_size,
                )
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.osci_reset = None  # recipe.osci_reset: weight de-oscillation after every optimizer step
        if cfg.recipe.osci_reset is not None:
            self.osci_reset = OsciReset(self.model, cfg.recipe.osci_reset)
            self.osci_reset.attach(self.optimizer)
        # 1 once a step's loss or gradient norm was not finite: from then on the optimizer applies nothing.
        self._found_inf = torch.zeros((), dtype=torch.float32, device=self.device)
        self.named_layers = adahop_layers(self.model)
        self.layers = list(self.named_layers.values())
        self.tokens_per_step = cfg.data.batch_size * cfg.data.seq_len * cfg.training.grad_accum
        if plan is not None:
            try:
                load_plan(self.model, plan)
            except ValueError as e:  # a plan of another model or recipe
                raise ConfigError(f"training.plan={cfg.training.plan}: {e}") from None
        self.step = 0
        self._plan_saved = self._compiled = self._loss_compiled = self._plan_restored = False
        self._plan_loaded = plan is not None  # training.plan's
        self.step_phase = self.phase  # the phase the latest step ran in (a freeze ends a calibrating step)
        self._graphed: GraphedMicroStep | None = None
        self._bf16_forward = False  # recipe.bf16_forward_after has switched the forward to BF16
        self.pattern_record: dict | None = None  # the last telemetry step's, until logged
        self.memory = PeakMemory(self.device)
        if checkpoint is not None:
            self._resume_from(*checkpoint)
        if self.device.type == "cuda":  # what sharding or loading freed goes back first: the moments get new segments
            torch.cuda.empty_cache()
        allocate_state(self.optimizer)  # before any step: in segments of its own (optim.allocate_state)
        self.scheduler = build_lr_scheduler(self.optimizer, cfg.optim, cfg.training.steps, self.step)
        if self.env.is_main:
            stale = remove_stale_temp_files(self.run_dir / CHECKPOINT_DIR) + remove_stale_temp_files(self.run_dir)
            for path in stale + remove_partial_checkpoints(self.run_dir):
                log.info("removed %s, left by an interrupted write", path)
            write_atomic(self.run_dir / CONFIG_FILE, cfg.to_toml())

    # ---- run directory and checkpoints --------------------------------------------------------
    def _check_run_dir(self, resume: bool) -> tuple[Path, dict] | None:
        """Check the run directory fits the request and create it; returns the checkpoint to
        resume from (path, state), or None for a new run."""
        run_dir = self.run_dir
        if run_dir.exists() and not run_dir.is_dir():
            raise ConfigError(f"--out {run_dir} is a file, not a directory; pass --out DIR")
        checkpoints = list_checkpoints(run_dir)
        if checkpoints and not resume:
            raise ConfigError(
                f"{run_dir} already holds checkpoints (latest: {checkpoints[-1].name}); "
                "pass --resume to continue that run, or --out DIR to start a new one"
            )
        if resume and not checkpoints:
            raise ConfigError(
                f"--resume: no checkpoint in {run_dir / CHECKPOINT_DIR}; check --out, or leave out --resume to start a new run"
            )
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"cannot create the run directory --out {run_dir}: {e.strerror}") from None
        if not os.access(run_dir, os.W_OK | os.X_OK):
            raise ConfigError(f"cannot write to the run directory --out {run_dir}; pass a writable --out DIR")
        if not resume:
            self._refuse_leftovers()
            return None
        # Rank 0 verifies the checksums and sets damaged checkpoints aside; the others list after it.
        path, state = newest_readable(run_dir, verify=self.env.is_main)
        self._check_resumable(path, state)
        return path, state

    def _refuse_leftovers(self) -> None:
        """A new run must not overwrite the records of an earlier one that left no checkpoint."""
        metrics, plan = self.run_dir / METRICS_FILE, self.run_dir / PLAN_FILE
        leftovers = [p.name for p in (metrics, plan) if p.exists() and p.stat().st_size > 0]
        if leftovers:
            raise ConfigError(
                f"{self.run_dir} holds {' and '.join(leftovers)} of an earlier run that wrote no checkpoint; "
                f"delete {'it' if len(leftovers) == 1 else 'them'} (or the directory) to start over there, or pass --out DIR"
            )

    def _check_resumable(self, path: Path, state: dict) -> None:
        """Refuse config changes a resumed run cannot honour; log the ones it applies."""
        saved, current, step = state["config"], self.cfg.to_dict(), state["step"]
        check_matches(path, saved, current)
        steps = self.cfg.training.steps
        if steps == step:
            raise ConfigError(
                f"{self.run_dir} has finished its {steps} steps ({path.name}); "
                f"to train on, resume with --steps N for some N > {step}"
            )
        if steps < step:
            raise ConfigError(
                f"--steps {steps} is before the checkpoint's step {step} ({path}); resume with --steps N for some N > {step}"
            )
        self._config_changes = config_changes(saved, current)
        if self._config_changes:
            log.info(
                "resuming with a changed config (applied from step %d): %s", step + 1, ", ".join(self._config_changes)
            )
        noise = noise_layout_change(state)
        recipe = self.cfg.recipe
        if (
            noise
            and recipe.strategy != "bf16"
            and "stochastic" in (recipe.rounding, recipe.grad_rounding, recipe.backward_rounding)
        ):
            log.warning(
                "warning: %s was written by an adahop with other stochastic-rounding noise: from step %d on the "
                "run rounds with the same seeds but other bits than that adahop would have drawn (%s)",
                path,
                step + 1,
                noise,
            )
            self._config_changes.append(noise)

    def _check_data(self, path: Path, saved: dict | None, accept: bool) -> None:
        """Refuse to resume on data other than the checkpoint's (a checkpoint that predates
        fingerprints passes), unless ``accept``: then the change is logged and recorded."""
        current = self.data_fingerprint
        if saved is None or saved == current:
            return

        def described(fingerprint: dict) -> str:
            return f"{fingerprint['source']}: {fingerprint['tokens']:,} tokens, sha256 {fingerprint['sha256'][:12]}"

        change = f"data ({described(saved)}) -> ({described(current)})"
        if not accept:
            raise ConfigError(
                f"the data changed since {path} was written: it trained on {described(saved)}, "
                f"the data is now {described(current)}; restore that data, or resume with "
                "--accept-changed-data to go on with this data knowingly"
            )
        log.warning("warning: resuming on changed data (--accept-changed-data): %s", change)
        self._config_changes.append(change)

    def _resume_from(self, path: Path, state: dict) -> None:
        osci = self.osci_reset
        if path.is_dir():
            restore_rng(load_sharded(path, state, self.model, self.optimizer, self.data.train, osci_reset=osci), state)
        elif self.env.distributed:  # written by one process
            load_full(path, state, self.model, self.optimizer, self.data.train, osci_reset=osci)
            restore_rng(state, {**state, "world_size": 1})
        else:
            restore_state(path, state, self.model, self.optimizer, None, self.data.train, osci_reset=osci)
            set_rng_state(state["rng"])
        apply_hyperparameters(self.optimizer, self.cfg.optim)
        self.step = state["step"]
        self._plan_restored = self.phase == "frozen"  # the checkpoint's plans, not a new calibration
        log.info("resumed from %s at step %d", path, self.step)

    def save(self) -> Path:
        if self.env.distributed:
            path = save_sharded(
                checkpoint_path(self.run_dir, self.step).with_suffix(""),
                step=self.step,
                model=self.model,
                optimizer=self.optimizer,
                scheduler=self.scheduler,
                loader=self.data.train,
                config=self.cfg.to_dict(),
                data_fingerprint=self.data_fingerprint,
                osci_reset=self.osci_reset,
            )
        else:
            state = training_state(
                self.step,
                self.model,
                self.optimizer,
                self.scheduler,
                self.data.train,
                self.cfg.to_dict(),
                self.data_fingerprint,
                osci_reset=self.osci_reset,
            )
            path = save_checkpoint(checkpoint_path(self.run_dir, self.step), state)
        if self.env.is_main:
            prune_checkpoints(self.run_dir, self.cfg.checkpoint.keep_last)
        return path

    # ---- calibration --------------------------------------------------------------------------
    @property
    def phase(self) -> str:
        """``"calibrating"``, ``"frozen"`` (every layer froze its plan) or ``"fixed"`` (a recipe of one
        strategy, such as ``bf16`` or ``mxfp4``: nothing to calibrate or freeze)."""
        if not self.cfg.recipe.adaptive:
            return "fixed"
        return "calibrating" if any(layer.calibrating for layer in self.layers) else "frozen"

    def _maybe_save_plan(self) -> None:
        if self._plan_saved or self.phase == "calibrating":
            return
        self._plan_saved = True
        if not self.env.is_main:  # every rank froze the same plan (merged votes): rank 0 saves it
            return
        plan = model_plan(self.model)
        plan.save(self.run_dir / PLAN_FILE)
        recipe = self.cfg.recipe.name
        kinds = {tuple(p.strategies().values()) for p in plan.values()}
        if not kinds:  # a peer recipe (torchao float8) trains the linears itself
            log.info("strategy plan: recipe %s converts no layer to AdaHOPLinear", recipe)
            return
        if self.phase == "fixed" and len(kinds) == 1:  # one line says it all
            strategies = ", ".join(f"{g}={s.value}" for g, s in next(iter(plan.values())).strategies().items())
            log.info("strategy plan fixed by recipe %s: every one of %d layers runs %s", recipe, len(plan), strategies)
            return
        how = {"fixed": "fixed by the recipe", "frozen": "frozen"}[self.phase]
        if self._plan_restored:
            how = "restored from the checkpoint"
        elif self._plan_loaded:
            how = f"loaded from {self.cfg.training.plan}"
        log.info("strategy plan %s (step %d, recipe %s):\n%s", how, self.step, recipe, plan.summary())

    def _maybe_compile(self) -> None:
        """Compile the loss at once (it has nothing to calibrate, and eager it would set the run's memory
        peak during calibration) and the transformer blocks once no layer calibrates: calibration would
        compile (it traces) but run its BF16 graph for a few steps only; a frozen plan never changes again."""
        if not self.cfg.training.compile:
            return
        if not self._loss_compiled:
            self.model.compile_loss(self.cfg.training.compile_backend)
            self._loss_compiled = True
        if self._compiled or self.phase == "calibrating":
            return
        # Blocks with other plans are other graphs (so are the plans of the late BF16 forward), and so
        # is each variant of weight_operands_cached (W quantized and kept, W's kept operands read)
        # beside the evaluation's.
        plans = 1 if self.cfg.recipe.bf16_forward_after is None else 2
        reserve_compiled_graphs(3 * plans * len(self.model.layers))
        options = compile_options(self.cfg.training.recompute_wgrad_operands)
        self.model.compile_blocks(self.cfg.training.compile_backend, options=options)
        self._compiled = True
        log.info(
            "compiled %d transformer blocks (backend %s%s)",
            len(self.model.layers),
            self.cfg.training.compile_backend,
            ", wgrad's operands recomputed in backward" if options else "",
        )

    def _maybe_graph(self) -> None:
        """Replay micro-steps as a CUDA graph once no layer calibrates (calibration reads its
        statistics on the host at every step boundary; a frozen step never waits on it). Not with several ranks: a graph would
        not capture FSDP's collectives (their buffers and streams live outside it)."""
        if self._graphed is not None or not self.cfg.training.cuda_graph or self.device.type != "cuda":
            return
        if self.env.distributed:
            return
        if self.phase == "calibrating":
            return
        dtype = torch.bfloat16 if self.cfg.training.autocast else None
        self._graphed = GraphedMicroStep(self.model, loss_scale=1 / self.cfg.training.grad_accum, autocast_dtype=dtype)

    def _maybe_bf16_forward(self) -> None:
        """``recipe.bf16_forward_after``: every forward GEMM in BF16 from step ``int(fraction *
        training.steps)`` on. Decided from the step alone, so a resumed run switches where an
        uninterrupted one does. Compiled blocks recompile (their guards read the layers' flag);
        captured CUDA graphs replay the quantized forward, so they are dropped and captured anew."""
        after = self.cfg.recipe.bf16_forward_after
        if after is None or self._bf16_forward or self.step < int(after * self.cfg.training.steps):
            return
        set_bf16_forward(self.model)
        self._bf16_forward = True
        self._graphed = None  # _maybe_graph starts a new one: warm-up, then capture
        log.info("step %d on: every forward GEMM in BF16 (recipe.bf16_forward_after=%s)", self.step + 1, after)

    @property
    def graph_captured(self) -> bool:
        return self._graphed is not None and self._graphed.captured

    # ---- steps --------------------------------------------------------------------------------
    def _autocast(self) -> torch.autocast:
        return autocast_for(self.cfg, self.device)

    def _micro_step(
        self, inputs: torch.Tensor, targets: torch.Tensor, first: bool, eager: bool = False
    ) -> torch.Tensor:
        """Forward and backward of one micro-batch (gradients accumulate after the ``first``);
        returns its loss. ``eager``: no graph replay and compiled blocks run uncompiled (Python
        hooks observe it)."""
        if self._graphed is not None and not eager:
            return self._graphed(inputs, targets, first=first)
        if self._graphed is not None and first:  # the graphs own .grad: overwrite it in place
            self.optimizer.zero_grad(set_to_none=False)
        uncompiled = torch.compiler.set_stance("force_eager") if eager and self._compiled else contextlib.nullcontext()
        with uncompiled:  # backward too: a recomputed block must run as its forward did
            with self._autocast():
                _, loss = self.model(inputs, targets)
            (loss / self.cfg.training.grad_accum).backward()
        return loss.detach()

    def _telemetry_layers(self) -> dict:
        """The layers to sample on the coming step: after calibration, every ``pattern_telemetry_every`` steps."""
        every = self.cfg.training.pattern_telemetry_every
        if not every or (self.step + 1) % every or self.phase == "calibrating":
            return {}
        return calibrated_layers(self.named_layers)

    def train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over ``grad_accum`` micro-batches; returns its loss and gradient
        norm, left on the device (reading them waits for the step). The update is refused on the
        device when either is not finite, or an earlier step's was (``nonfinite``), so a frozen
        step never waits for the device. On a pattern-telemetry step the patterns it saw wait in
        ``pattern_record``."""
        self._maybe_bf16_forward()
        self._maybe_compile()
        self._maybe_graph()
        accum = self.cfg.training.grad_accum
        loss_sum = torch.zeros((), device=self.device)
        sampled = self._telemetry_layers()
        self.step_phase = self.phase
        recompute = (self.phase == "calibrating" or bool(sampled)) and self.cfg.training.recompute_pattern_steps
        if recompute:  # a step that votes patterns (a frozen step does not touch the blocks)
            self.model.recompute = True
        try:
            # W quantized once for the step's micro-batches (kept only with several: it costs memory).
            once = accum > 1 and self.cfg.training.weight_operands_once_per_step
            cached = weight_operands_cached(self.model) if once else contextlib.nullcontext()
            with sample_patterns(sampled) as sampled_votes, cached:
                for i in range(accum):
                    inputs, targets = (t.to(self.device, non_blocking=True) for t in next(self.data.train))
                    loss_sum += self._micro_step(inputs, targets, first=i == 0, eager=bool(sampled))
        finally:
            if recompute:
                self.model.recompute = False  # the model leaves the step as it came
        if sampled:
            self.pattern_record = drift_record(sampled, sampled_votes)
        loss = loss_sum / accum
        if self.env.distributed:  # every rank gets the same loss and norm, so all refuse the same steps
            loss = all_ranks_mean(loss)
        max_norm = self.cfg.optim.grad_clip or math.inf  # inf: measure the norm, clip nothing
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if isinstance(grad_norm, DTensor):  # sharded gradients: the norm of the whole gradient
            grad_norm = grad_norm.full_tensor()
        step_unless_non_finite(self.optimizer, self._found_inf, loss, grad_norm)
        self.scheduler.step()
        if self._graphed is None:  # the graphs own .grad: the next first micro-step overwrites it
            self.optimizer.zero_grad(set_to_none=True)
        return loss, grad_norm

    def _read_steps(self, pending: PendingSteps) -> StepFigures | None:
        """The figures of the steps since the last read, read on the host; the latest step's, or
        None when none ran. A non-finite step (its update and every later one were refused)
        stops the run here, naming it."""
        figures = pending.read()
        bad = next((f for f in figures if not f.finite), None)
        if bad is not None:
            if not self.env.is_main:  # every rank sees the same global loss: rank 0 reports it
                raise PeerFailedError(f"non-finite loss or gradient at step {bad.step}")
            what = f"loss is {bad.loss}" if not math.isfinite(bad.loss) else f"gradient norm is {bad.grad_norm}"
            raise self._non_finite(what, bad.step, bad.lr)
        return figures[-1] if figures else None

    def _non_finite(self, what: str, step: int, lr: float) -> NonFiniteLossError:
        latest = latest_checkpoint(self.run_dir)
        advice = "resume from it with --resume and a lower --optim.lr" if latest else "lower --optim.lr"
        return NonFiniteLossError(
            f"{what} at step {step} with recipe {self.cfg.recipe.name!r} "
            f"(lr {lr:.3g}); stopped before applying the update. "
            f"Last good checkpoint: {latest or 'none written yet'}; {advice}"
        )

    def evaluate(self) -> float:
        """Mean next-token loss over the fixed validation batches."""
        return mean_loss(self.model, self.data.val, self.cfg, self.device)

    # ---- loop ---------------------------------------------------------------------------------
    def _describe(self) -> str:
        cfg, args = self.cfg, self.model.args
        return (
            f"model {cfg.model.preset} ({num_params(self.model) / 1e6:.1f}M parameters, {args.n_layers} layers, "
            f"dim {args.dim}), recipe {cfg.recipe.name}, data {self.data.source} "
            f"({len(self.data.train.tokens) / 1e6:.1f}M train tokens), device {self.device}, "
            f"{cfg.training.steps} steps of {self.tokens_per_step} tokens"
            + (f", FSDP2 over {self.env.world_size} ranks" if self.env.distributed else "")
        )

    def _log_train(
        self, metrics: MetricsLogger | None, loss: float, lr: float, grad_norm: float, tokens_per_s: float
    ) -> None:
        """Log a train record (rank 0); ``tokens_per_s`` is this rank's, summed over ranks here."""
        memory, per_rank = self.memory.read(), {}
        if self.env.distributed:  # a collective: every rank logs at the same steps
            ranks = gather_floats(self.device, tokens_per_s, *memory.values())
            tokens_per_s = sum(r[0] for r in ranks)
            memory = {name: max(r[1 + i] for r in ranks) for i, name in enumerate(memory)}
            per_rank = {"memory_mib_per_rank": [r[1] for r in ranks]}
        if metrics is None:
            return
        metrics.log(
            "train",
            self.step,
            loss=loss,
            lr=lr,
            grad_norm=grad_norm,
            tokens=self.step * self.tokens_per_step,
            tokens_per_s=tokens_per_s,
            **memory,
            **per_rank,
            phase=self.step_phase,
        )
        log.info(
            "step %d/%d  loss %.4f  lr %.2e  grad_norm %.3f  %s tok/s  %s MiB%s",
            self.step,
            self.cfg.training.steps,
            loss,
            lr,
            grad_norm,
            f"{tokens_per_s:,.0f}",
            f"{memory['memory_mib']:,.0f}"
            + (f" (reserved {memory['memory_reserved_mib']:,.0f})" if "memory_reserved_mib" in memory else ""),
            "" if self.step_phase == "fixed" else f"  {self.step_phase}",
        )

    def _log_patterns(self, metrics: MetricsLogger | None) -> None:
        record, self.pattern_record = self.pattern_record, None
        if metrics is None:
            return
        metrics.log(RECORD_KIND, self.step, **record)
        log.info(
            "step %d  pattern drift from the plan: x %.2f  w %.2f  dY %.2f  strategies %.2f (%d layers)",
            self.step,
            record["drift_x"],
            record["drift_w"],
            record["drift_g"],
            record["strategy_drift"],
            record["layers"],
        )

    def _validate(self, metrics: MetricsLogger | None) -> float:
        loss = self.evaluate()
        if metrics is None:
            return loss
        metrics.log("val", self.step, loss=loss, perplexity=math.exp(loss))
        log.info("step %d  validation loss %.4f  perplexity %.2f", self.step, loss, math.exp(loss))
        return loss

    def train(self) -> TrainResult:
        """Train to ``training.steps``: log, validate and checkpoint on their intervals and after
        the last step; always leave ``loss.png`` behind, even when stopped by an error. The
        steps' figures are read on the host only there (and on pattern-telemetry steps), which
        is where a non-finite step stops the run."""
        cfg, every = self.cfg, self.cfg.logging
        steps = cfg.training.steps
        log.info(self._describe())
        self.model.train()
        loss = val_loss = math.nan
        pending = PendingSteps()
        # Steps and seconds since the last log, in training only (no eval, no saving): a read
        # waits for the device, so the time up to it is the steps' time.
        timed_steps, step_time, resumed = 0, 0.0, time.perf_counter()
        bar, phase = self._progress_bar(), self.phase
        records = MetricsLogger(self.run_dir, self.step) if self.env.is_main else contextlib.nullcontext()
        started, saved = self.step, self.step  # a resumed run's checkpoint is at its first step
        try:
            with records as metrics:
                if metrics is not None and self._config_changes:  # the config.toml it rewrote holds the new values
                    metrics.log(RESUME_KIND, self.step, changes=self._config_changes)
                    self._config_changes = []
                while self.step < steps:
                    if self.stop.stop_now(self.step, self.env):
                        if self.step != saved:
                            self._read_steps(pending)  # a non-finite step is reported, not saved
                            self.save()
                        raise Terminated(agreed=True)
                    lr = self.scheduler.get_last_lr()[0]
                    try:
                        pending.add(self.step + 1, lr, *self.train_step())
                    except NonFiniteTensorError:  # seen by a layer measuring its patterns, before the loss
                        self._read_steps(pending)  # an earlier non-finite step is the one to report
                        which = (
                            "a calibrating layer"
                            if self.phase == "calibrating"
                            else "a layer sampled for pattern telemetry"
                        )
                        raise self._non_finite(f"an operand of {which} holds NaN or Inf", self.step + 1, lr) from None
                    timed_steps += 1
                    self.step += 1
                    if self.step == started + 1:  # past the first step, which may wait on a peer's setup
                        use_training_timeout(self.env)
                    self._maybe_save_plan()
                    bar.update()
                    if self.phase != phase:  # frozen steps run at another speed: a new bar, a new ETA
                        bar.close()
                        bar, phase = self._progress_bar(), self.phase
                    last = self.step == steps
                    log_now = self.step % every.log_every == 0 or last
                    val_now = self.step % every.val_every == 0 or last
                    save_now = self.step % cfg.checkpoint.interval == 0 or last
                    if not (log_now or val_now or save_now or self.pattern_record is not None):
                        continue
                    latest = self._read_steps(pending)
                    loss = latest.loss
                    step_time += time.perf_counter() - resumed
                    tokens_per_s = timed_steps * self.tokens_per_step / self.env.world_size / step_time  # this rank's
                    total = tokens_per_s * self.env.world_size  # the bar's estimate of all ranks' rate
                    bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{total:,.0f}", phase=self.phase, refresh=False)
                    if self.pattern_record is not None:
                        self._log_patterns(metrics)
                    if log_now:
                        self._log_train(metrics, loss, latest.lr, latest.grad_norm, tokens_per_s)
                        timed_steps, step_time = 0, 0.0
                    if val_now:
                        val_loss = self._validate(metrics)
                    if save_now:
                        self.save()
                        saved = self.step
                    resumed = time.perf_counter()
        except BaseException:
            bar.close()
            self._plot(stopping=True)
            raise
        bar.close()
        self._plot()
        return TrainResult(self.run_dir, self.step, loss, val_loss)

    def _progress_bar(self) -> tqdm:
        steps, name = self.cfg.training.steps, self.cfg.recipe.name
        return tqdm(total=steps, initial=self.step, desc=name, unit="step", disable=not self.progress)

    def _plot(self, stopping: bool = False) -> None:
        """Write ``loss.png`` (rank 0); while stopping on another error, a failed write is only a warning."""
        if not self.env.is_main:
            return
        try:
            plot_losses(
                read_metrics(self.run_dir),
                self.run_dir / PLOT_FILE,
                f"{self.cfg.model.preset} / {self.cfg.recipe.name}",
            )
        except OSError as e:
            if not stopping:
                raise
            log.warning("warning: could not write %s: %s", self.run_dir / PLOT_FILE, e.strerror or e)
