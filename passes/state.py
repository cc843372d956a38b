"""Which buffers and parameters a run of nodes may write in forward: what a recompute must not write again."""
from __future__ import annotations

import operator
from typing import Any, Sequence

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import parametrize

from fxpipe.core.attrs import fetch_attr, tensors_read
from fxpipe.core.writes import is_view, operand_returned, operands_written_inside, subgraph_call, writes_a_view, writes_first_argument, written_arguments, written_value
from fxpipe.passes.inplace import written


# `node.meta[ASSIGNS]`: a call of a module called whole whose forward assigns what it holds (a
# counter in a settings object); the front end marks them.
ASSIGNS = "assigns"


def _writes_its_buffers(module: nn.Module) -> bool:
    """Norms keep running statistics; a module called whole may write anything it holds, and so
    may its forward hooks and parametrizations (spectral_norm's power iteration, in either form,
    updates its vectors in place)."""
    if has_forward_hooks(module) or (parametrize.is_parametrized(module) and _parametrizations_write(module)):
        return True
    if isinstance(module, parametrize.ParametrizationList):  # a parametrized tensor read apart from its module's forward
        return _chain_writes(module)
    if isinstance(module, nn.modules.batchnorm._NormBase):  # `track_running_stats` may be turned on later
        return module.track_running_stats or module.running_mean is not None
    return not type(module).__module__.startswith("torch.nn.")


def _parametrizations_write(module: nn.Module) -> bool:
    """spectral_norm's parametrization updates its vectors in training; torch's others (orthogonal,
    weight_norm) only read what they hold, and one of the user's may write anything."""
    chains: nn.ModuleDict = module.parametrizations  # type: ignore[assignment]
    return any(_chain_writes(chain) for chain in chains.values())


def _chain_writes(chain: nn.Module) -> bool:
    """Whether one tensor's chain of parametrizations may write what it holds."""
    kinds = [type(p) for p in chain.children()]
    return any(kind.__module__ != "torch.nn.utils.parametrizations" or kind.__name__ == "_SpectralNorm" for kind in kinds)


def has_forward_hooks(module: nn.Module) -> bool:
    """Whether the module runs hooks of its own around its forward, when called whole."""
    return bool(module._forward_pre_hooks or module._forward_hooks)


def writable_buffer_names(gm: fx.GraphModule, run: Sequence[fx.Node]) -> list[str]:
    """Qualified names of the buffers that `run` may write (`buffers_written` of its nodes)."""
    return list({name: None for node in run for name in buffers_written(gm, node)})


def writable_buffers(stage: nn.Module, gm: fx.GraphModule, run: Sequence[fx.Node]) -> dict[str, torch.Tensor]:
    """`writable_buffer_names` that are buffers of the generated `stage`, by name in it."""
    found = {}
    for name in writable_buffer_names(gm, run):
        try:
            found[name] = stage.get_buffer(name)
        except AttributeError:
            continue  # read through a shared copy, not held by the stage
    return found


RENORMS = "with max_norm, which renormalises the rows it looks up"


def parameters_written(gm: fx.GraphModule, run: Sequence[fx.Node]) -> dict[str, tuple[torch.Tensor, str]]:
    """The parameters `run` writes in place in forward, by qualified name, each with what writes
    it: an Embedding with max_norm called whole or inside a module called whole (it renormalises
    the rows it looks up), or an op writing a parameter (`embedding_renorm_`, a write under no_grad)."""
    found = {}
    for node in run:
        if node.op == "call_module":  # the module, or one inside a module kept whole
            for name, module in fetch_attr(gm, str(node.target)).named_modules(prefix=str(node.target)):
                if isinstance(module, (nn.Embedding, nn.EmbeddingBag)) and module.max_norm is not None:
                    found[f"{name}.weight"] = (module.weight, f"`{name}`, an {type(module).__name__} {RENORMS}")
            continue
        written, renorms = buffers_written(gm, node), _renorms(node)
        functional = renorms and node.target in (F.embedding, F.embedding_bag)  # (the op's own write is seen)
        root = _state_root(gm, node.args[1]) if functional and isinstance(node.args[1], fx.Node) else None
        if root is not None:
            written[str(root.target)] = fetch_attr(gm, str(root.target))
        writer = f"`{node.name}`" + (f" {RENORMS}" if renorms else "")
        for name, tensor in written.items():
            if isinstance(tensor, nn.Parameter):
                found[name] = (tensor, writer)
    return found


def _renorms(node: fx.Node) -> bool:
    """A call of F.embedding or F.embedding_bag with max_norm, or of the op they call then (in
    an exported graph): it writes its weight."""
    if node.target is torch.ops.aten.embedding_renorm_.default:
        return True
    if node.op != "call_function" or node.target not in (F.embedding, F.embedding_bag) or len(node.args) < 2:
        return False
    max_norm = node.args[3] if len(node.args) > 3 else node.kwargs.get("max_norm")  # (input, weight, _, max_norm) in both
    return max_norm is not None


def rewritten_by_recompute(gm: fx.GraphModule, runs: Sequence[Sequence[fx.Node]], micro_batches: int) -> list[str]:
    """The parameters a stage's forward writes in place, each as a line, where another stage
    reads them (a recompute of the writer writes them again while the reader may hold them for
    its backward) or, with several `micro_batches`, in any case (the next micro-batch's forward
    writes them before this one's recompute): autograd then finds them changed, as the plain
    model never does. With one, a write but a renorm's (which finds its rows within max_norm
    then) would run twice: an update kept in a parameter under no_grad, applied again."""
    problems = []
    for index, run in enumerate(runs):
        for name, (tensor, writer) in parameters_written(gm, run).items():
            others = [k for k, other in enumerate(runs) if k != index and any(t is tensor for n in other for t in tensors_read(gm, n).values())]
            if others:
                readers = f"stage {others[0]} reads" if len(others) == 1 else f"stages {others} read"
                problems.append(f"{name!r}: stage {index} writes it in place ({writer}), and {readers} it")
            elif micro_batches > 1:
                problems.append(f"{name!r}: stage {index} writes it in place ({writer}) in each micro-batch's forward, "
                                "the next one's before this one's recompute")  # fmt: skip
            elif RENORMS not in writer:  # a renorm leaves its rows within max_norm: the recompute's writes nothing
                problems.append(f"{name!r}: stage {index} writes it in place ({writer}), and its recompute would write it "
                                "a second time (an average kept in a parameter, say)")  # fmt: skip
    return problems


def aliases_state(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node`'s value is a parameter or buffer of the model, or a view of one, through
    views and in-place writes (`self.count.add_(1)` is the buffer itself)."""
    return _state_root(gm, node) is not None


def aliases_input(gm: fx.GraphModule, node: fx.Node) -> bool:
    """Whether `node`'s value is the caller's memory in the plain model: a view of an input (`x[:, :2]`,
    `x.detach()`), a tensor held in an input (`pack["m"]`, `pack[1]`), through views and in-place writes;
    not an input itself (`x`, which a pipeline returns as it is)."""
    root = _state_root(gm, node, through_items=True)
    return root is not None and root.op == "placeholder" and root is not node


def _state_root(gm: fx.GraphModule, node: fx.Node, through_items: bool = False) -> fx.Node | None:
    """The `get_attr` node whose tensor `node` is, through views, in-place writes and subgraphs
    that return an operand, if any."""
    seen = set()
    while node not in seen:
        seen.add(node)
        if node.op == "get_attr" or (through_items and node.op == "placeholder"):
            return node
        if through_items and node.target is operator.getitem and isinstance(node.args[0], fx.Node) and isinstance(node.args[1], (int, str)):
            node = node.args[0]  # an item of a container (an input's dict or tuple), or a row of a tensor
            continue
        returned = operand_returned(gm, node)
        if returned is not None:
            node = returned
        elif node.op == "call_function" and node.target is written:  # the buffer, as a write through a view left it
            node = node.args[0]  # type: ignore[assignment]
        elif node.args and isinstance(node.args[0], fx.Node) and (is_view(node) or writes_first_argument(gm, node)):
            node = node.args[0]
        else:
            return None
    return None


def state_write_spans(gm: fx.GraphModule, order: Sequence[fx.Node]) -> dict[str, tuple[int, int]]:
    """For each buffer that forward writes (in place, or by a module called whole that keeps
    running statistics: a BatchNorm called at several depths), the positions in `order` from its
    first use to its last write. A stage boundary inside a span would let two stages touch it at
    once: writes split across stages interleave the micro-batches otherwise than the plain model
    does, and an earlier stage reading it would race with a later stage's write. Reads after the
    last write may be anywhere: a later stage gets the value of its own micro-batch. The copy
    `reads_after_hidden_writes` makes right after a write ends the span: a later stage copying
    the live buffer would copy a later micro-batch's write."""
    writes = [buffers_written(gm, node) for node in order]
    names: dict[int, str] = {}
    last_write: dict[int, int] = {}
    for position, written_here in enumerate(writes):
        for name, tensor in written_here.items():
            names.setdefault(id(tensor), name)
            last_write[id(tensor)] = position
        if order[position].meta.get(_COPY_AFTER_WRITE):
            for tensor in tensors_read(gm, order[position]).values():
                if id(tensor) in last_write:
                    last_write[id(tensor)] = position
    first_use: dict[int, int] = {}
    for position, node in enumerate(order if last_write else []):
        for tensor in [*tensors_read(gm, node).values(), *writes[position].values()]:
            if id(tensor) in last_write:
                first_use.setdefault(id(tensor), position)
    spans = {f"the buffer {names[key]!r}, which forward writes,": (first_use[key], last) for key, last in last_write.items()}
    return {**spans, **_assigning_calls_spans(order)}


def _assigning_calls_spans(order: Sequence[fx.Node]) -> dict[str, tuple[int, int]]:
    """A module that assigns what it holds, called at several places (a counter read at each):
    its calls in one stage, so that they count in the plain model's order, not as two stages'
    micro-batches interleave."""
    calls: dict[str, list[int]] = {}
    for position, node in enumerate(order):
        if node.op == "call_module" and node.meta.get(ASSIGNS):
            calls.setdefault(str(node.target), []).append(position)
    return {
        f"the module {target!r}, which forward calls {len(places)} times and which assigns what it holds,": (places[0], places[-1])
        for target, places in calls.items()
        if len(places) > 1
    }  # fmt: skip


# Norms called as functions write their running statistics without saying so in their schema
# (`aten.batch_norm`'s are plain `Tensor?`): the positions (and names) of those arguments. A call
# is taken to write them whatever its `training` flag: a recompute then restores them for nothing.
_STATISTICS_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {
    F.batch_norm: ((1, "running_mean"), (2, "running_var")),
    F.instance_norm: ((1, "running_mean"), (2, "running_var")),
    torch.batch_norm: ((3, "running_mean"), (4, "running_var")),
    torch.instance_norm: ((3, "running_mean"), (4, "running_var")),
    torch.ops.aten.batch_norm.default: ((3, "running_mean"), (4, "running_var")),
    torch.ops.aten.instance_norm.default: ((3, "running_mean"), (4, "running_var")),
    torch.ops.aten.native_batch_norm.default: ((3, "running_mean"), (4, "running_var")),
    torch.ops.aten.cudnn_batch_norm.default: ((3, "running_mean"), (4, "running_var")),
}


def statistics_written(node: fx.Node) -> list[fx.Node]:
    """The running statistics a functional norm call may write."""
    if node.op != "call_function":
        return []
    found = []
    for position, name in _STATISTICS_WRITTEN.get(node.target, ()):
        value = node.args[position] if position < len(node.args) else node.kwargs.get(name)
        if isinstance(value, fx.Node):
            found.append(value)
    return found


def _statistics_written_inside(gm: fx.GraphModule, node: fx.Node) -> list[fx.Node]:
    """The operands of a higher-order op whose subgraph's norm calls write them as running
    statistics (a BatchNorm in a `no_grad` region that torch.export captured)."""
    inside = operands_written_inside(gm, node, lambda subgraph, inner: [*statistics_written(inner), *_statistics_written_inside(subgraph, inner)])
    return inside or []


def buffers_written(gm: fx.GraphModule, node: fx.Node) -> dict[str, torch.Tensor]:
    """The buffers `node` may write in forward, by qualified name: those of a module it calls
    whole that keeps running statistics or may write anything it holds, and the root of a
    tensor it writes in place (through views, earlier writes and subgraphs)."""
    found = {}
    if node.op == "call_module":
        module = fetch_attr(gm, str(node.target))
        found = dict(module.named_buffers(prefix=str(node.target))) if _writes_its_buffers(module) else {}
    for target in [*written_arguments(gm, node), *statistics_written(node), *_statistics_written_inside(gm, node)]:
        root = _state_root(gm, target)
        value = fetch_attr(gm, str(root.target)) if root is not None else None
        if root is not None and isinstance(value, torch.Tensor):
            found[str(root.target)] = value
    return found


def reads_written_state(gm: fx.GraphModule, nodes: Sequence[fx.Node]) -> bool:
    """Whether a node reads a buffer that another node writes (a running mean read by name, or
    its copy made after the norm): no edge orders the two, so only the traced order does."""
    writes = [buffers_written(gm, node) for node in nodes]
    written = {id(tensor) for found in writes for tensor in found.values()}
    return bool(written) and any(
        id(tensor) in written and id(tensor) not in {id(t) for t in own.values()}
        for node, own in zip(nodes, writes)
        for tensor in tensors_read(gm, node).values()
    )


def write_chains(gm: fx.GraphModule) -> list[list[fx.Node]]:
    """Each in-place write through a view: the writer, the `written` node that carries the write
    on, and the views it writes through, which one stage must run together; and the writes
    before it through the same view (`v.mul_(g)` then `v.add_(s)`: the second writes what the
    first returned)."""
    chains = []
    for node in gm.graph.nodes:
        # (a higher-order op's subgraph writes its operands: torch.export's no_grad region; an
        # opaque call, what it wrote on the example)
        opaque = "writes_seen" in node.meta
        targets = written_arguments(gm, node) if opaque or subgraph_call(gm, node)[0] is not None else [written_value(gm, node)]
        for target in targets:
            if target is None:
                continue
            chain = [node, *(user for user in node.users if user.target is written)]
            view = target
            while (is_view(view) or writes_a_view(gm, view)) and isinstance(view.args[0], fx.Node):
                chain.append(view)
                view = view.args[0]
            if len(chain) > 1:
                chains.append(chain)
    return chains


def view_write_spans(gm: fx.GraphModule, order: Sequence[fx.Node]) -> dict[str, tuple[int, int]]:
    """For each in-place write through a view, the positions from the first view it writes
    through to the `written` node that carries the write on: one stage must run them all."""
    position = {node: i for i, node in enumerate(order)}
    spans = {}
    for chain in write_chains(gm):
        places = [position[n] for n in chain if n in position]
        if chain[0] in position and len(places) > 1:
            spans[f"the in-place write `{chain[0].name}`"] = (min(places), max(places))
    return spans


_COPY_AFTER_WRITE = "copy_after_write"  # node.meta: a copy of a buffer right after a write to it


def reads_after_hidden_writes(gm: fx.GraphModule) -> fx.GraphModule:
    """A buffer that a module called whole or a norm op writes (BatchNorm's running mean), read
    by name after the call (`self.norm.running_mean` in forward): the read gets a copy made right
    after the call, a value of the graph like any other, as the plain model's read sees the call's
    write. Read by name in a later stage, the live buffer would hold a later micro-batch's
    write by then, and a recompute of the writing stage would write it a second time.

        norm(h) ... running_mean + y      becomes      norm(h); copy = clone(running_mean) ... copy + y
    """
    graph = gm.graph
    order = {node: i for i, node in enumerate(graph.nodes)}
    writers: dict[str, list[fx.Node]] = {}
    for node in graph.nodes:
        hidden = buffers_written(gm, node) if node.op == "call_module" else {str(b.target): b for b in statistics_written(node)}
        for name in hidden:
            writers.setdefault(name, []).append(node)
    copies: dict[tuple[str, fx.Node], fx.Node] = {}
    redirected = []
    for read in [n for n in graph.nodes if n.op == "get_attr" and str(n.target) in writers]:
        name = str(read.target)
        if any(read in written_arguments(gm, user) for user in read.users):
            continue  # the graph writes it too (`self.n.add_(1)` in a module traced through): the live buffer, for every use
        for user in list(read.users):
            before = [w for w in writers[name] if order[w] < order[user]]
            if not before or user in writers[name]:
                continue  # read before any write, or by a writer (a norm op writes what it is given)
            if (name, before[-1]) not in copies:
                with graph.inserting_after(before[-1]):
                    current = graph.get_attr(name)
                with graph.inserting_after(current):
                    copies[name, before[-1]] = graph.call_function(torch.clone, (current,))
                    copies[name, before[-1]].meta[_COPY_AFTER_WRITE] = True
            user.replace_input_with(read, copies[name, before[-1]])
            redirected.append(read)
    for read in dict.fromkeys(redirected):
        if not read.users:
            graph.erase_node(read)  # every reader reads a copy now
    if redirected:  # else its code stands: generating it again costs milliseconds
        gm.recompile()
    return gm
