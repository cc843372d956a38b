"""Two gloo processes on this machine's cores: fxpipe across processes against
torch.distributed.pipelining (the same model cut at the same point) and fxpipe's one-process
engine, with the plain model on one process as the baseline.

Every contender runs in the same two processes, round-robin, each timed block between two
barriers on rank 0: the two-process contenders run on both ranks, the one-process ones on rank
0 while rank 1 waits at the barrier. E = T(plain) / (2 x T(step)). Then the transport alone: a
small message's round trip, and two large sends crossing (one group for both directions against
a group per direction). The U-Net example is then trained over the two processes by fxpipe, and
given to pipelining as well.
"""
from __future__ import annotations

import argparse
import copy
import multiprocessing as mp
import os
import queue
import socket
import statistics
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from bound import stage_work
from environment import command_lines, ensure_malloc_env
from overhead import ROOT, make_mlp

Step = Callable[[], None]
BOUND = "no-dependency bound, 2 processes"
LIMIT = "limit of the schedule, 2 processes"


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7; 2 with --quick)")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--message", action="store_true", help="only the small message's round trip")
    p.add_argument("--loops-only", action="store_true", help="only train_steps over 8 batches: 1f1b against 2bw")
    args = p.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 7)
    return args


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- contenders: (name, runs on both ranks?, step) ---------------------------------------------
def drop_grads(params: Sequence[torch.Tensor]) -> None:
    for p in params:
        p.grad = None


def plain(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Step:
    params = list(model.parameters())

    def step() -> None:
        drop_grads(params)
        F.mse_loss(model(x), y).backward()

    return step


def fxpipe_step(pipe: Any, x: torch.Tensor, y: torch.Tensor, loss_fn: Callable[..., torch.Tensor] = F.mse_loss) -> Step:
    params = list(pipe.parameters())

    def step() -> None:
        drop_grads(params)
        pipe.train_step(x, target=y, loss_fn=loss_fn)

    return step


def pipelining_step(model: nn.Module, x: torch.Tensor, y: torch.Tensor, split: str, chunks: int, kind: str, rank: int) -> Step:
    """torch.distributed.pipelining on the same model, cut where fxpipe cut it."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe, SplitPoint, pipeline

    pipe = pipeline(model, mb_args=(x.chunk(chunks)[0],), split_spec={split: SplitPoint.BEGINNING})
    stage = pipe.build_stage(rank, torch.device("cpu"))
    maker = Schedule1F1B if kind == "1F1B" else ScheduleGPipe
    schedule = maker(stage, n_microbatches=chunks, loss_fn=F.mse_loss)
    params = list(stage.submod.parameters())

    def step() -> None:
        drop_grads(params)
        if rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y)

    return step


@dataclass
class Workload:
    model: nn.Sequential
    x: torch.Tensor
    y: torch.Tensor
    cut: int  # the first layer of the second stage
    text: str


def mlp_sizes(args: argparse.Namespace) -> tuple[int, int, int]:
    """Layers, width and batch of the MLP every contender trains."""
    return (8, 128, 512) if args.quick else (16, 512, 2048)


def mlp_on_two(args: argparse.Namespace) -> tuple[nn.Sequential, torch.Tensor, torch.Tensor, Any]:
    """The MLP, its batch and target (seeded alike on both ranks), and the two ranks' "pp" mesh."""
    from torch.distributed.device_mesh import init_device_mesh

    torch.manual_seed(0)
    layers, width, batch = mlp_sizes(args)
    model = make_mlp(layers, width)
    x, y = torch.randn(batch, width), torch.randn(batch, width)
    return model, x, y, init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))


def contenders(rank: int, args: argparse.Namespace) -> tuple[list[tuple[str, bool, Step]], Workload]:
    from fxpipe import compile_pipeline

    layers, width, batch = mlp_sizes(args)
    model, x, y, mesh = mlp_on_two(args)
    found: list[tuple[str, bool, Step]] = [("plain, one process", False, plain(model, x, y))]
    split = ""
    for schedule in ("gpipe", "1f1b", "zb-h1"):
        pipe = compile_pipeline(copy.deepcopy(model), x, mesh=mesh, chunks=args.chunks, checkpoint="never", schedule=schedule)
        split = pipe.plan.stages[1].modules[0]
        found.append((f"fxpipe {schedule}, 2 processes", True, fxpipe_step(pipe, x, y)))
    for kind in ("GPipe", "1F1B"):
        found.append((f"pipelining {kind}, 2 processes", True, pipelining_step(copy.deepcopy(model), x, y, split, args.chunks, kind, rank)))
    works = stage_work(model, int(split), x, y, args.chunks, F.mse_loss)
    found.append((BOUND, True, works[rank]))
    if rank == 0:
        for schedule in ("1f1b", "zb-h1"):
            pipe = compile_pipeline(copy.deepcopy(model), x, ["cpu", "cpu"], chunks=args.chunks, checkpoint="never", schedule=schedule)
            found.append((f"fxpipe {schedule}, one process, 2 threads", False, fxpipe_step(pipe, x, y)))
    else:  # rank 1 waits at the barriers while rank 0 runs these
        found += [(f"fxpipe {s}, one process, 2 threads", False, lambda: None) for s in ("1f1b", "zb-h1")]
    return found, Workload(model, x, y, int(split), f"MLP {layers}x{width}, batch {batch}, chunks {args.chunks}, cut at {split!r}")


LOOP_BATCHES = 8


def loop_contenders(args: argparse.Namespace) -> list[tuple[str, bool, Step]]:
    """train_steps over LOOP_BATCHES batches with SGD, across the two processes: 1f1b flushes
    after each batch, 2bw never; the plain model's loop on one process as the baseline."""
    from fxpipe import compile_pipeline

    model, x, y, mesh = mlp_on_two(args)
    lr = 1e-6  # the loops train: a small step keeps the work alike from round to round
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def plain_loop() -> None:
        for _ in range(LOOP_BATCHES):
            optimizer.zero_grad()
            F.mse_loss(model(x), y).backward()
            optimizer.step()

    found: list[tuple[str, bool, Step]] = [("plain loop, one process", False, plain_loop)]
    for schedule in ("1f1b", "2bw"):
        pipe = compile_pipeline(copy.deepcopy(model), x, mesh=mesh, chunks=args.chunks, checkpoint="never", schedule=schedule)
        found.append((f"fxpipe train_steps {schedule}, 2 processes", True, _loop_of(pipe, x, y, lr)))
    return found


def _loop_of(pipe: Any, x: torch.Tensor, y: torch.Tensor, lr: float) -> Step:
    optimizer = torch.optim.SGD(pipe.parameters(), lr=lr)

    def loop() -> None:
        for _ in pipe.train_steps([(x, y)] * LOOP_BATCHES, loss_fn=F.mse_loss, optimizer=optimizer):
            pass

    return loop


def timed(found: list[tuple[str, bool, Step]], rank: int, repeats: int) -> dict[str, list[float]]:
    """Round-robin blocks, the order rotated each round; each block between two barriers."""
    times: dict[str, list[float]] = {name: [] for name, _, _ in found}
    for name, both, step in found:  # warm-up
        if both or rank == 0:
            step()
        dist.barrier()
    for round_index in range(repeats):
        shift = round_index % len(found)
        for name, both, step in [*found[shift:], *found[:shift]]:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(2):
                if both or rank == 0:
                    step()
            dist.barrier()
            times[name].append((time.perf_counter() - start) / 2)
    return times


def stage_costs(model: nn.Sequential, cut: int, x: torch.Tensor, y: torch.Tensor, chunks: int, rank: int, repeats: int = 7) -> tuple[float, float, float]:
    """This rank's stage in plain PyTorch, seconds per micro-batch (medians): its forward, its
    whole backward, and its backward for the input's gradient alone (none on the first stage,
    whose input needs none). Both ranks time the same phase at once, so the cores are shared
    as in a step."""
    part = copy.deepcopy(model[:cut] if rank == 0 else model[cut:])
    xs, ys = x.chunk(chunks), y.chunk(chunks)
    with torch.no_grad():
        middles = [model[:cut](xc) for xc in xs]
    inputs = list(xs) if rank == 0 else middles
    grads = [torch.randn_like(m) for m in middles]  # the first stage's output gradients

    def forward() -> list[tuple[torch.Tensor, torch.Tensor]]:
        found = []
        for given, yc in zip(inputs, ys):
            given = given.detach().requires_grad_(rank == 1)
            out = part(given)
            found.append((given, out if rank == 0 else F.mse_loss(out, yc) * (len(yc) / len(y))))
        return found

    def backward(found: list[tuple[torch.Tensor, torch.Tensor]], input_only: bool) -> None:
        for k, (given, out) in enumerate(found):
            grad = grads[k] if rank == 0 else None
            if input_only:
                torch.autograd.grad(out, given, grad)
            else:
                out.backward(grad)

    def timed_phase(phase: Callable[[], Any]) -> float:
        dist.barrier()
        start = time.perf_counter()
        phase()
        elapsed = time.perf_counter() - start
        dist.barrier()
        return elapsed / chunks

    costs: list[list[float]] = [[], [], []]
    for _ in range(repeats):
        costs[0].append(timed_phase(forward))
        found = forward()
        costs[1].append(timed_phase(lambda: backward(found, input_only=False)))
        found = forward()
        costs[2].append(timed_phase(lambda: backward(found, input_only=True) if rank == 1 else None))
    return statistics.median(costs[0]), statistics.median(costs[1]), statistics.median(costs[2])


def schedule_limits(costs: list[tuple[float, float, float]], chunks: int) -> dict[str, float]:
    """What each schedule's order adds to the bound on two stages whose actions take `costs`
    and whose values travel in no time: fxpipe's simulator on the schedule's action lists, its
    step's time over the busier rank's work. The bound times this is what no implementation of
    that schedule on this cut beats (a ratio, so that the bound, timed in the same rounds as the
    contenders, carries the machine's speed)."""
    from fxpipe.schedules.actions import Layout
    from fxpipe.schedules.check import make_schedule
    from fxpipe.schedules.simulate import StageCosts, simulate

    layout = Layout((0, 1), frozenset({(0, 1)}), (1,))
    stages = [StageCosts(forward, backward, input_share=min(1.0, alone / backward)) for forward, backward, alone in costs]
    work = max(chunks * (forward + backward) for forward, backward, _ in costs)
    return {name: simulate(make_schedule(name, layout, chunks, 0), layout, stages).timeline.makespan / work for name in ("1f1b", "zb-h1")}


def message_cost(rank: int, rounds: int = 12, trips: int = 200) -> dict[str, float]:
    """Microseconds per round trip of a small tensor (median over `rounds` of `trips`, the ways
    taking turns): raw send/recv; the transport a channel uses without its Python (a 4 KiB frame
    into a receive posted before it is sent); and a channel message, with its header (step, key,
    shapes and dtypes) in the frame."""
    from fxpipe.distributed.channel import Channel
    from fxpipe.distributed.wire import FRAME

    group = dist.group.WORLD
    channel = Channel(group, [0, 1], rank, torch.device("cpu"), 30.0)
    t = torch.zeros(16)
    peer = 1 - rank
    frame = torch.zeros(FRAME, dtype=torch.uint8)
    posted: list[Any] = []
    tag = 1 << 20  # no channel's: channels take tags 1, 2, ...

    def raw() -> None:
        if rank == 0:
            dist.send(t, 1)
            dist.recv(t, 1)
        else:
            dist.recv(t, 0)
            dist.send(t, 0)

    def take_posted() -> None:
        posted.pop().wait()
        buffer = torch.empty(FRAME, dtype=torch.uint8)
        posted.append(dist.irecv(buffer, peer, tag=tag))

    def transport() -> None:
        if not posted:
            posted.append(dist.irecv(torch.empty(FRAME, dtype=torch.uint8), peer, tag=tag))
        if rank == 0:
            work = dist.isend(frame, 1, tag=tag)
            take_posted()
        else:
            take_posted()
            work = dist.isend(frame, 0, tag=tag)
        assert work is not None
        work.wait()

    def framed() -> None:
        if rank == 0:
            channel.send(1, "ping", t)
            channel.take(1, "pong")
        else:
            channel.take(0, "ping")
            channel.send(0, "pong", t)
        channel.wait_sent()

    ways = {"raw send/recv": raw, "a frame into a posted receive": transport, "fxpipe's message": framed}
    found: dict[str, list[float]] = {name: [] for name in ways}
    for _ in range(rounds):
        for name, trip in ways.items():
            for _ in range(20):
                trip()
            dist.barrier()
            start = time.perf_counter()
            for _ in range(trips):
                trip()
            found[name].append((time.perf_counter() - start) / trips * 1e6)
    last = dist.isend(frame, peer, tag=tag)  # fills the peer's last posted receive
    posted.pop().wait()
    assert last is not None
    last.wait()
    dist.barrier()
    return {name: statistics.median(values) for name, values in found.items()}


def crossing_sends(rank: int, nbytes: int = 2 * 1024 * 1024, repeats: int = 60) -> dict[str, tuple[float, float]]:
    """Both ranks send `nbytes` to each other at once, the receives posted beforehand, as an
    activation and a gradient cross in a step: milliseconds until this rank's receive is in
    (median, 90th percentile), on one group for both directions and on a group per direction."""
    pair = [dist.new_group([0, 1]) for _ in range(2)]  # made by every rank, in one order
    ways = {"one group for both directions": (dist.group.WORLD, dist.group.WORLD), "a group per direction": (pair[rank], pair[1 - rank])}
    out, into = torch.zeros(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    found = {}
    for name, (sending, receiving) in ways.items():
        times = []
        for _ in range(repeats):
            received: Any = dist.irecv(into, 1 - rank, group=receiving)
            dist.barrier()
            start = time.perf_counter()
            sent: Any = dist.isend(out, 1 - rank, group=sending)
            received.wait()
            times.append((time.perf_counter() - start) * 1e3)
            sent.wait()
        times.sort()
        found[name] = (statistics.median(times), times[int(0.9 * len(times))])
    return found


def unet_over_two(rank: int) -> list[str]:
    """The U-Net example over two processes: fxpipe's first gradients against the plain model's,
    then 5 training steps; pipelining given the same model, cut at the same place."""
    from torch.distributed.device_mesh import init_device_mesh

    from fxpipe import compile_pipeline

    sys.path.insert(0, str(ROOT / "examples"))
    from unet import loss_fn, make_batch, make_model

    torch.manual_seed(0)
    model = make_model()
    x, y = make_batch(32, size=32)
    reference = copy.deepcopy(model)
    loss_fn(reference(x), y).backward()
    expected = {name: p.grad for name, p in reference.named_parameters() if p.grad is not None}
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("pp",))
    pipe = compile_pipeline(copy.deepcopy(model), x, mesh=mesh, chunks=4, schedule="1f1b")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    losses = []
    for step in range(5):
        opt.zero_grad()
        losses.append(pipe.train_step(x, target=y, loss_fn=loss_fn).item())
        if step == 0:
            ours = gradient_report(pipe.named_parameters(), expected)
        opt.step()
    lines = [f"fxpipe 1f1b, 2 processes: U-Net trains, loss {losses[0]:.4f} -> {losses[-1]:.4f} in 5 steps; first "
             f"step's gradients against the plain model's: {ours}"]  # fmt: skip
    dist.barrier()
    split = pipe.plan.stages[1].modules[0]
    lines.append(f"pipelining Schedule1F1B on the same U-Net, cut at {split!r}: " + pipelining_on(model, x, y, [split], rank, loss_fn, expected))
    # Four stages, two on each process: now a skip jumps over stages.
    pipe = compile_pipeline(copy.deepcopy(model), x, mesh=mesh, chunks=4, schedule="interleaved-1f1b", stages_per_device=2)
    pipe.train_step(x, target=y, loss_fn=loss_fn)
    skips = ", ".join(f"{e.value} {e.src}->{e.dst}" for e in pipe.plan.skip_edges) or "none"
    lines.append(f"fxpipe interleaved-1f1b, 4 stages on 2 processes (skips {skips}): gradients against the plain "
                 f"model's: {gradient_report(pipe.named_parameters(), expected)}")  # fmt: skip
    dist.barrier()
    splits = [stage.modules[0] for stage in pipe.plan.stages[1:]]
    lines.append("pipelining ScheduleInterleaved1F1B, the same 4 stages: " + pipelining_on(model, x, y, splits, rank, loss_fn, expected))
    return lines


def gradient_report(named: Any, expected: dict[str, torch.Tensor]) -> str:
    """The largest gradient difference from the plain model's over both ranks, by parameter name."""
    diffs = [float((p.grad - expected[n]).abs().max()) for n, p in named if n in expected and p.grad is not None]
    totals = torch.tensor([max(diffs, default=0.0), float(len(diffs))], dtype=torch.float64)
    worst, count = totals[:1].clone(), totals[1:].clone()
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    dist.all_reduce(count)
    return f"max difference {float(worst):.1e} over {int(count)} of {len(expected)} parameters"


def pipelining_on(model: nn.Module, x: torch.Tensor, y: torch.Tensor, splits: list[str], rank: int, loss_fn: Callable[..., torch.Tensor], expected: dict[str, torch.Tensor]) -> str:
    """One step of torch.distributed.pipelining cut at `splits` (a stage per process, or two:
    interleaved), and its gradients against the plain model's; or the error it raises."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleInterleaved1F1B, SplitPoint, pipeline

    try:
        pipe = pipeline(copy.deepcopy(model), mb_args=(x.chunk(4)[0],), split_spec={s: SplitPoint.BEGINNING for s in splits})
        stages: list[Any] = [pipe.build_stage(i, torch.device("cpu")) for i in range(rank, len(splits) + 1, 2)]
        if len(stages) == 1:
            schedule: Any = Schedule1F1B(stages[0], n_microbatches=4, loss_fn=loss_fn)
        else:
            schedule = ScheduleInterleaved1F1B(stages, n_microbatches=4, loss_fn=loss_fn)
        schedule.step(x) if rank == 0 else schedule.step(target=y)
        named = [item for stage in stages for item in stage.submod.named_parameters()]
        return "ran a step; its gradients against the plain model's: " + gradient_report(named, expected)
    except Exception as e:  # noqa: BLE001 - what it does is the finding
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        return f"{type(e).__name__}: {first[:160]}"


def child(rank: int, port: int, args: argparse.Namespace, results: Any) -> None:
    torch.set_num_threads(1)
    # pipelining's tracer deep-copies pytree specs, which warns on every copy in torch 2.13
    warnings.filterwarnings("ignore", message=".*LeafSpec.*", category=FutureWarning)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2, timeout=timedelta(seconds=120))
    try:
        if args.message:
            cost = message_cost(rank)
            if rank == 0:
                results.put(("ok", (cost,)))
            return
        if args.loops_only:
            times = timed(loop_contenders(args), rank, args.repeats)
            if rank == 0:
                results.put(("ok", (times,)))
            return
        found, work = contenders(rank, args)
        times = timed(found, rank, args.repeats)
        costs: list[Any] = [None, None]
        dist.all_gather_object(costs, stage_costs(work.model, work.cut, work.x, work.y, args.chunks, rank))
        limits = schedule_limits(costs, args.chunks)
        cost = message_cost(rank)
        crossing = crossing_sends(rank)
        unet = unet_over_two(rank)
        if rank == 0:
            results.put(("ok", (work.text, times, limits, costs, cost, crossing, unet)))
    except BaseException:  # noqa: BLE001 - reported by the parent
        results.put(("error", f"rank {rank}:\n{traceback.format_exc()}"))
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace) -> tuple[Any, ...]:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=child, args=(r, port, args, results), daemon=True) for r in range(2)]
    for p in procs:
        p.start()
    try:
        status, value = results.get(timeout=1800)
    except queue.Empty:
        status, value = "error", "no result in 30 minutes"
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
    if status != "ok":
        raise SystemExit(value)
    return tuple(value)


def message_line(cost: dict[str, float]) -> str:
    raw = cost["raw send/recv"]
    return "\none small message, round trip (us, median): " + "; ".join(
        f"{name} {us:.0f} ({us / raw:.2f}x raw)" for name, us in cost.items())  # fmt: skip


def e_table(times: dict[str, list[float]], baseline: str, column: str, steps: int = 1) -> None:
    """Each contender's E against `baseline` (T(baseline) / (2 x T)), and its median ms per step
    (`column`; a timed block holding `steps` of them)."""
    base = times[baseline]
    print(f"| contender | E median | E best | {column} |")
    print("|---|---|---|---|")
    for name, values in times.items():
        if name.startswith("plain"):
            continue
        e_median, e_best = statistics.median(base) / (2 * statistics.median(values)), min(base) / (2 * min(values))
        print(f"| {name} | {e_median:.3f} | {e_best:.3f} | {statistics.median(values) / steps * 1e3:.1f} |")


def loop_table(times: dict[str, list[float]], args: argparse.Namespace) -> None:
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, gloo on 127.0.0.1, one thread per process; train_steps over "
          f"{LOOP_BATCHES} batches, chunks {args.chunks}; {args.repeats} rounds; E = T(plain loop) / (2 x T(loop))\n")  # fmt: skip
    e_table(times, "plain loop, one process", "ms per batch (median)", LOOP_BATCHES)


def main(argv: Optional[Sequence[str]] = None) -> None:
    reexecuted = ensure_malloc_env()
    args = parse_args(argv)
    for line in command_lines(reexecuted, "steady allocator for every contender"):
        print(line)
    if args.message:
        print(message_line(run(args)[0]).strip())
        return
    if args.loops_only:
        loop_table(run(args)[0], args)
        return
    workload, times, limits, costs, cost, crossing, unet = run(args)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, gloo on 127.0.0.1, one thread per process; {workload}; "
          f"{args.repeats} rounds; E = T(plain) / (2 x T(step))\n")  # fmt: skip
    e_table(times, "plain, one process", "ms/step median")
    base = times["plain, one process"]
    print(f"| plain, one process | 0.5 by definition | | {statistics.median(base) * 1e3:.1f} |")
    bound = statistics.median(times[BOUND])
    for name, ratio in limits.items():
        print(f"| {name} on this cut: {LIMIT} | {statistics.median(base) / (2 * bound * ratio):.3f} | | {bound * ratio * 1e3:.1f} |")
    print(f"\n{BOUND}: each rank does its stage's work for the step in plain PyTorch, on inputs made "
          "beforehand, sending nothing (benchmarks/bound.py): no schedule or transport beats it")  # fmt: skip
    print(f"{LIMIT}: the bound times what the schedule's order adds to it, {', '.join(f'{n} x{r:.3f}' for n, r in limits.items())}: "
          "fxpipe's simulator (fxpipe/schedules/simulate.py) runs the schedule's action lists with each action taking what it "
          "takes in plain PyTorch, measured on both ranks at once (ms per micro-batch, forward / backward / input's "
          "gradient alone: " + "; ".join(f"stage {k} {f * 1e3:.1f} / {b * 1e3:.1f} / {i * 1e3:.1f}" for k, (f, b, i) in enumerate(costs))
          + "), values arriving the moment they are made: no implementation of the schedule on this cut beats it")  # fmt: skip
    for name, ratio in limits.items():
        measured = statistics.median(times[f"fxpipe {name}, 2 processes"])
        print(f"fxpipe {name}, 2 processes: {measured / (bound * ratio) - 1:.1%} slower than its limit")
    print(message_line(cost))
    print("2 MB each way at once, until rank 0's receive is in (ms, median / 90th percentile): " + "; ".join(
        f"{name} {median:.2f} / {p90:.2f}" for name, (median, p90) in crossing.items()))  # fmt: skip
    print("\n" + "\n".join(unet))
    print(f"load average at end={os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
