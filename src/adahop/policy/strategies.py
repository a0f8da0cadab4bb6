"""GEMM strategies, the pattern-pair tables that choose them, and a layer's frozen plan.

A linear layer runs three GEMMs, C = A @ B with blocks along the contraction dimension K:

    forward  Y  = X  @ W^T    A = X   [T, in]    B = W^T [in, out]
    dgrad    dX = dY @ W      A = dY  [T, out]   B = W   [out, in]
    wgrad    dW = dY^T @ X    A = dY^T [out, T]  B = X   [T, in]

Patterns are measured in storage layout (X [T, in], W [out, in], dY [T, out]); an operand
used transposed swaps row and col (:func:`opposite`). In GEMM orientation A-col and B-row
outliers lie along K, where a Hadamard transform mixes them (IHT); A-row and B-col outliers
lie along the outer dimensions and are extracted to a BF16 side GEMM (OE-left / OE-right).
"""

from __future__ import annotations

from collections.abc import Mapping
import dataclasses
from dataclasses import dataclass
from enum import Enum
from types import MappingProxyType

from .patterns import PATTERNS, Pattern, check_pattern

GEMMS = ("forward", "dgrad", "wgrad")
ROLES = ("x", "w", "g")  # the layer's tensors whose patterns are measured: X, W, dY
PatternPair = tuple[Pattern, Pattern]
ALL_PAIRS: tuple[PatternPair, ...] = tuple((a, b) for a in PATTERNS for b in PATTERNS)


class Strategy(str, Enum):
    """How one GEMM is computed. Its value is its one spelling everywhere: logs, tables, ``plan.json``
    (``parse`` also reads the paper's "IHT", "OE-left")."""

    BF16 = "bf16"  # the whole GEMM in high precision
    MXFP4 = "mxfp4"  # plain MXFP4, no transform
    IHT = "iht"  # block Hadamard along K on both operands, then MXFP4
    OE_LEFT = "oe_left"  # top-k rows of A in BF16, the rest IHT + MXFP4
    OE_RIGHT = "oe_right"  # top-k columns of B in BF16, the rest IHT + MXFP4

    @classmethod
    def parse(cls, value: str | Strategy) -> Strategy:
        """A strategy from its value, case-insensitive, ``-`` read as ``_`` ("OE-left")."""
        try:
            return cls(value.strip().lower().replace("-", "_") if isinstance(value, str) else value)
        except ValueError:
            raise ValueError(f"unknown strategy {value!r}; valid: {[s.value for s in cls]}") from None


def opposite(pattern: Pattern) -> Pattern:
    """The pattern of the transposed tensor: row <-> col, none stays none."""
    return {"row": "col", "col": "row", "none": "none"}[check_pattern(pattern)]


def gemm_pattern_pairs(px: Pattern, pw: Pattern, pg: Pattern) -> dict[str, PatternPair]:
    """(pattern of A, pattern of B) of each GEMM from the storage-layout patterns of X, W, dY."""
    return {
        "forward": (check_pattern(px), opposite(pw)),
        "dgrad": (check_pattern(pg), check_pattern(pw)),
        "wgrad": (opposite(pg), check_pattern(px)),
    }


def _parse_pair(key: str | tuple[str, str]) -> PatternPair:
    parts = key.split(",") if isinstance(key, str) else key
    if len(parts) != 2:
        raise ValueError(f"bad table key {key!r}: expected 'A,B' such as 'row,none'")
    a, b = (p.strip().lower() for p in parts)
    return check_pattern(a), check_pattern(b)


@dataclass(frozen=True)
class StrategyTable:
    """A complete map (pattern of A, pattern of B) -> Strategy over all 9 pattern pairs."""

    entries: Mapping[PatternPair, Strategy]
    name: str = "custom"

    def __post_init__(self) -> None:
        missing = [f"{a},{b}" for a, b in ALL_PAIRS if (a, b) not in self.entries]
        if missing:
            raise ValueError(f"strategy table {self.name!r} is missing pattern pairs {missing}")
        extra = [key for key in self.entries if key not in ALL_PAIRS]
        if extra:
            raise ValueError(f"strategy table {self.name!r} has unknown pattern pairs {extra}")
        frozen = {pair: Strategy.parse(s) for pair, s in self.entries.items()}
        object.__setattr__(self, "entries", MappingProxyType(frozen))

    @classmethod
    def from_dict(cls, mapping: Mapping, name: str = "custom") -> StrategyTable:
        """From ``{"row,none": "oe_left", ...}`` (TOML/JSON) or ``{("row", "none"): ...}``."""
        return cls({_parse_pair(key): value for key, value in mapping.items()}, name)

    def __getitem__(self, pair: PatternPair) -> Strategy:
        return self.entries[pair]

    def to_dict(self) -> dict[str, str]:
        return {f"{a},{b}": s.value for (a, b), s in self.entries.items()}

    def markdown(self) -> str:
        """The table as the method reference draws it (rows: pattern of A, columns: of B)."""
        columns = ("row", "none", "col")
        lines = ["| A \\ B | " + " | ".join(columns) + " |", "|---" * (len(columns) + 1) + "|"]
        for a in PATTERNS:
            lines.append(f"| {a} | " + " | ".join(self[a, b].value for b in columns) + " |")
        return "\n".join(lines)


_S = Strategy
LEVEL2 = StrategyTable(
    {
        ("row", "row"): _S.IHT, ("row", "none"): _S.OE_LEFT, ("row", "col"): _S.OE_RIGHT,
        ("col", "row"): _S.IHT, ("col", "none"): _S.IHT, ("col", "col"): _S.BF16,
        ("none", "row"): _S.IHT, ("none", "none"): _S.IHT, ("none", "col"): _S.OE_RIGHT,
    },
    name="lv2",
)  # fmt: skip
# Level 1 avoids the BF16 GEMM (and, in wgrad, the BF16 copy of X it needs).
LEVEL1 = StrategyTable({**LEVEL2.entries, ("col", "col"): _S.OE_RIGHT}, name="lv1")
TABLES = {"lv1": LEVEL1, "lv2": LEVEL2}


def get_table(table: str | StrategyTable | Mapping) -> StrategyTable:
    """A table by name (``"lv1"``, ``"lv2"``), as is, or from a user mapping (see ``from_dict``)."""
    if isinstance(table, StrategyTable):
        return table
    if isinstance(table, str):
        if table not in TABLES:
            raise ValueError(f"unknown strategy table {table!r}; valid: {list(TABLES)} or a mapping")
        return TABLES[table]
    if isinstance(table, Mapping):
        return StrategyTable.from_dict(table)
    raise TypeError(f"strategy table must be a name, a StrategyTable or a mapping, got {type(table).__name__}")


# OE-left in wgrad extracts rows of dY^T, whose BF16 side GEMM needs *all* of X in BF16; but
# X is saved for backward only in MXFP4 (that is the memory saving). The official code
# therefore runs IHT there instead.
WGRAD_FALLBACK = {Strategy.OE_LEFT: Strategy.IHT}


@dataclass(frozen=True)
class LayerPlan:
    """The frozen strategy of each GEMM of one linear layer (and the patterns it came from)."""

    forward: Strategy
    dgrad: Strategy
    wgrad: Strategy
    patterns: dict[str, Pattern] | None = None  # {"x": ..., "w": ..., "g": ...}

    def __post_init__(self) -> None:
        for gemm in GEMMS:
            object.__setattr__(self, gemm, Strategy.parse(getattr(self, gemm)))
        if self.wgrad in WGRAD_FALLBACK:
            raise ValueError(
                f"wgrad cannot use {self.wgrad.value}: X is saved only in MXFP4 "
                f"(plan_for_patterns uses {WGRAD_FALLBACK[self.wgrad].value} instead)"
            )
        if self.patterns is not None:
            if set(self.patterns) != set(ROLES):
                raise ValueError(f"plan patterns need exactly the roles {list(ROLES)}, got {sorted(self.patterns)}")
            object.__setattr__(self, "patterns", {r: check_pattern(self.patterns[r]) for r in ROLES})

    @classmethod
    def uniform(cls, strategy: str | Strategy) -> LayerPlan:
        """The same strategy on all three GEMMs (the fixed recipes: bf16, mxfp4, iht)."""
        return cls(strategy, strategy, strategy)

    def strategies(self) -> dict[str, Strategy]:
        return {gemm: getattr(self, gemm) for gemm in GEMMS}

    def with_bf16(self, gemms: tuple[str, ...]) -> LayerPlan:
        """This plan with the GEMMs ``gemms`` (names from ``GEMMS``) in BF16; patterns kept."""
        return dataclasses.replace(self, **{gemm: Strategy.BF16 for gemm in gemms})

    @property
    def all_bf16(self) -> bool:
        """Every GEMM in BF16: the layer is plain ``nn.Linear``."""
        return self.forward is self.dgrad is self.wgrad is Strategy.BF16

    def to_dict(self) -> dict:
        out: dict = {gemm: s.value for gemm, s in self.strategies().items()}
        if self.patterns is not None:
            out["patterns"] = dict(self.patterns)
        return out

    @classmethod
    def from_dict(cls, d: Mapping) -> LayerPlan:
        unknown = set(d) - {*GEMMS, "patterns"}
        missing = set(GEMMS) - set(d)
        if unknown or missing:
            raise ValueError(
                f"layer plan needs keys {list(GEMMS)} (+ optional 'patterns'); "
                f"missing {sorted(missing)}, unknown {sorted(unknown)}"
            )
        return cls(**{gemm: d[gemm] for gemm in GEMMS}, patterns=d.get("patterns"))


DEFAULT_TABLE = "lv2"  # where a table can be left out here and in a bare Recipe(); recipes.DEFAULT_RECIPE names lv1


def plan_for_patterns(
    px: Pattern, pw: Pattern, pg: Pattern, table: str | StrategyTable | Mapping = DEFAULT_TABLE
) -> LayerPlan:
    """Look up each GEMM's pattern pair in ``table``; wgrad OE-left falls back to IHT."""
    table = get_table(table)
    chosen = {gemm: table[pair] for gemm, pair in gemm_pattern_pairs(px, pw, pg).items()}
    chosen["wgrad"] = WGRAD_FALLBACK.get(chosen["wgrad"], chosen["wgrad"])
    return LayerPlan(**chosen, patterns={"x": px, "w": pw, "g": pg})
