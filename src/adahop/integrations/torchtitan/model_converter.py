"""torchtitan 0.2.x: a registered ``ModelConverter`` that converts the built (meta-device) model.

Written against torchtitan 0.2.2's ``register_model_converter(cls, name)`` protocol; its options
come from an ``[adahop]`` job-config section (``--job.custom_config_module`` below).

The converter also reports the plan in torchtitan's log: when every layer has frozen its plan
(the table, and ``adahop_plan.json`` in the job's dump folder, written by rank 0), or, on a
resumed run, that the layers came back from the checkpoint with their plans and do not
calibrate again.
"""

from dataclasses import dataclass, field
from pathlib import Path

import torch.distributed as dist
from torch import nn
from torchtitan.config import JobConfig as TitanJobConfig
from torchtitan.distributed import ParallelDims
from torchtitan.protocols.model_converter import register_model_converter
from torchtitan.tools.logging import logger

from ...nn.convert import adahop_layers, convert_model, model_plan
from ...recipes import DEFAULT_RECIPE, get_recipe
from .filter import DEFAULT_MIN_FEATURES

CONVERTER_NAME = "adahop"
PLAN_FILE = "adahop_plan.json"  # in the job's dump folder


@dataclass
class AdaHOPOptions:
    recipe: str = DEFAULT_RECIPE
    """A registered adahop recipe name or a .toml/.json recipe file."""
    exclude: list[str] = field(default_factory=list)
    """fnmatch patterns of module names kept as nn.Linear, on top of the recipe's exclude."""
    min_features: int = DEFAULT_MIN_FEATURES
    """Layers with fewer input or output features stay nn.Linear."""
    plan: str = ""
    """A frozen plan (e.g. the adahop_plan.json of an earlier job) to skip calibration."""


# No ``from __future__ import annotations`` here: torchtitan resolves these field types by name
# in its own namespace when it merges ``JobConfig`` into its own.
@dataclass
class JobConfig:
    """Merged into torchtitan's JobConfig by ``--job.custom_config_module adahop.integrations.torchtitan``."""

    adahop: AdaHOPOptions = field(default_factory=AdaHOPOptions)


class AdaHOPModelConverter:
    """``--model.converters adahop``: swap ``nn.Linear`` for ``AdaHOPLinear`` (``nn.convert.conversion_verdict``)."""

    def __init__(self, job_config: TitanJobConfig, parallel_dims: ParallelDims | None) -> None:
        self.options = getattr(job_config, "adahop", None) or AdaHOPOptions()
        self.recipe = get_recipe(self.options.recipe)
        self.plan_path = Path(job_config.job.dump_folder) / PLAN_FILE
        self.steps = 0  # optimizer steps of this process (a resumed run counts from 0 again)
        self._frozen = 0  # layers with a frozen plan at the last step

    def convert(self, model: nn.Module) -> None:
        o = self.options
        convert_model(model, self.recipe, exclude=o.exclude, min_features=o.min_features, plan=o.plan or None)
        if o.plan:
            logger.info("adahop: %d linear layers converted with the frozen plan %s", len(adahop_layers(model)), o.plan)
            return
        logger.info(
            "adahop: %d linear layers converted (recipe %s); they calibrate for %d steps, then freeze their plans",
            len(adahop_layers(model)),
            self.recipe.name,
            self.recipe.calibration_steps,
        )

    def post_optimizer_hook(self, model: nn.Module | list[nn.Module]) -> None:
        """torchtitan 0.2 caches the model state_dict once; refresh each layer's ``_extra_state``
        tensor in place so a checkpoint holds the current votes and plan. Logs the plan once
        every layer has one (see the module docstring)."""
        parts = model if isinstance(model, list) else [model]
        layers = [layer for part in parts for layer in adahop_layers(part).values()]
        for layer in layers:
            layer.refresh_extra_state()
        self.steps += 1
        frozen = sum(not layer.calibrating for layer in layers)
        if frozen != self._frozen and self.recipe.adaptive:
            self._report(parts, frozen, len(layers))
        self._frozen = frozen

    def _report(self, parts: list[nn.Module], frozen: int, total: int) -> None:
        # A layer freezes before the update of its last calibration step, so none of this process
        # can have frozen by its first step with more than one: those came from a checkpoint or a plan.
        restored = self.steps == 1 and self.recipe.calibration_steps > 1
        if restored:
            logger.info(
                "adahop: %d of %d layers started with frozen plans (the checkpoint's or --adahop.plan); they do not calibrate",
                frozen,
                total,
            )
        elif frozen < total:
            return
        else:
            logger.info("adahop: every layer has frozen its plan (by optimizer step %d of this run)", self.steps)
        plan = model_plan(parts[0]) if len(parts) == 1 else None
        if plan is None or len(plan) != total:  # pipeline stages: each holds part of the plan
            return
        logger.info("adahop: plan (recipe %s):\n%s", self.recipe.name, plan.summary())
        if not restored and (not dist.is_initialized() or dist.get_rank() == 0):
            self.plan_path.parent.mkdir(parents=True, exist_ok=True)
            plan.save(self.plan_path)
            logger.info("adahop: plan saved to %s", self.plan_path)


register_model_converter(AdaHOPModelConverter, CONVERTER_NAME)
