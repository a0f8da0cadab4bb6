"""adahop in torchtitan: swap its linear layers for ``AdaHOPLinear``.

Two torchtitan APIs, picked by what the installed torchtitan provides:

- **0.3.x** (imports on torch >= 2.13, with Triton): ``AdaHOPConverter.Config(...)`` in
  ``model_registry(flavor, converters=[...])``; ``--module adahop.integrations.torchtitan
  --config llama3_debugmodel_adahop`` runs the ready-made config (``config_registry``) where
  torchtitan 0.3's trainer runs (a torch with ``torch.distributed.set_timeout``; docs/integrations.md).
- **0.2.x** (torch 2.11 takes 0.2.2): ``--experimental.custom_import adahop.integrations.torchtitan
  --job.custom_config_module adahop.integrations.torchtitan --model.converters adahop``,
  options under ``--adahop.recipe`` / ``--adahop.exclude`` / ``--adahop.min_features``.

Either way the layers are chosen as ``convert_model`` chooses them (``nn.convert.conversion_verdict``), calibration runs from the layers' own
hooks inside torchtitan's loop, and the frozen plan travels in torchtitan's DCP checkpoints
(each layer's ``_extra_state``). Data parallelism (FSDP2) only: tensor parallelism is untested.
"""

try:
    import torchtitan  # noqa: F401
except ImportError:
    raise ImportError('adahop.integrations.torchtitan needs torchtitan: pip install "adahop[torchtitan]"') from None

try:
    from torchtitan.protocols.model_converter import register_model_converter  # noqa: F401
except ImportError:
    API = "0.3"
    try:
        from .config_converter import AdaHOPConverter, AdaHOPTitanLinear
    except ModuleNotFoundError as e:  # torchtitan 0.3's model code imports Triton kernels unconditionally
        if e.name != "triton":
            raise
        raise ImportError(
            'torchtitan 0.3 needs Triton to import (its MoE kernels): pip install "adahop[torchtitan]" installs it'
        ) from None

    __all__ = ["API", "AdaHOPConverter", "AdaHOPTitanLinear"]
else:
    API = "0.2"
    from .model_converter import PLAN_FILE, CONVERTER_NAME, AdaHOPModelConverter, AdaHOPOptions, JobConfig

    __all__ = ["API", "CONVERTER_NAME", "PLAN_FILE", "AdaHOPModelConverter", "AdaHOPOptions", "JobConfig"]
