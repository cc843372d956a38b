"""Random streams per (step, micro-batch, graph node), so dropout is reproducible and replayable.

All CPU stage threads share one default generator: the order in which concurrent tasks draw from
it would be a race. Each task has a stream of its own instead, and each node of the graph that
draws its own generator in it, seeded from the step's seed, the micro-batch and the node: the
recompute of a checkpointed task reseeds the same way and gets the same masks, and a node draws
the same masks whichever stage it lands in, so that another cut (another checkpoint mode, whose
memory the default balance counts, or another stage count) trains on the same numbers.

The random ops a stage's graph shows (`nn.Dropout`, `F.dropout`, `torch.rand*`, `x.bernoulli_()`,
...) are rewritten to take their node's generator: no Python runs for the other ops. A random op
hidden from the graph (inside a module called whole, attention with dropout, an exported aten op)
runs under `TaskRandomness`, a dispatch mode that hands every random aten op the generator of the
node that runs: only while that node runs (between its `begin_draws` and `end_draws`), since the
mode costs a Python call per op. A forward hook may draw around any op: while a stage's modules
have hooks the mode covers the whole stage, and a draw no node is marked for takes the stage's
own generator.
"""
from __future__ import annotations

import enum
import threading
import zlib
from contextlib import contextmanager
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from fxpipe.core.eager_mode import CondRunsEagerly, is_higher_order, run_higher_order
from fxpipe.core.hooks import hooked
from fxpipe.core.scoped import scoped

_MASK = (1 << 64) - 1
# Guards the swap of a device's default generator, for random ops that take no generator.
_SWAP_LOCK = threading.RLock()
_local = threading.local()


def task_seed(step_seed: int, micro_batch: int, stage: int) -> int:
    """A well-mixed 63-bit seed from the step's seed and the task's coordinates (splitmix64)."""
    x = (step_seed * 0x9E3779B97F4A7C15 + micro_batch * 0xBF58476D1CE4E5B9 + stage) & _MASK
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK
    return (x ^ (x >> 31)) >> 1


def draw_step_seed() -> int:
    """A seed for one pipeline step, drawn from the caller's default generator, so that
    `torch.manual_seed` before a step fixes all of its random masks."""
    return int(torch.randint(0, 2**62, (), dtype=torch.int64).item())


def seed_started_generators(seed: int) -> None:
    """`torch.manual_seed(seed)` for the CPU and CUDA where it has started. torch's own also
    queues the seed for a CUDA not started yet, to apply at its first use: after compiling has
    put the generators back, it would reseed the caller's CUDA generator."""
    torch.random.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


@contextmanager
def generator_put_back_on_error() -> Iterator[None]:
    """A call that fails leaves the caller's generator as it found it (as it leaves `.grad` and
    the buffers), whatever its stages or its `loss_fn` drew before the failure."""
    before = torch.get_rng_state()
    try:
        yield
    except BaseException:
        torch.set_rng_state(before)
        raise


# Node keys are offset past every stage index, so that no node's generator is a stage's.
_NODE_KEYS = 1 << 32


# A key at or above this one draws alike in every micro-batch of a step (`WHOLE_BATCH_DRAW`).
_WHOLE_BATCH = 1 << 32
_ANY_MICRO_BATCH = 1 << 31  # the micro-batch coordinate such a draw is seeded with


def draw_key(name: str, whole_batch: bool = False) -> int:
    """A node's key among the draws of a task: from its name in the traced graph, which every cut
    of the graph keeps; `whole_batch`: a value drawn once for the whole batch, alike in every
    micro-batch of the step."""
    return zlib.crc32(name.encode()) + (_WHOLE_BATCH if whole_batch else 0)


class Unseen(enum.Enum):
    """Where a stage's draws may hide from its graph: where `TaskRandomness` must run."""

    NOWHERE = 0
    MARKED = 1  # in nodes marked by `begin_draws`: the mode runs while one of them does
    ANYWHERE = 2  # in forward hooks too, around any op: the mode runs around the whole stage


class TaskStream:
    """The random stream of one task: a generator per graph node that draws (per device), made on
    first use; `key` marks the node whose hidden draws run now (`begin_draws`), and `mode` is the
    dispatch mode entered for it, where the stage runs under none of its own."""

    def __init__(self, step_seed: int, micro_batch: int, stage: int, per_node: bool = False) -> None:
        self.step_seed, self.micro_batch, self.stage = step_seed, micro_batch, stage
        self.key: Optional[int] = None
        self.generators: dict[tuple[int, torch.device], tuple[torch.Generator, int]] = {}
        self.per_node = per_node  # `begin_draws` enters the dispatch mode (`Unseen.MARKED`)
        self.mode: Optional[TaskRandomness] = None

    def generator(self, device: torch.device, key: Optional[int] = None) -> torch.Generator:
        """The generator of node `key` (default: the node marked now, else the stage's own)."""
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        key = key if key is not None else self.key
        slot = self.stage if key is None else _NODE_KEYS + key
        found = self.generators.get((slot, device))
        if found is None:
            micro_batch = _ANY_MICRO_BATCH if key is not None and key >= _WHOLE_BATCH else self.micro_batch
            seed = task_seed(self.step_seed, micro_batch, slot)
            found = self.generators[(slot, device)] = (torch.Generator(device=device).manual_seed(seed), seed)
        return found[0]

    def drew(self) -> bool:
        """Whether any op drew from the stream: a generator handed to an op that did not draw
        (RReLU in eval mode) is still at its seed."""
        return any(
            not torch.equal(g.get_state(), torch.Generator(device=device).manual_seed(seed).get_state())
            for (_, device), (g, seed) in self.generators.items()
        )


@contextmanager
def task_stream(stream: TaskStream) -> Iterator[None]:
    """Random ops rewritten by `draw_from_task_streams` draw from `stream` on this thread; a
    marked node that raised before its `end_draws` has its dispatch mode left here."""
    try:
        with scoped(_local, "stream", stream):
            yield
    finally:
        _leave_node_mode(stream)


def _generator(device: torch.device, key: Optional[int]) -> Optional[torch.Generator]:
    stream: Optional[TaskStream] = getattr(_local, "stream", None)
    return stream.generator(device, key) if stream is not None else None


def begin_draws(key: int) -> None:
    """Before a node whose draws the graph does not show: they take its generator."""
    stream: Optional[TaskStream] = getattr(_local, "stream", None)
    if stream is not None:
        stream.key = key
        if stream.per_node and stream.mode is None:
            stream.mode = TaskRandomness(stream)
            stream.mode.__enter__()


def end_draws() -> None:
    stream: Optional[TaskStream] = getattr(_local, "stream", None)
    if stream is not None:
        stream.key = None
        _leave_node_mode(stream)


def _leave_node_mode(stream: TaskStream) -> None:
    mode, stream.mode = stream.mode, None
    if mode is not None:
        mode.__exit__(None, None, None)


# -- the rewritten random ops ----------------------------------------------------------------------
def _dropout(x: torch.Tensor, p: float, inplace: bool, generator: torch.Generator) -> torch.Tensor:
    if p == 1:
        return x.mul_(0) if inplace else x * 0
    mask = torch.empty_like(x).bernoulli_(1 - p, generator=generator)
    mask.mul_(1 / (1 - p))
    return x.mul_(mask) if inplace else x * mask


def dropout_module(module: nn.Dropout, x: torch.Tensor, *, draw_key: Optional[int] = None) -> torch.Tensor:
    """`module(x)`, with the mask drawn from the node's generator. A module with hooks (its own or
    global ones, forward or backward, registered before compiling or after) is called itself,
    its draw handed the generator by `TaskRandomness`, so that its hooks run as in the plain model."""
    if not module.training or module.p == 0:  # first: under torch.compile, no draw, no break
        return module(x)
    stream: Optional[TaskStream] = getattr(_local, "stream", None)
    if stream is None:
        return module(x)
    if hooked(None) or hooked(module):
        previous, stream.key = stream.key, draw_key
        try:
            with TaskRandomness(stream):
                return module(x)
        finally:
            stream.key = previous
    return _dropout(x, module.p, module.inplace, stream.generator(x.device, draw_key))


def dropout_function(
    x: torch.Tensor, p: float = 0.5, training: bool = True, inplace: bool = False, *, draw_key: Optional[int] = None
) -> torch.Tensor:
    """`F.dropout`, with the mask drawn from the node's generator."""
    if not training or p == 0:
        return F.dropout(x, p, training, inplace)
    generator = _generator(x.device, draw_key)
    if generator is None:
        return F.dropout(x, p, training, inplace)
    return _dropout(x, p, inplace, generator)


def _device_of(args: tuple[Any, ...], kwargs: dict[str, Any]) -> torch.device:
    if kwargs.get("device") is not None:
        return torch.device(kwargs["device"])
    leaves, _ = tree_flatten((args, kwargs))
    return next((t.device for t in leaves if isinstance(t, torch.Tensor)), torch.device("cpu"))


def with_generator(name: str, *args: Any, draw_key: Optional[int] = None, **kwargs: Any) -> Any:
    """`torch.<name>(*args, **kwargs)` (`rand`, `bernoulli`...) drawing from the node's generator."""
    function = getattr(torch, name)
    generator = _generator(_device_of(args, kwargs), draw_key)
    return function(*args, **kwargs) if generator is None else function(*args, generator=generator, **kwargs)


def method_with_generator(name: str, self: torch.Tensor, *args: Any, draw_key: Optional[int] = None, **kwargs: Any) -> Any:
    """`self.<name>(*args, **kwargs)` (`bernoulli_`, `uniform_`...) drawing from the node's generator."""
    generator = _generator(self.device, draw_key)
    method = getattr(self, name)
    return method(*args, **kwargs) if generator is None else method(*args, generator=generator, **kwargs)


# For compiled stages (fxpipe/compiled/stage_compile.py), in the steps where they draw: the draws run
# eagerly, outside the compiled graph, so that they take the task's stream as an eager stage's
# do and a recompute replays them, whatever the backend.
DRAWS = (dropout_module, dropout_function, with_generator, method_with_generator, begin_draws, end_draws)
MARKERS = (begin_draws, end_draws)  # no draw themselves: a step that draws nothing skips them


# Namespaces of torch's own ops, whose schemas' tags say whether they draw; a library's own op
# (torch.library.custom_op) may draw in its kernel, unseen.
TORCH_NAMESPACES = frozenset({"aten", "prims", "quantized_decomposed", "_quantized", "quantized"})


class TaskRandomness(CondRunsEagerly):
    """Within this mode, random ops draw from the generators of a task's stream (a torch.cond's
    branch's too)."""

    def __init__(self, stream: TaskStream) -> None:
        super().__init__()
        self.stream = stream

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Optional[dict[str, Any]] = None) -> Any:
        kwargs = kwargs or {}
        if is_higher_order(func):
            return run_higher_order(self, func, args, kwargs)
        drawing, at = _op_facts(func)
        given = kwargs.get("generator") if at is None or at >= len(args) else args[at]  # (RReLU's comes by position)
        if not drawing or given is not None:
            return func(*args, **kwargs)
        own = self.stream.generator(_device_of(args, kwargs))
        if at is not None and at >= len(args):
            return func(*args, **{**kwargs, "generator": own})
        if at is not None:
            return func(*args[:at], own, *args[at + 1 :], **kwargs)
        # No generator argument (native_dropout, a library's own op): swap the device's default
        # generator. Other draws fxpipe runs meanwhile (a loss, the caller's side of a 2bw loop)
        # wait for it (`default_generator_held`).
        with _SWAP_LOCK:
            default = _default_generator(own.device)
            saved = default.get_state()
            default.set_state(own.get_state())
            try:
                result = func(*args, **kwargs)
                own.set_state(default.get_state())
            finally:
                default.set_state(saved)
        return result


# Per op: whether it may draw, and where its generator argument is. Read from its schema once:
# each read builds Python objects of every argument, at the cost of a small op's own work.
_OP_FACTS: dict[Any, tuple[bool, Optional[int]]] = {}


def _op_facts(func: Any) -> tuple[bool, Optional[int]]:
    found = _OP_FACTS.get(func)
    if found is None:
        drawing = torch.Tag.nondeterministic_seeded in func.tags or func.namespace not in TORCH_NAMESPACES
        at = next((k for k, a in enumerate(func._schema.arguments) if a.name == "generator"), None)
        found = _OP_FACTS[func] = (drawing, at)
    return found


@contextmanager
def default_generator_held() -> Iterator[None]:
    """Around draws from torch's default generators that run beside the stages (a loss on a
    worker, a 2bw loop's caller side): no stage swaps one for its stream meanwhile."""
    with _SWAP_LOCK:
        yield


def _default_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return torch.cuda.default_generators[device.index if device.index is not None else torch.cuda.current_device()]
    return torch.default_generator


DROPOUTS = (nn.modules.dropout._DropoutNd,)


def dropout_rate(module: nn.Module) -> Optional[float]:
    """The `dropout` rate of built-in modules that apply one themselves (RNNs, attention)."""
    rate = getattr(module, "dropout", None)
    return float(rate) if isinstance(rate, (int, float)) and not isinstance(rate, bool) else None


def draw_rate(module: nn.Module) -> Optional[float]:
    """How often a built-in module draws while training (0: never), or None for one that never
    draws: a dropout's p, an RNN's or attention's `dropout`, and RReLU's random slopes."""
    if isinstance(module, DROPOUTS):
        return float(module.p)
    if isinstance(module, nn.RReLU):
        return 1.0
    return dropout_rate(module)


def draws_now(modules: Sequence[nn.Module]) -> bool:
    """Whether any of these modules draws when called now: training, rate > 0
    (read once per step, so that a rate changed between steps takes effect)."""
    for m in _every_module(modules):
        if m.training and draw_rate(m):
            return True
    return False


def _every_module(modules: Sequence[nn.Module]) -> list[nn.Module]:
    """These modules and all inside them, each once (those `modules()` gives, in another order):
    read at every step, so a walk of their tables, without `modules()`'s generator per level."""
    found: dict[int, nn.Module] = {}
    pending: list[Optional[nn.Module]] = list(modules)
    while pending:
        module = pending.pop()
        if module is not None and id(module) not in found:  # (a child slot may hold None; a module, itself)
            found[id(module)] = module
            pending.extend(module._modules.values())
    return list(found.values())


def runs_hooks(modules: Sequence[nn.Module]) -> bool:
    """Whether calling these modules runs forward hooks or pre-hooks (their own, those of the
    modules inside them, or global ones): a hook's draws do not show in the graph."""
    if modules and (nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks):
        return True
    for m in _every_module(modules):
        if m._forward_hooks or m._forward_pre_hooks:
            return True
    return False
