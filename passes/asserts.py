"""Assertions whose message torch.fx formatted at trace time: they format it from the call's values."""
from __future__ import annotations

import re
from typing import Any

import torch
import torch.fx as fx
from torch.fx.node import has_side_effect

# What an f-string makes of a traced value: `f"got {h}"` reads "got Proxy(getitem_2)".
_PROXY = re.compile(r"Proxy\(([A-Za-z_][A-Za-z0-9_]*)\)")


@has_side_effect
def assert_showing(condition: Any, template: str, *values: Any) -> None:
    """`torch._assert(condition, template.format(*values))`, formatted only when it fails."""
    if not condition:
        torch._assert(condition, template.format(*values))


def _escaped(text: str) -> str:
    return text.replace("{", "{{").replace("}", "}}")


def show_values_in_asserts(gm: fx.GraphModule) -> fx.GraphModule:
    """Each `torch._assert` whose message names a traced value (a plain model's "Expected 16 but
    got 24!" read "got Proxy(getitem_2)!") formats it from that value at the call."""
    nodes = {node.name: node for node in gm.graph.nodes}
    changed = False
    for node in gm.graph.nodes:
        message = node.args[1] if node.op == "call_function" and node.target is torch._assert and len(node.args) > 1 else None
        if not isinstance(message, str):
            continue
        found = [m for m in _PROXY.finditer(message) if m.group(1) in nodes]
        if not found:
            continue
        pieces, last = [], 0
        for k, match in enumerate(found):
            pieces += [_escaped(message[last : match.start()]), f"{{{k}}}"]
            last = match.end()
        pieces.append(_escaped(message[last:]))
        node.target, node.args = assert_showing, (node.args[0], "".join(pieces), *(nodes[m.group(1)] for m in found))
        changed = True
    if changed:
        gm.recompile()
    return gm
