"""A second graph of the same model, traced in the other training mode, cut like the first.

`if self.training:` branches and `F.dropout(x, p, self.training)` are decided when a model is
traced, so eval mode needs its own graph. A node of it that reads the model's state (a module's
parameters and buffers, or a tensor attribute it takes) goes to the first stage, at or after its
inputs' stages, that reads the same state in the training graph: each parameter stays on the
device that holds it in training, and across processes on the rank that trains it. Any other
node goes to the latest stage among its inputs. A stage never precedes its inputs' stages, so
values only travel forward. An in-place write through a view runs in one stage with the views
it writes through (as the training cut keeps them, passes/state.write_chains): they all go to
the latest of their stages.
"""
from __future__ import annotations

import torch.fx as fx

from fxpipe.core.attrs import tensors_read
from fxpipe.passes.linearize import COMPUTE_OPS
from fxpipe.passes.state import write_chains


def follow_stages(graph: fx.GraphModule, like: fx.GraphModule, stages: int) -> list[list[fx.Node]]:
    """Cut `graph` into `stages` runs following `like`'s `node.meta["stage"]`; sets the same
    meta on `graph`'s compute nodes. A run may be empty when a stage has nothing to do in this
    mode."""
    held: dict[int, set[int]] = {}  # a tensor's id -> the training stages that read it
    for node in like.graph.nodes:
        if "stage" in node.meta:
            for tensor in tensors_read(like, node).values():
                held.setdefault(id(tensor), set()).add(int(node.meta["stage"]))
    chains = [c for c in ([n for n in chain if n.op in COMPUTE_OPS] for chain in write_chains(graph)) if len(c) > 1]
    at_least: dict[fx.Node, int] = {}
    while True:
        _place(graph, held, at_least)
        moved = False
        for chain in chains:
            latest = max(int(n.meta["stage"]) for n in chain)
            for n in chain:
                if int(n.meta["stage"]) < latest:
                    at_least[n], moved = latest, True
        if not moved:  # stages only grow: this ends
            break
    runs: list[list[fx.Node]] = [[] for _ in range(stages)]
    for node in graph.graph.nodes:
        if node.op in COMPUTE_OPS:
            runs[node.meta["stage"]].append(node)
    return runs


def _place(graph: fx.GraphModule, held: dict[int, set[int]], at_least: dict[fx.Node, int]) -> None:
    for node in graph.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        earliest = max([at_least.get(node, 0), *(int(n.meta.get("stage", 0)) for n in node.all_input_nodes)])
        readers = sorted({s for t in tensors_read(graph, node).values() for s in held.get(id(t), ())})
        node.meta["stage"] = next((s for s in readers if s >= earliest), earliest)
