"""A generated stage's forward against the plain model's, with and without the code's two shortcuts.

The stage's code reaches each submodule it calls through containers the stage owns; the
shortcut puts each child in its container's `__dict__`, so that no lookup runs
`nn.Module.__getattr__`. A graph captured by torch.export calls every op as
`torch.ops.aten.add.Tensor(...)`; the shortcut calls each overload's C++ entry point, bound once.
Each row times, alternating in one process under `no_grad`, one call of the plain model, of the
pipeline's one stage as built, of a copy whose containers lack the first shortcut, and of one
that lacks both (a GPT of `examples/gpt.py`, one stage, chunks 1).
"""
from __future__ import annotations

import argparse
import copy
import functools
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch
import torch.fx as fx
from torch import nn

from environment import command_lines, ensure_malloc_env
from fxpipe import compile_pipeline
from fxpipe.passes.codegen import ready
from tables import print_markdown

ROOT = Path(__file__).resolve().parent.parent


class Exported(nn.Module):
    """The model, behind a signature torch.fx cannot trace (`*rest`): torch.export captures it."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, *rest: Any) -> torch.Tensor:
        return self.model(x)


def without_shortcuts(stage: fx.GraphModule, bind_operators: bool) -> fx.GraphModule:
    """A copy of `stage` whose containers find their children through `nn.Module.__getattr__`,
    and, unless `bind_operators`, whose code calls overloads by their full path."""
    slow = copy.deepcopy(stage)
    ready(slow, bind_operators=bind_operators)
    for module in slow.modules():
        for name, child in module._modules.items():
            if vars(module).get(name) is child:
                del vars(module)[name]
    return slow


def timed(calls: dict[str, Callable[[], Any]], rounds: int) -> dict[str, list[float]]:
    """Seconds per call of each contender, the contenders alternating call by call."""
    times: dict[str, list[float]] = {name: [] for name in calls}
    for _ in range(rounds):
        for name, call in calls.items():
            start = time.perf_counter()
            call()
            times[name].append(time.perf_counter() - start)
    return times


def row(name: str, model: nn.Module, x: torch.Tensor, rounds: int) -> list[str]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "torch.fx could not trace ...; used torch.export"
        pipe = compile_pipeline(copy.deepcopy(model), x, ["cpu"], chunks=1, checkpoint="never")
    stage = pipe.stages[0]
    calls = {
        "model": model,
        "stage": stage,
        "lookups": without_shortcuts(stage, bind_operators=True),
        "neither": without_shortcuts(stage, bind_operators=False),
    }
    with torch.no_grad():
        for call in list(calls.values())[1:]:
            torch.testing.assert_close(call(x)[0], model(x), rtol=0, atol=0)  # a stage returns a tuple
        timed({k: functools.partial(call, x) for k, call in calls.items()}, 20)
        times = timed({k: functools.partial(call, x) for k, call in calls.items()}, rounds)
    ops = sum(1 for n in stage.graph.nodes if n.op in ("call_function", "call_module", "call_method"))
    cells = [f"{min(t) * 1e6:.0f} / {statistics.median(t) * 1e6:.0f}" for t in times.values()]
    saved = statistics.median(times["neither"]) / statistics.median(times["stage"])
    return [name, str(ops), *cells, f"{saved:.2f}"]


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=8, help="the GPT's blocks (default 8)")
    p.add_argument("--rounds", type=int, default=400, help="timed calls of each contender (default 400)")
    return p.parse_args(argv)


def main(argv: Optional[Sequence[str]] = None) -> None:
    args = parse_args(argv)
    reexecuted = ensure_malloc_env()
    sys.path.insert(0, str(ROOT / "examples"))
    from gpt import make_batch, make_model

    torch.manual_seed(0)
    torch.set_num_threads(1)
    model = make_model(n_layer=args.layers, dropout=0.0).eval()
    x, _ = make_batch(2)
    rows = [
        row(f"GPT-{args.layers}, traced by torch.fx", model, x, args.rounds),
        row(f"GPT-{args.layers}, captured by torch.export", Exported(model), x, args.rounds),
    ]
    header = [
        "stage of", "ops", "model us (least / median)", "stage us", "lookups through __getattr__ us",
        "and overloads by full path us", "neither / stage",
    ]  # fmt: skip
    print_markdown(header, rows)
    for line in command_lines(reexecuted, "steady allocator"):
        print(line)


if __name__ == "__main__":
    main()
