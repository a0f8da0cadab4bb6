"""``convert_model``: swap a model's ``nn.Linear`` modules for ``AdaHOPLinear`` in place."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

from torch import nn

from ..policy.calibration import ModelPlan
from ..recipes import DEFAULT_RECIPE, Recipe, get_recipe, name_matches, split_bf16_gemm
from .linear import AdaHOPLinear

ModuleFilter = Callable[[nn.Module, str], bool]


def conversion_verdict(
    name: str,
    in_features: int,
    out_features: int,
    recipe: Recipe,
    exclude: tuple[str, ...] | list[str] = (),
    min_features: int = 0,
    subclass: str | None = None,
) -> str | None:
    """The one rule of which linear layers become ``AdaHOPLinear``, for ``convert_model`` and both
    torchtitan converters. A layer is converted unless

    - its name matches ``recipe.exclude`` (the LM head: ``output``, ``lm_head``) or ``exclude``
      (fnmatch on the full name or its last part). The LM head is known **by name only**: a model that
      names it otherwise (the last ``nn.Linear`` of an ``nn.Sequential`` is ``"2"``) names it in ``exclude``;
    - it is smaller than ``min_features`` on either side (default 0: none; torchtitan's default is 256);
    - it is a subclass of ``nn.Linear`` (``subclass``: its class name): its forward is its own;
    - ``in_features`` or ``out_features`` is not a multiple of ``recipe.block_size``: every GEMM of the
      layer has one of them as its K, and the MX kernels need whole blocks.

    Returns None to convert, ``""`` to keep the layer as asked (the first two), or why a layer that
    looks convertible is kept (the last two), which the caller reports (``warn_kept``).
    """
    if name_matches(name, (*recipe.exclude, *exclude)) or min(in_features, out_features) < min_features:
        return ""
    if subclass is not None:
        return f"{subclass}, a subclass of Linear with its own forward"
    block = recipe.block_size
    if in_features % block or out_features % block:
        return f"{in_features}->{out_features}, not whole MX blocks of {block}"
    return None


def warn_kept(kept: dict[str, str], what: str = "convert_model") -> None:
    """One warning line naming the layers ``conversion_verdict`` kept for a reason."""
    if kept:
        listed = "; ".join(f"{name or '<root>'} ({why})" for name, why in list(kept.items())[:5])
        more = f"; and {len(kept) - 5} more" if len(kept) > 5 else ""
        warnings.warn(
            f"{what} left {len(kept)} linear layers unconverted: {listed}{more} "
            "(name them in exclude= to keep them quietly)",
            stacklevel=3,
        )


def convert_model(
    model: nn.Module,
    recipe: str | Recipe | dict = DEFAULT_RECIPE,
    *,
    filter_fn: ModuleFilter | None = None,
    plan: ModelPlan | str | Path | None = None,
    exclude: tuple[str, ...] | list[str] = (),
    min_features: int = 0,
) -> nn.Module:
    """Replace the ``nn.Linear`` modules that ``conversion_verdict`` accepts by ``AdaHOPLinear``
    modules sharing their parameters; warn in one line about those it keeps for a reason.

    Args:
        recipe: a registered name (``adahop.RECIPES``; default ``DEFAULT_RECIPE``), a ``Recipe``, a dict
            of recipe fields or a .toml/.json path.
        filter_fn: ``filter_fn(module, fqn) -> bool``; modules it rejects stay ``nn.Linear``.
            Modules matching ``recipe.bf16_layers`` are converted with all three GEMMs in BF16, and
            ``recipe.bf16_gemms_for(fqn)`` says which GEMMs the others keep in BF16.
        plan: a frozen plan (``ModelPlan`` or its JSON path) to skip calibration.
        exclude, min_features: see ``conversion_verdict``.

    Returns the same model object, converted in place; a bare ``nn.Linear`` cannot be replaced in
    place, so for one the new ``AdaHOPLinear`` (sharing its parameters) is returned.
    """
    recipe = get_recipe(recipe)
    if recipe.torchao_float8:
        raise ValueError(
            f"recipe {recipe.name!r} is torchao's float8, not AdaHOP's: convert with "
            "adahop.integrations.float8.convert_to_float8(model, recipe, device)"
        )
    root = isinstance(model, nn.Linear)
    candidates = [("", model)] if root else list(model.named_modules())
    targets, kept, converted = [], {}, []
    for name, module in candidates:
        if isinstance(module, AdaHOPLinear):
            converted.append((name, module))
            continue
        if not isinstance(module, nn.Linear) or (filter_fn is not None and not filter_fn(module, name)):
            continue
        subclass = None if type(module) is nn.Linear else type(module).__name__
        verdict = conversion_verdict(
            name, module.in_features, module.out_features, recipe, exclude, min_features, subclass
        )
        if verdict is None:
            targets.append((name, module))
        elif verdict:
            kept[name] = verdict
    others = sorted({m.recipe.name for _, m in converted if m.recipe != recipe})
    if others:
        raise ValueError(
            f"the model is already converted with recipe {others[0]!r} ({len(converted)} layers, e.g. "
            f"{converted[0][0] or '<root>'}); convert_model with {recipe.name!r} would not change them: "
            "convert the unconverted model instead"
        )
    warn_kept(kept)
    if not any(isinstance(m, nn.Linear) for _, m in candidates):
        warnings.warn(f"convert_model converted nothing: {type(model).__name__} has no nn.Linear", stacklevel=2)
    linears = [name for name, m in candidates if isinstance(m, nn.Linear)]
    check_patterns(recipe, [name for name, _ in converted + targets], exclude, linears)
    for layer_id, (name, linear) in enumerate(targets, start=len(converted)):
        layer = AdaHOPLinear.from_linear(linear, recipe, layer_id, recipe.bf16_gemms_for(name))
        if root:
            model = layer
        else:
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name) if parent_name else model, child, layer)
    if plan is not None:
        load_plan(model, plan)
    return model


def check_patterns(
    recipe: Recipe, names: list[str], exclude: tuple[str, ...] | list[str] = (), linears: list[str] = ()
) -> None:
    """A ``bf16_layers`` or ``bf16_gemms`` (ROLE@PATTERN) pattern that matches no converted layer
    (``names``), or an ``exclude`` pattern that matches no linear layer (``linears``), is a typo, not
    an ablation: the layer it meant would silently be converted."""
    checks = [(f"recipe {recipe.name!r}: bf16_layers pattern {p!r}", p, names) for p in recipe.bf16_layers]
    checks += [
        (f"recipe {recipe.name!r}: bf16_gemms entry {e!r}", split_bf16_gemm(e)[1], names) for e in recipe.bf16_gemms
    ]
    checks += [(f"exclude pattern {p!r}", p, list(linears)) for p in exclude]
    for what, pattern, pool in checks:
        if pattern is not None and not any(name_matches(name, (pattern,)) for name in pool):
            kind = "linear" if pool is not names else "converted"
            raise ValueError(
                f"{what} matches no {kind} layer; names look like {pool[:3]} (fnmatch on the full name or its last part)"
            )


# Names that wrappers insert between a model's modules (activation checkpointing, torch.compile):
# a plan names the layers of the model as built, so it loads whatever wraps them now.
WRAPPER_PREFIXES = ("_checkpoint_wrapped_module.", "_orig_mod.")


def adahop_layers(model: nn.Module) -> dict[str, AdaHOPLinear]:
    """Every converted layer by its module name, without the wrappers' ``WRAPPER_PREFIXES``."""
    layers = {}
    for name, module in model.named_modules():
        if isinstance(module, AdaHOPLinear):
            for prefix in WRAPPER_PREFIXES:
                name = name.replace(prefix, "")
            layers[name] = module
    return layers


def set_bf16_forward(model: nn.Module, on: bool = True) -> None:
    """Run the forward GEMM of every converted layer in BF16 (``on``) or by its plan again; the late
    switch of ``recipe.bf16_forward_after``. Compiled modules recompile (their guards read the flag)."""
    for layer in adahop_layers(model).values():
        layer.bf16_forward = on


def model_plan(model: nn.Module) -> ModelPlan:
    """The frozen plan of every converted layer (layers still calibrating are left out)."""
    return ModelPlan({name: m.plan for name, m in adahop_layers(model).items() if m.plan is not None})


def load_plan(model: nn.Module, plan: ModelPlan | str | Path, *, strict: bool = True) -> None:
    """Freeze layers from a plan (or its JSON file). Every converted layer must be covered, and
    (``strict``) every entry of the plan must name one: a plan of another model is an error, not a
    partial match (``strict=False`` for one part of a model, such as a pipeline stage). Each entry must
    be one the layer's recipe runs (``AdaHOPLinear.check_plan``)."""
    if not isinstance(plan, ModelPlan):
        plan = ModelPlan.load(plan)
    layers = adahop_layers(model)
    missing = sorted(set(layers) - set(plan))
    if missing:
        raise ValueError(
            f"plan has no entry for layers {_some(missing)}; the model's look like {_some(sorted(layers))}"
        )
    extra = sorted(set(plan) - set(layers))
    if strict and extra:
        raise ValueError(
            f"plan has entries for layers this model does not convert: {_some(extra)} "
            "(load_plan(..., strict=False) to load part of a plan)"
        )
    for name, layer in layers.items():
        try:
            layer.check_plan(plan[name])
        except ValueError as e:
            raise ValueError(f"plan entry {name!r}: {e}") from None
    for name, layer in layers.items():
        layer.set_plan(plan[name])


def _some(names: list[str]) -> str:
    return f"{names[:5]}{'...' if len(names) > 5 else ''}"
