"""Pattern telemetry: sampled pattern votes after calibration, in metrics.jsonl and TensorBoard,
without changing the training numbers."""

from __future__ import annotations

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from adahop.nn import AdaHOPLinear
from adahop.policy import PATTERNS, PatternVotes
from adahop.policy.strategies import LayerPlan
from adahop.train import Trainer, load_config, read_metrics
from adahop.train.config import ConfigError
from adahop.train.telemetry import calibrated_layers, drift_record

pytestmark = pytest.mark.usefixtures("one_thread")


def train(small_overrides, run, **extra):
    trainer = Trainer(load_config(None, small_overrides(run, training__steps=8, **extra)), progress=False)
    trainer.train()
    return trainer, read_metrics(run)


def test_records_at_the_right_steps_and_training_is_bit_identical(small_overrides, tmp_path):
    trainer, records = train(small_overrides, tmp_path / "on", training__pattern_telemetry_every=2)
    _, records_off = train(small_overrides, tmp_path / "off", training__pattern_telemetry_every=0)

    # Calibration votes on steps 1-2 and freezes in step 3's forward: steps 4, 6, 8 are sampled.
    patterns = [r for r in records if r["kind"] == "patterns"]
    assert [r["step"] for r in patterns] == [4, 6, 8]
    names = set(trainer.named_layers)
    for r in patterns:
        assert r["layers"] == len(names) == 14
        assert set(r["sampled"]) == names
        for value in r["sampled"].values():
            assert all(p in PATTERNS for p in value.split("/")) and value.count("/") == 2
        for key in ("drift_x", "drift_w", "drift_g", "strategy_drift"):
            assert 0 <= r[key] <= 1 and (r[key] * 14).is_integer()
        frozen = {name: layer.plan.patterns for name, layer in trainer.named_layers.items()}
        changed_g = sum(r["sampled"][n].split("/")[2] != frozen[n]["g"] for n in names)
        assert r["drift_g"] == changed_g / 14
    assert all(not layer._forward_hooks for layer in trainer.layers)  # the hooks left with their step

    assert not any(r["kind"] == "patterns" for r in records_off)
    losses = [(r["kind"], r["step"], r["loss"]) for r in records if r["kind"] in ("train", "val")]
    assert losses == [(r["kind"], r["step"], r["loss"]) for r in records_off if r["kind"] in ("train", "val")]

    events = EventAccumulator(str(tmp_path / "on" / "tb")).Reload()
    assert [e.step for e in events.Scalars("patterns/drift_g")] == [4, 6, 8]
    assert {"patterns/drift_x", "patterns/drift_w", "patterns/strategy_drift"} <= set(events.Tags()["scalars"])


def test_compiled_blocks_run_the_sampled_step_eagerly(small_overrides, tmp_path):
    extra = {"training__compile": True, "training__compile_backend": "aot_eager", "training__grad_accum": 2}
    trainer, records = train(small_overrides, tmp_path / "run", training__pattern_telemetry_every=3, **extra)
    assert [r["step"] for r in records if r["kind"] == "patterns"] == [3, 6]  # grad_accum 2: frozen from step 2
    assert all(block._compiled_call_impl is not None for block in trainer.model.layers)


def _layer(patterns: dict[str, str] | None) -> AdaHOPLinear:
    layer = AdaHOPLinear(64, 64, recipe="adahop_lv2")
    layer.set_plan(LayerPlan("iht", "iht", "iht", patterns))
    return layer


def _votes(*patterns: str) -> PatternVotes:
    votes = PatternVotes()
    for role, pattern in zip("xwg", patterns):
        votes.add(role, pattern)
    return votes


def test_drift_counts_layers_whose_majority_left_the_plan():
    frozen = {"x": "col", "w": "none", "g": "row"}
    layers = {"a": _layer(frozen), "b": _layer(frozen), "fixed": _layer(None)}
    layers = calibrated_layers(layers)
    assert set(layers) == {"a", "b"}  # a plan without patterns has nothing to drift from
    votes = {"a": _votes("col", "none", "row"), "b": _votes("col", "none", "none")}
    votes["b"].add("g", "row")
    votes["b"].add("g", "none")  # two of three micro-batches vote none: the majority
    record = drift_record(layers, votes)
    assert (record["drift_x"], record["drift_w"], record["drift_g"]) == (0.0, 0.0, 0.5)
    assert record["strategy_drift"] == 0.5  # lv2: dgrad's (row, none) is OE-left, (none, none) IHT
    assert record["sampled"] == {"a": "col/none/row", "b": "col/none/none"} and record["layers"] == 2


def test_negative_interval_is_refused(small_overrides, tmp_path):
    with pytest.raises(ConfigError, match="training.pattern_telemetry_every must be >= 0"):
        load_config(None, small_overrides(tmp_path / "run", training__pattern_telemetry_every=-1))
