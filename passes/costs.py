"""Cost model: what each node weighs (bytes, FLOPs, measured time), and the cut model built on it."""
from __future__ import annotations

import functools
import random
import statistics
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten, tree_map

from fxpipe.core.attrs import parameters_of
from fxpipe.core.microbatch import takes_gradients
from fxpipe.core.snapshot import preserved
from fxpipe.core.writes import writes_first_argument
from fxpipe.passes.linearize import COMPUTE_OPS
from fxpipe.passes.objective import CutModel, crossing_values, kept_micro_batches

BALANCE_MODES = ("time", "flops", "params", "memory")


def annotate_costs(gm: fx.GraphModule) -> fx.GraphModule:
    """Set `param_bytes` (the parameters a node is first to use) on each node. FLOPs and bytes
    come from `propagate_shapes`; measured times from `profile_times`."""
    seen: set[int] = set()
    for node in gm.graph.nodes:
        fresh = [p for p in parameters_of(gm, node) if id(p) not in seen]
        seen.update(id(p) for p in fresh)
        node.meta["param_bytes"] = sum(p.numel() * p.element_size() for p in fresh)
    return gm


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _leafy(value: Any, buffers: set[int]) -> Any:
    """Inputs as fresh leaves, floating ones requiring grad, so backward stops at the node; not
    the buffers read as arguments (running statistics, in an exported graph), as in the model."""

    def leaf(t: Any) -> Any:
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().requires_grad_(takes_gradients(t) and id(t) not in buffers)

    return tree_map(leaf, value)


def _once(run: Callable[[], Any], device: torch.device) -> tuple[float, float]:
    """Seconds of one forward, and of it plus its backward (with gradients of ones), of `run`:
    on CUDA between events on the device's stream, the kernels' time; elsewhere by the host's clock."""
    _synchronize(device)
    if device.type == "cuda":
        events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
        events[0].record()
        out = run()
        events[1].record()
        _backward(out)
        events[2].record()
        events[2].synchronize()
        return events[0].elapsed_time(events[1]) / 1e3, events[0].elapsed_time(events[2]) / 1e3
    start = time.perf_counter()
    out = run()
    middle = time.perf_counter()
    _backward(out)
    return middle - start, time.perf_counter() - start


def _backward(out: Any) -> None:
    grads = [(t, torch.ones_like(t)) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if grads:
        torch.autograd.backward([t for t, _ in grads], [g for _, g in grads])


class _Capture(fx.Interpreter):
    """Runs the graph once and keeps, for every compute node, how to run it again on its inputs."""

    def __init__(self, gm: fx.GraphModule, keep_values: bool = False) -> None:
        super().__init__(gm, garbage_collect_values=not keep_values)
        self.runs: dict[fx.Node, Callable[[], Any]] = {}
        self.buffers = {id(b) for b in gm.buffers()}

    def run_node(self, n: fx.Node) -> Any:
        if n.op in COMPUTE_OPS:
            args, kwargs = self.fetch_args_kwargs_from_env(n)
            call, writes = getattr(self, n.op), writes_first_argument(self.module, n)

            def run() -> Any:
                leaves = _leafy(args, self.buffers)
                if writes and leaves and isinstance(leaves[0], torch.Tensor):
                    leaves = (leaves[0].clone(), *leaves[1:])  # an autograd leaf cannot be written in place
                return call(n.target, leaves, _leafy(kwargs, self.buffers))

            self.runs[n] = run
        with torch.no_grad():
            return super().run_node(n)


def profile_times(
    gm: fx.GraphModule, example: Sequence[Any], device: torch.device, warmup: int = 2, repeats: int = 7, per_batch: int = 1,
) -> fx.GraphModule:
    """Measure each node's forward plus backward time on `device` into `node.meta["time"]`
    (seconds per batch: the time on `example`, `per_batch` times over, where the example is one
    micro-batch of `per_batch`). The graph and the example must be on `device`.

    Nodes are timed in rounds, every node once per round in a new shuffled order, and each takes
    the median over rounds: a change of machine load during profiling then touches all nodes
    alike, instead of making one region of the graph look slow. The fixed cost of timing a node
    (leaves, gradients of ones, a call into autograd), measured on a no-op, is taken off. The
    graph's state, gradients and the random states are left as they were.
    """
    # Every run updates running statistics, draws random numbers and adds into `.grad`.
    with preserved(gm):
        samples = _time_rounds(gm, example, device, warmup, repeats)
    overhead = _medians(samples.pop(None))[1]
    for node, times in samples.items():
        node.meta["time"] = per_batch * max(_medians(times)[1] - overhead, 0.0)
    return gm


def _medians(samples: list[tuple[float, float]]) -> tuple[float, float]:
    return statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)


def _time_rounds(gm: fx.GraphModule, example: Sequence[Any], device: torch.device, warmup: int, repeats: int) -> dict[Any, list[tuple[float, float]]]:
    """Seconds of each node's runs after `warmup` rounds (forward, and forward plus backward),
    keyed by node (None: the no-op)."""
    capture = _Capture(gm)
    capture.run(*example)
    probe = torch.zeros(1, device=device, requires_grad=True)
    runs: dict[Any, Callable[[], Any]] = {**capture.runs, None: lambda: probe * 1}
    return _rounds(runs, device, warmup, repeats)


def _rounds(
    runs: dict[Any, Callable[[], Any]], device: torch.device, warmup: int, repeats: int, before_round: Callable[[], Any] = lambda: None
) -> dict[Any, list[tuple[float, float]]]:
    """Each run's seconds (forward, and forward plus backward) in the rounds after `warmup`."""
    samples: dict[Any, list[tuple[float, float]]] = {key: [] for key in runs}
    shuffle = random.Random(0).shuffle
    with torch.enable_grad():  # grad mode is the thread's own
        for round_ in range(warmup + repeats):
            before_round()
            order = list(runs)
            shuffle(order)
            for key in order:
                seconds = _once(runs[key], device)
                if round_ >= warmup:
                    samples[key].append(seconds)
    return samples


def profile_stages(
    gm: fx.GraphModule, example: Sequence[Any], device: torch.device, runs: Sequence[Sequence[fx.Node]], warmup: int = 2,
    repeats: int = 7, per_batch: int = 1, workers: Optional[Sequence[int]] = None, split_backward: bool = False,
) -> list[tuple[float, float, float]]:
    """Each stage's forward, and forward plus backward, in seconds per batch (as in
    `profile_times`), timed as the pipeline runs it: its nodes in one forward, one backward
    call. A stage costs more than its nodes' times apart: each of its ops keeps its fixed cost
    (which timing one node alone takes off with the harness's), and the stage pays the harness's
    once, as a task does. `workers` (each stage's worker): every worker on a thread of its own
    at once, each timing its stages in turn, as CPU stages run in a pipeline's steady state,
    sharing the cores and the interpreter lock (two busy stages on two cores each run slower
    than one alone). Third, the share of its backward that goes to its inputs' gradients
    (zb-h1's I; the rest is W), with `split_backward`, else 0.5."""
    with preserved(gm):
        capture = _Capture(gm, keep_values=True)
        capture.run(*example)
        stage_runs = {i: _stage_run(capture, run) for i, run in enumerate(runs)}
        if workers is not None and len(set(workers)) > 1:
            samples = _rounds_together(stage_runs, device, warmup, repeats, list(workers))
        else:
            samples = _rounds(stage_runs, device, warmup, repeats)
        shares = _input_shares(gm, stage_runs, runs, device, warmup, repeats) if split_backward else [0.5] * len(runs)
    times = [_medians(samples[i]) for i in range(len(runs))]
    return [(per_batch * forward, per_batch * whole, share) for (forward, whole), share in zip(times, shares)]


def _input_shares(
    gm: fx.GraphModule, stage_runs: dict[int, Callable[[], Any]], runs: Sequence[Sequence[fx.Node]], device: torch.device,
    warmup: int, repeats: int,
) -> list[float]:
    """Per stage, its backward with its parameters' gradients off (the inputs' alone) over its
    whole backward, each stage timed alone (a flag turned off is the model's own, which a stage
    on another thread would read)."""
    keyed: dict[Any, Callable[[], Any]] = {}
    for i, run in stage_runs.items():
        params = [p for node in runs[i] for p in parameters_of(gm, node) if p.requires_grad]
        keyed[i, "whole"], keyed[i, "inputs"] = run, functools.partial(_without_grads, run, params)
    samples = _rounds(keyed, device, warmup, repeats)
    shares = []
    for i in range(len(runs)):
        (f_whole, whole), (f_inputs, inputs) = _medians(samples[i, "whole"]), _medians(samples[i, "inputs"])
        backward = whole - f_whole
        shares.append(min(1.0, max(0.0, (inputs - f_inputs) / backward)) if backward > 0 else 0.5)
    return shares


def _without_grads(run: Callable[[], Any], params: list[torch.Tensor]) -> Any:
    """`run()` recorded with `params` not requiring grad: its backward computes the inputs' alone."""
    for p in params:
        p.requires_grad_(False)
    try:
        return run()
    finally:
        for p in params:
            p.requires_grad_(True)


def _rounds_together(
    runs: dict[int, Callable[[], Any]], device: torch.device, warmup: int, repeats: int, workers: list[int]
) -> dict[int, list[tuple[float, float]]]:
    """As `_rounds`, with each worker on a thread of its own running its runs (`workers[key]` is
    the worker of run `key`) in turn, all workers starting each round at once."""
    samples: dict[int, list[tuple[float, float]]] = {}
    mine = {w: {key: run for key, run in runs.items() if workers[key] == w} for w in dict.fromkeys(workers)}
    start = threading.Barrier(len(mine))
    failures: list[BaseException] = []

    def timed(own: dict[int, Callable[[], Any]]) -> None:
        try:
            samples.update(_rounds(own, device, warmup, repeats, before_round=start.wait))
        except BaseException as e:  # noqa: BLE001 - raised on the caller's thread below
            failures.append(e)
            start.abort()  # the others stop waiting for this one

    threads = [threading.Thread(target=timed, args=(own,), name=f"fxpipe-profile-{w}", daemon=True) for w, own in mine.items()]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise next((e for e in failures if not isinstance(e, threading.BrokenBarrierError)), failures[0])
    return samples


def _stage_run(capture: _Capture, run: Sequence[fx.Node]) -> Callable[[], Any]:
    """Run `run`'s nodes in order on fresh leaves of what they read from outside it; returns
    what later nodes read (the stage's outputs)."""
    inside = set(run)
    reads = [n for n in dict.fromkeys(i for node in run for i in node.all_input_nodes) if n not in inside]
    written = {n for node in run if node.args and writes_first_argument(capture.module, node) and isinstance(n := node.args[0], fx.Node) and n in reads}
    outputs = [node for node in run if any(user not in inside for user in node.users)]

    def go() -> list[Any]:
        env = {}
        for n in reads:
            value = _leafy(capture.env[n], capture.buffers)
            env[n] = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, value) if n in written else value
        for node in run:
            args, kwargs = fx.node.map_arg((node.args, node.kwargs), env.__getitem__)
            env[node] = getattr(capture, node.op)(node.target, args, kwargs)
        return [env[n] for n in outputs]

    return go


def held_bytes(node: fx.Node) -> int:
    """What a node holds for backward: its output, and what a module called whole saves inside."""
    return int(node.meta.get("held_bytes", node.meta.get("bytes", 0)))


def node_weights(order: Sequence[fx.Node], mode: str, *, param_scale: float, kept: float, flop_rate: float) -> list[float]:
    """What each node weighs in the objective: seconds ('time', and 'flops' at `flop_rate`, counted
    forward plus backward as three forwards), or bytes ('params', 'memory')."""
    if mode == "time":
        missing = [n.name for n in order if "time" not in n.meta]
        if missing:
            raise ValueError(f"balance='time' needs measured times; {len(missing)} nodes have none (run profile_times)")
        return [float(n.meta["time"]) for n in order]
    if mode == "flops":
        return [3.0 * float(n.meta.get("flops", 0)) / flop_rate for n in order]
    if mode == "params":
        return [float(n.meta.get("param_bytes", 0)) for n in order]
    return [param_scale * n.meta.get("param_bytes", 0) + kept * held_bytes(n) for n in order]


def cut_model(
    order: Sequence[fx.Node],
    mode: str,
    *,
    chunks: int,
    checkpointed: int,
    param_scale: float = 4.0,
    bandwidth: Optional[float] = None,
    flop_rate: float = 1e12,
    in_flight: Optional[list[tuple[float, float]]] = None,
) -> CutModel:
    """The cost model of cutting `order` for a balance mode.

    Receiving costs (bytes over `bandwidth`) are part of a stage's time in the modes measured in
    seconds, 'time' and 'flops'; 'params' and 'memory' balance bytes alone. `in_flight`: the
    micro-batches each stage index holds at its peak under the schedule (else GPipe's count).
    """
    kept = kept_micro_batches(chunks, checkpointed) / chunks
    return CutModel(
        times=node_weights(order, mode, param_scale=param_scale, kept=kept, flop_rate=flop_rate),
        params=[float(n.meta.get("param_bytes", 0)) for n in order],
        activations=[float(held_bytes(n)) for n in order],
        values=crossing_values(order),
        bandwidth=bandwidth if mode in ("time", "flops") else None,
        chunks=chunks,
        checkpointed=checkpointed,
        param_scale=param_scale,
        names=[f"{n.name} ({n.target})" if n.op == "call_module" else n.name for n in order],
        in_flight=in_flight,
        weighs_memory=mode == "memory",
    )


def report_model(order: Sequence[fx.Node], costs: dict[str, Any]) -> CutModel:
    """The model a plan's predictions use: seconds measured where every node is, else from FLOPs."""
    return cut_model(order, "time" if measured(order) else "flops", **costs)


def measured(order: Sequence[fx.Node]) -> bool:
    """Whether every node of `order` has a measured time."""
    return all("time" in n.meta for n in order)
