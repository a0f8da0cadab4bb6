"""torchtitan >= 0.3: a ``QuantizationConverter`` that rewrites the model config tree.

torchtitan builds the model from its config on the meta device, then ``to_empty`` and
``init_states``; this converter swaps each chosen ``Linear.Config`` for an
``AdaHOPTitanLinear.Config`` before that, so the layers are built as ``AdaHOPLinear`` directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from torchtitan.components.quantization import QuantizationConverter
from torchtitan.models.common.linear import Linear
from torchtitan.protocols.module import Module

from ...nn.convert import check_patterns, conversion_verdict, warn_kept
from ...nn.linear import AdaHOPLinear
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


class AdaHOPConverter(QuantizationConverter):
    """Swap torchtitan's ``Linear`` layers for ``AdaHOPLinear`` (``nn.convert.conversion_verdict``).

    Calibration needs no trainer hook: each layer votes its outlier patterns from module
    hooks during the first ``recipe.calibration_steps`` training steps, then freezes its plan,
    which torchtitan's checkpoints keep (the layer's ``_extra_state``) and restore on resume.
    The state tensor is not sharded, so DCP saves one rank's copy: a checkpoint taken during
    calibration resumes every rank with that rank's votes (the plan, merged over ranks at the
    freeze, is the same everywhere).
    """

    @dataclass(kw_only=True, slots=True)
    class Config(QuantizationConverter.Config):
        recipe: str = DEFAULT_RECIPE
        """A registered adahop recipe name or a .toml/.json recipe file."""
        exclude: list[str] = field(default_factory=list)
        """fnmatch patterns of module names kept as ``Linear``, on top of ``recipe.exclude``."""
        min_features: int = DEFAULT_MIN_FEATURES
        """Layers with fewer input or output features stay ``Linear``."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.recipe = get_recipe(config.recipe)  # a bad name fails here, before the model is built

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
        return model_config
