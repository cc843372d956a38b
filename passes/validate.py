"""Checking a traced graph against the eager model: same outputs, same buffer updates."""
from __future__ import annotations

import dataclasses
import importlib.util

import os
import re
import traceback
from collections import defaultdict
from typing import Any, Iterator, Optional

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import keystr, tree_flatten, tree_flatten_with_path, tree_map

from fxpipe.core.own_code import is_ours
from fxpipe.core.snapshot import Snapshot, preserved
from fxpipe.core.wording import listed
from fxpipe.passes.shapes import propagate_shapes, small_on_cpu
from fxpipe.tracing.assignments import started_alike

# (rtol, atol) by dtype: a graph from torch.export runs decomposed ops, which may round otherwise.
_TOLERANCES = {
    torch.float64: (1e-7, 1e-7),
    torch.complex128: (1e-7, 1e-7),
    torch.float32: (1e-4, 1e-5),
    torch.complex64: (1e-4, 1e-5),
}
_LOW_PRECISION = (1e-2, 1e-3)
_TORCH_DIR = os.path.dirname(torch.__file__)
# numpy's code: a frame there was called by the model's line, which is the one named.
_NUMPY = importlib.util.find_spec("numpy")
_NUMPY_DIR: Optional[str] = next(iter(_NUMPY.submodule_search_locations or []), None) if _NUMPY else None


def check_graph(
    model: nn.Module, gm: fx.GraphModule, example: tuple[Any, ...], inputs: tuple[Any, ...], kwargs: Optional[dict[str, Any]] = None
) -> Optional[str]:
    """None when `gm` computes what `model` computes on `example` (and keyword arguments
    `kwargs`) in the model's present mode; else what differs. `inputs` are the example as `gm`'s
    placeholders take them.

    Where the model is small enough to run whole (as the shape pass does) both run from the same
    state and random state, and outputs and buffers are compared; a larger one only has to run.
    Either way the model's state and the random states are left as they were.
    """
    with preserved(model) as state, torch.no_grad():
        if not small_on_cpu(gm, inputs):
            return _runs(gm, inputs)
        kwargs = kwargs or {}
        with started_alike(model) as put_back:  # the graph's run starts from the attributes the model's read
            expected = model(*_detached(example), **_detached(kwargs))  # copies: either may write its inputs
            expected_buffers = _buffers(model)
            state.restore()
            put_back()
            try:
                got = _quietly(gm, _detached(inputs))
            except Exception as error:
                state.restore()
                return f"does not run: {_failing_node(gm, inputs)}{first_line(error)}"
        problem = _compare(got, expected) or _compare_buffers(_buffers(model), expected_buffers)
        if problem is None:
            return None
        return f"computes otherwise than the model: {_locate(model, gm, example, kwargs, inputs, state)}{problem}"


def _quietly(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> Any:
    """`gm(*inputs)` without the traceback torch.fx prints to stderr when its generated code
    raises: a failure here is a finding (the other front end, or a refusal that says why)."""
    if getattr(gm, "_needs_recompile", lambda: False)():
        gm.recompile()
    return gm.forward(*inputs)


def _runs(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> Optional[str]:
    try:
        propagate_shapes(gm, inputs)
    except Exception as error:
        return f"does not run: {first_line(error)}"
    return None


def first_line(error: BaseException) -> str:
    """The error's type and the first line of its message."""
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: buffer.detach().clone() for name, buffer in model.named_buffers()}


def dense(t: torch.Tensor) -> torch.Tensor:
    """A sparse tensor (a GCN's adjacency) as the dense one it stands for: torch's comparisons
    (isclose, eq) have no sparse kernels."""
    return t if t.layout == torch.strided else t.to_dense()


def _close(got: torch.Tensor, expected: torch.Tensor) -> bool:
    if got.shape != expected.shape or got.dtype != expected.dtype or got.layout != expected.layout:
        return False
    got, expected = dense(got), dense(expected)
    if not (got.is_floating_point() or got.is_complex()):
        return torch.equal(got, expected)
    rtol, atol = _TOLERANCES.get(got.dtype, _LOW_PRECISION)
    return bool(torch.isclose(got, expected, rtol=rtol, atol=atol, equal_nan=True).all())


def _leaf_difference(got: Any, expected: Any) -> Optional[str]:
    """How one output value differs, or None."""
    if not isinstance(got, torch.Tensor) or not isinstance(expected, torch.Tensor):
        try:
            return None if type(got) is type(expected) and bool(got == expected) else f"{got!r} instead of {expected!r}"
        except Exception:
            return None  # values that do not compare: nothing to say
    if got.shape != expected.shape:
        return f"shape {tuple(got.shape)} instead of {tuple(expected.shape)}"
    if got.dtype != expected.dtype:
        return f"dtype {got.dtype} instead of {expected.dtype}"
    if got.layout != expected.layout:
        return f"layout {got.layout} instead of {expected.layout}"
    if _close(got, expected):
        return None
    got, expected = dense(got), dense(expected)
    difference = (got.detach().cpu().double() - expected.detach().cpu().double()).abs().nan_to_num(float("inf"))
    return f"max abs difference {difference.max().item():.3g}"


def _plain(value: Any) -> Any:
    """Dict and list kinds as plain dicts and lists: generated code returns plain ones, and the
    pipeline gives the model's own kinds back (from what the tracer recorded)."""
    if isinstance(value, dict):  # OrderedDict, fx's immutable dict, a library's output record
        return {key: _plain(v) for key, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):  # its fields, as the graph returns them
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if type(value) in (list, tuple) or type(value).__module__ == "torch.fx.immutable_collections":
        return type(value)(_plain(v) for v in value) if type(value) is tuple else [_plain(v) for v in value]
    return value


def _compare(got: Any, expected: Any) -> Optional[str]:
    got_leaves, got_spec = tree_flatten_with_path(_plain(got))
    expected_leaves, expected_spec = tree_flatten_with_path(_plain(expected))
    if got_spec != expected_spec:
        return "the output has another structure than the model's"
    for (path, value), (_, reference) in zip(got_leaves, expected_leaves):
        why = _leaf_difference(value, reference)
        if why is not None:
            return f"output{keystr(path) or ''} differs from the model's: {why}"
    return None


def _compare_buffers(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> Optional[str]:
    for name, reference in expected.items():
        why = _leaf_difference(got[name], reference) if name in got else "missing"
        if why is not None:
            return f"buffer {name} is updated otherwise than by the model: {why}"
    return None


# -- where the first difference is ------------------------------------------------------------


def _locate(
    model: nn.Module, gm: fx.GraphModule, example: tuple[Any, ...], kwargs: dict[str, Any], inputs: tuple[Any, ...], state: Snapshot
) -> str:
    """'first difference at node n (module m, file:line): ' or '' when no module's output tells."""
    state.restore()
    with started_alike(model) as put_back:
        eager = _module_outputs(model, _detached(example), _detached(kwargs))
        state.restore()
        put_back()
        values = _node_values(gm, _detached(inputs))
    nested = _nested_outputs(eager)
    if nested:
        return (
            f"the model runs a fast path on nested tensors ({listed(nested, most=3)} returned one), which its graph "
            "does not take: build nn.TransformerEncoder with enable_nested_tensor=False, or keep it whole "
            "(leaf_modules=[...]); "
        )
    for node, path in _module_ends(gm):
        if node not in values:
            break  # the graph failed before this node
        candidates = [out for out in eager.get(path, []) if _same_structure(values[node], out)]
        if candidates and all(_compare(values[node], out) for out in candidates):
            return f"first difference at node {node.name} (module {path}, {source_line(node)}); "
    return ""


def _detached(value: Any) -> Any:
    """A copy, so that a later in-place op does not change what was recorded; one that requires
    grad where the tensor did (a branch on `x.requires_grad` takes the example's way)."""
    return tree_map(lambda t: t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t, value)


def _module_outputs(model: nn.Module, example: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, list[Any]]:
    """What every submodule returned in an eager run, by qualified name, call by call."""
    paths: dict[int, list[str]] = defaultdict(list)
    for path, module in model.named_modules(remove_duplicate=False):
        if path:
            paths[id(module)].append(path)
    outputs: dict[str, list[Any]] = defaultdict(list)

    def record(module: nn.Module, args: Any, output: Any) -> None:
        for path in paths[id(module)]:
            outputs[path].append(_detached(output))

    handles = [m.register_forward_hook(record) for _, m in model.named_modules() if id(m) in paths]
    try:
        model(*example, **kwargs)
    finally:
        for handle in handles:
            handle.remove()
    return outputs


class _Recording(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm, garbage_collect_values=False)
        self.values: dict[fx.Node, Any] = {}

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        self.values[n] = _detached(value)
        return value


def _failing_node(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> str:
    """'at node n (module m, file:line): ' for the node that raises, or ''."""
    values = _node_values(gm, _detached(inputs))
    node = next((n for n in gm.graph.nodes if n.op.startswith("call_") and n not in values), None)
    return "" if node is None else f"at node {describe(node)}: "


def describe(node: fx.Node) -> str:
    """'n (module m, file:line (code))': the node, the module it runs in, the model's line."""
    return f"{node.name} (module {node.meta.get('scope') or 'the root module'}, {source_line(node)})"


def _node_values(gm: fx.GraphModule, inputs: tuple[Any, ...]) -> dict[fx.Node, Any]:
    recording = _Recording(gm)
    try:
        recording.run(*inputs)
    except Exception:
        pass  # the values up to the failing node still tell where the graph went astray
    return recording.values


def _ancestry(scope: str) -> list[str]:
    """'a.b.c' -> ['a.b.c', 'a.b', 'a']; the root module ('') has no name to compare by."""
    parts = scope.split(".") if scope else []
    return [".".join(parts[:i]) for i in range(len(parts), 0, -1)]


def _module_ends(gm: fx.GraphModule) -> Iterator[tuple[fx.Node, str]]:
    """(node, module path) for each node that ends a module's run of nodes: its output, for a
    module called whole or traced through (scopes from `node.meta["scope"]`), innermost first."""
    previous: Optional[fx.Node] = None
    for node in [*(n for n in gm.graph.nodes if n.op.startswith("call_")), None]:
        scope = "" if node is None else str(node.meta.get("scope", ""))
        if previous is not None:
            last = str(previous.meta.get("scope", ""))
            ended = [path for path in _ancestry(last) if scope != path and not scope.startswith(path + ".")]
            if previous.op == "call_module" and last and last not in ended:
                ended.insert(0, last)  # a module called whole ends with its node, even if called again
            yield from ((previous, path) for path in ended)
        previous = node


def _same_structure(got: Any, expected: Any) -> bool:
    got_leaves, got_spec = tree_flatten(got)
    expected_leaves, expected_spec = tree_flatten(expected)
    return got_spec == expected_spec and all(
        not isinstance(g, torch.Tensor) or (isinstance(e, torch.Tensor) and not (g.is_nested or e.is_nested) and g.shape == e.shape)
        for g, e in zip(got_leaves, expected_leaves)
    )


def _nested_outputs(eager: dict[str, list[Any]]) -> list[str]:
    """The modules whose output the model's run gave as a nested tensor (a fast path of
    nn.TransformerEncoder, taken without gradients in eval mode), which no graph makes."""
    return [path or "the model" for path, outs in eager.items() if any(isinstance(t, torch.Tensor) and t.is_nested for t in tree_flatten(outs)[0])]


_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+)')


def raising_line(error: BaseException) -> str:
    """The model's own line where `error` was raised (the innermost frame of its traceback
    outside torch and fxpipe), as 'file:line (code)', or '' when none is the model's."""
    found = ""
    for frame in traceback.extract_tb(error.__traceback__):
        if not _library(frame.filename) and not frame.filename.startswith("<"):
            found = f"{frame.filename}:{frame.lineno} ({(frame.line or '').strip()})"
    return found


def source_line(node: fx.Node) -> str:
    """The model's own line that made `node`, from its recorded stack trace (the innermost frame
    outside torch and fxpipe), as 'file:line (code)'."""
    lines = (node.stack_trace or node.meta.get("stack_trace") or "").splitlines()
    found = "an unknown line"
    for i, line in enumerate(lines):
        match = _FRAME.search(line)
        if match and not _library(match["file"]):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            found = f"{match['file']}:{match['line']} ({code})"
    return found


def _library(filename: str) -> bool:
    """Code of torch's, numpy's or fxpipe's, not the model's."""
    return filename.startswith(_TORCH_DIR) or bool(_NUMPY_DIR and filename.startswith(_NUMPY_DIR)) or is_ours(filename)
