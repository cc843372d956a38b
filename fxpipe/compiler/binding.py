"""Binding a call's arguments to the graph's inputs, and checking a call (or its micro-batches) against what the graph was traced for."""
from __future__ import annotations

import inspect
import re
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import TreeSpec, keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from fxpipe.compiled.program import Binder, OtherCall, first_floating_dtype
from fxpipe.passes.shapes import small_on_cpu
from fxpipe.passes.validate import check_graph
from fxpipe.tracing.export import fixed_dims, held_static

MicroBatchCheck = Callable[[Sequence[dict[str, Any]]], None]


def signature_binder(gm: fx.GraphModule, model: Optional[nn.Module] = None) -> Binder:
    """Arguments bound by the model's forward signature (its defaults applied: a tensor default
    is not in the traced code), keyed by the placeholder nodes' names (an argument called
    `input` is the node `input_1`)."""
    signature = inspect.signature((model if model is not None else gm).forward)
    names = {str(node.target): node.name for node in gm.graph.nodes if node.op == "placeholder"}

    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            raise _unbound(signature, error, kwargs) from None
        bound.apply_defaults()
        return {names[key]: value for key, value in bound.arguments.items()}

    return bind


# compile_pipeline's options (all its parameters but the model and the example: a test keeps
# them alike), which a call given one of them (train_step(..., schedule="1f1b")) is told of.
OPTIONS = frozenset({
    "devices", "mesh", "timeout", "chunks", "checkpoint", "split_points", "balance", "leaf_modules", "device_memory",
    "param_scale", "bandwidth", "flop_rate", "chunk_spec", "deferred_batch_norm", "example_kwargs", "schedule",
    "stages_per_device", "compile_stages", "stage_graph", "sequence_chunks", "sequence_dim",
})  # fmt: skip


def _unbound(signature: inspect.Signature, error: TypeError, kwargs: dict[str, Any]) -> TypeError:
    """A call the model's forward does not take, saying where an option of compiling went."""
    options = sorted(set(kwargs) & OPTIONS - set(signature.parameters))
    one = len(options) == 1
    fix = (
        f"\nHow to fix: {', '.join(f'{o}=' for o in options)} {'is an option' if one else 'are options'} of compile_pipeline, "
        f"set once for the pipeline: compile it with {'that' if one else 'those'} (a pipeline per setting)."
        if options else ""
    )
    return TypeError(f"the pipeline takes the traced model's arguments {signature}: {error}{fix}")


def none_as_traced(bind: Binder, traced: dict[str, Any], gm: fx.GraphModule) -> Binder:
    """`bind`, refusing a call that leaves an argument None where the example gave one, or the
    reverse, at the top or inside a container (`batch["mask"]`, `extras[0]`): torch.fx traced
    the model's `if mask is not None` branches as the example took them. A string other than the
    example's (`reduction="sum"`) is another call too: the graph passes it on, but what the
    compiler proved on the example (how an own loss adds up over micro-batches, which outputs
    hold the batch) was proved for the example's."""
    example = _leaves(traced)
    absent = {name: _nones(leaves) for name, leaves in example.items()}
    words = {name: _strings(leaves) for name, leaves in example.items()}
    argument = {node.name: str(node.target) for node in gm.graph.nodes if node.op == "placeholder"}  # `bias` for bias_1

    def checked(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        values = bind(args, kwargs)
        leaves = _leaves(values)  # one walk of each argument, for its Nones and its strings
        nones = {name: _nones(found) for name, found in leaves.items()}
        differ = sorted(
            argument.get(name, name) + path for name in values for path in nones[name].symmetric_difference(absent.get(name, frozenset()))
        )  # fmt: skip
        key = frozenset((name, path) for name, paths in nones.items() for path in paths)
        if differ:
            raise OtherCall(
                f"this call leaves {', '.join(differ)} None where the example gave a value, or the reverse; the "
                "graph was traced from the example, with the branches it took.\nHow to fix: compile a pipeline "
                "for calls of each kind (with and without the argument), or pass it as the example did.",
                key,
            )
        strings = {name: _strings(found) for name, found in leaves.items()}
        other = sorted(f"{argument.get(name, name)}{path}={word!r}" for name in values for path, word in strings[name].items()
                       if words.get(name, {}).get(path, word) != word)  # fmt: skip
        if other:
            raise OtherCall(
                f"this call passes {', '.join(other)}, where the example passed another string; what compiling "
                "proved on the example holds for the example's.\nHow to fix: compile a pipeline for calls of each "
                "kind, or pass what the example did.",
                (key, tuple(sorted((name, path, word) for name, found in strings.items() for path, word in found.items()))),
            )
        return values

    return checked


def _leaves(values: dict[str, Any]) -> dict[str, list[tuple[str, Any]]]:
    """Each argument's leaves with their paths (`['mask']`, `[0]`; '' for the argument itself),
    None among them."""
    found = {}
    for name, value in values.items():
        leaves, _ = tree_flatten_with_path(value, is_leaf=lambda leaf: leaf is None)
        found[name] = [(keystr(path), leaf) for path, leaf in leaves]
    return found


def _nones(leaves: list[tuple[str, Any]]) -> frozenset[str]:
    """Where an argument holds None: '' for None itself, `['mask']` or `[0]` inside a container."""
    return frozenset(path for path, leaf in leaves if leaf is None)


def _strings(leaves: list[tuple[str, Any]]) -> dict[str, str]:
    """The strings an argument holds, by path ('' for a string itself)."""
    return {path: leaf for path, leaf in leaves if isinstance(leaf, str)}


def leaf_binder(graphs: dict[bool, fx.GraphModule], spec: TreeSpec, model: nn.Module, example: list[Any], layout_read: bool = False) -> Binder:
    """Arguments flattened into leaves, as the exported graphs take them. A call that differs
    from the `example`'s leaves in structure or in kind (None, a tensor, another value: export
    keeps no input for a None, and guards a tensor's sizes; with `layout_read`, where the model's
    code asked how a tensor lies in memory, that too) is another call, compiled apart; one
    whose shapes differ where the graph of the model's mode (training or eval: each has its own
    branches) fixed or guards them is refused before any stage runs."""
    placeholders = [node for node in graphs[True].graph.nodes if node.op == "placeholder"]
    names = [node.name for node in placeholders]
    arguments = [str(node.meta.get("argument", node.name)) for node in placeholders]  # the model's names, for messages
    fixed = {mode: fixed_dims(gm) for mode, gm in graphs.items()}
    held = held_static(graphs[True])
    images = {mode: [f for f in dims if f[:2] in held] for mode, dims in fixed.items()}  # the sizes held of each
    guards = {mode: gm.meta.get("input_guards") for mode, gm in graphs.items()}
    kinds = [_kind(leaf, layout_read) for leaf in example]
    signature = inspect.signature(model.forward)
    exported_in = first_floating_dtype(model)  # export holds the model's dtype too (`self.dtype`, a branch on it)

    order = list(_children(spec)[1].context or [])  # the example's keyword arguments, in its order
    positional = _children(spec)[0].num_children

    def bind(args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as error:
            raise _unbound(signature, error, kwargs) from None
        args, kwargs = _laid_out(bound, positional) or (args, kwargs)
        if set(kwargs) == set(order):  # keywords in another order are the same call
            kwargs = {key: kwargs[key] for key in order}
        leaves, called = tree_flatten(_sizes_as_tuples((args, kwargs)))
        if called != spec:
            raise OtherCall(
                "the pipeline was exported for arguments shaped like the example, and this call differs:\n"
                f"  - example: {_arguments(spec)}\n  - call:    {_arguments(called)}\n"
                "How to fix: call it with the same positional and keyword arguments as the example.",
                str(called),
            )
        now = [_kind(leaf, layout_read) for leaf in leaves]
        dtype = first_floating_dtype(model)
        if dtype != exported_in:
            raise OtherCall(
                f"the model was cast from {exported_in} to {dtype} since the graph was exported, which holds the dtype "
                "the model had (a branch on it, `self.dtype`).\nHow to fix: compile a pipeline for the model as it is now.",
                (str(called), tuple(now), str(dtype)),
            )
        if now != kinds:
            differ = [f"{arguments[i]} ({now[i]}, the example's {kinds[i]})" for i in range(len(now)) if now[i] != kinds[i]]
            other = OtherCall(
                f"this call gives {', '.join(differ)}: the graph was exported from the example, which keeps no input "
                "for a None, holds the value of an argument that is not a tensor, and the dims and dtypes of the tensors.\nHow to fix: compile a pipeline "
                "for calls of each kind, or pass the arguments as the example did.",
                (str(called), tuple(now)),
            )
            other.numbers = tuple(arguments[i] for i in range(len(now)) if now[i] != kinds[i] and _number(leaves[i]) and _number(example[i]))
            raise other
        mode = model.training if model.training in graphs else True
        _another_image_size(leaves, images[mode], arguments)
        _check_fixed(leaves, fixed[mode], arguments)
        if guards[mode] is not None:
            _check_guards(guards[mode], leaves, arguments)
        return dict(zip(names, leaves))

    return bind


def _sizes_as_tuples(value: Any) -> Any:
    """`value` with each torch.Size in it a tuple, as the example's came to the export (a size is
    a tuple of ints to the graph, given either way)."""
    if isinstance(value, torch.Size):
        return tuple(value)
    if type(value) in (tuple, list):
        return type(value)(_sizes_as_tuples(v) for v in value)
    if type(value) is dict:
        return {key: _sizes_as_tuples(v) for key, v in value.items()}
    return value


def _laid_out(bound: inspect.BoundArguments, positional: int) -> Optional[tuple[tuple[Any, ...], dict[str, Any]]]:
    """A call's arguments laid out as the example's: its first `positional` parameters given by
    position, the rest by keyword (`model(x, mask=m)` and `model(x=x, mask=m)` are one call).
    None where the call cannot be (its first parameters not all given, extra positional ones)."""
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = bound.signature.parameters[name].kind
        if kind == inspect.Parameter.VAR_POSITIONAL:
            if value:
                return None
        elif kind == inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        else:
            named[name] = value
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    first = [p.name for p in bound.signature.parameters.values() if p.kind in kinds][:positional]
    if len(first) < positional or not all(name in named for name in first):
        return None
    return tuple(named.pop(name) for name in first), named


def _kind(leaf: Any, layout: bool = False) -> str:
    """What export made of a leaf of the arguments: no input (None), a tensor of a number of dims
    (`t[None]` for a 0-dim timestep), a dtype (which the graph holds for what it makes from it:
    `torch.ones(n, dtype=x.dtype)`), a class (an nn.Parameter given), with `layout` its layout in
    memory, and that requires grad or not (a branch on any of these is held too:
    `x.requires_grad`, `x.is_contiguous()`), or a value it holds: a number or a string by that
    value (`logits_to_keep=1`: a call with 3 is another kind)."""
    if isinstance(leaf, torch.Tensor):
        what = f"{leaf.dim()}-dim {str(leaf.dtype).removeprefix('torch.')} {_layout(leaf) if layout else ''}"
        kind = "tensor" if type(leaf) is torch.Tensor else type(leaf).__qualname__
        return f"a {what}{kind}{' that requires grad' if leaf.requires_grad else ''}"
    if isinstance(leaf, (bool, int, float, str)):
        return f"the value {leaf!r}"
    return "None" if leaf is None else "a value"


def _layout(t: torch.Tensor) -> str:
    """How a tensor lies in memory, as a branch of the model's may ask (`x.is_contiguous()`,
    `memory_format=torch.channels_last`, a stride of 0): '' for a contiguous one."""
    if t.layout != torch.strided:
        return f"{str(t.layout).removeprefix('torch.')} "
    channels_last = {4: torch.channels_last, 5: torch.channels_last_3d}.get(t.dim())
    said = [
        *(["channels-last"] if channels_last is not None and t.is_contiguous(memory_format=channels_last) else []),
        *(["non-contiguous"] if not t.is_contiguous() else []),
        *(["expanded"] if any(stride == 0 and size > 1 for stride, size in zip(t.stride(), t.shape)) else []),
    ]  # fmt: skip
    return "".join(f"{word} " for word in said)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _children(spec: TreeSpec) -> list[TreeSpec]:
    """A spec's children, by the pytree API of this torch (`children()` replaced an attribute)."""
    return list(spec.children()) if hasattr(spec, "children") else list(spec.children_specs)


def _arguments(spec: TreeSpec) -> str:
    """'2 positional; keywords mask, labels', and the structure of each, as pytree sees it."""
    positional, keywords = _children(spec)
    names = ", ".join(map(str, keywords.context or [])) or "none"
    return f"{positional.num_children} positional, keywords {names} (structure {spec})"


def _another_image_size(leaves: list[Any], held: list[tuple[int, int, int]], arguments: list[str]) -> None:
    """A call whose images have another size than the example's, which the graph holds: another
    kind of call, compiled for its size."""
    moved = {arguments[i]: tuple(leaves[i].shape) for i, d, size in held if leaves[i].dim() > d and leaves[i].shape[d] != size}
    if moved:
        raise OtherCall(
            f"this call's images have another size than the example's ({', '.join(f'{n} {s}' for n, s in moved.items())}), "
            "which the exported graph holds.\nHow to fix: compile a pipeline for each size, or call it with the "
            "example's.",
            ("image sizes", tuple(leaves[i].shape[d] if leaves[i].dim() > d else None for i, d, _ in held)),
        )


def _check_fixed(leaves: list[Any], fixed: list[tuple[int, int, int]], arguments: list[str]) -> None:
    wrong = [
        (f"{arguments[index]} (tensor of shape {tuple(leaves[index].shape)}): dim {dim} is {leaves[index].shape[dim]}, "
         f"the graph was made for {size}", size)
        for index, dim, size in fixed
        if isinstance(leaves[index], torch.Tensor) and leaves[index].dim() > dim and leaves[index].shape[dim] != size
    ]  # fmt: skip
    if not wrong:
        return
    listed = "\n".join(f"  - {w}" for w, _ in wrong)
    if all(size in (0, 1) for _, size in wrong):  # torch.export's own rule, not the model's code
        raise ValueError(
            "torch.export fixed these input sizes to the example's, as it does with every dim of size 0 or 1 "
            f"in the example, and this call differs:\n{listed}\nHow to fix: compile with an example that holds "
            "two or more along these dims (two samples, say)."
        )
    raise ValueError(
        "torch.export fixed these input sizes to the example's (the model's Python code depends on "
        f"them), and this call differs:\n{listed}\nHow to fix: compile a pipeline for these shapes, or write the "
        "size-dependent code with tensor operations so that export keeps the size dynamic."
    )


_CALL_DIFFERS = (
    "The exported graph holds the example's value of each argument that is not a tensor, and the branches the "
    "example's sizes took.\nHow to fix: call it as the example was called, compile a pipeline for this call, or "
    "make the model traceable by torch.fx, which keeps such arguments and branches live."
)


_MICRO_BATCH_DIFFERS = (
    "The model branches on a size that splitting the batch changes, and the stages would run each micro-batch "
    "down the branch of the whole batch.\nHow to fix: use fewer chunks (chunks=1 runs the batch whole), or write "
    "the branch as tensor operations (torch.where) so that it does not depend on the batch size."
)


def _check_guards(guards: Any, leaves: list[Any], arguments: list[str], what: str = "this call", why: str = _CALL_DIFFERS) -> None:
    """torch.export's own checks of `what`'s inputs (`leaves`, named by `arguments`): the graph
    holds the example's value of each argument that is not a tensor, and the branches its sizes
    took. The failed guard names the forward's arguments (export names leaves by index)."""
    try:
        guards(*leaves)
    except (AssertionError, IndexError) as error:  # (an IndexError: a guard on a dim the call's tensor lacks)
        failed = re.sub(r"\bleaves_(\d+)\b", lambda m: arguments[int(m.group(1))], str(error))
        shapes = "".join(f"\n  - {name}: shape {tuple(t.shape)}" for name, t in zip(arguments, leaves) if isinstance(t, torch.Tensor))
        raise ValueError(
            f"torch.export made the graph for calls like the example, and {what} differs: {failed}.\n"
            f"The tensors of {what}:{shapes}\n{why}"
        ) from None


def micro_batch_check(model: nn.Module, graphs: dict[bool, fx.GraphModule], spec: TreeSpec) -> Optional[MicroBatchCheck]:
    """torch.export's guards on the micro-batches' inputs: a branch on the batch size (`if
    x.shape[0] > 4:`) holds for the whole batch, and the stages run micro-batches. A guard
    that fails is not always a branch (export guards a size of 1 apart, and SimpleViT's batch
    of 1 computes alike): the graph then runs beside the model on the micro-batch, once per
    shape, and only a difference (or a model too large to run whole) refuses it."""
    if all(gm.meta.get("input_guards") is None for gm in graphs.values()):
        return None
    arguments = [str(node.meta.get("argument", node.name)) for node in graphs[True].graph.nodes if node.op == "placeholder"]
    alike: set[tuple[Any, ...]] = set()  # the shapes whose guards failed, and whose graph ran as the model

    def check(micro_batches: Sequence[dict[str, Any]]) -> None:
        guards = graphs.get(model.training, graphs[True]).meta.get("input_guards")  # each mode has its branches
        if guards is None:
            return
        seen: set[tuple[Any, ...]] = set()
        for values in micro_batches:
            leaves = list(values.values())
            key = (model.training, *(tuple(t.shape) if isinstance(t, torch.Tensor) else repr(t) for t in leaves))
            if key in seen or key in alike:
                continue
            seen.add(key)
            try:
                guards(*leaves)
            except AssertionError:
                if not _runs_alike(model, graphs, spec, leaves):
                    _check_guards(guards, leaves, arguments, "a micro-batch", _MICRO_BATCH_DIFFERS)
                alike.add(key)

    return check


def _runs_alike(model: nn.Module, graphs: dict[bool, fx.GraphModule], spec: TreeSpec, leaves: list[Any]) -> bool:
    """Whether the graph of the model's mode computes what the model does on these inputs."""
    gm = graphs.get(model.training, graphs[True])
    if not small_on_cpu(gm, tuple(leaves)):
        return False
    args, kwargs = tree_unflatten(leaves, spec)
    try:
        return check_graph(model, gm, tuple(args), tuple(leaves), kwargs) is None
    except Exception:  # noqa: BLE001 - the model itself does not run on it: the guard's refusal says why
        return False
