"""Shape propagation: what each node produces (shape, dtype, bytes) and its forward FLOPs, from one
example input."""
from __future__ import annotations

import math
from typing import Any, Callable, Optional

import torch
import torch.fx as fx
from torch import nn
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_map
from torch.utils.flop_counter import flop_registry

from fxpipe.core.eager_mode import EagerDispatchMode, is_higher_order, run_higher_order
from fxpipe.core.microbatch import takes_gradients
from fxpipe.core.snapshot import preserved
from fxpipe.tracing.assignments import assignments_recorded


class FlopCount(EagerDispatchMode):
    """Counts FLOPs with torch.utils.flop_counter's formulas, without its per-module tracking."""

    def __init__(self) -> None:
        super().__init__()
        self.flops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if is_higher_order(func):
            return run_higher_order(self, func, args, kwargs)
        out = func(*args, **kwargs)
        formula = flop_registry.get(func._overloadpacket)
        if formula is not None:
            self.flops += formula(*args, **kwargs, out_val=out)
        return out


def _describe(value: Any) -> dict[str, Any]:
    """Shapes, dtypes and total bytes of every tensor in a (nested) value; `opaque`, the types in
    it that hold tensors where pytree cannot see them."""
    if isinstance(value, torch.Tensor):  # most nodes: what the walk below gives for one tensor, without it
        return {"shape": tuple(value.shape), "dtype": value.dtype, "bytes": value.numel() * value.element_size(), "opaque": []}
    leaves, _ = tree_flatten(value, is_leaf=lambda v: isinstance(v, PackedSequence))
    tensors = [leaf for leaf in leaves if isinstance(leaf, torch.Tensor)]
    if any(isinstance(leaf, PackedSequence) for leaf in leaves):
        raise ValueError(
            "a PackedSequence is a value of the graph (the model's input, or what a module kept whole returns): its "
            "samples are packed together, sorted by length, so no stage can take a micro-batch of it, nor send it "
            "on.\nHow to fix: pass the padded batch and its lengths, and keep the packing, the RNN and the "
            "unpacking (pad_packed_sequence(..., total_length=...)) in one module kept whole (leaf_modules=[...])."
        )
    shapes = tree_map(lambda v: tuple(v.shape) if isinstance(v, torch.Tensor) else None, value)
    return {
        "shape": shapes,
        "dtype": tensors[0].dtype if len(tensors) == 1 else tuple(t.dtype for t in tensors),
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
        "opaque": sorted({type(leaf).__name__ for leaf in leaves if _holds_tensors(leaf)}),
    }


def _holds_tensors(leaf: Any) -> bool:
    """A pytree leaf that is no tensor but keeps tensors in its fields (a dataclass not registered
    with pytree, say): split into micro-batches, sent and gathered, it would go whole."""
    if isinstance(leaf, (torch.Tensor, nn.Module)) or not hasattr(leaf, "__dict__"):
        return False
    return any(isinstance(t, torch.Tensor) for t in tree_flatten(list(vars(leaf).values()))[0])


_FLOP_WORDS = ("mm", "matmul", "linear", "conv", "einsum", "attention", "addbmm", "tensordot", "bilinear")
_MATMULS = {"matmul", "mm", "bmm", "linear"}
# Built-in modules that run matmuls inside; the other built-ins are elementwise, norms, pools,
# lookups (or Linear and convolutions, counted from shapes).
_COMPOSITE_MODULES = (
    nn.MultiheadAttention, nn.RNNBase, nn.Transformer, nn.TransformerEncoder, nn.TransformerDecoder,
    nn.TransformerEncoderLayer, nn.TransformerDecoderLayer, nn.Bilinear,
)  # fmt: skip


class Recorder(fx.Interpreter):
    """Runs the graph and writes a description of each node's value into `node.meta`.

    On the meta device (`on_meta`), a module's parameters and buffers are swapped for meta
    copies for the call, so nothing is computed and nothing is allocated.
    """

    def __init__(self, gm: fx.GraphModule, on_meta: bool) -> None:
        super().__init__(gm)
        self.on_meta = on_meta
        self.copies: dict[int, Any] = {}

    def meta(self, value: Any) -> Any:
        if not self.on_meta:
            return value

        def copy(t: torch.Tensor) -> torch.Tensor:
            if id(t) not in self.copies:
                self.copies[id(t)] = t.detach().to("meta")
            return self.copies[id(t)]

        return tree_map(lambda v: copy(v) if isinstance(v, torch.Tensor) else v, value)

    def placeholder(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.meta(super().placeholder(target, args, kwargs))

    def get_attr(self, target: Any, args: Any, kwargs: Any) -> Any:
        return self.meta(super().get_attr(target, args, kwargs))

    def call_module(self, target: Any, args: Any, kwargs: Any) -> Any:
        if not self.on_meta:
            return super().call_module(target, args, kwargs)
        module = self.fetch_attr(target)
        state = {name: self.meta(t) for name, t in [*module.named_parameters(), *module.named_buffers()]}
        return torch.func.functional_call(module, state, args, kwargs)

    def run_bare(self, n: fx.Node) -> Any:
        """`n` run as `fx.Interpreter.run_node` runs it, without the two context managers that
        name the node for code that traces under an interpreter (nothing traces here): a tenth
        of a large graph's run on the example."""
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        return getattr(self, n.op)(n.target, args, kwargs)

    def run_node(self, n: fx.Node) -> Any:
        formula = self.known_flops(n)
        if formula is not None:
            value = self.run_bare(n)
            flops = formula(value)
        else:
            try:
                with FlopCount() as counter:
                    value = self.run_bare(n)
                flops = counter.flops
            except Exception:  # noqa: BLE001 - a fused path that counting breaks (TransformerEncoderLayer's, autocast)
                value = self._run_uncounted(n)
                flops = self.estimated_flops(n)
        if n.op != "output":
            n.meta.update(_describe(value), flops=flops)
            n.meta.pop("held_bytes", None)
            if n.op == "call_module" and not self.on_meta and _holds_inside(self.fetch_attr(str(n.target))):
                n.meta["held_bytes"] = n.meta["bytes"] + self.saved_inside(n)
        return value

    def saved_inside(self, n: fx.Node) -> int:
        """Bytes that autograd saves inside a module called whole for its backward, besides its
        inputs, outputs and own tensors (a TransformerEncoderLayer's attention weights and
        hidden layer): its node's output alone would count a tenth of what it holds. One more
        run of the module, with gradients, from its state and random state as they are."""
        module = self.fetch_attr(str(n.target))
        args, kwargs = self.fetch_args_kwargs_from_env(n)
        args, kwargs = tree_map(lambda v: v.detach().requires_grad_(takes_gradients(v)) if isinstance(v, torch.Tensor) else v, (args, kwargs))
        given = {_storage(t) for t in tree_flatten((args, kwargs, [*module.parameters(), *module.buffers()]))[0] if isinstance(t, torch.Tensor)}
        saved: dict[int, int] = {}
        # Alive for the run (a freed tensor's memory, taken again, would count once), then let go:
        # the graph holds this hook, and an output kept here with its graph would hold the graph
        # (and the module's parameters) in a cycle no collector sees.
        alive: list[torch.Tensor] = []

        def pack(t: torch.Tensor) -> None:
            alive.append(t)
            saved[_storage(t)] = t.untyped_storage().nbytes()

        try:
            # (what the module assigns, a call counter, put back too: the graph's later nodes read it)
            with preserved(module), assignments_recorded(module), torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, _never_unpacked):
                out = module(*args, **kwargs)
            given |= {_storage(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)}
        except Exception:  # noqa: BLE001 - the node's output stands for it, as for any node
            return 0
        finally:
            alive.clear()
        return sum(size for storage, size in saved.items() if storage not in given)

    def _run_uncounted(self, n: fx.Node) -> Any:
        """`n` run without counting; with grad on where it fails without: nn.TransformerEncoder's
        inference fast path (taken under no_grad, given a padding mask) fails under autocast,
        where the path the model trains on runs."""
        try:
            return self.run_bare(n)
        except Exception:
            if torch.is_grad_enabled():
                raise
            with torch.enable_grad():
                return self.run_bare(n)

    def estimated_flops(self, n: fx.Node) -> int:
        """Two per parameter per row of the first input (a module's matmuls), where they cannot
        be counted."""
        args = fx.map_arg(n.args, lambda a: self.env[a])
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if n.op != "call_module" or first is None or first.dim() == 0:
            return 0
        params = sum(p.numel() for p in self.fetch_attr(str(n.target)).parameters())
        return 2 * params * (first.numel() // first.shape[-1])

    def known_flops(self, n: fx.Node) -> Optional[Callable[[Any], int]]:
        """FLOPs of the common matmul and convolution nodes straight from shapes, and none for
        nodes that cannot run such ops; None where only counting the ops will tell (a custom
        module, attention). Counting costs a Python dispatch per op, and its first use imports
        the compiler stack."""
        args = fx.map_arg(n.args, lambda a: self.env[a])
        first = args[0] if args and isinstance(args[0], torch.Tensor) else None
        if n.op == "call_module":
            module = self.fetch_attr(str(n.target))
            if isinstance(module, nn.Linear):
                return lambda out: 2 * out.numel() * module.in_features
            if isinstance(module, nn.modules.conv._ConvTransposeNd) and first is not None:
                per_input = module.out_channels // module.groups * math.prod(module.kernel_size)
                return lambda out: 2 * first.numel() * per_input
            if isinstance(module, nn.modules.conv._ConvNd):
                per_output = module.in_channels // module.groups * math.prod(module.kernel_size)
                return lambda out: 2 * out.numel() * per_output
            built_in = type(module).__module__.startswith("torch.nn.")
            return None if not built_in or isinstance(module, _COMPOSITE_MODULES) else lambda out: 0
        if n.op in ("call_function", "call_method"):
            name = getattr(n.target, "__name__", str(n.target))
            if name in _MATMULS and first is not None:
                return lambda out: 2 * out.numel() * first.shape[-1]
            return None if any(word in name for word in _FLOP_WORDS) else lambda out: 0
        return lambda out: 0


def _holds_inside(module: nn.Module) -> bool:
    """A module called whole that computes more than one op: built-in composites, and any with
    submodules (one kept whole by leaf_modules)."""
    return isinstance(module, _COMPOSITE_MODULES) or next(module.children(), None) is not None


def _never_unpacked(packed: None) -> torch.Tensor:
    raise RuntimeError("saved_inside's run has no backward")


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


Watch = Callable[[fx.Node, Any, tuple[Any, ...]], None]  # (node, its value, its arguments' values)
Before = Callable[[fx.Node, dict[fx.Node, Any]], None]  # (node, the values of the nodes it takes)


class _Watching(Recorder):
    """Runs the graph as `Recorder` does, handing each node's value and arguments to `watch`."""

    def __init__(self, gm: fx.GraphModule, on_meta: bool, watch: Watch, before: Optional[Before]) -> None:
        super().__init__(gm, on_meta)
        self.watch, self.before = watch, before

    def run_node(self, n: fx.Node) -> Any:
        if self.before is not None:
            self.before(n, {a: self.env[a] for a in n.all_input_nodes})
        value = self.run_bare(n)
        self.watch(n, value, fx.map_arg(n.args, lambda a: self.env[a]))
        return value


def run_watching(gm: fx.GraphModule, example: tuple[Any, ...], watch: Watch, before: Optional[Before] = None) -> None:
    """Run the graph on `example` as `propagate_shapes` does, calling `watch(node, value, args)`
    after each node instead of annotating it (and `before(node, inputs)` ahead of it)."""
    _run(gm, example, lambda on_meta: _Watching(gm, on_meta, watch, before))


def _run(gm: fx.GraphModule, example: tuple[Any, ...], interpreter: Callable[[bool], fx.Interpreter], on_meta: Optional[bool] = None) -> None:
    """Run `interpreter(on_meta)` on `example`: on the meta device unless the model is small on
    the CPU (or `on_meta` says), for real when the meta device cannot run it; the graph's state
    and the random states left as they were."""
    if on_meta is None:
        on_meta = not small_on_cpu(gm, example)
    # A real run updates running statistics and draws random numbers: the model must not see it.
    with preserved(gm), torch.no_grad():
        if on_meta:
            try:
                interpreter(True).run(*example)
                return
            except Exception:  # noqa: BLE001 - a graph the meta device cannot run runs for real
                pass
        interpreter(False).run(*example)


# Below this many parameter bytes (all on the CPU), one real forward of the example is faster than
# the meta device, whose first use alone takes seconds.
REAL_RUN_LIMIT = 1 << 30


def small_on_cpu(gm: nn.Module, example: tuple[Any, ...]) -> bool:
    """Whether one real run of `gm` on `example` is cheaper than one on the meta device: all on the
    CPU, under REAL_RUN_LIMIT bytes of parameters."""
    tensors = [*gm.parameters(), *gm.buffers(), *(t for t in tree_flatten(example)[0] if isinstance(t, torch.Tensor))]
    return all(t.device.type == "cpu" for t in tensors) and sum(t.numel() * t.element_size() for t in gm.parameters()) < REAL_RUN_LIMIT


def propagate_shapes(gm: fx.GraphModule, example: tuple[Any, ...], on_meta: Optional[bool] = None) -> fx.GraphModule:
    """Annotate every node with `shape`, `dtype` and `bytes` of what it produces, and `flops`
    (forward, as `torch.utils.flop_counter` counts them).

    On the meta device nothing is computed or allocated; by default a model under
    `REAL_RUN_LIMIT` bytes on the CPU runs once for real instead (faster), as does a graph that
    cannot run on the meta device (a leaf module that reads values, say). The graph's state
    and the random states are left as they were.
    """
    _run(gm, example, lambda meta: Recorder(gm, on_meta=meta), on_meta)
    return gm
