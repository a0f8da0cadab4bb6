"""``adahop train``: the command line of the trainer.

    adahop train [--config FILE.toml] [--recipe NAME] [--model PRESET] [--steps N]
                 [--data SRC] [--out DIR] [--resume] [--section.field=VALUE ...]

The short flags are spellings of config keys (``--steps`` is ``--training.steps``); any other
key is set with ``--section.field=value``. ``--resume`` without ``--config`` starts from the
run directory's saved ``config.toml``. Mistakes in arguments exit with status 2 and a message
listing the valid choices; a failed run (non-finite loss, unusable checkpoint, a write that
failed) with status 1 and one line saying where it stopped; Ctrl-C with status 130 and the same
line.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

from tqdm.contrib.logging import logging_redirect_tqdm

from ..models import MODEL_PRESETS
from ..recipes import RECIPES
from .checkpoint import CHECKPOINT_DIR, CheckpointError, latest_checkpoint
from .config import ConfigError, TrainConfig, apply_overrides, flatten, load_config
from .metrics import METRICS_FILE, PLOT_FILE, TENSORBOARD_DIR
from .trainer import CONFIG_FILE, PLAN_FILE, NonFiniteLossError, Trainer

SHORT_FLAGS = {"recipe": "recipe", "model": "model.preset", "steps": "training.steps", "data": "data.source", "out": "out"}


def _overrides_help() -> str:
    lines = ["config keys (set any with --section.field=VALUE; defaults shown):"]
    for key, value in flatten(TrainConfig().to_dict()):
        if key == "model.overrides":
            lines.append("  --model.overrides.FIELD=VALUE   any model shape field, e.g. n_layers, dim")
        elif key != "out":
            shown = ",".join(map(str, value)) if isinstance(value, (list, tuple)) else value
            lines.append(f"  --{key}={shown}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="adahop train",
        description="Pretrain a Llama-style model from scratch with a low-precision recipe.",
        epilog=_overrides_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument("--config", type=Path, metavar="FILE.toml", help="TOML config (see configs/)")
    parser.add_argument("--recipe", choices=sorted(RECIPES), metavar="NAME", help=f"one of {', '.join(sorted(RECIPES))}")
    parser.add_argument("--model", choices=list(MODEL_PRESETS), metavar="PRESET", help=f"one of {', '.join(MODEL_PRESETS)}")
    parser.add_argument("--steps", type=int, metavar="N", help="optimizer steps")
    parser.add_argument("--data", metavar="SRC", help="stdlib (default), a .txt/.jsonl/.parquet file, dir or glob, or hf:NAME[:CONFIG]")
    parser.add_argument("--out", metavar="DIR", help="run directory (default runs/<model>-<recipe>)")
    parser.add_argument("--resume", action="store_true", help="continue from the run directory's latest checkpoint")
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
    return load_config(path, overrides)


_HANDLER = logging.StreamHandler()
_HANDLER.setFormatter(logging.Formatter("%(asctime)s %(message)s", datefmt="%H:%M:%S"))


def _setup_logging() -> logging.Logger:
    logger = logging.getLogger("adahop")
    if not logger.handlers:
        logger.addHandler(_HANDLER)
    _HANDLER.stream = sys.stderr  # the current one: main() may run more than once in a process
    logger.setLevel(logging.INFO)
    return logger


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    overrides = parse_overrides(rest, parser)
    try:
        cfg = resolve_config(args, overrides)
    except ConfigError as e:
        parser.error(str(e))
    trainer = None
    with logging_redirect_tqdm(loggers=[_setup_logging()]):  # log lines print above the bar
        try:
            trainer = Trainer(cfg, resume=args.resume, progress=sys.stderr.isatty())
            result = trainer.train()
        except ValueError as e:  # a config, run directory or data source that cannot be used
            if trainer is not None:
                raise
            parser.error(str(e))
        except (CheckpointError, NonFiniteLossError) as e:
            return _fail(str(e))
        except OSError as e:  # disk full, directory removed, file made read-only
            return _fail(f"cannot write {e.filename or cfg.run_dir}: {e.strerror or e}; {_where(trainer, cfg)}")
        except KeyboardInterrupt:
            return _fail(f"interrupted; {_where(trainer, cfg)}", status=130)
    print(f"\nTrained {result.step} steps: train loss {result.train_loss:.4f}, validation loss {result.val_loss:.4f}")
    print(f"Results in {result.run_dir}/: {', '.join(_artefacts(result.run_dir))}")
    return 0


def _fail(message: str, status: int = 1) -> int:
    print(f"adahop train: error: {message}", file=sys.stderr)
    return status


def _where(trainer: Trainer | None, cfg: TrainConfig) -> str:
    """Where a stopped run stands and how to continue it, for the one-line error."""
    at = "before training started" if trainer is None else f"at step {trainer.step} of {cfg.training.steps}"
    latest = latest_checkpoint(cfg.run_dir)
    if latest is None:
        return f"stopped {at}, with no checkpoint to resume from; delete {cfg.run_dir} and rerun to start over"
    return f"stopped {at}; last checkpoint {latest}; continue with: adahop train --out {cfg.run_dir} --resume"


def _artefacts(run: Path) -> list[str]:
    """The files and directories a finished run left (plan.json only where a plan froze)."""
    names = [CONFIG_FILE, METRICS_FILE, PLAN_FILE, PLOT_FILE]
    found = [name for name in names if (run / name).exists()]
    found += [f"{CHECKPOINT_DIR}/", f"{TENSORBOARD_DIR}/ (tensorboard --logdir {run / TENSORBOARD_DIR})"]
    return found
