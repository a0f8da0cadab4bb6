"""Checkpoints: everything needed to continue a run exactly, written atomically.

A checkpoint is one ``torch.save`` file, ``<run_dir>/checkpoints/step_XXXXXXX.pt``, holding

| key         | what                                                                      |
|-------------|---------------------------------------------------------------------------|
| `format`    | `CHECKPOINT_FORMAT`                                                       |
| `step`      | optimizer steps taken                                                     |
| `model`     | `model.state_dict()`, with each AdaHOP layer's frozen plan and calibration votes (its `_extra_state`) |
| `optimizer`, `scheduler` | their `state_dict()`s                                       |
| `data`      | the training loader's position                                            |
| `rng`       | torch CPU/CUDA (stochastic-rounding seeds come from these), Python and NumPy generator states |
| `config`    | the run's resolved `TrainConfig.to_dict()`                                |
| `data_fingerprint` | what it trains on: source, token count, SHA-256 of the tokens (`builders.data_fingerprint`) |
| `sr_noise`  | the stochastic-rounding noise layout (`formats.philox.NOISE_LAYOUT`; absent: 1, the 16-bit one) |
| `osci_reset` | under `recipe.osci_reset`: the de-oscillation's per-element state (`OsciReset.state_dict`) |

It is written to a temporary file in the same directory, flushed to disk and then renamed over
the final name, so a crash mid-write leaves the previous checkpoints as they were; its SHA-256,
taken while writing, goes to the sidecar ``step_XXXXXXX.pt.sha256`` (``checkpoint_files``). A
failed write (a full disk) is an ``OSError`` naming the file, whatever ``torch.save`` made of it.
Only plain containers and tensors are stored, so loading uses ``weights_only=True``.

A multi-process run writes sharded checkpoints instead, directories ``step_XXXXXXX/`` (see
``sharded_checkpoint``); both kinds count as the run's checkpoints, ordered by step, and this
module reads either (:func:`read_any`, :func:`newest_readable`, :func:`load_checkpoint`).
"""

from __future__ import annotations

import json
import logging
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..atomic import atomic_file
from ..formats.philox import NOISE_LAYOUT, NOISE_LAYOUTS
from ..nn import OsciReset
from ..recipes import Recipe
from .checkpoint_files import (
    CHECKPOINT_DIR,
    CheckpointError,
    HashingWriter,
    UnreadableCheckpointError,
    is_checkpoint_name,
    latest_checkpoint,
    list_checkpoints,
    set_aside,
    verify_checksums,
    write_failure,
    write_file_checksum,
)
from .config import TrainConfig
from .rng import rng_state
from .sharded_checkpoint import load_sharded, read_sharded

log = logging.getLogger(__name__)
_DEFAULTS = TrainConfig().to_dict()

CHECKPOINT_FORMAT = 1
_ZIP_MAGIC = b"PK\x03\x04"  # torch.save writes a zip archive
REQUIRED_KEYS = ("format", "step", "model", "optimizer", "scheduler", "data", "rng", "config")
# What a resumed run does with each config field (a test checks every field is named here, so a
# new field needs a decision): the sections and keys it refuses to change, each with what the
# checkpoint fixed for good, and the ones it applies from the next step on (logged, and recorded
# as a "resume" record in metrics.jsonl, so the run directory says which value ran when).
MATCHING_SECTIONS = ("model", "recipe", "data")
MATCHING_KEYS = {
    ("training", "seed"): "the data order",
    ("training", "grad_accum"): "the tokens per step",
    # The generators that draw the rounding keys were seeded with it at step 0 and resume from the
    # checkpoint's state: a new offset would not take effect, and reseeding would make the config
    # misdescribe the steps before the resume.
    ("training", "rounding_seed_offset"): "the rounding noise, carried on by the checkpoint's generators",
    ("training", "plan"): "the plans every layer froze at step 0 (the checkpoint carries them)",
}
APPLIED_SECTIONS = ("optim", "checkpoint", "logging")
APPLIED_KEYS = {
    ("training", name)
    for name in (
        "steps",  # the schedule is rebuilt for the new length
        "device",
        "autocast",
        "compile",
        "compile_backend",
        "recompute_wgrad_operands",  # bit-identical either way: where wgrad's Xᵀ is made, not what
        "cuda_graph",
        "distributed",
        "fsdp_low_precision_all_gather",
        "weight_operands_once_per_step",  # bit-identical either way: where W is quantized, not what
        "deterministic",
        "pattern_telemetry_every",
        "recompute_pattern_steps",
        "timeout",  # how the run stops, not what it computes
        "sigterm_checkpoint",
        "sigterm_grace",
    )
}


# ---- writing --------------------------------------------------------------------------------
def training_state(
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loader: Any,
    config: dict[str, Any],
    data_fingerprint: dict[str, Any] | None = None,
    osci_reset: OsciReset | None = None,
) -> dict[str, Any]:
    """The checkpoint of a run after ``step`` optimizer steps (see the module docstring)."""
    state = {
        "format": CHECKPOINT_FORMAT,
        "step": step,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "data": loader.state_dict(),
        "rng": rng_state(),
        "config": config,
        "data_fingerprint": data_fingerprint,
        "sr_noise": NOISE_LAYOUT,
    }
    if osci_reset is not None:
        state["osci_reset"] = osci_reset.state_dict()
    return state


def save_checkpoint(path: str | Path, state: dict[str, Any]) -> Path:
    """Write ``state`` to ``path`` atomically (temporary file, fsync, rename), then its checksum.
    Any failed write raises an ``OSError`` naming ``path`` and leaves the checkpoints as they were."""
    path = Path(path)
    try:
        with atomic_file(path) as f:
            writer = HashingWriter(f)
            torch.save(state, writer)
        write_file_checksum(path, writer.sha256.hexdigest())
    except (OSError, RuntimeError) as e:
        raise write_failure(e, path) from None
    return path


# ---- reading --------------------------------------------------------------------------------
def resolve_checkpoint(path_or_run_dir: str | Path) -> Path:
    """A checkpoint file, or the latest checkpoint of a run directory."""
    path = Path(path_or_run_dir)
    if path.is_dir() and not is_checkpoint_name(path.name):  # a run directory, not a sharded checkpoint
        latest = latest_checkpoint(path)
        if latest is None:
            raise CheckpointError(f"{path}: no checkpoints in {path / CHECKPOINT_DIR}")
        return latest
    if not path.exists():
        raise CheckpointError(f"{path}: no such checkpoint file or run directory")
    return path


def _unreadable_reason(path: Path, error: Exception) -> str:
    """Why ``torch.load`` failed, in a few words (torch's own text suggests weights_only=False)."""
    with open(path, "rb") as f:
        head = f.read(len(_ZIP_MAGIC))
    if not head:
        return "empty file"
    if head != _ZIP_MAGIC:
        return "not a torch.save archive"
    if not zipfile.is_zipfile(path):
        return "truncated archive"
    if isinstance(error, pickle.UnpicklingError):
        return "holds objects other than tensors and plain containers"
    return str(error).split(". ")[0] or type(error).__name__


def read_checkpoint(path: Path, verify: bool = True) -> dict[str, Any]:
    """The raw checkpoint dict, or a CheckpointError saying which file is wrong and how (an
    ``UnreadableCheckpointError`` for one that is damaged or fails its checksum)."""
    if verify:
        verify_checksums(path)
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot read: {e.strerror}") from None
    except Exception as e:  # truncated zip, garbage bytes, foreign pickle: all unreadable
        reason = _unreadable_reason(path, e)
        raise UnreadableCheckpointError(f"{path}: not a readable checkpoint, corrupt or truncated ({reason})") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not an adahop checkpoint (holds a {type(state).__name__})")
    missing = [k for k in REQUIRED_KEYS if k not in state]
    if missing:
        raise CheckpointError(f"{path}: not an adahop checkpoint (missing {', '.join(missing)})")
    if state["format"] != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"{path}: checkpoint format {state['format']!r}, this adahop reads format {CHECKPOINT_FORMAT}"
        )
    return state


def read_any(path: Path, verify: bool = True) -> dict[str, Any]:
    """A checkpoint of either format, read (and checked against its checksums when ``verify``):
    a single-process file's whole dict, a sharded directory's ``train`` entry."""
    return read_sharded(path, verify) if path.is_dir() else read_checkpoint(path, verify)


def newest_readable(run_dir: Path, verify: bool = True) -> tuple[Path, dict[str, Any]]:
    """The newest checkpoint of ``run_dir`` that reads back intact (:func:`read_any`); newer
    unreadable ones are set aside (renamed to ``*.corrupt``) with a warning."""
    for path in reversed(list_checkpoints(run_dir)):
        try:
            return path, read_any(path, verify)
        except UnreadableCheckpointError as e:
            aside = set_aside(path)
            log.warning("warning: %s; renamed it to %s and trying the one before", e, aside.name)
    raise CheckpointError(
        f"no readable checkpoint left in {run_dir / CHECKPOINT_DIR}; start a new run with another --out"
    )


def _plain(config: dict[str, Any]) -> dict[str, Any]:
    """A config as JSON holds it (tuples as lists), as a sharded checkpoint stores it."""
    return json.loads(json.dumps(config))


def check_matches(path: Path, saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raise if the checkpoint's model, recipe, data or seed differs from the current config's.
    Recipe fields added since the checkpoint was written count as their defaults."""
    saved, current = _plain(saved), _plain(current)
    saved = {**saved, "recipe": _plain(Recipe.from_dict(saved["recipe"]).to_dict())}
    for section in MATCHING_SECTIONS:
        if saved[section] != current[section]:
            diff = sorted(
                k
                for k in saved[section].keys() | current[section].keys()
                if saved[section].get(k) != current[section].get(k)
            )
            details = ", ".join(
                f"{k}: checkpoint {saved[section].get(k)!r} vs config {current[section].get(k)!r}" for k in diff
            )
            raise CheckpointError(f"{path}: written for a different {section} ({details})")
    for (section, key), fixed in MATCHING_KEYS.items():
        written = saved[section].get(key, _DEFAULTS[section][key])  # a field the checkpoint predates: its default
        if written != current[section][key]:
            raise CheckpointError(
                f"{path}: written with {section}.{key}={written!r}, which a resumed run cannot change "
                f"({fixed}; config: {current[section][key]!r}); resume with it, or start a new run with another --out"
            )


def noise_layout_change(state: dict[str, Any]) -> str | None:
    """``"stochastic-rounding noise (old) -> (new)"`` when the checkpoint was written under another
    noise layout (one without ``sr_noise`` predates the 8-bit layout), else None. Not an error: the
    resumed steps draw noise of the same distribution from the same seeds, but not the bits the
    adahop that wrote the checkpoint would have drawn."""
    written = int(state.get("sr_noise", 1))
    if written == NOISE_LAYOUT:
        return None
    old = NOISE_LAYOUTS.get(written, f"layout {written}, from a newer adahop")
    return f"stochastic-rounding noise ({old}) -> ({NOISE_LAYOUTS[NOISE_LAYOUT]})"


def config_changes(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """``"key old -> new"`` for each config value that differs from the checkpoint's (``out``
    aside: a run directory may move; a field the checkpoint predates is not a change)."""
    saved, current = _plain(saved), _plain(current)
    return [
        f"{section}.{key} {saved[section][key]!r} -> {value!r}"
        for section, fields in current.items()
        if isinstance(fields, dict)
        for key, value in fields.items()
        if key in saved.get(section, {}) and saved[section][key] != value
    ]


def load_checkpoint(
    path_or_run_dir: str | Path,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    loader: Any | None = None,
    *,
    config: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Restore ``model`` (and whichever of optimizer, scheduler, data loader are given) from a
    checkpoint (a file, or a multi-process run's sharded directory) or the latest checkpoint of
    a run directory; returns the checkpoint dict (``step``, ``config``, ``rng``, ...) with
    ``path`` added. A sharded checkpoint is gathered into whole tensors in one process.

    ``config`` (a ``TrainConfig.to_dict()``) makes a checkpoint written for another model
    preset or recipe an error instead of a confusing shape mismatch. The caller restores the
    random generators with ``set_rng_state(state["rng"])`` when it continues training.
    """
    path = resolve_checkpoint(path_or_run_dir)
    if path.is_dir():
        state = read_sharded(path)
        if config is not None:
            check_matches(path, state["config"], config)
        state["rng"] = load_sharded(path, state, model, optimizer, loader)["rng"]
        if scheduler is not None:
            scheduler.load_state_dict(state["scheduler"])
    else:
        state = read_checkpoint(path)
        if config is not None:
            check_matches(path, state["config"], config)
        restore_state(path, state, model, optimizer, scheduler, loader)
    state["path"] = path
    return state


def restore_state(
    path: Path,
    state: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    scheduler: Any | None = None,
    loader: Any | None = None,
    osci_reset: OsciReset | None = None,
) -> None:
    """Load a read checkpoint into ``model`` and whichever of the others are given (a checkpoint
    that predates the de-oscillation's state leaves ``osci_reset`` to start afresh)."""
    targets = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "data": loader}
    if osci_reset is not None and "osci_reset" in state:
        targets["osci_reset"] = osci_reset
    for key, target in targets.items():
        if target is None:
            continue
        try:
            target.load_state_dict(state[key])
        except (KeyError, RuntimeError, ValueError) as e:
            raise CheckpointError(f"{path}: its {key} state does not fit this run: {e}") from None
