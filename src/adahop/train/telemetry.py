"""Pattern telemetry: do the outlier patterns stay where calibration saw them?

AdaHOP freezes each layer's plan from a short calibration, assuming the patterns of X, W and dY
are stable over training. Every ``training.pattern_telemetry_every`` steps after the freeze the
trainer samples them again on that step, with calibration's own statistics and vote
(:class:`~adahop.policy.PatternRecorder`: the step's micro-batches and ranks merged into one vote
per tensor), and logs a ``patterns`` record:

- ``drift_x``, ``drift_w``, ``drift_g``: the fraction of layers whose sampled pattern differs
  from the one their plan was frozen with;
- ``strategy_drift``: the fraction whose sampled patterns would pick other strategies;
- ``layers``: how many layers were sampled; ``sampled``: each one's patterns as ``"x/w/g"``
  (``plan.json`` holds the frozen ones).

The hooks only observe: the output they wire is the same tensor and they draw no random
numbers, so the step trains exactly as it would unobserved. Only layers with a calibrated plan (patterns to compare with)
are sampled; under a fixed recipe there are none and nothing is logged.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from ..nn import AdaHOPLinear
from ..policy import PatternVotes, attach_pattern_hooks, plan_for_patterns
from ..policy.calibration import close_step
from ..policy.strategies import ROLES

RECORD_KIND = "patterns"


def calibrated_layers(layers: Mapping[str, AdaHOPLinear]) -> dict[str, AdaHOPLinear]:
    """The layers whose frozen plan carries the patterns it was chosen from."""
    return {name: layer for name, layer in layers.items() if layer.plan is not None and layer.plan.patterns}


@contextlib.contextmanager
def sample_patterns(layers: Mapping[str, AdaHOPLinear]) -> Iterator[dict[str, PatternVotes]]:
    """Vote the patterns of ``layers`` on the training step run inside the block (new votes,
    the layers' own calibration votes untouched): one vote per tensor, cast when the block ends
    (a collective under ``torch.distributed``: every rank samples the same steps); the hooks are
    gone then."""
    votes = {name: PatternVotes() for name in layers}
    recorders = [
        attach_pattern_hooks(layer, votes[name], layer.recipe.pattern_threshold) for name, layer in layers.items()
    ]
    try:
        yield votes
        if recorders:
            close_step([recorder.voter for recorder in recorders])
    finally:
        for recorder in recorders:
            recorder.remove()


def drift_record(layers: Mapping[str, AdaHOPLinear], votes: Mapping[str, PatternVotes]) -> dict[str, Any]:
    """The ``patterns`` record's values (see the module doc) for layers that got every vote."""
    seen = {name: v for name, v in votes.items() if all(v.count(role) for role in ROLES)}
    sampled = {name: {role: v.majority(role) for role in ROLES} for name, v in seen.items()}
    frozen = {name: layers[name].plan.patterns for name in seen}
    n = max(len(seen), 1)
    record: dict[str, Any] = {
        f"drift_{role}": sum(sampled[name][role] != frozen[name][role] for name in seen) / n for role in ROLES
    }

    def strategies(name: str, patterns: Mapping[str, str]) -> dict:
        return plan_for_patterns(*(patterns[role] for role in ROLES), layers[name].recipe.table).strategies()

    record["strategy_drift"] = (
        sum(strategies(name, sampled[name]) != strategies(name, frozen[name]) for name in seen) / n
    )
    record["layers"] = len(seen)
    record["sampled"] = {name: "/".join(p[role] for role in ROLES) for name, p in sampled.items()}
    return record
