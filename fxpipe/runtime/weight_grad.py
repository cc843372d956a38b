"""A stage's backward in two halves: input gradients now (I), weight gradients later (W).

I runs autograd for the stage's inputs alone: a node on the way to both an input and a weight
(`addmm` of a Linear, say) then computes only its input-side gradient, and a pre-hook keeps the
gradient it was given. W runs the same nodes again from the kept gradients, for the weights alone:

    output ──▶ TanhBackward ──▶ AddmmBackward ──▶ input             I: this path, hook on Addmm
                                   │  (kept: its gradient)
                                   └──▶ TBackward ──▶ weight        W: from Addmm, this path

Nothing is computed twice except by nodes that ignore autograd's mask (custom Functions whose
backward computes every gradient), which stay correct.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

Node = Any  # torch.autograd.graph.Node


class Weights:
    """A stage's weights over one step, each with a bit, and the autograd node that reaches it.
    The nodes are looked up once (a few microseconds each) and held: every micro-batch's graph
    in the step reaches the same ones."""

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)

    @cached_property
    def bits(self) -> dict[Node, int]:
        return {get_gradient_edge(w).node: 1 << k for k, w in enumerate(self.tensors)}

    def chosen(self, bits: int) -> list[torch.Tensor]:
        return [w for k, w in enumerate(self.tensors) if bits >> k & 1]


@dataclass
class PendingWeights:
    """What W needs: per place where gradients enter a weight-only part of the graph, the
    gradients given there and the weights they reach."""

    parts: list[tuple[list[GradientEdge], list[torch.Tensor], list[torch.Tensor]]] = field(default_factory=list)

    def run(self) -> None:
        """W: accumulate the weights' gradients into their `.grad`. Parts may run through the same
        nodes, so each keeps the graph; it goes with the last reference to it."""
        for edges, grads, weights in self.parts:
            torch.autograd.backward(edges, grads, inputs=weights, retain_graph=True)
        self.parts = []


def backward_inputs(
    tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], weights: Weights
) -> PendingWeights:
    """I: accumulate the gradients of `inputs` into their `.grad`, and return what W needs to
    give `weights` theirs. Where the split would count a gradient twice (a weight reached both
    from a node's weight side and through its input side: one weight used at two places), I
    runs the whole backward and W has nothing left to do."""
    if not tensors:
        return PendingWeights()
    roots = [get_gradient_edge(t) for t in tensors]
    if not inputs:  # nothing for I to do: W runs the whole backward
        return PendingWeights([(roots, list(grads), weights.tensors)]) if weights.tensors else PendingWeights()
    graph = _Graph([edge.node for edge in roots], {get_gradient_edge(t).node for t in inputs}, weights.bits)
    split = graph.split()
    # Roots off every input's path: W starts there as they are.
    off_path = [(edge, grad, graph.reach[edge.node]) for edge, grad in zip(roots, grads) if edge.node not in graph.to_input]
    if split is None or any(bits & split[1] for _, _, bits in off_path):
        torch.autograd.backward(list(tensors), list(grads), inputs=[*inputs, *weights.tensors])
        return PendingWeights()
    plan, in_i = split
    pending = PendingWeights([([edge], [grad], weights.chosen(bits)) for edge, grad, bits in off_path if bits])
    kept: dict[Node, tuple[Optional[torch.Tensor], ...]] = {}
    handles = [node.register_prehook(_keeper(kept, node)) for node in plan]
    try:
        torch.autograd.backward(list(tensors), list(grads), inputs=[*inputs, *weights.chosen(in_i)], retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    for node, node_grads in kept.items():
        edges = [GradientEdge(node, k) for k, g in enumerate(node_grads) if g is not None]
        given = [g for g in node_grads if g is not None]
        if edges:
            pending.parts.append((edges, given, weights.chosen(plan[node])))
    return pending


def _keeper(kept: dict[Node, tuple[Optional[torch.Tensor], ...]], node: Node) -> Any:
    def hook(grad_outputs: tuple[Optional[torch.Tensor], ...]) -> None:
        kept[node] = tuple(grad_outputs)

    return hook


# Nodes never asked for their weights' gradients alone: GroupNorm's backward kernel crashes the
# process when its input is channels_last and the input's gradient is not asked for (torch 2.13);
# an autograd Function's backward is the model's own Python, which runs once per micro-batch in
# the plain model (it may count its calls, or free what it kept on ctx). I computes their
# weights' gradients along with the input gradients.
_WHOLE_IN_I = frozenset({"NativeGroupNormBackward0"})


def _whole_in_i(node: Node) -> bool:
    return node.name() in _WHOLE_IN_I or isinstance(node, torch.autograd.function.BackwardCFunction)


class _Graph:
    """The backward graph from the roots, in one walk: each node's children, which nodes lead to
    an input, and which weights each leads to (a bit per weight). It runs once per I, on the
    critical path of a zero-bubble schedule, so it keeps to plain loops."""

    def __init__(self, roots: Sequence[Node], input_nodes: set[Node], weight_bits: dict[Node, int]) -> None:
        children: dict[Node, list[Node]] = {}
        reach: dict[Node, int] = {}
        to_input: set[Node] = set()
        stack: list[tuple[Node, bool]] = [(n, False) for n in roots if n is not None]
        while stack:  # depth first; a node is finished after every node its gradients flow to
            node, expanded = stack.pop()
            if expanded:
                bits, leads_to_input = weight_bits.get(node, 0), node in input_nodes
                for child in children[node]:
                    bits |= reach[child]
                    leads_to_input = leads_to_input or child in to_input
                reach[node] = bits
                if leads_to_input:
                    to_input.add(node)
            elif node not in children:
                kids = children[node] = [child for child, _ in node.next_functions if child is not None]
                stack.append((node, True))
                stack.extend((child, False) for child in kids if child not in children)
        self.children, self.reach, self.to_input = children, reach, to_input

    def split(self) -> Optional[tuple[dict[Node, int], int]]:
        """The nodes on an input's path with a child off every input's path that leads to a
        weight, with the weights reached from those children (W starts at these nodes), and
        the weights whose gradients I computes itself (those of nodes in `_WHOLE_IN_I`); None
        if a weight so reached can also be reached another way (it would be counted twice)."""
        plan, in_i, in_w = {}, 0, 0
        for node in self.to_input:
            weight_side = input_side = 0
            for child in self.children[node]:
                if child in self.to_input:
                    input_side |= self.reach[child]
                else:
                    weight_side |= self.reach[child]
            if weight_side & input_side:
                return None
            if _whole_in_i(node):
                in_i |= weight_side
            elif weight_side:
                plan[node] = weight_side
                in_w |= weight_side
        return None if in_i & in_w else (plan, in_i)
