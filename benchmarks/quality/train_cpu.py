"""``adahop train`` on the CPU under BF16 autocast, the numerics of a GPU run, bit-reproducibly.

The trainer autocasts on CUDA only (a CPU run computes in float32); a paired comparison of
recipes meant to stand for GPU runs needs BF16 operands, as under CUDA autocast. Same arguments
as ``adahop train``::

    python benchmarks/quality/train_cpu.py --config configs/tiny_cpu.toml --recipe adahop_lv2 ...
"""

from __future__ import annotations

import sys

import torch

from adahop.train import builders, trainer
from adahop.train.cli import main
from adahop.train.config import TrainConfig


def cpu_autocast(cfg: TrainConfig, device: torch.device) -> torch.autocast:
    """BF16 autocast on any device when ``training.autocast`` is set."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=cfg.training.autocast)


if __name__ == "__main__":
    builders.autocast_for = trainer.autocast_for = cpu_autocast  # training steps and validation
    sys.exit(main(sys.argv[1:]))
