"""``convert_model``: swap a model's ``nn.Linear`` modules for ``AdaHOPLinear`` in place."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from torch import nn

from ..policy.calibration import ModelPlan
from ..recipes import DEFAULT_RECIPE, Recipe, get_recipe, name_matches, split_bf16_gemm
from .linear import AdaHOPLinear

ModuleFilter = Callable[[nn.Module, str], bool]


def convert_model(
    model: nn.Module,
    recipe: str | Recipe | dict = DEFAULT_RECIPE,
    *,
    filter_fn: ModuleFilter | None = None,
    plan: ModelPlan | str | Path | None = None,
) -> nn.Module:
    """Replace every ``nn.Linear`` (except excluded ones) by an ``AdaHOPLinear`` sharing its parameters.

    Args:
        recipe: a registered name (``adahop.RECIPES``; default ``DEFAULT_RECIPE``), a ``Recipe``, a dict
            of recipe fields or a .toml/.json path.
        filter_fn: ``filter_fn(module, fqn) -> bool``; modules it rejects stay ``nn.Linear``.
            Modules matching ``recipe.exclude`` (the LM head by default) always stay; those
            matching ``recipe.bf16_layers`` are converted with all three GEMMs in BF16, and
            ``recipe.bf16_gemms_for(fqn)`` says which GEMMs the others keep in BF16.
        plan: a frozen plan (``ModelPlan`` or its JSON path) to skip calibration.

    Returns the same model object, converted in place; a bare ``nn.Linear`` cannot be replaced in
    place, so for one the new ``AdaHOPLinear`` (sharing its parameters) is returned.
    """
    recipe = get_recipe(recipe)
    if type(model) is nn.Linear:
        return _convert_root(model, recipe, filter_fn, plan)
    targets = [
        (name, module)
        for name, module in model.named_modules()
        if type(module) is nn.Linear
        and not name_matches(name, recipe.exclude)
        and (filter_fn is None or filter_fn(module, name))
    ]
    check_patterns(recipe, [name for name, _ in targets])
    for layer_id, (name, linear) in enumerate(targets):
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        layer = AdaHOPLinear.from_linear(linear, recipe, layer_id, recipe.bf16_gemms_for(name))
        setattr(parent, child, layer)
    if plan is not None:
        load_plan(model, plan)
    return model


def check_patterns(recipe: Recipe, names: list[str]) -> None:
    """A ``bf16_layers`` or ``bf16_gemms`` (ROLE@PATTERN) pattern that matches no converted layer
    is a typo, not an ablation."""
    checks = [(f"bf16_layers pattern {p!r}", p) for p in recipe.bf16_layers]
    checks += [(f"bf16_gemms entry {e!r}", split_bf16_gemm(e)[1]) for e in recipe.bf16_gemms]
    for what, pattern in checks:
        if pattern is not None and not any(name_matches(name, (pattern,)) for name in names):
            raise ValueError(
                f"recipe {recipe.name!r}: {what} matches no converted layer; "
                f"names look like {names[:3]} (fnmatch on the full name or its last part)"
            )


def _convert_root(
    linear: nn.Linear, recipe: Recipe, filter_fn: ModuleFilter | None, plan: ModelPlan | str | Path | None
) -> nn.Module:
    """``convert_model`` of a model that is itself an ``nn.Linear`` (its name is ``""``)."""
    if filter_fn is not None and not filter_fn(linear, ""):
        return linear
    check_patterns(recipe, [""])
    layer = AdaHOPLinear.from_linear(linear, recipe, bf16_gemms=recipe.bf16_gemms_for(""))
    if plan is not None:
        load_plan(layer, plan)
    return layer


def adahop_layers(model: nn.Module) -> dict[str, AdaHOPLinear]:
    return {name: m for name, m in model.named_modules() if isinstance(m, AdaHOPLinear)}


def model_plan(model: nn.Module) -> ModelPlan:
    """The frozen plan of every converted layer (layers still calibrating are left out)."""
    return ModelPlan({name: m.plan for name, m in adahop_layers(model).items() if m.plan is not None})


def load_plan(model: nn.Module, plan: ModelPlan | str | Path) -> None:
    """Freeze layers from a plan (or its JSON file); every converted layer must be covered."""
    if not isinstance(plan, ModelPlan):
        plan = ModelPlan.load(plan)
    layers = adahop_layers(model)
    missing = sorted(set(layers) - set(plan))
    if missing:
        raise ValueError(f"plan has no entry for layers {missing[:5]}{'...' if len(missing) > 5 else ''}")
    for name, layer in layers.items():
        layer.set_plan(plan[name])
