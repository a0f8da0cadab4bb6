"""Failures a user can cause: each ends in one clear line (no traceback) and loses nothing.

Non-finite values while calibrating, config changes on --resume, corrupt checkpoints, writes
killed midway, Ctrl-C, unusable run directories, a full disk. Faults that need a real process
(SIGKILL during a write, SIGINT) are injected into a subprocess.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from adahop import DEFAULT_RECIPE
from adahop.atomic import atomic_file, remove_stale_temp_files
from adahop.train import CheckpointError, ConfigError, Trainer, latest_checkpoint, load_config, read_metrics
from adahop.train import metrics as metrics_module
from adahop.train import trainer as trainer_module
from adahop.train.cli import main
from adahop.train.optim import lr_multiplier

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = Path(__file__).parents[1] / "src"


def as_argv(pairs: list[tuple[str, str]]) -> list[str]:
    return [f"--{k}={v}" for k, v in pairs]


def run_cli(argv: list[str], **kwargs) -> subprocess.Popen:
    """``adahop train ARGV`` in a subprocess running this tree's sources."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, "-m", "adahop.cli", "train", *argv]
    return subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)


def error_line(err: str) -> str:
    """The one ``adahop train: error:`` line, checked to be the only one and to have no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, err
    return lines[0]


@pytest.fixture(scope="module")
def four_steps(small_overrides, tmp_path_factory):
    """A finished 4-step adahop_lv2 run with checkpoints at steps 2 and 4 (copy it before changing it)."""
    run = tmp_path_factory.mktemp("four") / "run"
    Trainer(load_config(None, small_overrides(run, training__steps=4)), progress=False).train()
    return run


def run_files(run: Path) -> dict[Path, bytes]:
    """Every file of a run directory with its bytes, but the lock's (it names the last run)."""
    return {p: p.read_bytes() for p in run.rglob("*") if p.is_file() and p.name != ".lock"}


def copy_run(run: Path, tmp_path: Path) -> Path:
    copy = tmp_path / "copy"
    shutil.copytree(run, copy)
    return copy


# ---- 1. non-finite values while calibrating ----------------------------------------------
def test_nan_while_calibrating_stops_cleanly_also_on_resume(small_overrides, tmp_path, capsys):
    """lr 1e6 sends the weights to Inf; a calibrating layer sees it before the loss does. The run
    has not frozen yet, so the second run (resumed with the new lr) still calibrates. On which
    step it overflows depends on the CPU's float summation order; it writes no checkpoint
    before the end, so step 2's stays the last good one."""
    run = tmp_path / "run"
    argv = as_argv(small_overrides(run, training__steps=2, recipe__calibration_steps=8))
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Results in" in out and "plan.json" not in out  # no plan froze in 2 steps: none is listed

    assert main(["--out", str(run), "--resume", "--steps", "6", "--optim.lr=1e6", "--checkpoint.interval=100"]) == 1
    line = error_line(capsys.readouterr().err)
    bad = re.search(r"an operand of a calibrating layer holds NaN or Inf at step (\d+)", line)
    assert bad and int(bad.group(1)) >= 3, line
    assert f"Last good checkpoint: {run / 'checkpoints' / 'step_0000002.pt'}" in line


def test_nan_at_the_first_calibration_step_of_a_new_run(small_overrides, tmp_path, capsys):
    """As above, on a new run that writes no checkpoint before its end."""
    overrides = {"optim__lr": 1e6, "optim__warmup_steps": 0, "checkpoint__interval": 100}
    argv = as_argv(small_overrides(tmp_path / "run", recipe__calibration_steps=8, **overrides))
    assert main(argv) == 1
    line = error_line(capsys.readouterr().err)
    bad = re.search(rf"NaN or Inf at step (\d+) with recipe '{DEFAULT_RECIPE}'", line)
    assert bad and int(bad.group(1)) >= 2 and "none written yet; lower --optim.lr" in line, line


# ---- 2. config changes on --resume ---------------------------------------------------------
def test_resume_applies_and_logs_a_changed_lr_and_length(four_steps, small_overrides, tmp_path, caplog):
    run = copy_run(four_steps, tmp_path)
    cfg = load_config(None, small_overrides(run, training__steps=6, optim__lr=0.01, optim__betas="0.8,0.9"))
    with caplog.at_level(logging.INFO, logger="adahop"):
        trainer = Trainer(cfg, resume=True, progress=False)
    assert "optim.lr 0.002 -> 0.01" in caplog.text and "training.steps 4 -> 6" in caplog.text
    expected_lr = 0.01 * lr_multiplier(4, cfg.optim.warmup_steps, 6, cfg.optim.min_lr_ratio)
    assert [g["lr"] for g in trainer.optimizer.param_groups] == pytest.approx([expected_lr] * 2)
    assert all(g["betas"] == (0.8, 0.9) for g in trainer.optimizer.param_groups)
    trainer.train()
    step5 = next(r for r in read_metrics(run) if r["kind"] == "train" and r["step"] == 5)
    assert step5["lr"] == pytest.approx(expected_lr)
    assert load_config(run / "config.toml").optim.lr == 0.01  # recorded because it is in force
    # ... and metrics.jsonl says from when: config.toml alone would misdescribe steps 1-4.
    (resume,) = [r for r in read_metrics(run) if r["kind"] == "resume"]
    assert resume["step"] == 4 and "optim.lr 0.002 -> 0.01" in resume["changes"]


def test_every_config_field_is_either_applied_or_refused_on_resume():
    """A new config field needs a decision: a resumed run that silently kept the checkpoint's
    value would misdescribe itself in config.toml."""
    from adahop.train.checkpoint import APPLIED_KEYS, APPLIED_SECTIONS, MATCHING_KEYS, MATCHING_SECTIONS
    from adahop.train.config import TrainConfig, flatten

    decided = {
        k for k, _ in flatten(TrainConfig().to_dict()) if k.split(".")[0] in MATCHING_SECTIONS + APPLIED_SECTIONS
    }
    decided |= {f"{section}.{key}" for section, key in MATCHING_KEYS.keys() | APPLIED_KEYS}
    assert {k for k, _ in flatten(TrainConfig().to_dict())} - decided == {"out"}  # a run directory may move
    assert not {f"{s}.{k}" for s, k in MATCHING_KEYS} & {f"{s}.{k}" for s, k in APPLIED_KEYS}


@pytest.mark.parametrize(
    "change, error, expected",
    [
        (
            {},
            ConfigError,
            r"has finished its 4 steps \(step_0000004\.pt\); to train on, resume with --steps N for some N > 4",
        ),
        ({"training__steps": 3}, ConfigError, r"--steps 3 is before the checkpoint's step 4"),
        (
            {"training__steps": 6, "data__batch_size": 8},
            CheckpointError,
            r"different data \(batch_size: checkpoint 4 vs config 8\)",
        ),
        (
            {"training__steps": 6, "training__seed": 1},
            CheckpointError,
            r"training\.seed=0, which a resumed run cannot change",
        ),
        (
            {"training__steps": 6, "training__grad_accum": 2},
            CheckpointError,
            r"training\.grad_accum=1, which a resumed run",
        ),
        (
            {"training__steps": 6, "training__rounding_seed_offset": 1},
            CheckpointError,
            r"training\.rounding_seed_offset=0, which a resumed run cannot change \(the rounding noise, carried on by"
            r" the checkpoint's generators; config: 1\); resume with it, or start a new run with another --out$",
        ),
    ],
)
def test_resume_refuses_what_it_cannot_honour_and_records_nothing(
    change, error, expected, four_steps, small_overrides, tmp_path
):
    run = copy_run(four_steps, tmp_path)
    before = (run / "config.toml").read_text()
    with pytest.raises(error, match=expected):
        Trainer(
            load_config(None, small_overrides(run, **({"training__steps": 4} | change))), resume=True, progress=False
        )
    assert (run / "config.toml").read_text() == before


# ---- 3. a corrupt latest checkpoint ----------------------------------------------------------
def flip_one_byte(data: bytes) -> bytes:
    """Bit rot inside a tensor's bytes: the file is still a readable torch.save archive."""
    middle = len(data) // 2
    return data[:middle] + bytes([data[middle] ^ 1]) + data[middle + 1 :]


# With its checksum (any change is caught) and without (a checkpoint written before checksums
# existed: what torch.load cannot read is caught, and named).
@pytest.mark.parametrize(
    "damage, checksum, reason",
    [
        (lambda data: data[: len(data) // 2], True, "step_0000004.pt changed since it was written"),
        (flip_one_byte, True, "step_0000004.pt changed since it was written"),
        (
            lambda data: data[: len(data) // 2],
            False,
            "not a readable checkpoint, corrupt or truncated (truncated archive)",
        ),
        (
            lambda data: os.urandom(4096),
            False,
            "not a readable checkpoint, corrupt or truncated (not a torch.save archive)",
        ),
    ],
)
def test_corrupt_latest_checkpoint_falls_back_to_the_one_before(
    damage, checksum, reason, four_steps, small_overrides, tmp_path, caplog
):
    run = copy_run(four_steps, tmp_path)
    latest = run / "checkpoints" / "step_0000004.pt"
    latest.write_bytes(damage(latest.read_bytes()))
    if not checksum:
        for sidecar in latest.parent.glob("*.sha256"):
            sidecar.unlink()
    with caplog.at_level(logging.WARNING, logger="adahop"):
        trainer = Trainer(load_config(None, small_overrides(run, training__steps=6)), resume=True, progress=False)
    assert trainer.step == 2
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert f"{latest}: {reason}" in warning
    assert "weights_only" not in warning and "renamed it to step_0000004.pt.corrupt" in warning
    aside = ["step_0000004.pt.corrupt"] + (["step_0000004.pt.sha256.corrupt"] if checksum else [])
    kept = ["step_0000002.pt"] + (["step_0000002.pt.sha256"] if checksum else [])
    assert sorted(p.name for p in latest.parent.iterdir()) == sorted(kept + aside)


def test_no_readable_checkpoint_is_one_clear_error(four_steps, small_overrides, tmp_path):
    run = copy_run(four_steps, tmp_path)
    for path in (run / "checkpoints").iterdir():
        path.write_bytes(b"")
    with pytest.raises(CheckpointError, match="no readable checkpoint left in"):
        Trainer(load_config(None, small_overrides(run, training__steps=6)), resume=True, progress=False)


# ---- 4. writes killed midway -----------------------------------------------------------------
def killed_mid_write(path: Path) -> Path:
    """Start an atomic write of ``path`` in a subprocess, SIGKILL it midway; return its temp file."""
    code = (
        "import os, signal, sys\n"
        "from adahop.atomic import atomic_file\n"
        "with atomic_file(sys.argv[1]) as f:\n"
        "    f.write(b'x' * 100_000); f.flush()\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", code, str(path)], env=env, capture_output=True)
    assert done.returncode == -signal.SIGKILL
    (tmp,) = path.parent.glob(f".{path.name}.tmp*")
    return tmp


def test_temp_file_of_a_killed_checkpoint_write_is_removed_on_resume(four_steps, small_overrides, tmp_path, caplog):
    run = copy_run(four_steps, tmp_path)
    tmp = killed_mid_write(run / "checkpoints" / "step_0000006.pt")
    with caplog.at_level(logging.INFO, logger="adahop"):
        Trainer(load_config(None, small_overrides(run, training__steps=6)), resume=True, progress=False)
    assert not tmp.exists() and f"removed {tmp}, left by an interrupted write" in caplog.text
    assert sorted(p.name for p in tmp.parent.glob("*.pt")) == ["step_0000002.pt", "step_0000004.pt"]
    assert not list(tmp.parent.glob(".*"))


def test_temp_files_of_running_writers_are_kept(tmp_path):
    target = tmp_path / "plan.json"
    with atomic_file(target) as f:  # this process is writing it
        f.write(b"{}")
        assert remove_stale_temp_files(tmp_path) == []
    assert target.read_bytes() == b"{}" and [p.name for p in tmp_path.iterdir()] == ["plan.json"]


def test_loss_plot_and_metrics_are_replaced_atomically(tmp_path, monkeypatch):
    from matplotlib.figure import Figure

    records = [{"kind": "train", "step": 1, "loss": 5.0}, {"kind": "val", "step": 1, "loss": 5.5}]
    metrics_module.plot_losses(records, tmp_path / "loss.png")
    before = (tmp_path / "loss.png").read_bytes()

    def disk_full_midway(self, f, **kwargs):
        f.write(before[:100])
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(Figure, "savefig", disk_full_midway)
    with pytest.raises(OSError, match="No space left"):
        metrics_module.plot_losses(records, tmp_path / "loss.png")
    assert (tmp_path / "loss.png").read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["loss.png"]  # no temporary file left


def test_a_metrics_record_cut_short_is_left_out(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"kind": "train", "step": 1, "loss": 5.0}\n{"kind": "train", "st')
    assert read_metrics(tmp_path) == [{"kind": "train", "step": 1, "loss": 5.0}]


# ---- 5. Ctrl-C, unusable run directories, a full disk, no CUDA --------------------------------
def test_ctrl_c_is_one_line_with_the_last_checkpoint_and_exit_130(small_overrides, tmp_path, sigint_reaches_children):
    run = tmp_path / "run"
    process = run_cli(as_argv(small_overrides(run, training__steps=200)))
    first = run / "checkpoints" / "step_0000002.pt"
    while not first.exists() and process.poll() is None:  # no deadline: the run ends by itself
        time.sleep(0.1)
    process.send_signal(signal.SIGINT)
    _, err = process.communicate()  # no deadline: an interrupted run ends by itself
    assert process.returncode == 130, err
    line = error_line(err)
    assert line.startswith("adahop train: error: interrupted; stopped at step ") and " of 200; last checkpoint " in line
    assert line.endswith(f"continue with: adahop train --out {run} --resume")
    assert str(latest_checkpoint(run)) in line and (run / "loss.png").exists()
    assert not list((run / "checkpoints").glob(".*"))  # no half-written checkpoint


def test_full_disk_is_one_line_and_keeps_the_last_checkpoint(
    small_overrides, tmp_path, capsys, monkeypatch, disk_fills_up
):
    """The disk fills up inside torch.save's zip writer (a RuntimeError there): one line saying what
    failed, where the run stopped and how to continue; continuing then loses nothing."""
    save = trainer_module.save_checkpoint

    def disk_full_at_step_4(path, state):
        if state["step"] == 4:
            disk_fills_up(5000)
        return save(path, state)

    monkeypatch.setattr(trainer_module, "save_checkpoint", disk_full_at_step_4)
    run = tmp_path / "run"
    assert main(as_argv(small_overrides(run))) == 1
    line = error_line(capsys.readouterr().err)
    assert line == (
        f"adahop train: error: cannot write {run / 'checkpoints' / 'step_0000004.pt'}: No space left on device; "
        f"stopped at step 4 of 6; last checkpoint {run / 'checkpoints' / 'step_0000002.pt'}; "
        f"continue with: adahop train --out {run} --resume"
    )
    monkeypatch.undo()  # space freed
    assert main(["--out", str(run), "--resume"]) == 0
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == [1, 2, 3, 4, 5, 6]  # 3, 4 again
    assert latest_checkpoint(run).name == "step_0000006.pt"


@pytest.mark.parametrize(
    "setup, expected",
    [
        (lambda out: out.write_text(""), "is a file, not a directory"),
        (
            lambda out: out.parent.joinpath("file").write_text(""),
            "cannot create the run directory --out .*file/run: Not a directory",
        ),
    ],
)
def test_unusable_out_is_one_line(setup, expected, small_overrides, tmp_path, capsys):
    out = tmp_path / "run"
    setup(out)
    if "file/run" in expected:
        out = tmp_path / "file" / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(as_argv(small_overrides(out)))
    assert exit_info.value.code == 2
    assert expected.split(" .*")[0] in error_line(capsys.readouterr().err)


def test_unwritable_out_is_one_line(small_overrides, tmp_path, monkeypatch):
    monkeypatch.setattr(trainer_module.os, "access", lambda path, mode: False)  # as a non-root user sees a 0o500 dir
    with pytest.raises(ConfigError, match="cannot write to the run directory --out .*; pass a writable --out DIR"):
        Trainer(load_config(None, small_overrides(tmp_path / "run")), progress=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only machine")
def test_cuda_without_cuda_is_one_line(small_overrides, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(as_argv(small_overrides(tmp_path / "run", training__device="cuda")))
    assert exit_info.value.code == 2
    assert "no CUDA device is available; use 'auto' or 'cpu'" in error_line(capsys.readouterr().err)


# ---- 6. run directories without a checkpoint -----------------------------------------------
def test_new_run_refuses_to_overwrite_metrics_without_a_checkpoint(four_steps, small_overrides, tmp_path):
    run = copy_run(four_steps, tmp_path)
    shutil.rmtree(run / "checkpoints")
    before = (run / "metrics.jsonl").read_bytes()
    with pytest.raises(
        ConfigError, match="holds metrics.jsonl and plan.json of an earlier run that wrote no checkpoint"
    ):
        Trainer(load_config(None, small_overrides(run)), progress=False)
    assert (run / "metrics.jsonl").read_bytes() == before


def test_resume_without_a_checkpoint_is_an_error(small_overrides, tmp_path):
    with pytest.raises(ConfigError, match="--resume: no checkpoint in .*typo/checkpoints; check --out"):
        Trainer(load_config(None, small_overrides(tmp_path / "typo")), resume=True, progress=False)
    assert not (tmp_path / "typo").exists()  # the mistyped directory is not created


# ---- 9. the progress bar's ETA -----------------------------------------------------------------
def test_progress_bar_restarts_its_eta_when_calibration_ends(small_overrides, tmp_path, monkeypatch):
    starts = []

    def recording_tqdm(*args, initial=0, **kwargs):
        starts.append(initial)
        return trainer_module.tqdm.__wrapped__(*args, initial=initial, **kwargs)

    recording_tqdm.__wrapped__ = trainer_module.tqdm
    monkeypatch.setattr(trainer_module, "tqdm", recording_tqdm)
    Trainer(load_config(None, small_overrides(tmp_path / "run", training__steps=3)), progress=False).train()
    assert starts == [0, 2]  # the calibration bar, then the frozen one (its own rate) after the freeze (step 2)


# ---- 6. two runs on one --out ----------------------------------------------------------------
def test_a_second_run_on_a_busy_out_refuses_in_one_line_and_a_dead_runs_lock_does_not_block(
    four_steps, small_overrides, tmp_path, capsys
):
    """Another process holds the run directory's lock (as a running ``adahop train`` does): a new
    run and a resume there both refuse, naming it, and touch nothing. Once that process is
    killed (SIGKILL: no clean-up), its lock is gone with it and the resume goes ahead."""
    run = copy_run(four_steps, tmp_path)
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from adahop.train.run_lock import run_lock\nfrom pathlib import Path\n"
            f"with run_lock(Path({str(run)!r})):\n    print('locked', flush=True)\n    input()",
        ],
        env={**os.environ, "PYTHONPATH": str(SRC)},
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "locked\n"
        before = run_files(run)
        for argv in (as_argv(small_overrides(run)), ["--out", str(run), "--resume", "--steps", "6"]):
            assert main(argv) == 1
            line = error_line(capsys.readouterr().err)
            assert line.startswith(f"adahop train: error: --out {run} is in use by another run (pid {holder.pid} on ")
            assert line.endswith("wait for it to finish, stop it, or pass another --out DIR")
            assert run_files(run) == before
    finally:
        holder.kill()
        holder.wait()
    assert main(["--out", str(run), "--resume", "--steps", "6"]) == 0
    assert latest_checkpoint(run).name == "step_0000006.pt"


# ---- 7. the data changed under a resumed run -------------------------------------------------
def test_resume_refuses_changed_data_unless_accepted_and_a_touched_source_is_not_a_change(
    corpus, small_overrides, tmp_path, capsys
):
    source, run = tmp_path / "corpus.txt", tmp_path / "run"
    source.write_text(corpus.read_text())
    argv = as_argv(small_overrides(run, training__steps=2, data__source=source))
    assert main(argv) == 0
    written = torch.load(latest_checkpoint(run), weights_only=True)["data_fingerprint"]
    tokens = written["tokens"]
    assert written["source"] == str(source) and len(written["sha256"]) == 64
    capsys.readouterr()
    resume = ["--out", str(run), "--resume", "--steps"]
    os.utime(source, ns=(1, 1))  # touched, not changed: re-tokenized into the same tokens
    assert main([*resume, "3"]) == 0
    source.write_text(corpus.read_text().replace("json", "JSON"))  # edited
    before = run_files(run)
    with pytest.raises(SystemExit) as refused:
        main([*resume, "4"])
    assert refused.value.code == 2
    line = error_line(capsys.readouterr().err)
    assert (
        f"the data changed since {run / 'checkpoints' / 'step_0000003.pt'} was written: it trained on {source}: "
        in line
    )
    assert f"{tokens:,} tokens, sha256 {written['sha256'][:12]}, the data is now {source}: " in line
    assert line.endswith("restore that data, or resume with --accept-changed-data to go on with this data knowingly")
    assert run_files(run) == before  # nothing recorded
    assert main([*resume, "4", "--accept-changed-data"]) == 0
    (record,) = [r for r in read_metrics(run) if r["kind"] == "resume" and r["step"] == 3]
    assert any(change.startswith(f"data ({source}: ") for change in record["changes"])
    now = torch.load(latest_checkpoint(run), weights_only=True)["data_fingerprint"]
    assert now["sha256"] != written["sha256"]  # the next resume compares with the new data
