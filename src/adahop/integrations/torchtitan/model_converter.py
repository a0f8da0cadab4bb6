"""torchtitan 0.2.x: a registered ``ModelConverter`` that converts the built (meta-device) model.

Written against torchtitan 0.2.2's ``register_model_converter(cls, name)`` protocol; its options
come from an ``[adahop]`` job-config section (``--job.custom_config_module`` below).
"""


from dataclasses import dataclass, field

from torch import nn
from torchtitan.config import JobConfig as TitanJobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.model_converter import register_model_converter

from ...nn.convert import adahop_layers, convert_model
from ...recipes import get_recipe
from .filter import DEFAULT_MIN_FEATURES, should_convert

CONVERTER_NAME = "adahop"


@dataclass
class AdaHOPOptions:
    recipe: str = "adahop_lv2"
    """A registered adahop recipe name or a .toml/.json recipe file."""
    exclude: list[str] = field(default_factory=list)
    """fnmatch patterns of module names kept as nn.Linear, on top of the recipe's exclude."""
    min_features: int = DEFAULT_MIN_FEATURES
    """Layers with fewer input or output features stay nn.Linear."""


# No ``from __future__ import annotations`` here: torchtitan resolves these field types by name
# in its own namespace when it merges ``JobConfig`` into its own.
@dataclass
class JobConfig:
    """Merged into torchtitan's JobConfig by ``--job.custom_config_module adahop.integrations.torchtitan``."""

    adahop: AdaHOPOptions = field(default_factory=AdaHOPOptions)


class AdaHOPModelConverter:
    """``--model.converters adahop``: swap ``nn.Linear`` for ``AdaHOPLinear`` (see ``should_convert``)."""

    def __init__(self, job_config: TitanJobConfig, parallel_dims: ParallelDims | None) -> None:
        self.options = getattr(job_config, "adahop", None) or AdaHOPOptions()
        self.recipe = get_recipe(self.options.recipe)

    def convert(self, model: nn.Module) -> None:
        o = self.options

        def keep(module: nn.Linear, fqn: str) -> bool:
            return should_convert(fqn, module.in_features, module.out_features, self.recipe, o.exclude, o.min_features)

        convert_model(model, self.recipe, filter_fn=keep)

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """torchtitan 0.2 caches the model state_dict once; refresh each layer's ``_extra_state``
        tensor in place so a checkpoint holds the current votes and plan."""
        for part in model if isinstance(model, list) else [model]:
            for layer in adahop_layers(part).values():
                layer.refresh_extra_state()


register_model_converter(AdaHOPModelConverter, CONVERTER_NAME)
