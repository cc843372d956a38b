"""Pipelines on one GPU against the plain model, eager, compiled and as CUDA graphs: time, peak memory, per-task cost."""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parent.parent
Step = Callable[[], None]


# -- the models -----------------------------------------------------------------------------
class Embed(nn.Module):
    def __init__(self, vocab: int, width: int, length: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(length, width)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))


class Block(nn.Module):
    """A pre-norm transformer block with fused causal attention (SDPA)."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc, self.out = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, width: int, vocab: int) -> None:
        super().__init__()
        self.ln, self.lin = nn.LayerNorm(width), nn.Linear(width, vocab, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(self.ln(x))


def gpt(blocks: int, width: int, length: int, vocab: int = 8192) -> nn.Sequential:
    """A GPT as a Sequential, so that torchgpipe can run it too."""
    return nn.Sequential(Embed(vocab, width, length), *[Block(width, width // 64) for _ in range(blocks)], Head(width, vocab))


@dataclass
class Workload:
    name: str
    make: Callable[[], nn.Module]
    batch: Callable[[], torch.Tensor]
    sequential: bool  # torchgpipe can run it


def workloads() -> list[Workload]:
    sys.path.insert(0, str(ROOT / "examples"))
    from unet import UNet

    return [
        Workload("GPT 16 x d1024, bf16, batch 32 x 512", lambda: gpt(16, 1024, 512), lambda: torch.randint(0, 8192, (32, 512)), True),
        Workload("GPT 8 x d512, bf16, batch 8 x 128", lambda: gpt(8, 512, 128), lambda: torch.randint(0, 8192, (8, 128)), True),
        Workload("U-Net base 32, bf16, 64 x 3 x 128 x 128", lambda: UNet(3, 3, base=32), lambda: torch.randn(64, 3, 128, 128), False),
    ]


# -- contenders -----------------------------------------------------------------------------
@dataclass
class Contender:
    label: str
    step: Step
    stages: int = 0  # pipeline stages (0: not a pipeline)
    chunks: int = 1
    times: list[float] = field(default_factory=list)
    peak: int = 0
    first_step: float = 0.0  # seconds of the first step: compiling, CUDA graph capture
    failure: str = ""


def loss_of(output: torch.Tensor) -> torch.Tensor:
    return output.float().square().mean()


def plain_step(model: nn.Module, x: torch.Tensor) -> Step:
    params = list(model.parameters())

    def step() -> None:
        for p in params:
            p.grad = None
        loss_of(model(x)).backward()

    return step


def micro_batched_step(model: nn.Module, x: torch.Tensor, chunks: int) -> Step:
    """The plain model on the micro-batches in turn: the kernels a pipeline runs, with no pipeline."""
    params, pieces = list(model.parameters()), x.chunk(chunks)

    def step() -> None:
        for p in params:
            p.grad = None
        for piece in pieces:
            loss_of(model(piece)).backward()

    return step


def fxpipe_steps(model: nn.Module, x: torch.Tensor, stages: int, chunks: int, compiled: Any) -> dict[str, Step]:
    """A step per checkpoint mode, on one pipeline: its compiled stages serve both modes."""
    from fxpipe import compile_pipeline

    pipe = compile_pipeline(model, x, ["cuda:0"] * stages, chunks=chunks, compile_stages=compiled)
    step = plain_step(pipe, x)

    def under(checkpoint: str) -> Step:
        def run() -> None:
            pipe.checkpoint = checkpoint
            step()

        return run

    return {checkpoint: under(checkpoint) for checkpoint in ("never", "except_last")}


def torchgpipe_step(model: nn.Sequential, x: torch.Tensor, stages: int, chunks: int, checkpoint: str) -> Step:
    from torchgpipe import GPipe

    per, extra = divmod(len(model), stages)
    balance = [per + (1 if s < extra else 0) for s in range(stages)]
    return plain_step(GPipe(model, balance=balance, devices=["cuda:0"] * stages, chunks=chunks, checkpoint=checkpoint), x)


def measure(contenders: Sequence[Contender], repeats: int, steps: int, deadline: float) -> None:
    """First steps (compiling), peak memory of a step, then blocks of steps round-robin.
    A contender whose first step would start past the deadline is not run."""
    live = [c for c in contenders if not c.failure]
    for c in live:
        if time.monotonic() > deadline and c.stages:
            c.failure = "time budget spent"
            continue
        try:
            torch.cuda.synchronize()
            start = time.perf_counter()
            c.step()
            torch.cuda.synchronize()
            c.first_step = time.perf_counter() - start
            for _ in range(2):
                c.step()
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            c.step()
            torch.cuda.synchronize()
            c.peak = torch.cuda.max_memory_allocated() - base
        except Exception as error:  # noqa: BLE001 - reported in the table
            c.failure = f"{type(error).__name__}: {str(error).splitlines()[0][:160] if str(error) else ''}"
    live = [c for c in live if not c.failure]
    for round_index in range(repeats):
        shift = round_index % max(len(live), 1)
        for c in [*live[shift:], *live[:shift]]:
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(steps):
                c.step()
            torch.cuda.synchronize()
            c.times.append((time.perf_counter() - start) / steps)


# -- the table ------------------------------------------------------------------------------
HEADER = ["model", "contender", "ms/step (median)", "x plain", "x plain on micro-batches", "peak GiB", "us per task over micro-batches", "first step s"]


def rows_of(name: str, contenders: Sequence[Contender], baselines: bool = True) -> list[list[str]]:
    """A row per contender; the baselines' own rows once (they are measured again beside each
    kind of pipeline, for its ratios)."""
    plain, batched = contenders[0], contenders[1]
    rows = []
    for c in contenders if baselines else contenders[2:]:
        if c.failure or not c.times:
            rows.append([name, c.label, f"not run: {c.failure or 'time budget spent'}", "", "", "", "", ""])
            continue
        t = statistics.median(c.times)
        per_task = ""
        if c.stages and batched.times:
            per_task = f"{(t - statistics.median(batched.times)) / (2 * c.chunks * c.stages) * 1e6:.0f}"
        ratio = lambda ref: f"{t / statistics.median(ref.times):.3f}" if ref.times else ""  # noqa: E731
        rows.append([name, c.label, f"{t * 1e3:.2f}", ratio(plain), ratio(batched), f"{c.peak / 2**30:.2f}", per_task, f"{c.first_step:.1f}"])
    return rows


def print_rows(rows: Sequence[list[str]]) -> None:
    for row in rows:
        print("| " + " | ".join(row) + " |", flush=True)


# -- main -----------------------------------------------------------------------------------
MODES = {"eager": False, "compiled": True, "CUDA graphs": {"mode": "reduce-overhead"}}


def contenders_for(work: Workload, chunks: int, kind: str, deadline: float) -> list[Contender]:
    """The plain model whole and on micro-batches, then fxpipe's pipelines of this kind (and
    torchgpipe's, with the eager ones)."""
    torch.manual_seed(0)
    model = work.make().to("cuda", torch.bfloat16)
    x = work.batch().cuda()
    if x.is_floating_point():
        x = x.to(torch.bfloat16)
    found = [
        Contender("plain", plain_step(copy.deepcopy(model), x)),
        Contender(f"plain on {chunks} micro-batches in turn", micro_batched_step(copy.deepcopy(model), x, chunks)),
    ]
    for stages in (1, 4):
        steps, failure = _made(deadline, lambda: fxpipe_steps(copy.deepcopy(model), x, stages, chunks, MODES[kind]))
        for checkpoint in ("never", "except_last"):
            shape = f"{stages} stage{'s' * (stages > 1)} x {chunks}, {checkpoint!r}"
            found.append(Contender(f"fxpipe {kind}, {shape}", steps.get(checkpoint, _nothing), stages, chunks, failure=failure))
            if kind != "eager":
                continue
            if not work.sequential:
                why = "torchgpipe runs an nn.Sequential only (a U-Net's skips need its @skippable rewrite)"
                found.append(Contender(f"torchgpipe, {shape}", _nothing, stages, chunks, failure=why))
            else:
                made, failure = _made(deadline, lambda: {"": torchgpipe_step(copy.deepcopy(model), x, stages, chunks, checkpoint)})  # type: ignore[arg-type]
                found.append(Contender(f"torchgpipe, {shape}", made.get("", _nothing), stages, chunks, failure=failure))
    return found


def _nothing() -> None:
    """The step of a contender that could not be made."""


def _made(deadline: float, make: Callable[[], dict[str, Step]]) -> tuple[dict[str, Step], str]:
    """The steps `make` makes, or none and why not."""
    if time.monotonic() > deadline:
        return {}, "time budget spent"
    try:
        return make(), ""
    except Exception as error:  # noqa: BLE001 - reported in the table
        return {}, f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"


def main(argv: Optional[Sequence[str]] = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--budget", type=float, default=300.0, help="seconds; contenders not built by then are reported as not run")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps per timed block")
    p.add_argument("--chunks", type=int, default=8)
    p.add_argument("--models", default="1,0,2", help="which workloads, by index (0: GPT 16 x d1024, 1: GPT 8 x d512, 2: U-Net)")
    p.add_argument("--kinds", default="eager,compiled,CUDA graphs")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks/gpu.py needs a CUDA device; none is available here.")
        return
    deadline = time.monotonic() + args.budget
    print(f"# fxpipe on {torch.cuda.get_device_name()}, torch {torch.__version__}\n")
    print(
        f"method: a step is forward and backward of a mean-square loss, no optimizer; every pipeline's stages on cuda:0; "
        f"{args.chunks} micro-batches; median of {args.repeats} blocks of {args.steps} steps, contenders round-robin; peak "
        "memory is the allocator's peak over one step above what was allocated before it; a task is one stage's "
        "forward or backward of one micro-batch. The first step includes compiling and capture.\n"
    )
    print("| " + " | ".join(HEADER) + " |\n|" + "---|" * len(HEADER), flush=True)
    chosen = [workloads()[int(i)] for i in args.models.split(",")]
    kinds = [k.strip() for k in args.kinds.split(",")]
    # Every model's eager rows first, then each model's compiled kinds: compiling is what may run
    # out of time, the small GPT (launch-bound: where compiling helps most) first.
    order = [("eager", w) for w in chosen] if "eager" in kinds else []
    order += [(k, w) for w in chosen for k in kinds if k != "eager"]
    for kind, work in order:
        contenders = contenders_for(work, args.chunks, kind, deadline)
        measure(contenders, args.repeats, args.steps, deadline)
        print_rows(rows_of(work.name, contenders, baselines=kind == "eager"))
        del contenders
        torch.cuda.empty_cache()
    print(f"\nbudget left: {deadline - time.monotonic():.0f} s of {args.budget:.0f}")


if __name__ == "__main__":
    main()
