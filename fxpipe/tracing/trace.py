"""Tracing a model into a torch.fx graph, with errors that point at the line to fix."""
from __future__ import annotations

import dataclasses

import collections
import contextlib
import copy
import inspect
import operator
import os
import sys
import traceback
from typing import Any, Callable, Iterable, Iterator, Optional, Union

import torch
import torch.fx as fx
import torch.utils._pytree as pytree
from torch import nn

from fxpipe.core.attrs import submodule_or_none
from fxpipe.core.own_code import is_ours
from fxpipe.core.writes import written_value
from fxpipe.tracing.assignments import AssignmentError, assignments_refused
from fxpipe.tracing.autograd_state_reads import traced_grad_read
from fxpipe.tracing.context_watch import (
    INFERENCE_MODE, SAVED_TENSOR_HOOKS, autocast_watched, grad_mode_message, grad_mode_watched, inference_mode_watched, saved_tensor_hooks_watched,
)
from fxpipe.tracing.draws import drawn_message, traced_checking_draws
from fxpipe.tracing.functions import functions_as_calls
from fxpipe.tracing.markers import marking

LeafSpec = Union[str, type]

_TORCH_DIR = os.path.dirname(torch.__file__)


class TraceError(RuntimeError):
    """The model could not be traced; the message names the module, the line and the fix.
    `whole`: the submodule whose forward a library's check stopped (a function given the trace's
    value where it takes real tensors): called whole, it runs on real ones."""

    def __init__(self, message: str, whole: Optional[str] = None) -> None:
        super().__init__(message)
        self.whole = whole


class _ModuleStack(collections.OrderedDict):
    """fx's stack of the modules a trace is inside, which it copies into every node's meta:
    copied as a dict, where `copy.copy` of an OrderedDict goes through pickling's protocol (a
    tenth of a large model's trace)."""

    def __copy__(self) -> "_ModuleStack":
        return _ModuleStack(self)


class _Tracer(fx.Tracer):
    """A tracer that keeps chosen modules opaque and remembers which module it is inside."""

    # Buffers read in forward become graph nodes, not values of the trace: a write to one
    # (`self.count.add_(1)`) is then part of the graph, and a read sees the live buffer.
    proxy_buffer_attributes = True

    def __init__(self, leaf_modules: Iterable[LeafSpec], model: Optional[nn.Module] = None) -> None:
        super().__init__()
        self.module_stack = _ModuleStack()
        leaves = list(leaf_modules)
        self.leaf_names = {leaf for leaf in leaves if isinstance(leaf, str)}
        self.leaf_types = tuple(leaf for leaf in leaves if isinstance(leaf, type))
        # By the module a name holds too: a module shared under two names is called by the first.
        held = [submodule_or_none(model, name) for name in self.leaf_names] if model is not None else []
        self.leaf_ids = {id(module) for module in held if module is not None}
        self.failed_in: Optional[str] = None
        self.depth, self.returned = 0, None
        self.computed = 0  # tensors the forward computed from parameters outside the trace
        self._names: Optional[dict[int, str]] = None  # parameters' and buffers' first names, by identity

    def is_leaf_module(self, m: nn.Module, module_qualified_name: str) -> bool:
        if module_qualified_name in self.leaf_names or id(m) in self.leaf_ids or isinstance(m, self.leaf_types):
            return True
        return super().is_leaf_module(m, module_qualified_name)

    def getattr(self, attr: str, attr_val: Any, parameter_proxy_cache: dict[str, Any]) -> Any:
        # fx finds a parameter's or buffer's name by a walk over all of the root's, once per
        # read: quadratic in the model's size (a 48-block GPT spent most of its trace there).
        # By an index instead, checked on every hit, since forward may rebind a buffer.
        name = self._name_of(attr_val) if isinstance(attr_val, torch.Tensor) and not self.param_shapes_constant else None
        if name is None:
            return super().getattr(attr, attr_val, parameter_proxy_cache)
        if name not in parameter_proxy_cache:
            parameter_proxy_cache[name] = self.create_proxy("get_attr", name, (), {})
        return parameter_proxy_cache[name]

    def _name_of(self, tensor: torch.Tensor) -> Optional[str]:
        """The first name the root holds `tensor` under as a parameter or buffer, or None."""
        for fresh in (False, True):
            if fresh or self._names is None:
                named = [*self.root.named_parameters(), *self.root.named_buffers()]
                self._names = {}
                for held_name, held in named:
                    self._names.setdefault(id(held), held_name)
            name = self._names.get(id(tensor))
            if name is not None and _holds(self.root, name, tensor):
                return name
        return None

    def proxy(self, node: fx.Node) -> fx.Proxy:
        return _HeldTensor(node, self) if node.op == "get_attr" else super().proxy(node)

    def create_node(self, *args: Any, **kwargs: Any) -> fx.Node:
        node = super().create_node(*args, **kwargs)
        node.meta["scope"] = self.scope.module_path
        if node.op == "output":
            node.meta["containers"] = containers_of(self.returned)
        return node

    def create_arg(self, a: Any) -> Any:
        # The first call of a nesting is the whole value; for the output, the model's own return.
        if self.depth == 0:
            a = self.returned = fields_of_dataclasses(a)
        if isinstance(a, torch.Tensor) and not isinstance(a, nn.Parameter) and (a.grad_fn is not None or a.requires_grad):
            if a not in getattr(self, "tensor_attrs", {}):  # a module's tensor attribute is read by name (checked apart)
                self.computed += 1  # it would be a constant of the graph, never computed again
        self.depth += 1
        try:
            return super().create_arg(a)
        finally:
            self.depth -= 1

    def call_module(
        self,
        m: nn.Module,
        forward: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        try:
            return super().call_module(m, forward, args, kwargs)
        except Exception:
            if self.failed_in is None:  # the innermost module: the first to see the error
                self.failed_in = self.path_of_module(m)
            raise


class _HeldTensor(fx.Proxy):
    """A parameter's or buffer's Proxy, which tells the reads of its `.grad` (a Proxy is never
    None: the graph holds the branch of a gradient held) to fxpipe/tracing/autograd_state_reads.py."""

    def __getattr__(self, k: str) -> Any:
        if k == "grad":
            caller = sys._getframe(1)
            while caller.f_back is not None and is_ours(caller.f_code.co_filename):  # the attribute watch's lookup
                caller = caller.f_back
            traced_grad_read(str(self.node.target), caller.f_code.co_filename)
        return super().__getattr__(k)


def _holds(root: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """Whether `root` holds `tensor` as the parameter or buffer `name` (read without attribute
    lookups, which a trace may be watching)."""
    *path, leaf = name.split(".")
    module: Optional[nn.Module] = root
    for part in path:
        module = module._modules.get(part) if module is not None else None
    return module is not None and (module._parameters.get(leaf) is tensor or module._buffers.get(leaf) is tensor)


class DataclassFields(dict):  # type: ignore[type-arg]
    """A returned dataclass's fields, by name, which the graph returns as a dict; `kind` is
    the dataclass, which the pipeline makes again of them."""

    def __init__(self, kind: type, fields: dict[str, Any]) -> None:
        super().__init__(fields)
        self.kind = kind


def fields_of_dataclasses(value: Any, keyed: bool = False) -> Any:
    """A returned value with each dataclass pytree does not know (the model's own output type)
    as its fields: fx would make one opaque node of it, which no pipeline can split or gather.
    `keyed`: for torch.export, which needs keys too, also a dataclass a library registered
    without them (`flatten_with_keys_fn`)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type) and not _known(type(value), keyed):
        # A dataclass that is a dict too (Hugging Face's ModelOutput, diffusers' BaseOutput) holds
        # as keys the fields it was given that are not None: those, as its own flattening has them.
        names = list(value) if isinstance(value, dict) else [f.name for f in dataclasses.fields(value)]
        return DataclassFields(type(value), {name: fields_of_dataclasses(getattr(value, name), keyed) for name in names})
    if type(value) in (list, tuple):
        return type(value)(fields_of_dataclasses(v, keyed) for v in value)
    if type(value) is dict:
        return {key: fields_of_dataclasses(v, keyed) for key, v in value.items()}
    return value


def _known(kind: type, keyed: bool) -> bool:
    node = pytree.SUPPORTED_NODES.get(kind)
    return node is not None and (not keyed or node.flatten_with_keys_fn is not None)


def plain_dicts(value: Any) -> Any:
    """`fields_of_dataclasses`' records as plain dicts (what torch.export can return)."""
    if isinstance(value, DataclassFields) or type(value) is dict:
        return {key: plain_dicts(v) for key, v in value.items()}
    if type(value) in (list, tuple):
        return type(value)(plain_dicts(v) for v in value)
    return value


def containers_of(value: Any) -> Any:
    """The container types of a returned value (fx keeps dicts and lists as its own immutable
    kinds): an OrderedDict stays an OrderedDict, a dataclass's fields are made that dataclass
    again. Leaves are None."""
    if isinstance(value, DataclassFields):
        return (value.kind, {key: containers_of(v) for key, v in value.items()})
    if isinstance(value, dict):
        return (type(value), {key: containers_of(v) for key, v in value.items()})
    if isinstance(value, (list, tuple)) and type(value) in (list, tuple):
        return (type(value), [containers_of(v) for v in value])
    return None


def _user_frame(error: BaseException) -> str:
    """The innermost stack frame outside torch: the model's own line that tracing tripped on."""
    frames = [f for f in traceback.extract_tb(error.__traceback__) if not f.filename.startswith(_TORCH_DIR) and not is_ours(f.filename)]
    if not frames:
        return "an unknown line"
    frame = frames[-1]
    return f"{frame.filename}:{frame.lineno} ({frame.line})"


def trace(
    model: nn.Module, leaf_modules: Iterable[LeafSpec] = (), record_lines: bool = False, none: Iterable[str] = ()
) -> fx.GraphModule:
    """Trace `model` symbolically; `leaf_modules` (types or qualified names) stay opaque calls.
    `record_lines` keeps each node's stack trace (`node.stack_trace`), which makes tracing
    several times slower: it is for error messages. The forward's arguments named in `none` are
    traced as None (an `if mask is not None:` branch not taken), not as inputs of the graph.

    A `GraphModule` was traced already: it is copied (the passes annotate and rewrite graphs).
    """
    if isinstance(model, fx.GraphModule):
        return fx.GraphModule(model, copy.deepcopy(model.graph), type(model).__name__)
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be an nn.Module or a torch.fx.GraphModule, not {type(model).__name__}")
    stars = {inspect.Parameter.VAR_POSITIONAL: "*", inspect.Parameter.VAR_KEYWORD: "**"}
    variadic = [stars[p.kind] + p.name for p in inspect.signature(model.forward).parameters.values() if p.kind in stars]
    if variadic:
        raise TraceError(
            f"torch.fx cannot trace {type(model).__name__}: its forward takes {' and '.join(variadic)}, "
            "and a symbolic trace needs each input named.\n"
            "How to fix: name the forward's arguments, or let torch.export capture it."
        )
    gm, decided = traced_checking_draws(lambda: _trace_once(model, leaf_modules, record_lines, none), lambda g: g)
    if decided:
        raise TraceError(drawn_message(type(model).__name__, "torch.fx"))
    return gm


def _trace_once(model: nn.Module, leaf_modules: Iterable[LeafSpec], record_lines: bool, none: Iterable[str]) -> fx.GraphModule:
    tracer = _Tracer(leaf_modules, model)
    tracer.record_stack_traces = record_lines
    with _constants_taken_back(model):
        return _traced(model, tracer, none)


@contextlib.contextmanager
def _constants_taken_back(model: nn.Module) -> Iterator[None]:
    """torch.fx stores each tensor the trace met as a constant (one computed outside the trace, a
    global) on the model (`model._tensor_constant0`); the graph module holds its own reference,
    and the model is left as it was (across processes, such a reference to a parameter's
    graph keeps the parameter from being freed)."""
    before = set(vars(model))
    try:
        yield
    finally:
        for name in [name for name in vars(model) if name not in before and name.startswith("_tensor_constant")]:
            delattr(model, name)


@contextlib.contextmanager
def _is_tensor_watched() -> Iterator[list[bool]]:
    """Whether forward asked `torch.is_tensor` of a traced value (a Proxy, which it calls no
    tensor) while the block ran."""
    asked: list[bool] = []
    original = torch.is_tensor

    def is_tensor(obj: Any) -> bool:
        if isinstance(obj, fx.Proxy):
            asked.append(True)
        return original(obj)

    torch.is_tensor = is_tensor  # type: ignore[assignment]
    try:
        yield asked
    finally:
        torch.is_tensor = original  # type: ignore[assignment]


def _traced(model: nn.Module, tracer: _Tracer, none: Iterable[str]) -> fx.GraphModule:
    try:
        buffers = {(path, name): b for path, m in model.named_modules() for name, b in m._buffers.items()}
        held = _held_versions(model)
        with functions_as_calls(), assignments_refused(model), marking(tracer), grad_mode_watched() as switched, \
                inference_mode_watched() as inferred, autocast_watched() as entered, saved_tensor_hooks_watched() as hooked, \
                _is_tensor_watched() as asked:  # fmt: skip
            graph = tracer.trace(model, concrete_args=dict.fromkeys(none) or None)
            _buffer_updates_written(model, graph, buffers)
    except AssignmentError as error:
        raise TraceError(str(error)) from error
    except Exception as error:
        raise _untraceable(model, tracer, error) from error
    written = _written_while_traced(held)
    if written:
        raise TraceError(
            f"torch.fx cannot trace {type(model).__name__}: its forward writes parameters or buffers on their values "
            f"rather than through the trace ({', '.join(written)}: reached through self.parameters() or .data, say), "
            "and a traced graph would keep no such write: a momentum encoder's update in forward would never run.\n"
            "How to fix: let torch.export capture the model (a forward(*args) does), or keep the module that writes "
            "them whole (leaf_modules=[...]), or make the update outside forward, after optimizer.step()."
        )
    if inferred:
        raise TraceError(f"torch.fx cannot trace {type(model).__name__}: {INFERENCE_MODE}")
    if switched:
        raise TraceError(f"torch.fx cannot trace {type(model).__name__}: {grad_mode_message(switched, not torch.is_grad_enabled(), by_fx=True)}")
    if tracer.computed:
        raise TraceError(
            f"torch.fx cannot trace {type(model).__name__}: its forward computes a tensor from parameters on "
            "their values rather than through the trace (iterating self.parameters(), say), and a traced graph "
            "would keep it as a constant, computed once.\nHow to fix: let torch.export capture the model, or read "
            "the parameters by name (self.layer.weight)."
        )
    if entered:
        raise TraceError(
            f"torch.fx cannot trace {type(model).__name__}: its forward enters torch.autocast for a part (to run it in "
            "float32 under the caller's autocast, say), and a traced graph keeps the operations, not the autocast "
            "they ran under.\nHow to fix: let torch.export capture the model, or keep the module that enters it "
            "whole (leaf_modules=[...])."
        )
    if hooked:
        raise TraceError(f"torch.fx cannot trace {type(model).__name__}: {SAVED_TENSOR_HOOKS}")
    if asked:
        raise TraceError(
            f"torch.fx cannot trace {type(model).__name__}: its forward asks torch.is_tensor of a traced value, which "
            "torch.fx answers False for every tensor: the graph would keep the branch for numbers (diffusers' "
            "timesteps, say).\nHow to fix: let torch.export capture the model."
        )
    _drop_tensor_defaults(graph)
    _none_taken_as_given(graph, set(none))
    name = type(model).__name__
    try:
        return fx.GraphModule(tracer.root, graph, name)
    except Exception as error:
        raise TraceError(f"torch.fx traced {name}, but its graph does not compile: {type(error).__name__}: {error}") from error


def _none_taken_as_given(graph: fx.Graph, none: set[str]) -> None:
    """The arguments traced as None keep their names as inputs (torch.fx renames them `mask_1`),
    without torch.fx's check that they are None, which the pipeline makes before any stage runs."""
    for node in list(graph.nodes):
        if node.op == "call_function" and node.target is fx._symbolic_trace._assert_is_none:
            given, name = node.args[0], str(node.args[0].target).removesuffix("_1")  # type: ignore[union-attr]
            if name in none:
                given.target = name  # type: ignore[union-attr]
                given._rename(name)  # type: ignore[union-attr]
            graph.erase_node(node)


# A value of a class of the model's own, returned or passed between modules: neither front end
# can take it apart into tensors unless pytree knows the class.
UNKNOWN_TYPE_FIX = (
    "How to fix: return (and pass between modules) tuples, lists or dicts of tensors, or make the "
    "class a dataclass and register it with torch.export.register_dataclass, so that its tensors can "
    "be taken apart."
)


# A function or method handed to a call the trace records (a reentrant torch.utils.checkpoint's
# autograd Function): a graph holds tensors and plain values, not callables.
CALLABLE_FIX = (
    "How to fix: a function or method is passed to a call the trace records (torch.utils.checkpoint(self.fn, "
    "..., use_reentrant=True), say), which a graph cannot hold: pass a module instead (checkpoint(self.block, x)), "
    "use use_reentrant=False, or keep the module that makes the call whole (leaf_modules=[...])."
)


def _a_callable(text: str) -> bool:
    return any(f"argument of type: <class '{kind}'>" in text for kind in ("method", "function", "builtin_function_or_method", "functools.partial"))


def unknown_type(text: str) -> bool:
    """Whether a front end's failure is a value of a class it does not know (see UNKNOWN_TYPE_FIX)."""
    return "argument of type: <class" in text or "which is not a known type" in text


# `x op= y` on a tensor: the out-of-place operators a proxy falls back to.
_AUGMENTED = {
    operator.add, operator.sub, operator.mul, operator.truediv, operator.floordiv, operator.mod, operator.pow,
    operator.and_, operator.or_, operator.xor, operator.lshift, operator.rshift,
}


def _buffer_updates_written(model: nn.Module, graph: fx.Graph, buffers: dict[tuple[str, str], Any]) -> None:
    """`self.count += 1` on a buffer: a proxy has no `+=` of its own, so the trace adds out of place
    and assigns the sum to the buffer, where a tensor adds in place. A buffer left holding such a
    sum gets it written in (`copy_`) where it was made, and its tensor back: every later read,
    of the buffer or of a view of it, then sees the new value, as in the plain model. Two updates
    (`+=` then `*=`), or a write in place into the sum, are left as the assignment they look like
    (torch.fx refuses it, and torch.export takes the model)."""
    for path, module in model.named_modules():
        for name, value in list(module._buffers.items()):
            qualified = f"{path}.{name}" if path else name
            if not isinstance(value, fx.Proxy) or value.node.graph is not graph or not _one_update(model, value.node, qualified):
                continue
            with graph.inserting_after(value.node):  # into the buffer as read: later reads of it see the write
                graph.call_method("copy_", (value.node.args[0], value.node))
            module._buffers[name] = buffers[path, name]


def _one_update(model: nn.Module, node: fx.Node, qualified: str) -> bool:
    """`node` is one augmented operator on the buffer as read (`get_attr`), and nothing writes in
    place into it or into what is made from it."""
    source = node.args[0] if node.args else None
    if node.op != "call_function" or node.target not in _AUGMENTED or not isinstance(source, fx.Node):
        return False
    if source.op != "get_attr" or source.target != qualified:
        return False
    made, stack = {node}, [node]
    while stack:
        for user in stack.pop().users:
            if written_value(model, user) in made:
                return False
            if user not in made:
                made.add(user)
                stack.append(user)
    return True


def _held_versions(model: nn.Module) -> list[tuple[str, torch.Tensor, int, int]]:
    """Each parameter and buffer of `model`, by name, with its version and where its values live."""
    named = [*model.named_parameters(remove_duplicate=True), *model.named_buffers(remove_duplicate=True)]
    return [(name, t, t._version, t.data_ptr()) for name, t in named if t.layout == torch.strided and t.device.type != "meta"]


def _written_while_traced(held: list[tuple[str, torch.Tensor, int, int]]) -> list[str]:
    """The names of those `_held_versions` noted that were written in place, or given other
    values (`.data = ...`), since."""
    return [name for name, t, version, pointer in held if t._version != version or t.data_ptr() != pointer]


def _untraceable(model: nn.Module, tracer: "_Tracer", error: Exception) -> TraceError:
    where = tracer.failed_in
    fix = "How to fix: " + (
        f"mark {where!r} as a leaf (leaf_modules=[{where!r}] or its class), so it is called whole "
        "instead of traced, or " if where else ""
    ) + "rewrite data-dependent Python (control flow, or float(), .item() or numpy on a traced value) with tensor " + (
        "operations (torch.where; or torch.cond inside a module kept whole)." if where else "operations (torch.where), or move "
        "it into a submodule and keep that whole (leaf_modules=[...]; torch.cond runs there): the model's own forward is "
        "never kept whole."
    )
    refused = "Proxy" in str(error) and not unknown_type(str(error)) and _raised_in_a_library(model, where, error)
    if refused:  # a library's type check
        fix = (
            "How to fix: a function that takes real tensors only was given torch.fx's traced value (a Proxy): "
            + (f"keep {where!r} whole (leaf_modules=[{where!r}]), or " if where else "")
            + "register the function with torch.fx.wrap (or call it from a module kept whole), so that the "
            "trace records its call instead of running it."
        )
    if _in_packing(error):
        fix = (
            "How to fix: a packed sequence (pack_padded_sequence) cannot be traced: put the packing, the RNN and "
            "the unpacking in a submodule of their own and keep it whole (leaf_modules=[...]); unpack with "
            "pad_packed_sequence(..., total_length=x.shape[1]), so that every micro-batch keeps the padded length."
        )
    return TraceError(
        f"torch.fx cannot trace {type(model).__name__}: {type(error).__name__}: {error}\n"
        f"  - in module: {where or 'the root module'}\n"
        f"  - at: {_user_frame(error)}\n"
        + (CALLABLE_FIX if _a_callable(str(error)) else UNKNOWN_TYPE_FIX if unknown_type(str(error)) else fix),
        whole=where if where and (_stopped_on_a_traced_value(error) or _in_packing(error)) else None,
    )


def _raised_in_a_library(model: nn.Module, where: Optional[str], error: Exception) -> bool:
    """The error was raised in a function the module's forward called (einops' type check), not in
    the forward's own code (`h[:, 0] = 0` on a traced value) nor in torch."""
    frames = traceback.extract_tb(error.__traceback__)
    if not frames or frames[-1].filename.startswith(_TORCH_DIR):
        return False
    try:
        own = inspect.getsourcefile(type(model.get_submodule(where or "")).forward)
    except (AttributeError, TypeError):
        return False
    return (frames[-1].filename, frames[-1].name) != (own, "forward")


def _stopped_on_a_traced_value(error: Exception) -> bool:
    """The forward did what a traced value cannot take: a library's type check (einops), a key
    looked up by it, its shape unpacked (`b, n, d = *x.shape`). Called whole, the module does it
    on real tensors. Not a write into it (`h[:, 0] = 0`): a module called whole that writes its
    input cannot take a stage's input, which autograd keeps as a leaf."""
    text = str(error)
    return "Proxy" in text and not unknown_type(text) and "does not support item assignment" not in text


_PACKING = frozenset({"pack_padded_sequence", "pack_sequence", "pad_packed_sequence", "pad_sequence"})


def _in_packing(error: Exception) -> bool:
    """The trace failed inside torch's packing of variable-length sequences for an RNN."""
    frames = traceback.extract_tb(error.__traceback__)
    return any(frame.name in _PACKING for frame in frames) or "PackedSequence" in str(error)


def _drop_tensor_defaults(graph: fx.Graph) -> None:
    """A tensor default of a forward argument (`mask=torch.zeros(1)`) cannot be written into
    generated code; the pipeline applies the model's own defaults when it binds a call."""
    for node in list(graph.nodes):
        if node.op == "placeholder" and node.all_input_nodes:  # the default is a graph value
            node.args = ()
    for node in list(graph.nodes):
        if node.op == "get_attr" and not node.users:
            graph.erase_node(node)
