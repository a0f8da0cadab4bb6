"""Bad input and a short machine get one clear line naming the file, key or size and what to
do, never a traceback (issue 34's "noisy" list and more of its kind); an empty batch simply
works, and a meta-device tensor either gives the output's shape or a line saying what to do."""

from __future__ import annotations

import errno

import pytest
import torch
from torch import nn

from adahop import convert_model
from adahop.data import tokenizer as tokenizer_module
from adahop.nn import AdaHOPLinear
from adahop.nn.state import STATE_VERSION, decode_state
from adahop.recipes import RECIPES
from adahop.train import trainer as trainer_module
from adahop.train.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")
ONE_BLOCK = {"model__overrides__n_layers": 1}


def as_argv(pairs: list[tuple[str, str]]) -> list[str]:
    return [f"--{k}={v}" for k, v in pairs]


def usage_error(argv: list[str], capsys) -> str:
    """The last line of a refusal of the arguments (exit status 2), checked to be no traceback."""
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err, err
    return err.strip().splitlines()[-1]


def error_line(err: str) -> str:
    assert "Traceback" not in err, err
    [line] = [line for line in err.splitlines() if "error:" in line]
    return line


# ---- config and data ---------------------------------------------------------------------------
def test_a_toml_config_with_a_non_utf8_byte_is_named(tmp_path, capsys):
    config = tmp_path / "run.toml"
    config.write_bytes(b'out = "x"\n# caf\xe9\n')
    assert usage_error(["--config", str(config)], capsys) == (
        f"adahop train: error: {config}: not UTF-8 text (byte 0xe9 at offset 15); TOML files are UTF-8: save it as UTF-8"
    )


@pytest.mark.parametrize(
    ("key", "value", "expected"),
    [
        ("training.seed", "-1", "training.seed must be an integer in [0, 4294967295] (numpy's seed range), got -1"),
        ("training.rounding_seed_offset", "-2", "training.rounding_seed_offset must be an integer in [0, 4294967295]"),
        ("training.seed", str(2**32 - 1), "keep the sum at most 4294901759"),
        ("data.vocab_size", str(10**9), "data.vocab_size must be <= 1048576, got 1000000000"),
        ("training.timeout", "0", "training.timeout must be positive, got 0.0"),
    ],
)
def test_an_out_of_range_key_names_itself_and_its_range(key, value, expected, small_overrides, tmp_path, capsys):
    line = usage_error([*as_argv(small_overrides(tmp_path / "run")), f"--{key}={value}"], capsys)
    assert line.startswith("adahop train: error: ") and expected in line


def test_a_truncated_parquet_file_is_named(small_overrides, tmp_path, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    whole, cut = tmp_path / "whole.parquet", tmp_path / "cut.parquet"
    pq.write_table(pa.table({"text": ["some text " * 50] * 100}), whole)
    cut.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])
    line = usage_error(as_argv(small_overrides(tmp_path / "run", data__source=cut)), capsys)
    assert line.startswith(f"adahop train: error: {cut}: not a readable parquet file (")
    assert line.endswith("check or re-download it")


def test_resume_without_its_config_toml_says_so(small_overrides, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(as_argv(small_overrides(run, **ONE_BLOCK, training__steps=2))) == 0
    (run / "config.toml").unlink()
    capsys.readouterr()
    assert usage_error(["--out", str(run), "--resume"], capsys) == (
        f"adahop train: error: --resume: {run / 'config.toml'} is missing, so the run's settings are unknown; "
        "pass the config it was started with (--config FILE.toml) or all its --section.field=VALUE flags"
    )


# ---- the machine: memory and disks -------------------------------------------------------------
@pytest.mark.parametrize(
    "error",
    [
        RuntimeError("[enforce fail at alloc_cpu.cpp:127] DefaultCPUAllocator: can't allocate memory: you tried"),
        torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB"),
        MemoryError(),
    ],
    ids=["cpu-allocator", "cuda", "python"],
)
def test_a_model_that_does_not_fit_is_one_line_with_its_size(error, small_overrides, tmp_path, monkeypatch, capsys):
    def too_big(*args, **kwargs):
        raise error

    monkeypatch.setattr(trainer_module, "build_model_from_config", too_big)
    assert main(as_argv(small_overrides(tmp_path / "run"))) == 1
    line = error_line(capsys.readouterr().err)
    # conftest's SMALL_MODEL: 2 blocks of dim 64, a 512-token vocabulary, untied head.
    assert line.startswith(
        "adahop train: error: out of memory on cpu: model tiny (with model.overrides) has 0.2M parameters, "
        "0.0 GiB of FP32 weights, gradients and AdamW state before any activation; choose a smaller --model"
    )
    assert line.endswith(
        "stopped before training started, with nothing to resume; rerun the same command once that is fixed"
    )


def test_a_full_tokenizer_cache_disk_names_the_cache_not_the_run(small_overrides, tmp_path, monkeypatch, capsys):
    """The run directory is not at fault: the line must not advise deleting it."""
    cache = tmp_path / "cache"
    monkeypatch.setenv("ADAHOP_CACHE", str(cache))  # an empty cache: the tokenizer is trained and written

    def full_disk(path, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    monkeypatch.setattr(tokenizer_module, "atomic_file", full_disk)
    assert main(as_argv(small_overrides(tmp_path / "run"))) == 1
    line = error_line(capsys.readouterr().err)
    assert line.startswith(f"adahop train: error: cannot write {cache / 'tokenizers'}/")
    assert (
        f": No space left on device; the disk of the tokenizer and token cache {cache} is full: free space there, "
        "or point ADAHOP_CACHE at a directory on a disk with room; stopped before training started, with nothing "
        "to resume; rerun the same command once that is fixed"
    ) in line
    assert "delete" not in line


# ---- the library: empty batches, meta tensors, a damaged layer state ----------------------------
ADAHOP_RECIPES = sorted(name for name in RECIPES if not name.startswith("torchao"))


@pytest.mark.parametrize("recipe", ADAHOP_RECIPES)
@pytest.mark.parametrize("shape", [(0, 64), (2, 0, 64)], ids=["no-rows", "no-tokens"])
def test_an_empty_batch_works_under_every_recipe(recipe, shape):
    """No tokens: an empty output, no gradient for the input rows and a zero weight gradient,
    through calibration steps and frozen ones alike."""
    model = convert_model(nn.Sequential(nn.Linear(64, 32)), recipe)
    x = torch.zeros(*shape, requires_grad=True)
    for _ in range(4):  # past adaptive recipes' calibration
        model.zero_grad()
        y = model(x)
        y.sum().backward()
        assert y.shape == (*shape[:-1], 32) and x.grad.shape == x.shape
        assert torch.equal(model[0].weight.grad, torch.zeros(32, 64))


def test_a_meta_input_gives_the_shape_or_a_line_saying_what_to_do():
    with torch.device("meta"):
        on_meta = convert_model(nn.Sequential(nn.Linear(64, 32)), "adahop_lv2")
    assert on_meta(torch.empty(4, 64, device="meta")).shape == (4, 32)  # shapes only, as nn.Linear
    assert on_meta[0].calibrating  # and no vote was counted
    with pytest.raises(ValueError, match=r"its weight is on the meta device .* materialize the model first"):
        on_meta(torch.zeros(4, 64))
    real = convert_model(nn.Sequential(nn.Linear(64, 32)), "mxfp4")
    with pytest.raises(ValueError, match=r"its input is on the meta device \(no values\) and the other on cpu"):
        real(torch.empty(4, 64, device="meta"))


@pytest.mark.parametrize(
    ("index", "value", "expected"),
    [
        (0, -7, "corrupt AdaHOPLinear extra state: version field -7"),
        (0, 2**40, "corrupt AdaHOPLinear extra state: version field"),
        (0, STATE_VERSION + 1, "written by a newer adahop"),
        (1, 99, "corrupt AdaHOPLinear extra state: strategy code 99"),
        (4, 17, "corrupt AdaHOPLinear extra state: pattern code 17"),
        (9, -3, "corrupt AdaHOPLinear extra state: negative vote counts"),
    ],
)
def test_a_damaged_extra_state_is_called_corrupt_not_a_version_mismatch(index, value, expected):
    layer = AdaHOPLinear(64, 32, recipe={"name": "adahop_lv2", "calibration_steps": 2})
    optimizer = torch.optim.SGD(layer.parameters(), lr=1e-3)
    for _ in range(3):  # calibrate and freeze (at the optimizer's step): every field of the state is set
        layer(torch.randn(8, 64, requires_grad=True)).sum().backward()
        optimizer.step()
    state = layer.get_extra_state().clone()
    assert layer.plan is not None and decode_state(state)[0] == layer.plan
    state[index] = value
    with pytest.raises(ValueError, match=expected.replace("(", r"\(")):
        decode_state(state)
