"""When a run stops on a signal: SIGTERM (what Slurm and Kubernetes send) finishes the step,
writes a checkpoint and exits 143 with one line saying how to resume; past
``training.sigterm_grace`` it exits without that checkpoint; under torchrun the ranks stop
together, and workers die with a SIGKILLed launcher. The signals' outcomes are asserted, never
how long anything took: waits end when the awaited file appears or the process ends."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from adahop.train import latest_checkpoint, read_metrics
from adahop.train import trainer as trainer_module
from adahop.train.cli import main
from adahop.train.stopping import SIGTERM_EXIT_STATUS

pytestmark = pytest.mark.usefixtures("one_thread")

SRC = Path(__file__).parents[1] / "src"
ONE_BLOCK = {"model__overrides__n_layers": 1}
LIVENESS_S = 300  # how long a process may take to go away before the test fails: only a hang reaches it


def as_argv(pairs: list[tuple[str, str]]) -> list[str]:
    return [f"--{k}={v}" for k, v in pairs]


def train_losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["kind"] in ("train", "val")]


def the_line(err: str) -> str:
    """The one ``adahop train:`` line, checked to be the only one and to have no traceback."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("adahop train:")]
    assert len(lines) == 1, err
    return lines[0]


def sigterm_in_step(monkeypatch, step: int) -> None:
    """Send this process SIGTERM during the forward of ``step``, as a scheduler would."""
    micro_step = trainer_module.Trainer._micro_step

    def signalled(self, *args, **kwargs):
        if self.step + 1 == step:
            os.kill(os.getpid(), signal.SIGTERM)
        return micro_step(self, *args, **kwargs)

    monkeypatch.setattr(trainer_module.Trainer, "_micro_step", signalled)


def test_sigterm_finishes_the_step_checkpoints_and_exits_143(small_overrides, tmp_path, monkeypatch, capsys):
    """SIGTERM in step 2 of a run that checkpoints every 4 steps: step 2 is finished and saved,
    the line says how to resume, and the resumed run takes the uninterrupted run's steps."""
    straight, run = tmp_path / "straight", tmp_path / "run"
    assert main(as_argv(small_overrides(straight, **ONE_BLOCK, checkpoint__interval=4))) == 0
    with monkeypatch.context() as patch:
        sigterm_in_step(patch, 2)
        assert main(as_argv(small_overrides(run, **ONE_BLOCK, checkpoint__interval=4))) == SIGTERM_EXIT_STATUS == 143
    checkpoint = run / "checkpoints" / "step_0000002.pt"
    assert the_line(capsys.readouterr().err) == (
        f"adahop train: terminated (SIGTERM) after a checkpoint; stopped at step 2 of 6; last checkpoint "
        f"{checkpoint}; continue with: adahop train --out {run} --resume"
    )
    assert latest_checkpoint(run) == checkpoint
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the handler is gone with the run
    assert main(["--out", str(run), "--resume"]) == 0
    assert train_losses(run) == train_losses(straight)


def test_sigterm_without_checkpoint_stops_at_once(small_overrides, tmp_path, monkeypatch, capsys):
    run = tmp_path / "run"
    sigterm_in_step(monkeypatch, 3)
    overrides = small_overrides(run, **ONE_BLOCK, training__sigterm_checkpoint="false")
    assert main(as_argv(overrides)) == 143
    assert the_line(capsys.readouterr().err) == (
        f"adahop train: error: terminated (SIGTERM); stopped at step 2 of 6; last checkpoint "
        f"{run / 'checkpoints' / 'step_0000002.pt'}; continue with: adahop train --out {run} --resume"
    )
    assert latest_checkpoint(run).name == "step_0000002.pt"


def test_sigterm_grace_ends_a_checkpoint_that_never_finishes(small_overrides, tmp_path):
    """The step-4 checkpoint write hangs after SIGTERM: past training.sigterm_grace the process
    exits 143 naming the step-2 checkpoint, and the hung write left nothing behind."""
    run = tmp_path / "run"
    code = (
        "import os, signal, sys, threading\n"
        "from adahop.train import trainer\n"
        "from adahop.train.cli import main\n"
        "save = trainer.Trainer.save\n"
        "def hung(self):\n"
        "    if self.step == 4:\n"
        "        os.kill(os.getpid(), signal.SIGTERM)\n"
        "        threading.Event().wait()\n"
        "    return save(self)\n"
        "trainer.Trainer.save = hung\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = as_argv(small_overrides(run, **ONE_BLOCK, training__sigterm_grace=1))
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    done = subprocess.run([sys.executable, "-c", code, *argv], env=env, capture_output=True, text=True)
    assert done.returncode == 143, done.stderr
    assert the_line(done.stderr) == (
        f"adahop train: error: terminated (SIGTERM), no checkpoint within training.sigterm_grace=1 s; "
        f"stopped at step 4 of 6; last checkpoint {run / 'checkpoints' / 'step_0000002.pt'}; "
        f"continue with: adahop train --out {run} --resume"
    )
    assert sorted(p.name for p in (run / "checkpoints").iterdir() if p.suffix == ".pt") == ["step_0000002.pt"]


# ---- under torchrun --------------------------------------------------------------------------
def torchrun(argv: list[str], *options: str) -> subprocess.Popen:
    """``torchrun --standalone --nproc-per-node=2 -m adahop train ARGV`` (``--standalone`` binds
    its rendezvous on port 0 and hands it to the workers: no port to race for), in a session of
    its own so that a signal to its group reaches it and its workers alone."""
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", *options]
    command += ["-m", "adahop", "train", *argv]
    return subprocess.Popen(
        command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def wait_for(path: Path, process: subprocess.Popen) -> None:
    """Until ``path`` exists (no deadline: the run ends by itself if it never does)."""
    while not path.exists():
        assert process.poll() is None, process.communicate()[1]
        time.sleep(0.2)


def workers_of(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def gone(pid: int) -> bool:
    """Exited (a zombie waiting for its new parent to reap it counts)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


TORCHRUN = pytest.mark.skipif(not dist.is_available() or not sys.platform.startswith("linux"), reason="Linux")


@pytest.mark.slow
@TORCHRUN
def test_sigterm_to_torchrun_stops_both_ranks_at_one_checkpoint(small_overrides, tmp_path):
    """torchrun forwards SIGTERM to its workers; they agree on a step, write its sharded
    checkpoint together and rank 0 prints the one line (torchrun's own exit status and report
    are torchrun's)."""
    run = tmp_path / "run"
    process = torchrun(as_argv(small_overrides(run, **ONE_BLOCK, training__steps=300)))
    wait_for(run / "checkpoints" / "step_0000002", process)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate()
    lines = [line for line in err.splitlines() if line.startswith("adahop train:")]
    assert len(lines) == 1 and lines[0].startswith("adahop train: terminated (SIGTERM) after a checkpoint;"), err
    latest = latest_checkpoint(run)
    assert f"last checkpoint {latest};" in lines[0] and (latest / ".metadata").is_file()
    assert f"continue with: torchrun --nproc-per-node=2 -m adahop train --out {run} --resume" in lines[0]


@pytest.mark.slow
@TORCHRUN
def test_a_sigkilled_torchrun_leaves_no_workers_training_on(small_overrides, tmp_path):
    run = tmp_path / "run"
    process = torchrun(as_argv(small_overrides(run, **ONE_BLOCK, training__steps=300)))
    wait_for(run / "checkpoints" / "step_0000002", process)
    workers = workers_of(process.pid)
    assert len(workers) == 2
    process.kill()
    process.communicate()
    deadline = time.monotonic() + LIVENESS_S
    while not all(gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(gone(pid) for pid in workers)
    assert not (run / "checkpoints" / "step_0000300").exists()


@pytest.mark.slow
@TORCHRUN
def test_one_killed_rank_is_one_line(small_overrides, tmp_path):
    """Rank 1 is SIGKILLed (as by the out-of-memory killer): rank 0's collective breaks and it
    says so in one line; torchrun adds its own report of rank 1's signal."""
    run = tmp_path / "run"
    process = torchrun(as_argv(small_overrides(run, **ONE_BLOCK, training__steps=300)))
    wait_for(run / "checkpoints" / "step_0000002", process)
    workers = workers_of(process.pid)
    os.kill(workers[1], signal.SIGKILL)
    _, err = process.communicate()
    assert process.returncode != 0
    lines = [line for line in err.splitlines() if line.startswith("adahop train:")]
    assert len(lines) == 1, err
    assert "another rank exited without a word (killed, e.g. by the out-of-memory killer, or crashed" in lines[0]
    assert "continue with: torchrun --nproc-per-node=2 -m adahop train" in lines[0]


@pytest.mark.slow
@TORCHRUN
def test_ctrl_c_under_torchrun_is_one_line(small_overrides, tmp_path, sigint_reaches_children):
    """Ctrl-C signals the terminal's whole process group: every worker stops where it is and the
    first to stop prints the one line (workers exit 130; torchrun's own exit status is torchrun's)."""
    run = tmp_path / "run"
    process = torchrun(as_argv(small_overrides(run, **ONE_BLOCK, training__steps=300)))
    wait_for(run / "checkpoints" / "step_0000002", process)
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate()
    lines = [line for line in err.splitlines() if line.startswith("adahop train:")]
    assert len(lines) == 1 and "interrupted; stopped at step " in lines[0], err
    assert f"continue with: torchrun --nproc-per-node=2 -m adahop train --out {run} --resume" in lines[0]


@pytest.mark.slow
@TORCHRUN
def test_ctrl_c_exits_130_with_a_checkpoint_when_torchrun_leaves_sigint_alone(
    small_overrides, tmp_path, sigint_reaches_children
):
    """``torchrun --signals-to-handle=SIGTERM,SIGHUP,SIGQUIT`` (docs/reliability.md): Ctrl-C ends
    torchrun by SIGINT itself (a shell reports 130), and its shutdown SIGTERMs the workers, which
    stop together after a checkpoint."""
    run = tmp_path / "run"
    process = torchrun(
        as_argv(small_overrides(run, **ONE_BLOCK, training__steps=300)), "--signals-to-handle=SIGTERM,SIGHUP,SIGQUIT"
    )
    wait_for(run / "checkpoints" / "step_0000002", process)
    os.killpg(process.pid, signal.SIGINT)
    _, err = process.communicate()
    assert process.returncode == -signal.SIGINT  # killed by SIGINT: 130 in a shell
    lines = [line for line in err.splitlines() if line.startswith("adahop train:")]
    assert len(lines) == 1 and lines[0].startswith("adahop train: terminated (SIGTERM) after a checkpoint;"), err
    assert f"last checkpoint {latest_checkpoint(run)};" in lines[0]
