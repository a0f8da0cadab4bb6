"""torchao's float8 training as a peer recipe: the conversion, a resumed ``adahop train`` run with it on
the CPU (torch 2.13 runs float8 GEMMs there), and one-line refusals where it cannot run."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from adahop.bench.step import PEERS
from adahop.integrations import float8
from adahop.nn import convert_model
from adahop.recipes import Recipe, get_recipe
from adahop.train import Trainer, build_model_from_config, load_config, read_metrics
from adahop.train.cli import main

torchao_float8 = pytest.importorskip("torchao.float8")
Float8Linear = pytest.importorskip("torchao.float8.float8_linear").Float8Linear


def as_argv(pairs):
    return [f"--{k}={v}" for k, v in pairs]


@pytest.mark.parametrize("scaling", ("tensorwise", "rowwise"))
def test_every_linear_but_the_lm_head_becomes_float8(scaling, small_overrides, tmp_path):
    cfg = load_config(None, small_overrides(tmp_path, recipe=f"torchao_float8_{scaling}"))
    model = build_model_from_config(cfg)
    linears = {name: m for name, m in model.named_modules() if isinstance(m, nn.Linear)}
    converted = {name for name, m in linears.items() if isinstance(m, Float8Linear)}
    assert converted == set(linears) - {"output"} and len(converted) == 14  # 7 per block
    want = torchao_float8.Float8LinearConfig.from_recipe_name(scaling)
    assert all(linears[name].config == want for name in converted)


def test_float8_run_trains_and_resumes(small_overrides, tmp_path, one_thread):
    run = tmp_path / "run"
    assert main(as_argv(small_overrides(run, recipe="torchao_float8_rowwise", training__steps=3))) == 0
    assert main(["--out", str(run), "--resume", "--steps", "4"]) == 0
    train = [r for r in read_metrics(run) if r["kind"] == "train"]
    assert [r["step"] for r in train] == [1, 2, 3, 4] and all(r["loss"] == r["loss"] for r in train)
    # The same steps in BF16 give other losses: the float8 GEMMs are really in the loop.
    bf16 = Trainer(
        load_config(None, small_overrides(tmp_path / "bf16", recipe="bf16", training__steps=3)), progress=False
    )
    bf16.train()
    assert [r["loss"] for r in read_metrics(tmp_path / "bf16") if r["kind"] == "train"] != [
        r["loss"] for r in train[:3]
    ]


def test_refuses_in_one_line_where_float8_cannot_run(monkeypatch):
    recipe = get_recipe("torchao_float8_tensorwise")
    monkeypatch.setattr(float8, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="torchao is not installed: pip install torchao") as e:
        float8.check_float8(recipe, torch.device("cpu"))
    assert "\n" not in str(e.value)
    monkeypatch.undo()

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"needs an FP8 GPU \(sm_89 or newer\), this one is sm_80"):
        float8.check_float8(recipe, torch.device("cuda"))
    monkeypatch.setattr(float8, "_cpu_scaled_mm_works", lambda: False)
    with pytest.raises(ValueError, match="cannot run on cpu"):
        float8.check_float8(recipe, torch.device("cpu"))


def test_the_peer_is_registered_once_for_train_and_bench():
    assert {get_recipe(name).torchao_float8 for name in PEERS.values()} == {"tensorwise", "rowwise"}
    with pytest.raises(ValueError, match="is torchao's float8, not AdaHOP's"):
        convert_model(nn.Sequential(nn.Linear(32, 32)), "torchao_float8_tensorwise")
    with pytest.raises(ValueError, match="needs strategy='bf16'"):
        Recipe(name="x", strategy="mxfp4", torchao_float8="tensorwise")
    with pytest.raises(ValueError, match="torchao_float8='blockwise' is not one of"):
        Recipe(torchao_float8="blockwise")
