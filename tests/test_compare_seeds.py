"""``adahop compare`` across seeds, on run directories written here with known losses."""

from __future__ import annotations

import json
import math
import statistics

import pytest
from scipy import stats

from adahop.analysis import compare
from adahop.cli import main as adahop_main


def fake_run(root, recipe: str, seed: int, final_val: float, extra: str = ""):
    """A run directory with a 4-step train curve and validation at steps 2 and 4."""
    path = root / f"{recipe}-{seed}{extra and '-ablated'}"
    path.mkdir()
    (path / "config.toml").write_text(f'[training]\nseed = {seed}\n\n[recipe]\nname = "{recipe}"\n{extra}\n')
    records = [{"kind": "train", "step": s, "loss": final_val + 1.0 / s} for s in range(1, 5)]
    records += [{"kind": "val", "step": 2, "loss": final_val + 0.5}, {"kind": "val", "step": 4, "loss": final_val}]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


BF16 = [2.70, 2.71, 2.72]
LV2 = [2.75, 2.70, 2.78]  # gaps +0.05, -0.01, +0.06: inside the noise
MXFP4 = [2.80, 2.811, 2.819]  # gaps +0.100, +0.101, +0.099: beyond it


@pytest.fixture
def seed_runs(tmp_path):
    return [
        fake_run(tmp_path, name, seed, loss)
        for name, losses in (("bf16", BF16), ("adahop_lv2", LV2), ("mxfp4", MXFP4))
        for seed, loss in enumerate(losses)
    ]


def test_a_gap_over_two_standard_errors_is_inside_the_noise_while_p_is_above_0_05():
    """Three seeds give a paired gap 2 degrees of freedom: 2.6 standard errors is p = 0.12."""
    from adahop.analysis.compare import gap_between

    base = [(seed, 2.7) for seed in range(3)]
    g = gap_between([(0, 2.71), (1, 2.73), (2, 2.75)], base)
    assert g["t"] == pytest.approx(0.03 / (0.02 / math.sqrt(3))) and g["dof"] == 2
    assert g["p"] == pytest.approx(1 - g["t"] / math.sqrt(2 + g["t"] ** 2)) and g["p"] > 0.05
    assert g["verdict"] == "inside the noise"
    assert gap_between([(0, 2.72), (1, 2.73), (2, 2.74)], base)["verdict"] == "beyond the noise"  # t 5.2, p 0.035
    welch = gap_between([(None, 2.71), (None, 2.75)], [(None, 2.70), (None, 2.72), (None, 2.68)])
    assert welch["pairing"] == "unpaired" and 1 < welch["dof"] < 3  # Welch-Satterthwaite
    assert welch["p"] == pytest.approx(2 * stats.t.sf(abs(welch["t"]), welch["dof"]))


def test_groups_seeds_by_recipe_with_spread_and_paired_gap(seed_runs, tmp_path, capsys):
    folder = tmp_path / "out" / "cmp"
    assert adahop_main(["compare", *map(str, seed_runs), "--out", str(folder)]) == 0
    rows = {r["recipe"]: r for r in json.loads((folder / "recipes.json").read_text())}
    assert list(rows) == ["bf16", "adahop_lv2", "mxfp4"]
    lv2 = rows["adahop_lv2"]
    assert lv2["n"] == 3 and lv2["seeds"] == [0, 1, 2] and lv2["steps"] == [4]
    assert lv2["final_val_loss_mean"] == pytest.approx(statistics.fmean(LV2))
    assert lv2["final_val_loss_std"] == pytest.approx(statistics.stdev(LV2))
    gaps = [a - b for a, b in zip(LV2, BF16)]
    assert lv2["val_gap_to_bf16"] == pytest.approx(statistics.fmean(gaps))
    assert lv2["gap_stderr"] == pytest.approx(statistics.stdev(gaps) / math.sqrt(3))
    assert lv2["pairing"] == "paired" and lv2["verdict"] == "inside the noise"
    assert rows["mxfp4"]["verdict"] == "beyond the noise"
    assert rows["bf16"]["verdict"] == "baseline"
    t = lv2["val_gap_to_bf16"] / lv2["gap_stderr"]
    assert lv2["gap_t"] == pytest.approx(t)
    assert lv2["gap_p"] == pytest.approx(1 - abs(t) / math.sqrt(2 + t * t))  # Student's t, 2 dof, two-sided
    assert f"inside the noise (t {t:.2f}, p {lv2['gap_p']:.3f}, paired)" in (folder / "compare.md").read_text()
    assert "beyond the noise" in capsys.readouterr().out
    assert (folder / "loss.png").read_bytes().startswith(b"\x89PNG")
    per_run = json.loads((folder / "runs.json").read_text())
    assert len(per_run) == 9 and [r["seed"] for r in per_run[3:6]] == [0, 1, 2]
    assert [r["val_gap_to_bf16"] for r in per_run[3:6]] == pytest.approx(gaps)  # to bf16 of the same seed


def test_unmatched_seeds_use_the_welch_error_and_one_seed_has_no_error_bar(tmp_path):
    runs = [compare.read_run(fake_run(tmp_path, "bf16", s, v)) for s, v in ((0, 2.70), (1, 2.72))]
    runs += [compare.read_run(fake_run(tmp_path, "mxfp4", s, v)) for s, v in ((5, 2.80), (6, 2.84))]
    runs.append(compare.read_run(fake_run(tmp_path, "adahop_lv1", 0, 2.71)))
    rows = {r["recipe"]: r for r in compare.recipe_rows(runs)}
    mx = rows["mxfp4"]
    assert mx["pairing"] == "unpaired" and mx["val_gap_to_bf16"] == pytest.approx(0.11)
    assert mx["gap_stderr"] == pytest.approx(
        math.sqrt(statistics.variance([2.70, 2.72]) / 2 + statistics.variance([2.80, 2.84]) / 2)
    )
    lv1 = rows["adahop_lv1"]
    assert lv1["val_gap_to_bf16"] == pytest.approx(0.01) and lv1["verdict"] == "no error bar (n < 2)"
    assert lv1["final_val_loss_std"] is None and lv1["gap_stderr"] is None


def test_a_recipe_with_changed_fields_is_its_own_group(tmp_path):
    plain = compare.read_run(fake_run(tmp_path, "adahop_lv2", 0, 2.7))
    ablated = compare.read_run(fake_run(tmp_path, "adahop_lv2", 0, 2.7, extra='bf16_gemms = ["wgrad"]'))
    assert list(compare.group_runs([plain, ablated])) == ["adahop_lv2", "adahop_lv2 (bf16_gemms=['wgrad'])"]
    # the per-run table names each run by the same label as its group, in the .md and on the terminal
    folder = tmp_path / "cmp"
    assert adahop_main(["compare", str(plain.path), str(ablated.path), "--out", str(folder)]) == 0
    assert "| adahop_lv2 (bf16_gemms=['wgrad']) | 0 |" in (folder / "compare.md").read_text()
    assert [row["label"] for row in compare.comparison_rows([plain, ablated])] == list(
        compare.group_runs([plain, ablated])
    )


def test_runs_sharing_a_seed_count_as_one_seed_and_their_spread_is_the_noise_at_a_seed(seed_runs, tmp_path):
    """Rounding streams of one seed (``training.rounding_seed_offset``) are not more seeds: they are
    averaged into their seed, and their spread is reported beside the gap (adahop compare and the
    quality study's summary.py alike)."""
    streams = tmp_path / "streams"
    streams.mkdir()
    lv2_n1 = [2.77, 2.68]  # seeds 0 and 1 again, other rounding keys
    extra = [fake_run(streams, "adahop_lv2", seed, loss) for seed, loss in enumerate(lv2_n1)]
    extra.append(fake_run(streams, "bf16", 0, BF16[0]))  # BF16 draws no keys: the same loss again
    runs = [compare.read_run(p) for p in (*seed_runs, *extra)]
    rows = {r["recipe"]: r for r in compare.recipe_rows(runs)}

    per_seed = [statistics.fmean([LV2[0], lv2_n1[0]]), statistics.fmean([LV2[1], lv2_n1[1]]), LV2[2]]
    gaps = [a - b for a, b in zip(per_seed, BF16)]
    lv2 = rows["adahop_lv2"]
    assert lv2["n"] == 5 and lv2["pairing"] == "paired"
    assert lv2["final_val_loss_mean"] == pytest.approx(statistics.fmean(per_seed))
    assert lv2["val_gap_to_bf16"] == pytest.approx(statistics.fmean(gaps))
    assert lv2["gap_stderr"] == pytest.approx(statistics.stdev(gaps) / math.sqrt(3))  # three seeds, not five runs
    pooled = math.sqrt((statistics.variance([LV2[0], lv2_n1[0]]) + statistics.variance([LV2[1], lv2_n1[1]])) / 2)
    assert lv2["same_seed_std"] == pytest.approx(pooled)
    assert rows["bf16"]["same_seed_std"] == 0.0 and rows["bf16"]["final_val_loss_std"] == pytest.approx(
        statistics.stdev(BF16)
    )
    assert rows["mxfp4"]["same_seed_std"] is None
    assert f"| {pooled:.4f} |" in compare.recipe_markdown(list(rows.values()))

    summary = load_summary_script().summarize([str(p) for p in (*seed_runs, *extra)])
    by_recipe = {r["recipe"]: r for r in summary["recipes"]}
    g = by_recipe["adahop_lv2"]["val_gap"]
    assert (g["gap"], g["stderr"]) == pytest.approx((lv2["val_gap_to_bf16"], lv2["gap_stderr"]))
    assert by_recipe["adahop_lv2"]["val_same_seed_std"] == pytest.approx(pooled)
    assert "BF16 seed spread (std of the final val loss over 3 seeds)" in load_summary_script().markdown(summary)


def load_summary_script():
    """benchmarks/quality/summary.py, which is a script, not part of the package."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parents[1] / "benchmarks" / "quality" / "summary.py"
    spec = importlib.util.spec_from_file_location("quality_summary", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_paired_validation_gap_curves_per_step(seed_runs):
    from adahop.analysis.runs import read_run

    runs = [read_run(p) for p in seed_runs]
    gaps = compare.paired_val_gaps(runs)
    assert set(gaps) == {"adahop_lv2", "mxfp4"}  # BF16 itself has no gap curve
    steps, mean, stderr = gaps["adahop_lv2"]
    per_seed = [a - b for a, b in zip(LV2, BF16)]  # validation at step 2 is final + 0.5 for every run
    assert steps == [2, 4]
    assert mean == pytest.approx([statistics.fmean(per_seed)] * 2)
    assert stderr == pytest.approx([statistics.stdev(per_seed) / math.sqrt(3)] * 2)


def test_no_gap_curve_without_bf16_of_the_same_seeds(tmp_path):
    from adahop.analysis.runs import read_run

    runs = [read_run(fake_run(tmp_path, "bf16", 0, 2.7)), read_run(fake_run(tmp_path, "mxfp4", 1, 2.8))]
    assert compare.paired_val_gaps(runs) == {}


def test_summary_gives_every_gap_to_a_chosen_recipe_paired_by_seed(seed_runs, tmp_path, capsys):
    """``summary.py --against LABEL``: how each recipe differs from another than BF16 (an ablation
    against its base recipe), with the statistics of the gap to BF16."""
    script = load_summary_script()
    summary = script.summarize([str(p) for p in seed_runs], against=["adahop_lv2"])
    rows = {r["recipe"]: r for r in summary["recipes"]}
    g = rows["mxfp4"]["against"]["adahop_lv2"]["val"]
    diffs = [a - b for a, b in zip(MXFP4, LV2)]
    assert g["pairing"] == "paired"
    assert (g["gap"], g["stderr"]) == pytest.approx((statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(3)))
    assert "eval" not in rows["mxfp4"]["against"]["adahop_lv2"]  # these runs have no eval.json
    assert "against" not in rows["adahop_lv2"]  # not against itself
    assert "## Against adahop_lv2" in script.markdown(summary)

    out = tmp_path / "summary.json"
    assert script.main([*map(str, seed_runs), "--against", "adahop_lv2", "--json", str(out)]) == 0
    assert json.loads(out.read_text())["against"] == ["adahop_lv2"]
    assert script.main([*map(str, seed_runs), "--against", "adahop_lv9"]) == 2
    assert "--against 'adahop_lv9' is not a recipe of these runs" in capsys.readouterr().err


def test_labels_print_whole_and_as_text_on_the_terminal(tmp_path, capsys, monkeypatch):
    """A pattern such as ``[wq]`` in a label is text, not Rich markup, and a long label wraps, not cut."""
    monkeypatch.setenv("COLUMNS", "200")
    run = fake_run(tmp_path, "adahop_lv2", 0, 2.7, extra='bf16_gemms = ["wgrad@[wq]"]')
    assert adahop_main(["compare", str(run), "--out", str(tmp_path / "cmp")]) == 0
    out = capsys.readouterr().out
    assert out.count("adahop_lv2 (bf16_gemms=['wgrad@[wq]'])") == 2  # the run table and the recipe table


def test_against_gives_every_recipe_its_gap_to_a_chosen_one(seed_runs, tmp_path, capsys):
    """``adahop compare --against LABEL``: an ablation read against its base recipe, paired by seed."""
    folder = tmp_path / "cmp"
    assert adahop_main(["compare", *map(str, seed_runs), "--out", str(folder), "--against", "adahop_lv2"]) == 0
    rows = {r["recipe"]: r for r in json.loads((folder / "recipes.json").read_text())}
    diffs = [a - b for a, b in zip(MXFP4, LV2)]
    g = rows["mxfp4"]["against"]
    assert g["recipe"] == "adahop_lv2" and g["pairing"] == "paired"
    assert (g["gap"], g["stderr"]) == pytest.approx((statistics.fmean(diffs), statistics.stdev(diffs) / math.sqrt(3)))
    assert rows["bf16"]["against"]["gap"] == pytest.approx(-statistics.fmean([a - b for a, b in zip(LV2, BF16)]))
    assert "against" not in rows["adahop_lv2"]
    md = (folder / "compare.md").read_text()
    assert "| recipe | n | val gap to adahop_lv2 (± s.e.) | verdict |" in md and md.count("\n| mxfp4 | 3 |") == 2
    assert "gap to adahop_lv2" in capsys.readouterr().out
    # the summary script agrees with the command
    summary = load_summary_script().summarize([str(p) for p in seed_runs], against=["adahop_lv2"])
    by_recipe = {r["recipe"]: r for r in summary["recipes"]}
    assert by_recipe["mxfp4"]["against"]["adahop_lv2"]["val"]["gap"] == pytest.approx(g["gap"])
    assert adahop_main(["compare", *map(str, seed_runs), "--out", str(folder), "--against", "lv9"]) == 2
    assert "--against 'lv9' is not a recipe of these runs" in capsys.readouterr().err
