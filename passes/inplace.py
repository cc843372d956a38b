"""In-place writes: which ops write a tensor they are given, and what later readers must see.

    a = f(x)                          a = f(x)
    b = relu_(a)        ─────▶        b = relu_(a)
    c = g(a)                          c = g(b)      # the reader after the write reads the writer

    h = f(x)                          h = f(x)
    v = h[:, :4]                      v = h[:, :4]
    w = v.mul_(2)       ─────▶        w = v.mul_(2)
    y = g(h)                          h_written = written(h, w)   # h, once w has run
                                      y = g(h_written)

Within one stage the graphs do the same thing (`b` is `a`, `h_written` is `h`). Across stages they
do not: stage boundaries copy values, so a stage that received `a` (or `h`) from its producer
would never see another stage's write. Reading the writer's result instead carries the write
along the edges, from the stage that made it. Writes are found from the op's schema where it has
one (the aten ops of torch.export graphs, `aten.fill_.Scalar`), else from the `name_` convention.
"""
from __future__ import annotations

import operator
import re
from typing import Any, Sequence

import torch
import torch.fx as fx

from fxpipe.core.attrs import COMPUTE_OPS
from fxpipe.core.writes import changes_metadata_only, is_view, may_copy, returns_written, view_root, writes_a_view, writes_first_argument, written_arguments, written_value
from fxpipe.passes.opaque_writes import mark_opaque_writes

def written(value: torch.Tensor, write: Any) -> torch.Tensor:
    """`value`, read after `write` (an in-place op on a view of it) has run: the node that calls
    this depends on the write, so a later stage receives `value` from the stage that wrote it."""
    return value


def mark_copies(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> None:
    """`meta["copies"] = True` on each op that returns a view or a copy as its input decides
    (`reshape`, `contiguous`, `to`: `may_copy`), of a tensor written in place, that returned a
    copy on the example: a write through it is to the copy, not to its input (BEiT's
    `permute(...).contiguous()` index, then written), and a write to its input does not show
    through it (`h.transpose(1, 2).reshape(...)` made before `h.relu_()`). Runs the graph once,
    only where such an op and such a write exist."""
    targets = [written_value(gm, writer) for writer in gm.graph.nodes]
    written = {_alias_root(gm, target) for target in targets if target is not None}
    suspects = {node for node in gm.graph.nodes if may_copy(node) and _alias_root(gm, node) in written} if written else set()
    if suspects:
        from fxpipe.passes.shapes import run_watching  # the shape pass's runner: real or on meta

        def watch(node: fx.Node, value: Any, args: tuple[Any, ...]) -> None:
            if node in suspects and isinstance(value, torch.Tensor) and isinstance(args[0], torch.Tensor):
                node.meta["copies"] = value.untyped_storage()._cdata != args[0].untyped_storage()._cdata

        try:
            run_watching(gm, inputs, watch)
        except Exception:  # noqa: BLE001 - not runnable here: each stays a view, as before
            pass


def _alias_root(gm: fx.GraphModule, node: fx.Node) -> fx.Node:
    """Follow views, and in-place writes (`x.mul_(2)` returns `x`), back to the tensor whose
    memory they share."""
    while is_view(node) or writes_first_argument(gm, node):
        first = node.args[0]
        assert isinstance(first, fx.Node)
        node = first
    return node


def input_writes(gm: fx.GraphModule) -> dict[str, list[fx.Node]]:
    """Per input of the graph written in place, the nodes that write it, in graph order."""
    found: dict[str, list[fx.Node]] = {}
    for node in gm.graph.nodes:
        target = written_value(gm, node) if node.op in COMPUTE_OPS else None
        root = _alias_root(gm, target) if target is not None else None
        if root is not None and root.op == "placeholder":
            found.setdefault(root.name, []).append(node)
    return found


def input_write_spans(gm: fx.GraphModule, order: Sequence[fx.Node]) -> dict[str, tuple[int, int]]:
    """For each input written in place at several places, the positions from its first write to
    its last: one stage must make them all, since a stage copies back into the caller's tensor
    only what it wrote itself."""
    position = {node: i for i, node in enumerate(order)}
    spans = {}
    for name, writers in input_writes(gm).items():
        places = [position[n] for n in writers if n in position]
        if len(places) > 1:
            spans[f"the input {name!r}, which forward writes in place at {len(places)} places,"] = (min(places), max(places))
    return spans


def _stage_local_root(node: fx.Node, run: set[fx.Node]) -> fx.Node:
    """`view_root`, stopping at the first value the run does not make (a value it receives)."""
    while node in run and is_view(node):
        first = node.args[0]
        assert isinstance(first, fx.Node)
        node = first
    return node


def mutated_inputs(gm: fx.GraphModule, run: Sequence[fx.Node], inputs: Sequence[str]) -> set[str]:
    """Stage inputs that the stage writes in place (say, a ReLU(inplace=True) on a received value,
    or `h[:, :4].mul_(2)` on a received `h`).

    They are cloned on entry: a received value is an autograd leaf, the stage that sent it may
    still need it (for its backward, or another stage may read the same tensor), and a
    checkpointed stage must find its saved inputs unchanged when it recomputes.
    """
    nodes, found = set(run), set()
    for node in run:
        for target in written_arguments(gm, node):
            root = _stage_local_root(target, nodes)
            if root.name in inputs:
                found.add(root.name)
    return found


# -- readers after a write read what the write left -----------------------------------------------
def _redirect(old: fx.Node, new: fx.Node, writer: fx.Node, position: dict[fx.Node, float]) -> None:
    """Readers of `old` that come after `writer` read `new` instead."""
    for reader in list(old.users):
        if reader is not writer and reader is not new and position[reader] > position[writer]:
            reader.replace_input_with(old, new)


def _views_of(root: fx.Node) -> list[fx.Node]:
    """Every view of `root`, through chains of views, in graph order."""
    found, frontier = [], [root]
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if is_view(user) and user.args[0] is node and user not in found:
                found.append(user)
                frontier.append(user)
    return found


def _rebase_stale_views(graph: fx.Graph, root: fx.Node, after: fx.Node, writer: fx.Node, position: dict[fx.Node, float]) -> None:
    """A view of `root` made before the write and read after it: the reader gets the same view
    made again from `after`, so that it sees the write whichever stage it runs in; so do the
    views it is made from (`h.view(...)` then `[0]`), whose readers before the write keep theirs."""
    views = [v for v in sorted(_views_of(root), key=position.__getitem__) if position[v] < position[writer] and v is not writer.args[0]]
    late = {v: [(r, alias) for alias in _written_as(graph, v, writer, position) for r in alias.users
                if position[r] > position[writer] and r is not writer and r.target is not written] for v in views}  # fmt: skip
    first: dict[fx.Node, fx.Node] = {}  # the first reader after the write of it or of a view made from it
    for view in reversed(views):
        readers = [r for r, _ in late[view]] + [first[user] for user in view.users if user in first]
        if readers:
            first[view] = min(readers, key=position.__getitem__)
    remade: dict[fx.Node, fx.Node] = {root: after}
    for view in (v for v in views if v in first):
        base = remade.get(view.args[0], view.args[0])  # type: ignore[arg-type]
        with graph.inserting_before(first[view]):
            copy = graph.node_copy(view, lambda n: base if n is view.args[0] else n)
        position[copy] = position[first[view]] - 0.25
        remade[view] = copy
        for reader, alias in late[view]:
            reader.replace_input_with(alias, copy)


def _reads_of(graph: fx.Graph, root: fx.Node) -> list[fx.Node]:
    """`root`, and for a parameter or buffer every other `get_attr` node of it: each read by name
    is a node of its own, and a read after the write must see it as a read of `root` does."""
    if root.op != "get_attr":
        return [root]
    return [root, *(n for n in graph.nodes if n.op == "get_attr" and n.target == root.target and n is not root)]


def _written_as(graph: fx.Graph, view: fx.Node, writer: fx.Node, position: dict[fx.Node, float]) -> list[fx.Node]:
    """`view`, and what in-place writes of it before `writer` returned (`v.mul_(0.5)` is `v`):
    a reader of either after the write reads the view as the write left it."""
    found, frontier, owner = [view], [view], graph.owning_module
    while frontier and owner is not None:
        node = frontier.pop()
        for user in node.users:
            if user is not writer and position[user] < position[writer] and user.args and user.args[0] is node \
                    and user.target is not operator.setitem and writes_first_argument(owner, user) and user not in found:  # fmt: skip
                found.append(user)
                frontier.append(user)
    return found


def _carry_write(graph: fx.Graph, writer: fx.Node, target: fx.Node, returns_target: bool, position: dict[fx.Node, float]) -> None:
    """Readers after `writer`, which writes `target` in place, read what it left (the rules above)."""
    root = view_root(target)
    if returns_target:
        _redirect(target, writer, writer, position)
    if changes_metadata_only(writer):  # (`h.transpose_(1, 2)`: the values stay; older views keep their shapes)
        return
    if target is root and returns_target:
        after = writer
    else:
        with graph.inserting_after(writer):
            after = graph.call_function(written, (root, writer))
        after._rename(f"{root.name}_written")
        position[after] = position[writer] + 0.5
    for read in _reads_of(graph, root):  # a buffer read by name again (`self.ema`) is another node
        _redirect(read, after, writer, position)
    while root.op != "get_attr":
        _rebase_stale_views(graph, root, after, writer, position)
        if not (root.op == "call_function" and root.target is written):
            break
        root = root.args[0]  # type: ignore[assignment]  # as an earlier write left it: its views too


def redirect_reads_after_writes(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> fx.GraphModule:
    """Make every reader that comes after an in-place write read what the write left.

    A direct write (`relu_(a)`, `aten.fill_(a, 1)`) returns the tensor it writes: later readers
    of `a` read the writer. A write through a view (`h[:, :4].mul_(2)`, `aten.slice` then
    `aten.mul_`) or one that returns nothing (`h[0] = 1`) gets a `written(h, write)` node right
    after it, which later readers of `h` read; views of `h` made before the write and read after
    it are made again from that node. A parameter or buffer written through a view is read after the
    write as `written(buffer, write)` too, by every read of it by name: a later stage receives it
    from the stage that wrote it, as written by the same micro-batch (passes/state.py keeps its
    reads before the write and its writes in one stage).
    """
    mark_opaque_writes(gm, inputs)
    mark_copies(gm, inputs)
    graph = gm.graph
    position = {node: float(i) for i, node in enumerate(graph.nodes)}
    changed = False  # a graph without writes keeps its code: generating it costs milliseconds
    for writer in list(graph.nodes):
        direct = written_value(gm, writer)
        # A write in a subgraph (torch.export's `no_grad` region) writes the operands it names.
        for target in [direct] if direct is not None else written_arguments(gm, writer):
            changed = True
            _carry_write(graph, writer, target, returns_target=direct is not None and returns_written(writer, target), position=position)
    if changed:
        gm.recompile()
    return gm


# -- what cannot be made right across stages --------------------------------------------------------
class InplaceError(ValueError):
    """An in-place write that no cut of stages can run as the plain model does."""


def _where(node: fx.Node) -> str:
    """The model's source line of `node`, from its stack trace, else its module."""
    frames = re.findall(r'File "([^"]+)", line (\d+), in \S+\n\s*(.*)', node.stack_trace or "")
    if frames:
        path, line, code = frames[-1]
        return f"{path}:{line}: {code.strip()}"
    scope = node.meta.get("scope") or (node.target if node.op == "call_module" else "")
    return f"in {scope!r}" if scope else "in the model's forward"


def _describe(node: fx.Node) -> str:
    op = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", node.target)
    return f"`{node.name}` ({op}, {_where(node)})"


def _stage(node: fx.Node) -> int:
    return int(node.meta.get("stage", -1))


def _write_problems(gm: fx.GraphModule, writer: fx.Node, target: fx.Node, position: dict[fx.Node, int]) -> list[str]:
    problems, view = [], target
    while is_view(view) or writes_a_view(gm, view):
        if _stage(view) != _stage(writer):
            problems.append(
                f"{_describe(writer)} in stage {_stage(writer)} writes through the view `{view.name}` "
                f"made in stage {_stage(view)}: the stage boundary falls between the view and the write"
            )
            break
        view = view.args[0]  # type: ignore[assignment]
    root = view_root(target)
    for reader in root.users:
        if position[reader] < position[writer] and _stage(reader) > _stage(writer):
            problems.append(
                f"{_describe(writer)} in stage {_stage(writer)} writes `{root.name}`, which "
                f"`{reader.name}` in the later stage {_stage(reader)} reads as it was before the write"
            )
    return problems


def check_writes_across_stages(gm: fx.GraphModule) -> None:
    """Refuse, at compile time, in-place writes whose stages would compute something else than
    the plain model: a write cut off from the view it writes through or from the `written` node
    after it, a value read by a later stage as it was before the write, and one parameter,
    buffer or input written by two stages. Needs `node.meta["stage"]`."""
    problems: list[str] = []
    position = {node: i for i, node in enumerate(gm.graph.nodes)}
    state_writers: dict[str, set[int]] = {}
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target is written and isinstance(node.args[1], fx.Node):
            write = node.args[1]
            if _stage(write) != _stage(node):
                problems.append(
                    f"{_describe(write)} runs in stage {_stage(write)}, and the stage boundary falls "
                    f"right after it: stage {_stage(node)} could not see what it wrote"
                )
        target = written_value(gm, node) if node.op in COMPUTE_OPS else None
        # (what an opaque call wrote on the example: passes/opaque_writes.py)
        for target in [target] if target is not None else node.meta.get("writes_seen", []):
            if view_root(target).op == "get_attr":
                state_writers.setdefault(str(view_root(target).target), set()).add(_stage(node))
            problems += _write_problems(gm, node, target, position)
    for name, stages in state_writers.items():
        if len(stages) > 1:
            problems.append(f"the parameter or buffer {name!r} is written in place by stages {sorted(stages)}")
    for name, writers in input_writes(gm).items():
        writing = sorted({_stage(writer) for writer in writers})
        if len(writing) > 1:  # each stage copies back only its own write into the caller's tensor
            problems.append(f"the input {name!r} is written in place by stages {writing}")
    if problems:
        raise InplaceError(
            "cannot run these in-place writes across stages as the model does:\n"
            + "\n".join(f"  - {p}" for p in dict.fromkeys(problems))
            + "\nHow to fix: move the cut (balance=[...] or split_points=[...]) so that each write, the "
            "views it writes through and the node after it are in one stage, or write the value out "
            "of place (`h = h * scale` instead of `h[:, :4].mul_(2)`, `torch.where`, `torch.cat`)."
        )
