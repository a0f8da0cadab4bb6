"""The ``adahop`` dispatcher and the commands that need hardware this machine may not have."""

import pytest
import torch

from adahop.cli import COMMANDS, main


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in COMMANDS)


def test_version(capsys):
    import adahop

    assert main(["--version"]) == 0
    assert capsys.readouterr().out == f"adahop {adahop.__version__}\n"


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

    results = Path(__file__).parent.parent / "benchmarks" / "results"
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

    report = json.loads((Path(__file__).parent.parent / "benchmarks" / "results" / "2026-12-02-h200.json").read_text())
    text = summary_markdown(report)
    for key in ("gemm_speedup_vs_bf16", "quantize_fraction_of_copy_bw", "linear_fwd_bwd_speedup_vs_bf16",
                "saved_activation_compression", "train_step_speedup_vs_bf16"):
        assert f"(`{key}`) | {report[key]:.3f} |" in text
    assert "| rowwise | 32 | nearest |" in text  # quantizer cases
    assert "| adahop_lv2 |" in text  # step table


def test_bench_summary_renders_the_oe_split_table():
    import json
    from pathlib import Path

    from adahop.bench import summary_markdown

    report = json.loads((Path(__file__).parent.parent / "benchmarks" / "results" / "2026-12-03-h200.json").read_text())
    text = summary_markdown(report)
    assert f"(`oe_split_slowdown_vs_mxfp4`) | {report['oe_split_slowdown_vs_mxfp4']:.3f} |" in text
    first = report["gemm"]["oe_split"][0]
    assert f"| 16384, 4096, 4096 | {first['oe_left']['mxfp4_ms']:.3f}, {first['oe_right']['mxfp4_ms']:.3f} |" in text
