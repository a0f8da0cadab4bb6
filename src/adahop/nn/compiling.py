"""``torch.compile`` of converted blocks: one graph per distinct frozen plan, and (optionally) wgrad's
quantized Xᵀ made in backward from a recomputed X instead of kept from the forward.

A block's converted layers are traced with their plan (the strategies are Python values the graph is
specialised on), so blocks compiled from the same code whose layers froze different plans are
different graphs, and so is the calibrating block before them. Dynamo keeps at most
``torch._dynamo.config.recompile_limit`` graphs per code object (8 by default) and runs the frames
past it uncompiled; :func:`reserve_compiled_graphs` raises the limit for a model's blocks.

**Recomputed wgrad operands** (``training.recompute_wgrad_operands``). Inductor's partitioner never
recomputes a custom op, so a compiled block keeps every layer's wgrad operand as the forward made it
(Xᵀ in MXFP4, OE-right's BF16 channels, a BF16 X where wgrad runs BF16), where torchao float8's casts,
being element-wise, are recomputed in backward from tensors the block keeps anyway. ``AdaHOPLinear``
marks the nodes that prepare wgrad's operand and the wgrad GEMM that reads it
(:func:`wgrad_operand_region`, an ``fx.traceback`` annotation that reaches the joint graph), and
:class:`RecomputeWgradOperands`, an Inductor joint-graph pass, tags them and X (its views and the
element-wise op writing it) with the tag selective activation checkpointing hands the partitioner
(``CheckpointPolicy.MUST_RECOMPUTE``). The quantize is then dead in the forward and runs in backward, on an
X the partitioner recomputes as it recomputes float8's casts (RMSNorm's output from the block input and
its statistics, SwiGLU's product from w1's and w3's outputs, the attention output's copy): the same ops
on the same values, so the same bits, and no GEMM or quantize more. X alone is tagged because the
partitioner bans recomputing it (an opaque op reads it in backward); what it is made from is left to the
partitioner (tagging that chain too made an FP8 forward keep its GEMM's FP32 output on the CPU route).

A pass rather than a selective-checkpointing policy: a policy sees the ops in forward order, one at a
time, so it cannot tag X's producer before it sees X quantized for wgrad, and it needs a checkpoint region
around the block; the pass sees the whole joint graph and applies per ``torch.compile`` call
(:func:`compile_options`), beside any activation checkpointing (a tag already set is left alone; a fully
checkpointed block keeps its input only, with the pass or without).
"""

from __future__ import annotations

import contextlib

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files
from torch.utils.checkpoint import CheckpointPolicy

WGRAD_OPERAND = "wgrad_operand"  # the annotation's value under the key "adahop"
# Copies that are element-wise without the pointwise tag.
_COPIES = frozenset(
    (torch.ops.aten.clone.default, torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
)


def reserve_compiled_graphs(count: int) -> None:
    """Let dynamo keep ``count`` graphs per code object (never lowers the limit)."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, count)


def wgrad_operand_region(xt_seed: torch.Tensor | int) -> contextlib.AbstractContextManager:
    """Around what prepares wgrad's operand from X, and around the wgrad GEMM that reads it: annotates
    the traced nodes for :class:`RecomputeWgradOperands` (nothing outside tracing). Not where Xᵀ rounds
    stochastically (``xt_seed``, a key drawn in the forward): the partitioner would draw the key again
    in backward for the recomputed quantize (it re-runs ``torch.randint`` there for dY's keys), so
    those layers keep their Xᵀ as the forward made it."""
    if isinstance(xt_seed, torch.Tensor) or not torch.compiler.is_compiling():
        return contextlib.nullcontext()
    return torch.fx.traceback.annotate({"adahop": WGRAD_OPERAND})


def _marked(node: torch.fx.Node) -> bool:
    return (node.meta.get("custom") or {}).get("adahop") == WGRAD_OPERAND


def _backward_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The joint graph's nodes that depend on a tangent: the backward's."""
    found = {node for node in graph.nodes if node.op == "placeholder" and "tangents" in str(node.target)}
    for node in graph.nodes:  # topological order
        if node not in found and any(arg in found for arg in node.all_input_nodes):
            found.add(node)
    return found


def _elementwise(node: torch.fx.Node) -> bool:
    """Whether ``node`` is an element-wise op or a copy (never a random one)."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return False
    if torch.Tag.nondeterministic_seeded in target.tags:
        return False
    return torch.Tag.pointwise in target.tags or target in _COPIES


def _is_view(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def tag_wgrad_operands(graph: torch.fx.Graph) -> int:
    """Tag ``MUST_RECOMPUTE`` the marked forward nodes (wgrad's operand prepared from X) and every X that a
    marked node reads from the forward (the backward's wgrad GEMM reads a BF16 X directly): its views and
    the element-wise op that writes it. The partitioner bans recomputing X itself (an opaque op reads it in
    backward, so recomputing it is "not free"); the ops before it it recomputes or keeps as it does for
    BF16 and float8. A tag already set (activation checkpointing) is left as it is. Returns how many
    nodes were tagged."""
    backward = _backward_nodes(graph)
    tagged = 0

    def tag(node: torch.fx.Node) -> None:
        nonlocal tagged
        if "recompute" not in node.meta:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            tagged += 1

    for node in graph.nodes:
        if not _marked(node):
            continue
        if node not in backward:
            tag(node)
        for root in node.all_input_nodes:
            value = root.meta.get("val")
            if root in backward or _marked(root) or "recompute" in root.meta:
                continue
            if not (isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2):
                continue  # the seed, the Hadamard signs: kept as they are
            while _is_view(root) and "recompute" not in root.meta:
                tag(root)
                root = root.all_input_nodes[0]
            if _elementwise(root):
                tag(root)
    return tagged


class RecomputeWgradOperands(CustomGraphPass):
    """Inductor joint-graph pass (``joint_custom_post_pass``): :func:`tag_wgrad_operands`."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        tag_wgrad_operands(graph)

    def uuid(self) -> bytes:
        return get_hash_for_files((__file__,))


def compile_options(recompute_wgrad_operands: bool) -> dict:
    """Inductor options for a block's ``torch.compile``: the pass of :class:`RecomputeWgradOperands` when on."""
    return {"joint_custom_post_pass": RecomputeWgradOperands()} if recompute_wgrad_operands else {}
