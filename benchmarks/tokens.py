"""One sequence through two stages: one micro-batch per step against slices of its sequence (sequence_chunks).

A small GPT (examples/gpt.py) on one sequence (batch 1) is cut in 2 stages on 2 CPU devices. Each
contender runs `pipe(x)`, a cross-entropy loss and `loss.backward()` (checkpoint 'never': no
recompute), timed round-robin with the plain model on one thread (torch threads 1).
E = T(plain) / (2 x T(pipe)).

Predicted E comes from the model's FLOPs: counted at two lengths, they give a cost per position
(a) and per pair of positions attention computes (b); a slice of l positions after p others costs
a*l + b*l*(p + l) per stage-half, and the pipeline's time is sum(t) + (stages - 1) * max(t)
(fxpipe/schedules/slices.py). The plain model computes every pair of its T x T scores; slices
compute only those up to their last position, so E may pass 1 on attention-heavy work. Per-task
overheads are not in the prediction.
"""
from __future__ import annotations

import argparse
import copy
import os
import sys
from typing import Any, Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from environment import command_lines, ensure_malloc_env
from overhead import ROOT, Contender, measure
from tables import print_markdown

STAGES = 2


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="a shorter sequence and fewer layers, for a smoke run")
    p.add_argument("--repeats", type=int, default=None, help="timed rounds (default 7; 2 with --quick)")
    p.add_argument("--slices", type=int, default=8, help="sequence_chunks of the even contender")
    args = p.parse_args(argv)
    args.repeats = args.repeats or (2 if args.quick else 7)
    args.length, args.layers = (256, 2) if args.quick else (1024, 4)
    return args


def gpt(args: argparse.Namespace) -> nn.Module:
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import make_model

    torch.manual_seed(0)
    return make_model(n_layer=args.layers, n_embd=64, n_head=4, block_size=args.length)


def tokens(length: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 16, (1, length + 1), generator=g)
    return x[:, :-1], x[:, 1:]


def step(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> Callable[[], None]:
    params = list(model.parameters())

    def run() -> None:
        for p in params:
            p.grad = None
        out = model(x)
        F.cross_entropy(out.flatten(0, 1), y.flatten()).backward()

    return run


def costs(model: nn.Module, length: int) -> tuple[float, float]:
    """FLOPs per position (a) and per pair of positions (b) of forward and backward, from two lengths."""
    counts = []
    for n in (length // 2, length):
        x, y = tokens(n)
        with FlopCounterMode(display=False) as counter:
            F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
        counts.append(float(counter.get_total_flops()))
    model.zero_grad()
    (n1, f1), (n2, f2) = zip((length // 2, length), counts)
    b = (f2 / n2 - f1 / n1) / (n2 - n1)
    return f1 / n1 - b * n1, b


def predicted(lengths: list[int], a: float, b: float) -> float:
    """E of these slices under the FLOP model (module docstring)."""
    from fxpipe.schedules.slices import pipeline_time, slice_time

    total = sum(lengths)
    per_stage = slice_time(a / STAGES, b / STAGES, 0.0)
    return (a * total + b * total * total) / (STAGES * pipeline_time(lengths, STAGES, per_stage))


def main(argv: Optional[Sequence[str]] = None) -> None:
    reexecuted = ensure_malloc_env()
    args = parse_args(argv)
    torch.set_num_threads(1)
    from fxpipe import compile_pipeline

    model = gpt(args)
    x, y = tokens(args.length)
    a, b = costs(model, args.length)
    contenders: list[tuple[Contender, list[int]]] = []
    for slices in (1, args.slices, "auto"):
        pipe = compile_pipeline(copy.deepcopy(model), x, ["cpu"] * STAGES, sequence_chunks=slices, balance="flops", checkpoint="never")
        spec = pipe._compiled.slicing
        lengths = spec.lengths(args.length) if spec is not None else [args.length]
        name = f"fxpipe, sequence_chunks={slices!r}" + (f" ({len(lengths)} slices, {lengths[0]} to {lengths[-1]})" if slices == "auto" else "")
        contenders.append((Contender(name, step(pipe, x, y), pipe=pipe), lengths))
    plain = Contender("plain model, one thread", step(model, x, y))
    measure([plain, *(c for c, _ in contenders)], args.repeats, 1, warmup=1)
    print("# One sequence through two stages: slices of the sequence\n")
    for line in command_lines(reexecuted, "glibc reads them at start-up"):
        print(f"{line}  ")
    print(
        f"GPT {args.layers} blocks x 64, one sequence of {args.length} tokens, {STAGES} CPU devices, torch threads 1, "
        f"cores {os.cpu_count()}, {args.repeats} rounds; a = {a:.3g} FLOPs per position, b = {b:.3g} per pair\n"
    )
    rows = [[plain.name, f"{plain.median * 1e3:.1f}", "", ""]]
    for contender, lengths in contenders:
        measured = plain.median / (STAGES * contender.median)
        rows.append([contender.name, f"{contender.median * 1e3:.1f}", f"{predicted(lengths, a, b):.2f}", f"{measured:.2f}"])
        assert contender.pipe is not None
        contender.pipe.close()
    print_markdown(["contender", "ms per step (median)", "E predicted", "E measured"], rows)


if __name__ == "__main__":
    main()
