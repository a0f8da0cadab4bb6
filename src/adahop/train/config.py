"""``TrainConfig``: every setting of a training run, as nested dataclasses.

A config is built in layers, each overriding the last (as in torchtitan):

1. the defaults below (``adahop train`` with no arguments: ``tiny`` + ``DEFAULT_RECIPE`` on the
   embedded corpus, a few minutes on a 2-core CPU);
2. a TOML file (``--config FILE.toml``), one table per section::

       out = "runs/tiny-lv2"
       recipe = "adahop_lv2"          # or a [recipe] table: name = base recipe, then any field

       [model]
       preset = "tiny"
       [model.overrides]              # any ModelArgs field except vocab_size
       n_layers = 2

       [optim]
       lr = 2e-3

3. command-line overrides ``--section.field=value`` (``--optim.lr=1e-3``,
   ``--model.overrides.dim=64``, ``--recipe.calibration_steps=10``).

The resolved config is saved as ``config.toml`` in the run directory; ``load_config`` reads it
back. Every mistake raises ``ConfigError`` naming the key and the valid choices.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..data import EMBEDDED_SOURCE
from ..models import ModelArgs, get_model_args
from ..policy import ModelPlan
from ..recipes import DEFAULT_RECIPE, Recipe, get_recipe

DEVICES = ("auto", "cpu", "cuda")
RUNS_DIR = "runs"
MAX_SEED = 2**32 - 1  # numpy's generator takes seeds in [0, 2**32)
MAX_RANKS = 2**16  # seeds kept free above a run's seed: rank r seeds with seed + offset + r
MIN_VOCAB_SIZE = 257  # byte-level BPE: 256 byte tokens plus the end-of-document token
MAX_VOCAB_SIZE = 2**20  # 4x the largest vocabularies in use (256k); past it only a typo
TRUE_WORDS, FALSE_WORDS = ("true", "1", "yes", "on"), ("false", "0", "no", "off")


class ConfigError(ValueError):
    """A config key or value that cannot be used; the message lists the valid choices."""


@dataclass
class ModelConfig:
    preset: str = "tiny"
    overrides: dict[str, Any] = field(default_factory=dict)  # ModelArgs fields, e.g. {"n_layers": 2}


@dataclass
class DataConfig:
    source: str = EMBEDDED_SOURCE  # a --data value: "stdlib", a file/dir/glob, or hf:NAME[:CONFIG]
    seq_len: int = 128
    batch_size: int = 4
    vocab_size: int = 8192  # of the BPE tokenizer and the model's embedding
    val_fraction: float = 0.02


@dataclass
class OptimConfig:
    lr: float = 2e-3
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = 0.1  # on matrices only, not on norms
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    grad_clip: float = 1.0  # max global gradient norm; 0 turns clipping off


@dataclass
class TrainingConfig:
    steps: int = 120
    grad_accum: int = 1  # micro-batches per optimizer step
    # With grad_accum > 1, quantize each weight once per optimizer step and reuse it for the step's
    # micro-batches (bit-identical; holds W's operands for the step): eager layers, FSDP2's
    # low-precision gather, compiled blocks (a second graph per block) and CUDA graphs (the
    # accumulating graph reads what the first one wrote).
    weight_operands_once_per_step: bool = True
    seed: int = 0  # model initialisation and data order
    # Added to seed for torch's global generator only, which draws the stochastic-rounding keys:
    # runs that differ in it alone share init and data order and differ only in rounding noise.
    rounding_seed_offset: int = 0
    device: str = "auto"  # "auto": CUDA when available
    autocast: bool = True  # bf16 autocast on CUDA (CPU runs in fp32)
    compile: bool = False  # torch.compile the loss, and each transformer block once calibration has frozen the plans
    compile_backend: str = "inductor"  # a torch.compile backend ("aot_eager" needs no C++ compiler)
    # Compiled blocks (Inductor) make wgrad's operand (Xᵀ quantized, OE-right's BF16 channels, a BF16 X) in
    # backward from an X recomputed element-wise from what the block keeps anyway, instead of keeping it from
    # the forward (adahop.nn.compiling): bit-identical, less activation memory, a little pointwise work in
    # backward. Off by default: it trades a little speed for memory (benchmarks/step/README.md).
    recompute_wgrad_operands: bool = False
    cuda_graph: bool = True  # on CUDA, replay each micro-step as one CUDA graph once the plans are frozen
    distributed: bool = False  # under torchrun with one process, still train through FSDP2 (several always do)
    # FSDP2 gathers each AdaHOPLinear weight as the quantized operands its GEMMs read (each rank
    # quantizes its rows once per gather), where that is bit-identical to gathering W; docs/distributed.md.
    # Opt-in, as torchao's float8 all-gather is: it reaches into FSDP2's internals (tested on torch 2.13,
    # gloo) and has not yet run on the GPU image's torch or on NCCL.
    fsdp_low_precision_all_gather: bool = False
    # A plan.json (an earlier run's, or adahop.model_plan(model).save(path)) that freezes every layer from
    # step 0 instead of calibrating: one plan across runs, seeds and rank counts (GPU runs of one seed can
    # freeze different plans where a layer's patterns sit near a threshold). "" calibrates.
    plan: str = ""
    # PyTorch's deterministic kernels (cuBLAS workspace, cuDNN, torch.use_deterministic_algorithms),
    # as torchtitan's debug.deterministic: two runs of one seed step alike on the GPU, somewhat slower.
    deterministic: bool = False
    # Every N steps after calibration, sample each layer's X/W/dY outlier patterns and log how many
    # drifted from the plan (train.telemetry); 0 turns it off. That step runs eagerly (no graph replay).
    pattern_telemetry_every: int = 500
    # Steps that vote patterns (calibration, pattern telemetry) run uncompiled, at BF16 width during
    # calibration: recompute each block's activations in backward on those steps (activation
    # checkpointing, votes paused), so calibration needs no more memory than a frozen step and a
    # telemetry step little more (after a CUDA-graph capture it allocates beside the graph's pool).
    recompute_pattern_steps: bool = True
    # Seconds a collective waits for a stalled peer before the run stops naming it (joining and the
    # first step wait at least 600 s: compile, tokenizer cache); torch's own default is 30 minutes.
    timeout: float = 600.0
    # On SIGTERM (Slurm, Kubernetes): finish the step, write a checkpoint and exit 143 (train.stopping);
    # false: stop at once, as Ctrl-C. Past sigterm_grace seconds the run exits without that checkpoint.
    sigterm_checkpoint: bool = True
    sigterm_grace: float = 25.0


@dataclass
class CheckpointConfig:
    interval: int = 60  # steps between checkpoints (the last step is always saved)
    keep_last: int = 2


@dataclass
class LoggingConfig:
    log_every: int = 5
    val_every: int = 30  # validation also runs after the last step
    val_batches: int = 8


@dataclass
class TrainConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    recipe: Recipe = field(default_factory=lambda: get_recipe(DEFAULT_RECIPE))
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    out: str = ""  # run directory; "" means runs/<preset>-<recipe>

    @property
    def run_dir(self) -> Path:
        return Path(self.out or f"{RUNS_DIR}/{self.model.preset}-{self.recipe.name}")

    def model_args(self) -> ModelArgs:
        """The model's shape: the preset, its overrides and the tokenizer's vocabulary size."""
        args = get_model_args(self.model.preset)
        return dataclasses.replace(args, **self.model.overrides, vocab_size=self.data.vocab_size)

    def to_dict(self) -> dict[str, Any]:
        d = {"out": str(self.run_dir)}
        for f in dataclasses.fields(self):
            if f.name != "out":
                section = getattr(self, f.name)
                d[f.name] = section.to_dict() if f.name == "recipe" else dataclasses.asdict(section)
        return d

    def to_toml(self) -> str:
        return dump_toml(self.to_dict())

    def validate(self) -> None:
        """Check values that the dataclass types cannot express."""
        for key, value in flatten(self.to_dict()):
            numbers = value if isinstance(value, (list, tuple)) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in numbers):
                raise ConfigError(f"{key} must be a finite number, got {value}")
        try:
            args = self.model_args()  # unknown preset or an inconsistent shape
        except (TypeError, ValueError) as e:
            raise ConfigError(f"model: {e}") from None
        if self.data.seq_len > args.max_seq_len:
            raise ConfigError(
                f"data.seq_len={self.data.seq_len} exceeds the model's max_seq_len={args.max_seq_len}; "
                "lower it or set model.overrides.max_seq_len"
            )
        for key in _POSITIVE:
            if _get(self, key) <= 0:
                raise ConfigError(f"{key} must be positive, got {_get(self, key)}")
        for key in _NON_NEGATIVE:
            if _get(self, key) < 0:
                raise ConfigError(f"{key} must be >= 0, got {_get(self, key)}")
        seeds = self.training.seed + self.training.rounding_seed_offset
        for key in ("training.seed", "training.rounding_seed_offset"):
            if not 0 <= _get(self, key) <= MAX_SEED:
                raise ConfigError(
                    f"{key} must be an integer in [0, {MAX_SEED}] (numpy's seed range), got {_get(self, key)}"
                )
        if seeds + MAX_RANKS > MAX_SEED:
            raise ConfigError(
                f"training.seed + training.rounding_seed_offset = {seeds} leaves no seed for every rank "
                f"(each adds its rank); keep the sum at most {MAX_SEED - MAX_RANKS}"
            )
        if self.data.vocab_size < MIN_VOCAB_SIZE:
            raise ConfigError(f"data.vocab_size must be >= {MIN_VOCAB_SIZE} (bytes + end of document)")
        if self.data.vocab_size > MAX_VOCAB_SIZE:  # the BPE trainer would abort the process allocating for it
            raise ConfigError(f"data.vocab_size must be <= {MAX_VOCAB_SIZE}, got {self.data.vocab_size}")
        if not 0 < self.data.val_fraction < 1:
            raise ConfigError(f"data.val_fraction must be in (0, 1), got {self.data.val_fraction}")
        if not all(0 <= b < 1 for b in self.optim.betas):
            raise ConfigError(f"optim.betas must be in [0, 1), got {self.optim.betas}")
        if not 0 <= self.optim.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio must be in [0, 1], got {self.optim.min_lr_ratio}")
        if self.training.plan and not self.recipe.adaptive:
            raise ConfigError(
                f"training.plan freezes a calibrating recipe's layers; recipe {self.recipe.name} fixes them itself "
                "(drop training.plan, or pick an adahop_* recipe)"
            )
        if self.training.device not in DEVICES:
            raise ConfigError(f"training.device={self.training.device!r} is not one of {', '.join(DEVICES)}")
        if self.training.compile:
            import torch._dynamo

            backends = torch._dynamo.list_backends(exclude_tags=())
            if self.training.compile_backend not in backends:
                raise ConfigError(
                    f"training.compile_backend={self.training.compile_backend!r} is not one of {', '.join(backends)}"
                )
            if self.training.recompute_wgrad_operands and self.training.compile_backend != "inductor":
                raise ConfigError(
                    "training.recompute_wgrad_operands is an Inductor pass: set training.compile_backend=inductor "
                    f"(got {self.training.compile_backend!r}) or turn it off"
                )


_POSITIVE = (
    "data.seq_len",
    "data.batch_size",
    "optim.lr",
    "training.steps",
    "training.grad_accum",
    "checkpoint.interval",
    "checkpoint.keep_last",
    "logging.log_every",
    "logging.val_every",
    "logging.val_batches",
    "training.timeout",
    "training.sigterm_grace",
)
_NON_NEGATIVE = ("optim.weight_decay", "optim.warmup_steps", "optim.grad_clip", "training.pattern_telemetry_every")
_SECTIONS = {f.name for f in dataclasses.fields(TrainConfig)} - {"out", "recipe"}


def _get(cfg: TrainConfig, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


# ---- values: CLI strings and TOML values to typed fields -----------------------------------
def _coerce(value: Any, hint: Any, key: str) -> Any:
    """``value`` (a command-line string or a TOML value) as type ``hint``."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        arms = [a for a in args if a is not type(None)]
        if isinstance(value, str) and value.lstrip().startswith("{"):
            arms = [a for a in arms if a is not str]  # "{...}" is an inline TOML table, not a string
        elif isinstance(value, str) and str in arms:
            return value
        for arm in arms:
            try:
                return _coerce(value, arm, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}: {value!r} is not a {hint}")
    if origin is tuple:
        items = [v.strip() for v in value.split(",")] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)):
            raise ConfigError(f"{key}: expected a list, got {value!r}")
        arms = [args[0]] * len(items) if args[-1] is Ellipsis else list(args)
        if len(arms) != len(items):
            raise ConfigError(f"{key}: expected {len(arms)} values, got {value!r}")
        return tuple(_coerce(v, a, key) for v, a in zip(items, arms))
    if origin is dict:
        if isinstance(value, str):
            value = _parse_toml_value(value, key)
        if not isinstance(value, dict):
            raise ConfigError(f"{key}: expected a table, got {value!r}")
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in TRUE_WORDS + FALSE_WORDS:
            return value.lower() in TRUE_WORDS
        raise ConfigError(f"{key}: expected true or false, got {value!r}")
    if hint in (int, float):
        if isinstance(value, str):
            try:
                return hint(value)
            except ValueError:
                pass
        elif not isinstance(value, bool) and isinstance(value, (int, float)):
            if hint is float or float(value).is_integer():
                return hint(value)
        raise ConfigError(f"{key}: expected {'an integer' if hint is int else 'a number'}, got {value!r}")
    if hint is str:
        if isinstance(value, str):
            return value
        raise ConfigError(f"{key}: expected a string, got {value!r}")
    raise TypeError(f"{key}: unsupported config type {hint}")


def _parse_toml_value(text: str, key: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        raise ConfigError(f"{key}: {text!r} is not a TOML value") from None


def _field_hint(cls: type, name: str, prefix: str) -> Any:
    hints = typing.get_type_hints(cls)
    if name not in hints:
        raise ConfigError(f"unknown key '{prefix}{name}'; valid keys: {', '.join(sorted(hints))}")
    return hints[name]


# ---- overrides -------------------------------------------------------------------------------
def apply_override(cfg: TrainConfig, key: str, value: Any) -> None:
    """Set ``key`` (``out``, ``recipe``, ``section.field`` or ``model.overrides.field``)."""
    section, _, name = key.partition(".")
    if key == "out":
        cfg.out = _coerce(value, str, key)
    elif key in ("recipe", "recipe.name"):  # choose the base recipe; later keys refine it
        try:
            cfg.recipe = get_recipe(_coerce(value, str, key))
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif section == "recipe":
        value = _coerce(value, _field_hint(Recipe, name, "recipe."), key)
        try:
            cfg.recipe = dataclasses.replace(cfg.recipe, **{name: value})
        except ValueError as e:
            raise ConfigError(str(e)) from None
    elif key == "model.overrides":
        for sub, v in _coerce(value, dict[str, Any], key).items():
            apply_override(cfg, f"model.overrides.{sub}", v)
    elif key.startswith("model.overrides."):
        arg = key.removeprefix("model.overrides.")
        if arg == "vocab_size":
            raise ConfigError("set the vocabulary with data.vocab_size (it sizes the tokenizer too)")
        cfg.model.overrides[arg] = _coerce(value, _field_hint(ModelArgs, arg, "model.overrides."), key)
    elif section in _SECTIONS and name:
        obj = getattr(cfg, section)
        setattr(obj, name, _coerce(value, _field_hint(type(obj), name, f"{section}."), key))
    else:
        raise ConfigError(
            f"unknown key {key!r}; valid keys: out, recipe, and section.field for the sections "
            f"{', '.join(sorted(_SECTIONS | {'recipe'}))}"
        )


def _base_first(item: tuple[str, Any]) -> bool:
    return item[0] not in ("recipe", "recipe.name")


def apply_overrides(cfg: TrainConfig, overrides: list[tuple[str, Any]]) -> TrainConfig:
    """Apply ``(key, value)`` pairs in order, except that a recipe's base name goes first."""
    for key, value in sorted(overrides, key=_base_first):
        apply_override(cfg, key, value)
    return cfg


def flatten(doc: dict[str, Any]) -> list[tuple[str, Any]]:
    """A TOML document as ``(section.field, value)`` pairs."""
    pairs = []
    for key, value in doc.items():
        if isinstance(value, dict):
            pairs += [(f"{key}.{k}", v) for k, v in value.items()]
        else:
            pairs.append((key, value))
    return pairs


def read_plan(path: str) -> ModelPlan:
    """``training.plan``'s file, or one line saying why it cannot be used."""
    try:
        return ModelPlan.load(path)
    except OSError as e:
        raise ConfigError(f"training.plan={path}: {e.strerror or e} (give an earlier run's plan.json)") from None
    except ValueError as e:
        raise ConfigError(f"training.plan: {e}") from None


def load_config(path: str | Path | None = None, overrides: list[tuple[str, Any]] = ()) -> TrainConfig:
    """The defaults, updated by the TOML file ``path`` (if any), then by ``overrides``, validated.

    ``load_config(run_dir / "config.toml")`` gives back the exact config of a run.
    """
    cfg = TrainConfig()
    if path is not None:
        try:
            apply_overrides(cfg, flatten(tomllib.loads(Path(path).read_text(encoding="utf-8"))))
        except OSError as e:
            raise ConfigError(f"cannot read config {path}: {e.strerror}") from None
        except UnicodeDecodeError as e:
            raise ConfigError(
                f"{path}: not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start}); "
                "TOML files are UTF-8: save it as UTF-8"
            ) from None
        except (tomllib.TOMLDecodeError, ConfigError) as e:
            raise ConfigError(f"{path}: {e}") from None
    apply_overrides(cfg, list(overrides))
    cfg.validate()
    return cfg


# ---- TOML writing (flat values and nested tables: all a config holds) -----------------------
_BARE_KEY = re.compile(r"^[A-Za-z0-9_-]+$")


def _toml_key(key: str) -> str:
    return key if _BARE_KEY.match(key) else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {value!r} as TOML")


def dump_toml(doc: dict[str, Any], prefix: str = "") -> str:
    """TOML text for a dict of scalars, lists and nested dicts (tables); None values are left out."""
    scalars = [
        f"{_toml_key(k)} = {_toml_value(v)}" for k, v in doc.items() if not isinstance(v, dict) and v is not None
    ]
    lines = [f"[{prefix}]"] if prefix and (scalars or not doc) else []
    lines += scalars
    for key, value in doc.items():
        if isinstance(value, dict):
            table = f"{prefix}.{_toml_key(key)}" if prefix else _toml_key(key)
            lines += ["", dump_toml(value, table).rstrip("\n")]
    return "\n".join(lines).lstrip("\n") + "\n"
