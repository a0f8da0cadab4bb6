"""``adahop train``: the command line of the trainer.

    adahop train [--config FILE.toml] [--recipe NAME] [--model PRESET] [--steps N]
                 [--data SRC] [--out DIR] [--resume] [--section.field=VALUE ...]

The short flags are spellings of config keys (``--steps`` is ``--training.steps``); any other
key is set with ``--section.field=value``. ``--resume`` without ``--config`` starts from the
run directory's saved ``config.toml``. Mistakes in arguments exit with status 2 and a message
listing the valid choices; a failed run (non-finite loss, unusable checkpoint, a write that
failed) with status 1 and one line saying where it stopped; Ctrl-C with status 130 and the same
line; SIGTERM finishes the step, writes a checkpoint and exits with status 143 and that line
(``stopping``). A run holds its run directory's lock (``run_lock``): a second run on the same
``--out`` refuses with status 1, naming the first one's process and host.

Under ``torchrun --nproc-per-node=N -m adahop train ...`` every rank runs this with the same
arguments (see ``distributed``): rank 0 reports mistakes in them and logs the run, and when a
rank stops on an error the first rank to fail reports it, in the same one line, prefixed with
its rank when that is not 0; the others stop without a word.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tqdm.contrib.logging import logging_redirect_tqdm

from ..models import MODEL_PRESETS
from ..recipes import DEFAULT_RECIPE, RECIPES
from .checkpoint import CHECKPOINT_DIR, CheckpointError, latest_checkpoint, list_checkpoints
from .config import ConfigError, TrainConfig, apply_overrides, flatten, load_config
from .distributed import (
    ParallelEnv,
    PeerFailedError,
    claim_failure,
    launch_rank,
    lost_peer,
    mark_answering,
    process_group,
    silent_ranks,
    timed_out,
)
from .failures import describe_out_of_memory, describe_write_failure, out_of_memory
from .metrics import METRICS_FILE, PLOT_FILE, TENSORBOARD_DIR
from .run_lock import RunDirectoryInUseError, run_lock
from .stopping import SIGTERM_EXIT_STATUS, StopRequest, Terminated, on_sigterm
from .trainer import CONFIG_FILE, PLAN_FILE, NonFiniteLossError, Trainer, TrainResult

SHORT_FLAGS = {
    "recipe": "recipe",
    "model": "model.preset",
    "steps": "training.steps",
    "data": "data.source",
    "out": "out",
}


def _overrides_help() -> str:
    lines = ["config keys (set any with --section.field=VALUE; defaults shown):"]
    for key, value in flatten(TrainConfig().to_dict()):
        if key == "model.overrides":
            lines.append("  --model.overrides.FIELD=VALUE   any model shape field, e.g. n_layers, dim")
        elif key != "out":
            shown = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
            lines.append(f"  --{key}={shown}")
    return "\n".join(lines)


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):
        if launch_rank() > 0:  # every rank of a torchrun launch parses the same arguments: rank 0 reports
            sys.exit(2)
        super().error(message)


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="adahop train",
        description="Pretrain a Llama-style model from scratch with a low-precision recipe.",
        epilog=_overrides_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--config", type=Path, metavar="FILE.toml", help="TOML config (see configs/)")
    parser.add_argument(
        "--recipe",
        choices=sorted(RECIPES),
        metavar="NAME",
        help=f"one of {', '.join(sorted(RECIPES))} (default {DEFAULT_RECIPE})",
    )
    parser.add_argument(
        "--model", choices=list(MODEL_PRESETS), metavar="PRESET", help=f"one of {', '.join(MODEL_PRESETS)}"
    )
    parser.add_argument("--steps", type=int, metavar="N", help="optimizer steps")
    parser.add_argument(
        "--data",
        metavar="SRC",
        help="stdlib (default), a .txt/.jsonl/.parquet file (.txt.gz/.jsonl.gz too), dir or glob, or hf:NAME[:CONFIG]",
    )
    parser.add_argument("--out", metavar="DIR", help="run directory (default runs/<model>-<recipe>)")
    parser.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
    parser.add_argument(
        "--accept-changed-data",
        action="store_true",
        help="with --resume: go on although the data differs from what the checkpoint trained on",
    )
    return parser


def parse_overrides(rest: list[str], parser: argparse.ArgumentParser) -> list[tuple[str, str]]:
    """``--section.field=value`` or ``--section.field value`` arguments as (key, value) pairs."""
    pairs, args = [], iter(rest)
    for arg in args:
        if not (arg.startswith("--") and "." in arg.partition("=")[0]):
            parser.error(f"unrecognized argument {arg!r}; config keys are set with --section.field=VALUE (see --help)")
        key, has_value, value = arg[2:].partition("=")
        if not has_value:
            value = next(args, None)
            if value is None:
                parser.error(f"--{key} needs a value")
        pairs.append((key, value))
    return pairs


def resolve_config(args: argparse.Namespace, overrides: list[tuple[str, Any]]) -> TrainConfig:
    """Defaults or --config (or, with --resume, the run's saved config), then the flags."""
    flags = [(key, getattr(args, flag)) for flag, key in SHORT_FLAGS.items() if getattr(args, flag) is not None]
    overrides = flags + overrides
    path = args.config
    if path is None and args.resume:
        saved = apply_overrides(TrainConfig(), overrides).run_dir / CONFIG_FILE
        path = saved if saved.exists() else None
        if path is None and all(key == "out" for key, _ in overrides) and list_checkpoints(saved.parent):
            raise ConfigError(
                f"--resume: {saved} is missing, so the run's settings are unknown; pass the config it was "
                "started with (--config FILE.toml) or all its --section.field=VALUE flags"
            )
    return load_config(path, overrides)


_HANDLER = logging.StreamHandler()
_HANDLER.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))


def _setup_logging() -> logging.Logger:
    logger = logging.getLogger("adahop")
    if not logger.handlers:
        logger.addHandler(_HANDLER)
    _HANDLER.stream = sys.stderr  # the current one: main() may run more than once in a process
    logger.setLevel(logging.INFO if launch_rank() == 0 else logging.ERROR)  # rank 0 logs the run
    return logger


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest, parser)
    try:
        cfg = resolve_config(args, overrides)
    except ConfigError as e:
        parser.error(str(e))
    with logging_redirect_tqdm(loggers=[_setup_logging()]):  # log lines print above the bar
        try:
            with process_group(cfg.training.device, cfg.training.distributed, cfg.training.timeout) as env:
                result = _train(parser, args, cfg, env)
        except ValueError as e:  # this rank has no GPU of its own
            parser.error(str(e))
    if not isinstance(result, TrainResult):
        return result
    if launch_rank() == 0:
        print(
            f"\nTrained {result.step} steps: train loss {result.train_loss:.4f}, validation loss {result.val_loss:.4f}"
        )
        print(f"Results in {result.run_dir}/: {', '.join(_artefacts(result.run_dir))}")
    return 0


def _train(
    parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: TrainConfig, env: ParallelEnv
) -> TrainResult | int:
    """Build and train the run; an error becomes its exit status (and its one line). Runs inside
    the process group, so the failing rank claims its failure before leaving the group."""
    trainer, stop, grace = None, StopRequest(), cfg.training.sigterm_grace

    def give_up() -> None:  # SIGTERM's grace ran out before the checkpoint was written
        _fail(
            env,
            f"terminated (SIGTERM), no checkpoint within training.sigterm_grace={grace:g} s; {_where(trainer, cfg)}",
        )
        sys.stderr.flush()
        os._exit(SIGTERM_EXIT_STATUS)

    try:
        # Rank 0 locks the run directory for all ranks; theirs wait for it in the Trainer.
        lock = run_lock(cfg.run_dir) if env.is_main and not _missing_resume(args, cfg) else contextlib.nullcontext()
        sigterm = on_sigterm(stop, checkpoint=cfg.training.sigterm_checkpoint, grace_s=grace, give_up=give_up)
        with lock, sigterm:
            trainer = Trainer(
                cfg,
                resume=args.resume,
                progress=sys.stderr.isatty(),
                env=env,
                accept_changed_data=args.accept_changed_data,
                stop=stop,
            )
            return trainer.train()
    except Terminated as e:
        if not e.agreed:  # stopped where it was: the first rank to stop reports
            return _fail(env, f"terminated (SIGTERM); {_where(trainer, cfg)}", status=SIGTERM_EXIT_STATUS)
        if env.is_main:  # every rank stopped at the same step and wrote its shard: rank 0 reports
            print(f"adahop train: terminated (SIGTERM) after a checkpoint; {_where(trainer, cfg)}", file=sys.stderr)
        return SIGTERM_EXIT_STATUS
    except PeerFailedError:  # another rank reports
        return 1
    except ValueError as e:  # a config, run directory or data source that cannot be used
        if trainer is not None:
            if not env.distributed:
                raise
            return _fail_unexpected(env, e, trainer, cfg)
        if env.distributed:
            claim_failure()  # every rank meets the same refusal; silence the peers of one that did not
        parser.error(str(e))
    except (CheckpointError, NonFiniteLossError, RunDirectoryInUseError) as e:
        return _fail(env, str(e))
    except OSError as e:  # disk full, directory removed, file made read-only
        return _fail(env, f"{describe_write_failure(e, cfg.run_dir)}; {_where(trainer, cfg)}")
    except KeyboardInterrupt:
        with _ignoring(signal.SIGINT):  # under torchrun a second SIGINT follows (forwarded): not mid-line
            return _fail(env, f"interrupted; {_where(trainer, cfg)}", status=130)
    except Exception as e:
        if out_of_memory(e):
            return _fail(env, f"{describe_out_of_memory(cfg, env.device)}; {_where(trainer, cfg)}")
        if not env.distributed:
            raise
        if timed_out(e):
            return _fail_stalled(env, trainer, cfg)
        if lost_peer(e):
            return _fail(
                env,
                "another rank exited without a word "
                f"(killed, e.g. by the out-of-memory killer, or crashed: see the launcher's report); {_where(trainer, cfg)}",
            )
        return _fail_unexpected(env, e, trainer, cfg)


@contextlib.contextmanager
def _ignoring(signum: int) -> Iterator[None]:
    """Ignore ``signum`` within the block (where the main thread can: elsewhere nothing changes)."""
    try:
        previous = signal.signal(signum, signal.SIG_IGN)
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        signal.signal(signum, previous)


def _missing_resume(args: argparse.Namespace, cfg: TrainConfig) -> bool:
    """``--resume`` of a directory that does not exist: the trainer refuses it, and locking it
    first would leave an empty directory behind."""
    return args.resume and not cfg.run_dir.exists()


def _fail(env: ParallelEnv, message: str, status: int = 1) -> int:
    """Print the one error line, unless another rank of the run failed first (it reports)."""
    if env.distributed and not claim_failure():
        return status
    rank = f"rank {env.rank}: " if env.rank else ""
    print(f"adahop train: error: {rank}{message}", file=sys.stderr)
    return status


def _fail_stalled(env: ParallelEnv, trainer: Trainer | None, cfg: TrainConfig) -> int:
    """A collective waited ``training.timeout`` for a peer: the ranks that did not time out as
    this one did are the stalled ones."""
    mark_answering(env)
    if not claim_failure():
        return 1
    silent = silent_ranks(env)
    who = f"rank {', '.join(map(str, silent))}" if silent else "a rank"
    print(
        f"adahop train: error: {who} stalled: no answer within training.timeout={cfg.training.timeout:g} s "
        f"(a stopped process, I/O that hangs, a wedged GPU); {_where(trainer, cfg)}",
        file=sys.stderr,
    )
    return 1


def _fail_unexpected(env: ParallelEnv, error: Exception, trainer: Trainer | None, cfg: TrainConfig) -> int:
    """An error of no known kind on one rank of a distributed run (a bug, a GPU out of memory, a
    collective broken by a peer that left): its traceback once, then the one line."""
    if not claim_failure():
        return 1
    traceback.print_exception(error, file=sys.stderr)
    summary = f"{type(error).__name__}: {error}".splitlines()[0]
    print(f"adahop train: error: rank {env.rank}: {summary}; {_where(trainer, cfg)}", file=sys.stderr)
    return 1


def _where(trainer: Trainer | None, cfg: TrainConfig) -> str:
    """Where a stopped run stands and how to continue it, for the one-line error."""
    at = "before training started" if trainer is None else f"at step {trainer.step} of {cfg.training.steps}"
    latest = latest_checkpoint(cfg.run_dir)
    if latest is None and trainer is None:  # this run wrote nothing yet: the same command runs again
        return f"stopped {at}, with nothing to resume; rerun the same command once that is fixed"
    if latest is None:
        return f"stopped {at}, with no checkpoint to resume from; delete {cfg.run_dir} and rerun to start over"
    world = trainer.env.world_size if trainer is not None else 1
    torchrun = world > 1 or cfg.training.distributed
    launch = f"torchrun --nproc-per-node={world} -m adahop train" if torchrun else "adahop train"
    return f"stopped {at}; last checkpoint {latest}; continue with: {launch} --out {cfg.run_dir} --resume"


def _artefacts(run: Path) -> list[str]:
    """The files and directories a finished run left (plan.json only where a plan froze)."""
    names = [CONFIG_FILE, METRICS_FILE, PLAN_FILE, PLOT_FILE]
    found = [name for name in names if (run / name).exists()]
    found += [f"{CHECKPOINT_DIR}/", f"{TENSORBOARD_DIR}/ (tensorboard --logdir {run / TENSORBOARD_DIR})"]
    return found
