"""Recipes: one dataclass holding every knob of a low-precision training run, registered by name.

| recipe           | what every converted linear layer does                                   |
|------------------|--------------------------------------------------------------------------|
| `bf16`           | all three GEMMs in high precision (the baseline)                         |
| `mxfp4`          | naive MXFP4 on all three GEMMs, no transform                             |
| `mxfp4_hadamard` | uniform inner Hadamard (IHT) + MXFP4 on all three GEMMs                  |
| `adahop_lv1`     | calibrate outlier patterns, then per-GEMM strategies from the level-1 table |
| `adahop_lv2`     | same with the level-2 table (col-col GEMMs in BF16)                      |
| `adahop_lv1_bf16_forward` | `adahop_lv1` with every forward GEMM in BF16: BF16's loss (docs/quality.md); the default |
| `adahop_lv1_fp8_forward` | `adahop_lv1` with every forward GEMM in E4M3, a scale per token and per output channel |
| `torchao_float8_tensorwise`, `torchao_float8_rowwise` | the peer: torchao's float8 training (needs torchao) |

Ablations on top of any recipe: ``bf16_gemms`` keeps those GEMM roles ("forward", "dgrad",
"wgrad") in BF16 in every converted layer, or with ``ROLE@PATTERN`` entries (e.g.
``"forward@*.feed_forward.*"``) only in the layers whose module name matches the fnmatch pattern;
``bf16_layers`` (fnmatch patterns on module names) keeps all three GEMMs of the matching layers in
BF16; both override the frozen plan.

Knobs an independent port found to matter, each off by default: ``hadamard_signs`` (random-sign
Hadamard), ``backward_rounding="stochastic"`` (stochastic rounding on every backward operand, not
only dY) and ``weight_blocks="2d"`` (W quantized once in square tiles, so the forward and dgrad
see the same quantized weight).
"""

from __future__ import annotations

import dataclasses
import json
import tomllib
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

import torch

from .formats import DEFAULT_SPEC, ELEMENT_FORMATS, ROUNDING_MODES, SCALE_RULES, QuantSpec
from .formats.rowwise import ROWWISE_FP8
from .policy.strategies import DEFAULT_TABLE, GEMMS, Strategy, get_table
from .transforms import HADAMARD_BLOCK_SIZES

ADAPTIVE = "adaptive"
FLOAT8_SCALINGS = ("tensorwise", "rowwise")  # torchao's float8 recipes a peer recipe can name
FORWARD_GEMMS = (
    "fastest",
    "reference",
)  # the forward GEMM's route: the device's fastest faithful one, or the reference
WEIGHT_BLOCKS = ("1d", "2d")  # MX blocks of W: along each GEMM's K, or square tiles valid in both orientations
# The forward's formats: the MX formats, and E4M3 with a power-of-two scale per row (formats.rowwise)
FORWARD_FORMATS = (*ELEMENT_FORMATS, ROWWISE_FP8)


def name_matches(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether a module name (or its last component) matches one of the fnmatch ``patterns``."""
    leaf = name.rsplit(".", 1)[-1]
    return any(fnmatch(name, p) or fnmatch(leaf, p) for p in patterns)


def split_bf16_gemm(entry: str) -> tuple[str, str | None]:
    """A ``bf16_gemms`` entry as (role, pattern): ``"forward"`` -> ("forward", None), every layer;
    ``"forward@*.w2"`` -> ("forward", "*.w2"), the layers whose name matches (``name_matches``)."""
    role, at, pattern = entry.partition("@")
    return role, pattern if at else None


@dataclass(frozen=True)
class Recipe:
    """Every knob of AdaHOP's numerics. ``strategy`` is "adaptive" or one Strategy for all GEMMs.

    Frozen: the layers of a model share one instance; derive variants with ``dataclasses.replace``.
    The quantization knobs default to ``formats.DEFAULT_SPEC``'s.
    """

    name: str = "adahop_lv2"
    strategy: str = ADAPTIVE
    table: str | dict[str, str] = DEFAULT_TABLE  # a table name or a user mapping {"row,none": "oe_left", ...}
    fmt: str = DEFAULT_SPEC.fmt
    # The forward GEMM's element format (X and W as the forward reads them); None: ``fmt``. An 8-bit
    # forward ("mxfp8_e4m3") asks whether the quality study's forward gap is the 4-bit grid itself;
    # "fp8_e4m3_rowwise" (a scale per token of X and per output channel of W) runs Hopper's
    # row-wise scaled FP8 GEMM with a quantizer much cheaper than MXFP4's.
    forward_fmt: str | None = None
    # The forward GEMM's strategy in every layer whatever the plan says; None: the plan's. "mxfp4"
    # is the plain quantizer in forward_fmt (no Hadamard, no extraction); "iht" adds the Hadamard.
    forward_strategy: str | None = None
    block_size: int = DEFAULT_SPEC.block_size
    scale_rule: str = DEFAULT_SPEC.scale_rule  # E8M0 scale of every MX block: floor (OCP) | ceil | even | rceil
    rounding: str = DEFAULT_SPEC.rounding  # X and W as the forward GEMM reads them
    backward_rounding: str = "nearest"  # the copies of X and W quantized for wgrad (Xᵀ) and dgrad (Wᵀ)
    grad_rounding: str = "stochastic"  # output gradients dY
    weight_blocks: str = "1d"  # "2d": W in block_size x block_size tiles, shared by forward and dgrad
    # The dgrad and wgrad FP8 GEMMs (CUDA's fold_fp8 route) accumulate in the tensor core's reduced
    # precision; False promotes to FP32 as TransformerEngine and torchao do for gradient GEMMs.
    grad_fast_accum: bool = True
    # "reference": the forward GEMM as float32 products of the dequantized operands on every device
    # (no fold into E4M3, so no 14-binade window, and no fast accumulation); a quality probe, slow on CUDA.
    forward_gemm: str = "fastest"
    hadamard_block_size: int = DEFAULT_SPEC.hadamard_block_size  # of the strategies that rotate (IHT, OE)
    hadamard_signs: bool = False  # seeded random-sign Hadamard variant
    hadamard_seed: int = 0
    oe_k: int = 64  # rows/columns moved to the BF16 path by outlier extraction
    calibration_steps: int = 30
    pattern_threshold: float = 2.0
    exclude: tuple[str, ...] = ("output", "lm_head")  # module names kept as nn.Linear (fnmatch)
    bf16_gemms: tuple[str, ...] = ()  # GEMM roles kept in BF16 in every layer, or ROLE@PATTERN (ablation)
    bf16_layers: tuple[str, ...] = ()  # module names (fnmatch) whose three GEMMs stay in BF16
    # A peer, not AdaHOP: every linear layer but ``exclude`` trained by torchao's float8 of this
    # scaling ("tensorwise" | "rowwise"; adahop.integrations.float8); needs strategy="bf16".
    torchao_float8: str | None = None
    # The forward GEMM of every layer in BF16 for the last steps of training, from step
    # int(bf16_forward_after * training.steps) on (NVIDIA's NVFP4 recipe, appendix D); None: never.
    bf16_forward_after: float | None = None
    # TetraJet-v2's OsciReset (adahop.nn.oscillation): after each optimizer step, weights whose
    # forward-quantized value reverses direction more often than this rate (an EMA, per step) are
    # reset to the centre of their quantization bin; None: off.
    osci_reset: float | None = None

    def __post_init__(self) -> None:
        for knob in ("exclude", "bf16_gemms", "bf16_layers"):
            value = getattr(self, knob)
            object.__setattr__(self, knob, (value,) if isinstance(value, str) else tuple(value))
        self.validate()

    @property
    def adaptive(self) -> bool:
        return self.strategy == ADAPTIVE

    def validate(self) -> None:
        def check(value: Any, choices: tuple, what: str) -> None:
            if value not in choices:
                raise ValueError(f"recipe {self.name!r}: {what}={value!r} is not one of {choices}")

        fixed = tuple(s.value for s in Strategy if s not in (Strategy.OE_LEFT, Strategy.OE_RIGHT))
        check(self.strategy, (ADAPTIVE, *fixed), "strategy")
        registered = globals().get("RECIPES", {}).get(self.name)  # None while RECIPES itself is built
        if registered is not None and registered.strategy != self.strategy:
            raise ValueError(
                f"recipe {self.name!r}: strategy={self.strategy!r}, but the registered {self.name!r} has "
                f"strategy={registered.strategy!r}; Recipe(name=...) starts from the field defaults: use "
                f"get_recipe({{'name': {self.name!r}, ...}}) to start from {self.name!r}, or give the recipe its own name"
            )
        check(self.fmt, tuple(ELEMENT_FORMATS), "fmt")
        check(self.forward_fmt, (None, *FORWARD_FORMATS), "forward_fmt")
        check(self.forward_strategy, (None, *(s.value for s in Strategy)), "forward_strategy")
        if self.forward_fmt == ROWWISE_FP8 and self.rounding != "nearest":
            raise ValueError(
                f"recipe {self.name!r}: forward_fmt={ROWWISE_FP8!r} rounds to nearest; set rounding='nearest' "
                f"(got {self.rounding!r})"
            )
        check(self.scale_rule, SCALE_RULES, "scale_rule")
        check(self.rounding, ROUNDING_MODES, "rounding")
        check(self.backward_rounding, ROUNDING_MODES, "backward_rounding")
        check(self.grad_rounding, ROUNDING_MODES, "grad_rounding")
        check(self.weight_blocks, WEIGHT_BLOCKS, "weight_blocks")
        check(self.forward_gemm, FORWARD_GEMMS, "forward_gemm")
        check(self.torchao_float8, (None, *FLOAT8_SCALINGS), "torchao_float8")
        rate = self.osci_reset
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < 1):
            raise ValueError(
                f"recipe {self.name!r}: osci_reset={rate!r} must be a reversal rate per step in (0, 1), or unset"
            )
        after = self.bf16_forward_after
        if after is not None and (
            isinstance(after, bool) or not isinstance(after, (int, float)) or not 0 <= after <= 1
        ):
            raise ValueError(
                f"recipe {self.name!r}: bf16_forward_after={after!r} must be a fraction of the training steps "
                "in [0, 1], or unset"
            )
        if self.torchao_float8 and self.strategy != Strategy.BF16.value:
            raise ValueError(
                f"recipe {self.name!r}: torchao_float8={self.torchao_float8!r} replaces AdaHOP's layers with torchao's, "
                f"so it needs strategy='bf16', got {self.strategy!r}"
            )
        if not isinstance(self.grad_fast_accum, bool):
            raise ValueError(f"recipe {self.name!r}: grad_fast_accum={self.grad_fast_accum!r} is not true or false")
        if self.weight_blocks == "2d" and self.forward_fmt not in (None, self.fmt):
            raise ValueError(
                f"recipe {self.name!r}: weight_blocks='2d' shares one quantized W between the forward and dgrad, "
                f"so forward_fmt={self.forward_fmt!r} must be unset or equal fmt={self.fmt!r}"
            )
        if self.weight_blocks == "2d" and self.strategy != Strategy.MXFP4.value:
            raise ValueError(
                f"recipe {self.name!r}: weight_blocks='2d' needs strategy='mxfp4', got {self.strategy!r}: "
                "IHT and OE rotate W along K (in for the forward, out for dgrad), so the two GEMMs cannot share one quantized W"
            )
        check(self.hadamard_block_size, HADAMARD_BLOCK_SIZES, "hadamard_block_size")
        if self.block_size <= 0 or self.block_size % 2:
            raise ValueError(f"recipe {self.name!r}: block_size must be a positive even number")
        for knob in ("oe_k", "calibration_steps"):
            if getattr(self, knob) < 1:
                raise ValueError(f"recipe {self.name!r}: {knob} must be >= 1")
        if self.pattern_threshold <= 1.0:
            raise ValueError(f"recipe {self.name!r}: pattern_threshold must be > 1")
        for entry in self.bf16_gemms:
            self._check_bf16_gemm(entry)
        if self.adaptive:
            get_table(self.table)  # raises with the valid choices

    def _check_bf16_gemm(self, entry: Any) -> None:
        form = "entries are ROLE or ROLE@PATTERN (fnmatch on module names, e.g. 'forward@*.feed_forward.*')"
        role, pattern = split_bf16_gemm(entry) if isinstance(entry, str) else (entry, None)
        where = f"recipe {self.name!r}: bf16_gemms entry={entry!r}"
        if role not in GEMMS:
            what = f"{where}: role {role!r}" if pattern is not None else where
            raise ValueError(f"{what} is not one of {GEMMS}; {form}")
        if pattern == "":
            raise ValueError(f"{where} has an empty pattern; {form}")

    def quant_spec(self, rounding: str, signs: torch.Tensor | None = None, *, forward: bool = False) -> QuantSpec:
        """The spec of one tensor under this recipe, rounded by ``rounding`` (the recipe has three:
        ``rounding``, ``grad_rounding``, ``backward_rounding``); ``signs``: the random-sign vector
        when ``hadamard_signs`` is on; ``forward``: an operand of the forward GEMM (``forward_fmt``)."""
        fmt = (self.forward_fmt or self.fmt) if forward else self.fmt
        return QuantSpec(fmt, self.block_size, self.scale_rule, rounding, self.hadamard_block_size, signs)

    def bf16_gemms_for(self, name: str) -> tuple[str, ...]:
        """The GEMM roles (in ``GEMMS`` order) that module ``name`` keeps in BF16 whatever its plan
        says: all three if it matches ``bf16_layers``, else those of the ``bf16_gemms`` entries
        without a pattern or whose pattern it matches."""
        if name_matches(name, self.bf16_layers):
            return GEMMS
        kept = set()
        for entry in self.bf16_gemms:
            role, pattern = split_bf16_gemm(entry)
            if pattern is None or name_matches(name, (pattern,)):
                kept.add(role)
        return tuple(gemm for gemm in GEMMS if gemm in kept)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for knob in ("exclude", "bf16_gemms", "bf16_layers"):
            d[knob] = list(getattr(self, knob))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Recipe:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown recipe fields {unknown}; valid fields: {sorted(known)}")
        # The base: the registered recipe named, the default when none is named, else the field defaults.
        base = RECIPES.get(d.get("name", DEFAULT_RECIPE), cls())
        return dataclasses.replace(base, **d)

    @classmethod
    def from_file(cls, path: str | Path) -> Recipe:
        """Load from ``.toml`` (a ``[recipe]`` table or top-level keys) or ``.json``."""
        path = Path(path)
        if path.suffix == ".toml":
            d = tomllib.loads(path.read_text())
            d = d.get("recipe", d)
        elif path.suffix == ".json":
            d = json.loads(path.read_text())
        else:
            raise ValueError(f"recipe files must be .toml or .json, got {path}")
        return cls.from_dict(d)


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe(name="bf16", strategy=Strategy.BF16.value),
        Recipe(name="mxfp4", strategy=Strategy.MXFP4.value),
        Recipe(name="mxfp4_hadamard", strategy=Strategy.IHT.value),
        Recipe(name="adahop_lv1", table="lv1"),
        Recipe(name="adahop_lv2", table="lv2"),
        # The quality study found the whole gap to BF16 in the forward GEMM (docs/quality.md, phase 4).
        Recipe(name="adahop_lv1_bf16_forward", table="lv1", bf16_gemms=("forward",)),
        # The same split with the forward in row-wise scaled FP8 (per token, per output channel),
        # which runs on Hopper's FP8 tensor cores at about twice BF16's GEMM rate (issue 31).
        Recipe(
            name="adahop_lv1_fp8_forward", table="lv1", forward_fmt=ROWWISE_FP8, forward_strategy=Strategy.MXFP4.value
        ),
        # The peer: torchao's float8 training (needs torchao; adahop.integrations.float8).
        *(
            Recipe(name=f"torchao_float8_{scaling}", strategy=Strategy.BF16.value, torchao_float8=scaling)
            for scaling in FLOAT8_SCALINGS
        ),
    )
}

# What a layer, a model or a run gets when no recipe is named: the recipe that trains at BF16's loss
# (docs/quality.md, phases 4-5). ``adahop_lv2`` is the fastest step (benchmarks/step/); the paper's two tables
# stay registered as ``adahop_lv1`` and ``adahop_lv2``.
DEFAULT_RECIPE = "adahop_lv1_bf16_forward"


def get_recipe(recipe: str | Recipe | dict[str, Any] | Path) -> Recipe:
    """A Recipe from a registered name, a dict of fields, a .toml/.json path, or a Recipe."""
    if isinstance(recipe, Recipe):
        return recipe
    if isinstance(recipe, dict):
        return Recipe.from_dict(recipe)
    if isinstance(recipe, Path) or str(recipe).endswith((".toml", ".json")):
        return Recipe.from_file(recipe)
    if recipe not in RECIPES:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {sorted(RECIPES)}")
    return RECIPES[recipe]  # frozen: shared, never copied
