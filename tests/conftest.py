"""Test-wide settings: Triton kernels run in the interpreter when no GPU is present.

TRITON_INTERPRET must be set before triton is first imported, so it is set here.
"""

import contextlib
import json
import os
import signal
from pathlib import Path

import pytest
import torch
from full_disk import FillingFile

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

torch.set_num_threads(min(2, torch.get_num_threads()))


@pytest.fixture
def sigint_reaches_children():
    """Children of this process start with SIGINT at its default, as under a terminal. A shell starts
    a background job (a CI runner's, ``cmd &``) with SIGINT ignored, and an ignored signal stays
    ignored across exec, so a test's Ctrl-C would never reach the run; a handler is reset at exec."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        yield
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    else:
        yield


# ---- small training runs (trainer, checkpoint and analysis tests) ---------------------------
SMALL_MODEL = {"n_layers": 2, "dim": 64, "n_heads": 2, "n_kv_heads": 1, "max_seq_len": 64}


@pytest.fixture(scope="module")
def one_thread():
    """These runs' tensors are tiny: one intra-op thread is faster than two, and does not slow
    down many-fold when other processes busy the same two cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """About 50 kB of real text: the sources of the stdlib ``json`` package."""
    text = "".join(p.read_text() for p in sorted(Path(json.__file__).parent.glob("*.py")))
    path = tmp_path_factory.mktemp("corpus") / "json_sources.txt"
    path.write_text(text)
    return path


@pytest.fixture(scope="module")
def small_overrides(corpus, tmp_path_factory):
    """``small_overrides(out, **extra)``: (key, value) pairs of a seconds-long run in ``out``;
    ``extra`` keys spell dots as ``__`` (``optim__lr=0.1``)."""

    def make(out: Path, **extra) -> list[tuple[str, str]]:
        pairs = {f"model.overrides.{k}": v for k, v in SMALL_MODEL.items()}
        pairs |= {
            "data.source": corpus,
            "data.seq_len": 32,
            "data.batch_size": 4,
            "data.vocab_size": 512,
            "data.val_fraction": 0.1,
            "training.steps": 6,
            "training.device": "cpu",
            "optim.warmup_steps": 2,
            "recipe.calibration_steps": 2,
            "checkpoint.interval": 2,
            "logging.log_every": 1,
            "logging.val_every": 3,
            "logging.val_batches": 2,
            "out": out,
        }
        pairs |= {k.replace("__", "."): v for k, v in extra.items()}
        return [(k, str(v)) for k, v in pairs.items()]

    with pytest.MonkeyPatch.context() as patch:  # tokenizer and tokens cached per test module
        patch.setenv("ADAHOP_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield make


# ---- a disk that fills up (checkpoint and failure tests) --------------------------------------
@pytest.fixture
def disk_fills_up(monkeypatch):
    """``disk_fills_up(room)``: from now on a single-process checkpoint write finds the disk full
    after ``room`` bytes, inside the real ``torch.save`` and the real atomic write."""
    from adahop.train import checkpoint

    real = checkpoint.atomic_file

    def fill_after(room: int) -> None:
        @contextlib.contextmanager
        def filling(path):
            with real(path) as f:
                yield FillingFile(f, room)

        monkeypatch.setattr(checkpoint, "atomic_file", filling)

    return fill_after
