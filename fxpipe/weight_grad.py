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
from typing import Any, Optional, Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

Node = Any  # torch.autograd.graph.Node


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
    tensors: Sequence[torch.Tensor], grads: Sequence[torch.Tensor], inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]
) -> PendingWeights:
    """I: accumulate the gradients of `inputs` into their `.grad`, and return what W needs to
    give `weights` theirs. Where the split would count a gradient twice (a weight reached both
    from a node's weight side and through its input side: one weight used at two places), I
    runs the whole backward and W has nothing left to do."""
    if not tensors:
        return PendingWeights()
    roots = [get_gradient_edge(t) for t in tensors]
    if not inputs:  # nothing for I to do: W runs the whole backward
        return PendingWeights([(roots, list(grads), list(weights))]) if weights else PendingWeights()
    graph = _Graph([edge.node for edge in roots], inputs, weights)
    plan = graph.split()
    if plan is None:
        torch.autograd.backward(list(tensors), list(grads), inputs=[*inputs, *weights])
        return PendingWeights()
    pending = PendingWeights()
    for edge, grad in zip(roots, grads):  # roots off every input's path: W starts there as they are
        if edge.node not in graph.to_input and graph.reach[edge.node]:
            pending.parts.append(([edge], [grad], graph.weights_in(graph.reach[edge.node])))
    kept: dict[Node, tuple[Optional[torch.Tensor], ...]] = {}
    handles = [node.register_prehook(_keeper(kept, node)) for node in plan]
    try:
        torch.autograd.backward(list(tensors), list(grads), inputs=list(inputs), retain_graph=True)
    finally:
        for handle in handles:
            handle.remove()
    for node, node_grads in kept.items():
        edges = [GradientEdge(node, k) for k, g in enumerate(node_grads) if g is not None]
        given = [g for g in node_grads if g is not None]
        if edges:
            pending.parts.append((edges, given, graph.weights_in(plan[node])))
    return pending


def _keeper(kept: dict[Node, tuple[Optional[torch.Tensor], ...]], node: Node) -> Any:
    def hook(grad_outputs: tuple[Optional[torch.Tensor], ...]) -> None:
        kept[node] = tuple(grad_outputs)

    return hook


class _Graph:
    """The backward graph from the roots: which nodes lead to an input, and which weights each
    leads to (a bit per weight)."""

    def __init__(self, roots: Sequence[Node], inputs: Sequence[torch.Tensor], weights: Sequence[torch.Tensor]) -> None:
        input_nodes = {get_gradient_edge(t).node for t in inputs}
        self.weights = list(weights)
        bit = {get_gradient_edge(w).node: 1 << k for k, w in enumerate(weights)}
        self.children: dict[Node, list[Node]] = {}
        self.to_input: set[Node] = set()
        self.reach: dict[Node, int] = {}
        for node in _post_order(roots, self.children):
            kids = self.children[node]
            self.reach[node] = bit.get(node, 0) | _union(self.reach[c] for c in kids)
            if node in input_nodes or any(c in self.to_input for c in kids):
                self.to_input.add(node)

    def split(self) -> Optional[dict[Node, int]]:
        """The nodes on an input's path with a child off every input's path that leads to a
        weight, with the weights reached from those children; None if a weight so reached can
        also be reached through the node's input side (W from there would count it twice)."""
        plan = {}
        for node in self.to_input:
            kids = self.children[node]
            weight_side = _union(self.reach[c] for c in kids if c not in self.to_input)
            if not weight_side:
                continue
            if weight_side & _union(self.reach[c] for c in kids if c in self.to_input):
                return None
            plan[node] = weight_side
        return plan

    def weights_in(self, bits: int) -> list[torch.Tensor]:
        return [w for k, w in enumerate(self.weights) if bits >> k & 1]


def _union(bits: Any) -> int:
    total = 0
    for b in bits:
        total |= b
    return total


def _post_order(roots: Sequence[Node], children: dict[Node, list[Node]]) -> list[Node]:
    """Every node reachable from `roots`, each after all the nodes its gradients flow to;
    fills `children`."""
    order: list[Node] = []
    stack: list[tuple[Node, bool]] = [(n, False) for n in roots if n is not None]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node in children:
            continue
        children[node] = [child for child, _ in node.next_functions if child is not None]
        stack.append((node, True))
        stack.extend((c, False) for c in children[node] if c not in children)
    return order
