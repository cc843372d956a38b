"""Compiling for slices of a sequence: the model proved causal, its graphs rewritten to run one slice, checked on the example."""
from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, replace
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten

from fxpipe.compiled.plan import StagePlan, human_bytes
from fxpipe.compiler.traced import Traced
from fxpipe.core.attrs import fetch_attr, submodule_or_none
from fxpipe.core.carry import with_carry
from fxpipe.core.snapshot import preserved
from fxpipe.core.wording import listed
from fxpipe.passes.causal import prove_causal, prove_causal_at
from fxpipe.passes.position_tags import K, CausalityError, Positions, Proof, Q
from fxpipe.passes.sequence_slices import check_slices, slice_graph
from fxpipe.passes.state import buffers_written, has_forward_hooks
from fxpipe.passes.shapes import FlopCount, small_on_cpu
from fxpipe.schedules.slices import SliceSpec

SequenceChunks = Union[int, str, Sequence[int]]

# Seconds a slice adds on each stage whatever its length, per op of the stage (its forward and
# backward calls: on the CPU 15 us per op, fitted with benchmarks/tokens.py) and per slice
# (its tasks' hand-offs), by device type.
OP_SECONDS = {"cpu": 1.5e-5, "cuda": 5e-6}
SLICE_SECONDS = {"cpu": 3e-4, "cuda": 5e-5}


def sequence_problems(chunks: SequenceChunks, dim: int, compiled: bool) -> list[str]:
    """What is wrong with `sequence_chunks` and `sequence_dim`, or what they cannot go with."""
    if isinstance(chunks, bool) or not (isinstance(chunks, int) and chunks >= 1 or _lengths(chunks) or chunks == "auto"):
        return [
            "sequence_chunks must be a number of slices (1 or more), a list of slice lengths (each 1 or more) or "
            f"'auto', not {chunks!r}"
        ]
    problems = []
    if isinstance(dim, bool) or not isinstance(dim, int) or dim < 0:
        problems.append(f"sequence_dim must be the dim of the inputs that holds the sequence, 0 or more, not {dim!r}")
    if chunks != 1 and compiled:
        problems.append("sequence_chunks is not supported with compile_stages yet: compile with one or the other")
    return problems


def _refuse_writes_per_slice(gm: fx.GraphModule) -> None:
    """A node that writes buffers in training forward (spectral_norm's power iteration, a
    running statistic) would write them once per slice, where the plain model writes them once
    per call."""
    written = {node: sorted(found) for node in gm.graph.nodes if (found := buffers_written(gm, node))}
    if written:
        problems = [_writes_per_slice(gm, node, names) for node, names in written.items()]
        raise CausalityError(problems, fix=(
            "sequence_chunks=1 (the default): micro-batches of samples alone, each of which writes them once, as the "
            "plain model run on them in turn does; for hooks, remove them from the module while training in slices."
        ))


def _writes_per_slice(gm: fx.GraphModule, node: fx.Node, names: list[str]) -> str:
    module = submodule_or_none(gm, str(node.target)) if node.op == "call_module" else None
    if module is not None and has_forward_hooks(module):  # (what a hook does is not known: it may write them)
        return (f"{node} runs forward hooks, which would run once per slice on that slice, where the plain model runs them "
                f"once per call, and may write the buffer(s) {', '.join(names)}")
    return (f"{node} writes the buffer(s) {', '.join(names)} in training forward: in slices it would write them once per "
            "slice, where the plain model writes them once per call")


def _lengths(chunks: Any) -> bool:
    return isinstance(chunks, (list, tuple)) and bool(chunks) and all(isinstance(n, int) and not isinstance(n, bool) and n >= 1 for n in chunks)


def _refuse_a_dim_no_input_has(inputs: tuple[Any, ...], dim: int) -> None:
    shapes = [tuple(t.shape) for t in tree_flatten(list(inputs))[0] if isinstance(t, torch.Tensor)]
    if not any(len(shape) > dim for shape in shapes):
        raise ValueError(
            f"sequence_dim={dim}, and no input has a dim {dim} (the inputs' shapes: {listed(map(str, shapes))}).\nHow to fix: "
            "sequence_dim=the dim of the inputs that holds the sequence: 1 for (batch, sequence, ...), 0 for "
            "(sequence, batch, ...) with the batch's dim named in chunk_spec ({'x': 1})."
        )


def _refuse_the_batch_dim(held: dict[str, int], named: dict[str, Any], batch_dims: Optional[dict[int, Optional[int]]], dim: int, every: bool = False) -> None:
    """Slices and micro-batches cut different dims: an input that holds the sequence (`held`, by
    name: at which dim) at the dim micro-batches split it at (0 unless chunk_spec names another)
    is refused; with `every`, only where each of them is (before the proof, `held` every input
    that has the dim: the proof could only fail then, naming ops). `batch_dims` None: no
    micro-batches (chunks=1), which split nothing."""
    if batch_dims is None:
        return
    clashing = [name for name, d in held.items() if d == dim and batch_dims.get(id(named[name]), 0) == dim]
    if clashing and (not every or len(clashing) == len(held)):
        raise ValueError(
            f"sequence_dim={dim} is also the dim that micro-batches split {listed(clashing)} at (dim 0 unless chunk_spec "
            "names another): slices of the sequence and micro-batches of samples would cut the same dim.\nHow to fix: "
            "sequence_dim=the dim that holds the sequence (1 for inputs of (batch, sequence, ...)); for sequence-first "
            "inputs (sequence, batch, ...), sequence_dim=0 with the dim that holds each one's batch named in chunk_spec "
            "(chunk_spec={'x': 1})."
        )


def _with_lines(error: CausalityError, lined: Callable[[], fx.GraphModule], inputs: tuple[Any, ...], dim: int) -> CausalityError:
    """The proof's refusal again on the model traced with its lines, which it names; as it was
    where that trace fails."""
    try:
        prove_causal(lined(), inputs, dim)
    except CausalityError as again:
        return again
    except Exception:  # noqa: BLE001 - the error without lines says it all the same
        pass
    return error


def _taken(named: dict[str, Any], dim: int) -> str:
    """Where the check took the sequence to be: its longest length along `dim`, and the inputs
    that hold it (a refusal at an op may only mean `sequence_dim` names another dim)."""
    sizes = {name: t.shape[dim] for name, t in named.items() if isinstance(t, torch.Tensor) and t.dim() > dim}
    if not sizes:
        return ""
    length = max(sizes.values())
    holders = [f"{name} {tuple(named[name].shape)}" for name, size in sizes.items() if size == length]
    return f"The sequence was taken as dim {dim} (sequence_dim) of {listed(holders)}: {length} positions."


def slice_graphs(
    traced: Traced, inputs: tuple[Any, ...], chunks: SequenceChunks, dim: int, lined: Callable[[], fx.GraphModule], owner: nn.Module,
    batch_dims: Optional[dict[int, Optional[int]]],
) -> tuple[SliceSpec, LengthCheck]:
    """Rewrite `traced`'s graphs (each mode's) to run one slice of the sequence, once each is
    proved causal and its slices computed what the whole example does; raises CausalityError,
    naming each op and its line (from `lined`, the model traced again with lines), otherwise.
    With the spec, the check that proves each mode's graph again at a call's other length.
    `batch_dims`: where micro-batches split each input chunk_spec names (by the tensor's id;
    None: chunks=1)."""
    _refuse_a_dim_no_input_has(inputs, dim)
    named = dict(zip(_placeholders(traced.graph), inputs))
    having = {name: dim for name, t in named.items() if isinstance(t, torch.Tensor) and t.dim() > dim}
    _refuse_the_batch_dim(having, named, batch_dims, dim, every=True)
    _refuse_writes_per_slice(traced.graph)
    outputs: dict[str, tuple[Optional[int], ...]] = {}
    spec: Optional[SliceSpec] = None
    checked: dict[bool, Checked] = {}
    for attr in ("graph", "eval_graph"):
        gm = getattr(traced, attr)
        if gm is None:
            continue
        try:
            proof = prove_causal(gm, inputs, dim)
        except CausalityError as error:
            if traced.fx_failure:  # the ops it names are aten's, which the proof has no rules for
                raise CausalityError([_exported(traced.fx_failure)], fix=_EXPORTED_FIX) from None
            told = _with_lines(error, lined, inputs, dim)
            problems = [f"{p} (in eval mode: the graph pipe.eval() runs)" for p in told.problems] if attr == "eval_graph" else told.problems
            raise CausalityError(problems, fix=told.fix, taken=_taken(named, dim)) from None
        made = SliceSpec(chunks if isinstance(chunks, (int, str)) else tuple(chunks), dict(proof.inputs), outputs, len(proof.carries), dim)
        placed = dict(zip(_placeholders(gm), inputs))
        _refuse_the_batch_dim(made.inputs, placed, batch_dims, dim)
        sliced = slice_graph(gm, proof)
        check_slices(gm, sliced, proof, inputs, _example_cut(made, placed))
        outputs.update(_output_dims(gm, sliced, proof))
        setattr(traced, attr, sliced)
        checked[attr == "graph"] = Checked(gm, sliced, proof)
        spec = spec or made
    assert spec is not None
    named = dict(zip(_placeholders(next(iter(checked.values())).whole), inputs))
    length = example_length(spec, named)
    return spec, length_check(checked, length, tuple(spec.lengths(length)), owner, _settings(named))


def _example_cut(spec: SliceSpec, inputs: dict[str, Any]) -> list[int]:
    """The example's sequence cut into slices; refused, saying where the sequence was looked for,
    where it is shorter than the slices (a sequence-first input holds its batch on dim 1)."""
    length = example_length(spec, inputs)
    names = ", ".join(f"{name} {tuple(inputs[name].shape)}" for name in spec.inputs)
    if isinstance(spec.chunks, (list, tuple)) and sum(spec.chunks) != length:
        raise ValueError(
            f"sequence_chunks={list(spec.chunks)} cut {sum(spec.chunks)} positions, and the example's sequence has "
            f"{length}: dim {spec.dim} of {names} (sequence_dim={spec.dim}).\nHow to fix: give lengths that sum to "
            f"the example's, {length}, or sequence_chunks as a number of slices (which cuts any length)."
        )
    try:
        return list(spec.lengths(length))
    except ValueError as error:
        raise ValueError(
            f"{error}: the example's sequence is dim {spec.dim} of {names} (sequence_dim={spec.dim}).\nHow to fix: an "
            "example with a longer sequence; for inputs of (positions, batch), sequence-first, batch-first ones "
            "(x.transpose(0, 1), and a model that reads them so), as slices cut sequence_dim and micro-batches dim 0."
        ) from None


@dataclass(frozen=True)
class Checked:
    """A mode's graph before slicing, after, and the proof that rewrote it."""

    whole: fx.GraphModule
    sliced: fx.GraphModule
    proof: Proof


# (a call's micro-batches' inputs by name, the training flag, the slicing the call runs, and what
# holds the model still while the checks run on its tensors: a loop whose steps overlap updates them)
LengthCheck = Callable[[list[dict[str, Any]], bool, SliceSpec, Callable[[], ContextManager[Any]]], None]


def _settings(values: dict[str, Any]) -> tuple[tuple[str, str], ...]:
    """A call's inputs that are no tensors (`is_causal=causal`, a `start_pos`), by value: the
    proof read the example's, which decide what is causal as a mask's values do."""
    return tuple((name, repr(value)) for name, value in values.items() if not isinstance(value, torch.Tensor))


def length_check(
    graphs: dict[bool, Checked], example: int, example_cut: tuple[int, ...], owner: nn.Module, example_settings: tuple[tuple[str, str], ...] = (),
) -> LengthCheck:
    """The proof again, and the slices against the whole, on a call's first micro-batch (inputs
    by name) of a length or a cut into slices not checked yet, or after a tensor the masks are
    made from changed (a mask buffer loaded from a checkpoint), once each per mode: a table of the
    length's size read from a buffer (a mask narrowed to the length) may be causal at the
    example's length and not at another, and a slice of one position may take another shape
    (`squeeze()`). Masks made from an input's values (a prefix length) are proved again on every
    micro-batch of every call. A graph that cannot run here (its tensors on another device or
    rank, too large) keeps the example's proof where the masks it narrows hide the future past
    the example's length as they did up to it (`_hides_alike`), and is refused at a longer length
    where one does not, or where its masks' tensors changed or read inputs. The tensors the masks
    are made from are the model's (`owner`'s) as they are at the call: one replaced by another
    (`model.mask = ...`) counts as changed, and the proof runs on it."""
    holders = {mode: _mask_holders(graph, owner) for mode, graph in graphs.items()}
    proved = {mode: _mask_versions(holders[mode]) for mode in graphs}
    checked = {(mode, example, example_cut, proved[mode], example_settings) for mode in graphs}  # checked while compiling

    def check(micro_batches: list[dict[str, Any]], training: bool, spec: SliceSpec, still: Callable[[], ContextManager[Any]] = nullcontext) -> None:
        mode = training if training in graphs else next(iter(graphs))
        graph, values = graphs[mode], micro_batches[0]
        length = example_length(spec, values)
        try:
            lengths = tuple(spec.lengths(length))
        except ValueError:  # a length the slicing cannot cut: the call's cut says so, with its fix
            return
        key = (mode, length, lengths, _mask_versions(holders[mode]), _settings(values))
        if key in checked and not graph.proof.mask_inputs:
            return
        try:
            if not small_on_cpu(graph.whole, tuple(values.values())):
                _refuse_unprovable(graph, not _changed(proved[mode], key[3]), length, example)
            else:
                for gm in (graph.whole, graph.sliced):
                    _follow_the_model(gm, holders[mode])
                with still():  # the checks run the graph on the model's tensors, and put back what it wrote
                    for inputs in (micro_batches if graph.proof.mask_inputs else [values]):
                        prove_causal_at(graph.whole, tuple(inputs.values()), spec.dim, length, holding=set(spec.inputs))
                    if key not in checked:
                        check_slices(graph.whole, graph.sliced, graph.proof, tuple(values.values()), lengths)
        except CausalityError as error:
            raise _at_this_call(error, graph, length, example, changed=_changed(proved[mode], key[3]), settings=_other_settings(example_settings, key[4])) from None
        checked.add(key)

    return check


def _other_settings(example: tuple[tuple[str, str], ...], now: tuple[tuple[str, str], ...]) -> str:
    """The inputs that are no tensors whose values differ from the example's, said as `name=value`."""
    before = dict(example)
    return ", ".join(f"{name}={value} (the example's: {before.get(name, 'none')})" for name, value in now if before.get(name) != value)


def _at_this_call(error: CausalityError, graph: Checked, length: int, example: int, changed: bool, settings: str = "") -> CausalityError:
    """The proof's failure on a call, saying what differs from the example's: its length, the
    tensors the masks are made from, the inputs' values they read, or the values of inputs that
    are no tensors."""
    whats = [f"its length, {length} (the example's was {example})"] if length != example else []
    whats += [f"inputs that are no tensors: {settings}"] if settings else []
    inputs, state = ", ".join(sorted(graph.proof.mask_inputs)), ", ".join(sorted(graph.proof.mask_state))
    whats += [f"the values of {inputs}, which its masks read, proved on each call"] if inputs else []
    whats += [f"{state}, which its masks are made from, changed since compiling"] if changed else []
    fixes = [f"call it with sequences of the example's length, {example}, or compile for this one"] if length != example else []
    fixes += ["put back what the masks are made from, or compile again"] if changed else []
    fixes += ["call it with the example's values of those inputs that are no tensors"] if settings else []
    fixes += ["sequence_chunks=1 (a mask that lets a position read later ones, a prefix read both ways, is no causal model)"]
    only_length = length != example and len(whats) == 1
    where = f"at this call's length, {length} (the example's was {example})" if only_length else f"on this call ({'; '.join(whats)})"
    return CausalityError([f"{where}: {p}" for p in error.problems], fix="; or ".join(fixes) + ".")


Versions = tuple[tuple[str, int, int, int], ...]
# Where each tensor the masks are made from is held: its target, the module holding it, its name there.
Holders = list[tuple[str, nn.Module, str]]


def _mask_holders(graph: Checked, owner: nn.Module) -> Holders:
    """The modules that hold the tensors the masks were made from, found once: the model's (the
    graph's, for a constant the trace made: a module-level tensor). A call reads each tensor
    there, as it is then; a module replaced meanwhile is refused before (compile again)."""
    found = []
    for target in sorted(graph.proof.mask_state):
        prefix, _, name = target.rpartition(".")
        for root in (owner, graph.whole):
            parent = submodule_or_none(root, prefix) if prefix else root
            if parent is not None and isinstance(_attribute(parent, name), torch.Tensor):
                found.append((target, parent, name))
                break
    return found


def _attribute(module: nn.Module, name: str) -> Any:
    """What `module` holds as `name`: a parameter, a buffer or a plain attribute (None if nothing)."""
    for table in (module._parameters, module._buffers, module.__dict__):
        if name in table:
            return table[name]
    return None


def _mask_versions(holders: Holders) -> Versions:
    """Each tensor the masks were made from, with its identity, its memory (`.data = ...` swaps
    it) and the count of its in-place writes (`load_state_dict` copies into it); not those on the
    meta device (freed on this rank across processes: the rank that runs their stage checks them)."""
    found = []
    for target, parent, name in holders:
        tensor = _attribute(parent, name)
        if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
            found.append((target, id(tensor), tensor.data_ptr(), tensor._version))
    return tuple(found)


def _changed(proved: Versions, now: Versions) -> bool:
    """Whether a tensor held now is another, or was written, since the proof."""
    before = {target: rest for target, *rest in proved}
    return any(before.get(target) != rest for target, *rest in now)


def _follow_the_model(gm: fx.GraphModule, holders: Holders) -> None:
    """Put into the graph module the tensors the model now holds where the masks' tensors are,
    where it holds others than it traced (`model.mask = torch.ones(...)`): the proof runs on them."""
    for target, parent, name in holders:
        prefix = target.rpartition(".")[0]
        into, now = submodule_or_none(gm, prefix) if prefix else gm, _attribute(parent, name)
        if into is None or into is parent or _attribute(into, name) is now:
            continue
        table = next((t for t in (into._parameters, into._buffers) if name in t), into.__dict__)
        table[name] = now


def _refuse_unprovable(graph: Checked, same_state: bool, length: int, example: int) -> None:
    """A graph that cannot run here keeps the example's proof where nothing it rests on changed."""
    if graph.proof.mask_inputs:
        raise CausalityError([f"its masks are made from the values of {', '.join(sorted(graph.proof.mask_inputs))}, and the "
                              "proof on each call runs the model's graph on the CPU, which it cannot here (its tensors are on "
                              "another device, or over 1 GiB)"])  # fmt: skip
    if not same_state:
        raise CausalityError([f"the tensors its masks are made from ({', '.join(sorted(graph.proof.mask_state))}) changed since "
                              "they were proved causal, and the proof runs the model's graph on the CPU, which it cannot here"])  # fmt: skip
    if length > example and (tables := [n.name for n in _narrowed_tables(graph) if not _hides_alike(graph, n, example, length)]):
        raise CausalityError([_unprovable(tables, length, example)])


def _narrowed_tables(graph: Checked) -> list[fx.Node]:
    """The nodes that narrow a table to the sequence's length (a mask buffer's `[:T, :T]`), by
    name: their values past the example's length are not known (an arange's are)."""
    nodes = {n.name: n for n in graph.whole.graph.nodes}
    return [nodes[name] for name in sorted(graph.proof.tables) if nodes[name].target is not torch.arange]


def _hides_alike(graph: Checked, node: fx.Node, example: int, length: int) -> bool:
    """Whether the table `node` cuts to the length hides the future at `length` as it did at the
    example's, where the proof ran: a table of one position dim (a rotary table) mixes no
    positions; a mask (a query dim and a key dim, cut from a tensor the model holds) holds, where
    a key follows its query up to `length`, only values it held there up to the example's length."""
    cuts = graph.proof.tables[node.name]
    if len(cuts) < 2:
        return True
    roles = {graph.proof.role_of(variable): dim for variable, dim in cuts}
    source = node.args[0] if node.args else None
    if Q not in roles or K not in roles or not isinstance(source, fx.Node) or source.op != "get_attr":
        return False
    table = fetch_attr(graph.whole, str(source.target))
    if not isinstance(table, torch.Tensor) or table.is_meta:
        return False
    dims = _table_dims(node, table.dim())
    if roles[Q] not in dims or roles[K] not in dims:
        return False
    q, k = dims[roles[Q]], dims[roles[K]]
    if table.dim() <= max(q, k) or min(table.shape[q], table.shape[k]) < length:
        return False
    square = table.movedim((q, k), (-2, -1))[..., :length, :length]
    future = torch.ones(length, length, dtype=torch.bool, device=square.device).triu(1)
    before, now = square[..., :example, :example][..., future[:example, :example]].unique(), square[..., future].unique()
    if now.dtype == torch.bool:  # isin takes no booleans
        before, now = before.to(torch.uint8), now.to(torch.uint8)
    return bool(torch.isin(now, before).all())


def _table_dims(node: fx.Node, rank: int) -> dict[int, int]:
    """For a node that cuts a table (`table[None, :, :T, :T]`, `table[..., :T, :T]`,
    `narrow`), the table's dim each of its output's dims comes from; {} for an index it cannot
    follow (a tensor, an int past the dims)."""
    if node.target is not operator.getitem:
        return {d: d for d in range(rank)}
    index = node.args[1] if len(node.args) > 1 else ()
    items = list(index) if isinstance(index, tuple) else [index]
    if Ellipsis in items:
        at = items.index(Ellipsis)
        items[at : at + 1] = [slice(None)] * (rank - sum(1 for i in items if i is not None and i is not Ellipsis))
    found, source, target = {}, 0, 0
    for item in [*items, *[slice(None)] * max(0, rank - sum(1 for i in items if i is not None))]:
        if item is None:
            target += 1
        elif isinstance(item, int):
            source += 1
        elif isinstance(item, slice):
            found[target] = source
            source, target = source + 1, target + 1
        else:
            return {}
    return found


def _unprovable(tables: list[str], length: int, example: int) -> str:
    return (
        f"it narrows tables to the sequence's length ({', '.join(tables)}), proved causal at {example} positions, and the proof "
        f"at {length} runs the model's graph on the CPU, which it cannot here (its tensors are on another device, "
        "or over 1 GiB)"
    )


def _exported(why: str) -> str:
    return (
        f"the model was captured by torch.export, whose graph holds aten ops, because torch.fx could not trace it "
        f"({why.splitlines()[0]}): the proof reads torch.fx's graph of PyTorch's functions, methods and modules, "
        "and has no rules for aten ops yet (a Hugging Face model, whose mask functions and **kwargs torch.fx cannot "
        "trace, comes this way); a model torch.fx traces can be proved"
    )


_EXPORTED_FIX = "sequence_chunks=1 (micro-batches split the batch alone), or a model torch.fx can trace (its reason above)."


def example_length(spec: SliceSpec, inputs: dict[str, Any]) -> int:
    """The sequence's length in the example (inputs by placeholder name)."""
    return next(int(inputs[name].shape[dim]) for name, dim in spec.inputs.items())


def _placeholders(gm: fx.GraphModule) -> list[str]:
    return [n.name for n in gm.graph.nodes if n.op == "placeholder"]


def _output_dims(gm: fx.GraphModule, sliced: fx.GraphModule, proof: Proof) -> dict[str, tuple[Optional[int], ...]]:
    """The sequence's dim in each leaf of each value the graph returns, by the name the value
    has in the `sliced` graph that runs (slicing makes some nodes again: `add` may be `add_1`)."""
    found = {}
    for node, ran in zip(_returned_nodes(gm), _returned_nodes(sliced)):
        tags = tree_flatten(proof.tags.get(node.name), is_leaf=lambda t: t is None or isinstance(t, Positions))[0]
        found[ran.name] = tuple(_query_dim(tag, proof) for tag in tags)
    return found


def _returned_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    """The nodes the graph returns, in the order of its output's leaves."""
    output = next(n for n in gm.graph.nodes if n.op == "output")
    return [leaf for leaf in tree_flatten(output.args[0])[0] if isinstance(leaf, fx.Node)]


def _query_dim(tag: Any, proof: Proof) -> Optional[int]:
    if not isinstance(tag, Positions):
        return None
    return next((d for d, role in tag.dims if proof.role_of(role) == Q), None)


def slices_note(spec: SliceSpec, dim: int, length: int, stages: Sequence[StagePlan]) -> str:
    """The plan's line on slices of a sequence."""
    lengths = spec.lengths(length)
    held = ", ".join(human_bytes(stage.carry_bytes) for stage in stages)
    return (
        f"sequence slices: each micro-batch's sequence (dim {dim}) in {len(lengths)} slices, {lengths} on the example, "
        f"run in turn by every stage; {spec.carries} keys and values carried from slice to slice, held until "
        f"backward per stage (in memory): {held}"
    )


def with_costs(spec: SliceSpec, gm: fx.GraphModule, inputs: tuple[Any, ...], stages: int, flop_rate: float, device: str) -> SliceSpec:
    """`spec` for sequence_chunks='auto': the time of a slice on each stage, from the FLOPs of the
    graph's forward at the example's length and at half of it (position-wise work grows with the
    length, attention's scores with its square), forward and backward (3x), shared evenly among
    the stages; and a fixed cost per slice, of its ops' calls and its tasks."""
    if spec.chunks != "auto":
        return spec
    length = example_length(spec, dict(zip(_placeholders(gm), inputs)))
    short = max(1, length // 2)
    f_long, f_short = (_forward_flops(gm, inputs, spec, n) for n in (length, short))
    per_pair = max((f_long / length - f_short / short) / (length - short), 0.0) if length > short else 0.0
    per_position = max(f_long / length - per_pair * length, 0.0)
    seconds = 3.0 / (flop_rate * stages)
    ops = sum(1 for n in gm.graph.nodes if n.op in ("call_function", "call_method", "call_module")) / stages
    per_slice = SLICE_SECONDS.get(device, 5e-5) + ops * OP_SECONDS.get(device, 1e-5)
    return replace(spec, auto=(per_position * seconds, per_pair * seconds, per_slice, stages))


def _forward_flops(gm: fx.GraphModule, inputs: tuple[Any, ...], spec: SliceSpec, length: int) -> float:
    """The FLOPs of `gm`'s forward on the first `length` positions of the example."""
    cut = [x.narrow(d, 0, length) if (d := spec.inputs.get(name)) is not None else x for name, x in zip(_placeholders(gm), inputs)]
    with torch.no_grad(), preserved(gm), FlopCount() as counter:
        gm(*cut)
    return float(counter.flops)


def count_carries(stages: list[StagePlan], runs: Sequence[Sequence[fx.Node]], spec: SliceSpec, length: int) -> None:
    """Add to each stage's memory the keys and values its slices carry, held until backward:
    slice j keeps those of every position up to its last, so a batch's carries hold
    sum_j (end_j / T) times the whole sequence's keys and values ((k + 1) / 2 for k even slices)."""
    ends = list(itertools.accumulate(spec.lengths(length)))
    share = sum(end / length for end in ends)
    for stage, run in zip(stages, runs):
        whole = sum(int(node.meta.get("bytes", 0)) for node in run if node.target is with_carry)
        stage.carry_bytes = int(whole * share)
        stage.memory += stage.carry_bytes
