"""Generated stages under torch.compile: the options, one compiled forward per stage, its compiles counted.

Each stage is an fx GraphModule already, so compiling it is one `torch.compile` of its forward:
dynamo captures the graph, AOTAutograd its backward, and the backend (inductor by default) both.
The runtime calls the compiled forward where it called the eager one, in every place a stage
runs (forward, checkpointed forward, recompute), so the schedules, checkpointing and transport
are those of eager stages. Random draws stay eager, from the task's stream (fxpipe/core/randomness.py):
a recompute replays the masks its forward drew, bit for bit, whatever the backend.

A stage compiles once per calling context (grad mode, autocast, the training flag, which inputs
require grad, whether it draws): a checkpointed forward runs under grad, as its recompute does,
so the two run one graph, the kernels of one compile (a graph compiled under no_grad may fuse
and round apart). Any other compile is a recompile, a guard that failed
(a new shape, a flag changed): it is counted, and the first one is reported, naming the stage and
the guard.
"""
from __future__ import annotations

import difflib
import re
import threading
import time
import types
import warnings
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import cache, partial
from typing import Any, Callable, ContextManager, Hashable, Iterator, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn
from torch.fx.graph_module import _forward_from_src
from torch.utils._pytree import tree_map_only

from fxpipe.core.eager_calls import EAGER_IN_COMPILED
from fxpipe.core.own_code import caller_stacklevel
from fxpipe.core.randomness import DRAWS, MARKERS
from fxpipe.passes.sources import reached_from

# What `compile_stages={...}` may hold: torch.compile's own arguments, passed through.
COMPILE_KEYS = ("mode", "dynamic", "backend", "fullgraph", "options")
_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")


def compile_options(value: Any) -> tuple[Optional[dict[str, Any]], list[str]]:
    """`compile_stages` as torch.compile's keyword arguments (None: stages run eagerly), and
    the problems with it."""
    if value is False or value is None:
        return None, []
    if value is True:
        return {}, []
    if not isinstance(value, dict):
        return None, [f"compile_stages must be True, False or a dict of torch.compile's arguments ({', '.join(COMPILE_KEYS)}) (got {value!r})"]
    problems = [f"compile_stages has {key!r}, which is not one of torch.compile's arguments it passes on ({', '.join(COMPILE_KEYS)})" for key in value if key not in COMPILE_KEYS]
    mode = value.get("mode")
    if mode is not None and mode not in _MODES:
        problems.append(f"compile_stages['mode'] must be one of {', '.join(map(repr, _MODES))} (got {mode!r})")
    if mode is not None and value.get("options") is not None:
        problems.append("compile_stages gives both 'mode' and 'options', which torch.compile refuses: give one of them")
    if not isinstance(value.get("fullgraph", False), bool):
        problems.append(f"compile_stages['fullgraph'] must be True or False (got {value['fullgraph']!r})")
    if value.get("dynamic") not in (None, True, False):
        problems.append(f"compile_stages['dynamic'] must be None, True or False (got {value['dynamic']!r})")
    backend = value.get("backend", "inductor")
    if not (callable(backend) or (isinstance(backend, str) and backend in torch._dynamo.list_backends(exclude_tags=()))):
        problems.append(f"compile_stages['backend'] must be a callable or one of {torch._dynamo.list_backends()} (got {backend!r})")
    if value.get("options") is not None and not isinstance(value["options"], dict):
        problems.append(f"compile_stages['options'] must be a dict of the backend's options (got {value['options']!r})")
    problems = problems or _backend_problems(value)
    return (dict(value) if not problems else None), problems


def _backend_problems(options: dict[str, Any]) -> list[str]:
    """What the backend says of its options, said before anything is traced rather than at the
    first stage it compiles: inductor checks each option's name and type as it is built."""
    try:
        _backend(options)
    except (RuntimeError, TypeError, ValueError) as error:
        unknown = re.match(r"Unexpected optimization option (\S+?),", str(error))
        if unknown is None:
            return [f"compile_stages['options']: {str(error).splitlines()[0]}"]
        close = difflib.get_close_matches(unknown[1], torch._inductor.list_options(), n=3)
        meant = f"did you mean {' or '.join(map(repr, close))}?" if close else "torch._inductor.list_options() lists them"
        return [f"compile_stages['options'] has {unknown[1]!r}, which is not one of inductor's options ({meant})"]
    return []


@dataclass
class StageCompiles:
    """What compiling one stage cost: graphs handed to the backend, the seconds spent there (the
    forward graphs; a backward graph compiles at its first backward, inside that step's time),
    and the recompiles, each with the guard that failed."""

    stage: int
    graphs: int = 0
    seconds: float = 0.0
    recompiles: list[str] = field(default_factory=list)


def _backend(options: dict[str, Any]) -> Any:
    """The backend torch.compile would build from these options."""
    backend, mode, extra, dynamic = options.get("backend", "inductor"), options.get("mode"), options.get("options"), options.get("dynamic")
    if backend == "inductor":
        return torch._TorchCompileInductorWrapper(mode, extra, dynamic)  # type: ignore[attr-defined]
    return torch._TorchCompileWrapper(backend, mode, extra, dynamic)  # type: ignore[attr-defined]


def _calling_context(training: bool) -> Hashable:
    """What a stage's graph is specialised on besides its inputs: grad and inference mode,
    autocast, and the model's training flag."""
    return (
        torch.is_grad_enabled(), torch.is_inference_mode_enabled(), training,
        torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu"),
        torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda"),
    )  # fmt: skip


@cache
def _eager(function: Callable[..., Any]) -> Callable[..., Any]:
    """`function` (a draw, or the runtime's own bookkeeping) as dynamo runs it: outside the
    graph. Made on first use, since disabling imports dynamo, a second or more that `import
    fxpipe` need not pay."""
    return torch.compiler.disable(function)


def stage_forward(module: fx.GraphModule, draws: bool) -> Callable[..., Any]:
    """The stage's forward for the steps that draw, with its draws (`DRAWS`) run outside
    the compiled graph (dynamo breaks the graph at each, in the stage's own frame); or for the
    others, without the marks of unseen draws (`MARKERS`), which would break it for nothing.
    The runtime's own calls (`EAGER_IN_COMPILED`: a deferred BatchNorm) run outside it in both."""
    graph = fx.Graph()
    graph._codegen = module.graph._codegen
    graph.output(graph.graph_copy(module.graph, {}))
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target in EAGER_IN_COMPILED:
            node.target = _eager(node.target)
        elif node.target not in DRAWS:
            continue
        elif draws:
            node.target = _eager(node.target)
        elif node.target in MARKERS:
            graph.erase_node(node)
    code = graph.python_code(root_module="self")
    return types.MethodType(_forward_from_src(code.src, code.globals), module)


class _CompileLock:
    """Many stages run compiled graphs at once; one compiles at a time, alone. While dynamo
    compiles, torch.fx's tracing flag is set for the whole process, and a compiled call on another
    thread then refuses to run ("using FX to symbolically trace a dynamo-optimized function")."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._running = 0  # calls of compiled graphs in progress
        self._compiling = False
        self._waiting = 0  # compiles waiting: new calls wait behind them

    @contextmanager
    def running(self) -> Iterator[None]:
        with self._cond:
            self._cond.wait_for(lambda: not self._compiling and not self._waiting)
            self._running += 1
        try:
            yield
        finally:
            with self._cond:
                self._running -= 1
                self._cond.notify_all()

    # The caller's thread drawing from torch's default generator while stages run (a batch the
    # caller's iterable makes, a step's seed, a loss): dynamo puts that generator back as it was
    # when a compile began, which would take back a draw made meanwhile. No draw falls inside one.
    drawing = running

    @contextmanager
    def compiling(self) -> Iterator[None]:
        with self._cond:
            self._waiting += 1
            self._cond.wait_for(lambda: not self._compiling and not self._running)
            self._waiting -= 1
            self._compiling = True
        try:
            yield
        finally:
            with self._cond:
                self._compiling = False
                self._cond.notify_all()


_LOCK = _CompileLock()
_NESTED_TRACE = "FX to symbolically trace a dynamo-optimized function"


def drawing_between_compiles() -> ContextManager[None]:
    """The caller's thread may draw from torch's default generator: no stage compiles meanwhile."""
    return _LOCK.drawing()


class CompiledForward:
    """A stage's forward under torch.compile, with its compiles counted. `owner` is the model,
    whose training flag is part of the calling context."""

    def __init__(self, stage: int, module: fx.GraphModule, options: dict[str, Any], owner: nn.Module) -> None:
        self.stats = StageCompiles(stage)
        self.options = options
        self._owner = owner
        self._local = threading.local()  # the context of the call in progress on this thread
        self._eager = module.forward
        self._module = module
        self._reached: dict[frozenset[int], tuple[frozenset[int], frozenset[str]]] = {}
        self._warned_eager = False
        self._unsaid: list[str] = []  # warnings for the caller's thread (`report`)
        self._backend = _backend(options)
        # CUDA graphs (mode="reduce-overhead"): outputs live in the graph's static memory, and a
        # graph is recorded on the calls after the one that compiles it (inductor warms up first):
        # a capture fails if another stage launches work meanwhile, so those calls run alone too.
        self.static_outputs = bool(getattr(self._backend, "config", {}).get("triton.cudagraphs"))
        self._alone = 3 if self.static_outputs else 1
        self._calls: dict[Hashable, int] = {}  # calls completed, by context
        self._made_for: dict[str, Hashable] = {}  # the context each graph was compiled for, by compile id ("0/1")
        self._backwards_alone = 0  # backwards still to run alone (compiling, recording)
        # Two graphs: the steps that draw break it at each draw; the others run whole.
        self._quiet = self._compile(stage_forward(module, draws=False))
        self._drawing = self._compile(stage_forward(module, draws=True))

    def _compile(self, forward: Callable[..., Any]) -> Callable[..., Any]:
        return torch._dynamo.optimize(  # type: ignore[no-any-return]
            backend=self._counted, nopython=bool(self.options.get("fullgraph", False)), dynamic=self.options.get("dynamic"),
            guard_fail_fn=self._guard_failed,
        )(forward)  # fmt: skip

    def reached_from(self, outputs: frozenset[int]) -> tuple[frozenset[int], frozenset[str]]:
        """The stage's inputs (by position) and attributes that its outputs at `outputs` are
        computed from: the compiled backward gives every other one a gradient of zeros, where
        the eager stage's autograd gives none (passes/sources.py)."""
        found = self._reached.get(outputs)
        if found is None:
            found = self._reached[outputs] = reached_from(self._module, outputs)
        return found

    def unreached(self, outputs: frozenset[int], slots: Sequence[Sequence[tuple[dict[str, Any], str]]]) -> tuple[frozenset[int], list[int]]:
        """The stage's inputs (by position) that its outputs at `outputs` reach, and the
        parameters (by index, each held at its `slots`) that they do not."""
        inputs, attributes = self.reached_from(outputs)
        reached = set()
        for target in attributes:
            path, _, name = target.rpartition(".")
            holder = self._module.get_submodule(path)
            called = holder._modules.get(name)
            if called is None:  # a parameter read
                reached.add((id(holder._parameters), name))
            else:  # a module called whole: every parameter in it
                reached.update((id(m._parameters), key) for m in called.modules() for key in m._parameters)
        return inputs, [k for k, held in enumerate(slots) if not any((id(table), name) in reached for table, name in held)]

    def runner(self, draws: bool, hidden: bool, swapped: bool) -> Callable[..., Any]:
        """What runs the stage in a step where it `draws` random numbers (ops its graph shows)
        and where some are `hidden` from its graph (inside a module called whole, an exported
        op): the compiled forward, or, for hidden draws, which only a dispatch mode hands the
        task's generator and a compiled graph would not, the eager forward. `swapped`: the stage
        reads its parameters through the step's leaves (plain tensors, not Parameters), a
        context of its own."""
        if draws and self.options.get("fullgraph"):
            raise RuntimeError(
                f"stage {self.stats.stage} may draw random numbers, and compile_stages has fullgraph=True: a dropout in "
                "it, or code its graph does not show (a module called whole, a forward hook, an autograd Function of "
                "the model's), which may draw. A compiled stage draws outside its graph, from the task's stream, so "
                "that its recompute replays the draws, and one graph cannot hold that.\nHow to fix: leave fullgraph "
                "out of compile_stages (the stage then runs eagerly where it may draw); or run it without what may "
                "draw: dropout at rate 0 or in eval mode, no forward hooks, its modules traced through rather than "
                "kept whole (leaf_modules)."
            )
        if not hidden:
            return partial(self._run, self._drawing if draws else self._quiet, swapped)
        if not self._warned_eager:
            self._warned_eager = True
            self._unsaid.append(
                f"stage {self.stats.stage} runs eagerly in steps where it may draw random numbers that its graph does "
                "not show (in a module called whole, a forward hook, an autograd Function of the model's, or an op "
                "torch.export left in the graph): only an eager stage can hand them the task's stream, which its "
                "recompute replays. Steps where none of those may draw run compiled (pipe.compile_stats() counts them)."
            )
        return self._eager

    def _run(self, compiled: Callable[..., Any], swapped: bool, *args: Any) -> Any:
        if self.options.get("dynamic") is not False:
            args = tuple(map(_at_offset_zero, args))
        # Which inputs require grad is part of it too: a recompute's inputs do, where the
        # uncheckpointed forward's of a caller's input may not; and which are inference tensors
        # (made under torch.inference_mode()), whose dispatch keys the graph is guarded on.
        wants = tuple((a.requires_grad, a.is_inference()) for a in args if isinstance(a, torch.Tensor))
        context = (compiled is self._drawing, swapped, wants, _calling_context(self._owner.training))
        self._local.context = context
        calls = self._calls.get(context, 0)
        alone = calls < self._alone  # it compiles (and, for CUDA graphs, records) on its first calls
        if self.static_outputs:
            _graph_trees_on_this_thread()
        try:
            with _LOCK.compiling() if alone else _LOCK.running():
                result = compiled(*args)
        except RuntimeError as error:
            if _NESTED_TRACE not in str(error):
                raise
            with _LOCK.compiling():  # it recompiles (a new shape) while another stage compiled: again, alone
                result = compiled(*args)
        self._calls[context] = calls + 1
        if calls == 0:
            self._backwards_alone = self._alone
        return own_values(result) if self.static_outputs else result

    @contextmanager
    def backward(self) -> Iterator[None]:
        """Around a backward through this stage's graphs: the first after a new forward graph
        compiles the backward's (and, for CUDA graphs, the next ones record it), alone."""
        alone = self._backwards_alone > 0
        self._backwards_alone -= alone
        with _LOCK.compiling() if alone else _LOCK.running():
            yield

    def report(self) -> None:
        """What the stage's calls had to say (its first recompile, running eagerly), said on the
        caller's thread once the step's tasks ran: a worker's warning would name threading.py
        as its line (and a warning raised as an error inside the compiler would fail the compile)."""
        while self._unsaid:
            warnings.warn(self._unsaid.pop(0), stacklevel=caller_stacklevel())

    def _recompiled(self, reason: str) -> str:
        return (
            f"stage {self.stats.stage} was compiled again: a guard of its compiled graph failed ({reason}). Each "
            "recompile costs seconds, and torch.compile stops compiling a stage after "
            f"{torch._dynamo.config.recompile_limit} of them (it then runs eagerly). pipe.compile_stats() counts "
            "them.\nHow to fix: " + (
                "a parameter of the stage was frozen or unfrozen since (requires_grad_), which changes what its graph "
                "reads: each such change compiles it again, so change it seldom (compile the pipeline again after "
                "freezing, for a long run)"
                if "_parameters[" in reason or "requires_grad" in reason else
                "micro-batches of one sample compile apart even with dynamic=True (torch.compile specialises sizes "
                "0 and 1): keep two samples or more in each"
                if self.options.get("dynamic") else
                "for a batch size that changes (an uneven last micro-batch, a last batch of an epoch), compile "
                "with compile_stages={'dynamic': True} (micro-batches of one sample still compile apart), or keep "
                "micro-batches the same size"
            ) + "; otherwise keep the guarded value fixed between calls."
        )

    def _counted(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self._note_recompile()
        compile_id = torch._guards.CompileContext.current_compile_id()
        if compile_id is not None:
            self._made_for[str(compile_id)] = self._local.__dict__.get("context")
        start = time.perf_counter()
        try:
            return self._backend(gm, example_inputs)
        finally:
            self.stats.graphs += 1
            self.stats.seconds += time.perf_counter() - start

    def _guard_failed(self, failure: Any) -> None:
        """A guard of a cached graph failed: one call per graph tried, before dynamo compiles."""
        failed = self._local.__dict__.setdefault("failed", [])
        failed.append(str(getattr(failure, "reason", failure)).strip())

    def _note_recompile(self) -> None:
        """Under a context a call completed under already, a compile is a recompile: counted, with
        the guards that failed (those of the graphs made for other contexts left out: theirs fail
        on what sets the contexts apart, an input's requires_grad, the grad mode), and reported
        the first time."""
        failed, self._local.failed = self._local.__dict__.get("failed", []), []
        context = self._local.__dict__.get("context")
        if not failed or context not in self._calls:
            return
        mine = [r for r in failed if self._made_for.get(r.split(":", 1)[0].strip()) == context]
        reason = "; ".join(mine or [r for r in failed if "GLOBAL_STATE changed" not in r] or failed)
        self.stats.recompiles.append(reason)
        if len(self.stats.recompiles) == 1:
            self._unsaid.append(self._recompiled(reason))


def own_values(value: Any) -> Any:
    """Copies of a CUDA graph's outputs (forward values, input gradients): a graph replayed again
    writes the same static memory, before another stage has read the last replay's."""
    return tree_map_only(torch.Tensor, torch.clone, value)


def _graph_trees_on_this_thread() -> None:
    """inductor keeps its CUDA graph trees per thread, and finds them only on the thread that
    imported it and on autograd's threads: a stage worker makes its own, in both places that are
    looked in, so that the backward autograd runs for it finds them too."""
    from torch._inductor import cudagraph_trees as trees

    if hasattr(trees.local, "tree_manager_containers"):
        return
    trees.local.tree_manager_containers = {}
    trees.local.tree_manager_locks = defaultdict(threading.Lock)
    for name in ("tree_manager_containers", "tree_manager_locks"):
        torch._C._stash_obj_in_tls(name, getattr(trees.local, name))


def _at_offset_zero(value: Any) -> Any:
    """A micro-batch of the caller's input is a view at an offset into the batch: a graph
    compiled with dynamic shapes specialises on offsets 0 and 1, and the first micro-batch,
    at 0, would compile another. A copy at offset 0 compiles once."""
    if isinstance(value, torch.Tensor) and value.storage_offset() != 0:
        return value.clone()
    return value
