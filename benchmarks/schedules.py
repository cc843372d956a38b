"""Schedules side by side on CPU cores: efficiency, predicted and measured bubble, activation memory, step time.

For each workload every schedule runs `pipe.train_step` (forward, loss and backward per
micro-batch), interleaved round-robin with the plain model on one thread. E = T(plain) /
(n x T(step)), n the number of worker threads (devices). Peak activation memory per stage is
measured in one extra step with `pipe.measure_memory` on (its hook costs time, so the timed
steps run without it), and predicted by the plan's simulator. Every pipeline is cut with
balance='time', and its plan's predicted step time is printed beside the measured median.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from bound import stage_work, stage_work_on
from environment import command_lines, ensure_malloc_env
from tables import print_markdown
from overhead import ROOT, Contender, make_mlp, measure

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")


@dataclass
class Workload:
    name: str
    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7; 2 with --quick)")
    p.add_argument("--steps-per-block", type=int, default=None, help="steps per timed block (default 2; 1 with --quick)")
    p.add_argument("--checkpoint", default="never", help="checkpoint mode of every pipeline (default 'never')")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--gantt", default=None, help="write the Gantt chart of the MLP's zb-h1 step here (SVG)")
    p.add_argument("--loops-only", action="store_true", help="only the train_steps table (1f1b against 2bw)")
    args = p.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 7)
    args.steps_per_block = args.steps_per_block or (1 if args.quick else 2)
    return args


def workloads(quick: bool) -> list[Workload]:
    sys.path.insert(0, str(ROOT / "examples"))
    from unet import loss_fn as unet_loss, make_batch, make_model

    torch.manual_seed(0)
    layers, width, batch = (8, 128, 512) if quick else (16, 512, 2048)
    x = torch.randn(batch, width)
    mlp = Workload(f"MLP {layers}x{width}, batch {batch}", make_mlp(layers, width), x, torch.randn(batch, width), F.mse_loss)
    uneven = Workload(f"MLP of uneven widths, batch {batch}", uneven_mlp(width), x, torch.randn(batch, width), F.mse_loss)
    images, size = (16, 16) if quick else (128, 32)
    ux, uy = make_batch(images, size=size)
    unet = Workload(f"U-Net (examples/unet.py), batch {images}, {size}x{size}", make_model(), ux, uy, unet_loss)
    return [mlp, uneven, unet]


def uneven_mlp(width: int) -> nn.Sequential:
    """Layers of very different costs: a cut by layer count balances it badly, one by time well."""
    narrow, wide = width // 2, width * 4
    return nn.Sequential(
        nn.Linear(width, 2 * width), nn.ReLU(), nn.Linear(2 * width, narrow), nn.ReLU(),
        *[m for _ in range(4) for m in (nn.Linear(narrow, narrow), nn.Tanh())],
        nn.Linear(narrow, wide), nn.ReLU(), nn.Linear(wide, width),
    )  # fmt: skip


def plain_step(w: Workload) -> Callable[[], None]:
    params = list(w.model.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        w.loss_fn(w.model(w.x), w.y).backward()

    return step


def pipeline(w: Workload, schedule: str, chunks: int, checkpoint: str) -> Any:
    from fxpipe import compile_pipeline

    kwargs: dict[str, Any] = dict(chunks=chunks, checkpoint=checkpoint, schedule=schedule, balance="time")
    if schedule == "interleaved-1f1b":
        kwargs["stages_per_device"] = 2
    return compile_pipeline(copy.deepcopy(w.model), w.x, ["cpu", "cpu"], **kwargs)


def train_step(pipe: Any, w: Workload) -> Callable[[], None]:
    params = list(pipe.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        pipe.train_step(w.x, target=w.y, loss_fn=w.loss_fn)

    return step


def unwaited(w: Workload, pipe: Any, chunks: int) -> Optional[Callable[[], None]]:
    """The no-dependency bound (bound.py) at the cut `pipe` made: the first stage's work on a
    second thread while the caller does the second's. Only for a Sequential cut in two."""
    stages = pipe.plan.stages
    if not isinstance(w.model, nn.Sequential) or len(stages) != 2:
        return None
    first, second = stage_work(w.model, int(stages[1].modules[0]), w.x, w.y, chunks, w.loss_fn)
    helper = ThreadPoolExecutor(1)

    def step() -> None:
        done = helper.submit(first)
        second()
        done.result()

    return step


def mib(values: Sequence[float]) -> str:
    return " / ".join(f"{v / 2**20:.1f}" for v in values)


def bench(w: Workload, args: argparse.Namespace) -> list[list[str]]:
    plain = Contender("plain", plain_step(w))
    pipes = {name: pipeline(w, name, args.chunks, args.checkpoint) for name in SCHEDULES}
    contenders = [plain, *(Contender(name, train_step(pipe, w)) for name, pipe in pipes.items())]
    bound = unwaited(w, pipes["zb-h1"], args.chunks)
    if bound is not None:
        contenders.append(Contender(BOUND, bound))
    measure(contenders, args.repeats, args.steps_per_block, warmup=1)
    rows = []
    for contender in contenders[1:]:
        if contender.name == BOUND:
            rows.append([w.name, BOUND, "2 on 2", f"{plain.median / (2 * contender.median):.3f}",
                         f"{plain.best / (2 * contender.best):.3f}", "-", "-", "-", "-", f"{contender.median * 1e3:.1f}", "-", "-"])  # fmt: skip
            continue
        pipe = pipes[contender.name]
        measured_bubble = pipe.timeline().bubble()  # of the last timed step
        pipe.measure_memory = True
        train_step(pipe, w)()
        pipe.measure_memory = False
        predicted = pipe.plan.prediction()
        stages = len(pipe.plan.stages)
        rows.append([
            w.name, contender.name, f"{stages} stages on 2",
            f"{plain.median / (2 * contender.median):.3f}", f"{plain.best / (2 * contender.best):.3f}",
            f"{predicted.timeline.bubble():.2f}", f"{measured_bubble:.2f}",
            mib(pipe.last_peak_bytes), mib([predicted.peak_bytes.get(s, 0) for s in range(stages)]),
            f"{contender.median * 1e3:.1f}", f"{predicted.timeline.makespan * 1e3:.1f}",
            f"{contender.median / predicted.timeline.makespan:.2f}",
        ])  # fmt: skip
        if args.gantt and contender.name == "zb-h1" and w is not None and "MLP" in w.name:
            train_step(pipe, w)()
            pipe.timeline().to_svg(
                args.gantt, predicted=predicted.timeline, title=f"measured, {w.name}, zb-h1", predicted_title=f"predicted {pipe.plan.times}",
            )
    return rows


LOOP_BATCHES = 8


def plain_loop(w: Workload, lr: float) -> Callable[[], None]:
    """The plain model's loop over LOOP_BATCHES batches: zero_grad, loss, backward, SGD's step."""
    optimizer = torch.optim.SGD(w.model.parameters(), lr=lr)

    def loop() -> None:
        for _ in range(LOOP_BATCHES):
            optimizer.zero_grad()
            w.loss_fn(w.model(w.x), w.y).backward()
            optimizer.step()

    return loop


def pipeline_loop(pipe: Any, w: Workload, lr: float) -> Callable[[], None]:
    """`pipe.train_steps` over the same LOOP_BATCHES batches, with the same optimizer."""
    optimizer = torch.optim.SGD(pipe.parameters(), lr=lr)
    batches = [(w.x, w.y)] * LOOP_BATCHES

    def loop() -> None:
        for _ in pipe.train_steps(batches, loss_fn=w.loss_fn, optimizer=optimizer):
            pass

    return loop


MINIMUM = "2bw, 1F1B's minimum in hand"


def minimum_in_hand(loop: Callable[[], None]) -> Callable[[], None]:
    """`loop` with 2bw's stages keeping no forward in hand beyond 1F1B's minimum: what 2bw ran
    before its stages kept one more (fxpipe/schedules/two_bw.py), for the difference it makes."""
    import fxpipe.schedules.two_bw as two_bw
    from fxpipe.schedules.actions import one_f_one_b

    def run() -> None:
        kept = two_bw.two_bw_step
        two_bw.two_bw_step = one_f_one_b
        try:
            loop()
        finally:
            two_bw.two_bw_step = kept

    return run


def loop_rows(w: Workload, args: argparse.Namespace) -> list[list[str]]:
    """train_steps over LOOP_BATCHES batches: 1f1b flushes after each, 2bw never (and 2bw with
    1F1B's minimum in hand, its order before); E against the plain model's loop, and the
    parameters' memory (2bw holds a second version per stage)."""
    lr = 1e-6  # the loops train: a small step keeps the work alike from round to round
    schedules = {"1f1b": "1f1b", "2bw": "2bw", MINIMUM: "2bw"}
    pipes = {name: pipeline(w, schedule, args.chunks, args.checkpoint) for name, schedule in schedules.items()}
    plain = Contender("plain", plain_loop(w, lr))
    loops = {name: pipeline_loop(pipe, w, lr) for name, pipe in pipes.items()}
    loops[MINIMUM] = minimum_in_hand(loops[MINIMUM])
    contenders = [plain, *(Contender(name, loop) for name, loop in loops.items())]
    bound = unwaited_loop(w, pipes["2bw"], args.chunks, lr)
    if bound is not None:
        contenders.append(Contender(BOUND, bound))
    measure(contenders, args.repeats, 1, warmup=1)
    params = sum(p.numel() * p.element_size() for p in w.model.parameters())
    rows = []
    for contender in contenders[1:]:
        if contender.name == BOUND:
            rows.append([w.name, BOUND, f"{LOOP_BATCHES} batches", f"{plain.median / (2 * contender.median):.3f}",
                         f"{plain.best / (2 * contender.best):.3f}", f"{contender.median / LOOP_BATCHES * 1e3:.1f}", "-", "-"])  # fmt: skip
            continue
        pipe = pipes[contender.name]
        held = params if contender.name == "1f1b" else pipe.last_parameter_bytes  # 1f1b's steps run on the parameters' own memory
        rows.append([
            w.name, contender.name, f"{LOOP_BATCHES} batches", f"{plain.median / (2 * contender.median):.3f}",
            f"{plain.best / (2 * contender.best):.3f}", f"{contender.median / LOOP_BATCHES * 1e3:.1f}",
            f"{held / 2**20:.1f}", f"{held / params:.2f}",
        ])  # fmt: skip
    return rows


def unwaited_loop(w: Workload, pipe: Any, chunks: int, lr: float) -> Optional[Callable[[], None]]:
    """The no-dependency bound of the loop (bound.py): each stage's work for LOOP_BATCHES batches,
    and an SGD step of its layers after each, on a thread of its own, waiting for nothing. Only
    for a Sequential cut in two."""
    stages = pipe.plan.stages
    if not isinstance(w.model, nn.Sequential) or len(stages) != 2:
        return None
    cut = int(stages[1].modules[0])
    parts = copy.deepcopy(w.model[:cut]), copy.deepcopy(w.model[cut:])
    first, second = stage_work_on(*parts, w.x, w.y, chunks, w.loss_fn)
    steps = [torch.optim.SGD(part.parameters(), lr=lr) for part in parts]
    helper = ThreadPoolExecutor(1)

    def batches(work: Callable[[], None], optimizer: torch.optim.Optimizer) -> None:
        for _ in range(LOOP_BATCHES):
            work()
            optimizer.step()

    def loop() -> None:
        done = helper.submit(batches, first, steps[0])
        batches(second, steps[1])
        done.result()

    return loop


LOOP_HEADER = ["workload", "schedule", "loop", "E median", "E best", "ms per batch (median)", "parameter MiB (peak)", "x the model's"]


def split_cost(quick: bool, repeats: int = 30) -> str:
    """B against I + W on one stage alone: 8 Linear+ReLU layers, one micro-batch, one thread."""
    import statistics
    import time

    from fxpipe.runtime.weight_grad import Weights, backward_inputs

    width, rows = (128, 64) if quick else (512, 256)
    model = make_mlp(8, width)
    weights = list(model.parameters())
    x0 = torch.randn(rows, width)
    split_weights = Weights(weights)

    def whole() -> tuple[float, float]:
        x = x0.clone().requires_grad_()
        y = model(x)
        start = time.perf_counter()
        torch.autograd.backward([y], [torch.ones_like(y)], inputs=[x, *weights])
        return time.perf_counter() - start, 0.0

    def split() -> tuple[float, float]:
        x = x0.clone().requires_grad_()
        y = model(x)
        start = time.perf_counter()
        pending = backward_inputs([y], [torch.ones_like(y)], [x], split_weights)
        middle = time.perf_counter()
        pending.run()
        return middle - start, time.perf_counter() - middle

    for _ in range(3):
        whole(), split()
    b = statistics.median(whole()[0] for _ in range(repeats))
    i_w = [split() for _ in range(repeats)]
    i, w = statistics.median(t[0] for t in i_w), statistics.median(t[1] for t in i_w)
    return (
        f"split cost, one stage of 8 Linear+ReLU {width} wide at {rows} rows: B {b * 1e3:.2f} ms, "
        f"I {i * 1e3:.2f} ms + W {w * 1e3:.2f} ms = {(i + w) / b:.3f} x B; one W-style autograd call "
        f"on a tiny graph: {autograd_call_seconds() * 1e6:.1f} us"
    )


def autograd_call_seconds(repeats: int = 2000) -> float:
    """What one `torch.autograd.backward` from a gradient edge to one weight costs, on a graph
    too small for its kernels to matter: W makes one such call per node it starts from."""
    import statistics
    import time

    from torch.autograd.graph import get_gradient_edge

    w = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8)

    def once() -> float:
        y = (x @ w.t()).tanh()
        edge, grad = get_gradient_edge(y), torch.ones_like(y)
        start = time.perf_counter()
        torch.autograd.backward([edge], [grad], inputs=[w])
        return time.perf_counter() - start

    for _ in range(100):
        once()
    return statistics.median(once() for _ in range(repeats))


BOUND = "no-dependency bound"
HEADER = ["workload", "schedule", "stages", "E median", "E best", "bubble predicted", "bubble measured",
          "peak activations per stage, MiB (measured)", "(predicted)", "ms/step median", "(predicted)",
          "measured / predicted"]  # fmt: skip


def main(argv: Optional[Sequence[str]] = None) -> None:
    reexecuted = ensure_malloc_env()
    args = parse_args(argv)
    torch.set_num_threads(1)
    for line in command_lines(reexecuted, "steady allocator for every contender"):
        print(line)
    print(f"torch {torch.__version__}, {os.cpu_count()} CPUs, one thread per worker; chunks {args.chunks}, "
          f"checkpoint {args.checkpoint!r}; E = T(plain) / (2 x T(step)); GPipe bound m/(m+n-1) = "
          f"{args.chunks / (args.chunks + 1):.3f}\n")  # fmt: skip
    if not args.loops_only:
        rows = [row for w in workloads(args.quick) for row in bench(w, args)]
        print_markdown(HEADER, rows)
        print(f"\n{BOUND}: each stage's work for the step in plain PyTorch on its own thread, on inputs made "
              "beforehand (benchmarks/bound.py): what this machine needs for the step's arithmetic on two "
              "shared cores, at micro-batch size, with no bubble and no schedule")  # fmt: skip
    print(f"\n## train_steps over {LOOP_BATCHES} batches, SGD: 1f1b (a flush after each batch) against 2bw (none)\n")
    print_markdown(LOOP_HEADER, loop_rows(workloads(args.quick)[0], args))
    print(split_cost(args.quick))
    print(f"load average at end={os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
