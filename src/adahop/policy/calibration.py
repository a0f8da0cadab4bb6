"""Calibration: vote the outlier patterns of each linear layer once per training step, then freeze a plan.

Patterns are stable over training, so AdaHOP measures them only during a short BF16
calibration (30 steps by default), then freezes each layer's :class:`LayerPlan` from the
majority pattern of X, W and dY. A :class:`ModelPlan` (module name -> plan) is saved as JSON so
that a later run can skip calibration.

How a step is observed, so that it works inside the stacks users run:

- **In the backward, once.** A calibrating layer (or a :class:`PatternRecorder`) wraps its output
  in an autograd node whose backward adds the statistics of X, W and dY (``patterns.line_stats``)
  to device buffers. A backward node runs once per backward pass whatever activation
  checkpointing does (a recompute rebuilds saved tensors but never runs the first graph's nodes
  twice; a reentrant checkpoint's first forward builds no graph at all), so nothing is counted
  twice and the forward and its recompute run the same code. No host sync, no Python state
  changes: a calibrating layer compiles with ``torch.compile(fullgraph=True)``.
- **W whole.** A layer's own calibration sees W as its forward does, whole. A recorder's forward
  hook on a module that is an FSDP2 unit itself (``fully_shard`` per linear) runs after FSDP2
  has resharded it, so it gets W as a DTensor of this rank's rows: its backward gathers W whole
  (``full_tensor``; every rank gathers the same layers in the same order, on the rare steps
  recorders observe), so every rank votes the whole W's pattern, as one process does.
- **Decided at the step boundary.** Right before ``optimizer.step()`` (a global optimizer
  pre-hook, for the layers whose weights that optimizer updates), or at an explicit
  :func:`end_calibration_step`, the step's statistics are summed over the micro-batches and over
  every data-parallel rank (two ``all_reduce``), each operand gets one vote from the merged
  statistics, and a layer with ``recipe.calibration_steps`` votes freezes. So one process and N
  ranks that see the same global batch freeze the same plan, and the freeze never happens inside
  a forward that backward replays.
"""

from __future__ import annotations

import itertools
import json
import os
import weakref
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..atomic import atomic_file
from .patterns import (
    DEFAULT_THRESHOLD,
    PATTERNS,
    NonFiniteTensorError,
    Pattern,
    check_pattern,
    decide,
    line_stats,
    merged_scores,
    stats_sizes,
)
from .strategies import DEFAULT_TABLE, GEMMS, ROLES, LayerPlan, StrategyTable, plan_for_patterns

PLAN_VERSION = 1
ROLE_NAMES = {"x": "input X", "w": "weight W", "g": "output gradient dY"}


def _check_role(role: str) -> str:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; valid: {list(ROLES)} (X, W, dY)")
    return role


class PatternVotes:
    """Counts of the patterns seen for X ("x"), W ("w") and dY ("g") of one layer, one vote per
    operand per training step.

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


# ---- the step's statistics -----------------------------------------------------------------------
def add_step_buffers(module: nn.Module, in_features: int, out_features: int, device=None) -> None:
    """Register the non-persistent float64 buffers that hold one step's statistics of X, W and dY
    (``patterns.line_stats``) on ``module``: they follow ``.to()`` and FSDP2's device move, stay
    out of the state_dict, and a compiled forward mutates them in place."""
    for role, n_cols in zip(ROLES, (in_features, in_features, out_features)):
        for kind, size in zip(("sums", "maxes"), stats_sizes(n_cols)):
            module.register_buffer(
                f"_step_{role}_{kind}", torch.zeros(size, dtype=torch.float64, device=device), persistent=False
            )


def step_buffers(module: nn.Module) -> list[torch.Tensor]:
    """``[x sums, x maxes, w sums, w maxes, g sums, g maxes]`` of ``module`` (``add_step_buffers``)."""
    return [getattr(module, f"_step_{role}_{kind}") for role in ROLES for kind in ("sums", "maxes")]


def _accumulate(sums: torch.Tensor, maxes: torch.Tensor, t: torch.Tensor) -> None:
    if t.numel():
        s, m = line_stats(t.reshape(-1, t.shape[-1]))
        sums.add_(s)
        maxes.copy_(torch.maximum(maxes, m))


class _VoteInBackward(torch.autograd.Function):
    """Identity on the layer's output; its backward adds X's and dY's statistics to the step's and
    sets W's (the same W in every micro-batch of a step, on every rank: counted once)."""

    @staticmethod
    def forward(ctx, y, x, weight, *buffers):
        ctx.save_for_backward(x, weight)
        ctx.buffers = buffers
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        if isinstance(weight, DTensor):  # this rank's rows (a recorder outside W's FSDP2 unit): W is the whole weight
            weight = weight.full_tensor()
        x_sums, x_maxes, w_sums, w_maxes, g_sums, g_maxes = ctx.buffers
        _accumulate(x_sums, x_maxes, x)
        w_sums.zero_()
        w_maxes.zero_()
        _accumulate(w_sums, w_maxes, weight)
        _accumulate(g_sums, g_maxes, grad)
        return grad, None, None, *(None for _ in ctx.buffers)


def observe(y: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, holder: nn.Module) -> torch.Tensor:
    """``y`` (= linear(x, weight)), wired so the backward adds this micro-batch to the step's statistics."""
    return _VoteInBackward.apply(y, x, weight, *step_buffers(holder))


# ---- step boundaries -----------------------------------------------------------------------------
@dataclass(eq=False)
class Voter:
    """One layer's calibration: whose weight identifies it, where its step statistics live, and
    what to do after each step's votes (a calibrating ``AdaHOPLinear`` freezes)."""

    module: nn.Module
    holder: nn.Module
    votes: PatternVotes
    threshold: float
    after_votes: Callable[[], None] | None = None
    serial: int = field(default_factory=itertools.count().__next__)

    def __reduce__(self):
        """A copy (``copy.deepcopy``, pickle) is a voter of its own, open where the original is."""
        fields = (self.module, self.holder, self.votes, self.threshold, self.after_votes)
        return _copied_voter, (*fields, self.serial in _VOTERS)


def _copied_voter(module, holder, votes, threshold, after_votes, is_open: bool) -> Voter:
    voter = Voter(module, holder, votes, threshold, after_votes)
    return open_voter(voter) if is_open else voter


_VOTERS: weakref.WeakValueDictionary[int, Voter] = weakref.WeakValueDictionary()
_hook = None


def open_voter(voter: Voter) -> Voter:
    """Take part in step boundaries (kept while the caller holds ``voter``)."""
    global _hook
    if _hook is None:
        _hook = register_optimizer_step_pre_hook(_before_optimizer_step)
    _VOTERS[voter.serial] = voter
    return voter


def close_voter(voter: Voter) -> None:
    _VOTERS.pop(voter.serial, None)


def _before_optimizer_step(optimizer: torch.optim.Optimizer, args, kwargs) -> None:
    if len(_VOTERS):
        end_step([p for group in optimizer.param_groups for p in group["params"]])


def end_calibration_step(model: nn.Module, group=None) -> None:
    """End the training step for every calibrating layer (and pattern recorder) of ``model``:
    merge the step's statistics over ranks, vote, freeze the layers that have enough votes.

    Needed only where no ``torch.optim`` optimizer steps the layers' weights (its pre-step hook
    does this for them); calling it again in the same step does nothing. A collective when
    ``torch.distributed`` is initialized: every rank calls it (``group``: the data-parallel group).
    """
    end_step(model.parameters(), group)


def end_step(params: Iterable[torch.Tensor], group=None) -> None:
    """:func:`end_calibration_step` for the voters whose module's ``weight`` is in ``params``,
    in the order of ``params`` (the same on every rank, as the collectives need)."""
    order = {id(p): i for i, p in enumerate(params)}
    voters = [v for v in list(_VOTERS.values()) if id(getattr(v.module, "weight", None)) in order]
    voters.sort(key=lambda v: (order[id(v.module.weight)], v.serial))
    if voters:
        close_step(voters, group)


def close_step(voters: list[Voter], group=None) -> None:
    """Merge the step's statistics of ``voters`` over ranks, cast one vote per operand that the
    step saw, clear the statistics, then run each voter's ``after_votes``. One host read."""
    import torch.distributed as dist

    buffers = [step_buffers(v.holder) for v in voters]
    if dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1:
        # X and dY are split over ranks; W is the same tensor on every rank and is left alone.
        for kind, op in ((0, dist.ReduceOp.SUM), (1, dist.ReduceOp.MAX)):
            parts = [b[i + kind] for b in buffers for i in (0, 4)]
            merged = torch.cat(parts)
            dist.all_reduce(merged, op, group=group)
            for part, value in zip(parts, merged.split([p.numel() for p in parts])):
                part.copy_(value)
    scores = torch.stack([merged_scores(b[2 * i], b[2 * i + 1]) for b in buffers for i in range(len(ROLES))])
    scores = scores.tolist()
    for b in buffers:
        for t in b:
            t.zero_()
    for v, voter in enumerate(voters):
        for i, role in enumerate(ROLES):
            rows, row_score, col_score, nonfinite = scores[v * len(ROLES) + i]
            if nonfinite:
                raise NonFiniteTensorError(
                    f"the {ROLE_NAMES[role]} of a calibrating layer held NaN or Inf in this step"
                )
            if rows:
                n_cols = buffers[v][2 * i + 1].numel() - 2
                voter.votes.add(role, decide((int(rows), n_cols), row_score, col_score, voter.threshold))
    for voter in voters:
        if voter.after_votes is not None:
            voter.after_votes()


class PatternRecorder:
    """Votes the patterns of one ``nn.Linear``-like module on each training step, as calibration
    does (see the module doc): on a training forward with grad enabled it wires the output so that
    the backward adds X (flattened to [tokens, in]), the weight [out, in] and dY (flattened to
    [tokens, out]) to the step's statistics; at the step boundary (the optimizer that steps the
    module's weight, :func:`end_calibration_step`, or :meth:`end_step`) each gets one vote. Nothing is
    recorded under ``eval()`` or ``no_grad``. ``remove()`` (or leaving the ``with`` block)
    detaches it; a step not yet ended then votes nothing.
    """

    def __init__(self, module: nn.Module, votes: PatternVotes | None = None, threshold: float = DEFAULT_THRESHOLD):
        weight = getattr(module, "weight", None)
        if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            raise TypeError(f"PatternRecorder needs a module with a 2-D .weight, got {type(module).__name__}")
        self.votes = votes if votes is not None else PatternVotes()
        self.threshold = threshold
        self._holder = nn.Module()
        add_step_buffers(self._holder, weight.shape[1], weight.shape[0], weight.device)
        self.voter = open_voter(Voter(module, self._holder, self.votes, threshold))
        self._handle = module.register_forward_hook(self._on_forward)

    def _on_forward(self, module: nn.Module, args: tuple, output):
        if module.training and torch.is_grad_enabled() and isinstance(output, torch.Tensor) and output.requires_grad:
            return observe(output, args[0], module.weight, self._holder)
        return None

    def end_step(self, group=None) -> None:
        """End the step for this recorder alone (a collective under ``torch.distributed``)."""
        close_step([self.voter], group)

    def remove(self) -> None:
        close_voter(self.voter)
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
