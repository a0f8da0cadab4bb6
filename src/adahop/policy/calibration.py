"""Calibration: vote the outlier patterns of each linear layer, then freeze a plan.

Patterns are stable over training, so AdaHOP measures them only during a short BF16
calibration (30 steps by default): a :class:`PatternRecorder` on each linear layer votes the
pattern of X and W on every training forward and of dY on the backward; the majority per
tensor picks the layer's :class:`LayerPlan`. A :class:`ModelPlan` (module name -> plan) is
saved as JSON so that a later run can skip calibration.

A forward that only recomputes activations for backward (activation checkpointing) is not a
new training step: inside :func:`paused_votes` no recorder votes and no layer freezes.
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path

import torch
from torch import nn

from ..atomic import atomic_file
from .patterns import DEFAULT_THRESHOLD, PATTERNS, Pattern, check_pattern, detect_pattern
from .strategies import DEFAULT_TABLE, GEMMS, ROLES, LayerPlan, StrategyTable, plan_for_patterns

PLAN_VERSION = 1
_pauses = 0  # open paused_votes blocks, process-wide: the main thread waits in backward() meanwhile


class paused_votes:
    """Forwards run inside this block record no pattern votes and freeze no plan. One instance may
    be entered again after it exits (a graph kept with ``retain_graph`` recomputes once per backward)."""

    def __enter__(self) -> None:
        global _pauses
        _pauses += 1

    def __exit__(self, *exc: object) -> None:
        global _pauses
        _pauses -= 1


def votes_paused() -> bool:
    return _pauses > 0


def _check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; valid: {list(ROLES)} (X, W, dY)")
    return role


class PatternVotes:
    """Counts of the patterns seen for X ("x"), W ("w") and dY ("g") of one layer.

    Ties in :meth:`majority` go to the tied pattern seen most recently: the first steps (near
    initialisation) are the least representative of the rest of training; a pattern never seen
    loses, and a full tie goes to the first in ``PATTERNS``, so the result is deterministic.
    """

    def __init__(self) -> None:
        self._counts = {role: Counter() for role in ROLES}
        self._last_seen = {role: {} for role in ROLES}  # pattern -> ordinal of its latest vote

    def add(self, role: str, pattern: Pattern) -> None:
        counts = self._counts[_check_role(role)]
        counts[check_pattern(pattern)] += 1
        self._last_seen[role][pattern] = counts.total()

    def count(self, role: str) -> int:
        """Number of votes cast for ``role``."""
        return self._counts[_check_role(role)].total()

    def counts(self, role: str) -> dict[Pattern, int]:
        return {p: self._counts[_check_role(role)][p] for p in PATTERNS}

    def majority(self, role: str) -> Pattern:
        if self.count(role) == 0:
            raise ValueError(f"no {role!r} votes: the recorder saw no training step (model.train(), grad enabled?)")
        counts, last_seen = self._counts[role], self._last_seen[role]
        return max(PATTERNS, key=lambda p: (counts[p], last_seen.get(p, 0)))

    def all_reduce(self, device: torch.device | str = "cpu", group=None) -> None:
        """Merge the votes of every rank (counts summed, latest sighting kept) so that all
        data-parallel replicas freeze the same plan. A collective: every rank must call it."""
        import torch.distributed as dist

        counts = torch.tensor([[self._counts[r][p] for p in PATTERNS] for r in ROLES], device=device)
        seen = torch.tensor([[self._last_seen[r].get(p, 0) for p in PATTERNS] for r in ROLES], device=device)
        dist.all_reduce(counts, dist.ReduceOp.SUM, group=group)
        dist.all_reduce(seen, dist.ReduceOp.MAX, group=group)
        for i, role in enumerate(ROLES):
            self._counts[role] = Counter({p: int(c) for p, c in zip(PATTERNS, counts[i].tolist()) if c})
            self._last_seen[role] = {p: int(t) for p, t in zip(PATTERNS, seen[i].tolist()) if t}

    def plan(self, table: str | StrategyTable | Mapping = DEFAULT_TABLE) -> LayerPlan:
        """The layer's frozen plan from the majority pattern of each tensor."""
        return plan_for_patterns(*(self.majority(role) for role in ROLES), table)

    def state_dict(self) -> dict:
        return {
            "counts": {role: dict(c) for role, c in self._counts.items()},
            "last_seen": {role: dict(s) for role, s in self._last_seen.items()},
        }

    def load_state_dict(self, state: Mapping) -> None:
        counts, last_seen = state["counts"], state["last_seen"]
        for role in ROLES:
            for pattern in (*counts[role], *last_seen[role]):
                check_pattern(pattern)
        self._counts = {r: Counter(counts[r]) for r in ROLES}
        self._last_seen = {r: dict(last_seen[r]) for r in ROLES}


class PatternRecorder:
    """Forward/backward hooks that vote the patterns of one ``nn.Linear``-like module.

    On a training forward with grad enabled it votes X (flattened to [tokens, in]) and the
    weight [out, in], and hooks the output to vote dY (flattened to [tokens, out]). Nothing is
    recorded under ``eval()``, ``no_grad`` or :func:`paused_votes`. ``remove()`` (or leaving the ``with`` block)
    detaches it; a backward still pending then records nothing.
    """

    def __init__(self, module: nn.Module, votes: PatternVotes | None = None, threshold: float = DEFAULT_THRESHOLD):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(f"PatternRecorder needs a module with a 2-D .weight, got {type(module).__name__}")
        self.votes = votes if votes is not None else PatternVotes()
        self.threshold = threshold
        self._active = True
        self._handle = module.register_forward_hook(self._on_forward)

    def _vote(self, role: str, t: torch.Tensor) -> None:
        self.votes.add(role, detect_pattern(t.reshape(-1, t.shape[-1]), self.threshold))

    def _on_forward(self, module: nn.Module, args: tuple, output) -> None:
        if votes_paused() or not (module.training and torch.is_grad_enabled()):
            return
        self._vote("x", args[0])
        self._vote("w", module.weight)
        if isinstance(output, torch.Tensor) and output.requires_grad:
            output.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: torch.Tensor) -> None:
        if self._active:
            self._vote("g", grad)

    def remove(self) -> None:
        self._active = False
        self._handle.remove()

    def __enter__(self) -> PatternRecorder:
        return self

    def __exit__(self, *exc) -> None:
        self.remove()


def attach_pattern_hooks(
    module: nn.Module, votes: PatternVotes | None = None, threshold: float = DEFAULT_THRESHOLD
) -> PatternRecorder:
    """Start voting the patterns of ``module``; returns the recorder (call ``.remove()``)."""
    return PatternRecorder(module, votes, threshold)


class ModelPlan(Mapping[str, LayerPlan]):
    """The frozen plan of a whole model: module name -> :class:`LayerPlan`, JSON-serialisable."""

    def __init__(self, layers: Mapping[str, LayerPlan] | None = None) -> None:
        self._layers = dict(layers or {})

    @classmethod
    def from_votes(
        cls, votes: Mapping[str, PatternVotes], table: str | StrategyTable | Mapping = DEFAULT_TABLE
    ) -> ModelPlan:
        return cls({name: v.plan(table) for name, v in votes.items()})

    def __getitem__(self, name: str) -> LayerPlan:
        return self._layers[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._layers)

    def __len__(self) -> int:
        return len(self._layers)

    def __repr__(self) -> str:
        return f"ModelPlan({len(self)} layers)"

    def to_json(self) -> str:
        layers = {name: plan.to_dict() for name, plan in self._layers.items()}
        return json.dumps({"version": PLAN_VERSION, "layers": layers}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> ModelPlan:
        try:
            doc = json.loads(text)
        except json.JSONDecodeError as e:
            raise ValueError(f"not a valid plan: bad JSON ({e})") from None
        if not isinstance(doc, dict) or not isinstance(doc.get("layers"), dict):
            raise ValueError('not a valid plan: expected an object {"version": 1, "layers": {name: plan}}')
        if doc.get("version") != PLAN_VERSION:
            raise ValueError(f"unsupported plan version {doc.get('version')!r}; this adahop reads {PLAN_VERSION}")
        layers = {}
        for name, d in doc["layers"].items():
            if not isinstance(d, dict):
                raise ValueError(f"layer {name!r}: expected an object, got {d!r}")
            try:
                layers[name] = LayerPlan.from_dict(d)
            except ValueError as e:
                raise ValueError(f"layer {name!r}: {e}") from None
        return cls(layers)

    def save(self, path: str | os.PathLike) -> None:
        """Write atomically: a reader never sees a half-written plan."""
        with atomic_file(path) as f:
            f.write(self.to_json().encode())

    @classmethod
    def load(cls, path: str | os.PathLike) -> ModelPlan:
        try:
            return cls.from_json(Path(path).read_text())
        except ValueError as e:
            raise ValueError(f"{path}: {e}") from None

    def summary(self) -> str:
        """A text table, one line per layer: patterns of x/w/g and the strategy per GEMM."""
        header = ("layer", "x", "w", "g", *GEMMS)
        rows = [header]
        for name, plan in self._layers.items():
            patterns = plan.patterns or dict.fromkeys(ROLES, "-")
            rows.append((name, *(patterns[r] for r in ROLES), *(s.value for s in plan.strategies().values())))
        widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
        return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows)
