"""The step bench (``adahop bench --only step``) on the CPU: its dry run end to end, and the
preparation roofline's byte model against the ops a layer really runs."""

from dataclasses import replace

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from adahop import ops
from adahop.bench import roofline
from adahop.bench.step import (
    DRY_RUN,
    LONGEST_GAPS,
    Case,
    Kernel,
    gpu_idle,
    idle_markdown,
    markdown,
    memory_markdown,
    run,
)
from adahop.nn import AdaHOPLinear
from adahop.policy.strategies import LayerPlan

T, IN, OUT = 128, 64, 96


class _PreparationTrace(TorchDispatchMode):
    """Calls and bytes (every input and output tensor but the 0-dim rounding seed) of the preparation
    ops, by roofline family.
    An ``mx_matmul`` counts as the two folds the fold_fp8 route runs inside it (``kernels.gemm``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}

    def _add(self, family: str, nbytes: int) -> None:
        self.calls[family] = self.calls.get(family, 0) + 1
        self.bytes[family] = self.bytes.get(family, 0) + nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tensors = [
            t for t in (*args, *(out if isinstance(out, tuple) else (out,))) if isinstance(t, torch.Tensor) and t.dim()
        ]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        name = func.name()
        if name == "adahop::quantize_mx":
            self._add(roofline.QUANTIZE_COLS if args[2] % 2 == 0 else roofline.QUANTIZE_ROWS, nbytes)
        elif name == "adahop::quantize_fp8_rowwise":
            self._add(roofline.QUANTIZE_FP8, nbytes)
        elif name == "adahop::quantize_fold_fp8":
            self._add(roofline.QUANTIZE_FOLD, nbytes)
        elif name == "adahop::fold_fp8":
            self._add(roofline.FOLD, nbytes)
        elif name == "adahop::top_rows":
            self._add(roofline.SELECT, nbytes)
        elif name == "adahop::mx_matmul":
            a_data, a_scales, b_data, b_scales, _, block = args[:6]
            for data, scales in ((a_data, a_scales), (b_data, b_scales)):
                rows, k = data.shape[0], scales.shape[1] * block
                self._add(roofline.FOLD, data.numel() + scales.numel() + rows * k + 8 * rows)
        return out


@pytest.mark.parametrize(
    ("recipe", "plan"),
    [("adahop_lv1_fp8_forward", ("mxfp4", "iht", "iht")), ("adahop_lv1_fp8_forward", ("oe_left", "oe_left", "bf16"))]
    + [
        ("adahop_lv2", plan)
        for plan in [
            ("iht", "iht", "iht"),
            ("oe_left", "oe_right", "iht"),
            ("oe_right", "oe_left", "oe_right"),
            ("mxfp4", "bf16", "mxfp4"),
            ("bf16", "iht", "bf16"),
        ]
    ],
)
def test_roofline_bytes_are_what_the_layer_reads_and_writes(recipe, plan, monkeypatch):
    """The model's calls and bytes per family for one layer's forward and backward equal the sizes of
    the tensors its ops take and return, on the Hopper route (every GEMM folds into FP8)."""
    monkeypatch.setattr(ops, "folds_into_fp8", lambda device, n: True)
    torch.manual_seed(0)
    layer = AdaHOPLinear(IN, OUT, bias=False, recipe=recipe, dtype=torch.bfloat16)
    layer.set_plan(LayerPlan(*plan))
    x = torch.randn(T, IN, dtype=torch.bfloat16, requires_grad=True)
    trace = _PreparationTrace()
    with trace:
        layer(x).float().square().sum().backward()
    shape = roofline.Layer("layers.0.attention.wo", IN, OUT, *plan, forward_fmt=layer.recipe.forward_fmt)
    model = roofline.preparation_passes([shape], T, merged=False)
    assert {f: p.calls for f, p in model.items()} == trace.calls
    assert {f: p.bytes for f, p in model.items()} == trace.bytes


@pytest.mark.parametrize("plan", [("iht", "iht", "iht"), ("oe_right", "oe_right", "mxfp4")])
def test_roofline_counts_weight_passes_once_per_step_where_they_are_kept(plan, monkeypatch):
    """Three micro-batches inside ``weight_operands_cached``: W's quantize passes (and selection)
    run once, the others (Wᵀ's fold included) three times, as the model says."""
    from adahop.nn import weight_operands_cached

    monkeypatch.setattr(ops, "folds_into_fp8", lambda device, n: True)
    torch.manual_seed(0)
    layer = AdaHOPLinear(IN, OUT, bias=False, recipe="adahop_lv2", dtype=torch.bfloat16)
    layer.set_plan(LayerPlan(*plan))
    trace = _PreparationTrace()
    with trace, weight_operands_cached(layer):
        for _ in range(3):
            x = torch.randn(T, IN, dtype=torch.bfloat16, requires_grad=True)
            layer(x).float().square().sum().backward()
    shape = roofline.Layer("layers.0.attention.wo", IN, OUT, *plan)
    model = roofline.preparation_passes([shape], T, micro_steps=3, weight_micro_steps=1, merged=False)
    assert {f: p.calls for f, p in model.items()} == trace.calls
    assert {f: p.bytes for f, p in model.items()} == trace.bytes
    each = roofline.preparation_passes([shape], T, micro_steps=3, merged=False)
    assert each[roofline.QUANTIZE_COLS].calls == model[roofline.QUANTIZE_COLS].calls + 2  # Wᵀ: 3, not 1
    floor = roofline.one_read_floor_bytes([shape], T, micro_steps=3)
    assert roofline.one_read_floor_bytes([shape], T, micro_steps=3, weight_micro_steps=1) < floor


def test_roofline_counts_a_shared_input_once_where_compiled_blocks_merge_its_calls():
    layers = [
        roofline.Layer(f"layers.0.attention.{name}", 64, 64, forward, "iht", "iht")
        for name, forward in (("wq", "iht"), ("wk", "iht"), ("wv", "oe_left"))
    ]
    eager = roofline.preparation_passes(layers, T, merged=False)
    compiled = roofline.preparation_passes(layers, T, merged=True)
    # X quantized once for wq and wk (equal calls), once for wv (it records scores); Xᵀ once for all three
    assert eager[roofline.QUANTIZE_FOLD].calls - compiled[roofline.QUANTIZE_FOLD].calls == 1
    assert eager[roofline.QUANTIZE_COLS].calls - compiled[roofline.QUANTIZE_COLS].calls == 2
    # Xᵀ folded once for all three where it is quantized once; before, inside each wgrad GEMM
    assert eager[roofline.FOLD].calls - compiled[roofline.FOLD].calls == 2
    unshared = roofline.preparation_passes(layers, T, merged=True, shared_folds=False)
    assert unshared[roofline.FOLD].calls == eager[roofline.FOLD].calls
    assert eager[roofline.SELECT].calls == compiled[roofline.SELECT].calls == 1  # wv's X: its own scores
    shared = [replace(layer, forward="oe_left") for layer in layers]
    assert roofline.preparation_passes(shared, T, merged=False)[roofline.SELECT].calls == 3
    assert roofline.preparation_passes(shared, T, merged=True)[roofline.SELECT].calls == 1  # X's top rows once
    twice = roofline.preparation_passes(layers, T, merged=True, micro_steps=4)
    assert twice[roofline.FOLD].bytes == 4 * compiled[roofline.FOLD].bytes


def test_roofline_table_sets_time_against_the_floor():
    layer = {"name": "layers.0.feed_forward.w2", "in_features": 8192, "out_features": 2048}
    result = {
        "layers": [layer | {"forward": "iht", "dgrad": "iht", "wgrad": "bf16"}],
        "tokens_per_micro_step": 16384,
        "accum": 1,
        "merged": True,
        "profile": {"cuda_ms": 100.0, "preparation": {roofline.QUANTIZE_FOLD: {"ms": 0.5, "calls": 3}}},
    }
    table = roofline.roofline(result, copy_gb_per_s=4000.0)
    fold = table["families"][roofline.QUANTIZE_FOLD]
    # X [16384, 8192], W [2048, 8192], dY [16384, 2048]: 2 bytes read, 1 written and 8 per row, each
    elements, rows = 16384 * 8192 + 2048 * 8192 + 16384 * 2048, 16384 + 2048 + 16384
    assert fold["gb"] * 1e9 == pytest.approx(3 * elements + 8 * rows)
    assert fold["tb_per_s"] == pytest.approx(fold["gb"] / 0.5)
    assert fold["x_floor"] == pytest.approx(0.5 / (fold["gb"] / 4.0))
    assert fold["calls_model"] == 3 and fold["calls_profiled"] == 3
    assert table["families"][roofline.FOLD]["calls_profiled"] == 0  # modelled, not seen: shows as missing
    text = "\n".join(roofline.markdown("case run", table))
    assert "| fold | 1 / 0 (differ) |" in text and "| quantize-fold rows | 3 / 3 |" in text
    assert table["total"]["fraction_of_step"] == pytest.approx(0.005)


def test_step_bench_dry_run_falls_back_times_every_step_and_accumulates(corpus):
    """The whole step bench on the CPU: ``fastest`` records the graph mode's failure (no graph on
    the CPU) and runs the next mode; every timed step is timed; accumulation multiplies the tokens."""
    settings = replace(DRY_RUN, data=str(corpus))
    runs = (("bf16", "fastest"), ("adahop_lv2", "eager"), ("adahop_lv2", "eager-w-each"))
    result = run((Case("tiny", 2, runs, accum=2, seq_len=32),), settings=settings)
    runs = result["cases"]["tiny_2x32_accum2"]["runs"]
    assert list(runs) == ["bf16/graph", "bf16/eager", "adahop_lv2/eager", "adahop_lv2/eager-w-each"]
    # the A/B run runs the plan the recipe's first run calibrated, and calibrates nothing itself
    first, again = runs["adahop_lv2/eager"], runs["adahop_lv2/eager-w-each"]
    assert first["calibration_steps"] > 0 and not first["plan_reused"] and "plan" not in first
    assert again["calibration_steps"] == 0 and again["plan_reused"] and again["layers"] == first["layers"]
    assert "no CUDA graph was captured" in runs["bf16/graph"]["error"]
    lv2 = runs["adahop_lv2/eager"]
    assert len(lv2["step_ms_each"]) == settings.timed_steps
    assert lv2["step_ms_min"] <= lv2["step_ms_median"] <= lv2["step_ms_max"]
    assert lv2["tokens_per_s"] == pytest.approx(2 * 2 * 32 * 1e3 / lv2["step_ms"])
    assert lv2["speedup_vs_bf16_best"] == pytest.approx(lv2["tokens_per_s"] / runs["bf16/eager"]["tokens_per_s"])
    assert lv2["accum"] == 2 and {layer["name"].rsplit(".", 1)[1] for layer in lv2["layers"]} >= {"wq", "w2"}
    text = "\n".join(markdown(result))
    assert "2 micro-batches of 2 x 32 (vocabulary 512)" in text
    assert "| bf16/graph | failed: RuntimeError: mode graph: no CUDA graph was captured on cpu |" in text
    # a real profile on the CPU: no kernels, so no timeline and no idle table
    assert "gpu_span_ms" not in lv2["profile"] and lv2["profile"]["cuda_ms"] == 0
    assert "GPU idle" not in text
    fastest = result["cases"]["tiny_2x32_accum2"]["best_mode"]["adahop_lv2"]  # either lv2 run, by the clock
    assert f"| tiny_2x32_accum2 | adahop_lv2 / {fastest} | - | - | - | - |" in "\n".join(memory_markdown(result))
    table = roofline.roofline(lv2, copy_gb_per_s=4000.0)  # no kernels on the CPU: bytes only
    assert table["total"]["gb"] > 0 and all(r["calls_profiled"] == 0 for r in table["families"].values())
    # W quantized once per optimizer step (the default), so the roofline counts its passes once
    assert lv2["weight_operands_once_per_step"]
    each = roofline.roofline(lv2 | {"weight_operands_once_per_step": False}, copy_gb_per_s=4000.0)
    assert each["total"]["gb"] > table["total"]["gb"]


def test_gpu_idle_takes_the_union_of_kernels_and_splits_gaps_by_their_neighbours():
    """Two streams overlapping, back-to-back kernels, gaps beside a preparation kernel and not, short
    and long; the input in any order. Times in us, results in ms."""
    kernels = [
        Kernel(0, 10, False, "a"),  # stream A
        Kernel(4, 12, False, "b"),  # stream B, overlapping: busy [0, 12]
        Kernel(12, 20, False, "c"),  # back to back: no gap
        Kernel(23, 30, True, "quantize"),  # 3 us gap, a preparation kernel after it
        Kernel(38, 40, False, "d"),  # 8 us gap (long), a preparation kernel before it
        Kernel(42, 50, False, "e"),  # 2 us gap, no preparation kernel beside it
        Kernel(45, 60, False, "f"),  # outlasts e: the kernel before the next gap
        Kernel(66, 70, False, "g"),  # 6 us gap (long), none beside it
    ]
    assert gpu_idle(kernels[::-1]) == {
        "gpu_span_ms": 70 / 1e3,
        "gpu_busy_ms": 51 / 1e3,  # 20 + 7 + 2 + 18 + 4, not the 58 us the kernels sum to
        "gpu_idle_ms": 19 / 1e3,
        "gpu_idle_next_to_preparation_ms": 11 / 1e3,
        "gpu_idle_other_ms": 8 / 1e3,
        "gpu_gaps": 4,
        "gpu_long_gaps": 2,
        "gpu_idle_long_gaps_ms": 14 / 1e3,
        "gpu_longest_gaps": [  # longest first, where each starts from the step's first kernel
            {"ms": 8 / 1e3, "at_ms": 30 / 1e3, "after": "quantize", "before": "d"},
            {"ms": 6 / 1e3, "at_ms": 60 / 1e3, "after": "f", "before": "g"},
        ],
    }
    # before a gap, the kernel that ends last counts: a preparation kernel inside a longer one does not
    inside = gpu_idle([Kernel(0, 20, False), Kernel(5, 10, True), Kernel(25, 30, False)])
    assert inside["gpu_idle_next_to_preparation_ms"] == 0 and inside["gpu_idle_other_ms"] == 5 / 1e3
    outlasting = gpu_idle([Kernel(0, 10, False), Kernel(5, 20, True), Kernel(25, 30, False)])
    assert outlasting["gpu_idle_next_to_preparation_ms"] == 5 / 1e3 and outlasting["gpu_idle_other_ms"] == 0
    assert gpu_idle([]) == {}  # the CPU: no kernels
    # only the LONGEST_GAPS longest are named
    many = gpu_idle([Kernel(100 * i, 100 * i + 90 - i, False, str(i)) for i in range(LONGEST_GAPS + 3)])
    assert [g["before"] for g in many["gpu_longest_gaps"]] == [str(i) for i in range(LONGEST_GAPS + 2, 2, -1)]


def test_idle_table_lists_runs_with_kernels_only():
    timeline = gpu_idle([Kernel(0, 1000, True, "quantize"), Kernel(1010, 3000, False, "gemm")])
    runs = {
        "bf16/eager": {"step_ms": 3.5, "profile": {"cuda_ms": 2.99} | timeline},
        "bf16/graph": {"error": "RuntimeError: no graph"},
        "adahop_lv2/eager": {"step_ms": 4.0, "profile": {"cuda_ms": 0.0}},  # the CPU
    }
    text = idle_markdown({"cases": {"tiny": {"runs": runs}}})
    assert text[5] == "| tiny | bf16/eager | 3.5 | 3.0 | 3.0 | 0.01 | 0.01 | 1 | 1 / 0.01 |"
    assert "| gaps > 5 us: n / ms |" in text[3] and len(text) == 10
    assert text[-1] == "- tiny bf16/eager: 0.01 at 1.0 (`quantize` -> `gemm`)"
    assert idle_markdown({"cases": {"tiny": {"runs": {"adahop_lv2/eager": runs["adahop_lv2/eager"]}}}}) == []


def test_step_bench_gpu_script_dry_run_writes_its_files(tmp_path):
    """benchmarks/step/step_bench_h200.sh with DRY=1: the call a GPU session makes, on the CPU; a recipe
    this checkout does not register is skipped with a line, not a failed call; EXTRA_RUNS run after
    (here the plumbing of the W-each A/B: ``training.weight_operands_once_per_step=false``)."""
    import os
    import subprocess
    from pathlib import Path

    root = Path(__file__).parents[1]
    out = tmp_path / "out"
    env = os.environ | {
        "DRY": "1",
        "OUT": str(out),
        "RECIPES": "bf16 no_such_recipe",
        "MODE": "eager",
        "EXTRA_RUNS": "bf16/eager-w-each",
    }
    done = subprocess.run(
        ["bash", str(root / "benchmarks" / "step" / "step_bench_h200.sh")], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    assert sorted(p.name for p in out.iterdir()) == ["bench.json", "bench.log", "bench.md", "step_bench.log"]
    assert "skipped: no_such_recipe is not a recipe of this checkout" in (out / "step_bench.log").read_text()
    table = (out / "bench.md").read_text()
    assert "| bf16/eager |" in table and "| bf16/eager-w-each |" in table


def test_roofline_model_predicts_every_preparation_call_of_a_committed_h200_step():
    """The byte model's calls against the kernels the H200 profiled at ``llama3_1b`` 8 x 2048 (2026-12-04,
    compiled blocks and CUDA graphs): quantize-fold, column-wise quantize, fold and selection, per recipe.
    The layers come from the run's plan mix (benchmarks/step/roofline_committed.py)."""
    import importlib.util
    import json
    from pathlib import Path

    step = Path(__file__).parents[1] / "benchmarks" / "step"
    spec = importlib.util.spec_from_file_location("roofline_committed", step / "roofline_committed.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    bench = json.loads((step / "2026-12-04-h200-step" / "recheck-c340476" / "bench.json").read_text())
    case = bench["step"]["cases"]["llama3_1b_8x2048"]
    for name in ("adahop_lv2/compile+graph", "adahop_lv1/compile+graph", "adahop_lv1_bf16_forward/compile+graph"):
        table = script.committed_roofline(case, case["runs"][name])
        assert {f: (r["calls_model"], r["calls_profiled"]) for f, r in table["families"].items()} == {
            f: (r["calls_profiled"], r["calls_profiled"]) for f, r in table["families"].items()
        }
        assert set(table["families"]) == {
            roofline.QUANTIZE_FOLD,
            roofline.QUANTIZE_COLS,
            roofline.FOLD,
            roofline.SELECT,
        }
    assert script.committed_roofline(case, case["runs"]["bf16/compile"]) is None


def test_step_bench_mode_suffixes_set_their_training_knobs(monkeypatch, tmp_path):
    """A mode's ``-w-each`` and ``-recompute`` (either, both, in any order) name the A/B runs of
    ``training.weight_operands_once_per_step`` and ``training.recompute_wgrad_operands``."""
    from adahop.bench import step

    assert step.base_mode("compile+graph-w-each-recompute") == "compile+graph"
    assert step.base_mode("fastest-recompute-w-each") == "fastest"
    runs = ["adahop_lv2/fastest-recompute", "adahop_lv2/compile+graph-recompute-w-each"]
    (case,) = step.select_cases(["llama3_1b_8x2048"], runs)
    assert case.runs == (("adahop_lv2", "fastest-recompute"), ("adahop_lv2", "compile+graph-recompute-w-each"))
    with pytest.raises(ValueError, match="unknown step run"):
        step.select_cases(["llama3_1b_8x2048"], ["adahop_lv2/fastest-recomputed"])
    built = []
    monkeypatch.setattr("adahop.train.Trainer", lambda cfg, progress: built.append(cfg.training))
    for mode in ("compile+graph-recompute-w-each", "compile"):
        step._trainer("adahop_lv2", case, mode, step.DRY_RUN, str(tmp_path))
    on, off = built
    assert (on.recompute_wgrad_operands, on.weight_operands_once_per_step, on.compile, on.cuda_graph) == (
        True,
        False,
        True,
        True,
    )
    assert (off.recompute_wgrad_operands, off.weight_operands_once_per_step, off.cuda_graph) == (False, True, False)


def test_bounds_table_splits_each_step_and_puts_the_preparation_kernels_at_their_floor():
    """benchmarks/step/bounds.py on a committed H200 run: every measured row's parts add up to the run's
    CUDA time, and an "at their fused floor" row is that time less the roofline kernels' measured time plus
    their fused floor (the Inductor kernels that feed them kept as measured)."""
    import importlib.util
    import json
    from pathlib import Path

    step = Path(__file__).parents[1] / "benchmarks" / "step"
    spec = importlib.util.spec_from_file_location("bounds", step / "bounds.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    runs = json.loads((step / "2026-12-05-h200-compiled-loss" / "n4-1b-8x2048" / "bench.json").read_text())
    runs = runs["step"]["cases"]["llama3_1b_8x2048"]["runs"]
    table = {row.split(" | ")[1]: row for row in script.rows("1b", runs)}

    def cells(label: str) -> list[float]:  # GEMM, preparation (0 for "-"), element-wise, rest, step
        return [0.0 if c == "-" else float(c) for c in table[label].strip("| ").split(" | ")[2:7]]

    bf16_ms = runs["bf16/compile+graph"]["profile"]["cuda_ms"]
    assert table["bf16"].endswith("| 1.00x | 0.89x |")
    for recipe in ("bf16", "float8_tensorwise", "adahop_lv2", "adahop_lv1_fp8_forward"):
        *parts, total = cells(recipe)
        assert sum(parts) == pytest.approx(total, abs=0.2)
        assert total == pytest.approx(runs[f"{recipe}/compile+graph"]["profile"]["cuda_ms"], abs=0.05)
    lv2 = runs["adahop_lv2/compile+graph"]
    roof = lv2["roofline"]["total"]
    at_floor = lv2["profile"]["cuda_ms"] - roof["ms"] + roof["one_read_floor_ms"]
    assert cells("adahop_lv2, preparation kernels at their fused floor")[4] == pytest.approx(at_floor, abs=0.05)
    assert table["adahop_lv2, preparation kernels at their fused floor"].split(" | ")[7] == f"{bf16_ms / at_floor:.2f}x"
