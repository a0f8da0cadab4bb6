"""Checkpoints: exact resume, atomic writes, and clear errors for corrupt or foreign files."""

from __future__ import annotations

import errno
import hashlib
import shutil

import pytest
import torch

from adahop.formats import philox
from adahop.nn import adahop_layers
from adahop.train import (
    CheckpointError,
    Trainer,
    build_model_from_config,
    latest_checkpoint,
    load_checkpoint,
    load_config,
    read_metrics,
)
from adahop.train import checkpoint as ckpt
from adahop.train import trainer as trainer_module
from adahop.train.checkpoint_files import checkpoint_path

pytestmark = pytest.mark.usefixtures("one_thread")

STEPS = 8
CALIBRATION_STEPS = 3


class Interrupted(Exception):
    """Stands in for a crash or preemption right after a checkpoint was written."""


def exact_run_overrides(small_overrides, out, **extra):
    """8 steps of adahop_lv2, 2 micro-batches each; layers freeze during step 2 (3 forwards of
    calibration) and then round dY stochastically."""
    run = {
        "recipe": "adahop_lv2",
        "training__steps": STEPS,
        "training__grad_accum": 2,
        "recipe__calibration_steps": CALIBRATION_STEPS,
        "logging__val_every": 4,
    }
    return small_overrides(out, **(run | extra))


@pytest.fixture(scope="module")
def straight_run(small_overrides, tmp_path_factory):
    cfg = load_config(None, exact_run_overrides(small_overrides, tmp_path_factory.mktemp("straight")))
    trainer = Trainer(cfg, progress=False)
    trainer.train()
    return trainer


def assert_same_state(a: dict, b: dict, where: str) -> None:
    assert a.keys() == b.keys(), where
    for key in a:
        if isinstance(a[key], torch.Tensor):
            assert torch.equal(a[key], b[key]), f"{where}: {key}"
        elif isinstance(a[key], dict):
            assert_same_state(a[key], b[key], f"{where}.{key}")
        else:
            assert a[key] == b[key], f"{where}: {key}"


def as_if_written_on_cuda(state: dict) -> None:
    """A CUDA run's checkpoint: its AdamW ran fused (and its step counts were device tensors)."""
    for group in state["optimizer"]["param_groups"]:
        group["fused"] = True


# Resume at step 1 while calibrating (votes in the checkpoint) and at step 4, after the freeze
# (plan in the checkpoint; stochastic rounding draws its seeds from torch's restored generator);
# at step 4 from a checkpoint whose optimizer ran fused, as on CUDA: this process runs it unfused;
# and at step 4 from a checkpoint written before the 8-bit noise layout (no `sr_noise`): the run
# goes on, saying in the log and in metrics.jsonl that its noise bits differ from that adahop's.
@pytest.mark.parametrize(
    ("stop_after", "written_on_cuda", "old_noise"),
    [(1, False, False), (4, False, False), (4, True, False), (4, False, True)],
)
def test_resume_is_bit_exact(
    stop_after, written_on_cuda, old_noise, straight_run, small_overrides, tmp_path, monkeypatch, caplog
):
    out = tmp_path / "resumed"
    cfg = load_config(None, exact_run_overrides(small_overrides, out, checkpoint__interval=stop_after))

    def save_then_crash(path, state):
        if written_on_cuda:
            as_if_written_on_cuda(state)
        assert state["sr_noise"] == philox.NOISE_LAYOUT
        if old_noise:
            del state["sr_noise"]
        ckpt.save_checkpoint(path, state)
        if state["step"] == stop_after:
            raise Interrupted

    with monkeypatch.context() as patch, pytest.raises(Interrupted):
        patch.setattr(trainer_module, "save_checkpoint", save_then_crash)
        Trainer(cfg, progress=False).train()
    caplog.clear()
    with caplog.at_level("INFO", logger="adahop"):
        resumed = Trainer(cfg, resume=True, progress=False)
        assert resumed.step == stop_after
        resumed.train()
    # A plan that came with the checkpoint is reported as restored, one that froze after the resume as frozen.
    how = "restored from the checkpoint" if stop_after >= 2 else "frozen"
    assert [r.getMessage().split(" (")[0] for r in caplog.records if "strategy plan" in r.getMessage()] == [
        f"strategy plan {how}"
    ]

    def losses(run):
        return [(r["kind"], r["step"], r["loss"]) for r in read_metrics(run) if r["kind"] != "resume"]

    assert losses(out) == losses(straight_run.run_dir)  # every train and validation loss, exactly
    noted = [r.getMessage() for r in caplog.records if "other stochastic-rounding noise" in r.getMessage()]
    resumes = [r["changes"] for r in read_metrics(out) if r["kind"] == "resume"]
    if old_noise:
        change = f"stochastic-rounding noise ({philox.NOISE_LAYOUTS[1]}) -> ({philox.NOISE_LAYOUTS[2]})"
        assert len(noted) == 1 and noted[0].endswith(f"({change})") and resumes == [[change]]
    else:
        assert not noted and not resumes
    assert not any(group["fused"] for group in resumed.optimizer.param_groups)
    layers = adahop_layers(resumed.model).values()
    assert not any(layer.calibrating for layer in layers)
    assert_same_state(resumed.model.state_dict(), straight_run.model.state_dict(), "model")
    assert_same_state(resumed.optimizer.state_dict(), straight_run.optimizer.state_dict(), "optimizer")


# The disk fills up at once (an OSError from the first write), or inside torch.save's zip writer,
# which turns it into "RuntimeError: [enforce fail at inline_container.cc ...] unexpected pos".
@pytest.mark.parametrize("room", [0, 1000, 100_000])
def test_a_full_disk_is_an_oserror_naming_the_file_and_keeps_the_previous_checkpoint(room, straight_run, disk_fills_up):
    run = straight_run.run_dir
    latest = latest_checkpoint(run)
    before = {p.name: p.read_bytes() for p in latest.parent.iterdir()}
    disk_fills_up(room)
    with pytest.raises(OSError) as failed:
        straight_run.save()  # the same step: it would replace `latest`
    assert (failed.value.errno, failed.value.strerror) == (errno.ENOSPC, "No space left on device")
    assert failed.value.filename == str(latest)
    with pytest.raises(OSError, match="No space left") as failed:
        ckpt.save_checkpoint(checkpoint_path(run, STEPS + 1), {"step": STEPS + 1, "t": torch.zeros(100_000)})
    assert failed.value.filename == str(checkpoint_path(run, STEPS + 1))
    # Nothing changed: no temp files, no new checksum, the previous checkpoints intact and loadable.
    assert {p.name: p.read_bytes() for p in latest.parent.iterdir()} == before
    assert sorted(before) == ["step_0000006.pt", "step_0000006.pt.sha256", "step_0000008.pt", "step_0000008.pt.sha256"]
    model = build_model_from_config(straight_run.cfg)
    assert load_checkpoint(run, model)["step"] == STEPS


def test_checkpoints_load_with_weights_only_and_match_their_checksums(straight_run):
    for path in ckpt.list_checkpoints(straight_run.run_dir):
        assert torch.load(path, weights_only=True)["step"] in (6, 8)
        digest, name = path.with_name(path.name + ".sha256").read_text().split()
        assert name == path.name and digest == hashlib.sha256(path.read_bytes()).hexdigest()  # as sha256sum -c


@pytest.mark.parametrize(
    "damage, expected",
    [
        (lambda data: data[: len(data) // 2], r"corrupt or truncated \(truncated archive\)$"),
        (lambda data: b"\x00garbage" * 100, r"corrupt or truncated \(not a torch.save archive\)$"),
        (lambda data: b"", r"corrupt or truncated \(empty file\)$"),
    ],
)
def test_corrupt_checkpoint_is_named(damage, expected, straight_run, tmp_path):
    path = tmp_path / "step_0000008.pt"
    path.write_bytes(damage(latest_checkpoint(straight_run.run_dir).read_bytes()))
    with pytest.raises(CheckpointError, match=f"{path}: .*{expected}"):  # not torch's weights_only advice
        load_checkpoint(path, build_model_from_config(straight_run.cfg))


class NotATensor:
    pass


def test_pickled_objects_are_not_a_checkpoint(straight_run, tmp_path):
    path = tmp_path / "objects.pt"
    torch.save({"format": 1, "thing": NotATensor()}, path)
    with pytest.raises(CheckpointError, match=r"\(holds objects other than tensors and plain containers\)$"):
        load_checkpoint(path, build_model_from_config(straight_run.cfg))


def test_foreign_file_is_not_a_checkpoint(straight_run, tmp_path):
    model = build_model_from_config(straight_run.cfg)
    path = tmp_path / "weights.pt"
    torch.save(model.state_dict(), path)  # a bare state_dict, not a training checkpoint
    with pytest.raises(CheckpointError, match=f"{path}: not an adahop checkpoint \\(missing format, step"):
        load_checkpoint(path, model)
    with pytest.raises(CheckpointError, match="no checkpoints in"):
        load_checkpoint(tmp_path, model)


@pytest.mark.parametrize(
    "change, expected",
    [
        ({"recipe": "bf16"}, r"different recipe \(name: checkpoint 'adahop_lv2' vs config 'bf16'"),
        (
            {"model__overrides__n_layers": 3},
            r"different model \(overrides: checkpoint .*'n_layers': 2.* vs config .*'n_layers': 3",
        ),
    ],
)
def test_resuming_with_another_model_or_recipe_is_refused(change, expected, straight_run, small_overrides, tmp_path):
    run = tmp_path / "copy"
    shutil.copytree(straight_run.run_dir, run)
    cfg = load_config(None, exact_run_overrides(small_overrides, run, **change))
    with pytest.raises(CheckpointError, match=f"{latest_checkpoint(run)}: written for a {expected}"):
        Trainer(cfg, resume=True, progress=False)


def test_checkpoint_that_does_not_fit_the_model_is_named(straight_run, small_overrides, tmp_path):
    cfg = load_config(None, exact_run_overrides(small_overrides, tmp_path, model__overrides__dim=32))
    path = latest_checkpoint(straight_run.run_dir)
    with pytest.raises(CheckpointError, match=f"{path}: its model state does not fit this run"):
        load_checkpoint(path, build_model_from_config(cfg))


def test_config_changes_name_changed_values_and_not_fields_the_checkpoint_predates():
    from adahop.train.checkpoint import config_changes

    saved = {"training": {"steps": 100, "seed": 0}, "out": "a"}
    current = {"training": {"steps": 200, "seed": 0, "recompute_pattern_steps": True}, "out": "b"}
    assert config_changes(saved, current) == ["training.steps 100 -> 200"]


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_a_distributed_checkpoint_of_the_pickled_format_is_named_not_set_aside(tmp_path):
    """Format 1 stored pickled blobs (DCP unpickles those without ``weights_only``): refused in one
    line, and kept where it is, since it is not damaged."""
    import io

    import torch.distributed.checkpoint as dcp

    from adahop.train.checkpoint import newest_readable

    path = tmp_path / "checkpoints" / "step_0000002"
    dcp.save({"train": io.BytesIO(b"pickled")}, checkpoint_id=path, no_dist=True)
    with pytest.raises(CheckpointError, match=f"{path}: a distributed checkpoint of format 1 \\(pickled state\\)"):
        newest_readable(tmp_path)
    assert path.is_dir()


def test_a_writer_failure_that_lost_its_oserror_says_so_and_how_much_space_is_left(tmp_path):
    """DCP gathers a rank's failure to the others by pickling, which drops the ``OSError`` that
    ``torch.save``'s RuntimeError hides: an EIO then, naming the file and the free space."""
    from adahop.train.checkpoint_files import write_failure

    path = tmp_path / "checkpoints" / "step_0000004"
    error = write_failure(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"), path)
    assert (error.errno, error.filename) == (errno.EIO, str(path))
    assert error.strerror.startswith("the checkpoint writer failed (RuntimeError: [enforce fail at inline_container")
    assert error.strerror.endswith(" MiB free on its file system")
    try:
        raise RuntimeError("unexpected pos") from OSError(errno.EDQUOT, "Disk quota exceeded")
    except RuntimeError as e:
        assert (write_failure(e, path).errno, write_failure(e, path).strerror) == (errno.EDQUOT, "Disk quota exceeded")
