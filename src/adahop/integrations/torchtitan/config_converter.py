"""torchtitan >= 0.3: a ``QuantizationConverter`` that rewrites the model config tree.

torchtitan builds the model from its config on the meta device, then ``to_empty`` and
``init_states``; this converter swaps each chosen ``Linear.Config`` for an
``AdaHOPTitanLinear.Config`` before that, so the layers are built as ``AdaHOPLinear`` directly.

How it composes with the rest of torchtitan's stack:

- activation checkpointing (``--activation_checkpoint.mode`` selective or full): calibration votes
  in backward, once per step, and freezes before ``optimizer.step()``, never inside a recompute;
- ``torch.compile`` (``compile.enable`` with ``"model"`` in ``compile.components``:
  ``model_compile_enabled``): each block compiles ``fullgraph=True`` from step 0 while it
  calibrates, and once more when its layers freeze; blocks whose layers froze other plans are other
  graphs, so the converter raises dynamo's recompile limit to one graph per block, plus the
  calibrating one (``adahop.nn.compiling``);
- ``plan``: a frozen plan file skips calibration (every layer is built frozen).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.module import Module

from ...nn.compiling import reserve_compiled_graphs
from ...nn.convert import check_patterns, conversion_verdict, warn_kept
from ...nn.linear import AdaHOPLinear
from ...policy import LayerPlan, ModelPlan
from ...recipes import DEFAULT_RECIPE, get_recipe
from .filter import DEFAULT_MIN_FEATURES


class AdaHOPTitanLinear(AdaHOPLinear, Module):
    """``AdaHOPLinear`` satisfying torchtitan's ``Module`` protocol (built from its ``Config``)."""

    @dataclass(kw_only=True, slots=True)
    class Config(Linear.Config):
        recipe: str = DEFAULT_RECIPE
        """A registered adahop recipe name or a .toml/.json recipe file."""
        layer_id: int = 0
        bf16_gemms: tuple[str, ...] | None = None
        """The GEMMs this layer keeps in BF16 (``recipe.bf16_gemms_for`` of its module name)."""
        plan: dict[str, Any] | None = None
        """A frozen plan (``LayerPlan.to_dict()``): the layer is built frozen and does not calibrate."""

    def __init__(self, config: Config) -> None:
        AdaHOPLinear.__init__(
            self,
            config.in_features,
            config.out_features,
            config.bias,
            recipe=config.recipe,
            layer_id=config.layer_id,
            bf16_gemms=config.bf16_gemms,
        )
        if config.plan is not None:
            self.set_plan(LayerPlan.from_dict(config.plan))


class AdaHOPConverter(QuantizationConverter):
    """Swap torchtitan's ``Linear`` layers for ``AdaHOPLinear`` (``nn.convert.conversion_verdict``).

    Calibration needs no trainer hook: each layer measures its outlier patterns in backward
    during the first ``recipe.calibration_steps`` training steps, votes once per step (statistics
    merged over ranks) from the optimizer's pre-step hook, then freezes its plan, which
    torchtitan's checkpoints keep (the layer's ``_extra_state``) and restore on resume. The votes
    are the same on every rank, so the one copy DCP saves of the unsharded state tensor resumes
    every rank. See the module doc for activation checkpointing, compile and ``plan``.
    """

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str = DEFAULT_RECIPE
        """A registered adahop recipe name or a .toml/.json recipe file."""
        exclude: list[str] = field(default_factory=list)
        """fnmatch patterns of module names kept as ``Linear``, on top of ``recipe.exclude``."""
        min_features: int = DEFAULT_MIN_FEATURES
        """Layers with fewer input or output features stay ``Linear``."""
        plan: str = ""
        """A frozen plan to skip calibration: a JSON file from ``adahop.model_plan(model).save(path)``
        of a model converted the same way (every converted layer needs an entry)."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.recipe = get_recipe(config.recipe)  # a bad name fails here, before the model is built
        self.plan = ModelPlan.load(config.plan) if config.plan else None

    def convert(self, model_config: Module.Config) -> Module.Config:
        c = self.config
        converted: list[str] = []
        kept: dict[str, str] = {}
        linears: list[str] = []
        for fqn, linear, parent, attr in model_config.traverse(Linear.Config):
            linears.append(fqn)
            subclass = None if type(linear) is Linear.Config else type(linear).__qualname__
            verdict = conversion_verdict(
                fqn, linear.in_features, linear.out_features, self.recipe, c.exclude, c.min_features, subclass
            )
            if verdict is not None:
                if verdict:
                    kept[fqn] = verdict
                continue
            new = AdaHOPTitanLinear.Config(
                **{f.name: getattr(linear, f.name) for f in fields(linear)},
                recipe=c.recipe,
                layer_id=len(converted),
                bf16_gemms=self.recipe.bf16_gemms_for(fqn),
                plan=self.plan[fqn].to_dict() if self.plan is not None and fqn in self.plan else None,
            )
            converted.append(fqn)
            if parent is None:
                model_config = new
            elif isinstance(parent, list):
                parent[attr] = new
            else:
                setattr(parent, attr, new)
        warn_kept(kept, "AdaHOPConverter")
        # A bf16_layers / ROLE@PATTERN / exclude typo is an error, as in convert_model.
        check_patterns(self.recipe, converted, c.exclude, linears)
        missing = [] if self.plan is None else [fqn for fqn in converted if fqn not in self.plan]
        if missing:
            raise ValueError(
                f"plan {c.plan} has no entry for layers {missing[:5]}{'...' if len(missing) > 5 else ''}; "
                "save the plan of a model converted the same way (adahop.model_plan(model).save(path))"
            )
        if c.model_compile_enabled:
            blocks = {re.sub(r"^(.*?\.\d+)\..*", r"\1", fqn) for fqn in converted}  # layers.3 of layers.3.attention.wo
            reserve_compiled_graphs(len(blocks) + 1)
        return model_config
