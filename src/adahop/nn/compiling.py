"""``torch.compile`` of converted blocks: one graph per distinct frozen plan.

A block's converted layers are traced with their plan (the strategies are Python values the graph is
specialised on), so blocks compiled from the same code whose layers froze different plans are
different graphs, and so is the calibrating block before them. Dynamo keeps at most
``torch._dynamo.config.recompile_limit`` graphs per code object (8 by default) and runs the frames
past it uncompiled; :func:`reserve_compiled_graphs` raises the limit for a model's blocks.
"""

from __future__ import annotations

import torch


def reserve_compiled_graphs(count: int) -> None:
    """Let dynamo keep ``count`` graphs per code object (never lowers the limit)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, count)
