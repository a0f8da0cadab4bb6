"""``adahop compare`` and ``adahop analyze`` on real run directories made by short CPU runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from adahop.analysis import analyze, compare, evaluate
from adahop.cli import main as adahop_main
from adahop.policy import ModelPlan
from conftest import SMALL_MODEL

pytestmark = pytest.mark.usefixtures("one_thread")
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def runs(small_overrides, tmp_path_factory):
    """A bf16 run and an adahop_lv2 run of the same small model, data and seed."""
    root = tmp_path_factory.mktemp("runs")
    dirs = {}
    for recipe in ("bf16", "adahop_lv2"):
        out = root / recipe
        argv = [f"--{k}={v}" for k, v in small_overrides(out, recipe__name=recipe)]
        assert adahop_main(["train", *argv]) == 0
        dirs[recipe] = out
    return dirs


def test_compare_writes_plot_and_table_with_gap_to_bf16(runs, tmp_path, capsys):
    folder = tmp_path / "cmp"
    assert adahop_main(["compare", str(runs["bf16"]), str(runs["adahop_lv2"]), "--out", str(folder)]) == 0
    assert (folder / "loss.png").read_bytes().startswith(PNG_SIGNATURE)
    rows = json.loads((folder / "runs.json").read_text())
    assert [r["recipe"] for r in rows] == ["bf16", "adahop_lv2"]
    assert rows[0]["val_gap_to_bf16"] == 0.0
    lv2 = rows[1]
    assert lv2["val_gap_to_bf16"] == pytest.approx(lv2["final_val_loss"] - rows[0]["final_val_loss"])
    assert "adahop_lv2" in (folder / "compare.md").read_text()
    assert "adahop_lv2" in capsys.readouterr().out


def test_compare_reads_every_logged_point(runs):
    run = compare.read_run(runs["adahop_lv2"])
    assert run.train_steps == list(range(1, 7)) and run.val_steps == [3, 6]
    assert all(loss > 0 for loss in run.train_loss + run.val_loss)


def test_compare_rejects_a_directory_that_is_not_a_run(tmp_path, capsys):
    assert adahop_main(["compare", str(tmp_path)]) == 2
    assert "not an adahop run directory" in capsys.readouterr().err


def test_analyze_reports_every_linear_layer_with_its_plan(runs, tmp_path):
    reports, out = analyze.analyze(runs["adahop_lv2"], tmp_path / "analysis")
    n_converted = 7 * SMALL_MODEL["n_layers"]
    assert len(reports) == n_converted + 1  # and the LM head
    plan = ModelPlan.load(runs["adahop_lv2"] / "plan.json")
    for rep in reports:
        assert set(rep.tensors) == {"x", "w", "g"}
        for t in rep.tensors.values():
            # Which pattern a trained tensor has is not known here (planted patterns: below).
            assert t.pattern in ("row", "col", "none") and t.mxfp4_rel_error > 0
        if rep.name == "output":
            assert rep.strategies is None
        else:
            assert rep.strategies == {g: s.value for g, s in plan[rep.name].strategies().items()}
        assert (out / "heatmaps" / f"{rep.name}.png").read_bytes().startswith(PNG_SIGNATURE)
    assert (out / "overview.png").read_bytes().startswith(PNG_SIGNATURE)
    saved = json.loads((out / "report.json").read_text())
    assert [r["name"] for r in saved] == [r.name for r in reports]
    assert "| layers.0.attention.wq |" in (out / "report.md").read_text()


def planted(rows: int = 64, cols: int = 64, *, row: int | None = None, col: int | None = None, seed: int = 0):
    """Gaussian noise, with one row and/or one column scaled by 8 (pattern scores near 8, noise
    of this size scores about 1.2, the threshold is 2)."""
    import torch

    t = torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed))
    if row is not None:
        t[row] *= 8
    if col is not None:
        t[:, col] *= 8
    return t


def test_analyze_model_reports_the_patterns_planted_in_x_w_and_dy():
    """X, W and dY are built with a known pattern: X and dY are the inputs and the loss weights
    (dY of ``(y * g).sum()`` is ``g``), W the layer's weight; one layer is noise throughout."""
    import torch
    from torch import nn

    from adahop.analysis.outliers import analyze_model

    planned = {  # layer: ((x, w, dY), expected patterns)
        "rows": ((planted(row=5, seed=1), planted(row=40, seed=2), planted(row=17, seed=3)), ("row", "row", "row")),
        "cols": ((planted(col=9, seed=4), planted(col=33, seed=5), planted(col=60, seed=6)), ("col", "col", "col")),
        "mixed": ((planted(col=2, seed=7), planted(seed=8), planted(row=63, seed=9)), ("col", "none", "row")),
        "noise": ((planted(seed=10), planted(seed=11), planted(seed=12)), ("none", "none", "none")),
    }
    model = nn.ModuleDict({name: nn.Linear(64, 64, bias=False) for name in planned})
    with torch.no_grad():
        for name, ((_, w, _), _) in planned.items():
            model[name].weight.copy_(w)

    def run_batch(m):
        return sum((m[name](x) * g).sum() for name, ((x, _, g), _) in planned.items())

    reports = {r.name: r for r in analyze_model(model, run_batch)}
    assert set(reports) == set(planned)
    for name, ((x, w, g), expected) in planned.items():
        tensors = reports[name].tensors
        assert tuple(tensors[role].pattern for role in ("x", "w", "g")) == expected, name
        for role, pattern in zip(("x", "w", "g"), expected):
            t = tensors[role]
            planted_score, other_score = {"row": (t.row_score, t.col_score), "col": (t.col_score, t.row_score)}.get(
                pattern, (max(t.row_score, t.col_score), None)
            )
            if other_score is None:
                assert planted_score < 1.5, (name, role)  # noise of 64 lines of 63 |N(0,1)|: about 1.2
            else:  # the scaled line over the median line: 8 up to noise; the other direction sees it as spikes
                assert 6 < planted_score < 10 and other_score < 1.5, (name, role)
        assert torch.equal(reports[name].tensors["g"].heatmap, g.abs())  # 64 x 64: no pooling


def test_analyze_cli_on_a_checkpoint_file_and_bad_paths(runs, tmp_path, capsys):
    checkpoint = sorted((runs["bf16"] / "checkpoints").glob("*.pt"))[-1]
    assert adahop_main(["analyze", str(checkpoint), "--out", str(tmp_path / "a")]) == 0
    assert "(15 layers)" in capsys.readouterr().out
    assert "| nn.Linear | nn.Linear | nn.Linear |" in (tmp_path / "a" / "report.md").read_text()
    assert adahop_main(["analyze", str(runs["bf16"]), "--out", str(tmp_path / "b"), "--no-heatmaps"]) == 0
    assert "overview.png (15 layers)" in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["overview.png", "report.json", "report.md"]
    assert (
        adahop_main(["analyze", str(runs["bf16"]), "--out", str(tmp_path / "c"), "--no-heatmaps", "--sequences", "1"])
        == 0
    )
    full, one = (json.loads((tmp_path / d / "report.json").read_text())[0]["tensors"]["x"]["shape"] for d in "bc")
    assert one[0] * 4 == full[0] and one[1] == full[1]  # the fixture's runs train on batches of 4 sequences
    with pytest.raises(SystemExit):
        adahop_main(["analyze", str(runs["bf16"]), "--sequences", "0"])
    assert adahop_main(["analyze", str(tmp_path / "missing")]) == 2
    assert "no such checkpoint" in capsys.readouterr().err


def test_analyze_scores_do_not_depend_on_the_random_state(runs):
    import torch

    model, (inputs, targets), _ = analyze.load_trained_model(runs["adahop_lv2"])
    reports = []
    for seed in (1, 2):  # stands in for two processes: stochastic rounding of dY draws from torch's generator
        torch.manual_seed(seed)
        reports.append([r.to_dict() for r in analyze.report_model(model, inputs, targets)])
    assert reports[0] == reports[1]


def test_eval_on_the_training_source_matches_the_logged_validation_and_writes_json(runs, corpus, tmp_path, capsys):
    out = tmp_path / "eval.json"
    args = ["eval", str(runs["adahop_lv2"]), "--data", str(corpus), "--max-batches", "2", "--out", str(out)]
    assert adahop_main(args) == 0
    assert "every linear in BF16" in capsys.readouterr().out
    report = json.loads(out.read_text())
    assert report["part"] == "validation split" and report["step"] == 6 and report["tokens"] == 2 * 4 * 32
    logged = compare.read_run(runs["adahop_lv2"]).val_loss[-1]  # the same 2 batches, same weights
    assert report["as_trained"]["loss"] == pytest.approx(logged, abs=1e-6)
    for key in ("as_trained", "bf16"):
        assert report[key]["perplexity"] == pytest.approx(math.exp(report[key]["loss"]))
    assert report["loss_gap"] == pytest.approx(report["as_trained"]["loss"] - report["bf16"]["loss"])
    assert report["as_trained"]["loss"] != report["bf16"]["loss"]  # the plans quantize


def test_eval_of_a_bf16_run_on_another_source_uses_all_of_it(runs, tmp_path):
    other = tmp_path / "other.txt"
    other.write_text(Path(__file__).read_text())
    report = evaluate.evaluate(runs["bf16"], str(other), device="cpu")
    assert report["part"] == "all" and report["tokens"] > 0
    assert report["as_trained"] == report["bf16"]  # nothing to quantize


def test_eval_bad_paths_and_data_are_one_line_errors(runs, tmp_path, capsys):
    assert adahop_main(["eval", str(tmp_path / "missing"), "--data", "stdlib"]) == 2
    assert "no such checkpoint" in capsys.readouterr().err
    assert adahop_main(["eval", str(runs["bf16"]), "--data", str(tmp_path / "nothing.txt")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("adahop eval: error:") and err.count("\n") == 1


def test_compare_out_is_a_folder_and_nothing_lands_beside_it(runs, tmp_path, capsys):
    folder = tmp_path / "nested" / "cmp"
    assert adahop_main(["compare", str(runs["bf16"]), "--out", str(folder)]) == 0
    assert sorted(p.name for p in folder.iterdir()) == sorted(compare.OUTPUTS)
    assert [p.name for p in folder.parent.iterdir()] == ["cmp"]
    assert f"in {folder}/" in capsys.readouterr().out
    (tmp_path / "file").write_text("")
    assert adahop_main(["compare", str(runs["bf16"]), "--out", str(tmp_path / "file")]) == 2
    assert "is a file; name a folder" in capsys.readouterr().err


def test_eval_defaults_to_the_runs_own_validation_split(runs, corpus, capsys):
    assert adahop_main(["eval", str(runs["adahop_lv2"]), "--max-batches", "2"]) == 0  # no --data
    assert "validation split" in capsys.readouterr().out
    default = evaluate.evaluate(runs["adahop_lv2"], max_batches=2, device="cpu")
    assert default == evaluate.evaluate(runs["adahop_lv2"], str(corpus), max_batches=2, device="cpu")


def test_held_out_batches_show_progress_with_their_count():
    import numpy as np

    held = evaluate.HeldOut(np.arange(1000), "x", "all", batch_size=4, seq_len=32, max_batches=None)
    assert held.batches("pass").total == len(list(held.batches())) == 8  # 31 windows of 32 in 4s
    capped = evaluate.HeldOut(np.arange(1000), "x", "all", batch_size=4, seq_len=32, max_batches=3)
    assert capped.batches("pass").total == len(list(capped.batches())) == 3
    assert held.num_tokens == 31 * 32


def test_tables_are_not_cut_at_80_columns_in_a_log(capsys):
    from rich.table import Table

    from adahop.analysis.console import make_console

    name = "model.layers.27.self_attention.query_key_value_projection_with_a_long_name." * 2
    table = Table("layer", "forward")
    table.add_row(name, "oe_left")
    make_console().print(table)  # pytest captures: not a terminal
    assert name in capsys.readouterr().out
