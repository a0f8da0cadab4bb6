"""``AdaHOPLinear``'s ``_extra_state``: its frozen plan and calibration votes as one int64 tensor.

A tensor, not a dict, so every tool that handles a ``state_dict`` keeps it: safetensors and
``save_pretrained`` store only tensors, torchtitan's checkpointer compares ``.shape``/``.dtype``
of every entry, and ``torch.distributed.checkpoint`` loads a tensor in place. The shape never
changes (a fresh layer's tensor has the shape of a calibrated one), which that in-place load needs.

Layout (int64, ``STATE_SIZE`` entries; codes are indices into the tuples below, -1 for none)::

    [version, forward, dgrad, wgrad, pattern x, pattern w, pattern g,
     counts  (role x pattern, 3 x 3),
     last_seen (role x pattern, 3 x 3)]
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from ..policy.calibration import PatternVotes
from ..policy.patterns import PATTERNS
from ..policy.strategies import GEMMS, ROLES, LayerPlan, Strategy

STATE_VERSION = 1
STRATEGY_CODES = ("bf16", "mxfp4", "iht", "oe_left", "oe_right")  # append only: codes are saved
_HEADER = 1 + len(GEMMS) + len(ROLES)
_TABLE = len(ROLES) * len(PATTERNS)
STATE_SIZE = _HEADER + 2 * _TABLE
NONE = -1
_MAX_PLAUSIBLE_VERSION = 255  # a version field past this is damage, not a newer adahop


def new_state() -> torch.Tensor:
    """An all-empty state tensor (always on the CPU: it is metadata, not compute)."""
    return torch.full((STATE_SIZE,), NONE, dtype=torch.int64, device="cpu")


def encode_state(plan: LayerPlan | None, votes: PatternVotes, out: torch.Tensor) -> torch.Tensor:
    """Write ``plan`` and ``votes`` into ``out`` (a ``new_state()`` tensor) in place; returns it."""
    values = [STATE_VERSION]
    if plan is None:
        values += [NONE] * (len(GEMMS) + len(ROLES))
    else:
        values += [STRATEGY_CODES.index(s.value) for s in plan.strategies().values()]
        patterns = plan.patterns
        values += [NONE] * len(ROLES) if patterns is None else [PATTERNS.index(patterns[r]) for r in ROLES]
    votes_state = votes.state_dict()
    for table in ("counts", "last_seen"):
        values += [votes_state[table][r].get(p, 0) for r in ROLES for p in PATTERNS]
    out.copy_(torch.tensor(values, dtype=torch.int64))
    return out


def decode_state(state: torch.Tensor | Mapping[str, Any]) -> tuple[LayerPlan | None, dict]:
    """``(plan, votes state_dict)`` from a state tensor, or from the dict that adahop <= 0.1 saved."""
    if isinstance(state, Mapping):
        if not {"plan", "votes"} <= state.keys():
            raise ValueError(f"corrupt AdaHOPLinear extra state: {state!r}")
        return (None if state["plan"] is None else LayerPlan.from_dict(state["plan"])), state["votes"]
    if not isinstance(state, torch.Tensor) or state.shape != (STATE_SIZE,) or state.dtype != torch.int64:
        raise ValueError(
            f"corrupt AdaHOPLinear extra state: expected an int64 tensor of {STATE_SIZE} entries, got {state!r}"
        )
    values = state.tolist()
    if STATE_VERSION < values[0] <= _MAX_PLAUSIBLE_VERSION:
        raise ValueError(
            f"AdaHOPLinear extra state version {values[0]} was written by a newer adahop (this one reads "
            f"{STATE_VERSION}); upgrade adahop"
        )
    if values[0] != STATE_VERSION:
        raise ValueError(f"corrupt AdaHOPLinear extra state: version field {values[0]}, expected {STATE_VERSION}")
    strategies = [_code(c, STRATEGY_CODES, "strategy") for c in values[1 : 1 + len(GEMMS)]]
    patterns = [_code(c, PATTERNS, "pattern") for c in values[1 + len(GEMMS) : _HEADER]]
    if (NONE in strategies and set(strategies) != {NONE}) or (NONE in patterns and set(patterns) != {NONE}):
        raise ValueError(f"corrupt AdaHOPLinear extra state: a plan with some of its entries unset: {values[:_HEADER]}")
    if any(n < 0 for n in values[_HEADER:]):
        raise ValueError(f"corrupt AdaHOPLinear extra state: negative vote counts: {values[_HEADER:]}")
    plan = None
    if strategies[0] != NONE:
        plan = LayerPlan(
            *(Strategy(STRATEGY_CODES[c]) for c in strategies),
            patterns=None if patterns[0] == NONE else {r: PATTERNS[c] for r, c in zip(ROLES, patterns)},
        )
    tables = {}
    for i, table in enumerate(("counts", "last_seen")):
        flat = values[_HEADER + i * _TABLE : _HEADER + (i + 1) * _TABLE]
        rows = [flat[j * len(PATTERNS) : (j + 1) * len(PATTERNS)] for j in range(len(ROLES))]
        tables[table] = {r: {p: n for p, n in zip(PATTERNS, row) if n} for r, row in zip(ROLES, rows)}
    return plan, tables


def _code(value: int, names: tuple[str, ...], what: str) -> int:
    """``value`` if it is a valid index into ``names`` (or NONE); corrupt otherwise."""
    if value != NONE and not 0 <= value < len(names):
        raise ValueError(f"corrupt AdaHOPLinear extra state: {what} code {value} is not one of 0..{len(names) - 1}")
    return value
