"""What a compiled module keeps for backward: the values Inductor's min-cut partitioner hands from the
forward graph to the backward graph, recorded once it has chosen (nothing is compiled further or run).
Used by ``benchmarks/linear/saved_bytes.py`` and the tests of ``training.recompute_wgrad_operands``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any
from unittest import mock

import torch


class _Partitioned(Exception):
    """Raised once the partitioner has chosen."""


def kept_for_backward(run: Callable[[], Any]) -> list[torch.fx.Node]:
    """The saved values (forward-graph nodes) of the first graph that ``run()`` compiles with Inductor;
    ``run`` stops there."""
    from torch._inductor import compile_fx

    inner, chosen = compile_fx.min_cut_rematerialization_partition, []

    def recording(joint, joint_inputs, **kwargs):
        fw, _ = inner(joint, joint_inputs, **kwargs)
        output = next(n for n in fw.graph.nodes if n.op == "output")
        chosen.extend(output.args[0][kwargs["num_fwd_outputs"] :])
        raise _Partitioned

    with mock.patch.object(compile_fx, "min_cut_rematerialization_partition", recording):
        with contextlib.suppress(_Partitioned, torch._dynamo.exc.BackendCompilerFailed):
            run()
    if not chosen:
        raise RuntimeError("the partitioner was never reached (a graph break, or not Inductor?)")
    return chosen
