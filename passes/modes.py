"""A second graph of the same model, traced in the other training mode, cut like the first.

`if self.training:` branches and `F.dropout(x, p, self.training)` are decided when a model is
traced, so eval mode needs its own graph. Its nodes go to the stage of their namesakes in the
training graph, so each module runs on the device that holds its parameters; a node the
training graph lacks goes to the latest stage among its inputs. A stage never precedes its
inputs' stages, so values only travel forward.
"""
from __future__ import annotations

import torch.fx as fx

from fxpipe.passes.linearize import COMPUTE_OPS


def _same_call(a: fx.Node, b: fx.Node) -> bool:
    return a.op == b.op and a.target == b.target


def follow_stages(graph: fx.GraphModule, like: fx.GraphModule, stages: int) -> list[list[fx.Node]]:
    """Cut `graph` into `stages` runs following `like`'s `node.meta["stage"]`; sets the same
    meta on `graph`'s compute nodes. A run may be empty when a stage has nothing to do in this
    mode."""
    known = {node.name: node for node in like.graph.nodes if "stage" in node.meta}
    runs: list[list[fx.Node]] = [[] for _ in range(stages)]
    for node in graph.graph.nodes:
        if node.op not in COMPUTE_OPS:
            continue
        earliest = max((int(n.meta.get("stage", 0)) for n in node.all_input_nodes), default=0)
        twin = known.get(node.name)
        wanted = int(twin.meta["stage"]) if twin is not None and _same_call(twin, node) else earliest
        node.meta["stage"] = max(wanted, earliest)
        runs[node.meta["stage"]].append(node)
    return runs
