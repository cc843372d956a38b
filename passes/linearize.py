"""Linearization: the order in which a graph's compute nodes are laid out across the stages.

Stages are runs of this order, and a cut between two positions sends every value that is open
there: made before, used after. A topological order that starts a second branch before finishing
the first cuts through both:

    a ─ b ─ c ─┐                 order a b c d e f g:  cut after c sends c and a's branch f
    a ─ e ─ f ─┴─ g              order a e f b c g:    better or worse, by the bytes of each value

so the order is chosen to keep the bytes open across positions low.
"""
from __future__ import annotations

from typing import Sequence

import torch.fx as fx

from fxpipe.core.attrs import COMPUTE_OPS
from fxpipe.core.writes import written_arguments
from fxpipe.passes.state import reads_written_state

__all__ = ["COMPUTE_OPS", "keeps_traced_order", "linearize", "open_bytes"]



def open_bytes(order: Sequence[fx.Node]) -> int:
    """Bytes open across the positions of `order`, summed over positions: each value counts its
    size once for every boundary between its producer and its last consumer."""
    position = {node: i for i, node in enumerate(order)}
    end = len(order)
    total = 0
    producers = {n for node in order for n in node.all_input_nodes if n.op == "placeholder"}
    for node in [*producers, *order]:
        last = max((position.get(user, end) for user in node.users), default=None)
        if last is not None:
            total += int(node.meta.get("bytes", 0)) * (last - position.get(node, -1))
    return total


def _greedy(gm: fx.GraphModule, nodes: list[fx.Node]) -> list[fx.Node]:
    """A topological order that, among the ready nodes, runs first the one that closes the most
    bytes (values whose last user it is) for the fewest it opens; ties keep the traced order."""
    index = {node: i for i, node in enumerate(nodes)}
    waiting = {node: sum(1 for n in node.all_input_nodes if n in index) for node in nodes}
    remaining_users = {node: sum(1 for u in node.users if u in index) for node in gm.graph.nodes}
    ready = [node for node in nodes if waiting[node] == 0]
    order = []
    while ready:

        def gain(node: fx.Node) -> tuple[int, int]:
            closed = sum(int(n.meta.get("bytes", 0)) for n in node.all_input_nodes if remaining_users.get(n) == 1)
            opened = int(node.meta.get("bytes", 0)) if node.users else 0
            return (opened - closed, index[node])

        node = min(ready, key=gain)
        ready.remove(node)
        order.append(node)
        for n in node.all_input_nodes:
            remaining_users[n] = remaining_users.get(n, 1) - 1
        for user in node.users:
            if user in waiting:
                waiting[user] -= 1
                if waiting[user] == 0:
                    ready.append(user)
    return order


def keeps_traced_order(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> bool:
    """Whether `nodes` write tensors in place or read by name a buffer another node writes: their
    reads rely on the traced order, as no edge orders a read before a write."""
    return any(written_arguments(gm, node) for node in nodes) or reads_written_state(gm, nodes)


def linearize(gm: fx.GraphModule) -> list[fx.Node]:
    """The compute nodes in a topological order; stages are contiguous runs of this list.

    Placeholders, `get_attr` and the output node are not placed: inputs come from the caller,
    attributes are read in every stage that uses them, and the output is gathered at the end.
    Of the traced order (which follows the model's forward and keeps a module's nodes together)
    and a greedy order that closes open values early, the one with fewer `open_bytes` is taken;
    a graph that writes tensors in place (`relu_`, `aten.fill_.Scalar`, `out=`), or reads by name
    a buffer another node writes (a running mean read after its norm), keeps the traced order,
    which its reads rely on: a read before a write has no edge to the write that says so.
    """
    traced = [node for node in gm.graph.nodes if node.op in COMPUTE_OPS]
    if keeps_traced_order(gm, traced):
        return traced
    greedy = _greedy(gm, traced)
    return greedy if open_bytes(greedy) < open_bytes(traced) else traced
