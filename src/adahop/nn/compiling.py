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
partitioner (tagging that chain too made an FP8 forward keep its GEMM's FP32 output on the CPU route). An
operand moves only where X is made element-wise from tensors the backward needs anyway (or small ones):
an X straight out of a GEMM, the graph's input, or a GEMM output plus a bias would otherwise be kept in
high precision in place of its quantized Xᵀ.

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
from torch.fx.experimental.symbolic_shapes import statically_known_true
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


def _roots(node: torch.fx.Node, backward: set[torch.fx.Node]) -> list[torch.fx.Node]:
    """The forward tensors a marked node reads that no marked node made: X (the seed and the Hadamard
    signs, kept as they are, left out)."""
    roots = []
    for arg in node.all_input_nodes:
        value = arg.meta.get("val")
        if arg in backward or _marked(arg):
            continue
        if isinstance(value, torch.Tensor) and value.is_floating_point() and value.dim() >= 2:
            roots.append(arg)
    return roots


def _storage_node(node: torch.fx.Node) -> torch.fx.Node:
    """The node that wrote ``node``'s storage (``node`` without its views)."""
    while _is_view(node):
        node = node.all_input_nodes[0]
    return node


def tag_wgrad_operands(graph: torch.fx.Graph) -> int:
    """Tag ``MUST_RECOMPUTE`` the marked forward nodes (wgrad's operand prepared from X) and every X that a
    marked node reads from the forward (the backward's wgrad GEMM reads a BF16 X directly): its views and
    the element-wise op that writes it. The partitioner bans recomputing X itself (an opaque op reads it in
    backward, so recomputing it is "not free"); the ops before it it recomputes or keeps as it does for
    BF16 and float8. Only where that keeps nothing more (``recomputable``); elsewhere those operands stay as
    they are. A tag
    already set (activation checkpointing) is left as it is. Returns how many nodes were tagged."""
    backward = _backward_nodes(graph)

    def needed_in_backward(node: torch.fx.Node) -> bool:
        """Whether an unmarked backward node reads ``node`` (or a view of it): kept or recomputed anyway."""
        return any(
            (user in backward and not _marked(user)) or (_is_view(user) and needed_in_backward(user))
            for user in node.users
        )

    def recomputable(root: torch.fx.Node) -> bool:
        """Whether X is written by an element-wise op from tensors the backward needs anyway (or small
        ones: statistics, a norm's weight), through element-wise ops: then recomputing it keeps nothing
        more. An X straight out of a GEMM, the graph's input, or one made from a tensor only it needs
        (a GEMM's output before its bias) would be kept instead of its quantized Xᵀ."""
        origin = _storage_node(root)
        if not _elementwise(origin):
            return False
        numel, stack, seen = root.meta["val"].numel(), [origin], set()
        while stack:
            for source in stack.pop().all_input_nodes:
                value = source.meta.get("val")
                if source in seen or not isinstance(value, torch.Tensor):
                    continue
                seen.add(source)
                if statically_known_true(value.numel() * 16 <= numel) or needed_in_backward(source):
                    continue
                if not (_is_view(source) or _elementwise(source)):
                    return False
                stack.append(source)
        return True

    # The marked forward nodes in groups (one operand's quantize, scores, selection, extracted rows), each
    # moved into backward whole or not at all.
    group = {node: node for node in graph.nodes if _marked(node) and node not in backward}

    def find(node: torch.fx.Node) -> torch.fx.Node:
        while group[node] is not node:
            node = group[node]
        return node

    for node in group:
        for arg in node.all_input_nodes:
            if arg in group:
                group[find(arg)] = find(node)
    movable = {find(node) for node in group}
    for node in group:
        if not all(recomputable(root) for root in _roots(node, backward)):
            movable.discard(find(node))

    tagged = 0

    def tag(node: torch.fx.Node) -> None:
        nonlocal tagged
        if "recompute" not in node.meta:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            tagged += 1

    for node in graph.nodes:
        if not _marked(node) or (node in group and find(node) not in movable):
            continue
        if node in group:
            tag(node)
        for root in _roots(node, backward):
            if not recomputable(root):
                continue
            while _is_view(root):
                tag(root)
                root = root.all_input_nodes[0]
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
