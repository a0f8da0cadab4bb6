"""Checkpoints of a multi-process run, with ``torch.distributed.checkpoint`` (DCP).

A sharded checkpoint is a directory, ``<run_dir>/checkpoints/step_XXXXXXX/``, that every rank
writes its shards into. It holds what a single-process checkpoint holds:

| key         | what                                                                          |
|-------------|-------------------------------------------------------------------------------|
| `model`     | the parameters, sharded (DCP reshards them for any number of ranks on load)  |
| `optimizer` | AdamW's state by parameter name, sharded alike                                |
| `train`     | `format`, `step`, `scheduler`, `config`, `data_fingerprint`, the `world_size` that wrote it and `sr_noise` (as in `checkpoint`) |
| `ranks.R`   | rank R's data position, random generators and each AdaHOP layer's plan and calibration votes (votes are per rank until the plan freezes); under `recipe.osci_reset` its count of resets |
| `osci_reset` | under `recipe.osci_reset`: the de-oscillation's per-element state, sharded as the weights (DCP reshards it too) |

Atomic: the ranks write into ``.step_XXXXXXX.tmp``, which rank 0 renames to its final name once
DCP has written the metadata and the ranks the checksums of their files (``checksums.sha256``,
see ``checkpoint_files``), so a checkpoint cut short is never taken as the latest. A checkpoint
with a damaged or missing shard is unreadable, like a damaged single-process file: a resumed run
sets it aside and takes the one before.

Resuming on M ranks a checkpoint written by N: DCP reshards model and optimizer; rank r takes
the per-rank state of rank r mod N (so every rank has as many calibration votes as the others
and all freeze at the same step). A single-process checkpoint resumes on M ranks through
:func:`load_full`. The data position counts global batches (see
``adahop.data.loader``), so the run continues on exactly the next batches; on the same number
of ranks it continues bit for bit (on CPU).
"""

from __future__ import annotations

import contextlib
import json
import re
import shutil
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint import CheckpointException, FileSystemWriter
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from ..atomic import publish_dir
from ..formats.philox import NOISE_LAYOUT
from ..nn import OsciReset, adahop_layers
from .checkpoint_files import (
    CHECKPOINT_DIR,
    CHECKSUM_FILE,
    CheckpointError,
    UnreadableCheckpointError,
    file_sha256,
    verify_checksums,
    write_dir_checksums,
    write_failure,
)
from .rng import rng_state, set_rng_state

SHARDED_FORMAT = 2  # 1 stored pickled blobs
_TENSOR = "__tensor__"  # in _as_tensors's JSON: the number of a tensor item
_EXTRA_STATE = "_extra_state"  # AdaHOP layers' plan and votes: saved per rank, not as model state
_PARTIAL = re.compile(r"^\.step_\d+\.(tmp|old)$")
_RANK_FILE = re.compile(r"^__(\d+)_\d+\.distcp$")  # the data files DCP's file system writer names per rank


def _as_tensors(obj: Any) -> dict[str, torch.Tensor]:
    """``obj`` (plain containers, numbers, strings, tensors) as DCP items that are all tensors: its
    tensors by number and the rest as JSON in a uint8 tensor. Nothing in a checkpoint is pickled,
    so DCP reads it with ``weights_only`` and ``dcp_to_torch_save``'s file loads with it."""
    tensors: list[torch.Tensor] = []

    def strip(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            tensors.append(x)
            return {_TENSOR: len(tensors) - 1}
        if isinstance(x, dict):
            return {k: strip(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [strip(v) for v in x]
        return x

    text = json.dumps(strip(obj)).encode()
    return {"json": torch.frombuffer(bytearray(text), dtype=torch.uint8), **{str(i): t for i, t in enumerate(tensors)}}


def from_tensors(items: dict[str, torch.Tensor]) -> Any:
    """What :func:`_as_tensors` stored (tuples come back as lists)."""

    def fill(x: Any) -> Any:
        if isinstance(x, dict):
            return items[str(x[_TENSOR])] if x.keys() == {_TENSOR} else {k: fill(v) for k, v in x.items()}
        if isinstance(x, list):
            return [fill(v) for v in x]
        return x

    return fill(json.loads(items["json"].numpy().tobytes()))


def _holds_item(path: Path, fqn: str) -> bool:
    return fqn in dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def _empty_items(path: Path, prefix: str, empty: Callable[..., torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Tensors of the saved shapes and dtypes for the items under ``prefix`` (``train``,
    ``ranks.R``): :func:`_as_tensors`'s items vary in size, and DCP loads into given tensors.
    ``empty(key, size, dtype)`` makes them (default: whole tensors on the CPU)."""
    metadata = dcp.FileSystemReader(path).read_metadata()
    items = {
        fqn.removeprefix(f"{prefix}."): md
        for fqn, md in metadata.state_dict_metadata.items()
        if fqn.startswith(f"{prefix}.")
    }
    if empty is None:
        return {key: torch.empty(md.size, dtype=md.properties.dtype) for key, md in items.items()}
    return {key: empty(key, md.size, md.properties.dtype) for key, md in items.items()}


def _load(state: dict[str, Any], path: Path, **kwargs: Any) -> None:
    """``dcp.load``, without its warning that a process outside a process group reads alone."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=path, **kwargs)


def _failure(error: CheckpointException) -> str:
    """The first rank's error of a failed DCP save or load, in one line."""
    rank, (exc, _) = min(error.failures.items())
    return f"rank {rank}: {type(exc).__name__}: {exc}".splitlines()[0]


class _Writer(FileSystemWriter):
    """DCP's file system writer, whose failed write is the ``OSError`` behind it: DCP gathers a
    rank's failure to every rank by pickling, which drops what ``torch.save``'s ``RuntimeError``
    hides (a full disk), so it is mapped here, on the rank that failed."""

    def write_data(self, plan: Any, planner: Any) -> Any:
        try:
            return super().write_data(plan, planner)
        except (OSError, RuntimeError) as e:
            raise write_failure(e, Path(self.path)) from None


def _model_state(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict]:
    model_state, optim_state = get_state_dict(model, [] if optimizer is None else optimizer)
    return {k: v for k, v in model_state.items() if not k.endswith(_EXTRA_STATE)}, optim_state


def save_sharded(
    path: Path,
    *,
    step: int,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: Any,
    loader: Any,
    config: dict[str, Any],
    data_fingerprint: dict[str, Any] | None = None,
    osci_reset: OsciReset | None = None,
) -> Path:
    """Write the checkpoint of a distributed run after ``step`` steps; a collective (every rank
    calls it). A failed write on any rank raises on every rank: an ``OSError`` naming ``path``
    for a failed file operation, else a ``CheckpointError``."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model_state, optim_state = _model_state(model, optimizer)
    layers = {name: layer.get_extra_state() for name, layer in adahop_layers(model).items()}
    train = {
        "format": SHARDED_FORMAT,
        "step": step,
        "scheduler": scheduler.state_dict(),
        "config": config,
        "data_fingerprint": data_fingerprint,  # rank 0's: it alone reads the data's fingerprint
        "world_size": world_size,
        "sr_noise": NOISE_LAYOUT,
    }
    own = {"data": loader.state_dict(), "rng": rng_state(), "layers": layers}
    state = {"model": model_state, "optimizer": optim_state, "train": _as_tensors(train)}
    if osci_reset is not None:
        osci = osci_reset.state_dict()
        state["osci_reset"], own["osci_resets"] = osci["tracks"], osci["resets"]
    state["ranks"] = {str(rank): _as_tensors(own)}
    tmp = path.with_name(f".{path.name}.tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    try:
        dcp.save(state, storage_writer=_Writer(tmp))
    except CheckpointException as e:
        failed_rank, (error, _) = min(e.failures.items())
        if isinstance(error, (OSError, RuntimeError)):  # a full disk, a lost directory: as for one process
            failure = write_failure(error, path)
            raise OSError(failure.errno, f"{failure.strerror} (on rank {failed_rank})", str(path)) from None
        raise CheckpointError(f"{path}: writing the checkpoint failed on {_failure(e)}") from None
    _write_checksums(tmp, rank)
    if rank == 0:
        publish_dir(tmp, path)
    dist.barrier()  # no rank goes on (and may prune) before the checkpoint is in place
    return path


def _write_checksums(tmp: Path, rank: int) -> None:
    """Each rank hashes the files it wrote (rank 0 also the metadata), rank 0 records them all;
    a collective. A failed read or write on any rank raises the same ``OSError`` on every rank."""
    digests, error = {}, None
    try:
        for file in sorted(tmp.iterdir()):
            owner = _RANK_FILE.match(file.name)
            if (int(owner[1]) == rank) if owner else rank == 0:
                digests[file.name] = file_sha256(file)
    except OSError as e:
        error = (e.errno, e.strerror, e.filename)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (digests, error))
    failures = [(r, e) for r, (_, e) in enumerate(gathered) if e is not None]
    if not failures and rank == 0:
        try:
            write_dir_checksums(tmp, {name: d for ds, _ in gathered for name, d in ds.items()})
        except OSError as e:
            failures = [(0, (e.errno, e.strerror, e.filename))]
    outcome = [failures]
    dist.broadcast_object_list(outcome, src=0)  # rank 0's list: with its own write's failure
    if outcome[0]:
        failed_rank, (code, reason, filename) = outcome[0][0]
        raise OSError(code, f"{reason} (on rank {failed_rank})", filename)


def read_sharded(path: Path, verify: bool = True) -> dict[str, Any]:
    """The ``train`` entry of a sharded checkpoint (step, config, ...), read by this process
    alone; an ``UnreadableCheckpointError`` for a directory DCP cannot read, or (``verify``) one
    whose files fail their checksums or, written without checksums, are shorter than the
    metadata says."""
    if verify:
        verify_checksums(path)
        if not (path / CHECKSUM_FILE).exists():
            _check_sizes(path)
    try:
        items = _empty_items(path, "train")
        if not items and _holds_item(path, "train"):
            raise CheckpointError(
                f"{path}: a distributed checkpoint of format 1 (pickled state), which this adahop does not "
                "read; resume it with the adahop that wrote it, or start a new run with another --out"
            )
        state = {"train": items}
        _load(state, path, no_dist=True)
        train = from_tensors(state["train"])
    except CheckpointError:
        raise
    except (Exception, CheckpointException) as e:  # no metadata, truncated shards, foreign files: all unreadable
        reason = _failure(e) if isinstance(e, CheckpointException) else f"{type(e).__name__}: {e}".splitlines()[0]
        raise UnreadableCheckpointError(f"{path}: not a readable distributed checkpoint ({reason})") from None
    if not isinstance(train, dict) or train.get("format") != SHARDED_FORMAT:
        raise CheckpointError(f"{path}: not an adahop distributed checkpoint of format {SHARDED_FORMAT}")
    return train


def _check_sizes(path: Path) -> None:
    """Every shard file the metadata names exists and holds the bytes it points into."""
    try:
        metadata = dcp.FileSystemReader(path).read_metadata()
    except Exception:  # no metadata: the read that follows says so
        return
    ends: dict[str, int] = {}
    for info in (metadata.storage_data or {}).values():
        ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
    for name, end in sorted(ends.items()):
        size = (path / name).stat().st_size if (path / name).is_file() else None
        if size is None or size < end:
            what = "is missing" if size is None else f"has {size} bytes, the metadata points up to {end}"
            raise UnreadableCheckpointError(f"{path}: not a readable distributed checkpoint ({name} {what})")


def load_sharded(
    path: Path,
    train: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    loader: Any | None = None,
    osci_reset: OsciReset | None = None,
) -> dict[str, Any]:
    """Restore the model with its layer plans and votes (and the optimizer, data position and
    de-oscillation state, when given) from a sharded checkpoint (``train``: its
    :func:`read_sharded`), on any number of ranks (on one process too: DCP then reads whole
    tensors). A collective when distributed. Returns the per-rank entry this rank takes
    (``rng``, ``data``, ``layers``); the caller restores the random generators."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    saved_world = train["world_size"]
    model_state, optim_state = _model_state(model, optimizer)
    state = {
        "model": model_state,
        "ranks": {str(r): _empty_items(path, f"ranks.{r}") for r in range(saved_world)},
    }  # same keys on every rank
    if optimizer is not None:
        state["optimizer"] = optim_state
    if osci_reset is not None:  # none saved (a checkpoint that predates it): the tracking starts afresh
        with _osci_state_fits(path):
            state["osci_reset"] = _empty_items(path, "osci_reset", osci_reset.empty_track)
    try:
        _load(state, path)
        optimizers = [] if optimizer is None else optimizer
        set_state_dict(model, optimizers, model_state_dict=model_state, optim_state_dict=state.get("optimizer", {}))
    except CheckpointException as e:
        raise CheckpointError(f"{path}: its model or optimizer state does not fit this run ({_failure(e)})") from None
    except (KeyError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{path}: its model or optimizer state does not fit this run: {e}") from None
    own = from_tensors(state["ranks"][str(rank % saved_world)])
    for name, layer in adahop_layers(model).items():
        layer.set_extra_state(own["layers"][name])
    if state.get("osci_reset"):
        resets = own.get("osci_resets") if rank < saved_world else None  # a count per rank: none for a new one
        with _osci_state_fits(path):
            osci_reset.load_state_dict({"tracks": state["osci_reset"], "resets": resets})
    if loader is not None:
        loader.load_state_dict(own["data"])
    return own


def load_full(
    path: Path,
    state: dict[str, Any],
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loader: Any,
    osci_reset: OsciReset | None = None,
) -> None:
    """Restore a single-process checkpoint (``state``: its ``read_checkpoint``) into a sharded
    model on every rank: each rank reads the whole file and keeps its shards. Every rank takes
    the one process's calibration votes (merged at the freeze they pick the same majorities);
    rank 0 its count of de-oscillation resets."""
    names = {id(p): name for name, p in model.named_parameters()}
    # build_optimizer numbers the same parameters in the same order on one process and on many
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    saved = state["optimizer"]
    groups = [  # the hyperparameters this optimizer has (the schedule adds initial_lr later)
        {**{k: v for k, v in group.items() if k in current}, "params": [order[i] for i in group["params"]]}
        for group, current in zip(saved["param_groups"], optimizer.param_groups)
    ]
    optim_state = {"state": {order[i]: s for i, s in saved["state"].items()}, "param_groups": groups}
    try:
        set_state_dict(
            model,
            optimizer,
            model_state_dict=state["model"],
            optim_state_dict=optim_state,
            options=StateDictOptions(full_state_dict=True),
        )
    except (KeyError, IndexError, RuntimeError, ValueError) as e:
        raise CheckpointError(f"{path}: its model or optimizer state does not fit this run: {e}") from None
    loader.load_state_dict(state["data"])
    if osci_reset is not None and "osci_reset" in state:
        resets = state["osci_reset"]["resets"] if dist.get_rank() == 0 else None
        with _osci_state_fits(path):
            osci_reset.load_state_dict({"tracks": state["osci_reset"]["tracks"], "resets": resets})


@contextlib.contextmanager
def _osci_state_fits(path: Path) -> Iterator[None]:
    """A saved de-oscillation state that names a layer this model lacks is a ``CheckpointError``."""
    try:
        yield
    except KeyError as e:
        raise CheckpointError(f"{path}: its de-oscillation state does not fit this run: {e.args[0]}") from None


def restore_rng(own: dict[str, Any], train: dict[str, Any]) -> None:
    """Set this rank's random generators from its entry (:func:`load_sharded`); a rank the
    checkpoint did not have (more ranks than wrote it) gets fresh ones, distinct per rank and step."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    if rank < train["world_size"]:
        set_rng_state(own["rng"])
    else:
        seed = np.random.SeedSequence([train["config"]["training"]["seed"], rank, train["step"]]).generate_state(1)[0]
        torch.manual_seed(int(seed))


def remove_partial_checkpoints(run_dir: str | Path) -> list[Path]:
    """Delete what a distributed write that was cut short left behind (``.step_*.tmp`` and
    ``.step_*.old`` directories); returns the deleted paths. Call it before the run writes."""
    directory = Path(run_dir) / CHECKPOINT_DIR
    if not directory.is_dir():
        return []
    partial = [p for p in sorted(directory.iterdir()) if _PARTIAL.match(p.name) and p.is_dir()]
    for path in partial:
        shutil.rmtree(path, ignore_errors=True)
    return partial
