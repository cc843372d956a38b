"""Pictures of a plan: the stage graph as graphviz SVG, one cluster per stage.

Activation edges (to the next stage) are solid; stash/pop edges (skips over stages) are dashed
and labelled with the value and its shape. A stage with many nodes shows one box per module
group rather than one per node, so a 24-block model stays readable.
"""
from __future__ import annotations

import html
from collections import OrderedDict
from typing import Any

import graphviz

from fxpipe.compiled.plan import Plan, StagePlan, human_bytes
from fxpipe.core.edges import ACTIVATION, INPUT, OUTPUT, SKIP

MAX_BOXES = 12


def _groups(stage: StagePlan) -> "OrderedDict[str, list[str]]":
    """Nodes grouped by module path, at the deepest level that gives at most MAX_BOXES boxes."""
    if len(stage.nodes) <= MAX_BOXES:
        return OrderedDict((node, [node]) for node in stage.nodes)
    best: "OrderedDict[str, list[str]]" = OrderedDict()
    for depth in range(1, 6):
        groups: "OrderedDict[str, list[str]]" = OrderedDict()
        for node, module in zip(stage.nodes, stage.modules):
            key = ".".join(module.split(".")[:depth]) if module else "(top level)"
            groups.setdefault(key, []).append(node)
        if len(groups) > MAX_BOXES and best:
            break
        best = groups
    return best


def _shape(value: Any) -> str:
    if isinstance(value, (tuple, list)) and all(isinstance(v, int) for v in value):
        return "×".join(map(str, value))
    return str(value)


def plan_to_graph(plan: Plan) -> graphviz.Digraph:
    """The stage graph as a graphviz Digraph (render it with `.pipe(format='svg')`)."""
    dot = graphviz.Digraph("plan", graph_attr={"rankdir": "LR", "fontname": "Helvetica", "nodesep": "0.15", "ranksep": "0.6"})
    dot.attr("node", shape="box", style="rounded,filled", fillcolor="white", fontname="Helvetica", fontsize="10")
    dot.attr("edge", fontname="Helvetica", fontsize="9")
    dot.node("input", "input", shape="ellipse", fillcolor="#eeeeee")
    dot.node("output", "output", shape="ellipse", fillcolor="#eeeeee")
    box_of: dict[str, str] = {}
    first_box: dict[int, str] = {}
    for stage in plan.stages:
        groups = _groups(stage)
        label = f"stage {stage.index} · {stage.device} · {len(stage.nodes)} nodes · params {human_bytes(stage.param_bytes)}"
        with dot.subgraph(name=f"cluster_{stage.index}") as cluster:
            cluster.attr(label=label, style="rounded,filled", fillcolor="#e8f0fe", color="#4a6fa5")
            cluster.attr(rank="same")  # left to right, stage after stage; a stage's boxes in a column
            for index, (name, nodes) in enumerate(groups.items()):
                box = f"s{stage.index}_{index}"
                text = name if len(nodes) == 1 and nodes[0] == name else f"{name}\n({len(nodes)} nodes)"
                cluster.node(box, html.escape(text))
                for node in nodes:
                    box_of[node] = box
                first_box.setdefault(stage.index, box)
    sink = len(plan.stages)
    for edge in plan.edges:
        tail = "input" if edge.kind == INPUT else box_of.get(edge.value, first_box.get(edge.src, "input"))
        head = "output" if edge.dst == sink else first_box[edge.dst]
        label = f"{edge.value}\n{_shape(edge.shape)}"
        if edge.kind == SKIP:
            dot.edge(tail, head, label=label, style="dashed", color="#c0392b", fontcolor="#c0392b")
        elif edge.kind in (ACTIVATION, INPUT, OUTPUT):
            dot.edge(tail, head, label=label)
    return dot


def plan_to_svg(plan: Plan) -> str:
    """The stage graph as SVG text (needs Graphviz's `dot` on the PATH)."""
    try:
        return plan_to_graph(plan).pipe(format="svg").decode("utf-8")
    except graphviz.ExecutableNotFound as error:
        raise RuntimeError(
            "drawing the plan needs Graphviz's `dot` program, which is not on the PATH.\n"
            "How to fix: install it (Debian/Ubuntu: apt-get install graphviz; macOS: brew install graphviz)."
        ) from error
