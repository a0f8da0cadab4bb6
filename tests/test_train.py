"""The trainer: config files and overrides, a short run per recipe, the CLI, non-finite stops.

Runs use the ``tiny`` preset shrunk to 2 layers of width 64 on a small text made from the
standard library's ``json`` package (a 512-token BPE), so each takes a few seconds on a CPU.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from adahop.models import MODEL_PRESETS
from adahop.policy import LayerPlan, ModelPlan
from adahop.policy.strategies import get_table
from adahop.recipes import RECIPES
from adahop.train import (
    ConfigError,
    NonFiniteLossError,
    Trainer,
    TrainConfig,
    build_model_from_config,
    latest_checkpoint,
    load_checkpoint,
    load_config,
    read_metrics,
)
from adahop.train.cli import main
from adahop.train.config import dump_toml
from adahop.train.metrics import PeakMemory
from adahop.train.optim import lr_multiplier

from conftest import SMALL_MODEL

LINEARS_PER_BLOCK = 7  # wq, wk, wv, wo, w1, w2, w3
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


pytestmark = pytest.mark.usefixtures("one_thread")


def as_argv(pairs: list[tuple[str, str]]) -> list[str]:
    return [f"--{k}={v}" for k, v in pairs]


# ---- config ---------------------------------------------------------------------------------
def test_defaults_are_the_cpu_quickstart():
    cfg = TrainConfig()
    assert (cfg.model.preset, cfg.recipe.name, cfg.data.source) == ("tiny", "adahop_lv1_bf16_forward", "stdlib")
    assert cfg.recipe.calibration_steps == 30
    assert cfg.run_dir == Path("runs/tiny-adahop_lv1_bf16_forward")


def test_toml_round_trip_and_precedence(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text(
        'recipe = "adahop_lv1"\n[model]\npreset = "tiny"\n[model.overrides]\nn_layers = 3\n'
        "[optim]\nlr = 0.01\nbetas = [0.8, 0.9]\n"
    )
    cfg = load_config(path, [("optim.lr", "0.005"), ("recipe.calibration_steps", "7")])
    assert cfg.model.overrides == {"n_layers": 3}
    assert cfg.optim.lr == 0.005 and cfg.optim.betas == (0.8, 0.9)  # the command line wins
    assert (cfg.recipe.name, cfg.recipe.table, cfg.recipe.calibration_steps) == ("adahop_lv1", "lv1", 7)
    saved = tmp_path / "saved.toml"
    saved.write_text(cfg.to_toml())
    assert load_config(saved).to_dict() == cfg.to_dict()


def test_strategy_table_override_on_the_command_line_is_an_inline_toml_table(tmp_path):
    """``--recipe.table={"row,row"="iht",...}`` (docs/quality.md's dgrad ablation: lv2 with
    ``"row,none"="iht"``) is a mapping, not a table name, and survives the saved config."""
    table = {**get_table("lv2").to_dict(), "row,none": "iht"}
    text = "{" + ",".join(f'"{pair}"="{strategy}"' for pair, strategy in table.items()) + "}"  # no spaces
    cfg = load_config(None, [("recipe.table", text)])
    assert cfg.recipe.table == table
    saved = tmp_path / "config.toml"
    saved.write_text(cfg.to_toml())
    assert load_config(saved).recipe.table == table
    assert load_config(None, [("recipe.table", "lv1")]).recipe.table == "lv1"


def test_dump_toml_is_read_back_by_tomllib():
    import tomllib

    doc = {"a": 1, "b": 2.5e-7, "c": 'x"y\\z', "d": [1, 2], "e": True, "t": {"row,none": "bf16", "k": {"n": 1}}}
    assert tomllib.loads(dump_toml(doc)) == doc


@pytest.mark.parametrize(
    "pairs, expected",
    [
        ([("model.preset", "huge")], "valid presets: tiny, small"),
        ([("recipe", "fp2")], "adahop_lv1"),
        ([("optim.lrate", "1")], "valid keys: betas, grad_clip, lr"),
        ([("optimizer.lr", "1")], "sections checkpoint, data, logging, model, optim, recipe, training"),
        ([("model.overrides.width", "1")], "valid keys: dim,"),
        ([("optim.lr", "fast")], "optim.lr: expected a number"),
        ([("training.steps", "2.5")], "training.steps: expected an integer"),
        ([("training.device", "tpu")], "auto, cpu, cuda"),
        ([("recipe.scale_rule", "up")], "floor"),
        ([("training.steps", "0")], "training.steps must be positive"),
        ([("data.seq_len", "4096")], "max_seq_len"),
        ([("training.compile", "true"), ("training.compile_backend", "tvmx")], "compile_backend='tvmx' is not one of"),
        (
            [("training.compile", "true"), ("training.compile_backend", "aot_eager")]
            + [("training.recompute_wgrad_operands", "true")],
            "recompute_wgrad_operands is an Inductor pass: set training.compile_backend=inductor",
        ),
        ([("optim.lr", "inf")], "optim.lr must be a finite number, got inf"),
        ([("optim.grad_clip", "nan")], "optim.grad_clip must be a finite number, got nan"),
        ([("optim.betas", "0.9,nan")], "optim.betas must be a finite number"),
        ([("model.overrides.n_layers", "0")], "model: n_layers must be positive, got 0"),
    ],
)
def test_bad_values_name_the_key_and_the_choices(pairs, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, pairs)


CONFIGS = Path(__file__).parents[1] / "configs"


def test_tiny_cpu_config_spells_out_the_defaults():
    default = TrainConfig()
    default.training.device = "cpu"
    assert load_config(CONFIGS / "tiny_cpu.toml").to_dict() == default.to_dict()
    assert load_config(CONFIGS / "tiny_cpu.toml", [("recipe", "bf16")]).run_dir == Path("runs/tiny-bf16")


@pytest.mark.parametrize("preset", ["llama3_1b", "llama3_3b"])
def test_h200_configs_train_in_the_fastest_mode_with_64k_token_steps(preset):
    cfg = load_config(CONFIGS / f"{preset}_h200.toml")  # validates
    assert (cfg.model.preset, cfg.training.device, cfg.recipe.name) == (preset, "cuda", "adahop_lv2")
    assert cfg.training.compile and cfg.training.cuda_graph  # what the step bench measured fastest
    assert cfg.data.batch_size * cfg.data.seq_len * cfg.training.grad_accum == 65536
    assert cfg.data.vocab_size == MODEL_PRESETS[preset].vocab_size == 128256  # Llama 3's, as the step bench runs it


def test_bad_config_file_is_named(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text("[optim]\nlearning_rate = 1\n")
    with pytest.raises(ConfigError, match=r"bad\.toml: unknown key 'optim\.learning_rate'"):
        load_config(path)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["--model", "huge"], "invalid choice: 'huge' (choose from 'tiny', 'small'"),
        (
            ["--recipe", "fp2"],
            "choose from 'adahop_lv1', 'adahop_lv1_bf16_forward', 'adahop_lv1_fp8_forward', 'adahop_lv2', 'bf16', 'mxfp4', "
            "'mxfp4_hadamard'",
        ),
        (["--steps", "many"], "invalid int value"),
        (["--optim.lr=fast"], "optim.lr: expected a number"),
        (["--model.preset=huge"], "valid presets: tiny"),
        (["--optim.lr"], "--optim.lr needs a value"),
        (["extra"], "unrecognized argument 'extra'"),
        (["--config", "missing.toml"], "cannot read config missing.toml"),
    ],
)
def test_cli_errors_exit_2_with_choices(argv, expected, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert expected in capsys.readouterr().err


def test_cuda_memory_fields_are_interval_peaks_beside_the_run_peak(monkeypatch):
    """Under CUDA graphs ``max_memory_allocated`` misses the graphs' private pools (measured in
    benchmarks/step/2026-12-04-h200-step/), so records carry the reserved peak too; each
    record's peaks are those since the previous one (calibration's and capture's peaks would
    otherwise hide the frozen steps'), and the run's reserved peak is kept beside them."""
    allocated, reserved = [3, 2], [50, 28]  # MiB: calibration's interval, then frozen steps'
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: allocated[0] * 2**20)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: reserved[0] * 2**20)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: (allocated.pop(0), reserved.pop(0)))
    memory = PeakMemory(torch.device("cuda"))
    assert memory.read() == {"memory_mib": 3.0, "memory_reserved_mib": 50.0, "run_peak_reserved_mib": 50.0}
    assert memory.read() == {"memory_mib": 2.0, "memory_reserved_mib": 28.0, "run_peak_reserved_mib": 50.0}
    assert not allocated and not reserved  # each read reset the counters
    cpu = PeakMemory(torch.device("cpu")).read()
    assert list(cpu) == ["memory_mib"] and cpu["memory_mib"] > 0


def test_lr_schedule_warmup_then_cosine():
    warmup, total, floor = 10, 110, 0.1
    assert lr_multiplier(0, warmup, total, floor) == pytest.approx(0.1)
    assert lr_multiplier(9, warmup, total, floor) == pytest.approx(1.0)
    assert lr_multiplier(10, warmup, total, floor) == pytest.approx(1.0)
    assert lr_multiplier(60, warmup, total, floor) == pytest.approx((1 + floor) / 2)  # cos(pi/2) = 0
    assert lr_multiplier(110, warmup, total, floor) == pytest.approx(floor)


# ---- runs -----------------------------------------------------------------------------------
def test_deterministic_kernels_are_asked_for_and_change_no_cpu_result(small_overrides, tmp_path):
    """``training.deterministic`` turns on PyTorch's deterministic kernels for the process, strictly:
    warn-only would leave SDPA's flash-attention backward on CUDA nondeterministic. On the CPU,
    where the step is already reproducible, the losses are those of the default run."""
    default = Trainer(load_config(None, small_overrides(tmp_path / "a")), progress=False)
    default.train()
    try:
        cfg = load_config(None, small_overrides(tmp_path / "b", training__deterministic="true"))
        Trainer(cfg, progress=False).train()
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # strict: see use_deterministic_kernels
        assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
    losses = [[r["loss"] for r in read_metrics(tmp_path / run) if r["kind"] == "train"] for run in ("a", "b")]
    assert losses[0] == losses[1] and len(losses[0]) == 6


def test_rounding_seed_offset_changes_only_the_rounding_noise(small_overrides, tmp_path):
    """``training.rounding_seed_offset`` reseeds only the generator of the stochastic-rounding keys:
    init and data order stay those of ``training.seed``, so BF16 (no keys) trains bit for bit alike
    and an adaptive recipe matches through its BF16 calibration (2 steps) and the first quantized
    forward (X and W round to nearest), then differs: the keys round dY from step 3's backward on."""
    losses = {}
    for recipe in ("bf16", "adahop_lv2"):
        for offset in (0, 1):
            out = tmp_path / f"{recipe}-{offset}"
            cfg = load_config(None, small_overrides(out, recipe__name=recipe, training__rounding_seed_offset=offset))
            Trainer(cfg, progress=False).train()
            losses[recipe, offset] = [r["loss"] for r in read_metrics(out) if r["kind"] == "train"]
    assert losses["bf16", 0] == losses["bf16", 1]
    same, other = losses["adahop_lv2", 0], losses["adahop_lv2", 1]
    assert same[:3] == other[:3] and all(a != b for a, b in zip(same[3:], other[3:]))


@pytest.mark.parametrize(
    "recipe", sorted(n for n, r in RECIPES.items() if not r.torchao_float8)
)  # peer: test_float8_peer
def test_short_run_writes_the_run_directory(recipe, small_overrides, tmp_path, caplog):
    cfg = load_config(None, small_overrides(tmp_path / "run", recipe=recipe, checkpoint__keep_last=2))
    with caplog.at_level("INFO", logger="adahop"):
        result = Trainer(cfg, progress=False).train()
    run = tmp_path / "run"
    assert result.run_dir == run and result.step == 6

    assert load_config(run / "config.toml").to_dict() == cfg.to_dict()
    assert (run / "loss.png").read_bytes()[:8] == PNG_SIGNATURE
    assert any(p.name.startswith("events.out.tfevents") for p in (run / "tb").iterdir())
    # checkpoints every 2 steps, the newest 2 kept
    assert sorted(p.name for p in (run / "checkpoints").glob("*.pt")) == ["step_0000004.pt", "step_0000006.pt"]

    records = read_metrics(run)
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    assert [r["step"] for r in train] == [1, 2, 3, 4, 5, 6]
    assert [r["step"] for r in val] == [3, 6]
    assert all(math.isfinite(r["loss"]) and r["memory_mib"] > 0 and r["tokens_per_s"] > 0 for r in train)
    assert [r["tokens"] for r in train] == [128 * s for s in range(1, 7)]
    assert [r["lr"] for r in train[:2]] == pytest.approx([cfg.optim.lr / 2, cfg.optim.lr])  # warmup
    assert val[-1]["loss"] == result.val_loss and val[-1]["perplexity"] == pytest.approx(math.exp(result.val_loss))

    # The plan covers every converted linear; calibrating recipes froze after 2 steps.
    plan = ModelPlan.load(run / "plan.json")
    assert len(plan) == LINEARS_PER_BLOCK * SMALL_MODEL["n_layers"]
    plan_logs = [r.getMessage() for r in caplog.records if r.getMessage().startswith("strategy plan")]
    steps_logged = [r.getMessage() for r in caplog.records if r.getMessage().startswith("step 6/6")]
    if cfg.recipe.adaptive:
        assert [r["phase"] for r in train[:3]] == ["calibrating", "calibrating", "frozen"]
        assert len(plan_logs) == 1 and plan_logs[0].startswith("strategy plan frozen (step 2")  # before its update
        assert steps_logged[0].endswith("frozen")
    else:  # one strategy: nothing calibrates or freezes, and one line says what every layer runs
        strategies = {s.value for p in plan.values() for s in p.strategies().values()}
        assert strategies == {cfg.recipe.strategy}
        assert {r["phase"] for r in train} == {"fixed"}
        s = cfg.recipe.strategy
        assert plan_logs == [
            f"strategy plan fixed by recipe {recipe}: every one of {len(plan)} layers runs "
            f"forward={s}, dgrad={s}, wgrad={s}"
        ]
        assert not steps_logged[0].endswith(("frozen", "calibrating", "fixed"))

    # What `adahop analyze` does: rebuild from config.toml and load the latest checkpoint.
    model = build_model_from_config(load_config(run / "config.toml"))
    state = load_checkpoint(run, model)
    assert state["step"] == 6 and state["path"] == latest_checkpoint(run)
    for name, tensor in model.state_dict().items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(tensor, state["model"][name]), name
    assert (
        ModelPlan.load(run / "plan.json").to_json()
        == ModelPlan({n: m.plan for n, m in model.named_modules() if getattr(m, "plan", None) is not None}).to_json()
    )


@pytest.mark.parametrize("recipe", ["mxfp4", "adahop_lv2"])
def test_compiled_blocks_train_like_eager(recipe, small_overrides, tmp_path, monkeypatch):
    """``training.compile`` compiles every block once no layer calibrates (from step 1 for a fixed
    recipe, after 2 calibration steps for lv2), trains bit for bit like eager, and checkpoints
    keep the eager names.

    The stochastic-rounding keys are fixed here: compiled, the partitioner moves each layer's
    ``torch.randint`` draw into the backward, so layers get their keys in another order
    (tests/test_compile.py, which checks the compiled keys give eager's numbers). That alone
    moves these losses by up to 1.2e-3 relative over 6 steps (measured: 20 runs with
    independently drawn keys, median of the worst step 5e-4), so a tolerance would have to be
    loose enough to hide real bugs. With the keys fixed, ``aot_eager`` runs the same ops on
    the same inputs (no code generation, no float reordering) and the losses are equal."""
    fixed = lambda device="cpu", count=2: torch.arange(1, count + 1, dtype=torch.int64, device=device) * 7919  # noqa: E731
    monkeypatch.setattr("adahop.nn.linear.draw_rounding_seeds", fixed)
    losses = {}
    for compile in (False, True):
        run = tmp_path / f"compile_{compile}"
        extra = {"training__compile": compile, "training__compile_backend": "aot_eager"}
        trainer = Trainer(load_config(None, small_overrides(run, recipe=recipe, **extra)), progress=False)
        trainer.train()
        losses[compile] = [(r["kind"], r["loss"]) for r in read_metrics(run) if r["kind"] in ("train", "val")]
        assert all((block._compiled_call_impl is not None) == compile for block in trainer.model.layers)
    assert len(losses[False]) == 6 + 2 and losses[True] == losses[False]
    model = build_model_from_config(load_config(run / "config.toml"))
    assert load_checkpoint(run, model)["step"] == 6  # strict load: same parameter names


def test_cli_run_refuses_to_overwrite_then_resumes_from_saved_config(small_overrides, tmp_path, capsys):
    run = tmp_path / "run"
    assert main(as_argv(small_overrides(run, training__steps=3))) == 0
    assert f"Results in {run}/" in capsys.readouterr().out

    with pytest.raises(SystemExit) as exit_info:
        main(as_argv(small_overrides(run, training__steps=3)))
    assert exit_info.value.code == 2
    assert "already holds checkpoints" in capsys.readouterr().err

    # Only --out, --resume and a longer --steps: everything else comes from run/config.toml.
    assert main(["--out", str(run), "--resume", "--steps", "5"]) == 0
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == [1, 2, 3, 4, 5]
    assert load_config(run / "config.toml").training.steps == 5


def test_a_saved_plan_freezes_every_layer_from_step_0_and_resumes_without_its_file(
    small_overrides, tmp_path, caplog, capsys
):
    """training.plan: no calibration, the file's strategies in force (not a plan calibration could have
    frozen: every layer IHT/BF16/IHT), logged and saved as the run's plan; a resume takes the checkpoint's."""
    plan = ModelPlan(
        {
            f"layers.{i}.{part}.{w}": LayerPlan("iht", "bf16", "iht")
            for i in range(SMALL_MODEL["n_layers"])
            for part, names in (("attention", ("wq", "wk", "wv", "wo")), ("feed_forward", ("w1", "w2", "w3")))
            for w in names
        }
    )
    plan_file = tmp_path / "chosen.json"
    plan.save(plan_file)
    run = tmp_path / "run"
    pairs = small_overrides(run, recipe="adahop_lv2", training__steps=3, training__plan=plan_file)
    with caplog.at_level("INFO", logger="adahop"):
        assert main(as_argv(pairs)) == 0
    assert [r["phase"] for r in read_metrics(run) if r["kind"] == "train"] == ["frozen"] * 3
    assert ModelPlan.load(run / "plan.json").to_json() == plan.to_json()
    assert any(r.getMessage().startswith(f"strategy plan loaded from {plan_file}") for r in caplog.records)

    plan_file.unlink()  # the checkpoint holds the plans
    assert main(["--out", str(run), "--resume", "--steps", "4"]) == 0
    # another plan would misdescribe the steps run so far
    assert main(["--out", str(run), "--resume", "--steps", "5", f"--training.plan={tmp_path / 'other.json'}"]) == 1
    assert "which a resumed run cannot change (the plans every layer froze" in capsys.readouterr().err
    model = build_model_from_config(load_config(run / "config.toml"))
    assert load_checkpoint(run, model)["step"] == 4
    assert {m.plan for m in model.modules() if getattr(m, "plan", None) is not None} == {
        LayerPlan("iht", "bf16", "iht")
    }


@pytest.mark.parametrize(
    "plan_text, extra, expected",
    [
        (None, {}, "chosen.json: No such file or directory (give an earlier run's plan.json)"),
        ("{not json", {}, "training.plan: " + "{path}" + ": not a valid plan: bad JSON"),
        (
            '{"version": 1, "layers": {"layers.0.attention.wq": {"forward": "iht", "dgrad": "bf16", "wgrad": "iht"}}}',
            {},
            "plan has no entry for layers",
        ),
        ('{"version": 1, "layers": {}}', {"recipe": "bf16"}, "recipe bf16 fixes them itself"),
    ],
    ids=["missing", "corrupt", "another-model", "fixed-recipe"],
)
def test_an_unusable_plan_file_is_one_line_before_training(
    plan_text, extra, expected, small_overrides, tmp_path, capsys
):
    plan_file = tmp_path / "chosen.json"
    if plan_text is not None:
        plan_file.write_text(plan_text)
    run = tmp_path / "run"
    with pytest.raises(SystemExit) as exit_info:
        main(as_argv(small_overrides(run, training__plan=plan_file, **extra)))
    assert exit_info.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert "error: training.plan" in last and expected.replace("{path}", str(plan_file)) in last
    assert not (run / "checkpoints").exists()


def test_non_finite_loss_stops_and_keeps_last_good_checkpoint(small_overrides, tmp_path):
    cfg = load_config(None, small_overrides(tmp_path / "run", recipe="mxfp4"))
    trainer = Trainer(cfg, progress=False)

    def poison_at_step_5(model, args):
        if trainer.step == 4:  # the forward of step 5
            model.tok_embeddings.weight.data[args[0][0, 0]] = float("nan")

    trainer.model.register_forward_pre_hook(poison_at_step_5)
    with pytest.raises(NonFiniteLossError, match=r"loss is nan at step 5 with recipe 'mxfp4'.*step_0000004\.pt"):
        trainer.train()
    run = tmp_path / "run"
    assert latest_checkpoint(run).name == "step_0000004.pt"
    assert [r["step"] for r in read_metrics(run) if r["kind"] == "train"] == [1, 2, 3, 4]
    assert (run / "loss.png").exists()
    model = build_model_from_config(cfg)
    load_checkpoint(run, model)
    assert all(torch.isfinite(p).all() for p in model.parameters())


def test_cli_exits_1_when_the_loss_diverges(small_overrides, tmp_path, capsys):
    argv = as_argv(small_overrides(tmp_path / "run", recipe="bf16", optim__lr=1e6, optim__warmup_steps=0))
    assert main(argv) == 1
    assert "with recipe 'bf16'" in capsys.readouterr().err
