"""``adahop train``: pretrain a Llama-style model with a low-precision recipe.

| module               | what                                                            |
|----------------------|-----------------------------------------------------------------|
| `config`             | `TrainConfig` (nested dataclasses), TOML in and out, overrides  |
| `builders`           | the device, the converted model and the data a config describes |
| `optim`              | AdamW and the warmup + cosine schedule                          |
| `checkpoint`         | atomic, exactly resumable checkpoints; reads either format      |
| `checkpoint_files`   | checkpoint names, checksums, setting damaged ones aside         |
| `rng`                | the random generators a step draws from, as checkpoint state    |
| `distributed`        | torchrun's process group, FSDP2 sharding, failures across ranks |
| `sharded_checkpoint` | the checkpoints of a multi-process run (DCP)                    |
| `metrics`            | `metrics.jsonl`, TensorBoard, `loss.png`                        |
| `nonfinite`          | non-finite steps: refused on the device, reported later         |
| `trainer`            | the loop                                                        |
| `cli`                | the command line                                                |

A run directory holds ``config.toml``, ``metrics.jsonl``, ``plan.json``, ``tb/``,
``checkpoints/step_XXXXXXX.pt`` with its ``.sha256`` (``step_XXXXXXX/`` directories when trained
on several ranks) and ``loss.png``. To read a run back::

    cfg = load_config(run_dir / "config.toml")
    model = build_model_from_config(cfg)
    state = load_checkpoint(run_dir, model)  # the latest checkpoint; state["step"], ...
"""

from .builders import TrainData, build_data, build_model_from_config, load_run, mean_loss, resolve_device
from .checkpoint import CheckpointError, latest_checkpoint, load_checkpoint
from .config import ConfigError, TrainConfig, load_config
from .metrics import plot_losses, read_metrics
from .trainer import NonFiniteLossError, Trainer, TrainResult

__all__ = [
    "CheckpointError",
    "ConfigError",
    "NonFiniteLossError",
    "TrainConfig",
    "TrainData",
    "TrainResult",
    "Trainer",
    "build_data",
    "build_model_from_config",
    "latest_checkpoint",
    "load_checkpoint",
    "load_config",
    "load_run",
    "mean_loss",
    "plot_losses",
    "read_metrics",
    "resolve_device",
]
