"""``adahop train`` on two CPU ranks (gloo), as ``torchrun --nproc-per-node=2 -m adahop train``
runs it: FSDP2, per-rank data shares, sharded checkpoints, resume on 2 and on 1 rank, and one
rank failing.

Each rank is a spawned process that sets torchrun's variables (RANK, WORLD_SIZE, MASTER_ADDR,
...) and calls the CLI's ``main``; one spawn runs several jobs in turn (a process group each),
so the processes start (and import torch) once per test module, not once per run.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from full_disk import FillingFile

from rendezvous import HostedStore

from adahop.nn import model_plan
from adahop.nn.state import decode_state
from adahop.policy import ModelPlan
from adahop.train import (
    Trainer,
    build_model_from_config,
    latest_checkpoint,
    load_checkpoint,
    load_config,
    read_metrics,
)

pytestmark = [
    pytest.mark.skipif(not dist.is_available(), reason="torch.distributed is not available"),
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),  # DCP read by the test process alone
]
WORLD = 2
TOLERANCE = 1e-6  # relative, 2 ranks against 1 process: see the first test
TIMEOUT_S = 360  # the whole spawn; a hang fails the test instead of stalling CI
STALL_TIMEOUT_S = 15  # training.timeout of the run with a stopped rank: generous for a busy machine


class Interrupted(Exception):
    """Stands in for a preemption right after a checkpoint was written."""


def as_argv(pairs: list[tuple[str, str]]) -> list[str]:
    return [f"--{k}={v}" for k, v in pairs]


@contextlib.contextmanager
def filling_stream(self, path, mode):
    """DCP's file stream on a disk that is full after 1000 bytes, inside ``torch.save``."""
    with open(path, mode) as stream:
        yield FillingFile(stream, 1000)


def damage_a_shard(source: str, run: str, checksums: bool) -> None:
    """Copy run ``source`` to ``run`` and damage the step-6 checkpoint's shard of rank 1: one
    byte flipped (caught by its checksum) or, for a checkpoint written before checksums, cut short."""
    shutil.copytree(source, run)
    checkpoint = Path(run) / "checkpoints" / "step_0000006"
    shard = checkpoint / "__1_0.distcp"
    data = shard.read_bytes()
    if checksums:
        shard.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    else:
        (checkpoint / "checksums.sha256").unlink()
        shard.write_bytes(data[: len(data) // 2])


def run_rank(rank: int, jobs: list[dict], logs: str) -> None:
    """Rank ``rank``'s side of each job: ``main(job["argv"])`` under torchrun's variables, its
    stderr (file descriptor 2, so gloo's C++ messages too) and exit status kept in ``logs``."""
    from torch.distributed.checkpoint.filesystem import FileSystem

    from adahop.train import trainer as trainer_module
    from adahop.train.cli import main

    torch.set_num_threads(1)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(WORLD))
    save_sharded, micro_step = trainer_module.save_sharded, trainer_module.Trainer._micro_step
    train = trainer_module.Trainer.train
    for i, job in enumerate(jobs):
        os.environ.update(job["rendezvous"])

        def save_then_crash(path, job=job, **kwargs):
            if rank == 1 and kwargs["step"] == job.get("full_disk_at"):
                with mock.patch.object(FileSystem, "create_stream", filling_stream):
                    return save_sharded(path, **kwargs)
            save_sharded(path, **kwargs)
            if kwargs["step"] == job.get("crash_after"):
                raise Interrupted

        def faults(self, inputs, targets, job=job, **kwargs):
            if rank == 1 and self.step + 1 == job.get("fail_at"):
                raise RuntimeError("simulated fault on rank 1")
            if rank == 1 and self.step + 1 == job.get("stall_at"):
                os.kill(os.getpid(), signal.SIGSTOP)  # stopped until the test kills it
            if rank in job.get("sigterm_ranks", ()) and self.step + 1 == job["sigterm_at"]:
                os.kill(os.getpid(), signal.SIGTERM)  # what Slurm sends; handled before the next line runs
            return micro_step(self, inputs, targets, **kwargs)

        def train_then_keep_osci(self, i=i, job=job):
            """With ``keep_osci``: this rank's rows of the de-oscillation state at the start or the end."""

            def keep():
                tracks = self.osci_reset.state_dict()["tracks"]
                torch.save({k: v.to_local() for k, v in tracks.items()}, f"{logs}/job{i}.rank{rank}.osci")

            if job.get("keep_osci") == "start":
                keep()
            result = train(self)
            if job.get("keep_osci") == "end":
                keep()
            return result

        trainer_module.save_sharded, trainer_module.Trainer._micro_step = save_then_crash, faults
        trainer_module.Trainer.train = train_then_keep_osci
        if rank == 0 and "damage" in job:  # before the ranks meet: rank 1 reads the run after rank 0
            damage_a_shard(*job["damage"])
        with open(f"{logs}/job{i}.rank{rank}.err", "w") as err:
            os.dup2(err.fileno(), 2)
            status = main(job["argv"])
            sys.stderr.flush()
        Path(f"{logs}/job{i}.rank{rank}.status").write_text(str(status))


def spawn(jobs: list[dict], logs: Path) -> list[list[tuple[int | None, str]]]:
    """Run ``jobs`` on 2 ranks; per job, each rank's (exit status, stderr); a job with
    ``stall_at`` must be the last: once rank 0 is done with it, the stopped rank is killed (its
    status: None)."""
    logs.mkdir(parents=True, exist_ok=True)
    stores = [HostedStore() for _ in jobs]  # bound here, before the ranks start: no port to race for
    jobs = [{**job, "rendezvous": store.env} for job, store in zip(jobs, stores)]
    context = mp.start_processes(run_rank, args=(jobs, str(logs)), nprocs=WORLD, start_method="spawn", join=False)
    deadline = time.monotonic() + TIMEOUT_S
    stalled = "stall_at" in jobs[-1]
    while True:
        if stalled and (logs / f"job{len(jobs) - 1}.rank0.status").exists():
            context.processes[1].kill()  # SIGKILL ends a stopped process too
        try:
            if context.join(timeout=5):
                break
        except mp.ProcessExitedException:
            assert stalled, "a rank died"
            break
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"the 2-rank run did not end within {TIMEOUT_S} s")

    def status(path: Path) -> int | None:
        return int(path.read_text()) if path.exists() else None

    return [
        [(status(logs / f"job{i}.rank{r}.status"), (logs / f"job{i}.rank{r}.err").read_text()) for r in range(WORLD)]
        for i in range(len(jobs))
    ]


def losses(run: Path) -> list[tuple[str, int, float]]:
    return [(r["kind"], r["step"], r["loss"]) for r in read_metrics(run) if r["kind"] in ("train", "val")]


def train_losses(run: Path) -> list[float]:
    return [r["loss"] for r in read_metrics(run) if r["kind"] == "train"]


# The small runs of conftest (a global batch of 4: 2 rows per rank) with one transformer block:
# FSDP shards it and the root, and each step costs half as much.
ONE_BLOCK = {"model__overrides__n_layers": 1}
# mxfp4_hadamard quantizes every GEMM from step 1; dY rounds to nearest, so the 2-rank run can be
# compared with one process (stochastic rounding draws its noise per rank).
# Read on the host every 4 steps only: until then the ranks refuse the bad steps on the device.
DIVERGING = {"recipe": "bf16", "optim__lr": 1e6, "optim__warmup_steps": 0, "logging__log_every": 4}
DIVERGING |= {"logging__val_every": 4, "checkpoint__interval": 4}
TELEMETRY = {"training__pattern_telemetry_every": 2}  # the resumed run samples patterns, the straight one not
NEAREST = ONE_BLOCK | {"recipe": "mxfp4_hadamard", "recipe__grad_rounding": "nearest", "training__steps": 4}
BF16_GATHER = {"training__fsdp_low_precision_all_gather": "false"}
# Weight de-oscillation that resets from step 3 on (one reversal is enough), through the Hadamard.
OSCI = ONE_BLOCK | {"recipe": "mxfp4_hadamard", "recipe__osci_reset": 0.001}
OSCI_JOBS = slice(12, 16)  # straight, cut off after step 4, resumed; a one-process run resumed on 2 ranks
LOW_PRECISION_GATHER = {"training__fsdp_low_precision_all_gather": "true"}


@pytest.fixture(scope="module")
def runs(small_overrides, tmp_path_factory):
    """One process with nearest rounding; then one 2-rank spawn: the same run, a straight
    adahop_lv2 run (6 steps, 2 of calibration, a checkpoint every 2), that run cut off right
    after its step-2 checkpoint (still calibrating: per-rank votes) and resumed, the
    one-process run resumed on 2 ranks from its step-2 checkpoint, a run whose loss diverges,
    one whose rank 1 finds the disk full at the step-4 checkpoint, the straight run resumed
    from step 4 after a shard of its step-6 checkpoint was damaged (with and without checksums),
    two stopped by SIGTERM (one resumed), and one whose rank 1 fails in step 3 (last: its
    processes go on, but in a group of their own, and rank 0 notices only when rank 1's process
    exits)."""
    root = tmp_path_factory.mktemp("dist")
    Trainer(load_config(None, small_overrides(root / "single", **NEAREST)), progress=False).train()  # caches the tokens
    shutil.copytree(root / "single", root / "widened")
    Trainer(
        load_config(None, small_overrides(root / "osci_widened", **OSCI, training__steps=4)), progress=False
    ).train()
    (root / "widened" / "checkpoints" / "step_0000004.pt").unlink()
    jobs = [
        {"argv": as_argv(small_overrides(root / "nearest", **NEAREST, **LOW_PRECISION_GATHER))},
        {"argv": as_argv(small_overrides(root / "straight", **ONE_BLOCK))},
        {"argv": as_argv(small_overrides(root / "resumed", **ONE_BLOCK, **TELEMETRY)), "crash_after": 2},
        {"argv": ["--out", str(root / "resumed"), "--resume"]},
        {"argv": ["--out", str(root / "widened"), "--resume"]},
        {"argv": as_argv(small_overrides(root / "diverging", **ONE_BLOCK, **DIVERGING))},
        {"argv": as_argv(small_overrides(root / "full_disk", **ONE_BLOCK)), "full_disk_at": 4},
    ]
    for name, checksums in (("damaged", True), ("damaged_unchecked", False)):
        # The whole config in the arguments: rank 1 must not read the run before rank 0 copied it.
        resume = [*as_argv(small_overrides(root / name, **ONE_BLOCK)), "--resume"]
        jobs.append({"argv": resume, "damage": (str(root / "straight"), str(root / name), checksums)})
    jobs += [
        {"argv": as_argv(small_overrides(root / "sigterm_one", **ONE_BLOCK)), "sigterm_ranks": [1], "sigterm_at": 2},
        {"argv": ["--out", str(root / "sigterm_one"), "--resume"]},
        {"argv": as_argv(small_overrides(root / "sigterm_all", **ONE_BLOCK)), "sigterm_ranks": [0, 1], "sigterm_at": 2},
    ]
    jobs += [
        {"argv": as_argv(small_overrides(root / "osci_straight", **OSCI)), "keep_osci": "end"},
        {"argv": as_argv(small_overrides(root / "osci_resumed", **OSCI)), "crash_after": 4},
        {"argv": ["--out", str(root / "osci_resumed"), "--resume"], "keep_osci": "end"},
        {"argv": ["--out", str(root / "osci_widened"), "--resume", "--steps=6"], "keep_osci": "start"},
    ]
    # "nearest" with FSDP2's own BF16 gather (training.fsdp_low_precision_all_gather off).
    jobs.append({"argv": as_argv(small_overrides(root / "bf16_gather", **NEAREST, **BF16_GATHER))})
    jobs.append({"argv": as_argv(small_overrides(root / "failing", **ONE_BLOCK)), "fail_at": 3})  # last: see above
    return root, spawn(jobs, root / "logs")


def test_low_precision_all_gather_trains_bit_identically_to_the_bf16_gather(runs):
    """ "nearest" gathers the weights whose ranks hold whole MX blocks along out (32 rows or more
    each: all but wk and wv) as their MXFP4 operands (adahop.nn.fsdp, asked for); the same
    run with FSDP2's own gather takes the very same steps."""
    root, results = runs
    assert [status for status, _ in results[-2]] == [0, 0], results[-2]
    assert load_config(root / "nearest" / "config.toml").training.fsdp_low_precision_all_gather
    assert losses(root / "nearest") == losses(root / "bf16_gather")


@pytest.fixture(scope="module")
def stalled(small_overrides, tmp_path_factory):
    """A 2-rank run whose rank 1 stops itself (SIGSTOP) in step 3; a spawn of its own, as the
    stopped process is killed at the end."""
    root = tmp_path_factory.mktemp("stalled")
    overrides = small_overrides(root / "run", **ONE_BLOCK, training__timeout=STALL_TIMEOUT_S)
    [result] = spawn([{"argv": as_argv(overrides), "stall_at": 3}], root / "logs")
    return root / "run", result


def rank_states(checkpoint: Path, tmp_path: Path) -> list[dict]:
    """The per-rank entries of a sharded checkpoint (data position, generators, layer plans), read
    as a user would: DCP's own conversion to one torch.save file, loaded with ``weights_only``
    (nothing in it is pickled: every entry is a tensor)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from adahop.train.sharded_checkpoint import from_tensors

    whole = tmp_path / "whole.pt"
    dcp_to_torch_save(checkpoint, whole)
    state = torch.load(whole, weights_only=True)
    assert from_tensors(state["train"])["step"] == int(checkpoint.name.removeprefix("step_"))
    return [from_tensors(state["ranks"][str(r)]) for r in range(WORLD)]


def test_two_ranks_train_like_one_process_on_the_same_global_batch(runs):
    """Each rank's loss is the mean over its 2 rows and the ranks' losses are averaged; FSDP
    averages the gradients of the halves. MX and Hadamard blocks run along tokens, and each rank
    holds 64 tokens, a whole number of blocks, so quantization sees the same blocks as on one
    process. What differs is the order of floating-point sums (over ranks, then rows), about
    1e-7 relative per step, which AdamW's steps carry on (the largest difference seen over these
    4 steps: 8e-8): hence rel=1e-6. Such noise could flip the rounding of an element that sits on a
    boundary and give a larger (still small) difference; in this deterministic CPU run none does."""
    root, results = runs
    (status0, err0), (status1, err1) = results[0]
    assert (status0, status1) == (0, 0), err0 + err1
    two, one = root / "nearest", root / "single"
    assert [k for k, _, _ in losses(two)] == [k for k, _, _ in losses(one)]
    assert [loss for _, _, loss in losses(two)] == pytest.approx([loss for _, _, loss in losses(one)], rel=TOLERANCE)
    assert "step 1/4" in err0 and err1 == ""  # rank 0 logs, rank 1 is silent
    train = [r for r in read_metrics(two) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4]
    assert all(
        len(r["memory_mib_per_rank"]) == WORLD and r["memory_mib"] == max(r["memory_mib_per_rank"]) for r in train
    )
    assert [r["tokens"] for r in train] == [128 * s for s in range(1, 5)]  # global tokens
    # Sharded checkpoints: directories, the newest 2 kept, nothing left of the writes.
    assert sorted(p.name for p in (two / "checkpoints").iterdir()) == ["step_0000002", "step_0000004"]
    assert (two / "checkpoints" / "step_0000004" / ".metadata").is_file()


def test_ranks_freeze_one_plan_from_merged_votes_and_save_it_once(runs, tmp_path):
    root, results = runs
    (_, err0), (_, err1) = results[1]
    run = root / "straight"
    assert err0.count("strategy plan frozen") == 1 and "strategy plan frozen" not in err1
    saved = ModelPlan.load(run / "plan.json").to_json()
    for state in rank_states(run / "checkpoints" / "step_0000006", tmp_path):
        plans = {name: decode_state(layer)[0] for name, layer in state["layers"].items()}
        assert ModelPlan(plans).to_json() == saved
    model = build_model_from_config(load_config(run / "config.toml"))  # what `adahop analyze` does
    assert load_checkpoint(run, model)["step"] == 6
    assert model_plan(model).to_json() == saved


def test_resume_on_two_ranks_is_bit_exact(runs):
    root, results = runs
    assert [status for job in results[1:4] for status, _ in job] == [0, 0, 1, 1, 0, 0]
    crashed = results[2]
    assert sum(err.count("error:") for _, err in crashed) == 1  # one message for the run
    assert losses(root / "resumed") == losses(root / "straight")  # every train and validation loss
    # The sharded checkpoint records its noise layout: no "other stochastic-rounding noise" resume record.
    assert not [r for r in read_metrics(root / "resumed") if r["kind"] == "resume"]
    # Pattern telemetry after calibration (votes merged over ranks) leaves the training numbers alone.
    patterns = [r for r in read_metrics(root / "resumed") if r["kind"] == "patterns"]
    assert [(r["step"], r["layers"]) for r in patterns] == [(4, 7), (6, 7)]
    assert train_losses(root / "straight") != pytest.approx(train_losses(root / "nearest"), rel=1e-6)  # noise: on


def osci_rows(root: Path, job: int) -> list[dict[str, torch.Tensor]]:
    """Each rank's rows of the de-oscillation state at the end of job ``job`` (``keep_osci``)."""
    return [torch.load(root / "logs" / f"job{job}.rank{r}.osci", weights_only=True) for r in range(WORLD)]


def test_osci_reset_state_resumes_on_two_ranks_bit_exact(runs, tmp_path):
    """Each rank's rows of the de-oscillation state go into the sharded checkpoint (DTensors, as
    the weights), so the 2-rank run cut off after step 4 resets the same elements in steps 5
    and 6 as the straight one and ends with the same state; the checkpoint still holds only
    tensors (read with ``weights_only``)."""
    root, results = runs
    straight, crashed, resumed, _ = range(OSCI_JOBS.start, OSCI_JOBS.stop)
    assert [[status for status, _ in results[job]] for job in (straight, crashed, resumed)] == [[0, 0], [1, 1], [0, 0]]
    assert losses(root / "osci_resumed") == losses(root / "osci_straight")
    ends = osci_rows(root, straight)
    for a, b in zip(ends, osci_rows(root, resumed)):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert all(rows["layers.0.attention.wq.rate"].shape[0] == 32 for rows in ends)  # 64 rows, split in halves
    for state in rank_states(root / "osci_resumed" / "checkpoints" / "step_0000006", tmp_path):
        assert state["osci_resets"] > 0


def test_two_rank_osci_reset_state_loads_whole_in_one_process(runs):
    """DCP gathers the ranks' rows of the de-oscillation state into whole tensors for one process."""
    from adahop.nn import OsciReset
    from adahop.train.sharded_checkpoint import load_sharded, read_sharded

    root, _ = runs
    checkpoint = root / "osci_straight" / "checkpoints" / "step_0000006"
    model = build_model_from_config(load_config(root / "osci_straight" / "config.toml"))
    osci = OsciReset(model, 0.001)
    load_sharded(checkpoint, read_sharded(checkpoint), model, osci_reset=osci)
    ranks = osci_rows(root, OSCI_JOBS.start)
    whole = osci.state_dict()["tracks"]
    assert whole.keys() == ranks[0].keys() and len(whole) == 3 * 7  # 7 layers, 3 tensors each
    for key, value in whole.items():
        assert torch.equal(value, torch.cat([rows[key] for rows in ranks])), key


def test_one_process_osci_reset_state_resumes_on_two_ranks_split_by_rows(runs):
    """Each rank keeps its rows of a single-process checkpoint's whole de-oscillation state, the
    rows of its weight shard; rank 0 takes the count of resets."""
    root, results = runs
    widened = OSCI_JOBS.stop - 1
    assert [status for status, _ in results[widened]] == [0, 0], results[widened]
    saved = torch.load(root / "osci_widened" / "checkpoints" / "step_0000004.pt", weights_only=True)["osci_reset"]
    assert saved["resets"] > 0
    ranks = osci_rows(root, widened)
    for key, whole in saved["tracks"].items():
        assert all(torch.equal(rows[key], half) for rows, half in zip(ranks, whole.chunk(WORLD))), key


def test_two_rank_checkpoint_resumes_on_one_process(runs, small_overrides, tmp_path):
    """DCP gathers the shards into whole tensors; the data goes on from the global position, the
    plan comes from the checkpoint. One process rounds the ranks' rows with other noise, so the
    losses follow the 2-rank run closely but not bit for bit."""
    root, _ = runs
    run = tmp_path / "one"
    shutil.copytree(root / "straight", run)
    shutil.rmtree(run / "checkpoints" / "step_0000006")
    trainer = Trainer(load_config(None, small_overrides(run, **ONE_BLOCK)), resume=True, progress=False)
    assert trainer.step == 4 and trainer.phase == "frozen"
    assert trainer.data.train.state_dict()["position"] == 4 * 4  # 4 global batches of 4 windows
    trainer.train()
    assert train_losses(run)[:4] == train_losses(root / "straight")[:4]
    assert train_losses(run)[4:] == pytest.approx(train_losses(root / "straight")[4:], rel=2e-3)
    assert latest_checkpoint(run).name == "step_0000006.pt"  # one process writes the single-process format
    assert ModelPlan.load(run / "plan.json").to_json() == ModelPlan.load(root / "straight" / "plan.json").to_json()
    steps = {int(s["step"]) for s in trainer.optimizer.state_dict()["state"].values()}
    assert steps == {6}  # AdamW's moments came from the checkpoint, then took 2 steps


def test_one_process_checkpoint_resumes_on_two_ranks(runs):
    """Every rank reads the whole single-process file and keeps its shards (AdamW's moments
    too); the 2 ranks then train steps 3 and 4 as the one process did (see TOLERANCE)."""
    root, results = runs
    assert [status for status, _ in results[4]] == [0, 0], results[4]
    assert [loss for _, _, loss in losses(root / "widened")] == pytest.approx(
        [loss for _, _, loss in losses(root / "single")], rel=TOLERANCE
    )
    assert latest_checkpoint(root / "widened").name == "step_0000004"  # now sharded


def test_a_diverging_loss_stops_every_rank_with_one_message(runs):
    """Every rank sees the same loss (averaged over ranks) and gradient norm, so all refuse the
    same updates on the device and stop at the same read; rank 0 reports. No checkpoint is
    written from the bad step on."""
    root, results = runs
    assert [status for status, _ in results[5]] == [1, 1]
    lines = [line for _, err in results[5] for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1 and "Traceback" not in results[5][0][1] + results[5][1][1]
    # lr 1e6 overflows within a few steps; on which one depends on the CPU's float summation order.
    bad = re.search(r"at step (\d+) with recipe 'bf16'", lines[0])
    assert lines[0].startswith("adahop train: error: ") and bad and int(bad.group(1)) >= 2, lines
    latest = latest_checkpoint(root / "diverging")
    assert latest is None or int(latest.name.removeprefix("step_")) < int(bad.group(1))


def test_a_failed_sharded_write_stops_every_rank_and_keeps_the_last_checkpoint(runs):
    """DCP gathers rank 1's error onto every rank; the directory it was writing is never renamed
    into place, so step 2 stays the latest."""
    root, results = runs
    run = root / "full_disk"
    assert [status for status, _ in results[6]] == [1, 1]
    lines = [line for _, err in results[6] for line in err.splitlines() if "error:" in line]
    assert len(lines) == 1, results[6]
    assert f"cannot write {run / 'checkpoints' / 'step_0000004'}: No space left on device (on rank 1)" in lines[0]
    assert (
        f"last checkpoint {run / 'checkpoints' / 'step_0000002'}; continue with: torchrun --nproc-per-node=2"
        in lines[0]
    )
    assert latest_checkpoint(run).name == "step_0000002"
    assert (run / "checkpoints" / ".step_0000004.tmp").is_dir()  # removed when the run resumes


def test_one_rank_failing_stops_both_with_one_message(runs):
    """Rank 1 fails before the forward of step 3 while rank 0 waits for it in FSDP's all-gather:
    rank 1 reports, leaves the process group, and rank 0's collective fails, so rank 0 stops too,
    silently; the step-2 checkpoint stays the latest."""
    root, results = runs
    run = root / "failing"
    [(status0, err0), (status1, err1)] = results[-1]
    assert (status0, status1) == (1, 1)
    assert "error:" not in err0 and "Traceback" not in err0, err0
    lines = [line for line in err1.splitlines() if "error:" in line]
    assert len(lines) == 1, err1
    assert lines[0].startswith(
        "adahop train: error: rank 1: RuntimeError: simulated fault on rank 1; stopped at step 2 of 6"
    )
    assert f"last checkpoint {run / 'checkpoints' / 'step_0000002'}" in lines[0]
    assert latest_checkpoint(run).name == "step_0000002"


def test_a_cut_short_sharded_write_is_never_the_latest(runs, small_overrides, tmp_path, caplog):
    """A killed write leaves ``.step_N.tmp/`` (never listed; removed by the next run), and a
    checkpoint directory DCP cannot read is renamed aside for the one before."""
    root, _ = runs
    run = tmp_path / "run"
    shutil.copytree(root / "straight", run)
    partial = run / "checkpoints" / ".step_0000008.tmp"
    partial.mkdir()
    (partial / "__0_0.distcp").write_bytes(b"half")
    (run / "checkpoints" / "step_0000006" / ".metadata").unlink()
    assert latest_checkpoint(run).name == "step_0000006"
    with caplog.at_level("INFO", logger="adahop"):
        trainer = Trainer(
            load_config(None, small_overrides(run, **ONE_BLOCK, training__steps=7)), resume=True, progress=False
        )
    assert trainer.step == 4 and f"{run / 'checkpoints' / 'step_0000006'}: .metadata is missing" in caplog.text
    assert not partial.exists() and (run / "checkpoints" / "step_0000006.corrupt").is_dir()


@pytest.mark.parametrize(
    ("job", "name", "reason"),
    [(7, "damaged", "changed since it was written"), (8, "damaged_unchecked", "the metadata points up to")],
)
def test_a_damaged_shard_sets_the_checkpoint_aside_and_resumes_from_the_one_before(runs, job, name, reason):
    """Rank 0 checks the newest checkpoint's files against their checksums (a checkpoint written
    before checksums: their sizes against DCP's metadata) before any rank loads it, sets the
    damaged one aside and every rank resumes from the one before, as one process does."""
    root, results = runs
    run = root / name
    [(status0, err0), (status1, err1)] = results[job]
    assert (status0, status1) == (0, 0), err0 + err1
    damaged = run / "checkpoints" / "step_0000006"
    assert f"warning: {damaged}: " in err0 and reason in err0 and "renamed it to step_0000006.corrupt" in err0
    assert f"resumed from {run / 'checkpoints' / 'step_0000004'} at step 4" in err0
    assert (run / "checkpoints" / "step_0000006.corrupt" / "__1_0.distcp").is_file()  # set aside, not deleted
    assert losses(run) == losses(root / "straight")  # steps 5 and 6 again, exactly
    assert latest_checkpoint(run).name == "step_0000006"  # written anew


def test_sigterm_to_one_rank_stops_every_rank_at_one_step_with_a_checkpoint(runs):
    """Rank 1 gets SIGTERM during step 2 and proposes step 3 in the store; both ranks finish step 3,
    write its checkpoint together and exit 143; rank 0 prints the one line. Resumed, the run
    trains on as if never stopped."""
    root, results = runs
    run = root / "sigterm_one"
    [(status0, err0), (status1, err1)] = results[9]
    assert (status0, status1) == (143, 143), err0 + err1
    assert err1 == "" and "Traceback" not in err0
    [line] = [line for line in err0.splitlines() if line.startswith("adahop train:")]
    assert line == (
        f"adahop train: terminated (SIGTERM) after a checkpoint; stopped at step 3 of 6; last checkpoint "
        f"{run / 'checkpoints' / 'step_0000003'}; continue with: torchrun --nproc-per-node=2 -m adahop train "
        f"--out {run} --resume"
    )
    assert [status for status, _ in results[10]] == [0, 0], results[10]
    assert losses(run) == losses(root / "straight")  # every train and validation loss, bit for bit


def test_sigterm_to_every_rank_writes_one_checkpoint(runs):
    root, results = runs
    run = root / "sigterm_all"
    assert [status for status, _ in results[11]] == [143, 143], results[11]
    lines = [line for _, err in results[11] for line in err.splitlines() if line.startswith("adahop train:")]
    assert len(lines) == 1 and "stopped at step 3 of 6" in lines[0]
    assert latest_checkpoint(run).name == "step_0000003"
    assert (run / "checkpoints" / "step_0000003" / ".metadata").is_file()


def test_a_stalled_rank_stops_the_run_naming_it(stalled):
    """Rank 1 stops itself (SIGSTOP) in step 3; rank 0's collective gives up after
    training.timeout and it reports rank 1, which never answered. No timing is asserted: the
    run ends only through the timeout."""
    run, [(status0, err0), (status1, _)] = stalled
    assert (status0, status1) == (1, None)  # rank 1 was killed while stopped
    [line] = [line for line in err0.splitlines() if "error:" in line]
    assert line == (
        f"adahop train: error: rank 1 stalled: no answer within training.timeout={STALL_TIMEOUT_S} s "
        f"(a stopped process, I/O that hangs, a wedged GPU); stopped at step 2 of 6; last checkpoint "
        f"{run / 'checkpoints' / 'step_0000002'}; continue with: torchrun --nproc-per-node=2 -m adahop train "
        f"--out {run} --resume"
    )
