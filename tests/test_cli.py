"""The ``adahop`` dispatcher and the commands that need hardware this machine may not have."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import adahop
from adahop.cli import COMMANDS, main


def _src_env() -> dict[str, str]:
    """The environment of a subprocess that imports this tree's adahop."""
    src = str(Path(adahop.__file__).parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"adahop {adahop.__version__}\n"


def test_python_dash_m_adahop_runs_the_command():
    """``python -m adahop`` (what ``torchrun ... -m adahop train`` starts on every rank)."""
    done = subprocess.run([sys.executable, "-m", "adahop", "--version"], env=_src_env(), capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, f"adahop {adahop.__version__}\n"), done.stderr


def test_unknown_command_is_a_clear_error(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "train" in err


def test_bench_rejects_unknown_sections(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--only", "gemm,speed"])
    assert exc.value.code == 2
    assert "speed" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a CPU-only machine")
def test_bench_without_a_gpu_says_so(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["bench", "--only", "linear"])
    assert exc.value.code == 2
    assert "need a CUDA GPU" in capsys.readouterr().err


def test_bench_summary_renders_committed_h200_results():
    """The markdown summary of ``adahop bench``, fed with the JSON of real H200 runs."""
    import json
    from pathlib import Path

    from adahop.bench import summary_markdown

    results = Path(__file__).parent / "data"
    gemm = json.loads((results / "2026-12-02-h200-gemm.json").read_text())
    linear = json.loads((results / "2026-12-02-h200-linear.json").read_text())
    report = {**{k: linear[k] for k in ("gpu", "torch", "triton", "cuda", "python", "date")}}
    report |= {"gemm": gemm, "gemm_speedup_vs_bf16": gemm["gemm_speedup_vs_bf16"], "linear": linear["linear"]}
    report["linear_fwd_bwd_speedup_vs_bf16"] = linear["linear_fwd_bwd_speedup_vs_bf16"]
    text = summary_markdown(report)
    assert f"| {gemm['gemm_speedup_vs_bf16']:.3f} |" in text
    assert "| 16384, 14336, 4096 |" in text
    assert "| w2 | lv2_calibrated |" in text


def test_bench_summary_renders_every_section_of_the_combined_h200_run():
    import json
    from pathlib import Path

    from adahop.bench import summary_markdown

    report = json.loads((Path(__file__).parent / "data" / "2026-12-02-h200.json").read_text())
    del report["step"]  # measured by an older step bench (one mode per recipe); see test_step_bench_*
    text = summary_markdown(report)
    for key in (
        "gemm_speedup_vs_bf16",
        "quantize_fraction_of_copy_bw",
        "linear_fwd_bwd_speedup_vs_bf16",
        "saved_activation_compression",
    ):
        assert f"(`{key}`) | {report[key]:.3f} |" in text
    assert "| rowwise | 32 | nearest |" in text  # quantizer cases


def test_bench_summary_renders_the_oe_split_table():
    import json
    from pathlib import Path

    from adahop.bench import summary_markdown

    report = json.loads((Path(__file__).parent.parent / "benchmarks" / "gemm" / "2026-12-03-h200.json").read_text())
    text = summary_markdown(report)
    assert f"(`oe_split_slowdown_vs_mxfp4`) | {report['oe_split_slowdown_vs_mxfp4']:.3f} |" in text
    first = report["gemm"]["oe_split"][0]
    assert f"| 16384, 4096, 4096 | {first['oe_left']['mxfp4_ms']:.3f}, {first['oe_right']['mxfp4_ms']:.3f} |" in text


def _step_run(recipe: str, mode: str, tokens_per_s: float, reserved: float) -> dict:
    profile = {"cuda_ms": 100.0, "families_ms": {"GEMM": 60.0, "other": 40.0}}
    return {
        "recipe": recipe,
        "mode": mode,
        "tokens_per_s": tokens_per_s,
        "step_ms": 8192e3 / tokens_per_s,
        "peak_allocated_gib": reserved - 1,
        "peak_reserved_gib": reserved,
        "profile": profile,
    }


def test_step_bench_compares_each_recipe_with_bf16_and_float8_in_their_fastest_modes():
    from adahop.bench.step import add_ratios, best_runs, markdown, memory_markdown

    runs = {
        f"{r}/{m}": _step_run(r, m, t, g)
        for r, m, t, g in (
            ("bf16", "eager", 50e3, 40),
            ("bf16", "compile", 60e3, 38),
            ("float8_tensorwise", "compile", 66e3, 33),
            ("adahop_lv2", "eager", 40e3, 30),
            ("adahop_lv2", "compile+graph", 72e3, 31),
        )
    }
    runs["float8_tensorwise/compile+graph"] = {
        "error": "RuntimeError: capture failed",
        "recipe": "float8_tensorwise",
        "mode": "compile+graph",
    }
    runs["float8_rowwise/compile+graph"] = {"error": "torchao is not installed", "recipe": "float8_rowwise"}
    runs["float8_rowwise/compile+graph"]["mode"] = "compile+graph"
    runs["adahop_lv2/compile+graph"]["profile"] = {"cuda_ms": 80.0, "families_ms": {"GEMM": 50.0, "other": 30.0}}
    runs["adahop_lv2/compile+graph"]["run_peak_reserved_gib"] = 45.0  # calibration and capture held more
    runs["adahop_lv2/eager"]["run_peak_reserved_gib"] = 30.0  # no higher than its timed steps
    runs["bf16/compile"]["run_peak_reserved_gib"] = 38.0
    runs["float8_tensorwise/compile"]["run_peak_reserved_gib"] = 36.0
    best = best_runs(runs)
    assert {k: v["mode"] for k, v in best.items()} == {
        "bf16": "compile",
        "float8_tensorwise": "compile",
        "adahop_lv2": "compile+graph",
    }
    add_ratios(runs)
    lv2 = runs["adahop_lv2/compile+graph"]
    assert lv2["speedup_vs_bf16_best"] == pytest.approx(1.2) and lv2["cuda_speedup_vs_bf16_best"] == 1.25
    assert lv2["speedup_vs_float8_tensorwise"] == pytest.approx(72 / 66)
    assert lv2["run_peak_reserved_ratio_vs_float8_tensorwise"] == pytest.approx(45 / 36)
    case = {"preset": "llama3_1b", "batch": 4, "seq_len": 2048, "vocab_size": 128256, "runs": runs}
    step = {"cases": {"llama3_1b_4x2048": case}}
    text = "\n".join(markdown(step))
    assert "micro-batch 4 x 2048 (vocabulary 128256)" in text
    assert "| adahop_lv2/compile+graph | 72,000 | 1.20x / 1.25x | 1.09x / 1.25x | - |" in text
    assert "| 30.0 / 31.0 (45.0) |" in text  # the whole run's peak beside the steady one
    assert "| 29.0 / 30.0 |" in text and "| 37.0 / 38.0 |" in text  # none where it adds nothing, or unknown
    assert "| float8_tensorwise/compile+graph | failed: RuntimeError: capture failed |" in text
    assert "| float8_rowwise/compile+graph | failed: torchao is not installed |" in text
    memory = "\n".join(memory_markdown(step))
    assert "| llama3_1b_4x2048 | adahop_lv2 / compile+graph | 31.0 | 45.0 | 1.18x | 1.25x |" in memory
    assert "| llama3_1b_4x2048 | float8_tensorwise / compile | 33.0 | 36.0 | 0.95x | 1.00x |" in memory


def test_step_bench_renders_a_committed_h200_run():
    """Results from before per-step times and per-case vocabularies still render."""
    import json
    from pathlib import Path

    from adahop.bench.step import markdown

    path = Path(__file__).parent.parent / "benchmarks" / "step" / "2026-12-04-h200-step" / "recheck-c340476"
    step = json.loads((path / "bench.json").read_text())["step"]
    text = "\n".join(markdown(step))
    assert "micro-batch 8 x 2048 (vocabulary 32768)" in text
    assert "| adahop_lv2/compile+graph | 84,952 | 1.12x / - | - / - | - | 192.9 | - | 184.3 |" in text
    assert "| llama3_1b_8x2048 | bf16 / compile | 45.1 | 45.1 | - | - |" in text


def test_step_bench_selects_cases_and_runs_by_name():
    from adahop.bench.step import CASES, select_cases

    assert select_cases([]) == CASES
    (case,) = select_cases(["llama3_3b_4x2048"], ["adahop_lv2/compile+graph", "bf16/fastest"])
    assert case.preset == "llama3_3b" and case.runs == (("adahop_lv2", "compile+graph"), ("bf16", "fastest"))
    (accum,) = select_cases(["llama3_1b_2x2048_accum4"], ["bf16/compile"])
    assert (accum.batch, accum.accum, accum.tokens_per_step) == (2, 4, 8 * 2048)
    one, three = select_cases(
        ["llama3_1b_4x2048", "llama3_3b_4x2048"], ["bf16/compile", "llama3_3b_4x2048:adahop_lv2/eager"]
    )
    assert one.runs == (("bf16", "compile"),) and three.runs == (("bf16", "compile"), ("adahop_lv2", "eager"))
    with pytest.raises(ValueError, match="unknown step run 'bf16/turbo'"):
        select_cases(["llama3_1b_4x2048"], ["bf16/turbo"])
    # every registered recipe can be benched, not only the paper's
    from adahop.recipes import RECIPES

    runs = [f"{name}/compile" for name in RECIPES]
    (case,) = select_cases(["llama3_1b_8x2048"], runs)
    assert (
        case.runs == tuple((name, "compile") for name in RECIPES)
        and ("adahop_lv1_bf16_forward", "compile") in case.runs
    )
    with pytest.raises(ValueError, match="choose from"):
        select_cases(["llama3_70b_4x2048"])


def test_import_adahop_and_help_do_not_import_torch():
    """``adahop --help`` and ``--version`` answer without torch (its import takes seconds); the
    public names load on first use. The version has one source: the installed package's metadata."""
    code = (
        "import sys, adahop, adahop.cli\n"
        "assert adahop.cli.main(['--help']) == 0 and adahop.cli.main(['--version']) == 0\n"
        "assert 'torch' not in sys.modules, 'torch imported'\n"
        "from adahop import convert_model, RECIPES\n"
        "assert adahop.policy.ModelPlan and 'torch' in sys.modules and 'bf16' in RECIPES\n"
        "from importlib.metadata import version\n"
        "assert adahop.__version__ == version('adahop')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_src_env())
    assert done.returncode == 0, done.stderr
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        adahop.nope
