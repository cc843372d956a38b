"""Cross-stage edges: which values travel from which stage to which, and how.

Stage -1 stands for the caller (the pipeline's inputs) and stage n for the gathered output. A
value travels straight from the stage that makes it to every stage that uses it:

    stage:    0 ────▶ 1 ────▶ 2 ────▶ 3          activation: to the next stage
              └───────────────▶ 2                skip (stash at 0, pop at 2): never relayed by 1
              └───────────────────────▶ 3        the same value, again straight to its user

so stage 1 neither receives nor forwards what it does not use, and in backward the gradients
that come back from stages 2 and 3 are summed at stage 0. A skip jumps over a stage that lies
between its ends in the stage graph; where none does (branches side by side: stage 1 reads only
the inputs, stage 2 reads stage 0), the edge is stage 2's activation, whatever the indices.
"""
from __future__ import annotations

from typing import Sequence

import networkx as nx
import torch.fx as fx

from fxpipe.core.edges import ACTIVATION, CALLER, INPUT, OUTPUT, SKIP, Edge
from fxpipe.passes.inplace import check_writes_across_stages
from fxpipe.passes.linearize import COMPUTE_OPS

__all__ = ["find_edges", "stage_inputs", "stage_outputs"]

def _kind(src: int, dst: int, sink: int, direct: set[tuple[int, int]]) -> str:
    if src == CALLER:
        return INPUT
    if dst == sink:
        return OUTPUT
    return ACTIVATION if (src, dst) in direct else SKIP


def _direct(links: set[tuple[int, int]]) -> set[tuple[int, int]]:
    """The links between stages with no stage between their ends (the transitive reduction of
    the stage graph: stages come in topological order, so it is a DAG)."""
    graph = nx.DiGraph(links)
    return set(nx.transitive_reduction(graph).edges) if graph.number_of_nodes() else set()


def _stage_of(node: fx.Node, sink: int) -> int:
    if node.op == "output":
        return sink
    if node.op == "placeholder":
        return CALLER
    return int(node.meta["stage"])


def find_edges(gm: fx.GraphModule, stages: int) -> list[Edge]:
    """Every (value, consumer stage) pair that crosses a stage boundary, in graph order.

    Needs `node.meta["stage"]` from `partition`; stage `stages` is the pipeline's output.
    In-place writes that no edge can carry are refused here, at compile time.
    """
    check_writes_across_stages(gm)
    crossing = []
    for node in gm.graph.nodes:
        if node.op != "placeholder" and node.op not in COMPUTE_OPS:
            continue
        src = _stage_of(node, stages)
        crossing += [(node, src, dst) for dst in sorted({_stage_of(user, stages) for user in node.users} - {src})]
    direct = _direct({(src, dst) for _, src, dst in crossing if src != CALLER and dst != stages})
    return [
        Edge(
            value=node.name,
            src=src,
            dst=dst,
            kind=_kind(src, dst, stages, direct),
            shape=node.meta.get("shape"),
            dtype=node.meta.get("dtype"),
            nbytes=int(node.meta.get("bytes", 0)),
        )
        for node, src, dst in crossing
    ]


def stage_inputs(edges: Sequence[Edge], stage: int) -> list[str]:
    """The values `stage` receives, in graph order."""
    return [e.value for e in edges if e.dst == stage]


def stage_outputs(edges: Sequence[Edge], stage: int) -> list[str]:
    """The values `stage` sends on, each once, in graph order."""
    return list(dict.fromkeys(e.value for e in edges if e.src == stage))
