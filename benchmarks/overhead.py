"""Pipeline overhead and efficiency on CPU: fxpipe and torchgpipe against the plain model, side by side."""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, cast

import torch
from torch import nn

from environment import command_lines, ensure_malloc_env

if TYPE_CHECKING:
    from fxpipe import Pipeline

ROOT = Path(__file__).resolve().parent.parent


Step = Callable[[], None]
Key = tuple[int, int, str]  # stages, chunks, checkpoint


# -- options --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    mlp_layers: int
    mlp_width: int
    mlp_batch: int
    small_batch: int
    unet_batch: int
    unet_image: int
    chunks: int


FULL = Sizes(mlp_layers=16, mlp_width=512, mlp_batch=2048, small_batch=256, unet_batch=128, unet_image=32, chunks=8)
QUICK = Sizes(mlp_layers=8, mlp_width=128, mlp_batch=512, small_batch=128, unet_batch=16, unet_image=16, chunks=8)


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=None, help="timed rounds of every contender (default 9; 2 with --quick)")
    p.add_argument("--steps-per-block", type=int, default=None, help="steps per timed block (default 3; 1 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed steps per contender first (default 2; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run in under 30 s")
    p.add_argument("--parts", default="mlp,unet,tasks,compiled", help="which tables to run, of mlp, unet, tasks, compiled")
    args = p.parse_args(argv)
    args.sizes = QUICK if args.quick else FULL
    for name, full, quick in (("repeats", 9, 2), ("steps_per_block", 3, 1), ("warmup", 2, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


# -- contenders -----------------------------------------------------------------------------
@dataclass
class Contender:
    name: str
    step: Step
    detail: str = ""  # how the pipeline was cut, for the table
    times: list[float] = field(default_factory=list)  # seconds per step, one entry per timed block
    pipe: Optional[Pipeline] = None  # the pipeline it runs, if any

    @property
    def median(self) -> float:
        return statistics.median(self.times)

    @property
    def best(self) -> float:
        return min(self.times)


def training_step(model: nn.Module, inputs: torch.Tensor, loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> Step:
    """Forward and backward, no optimizer; gradients are dropped first, as zero_grad() does."""
    params = list(model.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        loss_fn(model(inputs)).backward()

    return step


def forward_step(model: nn.Module, inputs: torch.Tensor) -> Step:
    """The forward alone, recording the graph as a recompute does: F in the recompute bound."""

    def step() -> None:
        with torch.enable_grad():
            model(inputs)

    return step


def sequential_micro_batches_step(model: nn.Module, inputs: torch.Tensor, chunks: int, loss_fn: Callable[[torch.Tensor], torch.Tensor]) -> Step:
    """The plain model over the micro-batches one after another, on one thread: the kernel cost
    of small micro-batches, without any pipeline."""
    params = list(model.parameters())
    pieces = inputs.chunk(chunks)

    def step() -> None:
        for p in params:
            p.grad = None
        for piece in pieces:
            loss_fn(model(piece)).backward()

    return step


def mean_square(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def measure(
    contenders: Sequence[Contender], repeats: int, steps_per_block: int, warmup: int, clock: Callable[[], float] = time.perf_counter
) -> None:
    """Warm every contender up, then time blocks of steps round-robin, rotating who goes first.
    `clock` is the wall clock, or `time.thread_time` for work on the caller's thread alone."""
    for contender in contenders:
        for _ in range(warmup):
            contender.step()
    for round_index in range(repeats):
        shift = round_index % len(contenders)
        for contender in [*contenders[shift:], *contenders[:shift]]:
            start = clock()
            for _ in range(steps_per_block):
                contender.step()
            contender.times.append((clock() - start) / steps_per_block)


# -- the libraries --------------------------------------------------------------------------
def fxpipe_pipeline(model: nn.Module, example: torch.Tensor, stages: int, chunks: int, checkpoint: str, **options: Any) -> Pipeline:
    from fxpipe import compile_pipeline

    devices = ["cpu"] * stages
    return compile_pipeline(copy.deepcopy(model), example, devices=devices, chunks=chunks, checkpoint=checkpoint, **options)


def fxpipe_contender(model: nn.Module, x: torch.Tensor, loss_fn: Callable[[torch.Tensor], torch.Tensor], key: Key, **options: Any) -> Contender:
    pipe = fxpipe_pipeline(model, x, *key, **options)
    nodes = "+".join(str(len(stage.nodes)) for stage in pipe.plan.stages)
    detail = f" ({nodes} nodes{''.join(f', {k}={v!r}' for k, v in options.items())})" if key[0] > 1 else ""
    return Contender(f"fxpipe {key}{' compiled' if options.get('compile_stages') else ''}", training_step(pipe, x, loss_fn), detail, pipe=pipe)


def load_torchgpipe() -> tuple[Optional[Any], str]:
    """torchgpipe's GPipe class, or None and why not. 0.0.7 needs no shim on torch 2.13 so far."""
    try:
        import torchgpipe
        from torchgpipe import GPipe
    except Exception as error:  # noqa: BLE001 - any import failure means "not runnable"
        return None, f"import failed: {type(error).__name__}: {error}"
    return GPipe, f"torchgpipe {torchgpipe.__version__}"


def torchgpipe_pipeline(gpipe: Any, model: nn.Sequential, stages: int, chunks: int, checkpoint: str) -> nn.Module:
    per_stage, extra = divmod(len(model), stages)
    balance = [per_stage + (1 if s < extra else 0) for s in range(stages)]
    return gpipe(copy.deepcopy(model), balance=balance, devices=["cpu"] * stages, chunks=chunks, checkpoint=checkpoint)


def smoke_test(step: Step) -> Optional[str]:
    """Run one step; the reason it failed, or None."""
    try:
        step()
    except Exception as error:  # noqa: BLE001 - reported in the table instead
        return f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    return None


# -- the models -----------------------------------------------------------------------------
def make_mlp(layers: int, width: int) -> nn.Sequential:
    blocks: list[nn.Module] = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks)


# -- the table ------------------------------------------------------------------------------
@dataclass
class Row:
    model: str
    library: str
    configuration: str
    metric: str
    median: Optional[float] = None
    best: Optional[float] = None
    target: str = ""
    bound: str = ""
    milliseconds: str = ""
    note: str = ""

    def cells(self) -> list[str]:
        if self.median is None or self.best is None:
            values = [self.note, ""]
        else:
            values = [f"{self.median:.3f}", f"{self.best:.3f}"]
        return [self.model, self.library, self.configuration, self.metric, *values, self.target, self.bound, self.milliseconds]


HEADER = ["model", "library", "configuration", "metric", "median", "min", "target", "bound", "ms/step median (min)"]


def milliseconds(*contenders: Contender) -> str:
    return " / ".join(f"{c.median * 1e3:.1f} ({c.best * 1e3:.1f})" for c in contenders)


def overhead_row(model: str, library: str, plain: Contender, pipe: Contender) -> Row:
    """T(pipe) / T(plain) for one stage, one micro-batch."""
    return Row(
        model, library, "1 stage, chunks 1, 'never'", "T(pipe)/T(plain)",
        pipe.median / plain.median, pipe.best / plain.best, "<= 1.03", "1.00", milliseconds(plain, pipe),
    )


def efficiency_row(model: str, library: str, configuration: str, plain: Contender, pipe: Contender, stages: int, target: str, bound: float) -> Row:
    """E = T(plain, one thread) / (n x T(pipeline))."""
    return Row(
        model, library, configuration, f"E = T(plain)/({stages}T(pipe))",
        plain.median / (stages * pipe.median), plain.best / (stages * pipe.best), target, f"{bound:.2f}", milliseconds(plain, pipe),
    )


def micro_batched_row(model: str, pieces: str, plain: Contender, sequential: Contender) -> Row:
    """What micro-batching alone costs: the plain model over the micro-batches in turn, one thread."""
    return Row(
        model, "(none)", f"plain, {pieces} in turn, one thread", "T(micro-batched)/T(plain)",
        sequential.median / plain.median, sequential.best / plain.best, "", "", milliseconds(plain, sequential),
    )


def gpipe_bound(chunks: int, stages: int) -> float:
    return chunks / (chunks + stages - 1)


def recompute_bound(chunks: int, stages: int, plain: Contender, forward: Contender) -> float:
    """The GPipe bound times (F + B) / (F + B + F (m-1)/m): 'except_last' recomputes m-1 of m."""
    step, f = plain.median, forward.median
    return gpipe_bound(chunks, stages) * step / (step + f * (chunks - 1) / chunks)


def print_table(rows: Sequence[Row]) -> None:
    lines = [HEADER, ["---"] * len(HEADER), *[row.cells() for row in rows]]
    for line in lines:
        print("| " + " | ".join(line) + " |")


# -- the benchmarks -------------------------------------------------------------------------
def configurations(chunks: int) -> list[Key]:
    return [(1, 1, "never"), (2, chunks, "never"), (2, chunks, "except_last")]


def describe(key: Key) -> str:
    stages, chunks, checkpoint = key
    return f"{stages} stage{'s' if stages > 1 else ''}, chunks {chunks}, {checkpoint!r}"


def pipeline_rows(name: str, library: str, runs: dict[Key, Contender], failures: dict[Key, str], plain: Contender, forward: Contender, keys: Sequence[Key]) -> list[Row]:
    """Rows 1-3 for one library on one model: overhead, efficiency, efficiency with recompute."""
    rows = []
    for key in keys:
        stages, chunks, checkpoint = key
        if key not in runs:
            rows.append(Row(name, library, describe(key), "", note=f"{library}: not runnable ({failures[key]})"))
        elif stages == 1:
            rows.append(overhead_row(name, library, plain, runs[key]))
        elif checkpoint == "never":
            rows.append(efficiency_row(name, library, describe(key) + runs[key].detail, plain, runs[key], stages, ">= 0.80", gpipe_bound(chunks, stages)))
        else:
            bound = recompute_bound(chunks, stages, plain, forward)
            rows.append(efficiency_row(name, library, describe(key) + runs[key].detail, plain, runs[key], stages, "", bound))
    return rows


def torchgpipe_contenders(layers: nn.Sequential, x: torch.Tensor, keys: Sequence[Key]) -> tuple[dict[Key, Contender], dict[Key, str]]:
    """A contender per configuration that builds and runs one step; the reason for the others."""
    gpipe, status = load_torchgpipe()
    runs: dict[Key, Contender] = {}
    failures: dict[Key, str] = {}
    for key in keys:
        if gpipe is None:
            failures[key] = status
            continue
        try:
            step = training_step(torchgpipe_pipeline(gpipe, layers, *key), x, mean_square)
            reason = smoke_test(step)
        except Exception as error:  # noqa: BLE001 - reported in the table
            reason = f"{type(error).__name__}: {error}"
        if reason is None:
            runs[key] = Contender(f"torchgpipe {key}", step)
        else:
            failures[key] = reason
    return runs, failures


def bench_mlp(args: argparse.Namespace) -> list[Row]:
    s: Sizes = args.sizes
    torch.manual_seed(0)
    model = make_mlp(s.mlp_layers, s.mlp_width)
    x = torch.randn(s.mlp_batch, s.mlp_width)
    small = torch.randn(s.small_batch, s.mlp_width)
    name = f"MLP {s.mlp_layers}x{s.mlp_width}, batch {s.mlp_batch}"
    small_name = f"MLP {s.mlp_layers}x{s.mlp_width}, batch {s.small_batch}"
    keys = configurations(s.chunks)

    plain = Contender("plain", training_step(model, x, mean_square))
    forward = Contender("plain forward", forward_step(model, x))
    fx = {key: fxpipe_contender(model, x, mean_square, key) for key in keys}
    tg, tg_failures = torchgpipe_contenders(model, x, keys)
    sequential = Contender("plain, micro-batches in turn", sequential_micro_batches_step(model, x, s.chunks, mean_square))
    small_plain = Contender("plain, small batch", training_step(model, small, mean_square))
    small_fx = fxpipe_contender(model, small, mean_square, (2, s.chunks, "never"))
    small_sequential = Contender("plain, small micro-batches in turn", sequential_micro_batches_step(model, small, s.chunks, mean_square))

    contenders = [plain, forward, *fx.values(), *tg.values(), sequential, small_plain, small_fx, small_sequential]
    measure(contenders, args.repeats, args.steps_per_block, args.warmup)

    rows = pipeline_rows(name, "fxpipe", fx, {}, plain, forward, keys)
    rows += pipeline_rows(name, "torchgpipe", tg, tg_failures, plain, forward, keys)
    rows.append(micro_batched_row(name, f"{s.chunks} micro-batches of {s.mlp_batch // s.chunks} rows", plain, sequential))
    rows.append(efficiency_row(
        small_name, "fxpipe", f"2 stages, chunks {s.chunks} ({s.small_batch // s.chunks} rows), 'never'{small_fx.detail}",
        small_plain, small_fx, 2, "", gpipe_bound(s.chunks, 2),
    ))
    rows.append(micro_batched_row(small_name, f"{s.chunks} micro-batches of {s.small_batch // s.chunks} rows", small_plain, small_sequential))
    return rows


def bench_unet(args: argparse.Namespace) -> list[Row]:
    sys.path.insert(0, str(ROOT / "examples"))
    from unet import loss_fn, make_batch, make_model

    s: Sizes = args.sizes
    torch.manual_seed(0)
    model = make_model()
    x, y = make_batch(s.unet_batch, size=s.unet_image)
    name = f"U-Net (examples/unet.py), batch {s.unet_batch}, {s.unet_image}x{s.unet_image}"
    keys = configurations(s.chunks)

    def loss(output: torch.Tensor) -> torch.Tensor:
        # y[:len(output)] is y itself, except for the micro-batched reference, where any rows time the same.
        return loss_fn(output, y[: len(output)])

    plain = Contender("plain", training_step(model, x, loss))
    forward = Contender("plain forward", forward_step(model, x))
    fx = {key: fxpipe_contender(model, x, loss, key) for key in keys}
    by_time = (2, s.chunks, "never")
    try:  # an extra row: the default cut balances memory; this one balances measured time
        timed: dict[Key, Contender] = {by_time: fxpipe_contender(model, x, loss, by_time, balance="time")}
        timed_failure: dict[Key, str] = {}
    except Exception as error:  # noqa: BLE001 - reported in the table
        timed, timed_failure = {}, {by_time: f"balance='time': {type(error).__name__}: {error}"}
    sequential = Contender("plain, micro-batches in turn", sequential_micro_batches_step(model, x, s.chunks, loss))
    measure([plain, forward, *fx.values(), *timed.values(), sequential], args.repeats, args.steps_per_block, args.warmup)

    rows = pipeline_rows(name, "fxpipe", fx, {}, plain, forward, keys)
    rows += pipeline_rows(name, "fxpipe", timed, timed_failure, plain, forward, [by_time])
    rows.append(micro_batched_row(name, f"{s.chunks} micro-batches of {s.unet_batch // s.chunks} images", plain, sequential))
    return rows


class TinyBlock(nn.Module):
    """A pre-norm transformer block with SDPA, small enough that a micro-batch is launch-bound."""

    def __init__(self, width: int = 64, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


def per_task_row(name: str, sequential: Contender, pipe: Contender, chunks: int) -> Row:
    """What a pipeline adds per task (a forward or a backward of one micro-batch on one stage)
    over the plain model run on the same micro-batches in turn, in microseconds."""
    tasks = 2 * chunks
    return Row(
        name, "fxpipe", f"1 stage, chunks {chunks}, 'never'", "us per task over plain in turn (CPU time)",
        (pipe.median - sequential.median) / tasks * 1e6, (pipe.best - sequential.best) / tasks * 1e6,
        "<= 30", "", milliseconds(sequential, pipe),
    )


def bench_tasks(args: argparse.Namespace) -> list[Row]:
    """Launch-bound workloads: the runtime's own cost per task, not the kernels'."""
    torch.manual_seed(0)
    chunks = args.sizes.chunks
    workloads = [
        ("small MLP 4x64, batch 64", make_mlp(4, 64), torch.randn(64, 64)),
        ("transformer block 64 (SDPA), batch 16 x 16", TinyBlock(), torch.randn(16, 16, 64)),
    ]
    rows = []
    for name, model, x in workloads:
        sequential = Contender("plain, micro-batches in turn", sequential_micro_batches_step(model, x, chunks, mean_square))
        pipe = fxpipe_contender(model, x, mean_square, (1, chunks, "never"))
        # One worker runs its tasks on the caller's thread: its CPU time is the runtime's cost,
        # and the neighbours' load on this shared machine inflates it less than the wall clock.
        measure([sequential, pipe], args.repeats * 3, args.steps_per_block * 10, args.warmup, clock=time.thread_time)
        rows.append(per_task_row(name, sequential, pipe, chunks))
    rows += per_step_and_per_task_rows(workloads[0][1], args)
    return rows


def per_step_and_per_task_rows(model: nn.Module, args: argparse.Namespace, rows_each: int = 8, counts: tuple[int, int] = (1, 16)) -> list[Row]:
    """What the runtime adds per call and per task, apart: the pipeline over the plain model in
    turn at two counts of micro-batches of `rows_each` rows, fitted as a line in the tasks."""
    extra: dict[int, tuple[float, float]] = {}
    for chunks in counts:
        x = torch.randn(rows_each * chunks, 64)
        sequential = Contender("plain, micro-batches in turn", sequential_micro_batches_step(model, x, chunks, mean_square))
        pipe = fxpipe_contender(model, x, mean_square, (1, chunks, "never"))
        measure([sequential, pipe], args.repeats * 3, args.steps_per_block * 10, args.warmup, clock=time.thread_time)
        extra[chunks] = (pipe.median - sequential.median, pipe.best - sequential.best)
    few, many = counts
    per_task = [(extra[many][k] - extra[few][k]) / (2 * (many - few)) for k in (0, 1)]
    per_call = [extra[few][k] - 2 * few * per_task[k] for k in (0, 1)]
    where = f"1 stage, micro-batches of {rows_each} rows, chunks {few} and {many}, 'never'"
    return [
        Row("small MLP 4x64", "fxpipe", where, "us per call, fitted (CPU time)", per_call[0] * 1e6, per_call[1] * 1e6),
        Row("small MLP 4x64", "fxpipe", where, "us per task, fitted (CPU time)", per_task[0] * 1e6, per_task[1] * 1e6, "<= 30"),
    ]


class TinyGPT(nn.Module):
    """Token and position embeddings, TinyBlocks, a head: a GPT small enough to be launch-bound."""

    def __init__(self, width: int = 32, blocks: int = 4, vocab: int = 64, length: int = 16) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(length, width)
        self.blocks = nn.Sequential(*[TinyBlock(width, 4) for _ in range(blocks)])
        self.head = nn.Linear(width, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.tok(idx) + self.pos(torch.arange(idx.shape[1]))))


def first_step_seconds(step: Step) -> float:
    start = time.perf_counter()
    step()
    return time.perf_counter() - start


def bench_compiled(args: argparse.Namespace) -> list[Row]:
    """Stages under torch.compile (inductor's C++ on the CPU) against the same pipeline eager,
    and torch.compile of the plain model against the plain model, on the same micro-batches."""
    torch.manual_seed(0)
    chunks = args.sizes.chunks
    model, x = TinyGPT(), torch.randint(0, 64, (4 * chunks, 16))
    name = f"small GPT (d 32, 4 blocks, SDPA), {chunks} micro-batches of 4 x 16 tokens"
    eager = fxpipe_contender(model, x, mean_square, (1, chunks, "never"))
    compiled = fxpipe_contender(model, x, mean_square, (1, chunks, "never"), compile_stages=True)
    plain = Contender("plain, micro-batches in turn", sequential_micro_batches_step(model, x, chunks, mean_square))
    plain_compiled = Contender(
        "plain compiled, micro-batches in turn", sequential_micro_batches_step(cast(nn.Module, torch.compile(copy.deepcopy(model))), x, chunks, mean_square)
    )
    compile_seconds = {c.name: first_step_seconds(c.step) for c in (compiled, plain_compiled)}
    measure([eager, compiled, plain, plain_compiled], args.repeats, args.steps_per_block * 5, args.warmup)
    stage_graphs = sum(s.graphs for s in compiled_stats(compiled))
    return [
        Row(name, "fxpipe", f"1 stage, chunks {chunks}, 'never', compile_stages=True", "T(compiled)/T(eager pipeline)",
            compiled.median / eager.median, compiled.best / eager.best, "<= 0.85", "", milliseconds(eager, compiled)),
        Row(name, "(none)", "torch.compile(model), micro-batches in turn", "T(compiled)/T(plain)",
            plain_compiled.median / plain.median, plain_compiled.best / plain.best, "", "", milliseconds(plain, plain_compiled)),
        Row(name, "fxpipe", f"first step: compiling {stage_graphs} graph(s) (the plain model: {compile_seconds[plain_compiled.name]:.1f} s)",
            "seconds", compile_seconds[compiled.name], compile_seconds[compiled.name], "", "", ""),
    ]  # fmt: skip


def compiled_stats(contender: Contender) -> list[Any]:
    pipe = contender.pipe
    return pipe.compile_stats() if pipe is not None else []


# -- main -----------------------------------------------------------------------------------
def print_settings(args: argparse.Namespace, reexecuted: bool) -> None:
    print("# fxpipe overhead and pipeline efficiency on CPU\n")
    for line in command_lines(reexecuted, "glibc reads them at start-up; set for every contender alike"):
        print(line)
    s: Sizes = args.sizes
    print(
        f"settings: repeats={args.repeats}, steps per block={args.steps_per_block}, warm-up steps={args.warmup}, "
        f"quick={args.quick}; MLP {s.mlp_layers} x Linear({s.mlp_width})+ReLU, batch {s.mlp_batch} (small: {s.small_batch}); "
        f"U-Net batch {s.unet_batch} of {s.unet_image}x{s.unet_image}; chunks {s.chunks}"
    )
    print(
        f"torch {torch.__version__}, intra-op threads per thread={torch.get_num_threads()}, cores={os.cpu_count()}, "
        f"{load_torchgpipe()[1]}, load average at start={os.getloadavg()[0]:.2f}"
    )
    print(
        "method: a step is forward + backward of a mean loss, no optimizer; contenders run round-robin in this "
        "process (rotating who goes first), each timed in blocks of steps; median and min over the blocks. "
        "Each pipeline stage runs on its own worker thread; 'devices' are ['cpu', 'cpu'].\n"
    )


def main(argv: Optional[Sequence[str]] = None) -> None:
    reexecuted = ensure_malloc_env()
    args = parse_args(argv)
    torch.set_num_threads(1)
    print_settings(args, reexecuted)
    parts = {"mlp": bench_mlp, "unet": bench_unet, "tasks": bench_tasks, "compiled": bench_compiled}
    rows = [row for name in args.parts.split(",") for row in parts[name.strip()](args)]
    print_table(rows)
    print(
        f"\nbound: m/(m+n-1) for 'never'; for 'except_last' that times (F+B)/(F+B+F(m-1)/m), F the measured "
        f"forward and F+B the plain step. load average at end={os.getloadavg()[0]:.2f}"
    )


if __name__ == "__main__":
    main()
