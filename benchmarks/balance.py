"""Stage balance on CPU: fxpipe's predicted against measured stage times, and how evenly each way of cutting splits the work."""
from __future__ import annotations

import argparse
import cProfile
import collections
import copy
import itertools
import os
import random
import re
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

import torch
import torch.fx as fx
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map

from environment import command_lines, ensure_malloc_env

if TYPE_CHECKING:
    from gpt import GPT

ROOT = Path(__file__).resolve().parent.parent
IMBALANCE_TARGET = 1.10  # measured max/mean at 4 stages, balance='time', U-Net and GPT
COMPILE_TARGET_S = 2.0  # compile_pipeline of a 48-block GPT, balance='flops'
PARTITION_TARGET_S = 0.5  # best_cuts on 100,000 positions, receiving costs, 8 stages


# -- options --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Sizes:
    unet_batch: int
    unet_image: int
    resnet_batch: int
    resnet_image: int
    resnet_blocks: int  # residual blocks per resolution (3 resolutions)
    gpt_batch: int
    gpt_layers: int
    gpt_width: int
    gpt_seq: int
    big_gpt_layers: int  # for the compile-time target
    positions: int  # for the partitioner target
    gpipe_timeout: float  # seconds torchgpipe's balance_by_time profiles for
    chunks: int = 8


FULL = Sizes(unet_batch=48, unet_image=32, resnet_batch=64, resnet_image=16, resnet_blocks=2,
             gpt_batch=32, gpt_layers=8, gpt_width=64, gpt_seq=32, big_gpt_layers=48,
             positions=100_000, gpipe_timeout=1.0)  # fmt: skip
QUICK = Sizes(unet_batch=8, unet_image=16, resnet_batch=16, resnet_image=16, resnet_blocks=1,
              gpt_batch=8, gpt_layers=4, gpt_width=32, gpt_seq=16, big_gpt_layers=48,
              positions=100_000, gpipe_timeout=0.2)  # fmt: skip
STAGE_COUNTS = (2, 4)
FXPIPE_MODES = ("time", "flops", "params", "memory")


def parse_args(argv: Optional[Sequence[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repeats", type=int, default=None, help="timed runs of every stage (default 15; 3 with --quick)")
    p.add_argument("--warmup", type=int, default=None, help="untimed runs of every stage first (default 2; 1 with --quick)")
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run in under 60 s")
    p.add_argument("--diagnose", action="store_true", help="also profile U-Net and GPT repeatedly, two ways, and measure each cut")
    p.add_argument("--profiles", type=int, default=4, help="profiles per method with --diagnose (default 4)")
    p.add_argument("--compile-only", action="store_true", help="only the compile-time targets (about a minute)")
    args = p.parse_args(argv)
    args.sizes = QUICK if args.quick else FULL
    for name, full, quick in (("repeats", 15, 3), ("warmup", 2, 1)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    return args


# -- one stage alone ------------------------------------------------------------------------
def _leafy(value: Any) -> Any:
    """Fresh leaves, floating ones requiring grad, as a stage receives them in the pipeline."""
    return tree_map(lambda t: t.detach().requires_grad_(t.is_floating_point()) if isinstance(t, torch.Tensor) else t, value)


def _backward_ones(outputs: Any) -> None:
    tensors = [t for t in tree_flatten(outputs)[0] if isinstance(t, torch.Tensor) and t.requires_grad]
    if tensors:
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])


@dataclass
class Probe:
    """One stage run alone on its captured full-batch inputs: forward plus backward."""

    module: nn.Module
    inputs: list[Any]
    samples: list[float] = field(default_factory=list)

    def once(self) -> float:
        leaves = _leafy(self.inputs)
        for param in self.module.parameters():
            param.grad = None
        start = time.perf_counter()
        _backward_ones(self.module(*leaves))
        return time.perf_counter() - start

    @property
    def median(self) -> float:
        return statistics.median(self.samples) if self.samples else 0.0


def measure(probes: Sequence[Probe], warmup: int, repeats: int) -> None:
    """Warm every stage up, then time them in rounds, each in a new shuffled order, so that load
    from elsewhere on the machine falls on every contender alike."""
    for probe in probes:
        for _ in range(warmup):
            probe.once()
    order = list(probes)
    for round_index in range(repeats):
        random.Random(round_index).shuffle(order)
        for probe in order:
            probe.samples.append(probe.once())


# -- splits ---------------------------------------------------------------------------------
@dataclass
class Split:
    """A cut of one model into stages, by one method, and its stages ready to time."""

    method: str
    probes: list[Probe]
    sizes: list[int]  # nodes (fxpipe) or layers (torchgpipe) per stage
    predicted: Optional[list[float]] = None  # seconds per stage, fxpipe's plan
    compile_s: float = 0.0
    note: str = ""
    pipe: Any = None  # fxpipe's Pipeline, for its plan and profiled graph

    @property
    def measured(self) -> list[float]:
        return [probe.median for probe in self.probes]

    @property
    def imbalance(self) -> float:
        return max_over_mean(self.measured)


def max_over_mean(values: Sequence[float]) -> float:
    return max(values) / statistics.fmean(values)


def unavailable(method: str, reason: str) -> Split:
    return Split(method, [], [], note=reason)


def fxpipe_stage_inputs(pipe: Any, example: tuple[Any, ...]) -> list[list[Any]]:
    """Each stage's inputs for the full example batch: the stages run once, in order."""
    env = pipe.bind(*example)
    captured = []
    with torch.no_grad():
        for stage, shared in zip(pipe.program().stages, pipe.program().shared):
            args = [*(env[name] for name in stage.inputs), *shared]  # one device: the tensors themselves
            captured.append(args)
            env.update(zip(stage.outputs, stage.module(*args)))
    return captured


def fxpipe_split(case: Case, stages: int, balance: Union[str, list[int]], chunks: int) -> Split:
    from fxpipe import compile_pipeline

    model = copy.deepcopy(case.model)
    start = time.perf_counter()
    pipe = compile_pipeline(model, case.example, ["cpu"] * stages, chunks=chunks, balance=balance)
    compile_s = time.perf_counter() - start
    probes = [Probe(module, inputs) for module, inputs in zip(pipe.stages, fxpipe_stage_inputs(pipe, (case.example,)))]
    split = Split(
        f"fxpipe {balance}", probes, [len(s.nodes) for s in pipe.plan.stages],
        predicted=[s.time for s in pipe.plan.stages], compile_s=compile_s, pipe=pipe,
    )  # fmt: skip
    pipe.close()
    return split


def load_balance_by_time() -> tuple[Optional[Callable[..., list[int]]], str]:
    """torchgpipe's balance_by_time, or None and why not. 0.0.7 runs on torch 2.13 unshimmed."""
    try:
        import torchgpipe
        from torchgpipe.balance import balance_by_time
    except Exception as error:  # noqa: BLE001 - any import failure means "not runnable"
        return None, f"import failed: {type(error).__name__}: {error}"
    return balance_by_time, f"torchgpipe {torchgpipe.__version__}"


def torchgpipe_split(case: Case, stages: int, timeout: float) -> Split:
    """Cut the model's flattened Sequential form by torchgpipe's `balance_by_time`."""
    method = "torchgpipe balance_by_time"
    if case.sequential is None:
        return unavailable(method, f"n/a: {case.why_not}")
    balance_by_time, status = load_balance_by_time()
    if balance_by_time is None:
        return unavailable(method, f"n/a ({status})")
    sequential = copy.deepcopy(case.sequential)
    try:
        start = time.perf_counter()
        balance = balance_by_time(stages, sequential, case.example, timeout=timeout, device="cpu")
        compile_s = time.perf_counter() - start
    except Exception as error:  # noqa: BLE001 - reported in the table
        return unavailable(method, f"n/a ({type(error).__name__}: {error})")
    layers = list(sequential)
    bounds = [0, *itertools.accumulate(balance)]
    parts = [nn.Sequential(*layers[a:b]) for a, b in zip(bounds, bounds[1:])]
    inputs, x = [], case.example
    with torch.no_grad():
        for part in parts:
            inputs.append([x])
            x = part(x)
    note = "empty stage" if 0 in balance else ""
    return Split(method, [Probe(p, i) for p, i in zip(parts, inputs)], list(balance), compile_s=compile_s, note=note)


# -- the models -----------------------------------------------------------------------------
@dataclass
class Case:
    name: str
    model: nn.Module
    example: torch.Tensor
    sequential: Optional[nn.Sequential]  # the flattened form torchgpipe takes
    why_not: str = ""
    identical_blocks: bool = False  # `blocks.<i>` all do the same work
    held_to_target: bool = False  # balance='time' must reach IMBALANCE_TARGET at 4 stages


class GPTEmbedding(nn.Module):
    """The GPT's token and position embeddings, as the first layer of its Sequential form."""

    def __init__(self, gpt: GPT) -> None:
        super().__init__()
        self.tok_emb, self.pos_emb, self.drop = gpt.tok_emb, gpt.pos_emb, gpt.drop

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(idx.size(1), device=idx.device)
        return self.drop(self.tok_emb(idx) + self.pos_emb(pos))


def unet_case(s: Sizes) -> Case:
    from unet import make_batch, make_model

    torch.manual_seed(0)
    x, _ = make_batch(s.unet_batch, size=s.unet_image)
    name = f"U-Net base 8, batch {s.unet_batch}, {s.unet_image}x{s.unet_image}"
    return Case(name, make_model(), x, None, why_not="not a Sequential (skip connections)", held_to_target=True)


def resnet_case(s: Sizes) -> Case:
    from resnet import make_batch, make_model

    torch.manual_seed(0)
    model = make_model(blocks_per_stage=s.resnet_blocks)
    x, _ = make_batch(s.resnet_batch, size=s.resnet_image)
    sequential = nn.Sequential(model.stem, *model.blocks, nn.Sequential(model.pool, nn.Flatten(1), model.fc))
    name = f"ResNet {3 * s.resnet_blocks} blocks, batch {s.resnet_batch}, {s.resnet_image}x{s.resnet_image}"
    return Case(name, model, x, sequential)


def gpt_case(s: Sizes) -> Case:
    from gpt import make_batch, make_model

    torch.manual_seed(0)
    model = make_model(n_layer=s.gpt_layers, n_embd=s.gpt_width, block_size=s.gpt_seq)
    x, _ = make_batch(s.gpt_batch, seq_len=s.gpt_seq)
    sequential = nn.Sequential(GPTEmbedding(model), *model.blocks, nn.Sequential(model.ln_f, model.head))
    name = f"GPT {s.gpt_layers} blocks x {s.gpt_width}, batch {s.gpt_batch} x {s.gpt_seq} tokens"
    return Case(name, model, x, sequential, identical_blocks=True, held_to_target=True)


# -- the targets on compile and partition time ---------------------------------------------
def first_and_median(setup: Callable[[], Any], run: Callable[[Any], Any], repeats: int) -> tuple[float, float]:
    """Seconds of `run(setup())`, `setup` untimed: (first call, median of `repeats` calls after it)."""
    samples = []
    for _ in range(repeats + 1):
        prepared = setup()
        start = time.perf_counter()
        run(prepared)
        samples.append(time.perf_counter() - start)
    return samples[0], statistics.median(samples[1:])


def compile_seconds(s: Sizes, stages: int, repeats: int) -> tuple[float, float]:
    """compile_pipeline of a big GPT with balance='flops': every pass, no profiling."""
    from fxpipe import compile_pipeline
    from gpt import make_batch, make_model

    torch.manual_seed(0)
    model = make_model(n_layer=s.big_gpt_layers)
    x, _ = make_batch(s.gpt_batch)

    def run(fresh: nn.Module) -> None:
        compile_pipeline(fresh, x, ["cpu"] * stages, chunks=s.chunks, balance="flops").close()

    return first_and_median(lambda: copy.deepcopy(model), run, repeats)


FRESH_COMPILE = """
import sys, time
import torch
sys.path[:0] = [{examples!r}, {root!r}]
torch.set_num_threads(1)
from gpt import make_batch, make_model
from fxpipe import compile_pipeline
torch.manual_seed(0)
model, (x, _) = make_model(n_layer={layers}), make_batch({batch})
start = time.perf_counter()
compile_pipeline(model, x, ["cpu"] * {stages}, chunks={chunks}, balance="flops").close()
print(time.perf_counter() - start)
"""


def compile_calls(s: Sizes, stages: int) -> int:
    """Python function calls in one compile_pipeline of the big GPT, as cProfile counts them: the
    compiler's work in a figure the machine's load does not move, to compare versions by."""
    from fxpipe import compile_pipeline
    from gpt import make_batch, make_model

    torch.manual_seed(0)
    model, (x, _) = make_model(n_layer=s.big_gpt_layers), make_batch(s.gpt_batch)
    compile_pipeline(copy.deepcopy(model), x, ["cpu"] * stages, chunks=s.chunks, balance="flops").close()  # imports, caches
    profile = cProfile.Profile()
    profile.runcall(lambda: compile_pipeline(model, x, ["cpu"] * stages, chunks=s.chunks, balance="flops").close())
    return sum(entry.callcount for entry in profile.getstats())


def fresh_compile_seconds(s: Sizes, stages: int, repeats: int) -> float:
    """Median over new Python processes of their first compile_pipeline (after the imports): what
    a script pays once, one-off lazy imports inside torch included."""
    code = FRESH_COMPILE.format(examples=str(ROOT / "examples"), root=str(ROOT), layers=s.big_gpt_layers,
                                batch=s.gpt_batch, stages=stages, chunks=s.chunks)  # fmt: skip
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True) for _ in range(repeats)]
    return statistics.median(float(run.stdout.split()[-1]) for run in runs)


def random_cut_model(positions: int, seed: int = 0) -> Any:
    """A chain of `positions` nodes of random time, each sending its output to the next, one in
    twenty also to a random later one (a skip); receiving is charged at a finite bandwidth."""
    from fxpipe.passes.objective import CrossingValue, CutModel

    rng = random.Random(seed)
    values = []
    for i in range(positions):
        consumers = [i + 1] if i + 1 < positions else [positions]
        if rng.random() < 0.05:
            consumers.append(min(positions, i + rng.randint(2, 2000)))
        values.append(CrossingValue(i, sorted(set(consumers)), rng.randint(1_000, 1_000_000)))
    return CutModel(
        times=[rng.uniform(1e-5, 1e-3) for _ in range(positions)],
        params=[float(rng.randint(0, 1_000_000)) for _ in range(positions)],
        activations=[float(rng.randint(1_000, 1_000_000)) for _ in range(positions)],
        values=values, bandwidth=1e9, chunks=8, checkpointed=7, param_scale=4.0,
    )  # fmt: skip


def partition_seconds(positions: int, stages: int, repeats: int) -> tuple[float, float, str]:
    """best_cuts alone, on a fresh model every time (its caches start empty)."""
    from fxpipe.passes.partition import best_cuts

    cuts: list[int] = []

    def run(model: Any) -> None:
        cuts[:] = best_cuts(model, stages)

    first, median = first_and_median(lambda: random_cut_model(positions), run, repeats)
    times = random_cut_model(positions).stage_times(cuts)
    return first, median, f"predicted stage max/mean {max_over_mean(times):.3f}"


# -- diagnosis: how repeatable balance='time' is -----------------------------------------------
COMPUTE_OPS = ("call_module", "call_function", "call_method")


class NodeCalls(fx.Interpreter):
    """Runs a graph once, keeping every compute node's arguments."""

    def __init__(self, gm: fx.GraphModule) -> None:
        super().__init__(gm)
        self.calls: dict[str, tuple[Any, Any]] = {}

    def run_node(self, n: fx.Node) -> Any:
        if n.op in COMPUTE_OPS:
            self.calls[n.name] = self.fetch_args_kwargs_from_env(n)
        return super().run_node(n)


def time_node(interp: NodeCalls, node: fx.Node) -> float:
    """One forward plus backward of a node with ones, timed the way fxpipe's profile_times does."""
    args, kwargs = interp.calls[node.name]
    start = time.perf_counter()
    with torch.enable_grad():
        _backward_ones(getattr(interp, node.op)(node.target, _leafy(args), _leafy(kwargs)))
    return time.perf_counter() - start


def interleaved_profile(gm: fx.GraphModule, example: tuple[Any, ...], warmup: int = 2, rounds: int = 5) -> dict[str, float]:
    """Median seconds per node, with the nodes timed in rounds, in a new shuffled order each round,
    so that a drift in the machine's load falls on every node alike. fxpipe's profile_times runs
    each node's warm-up and repeats back to back (the same 2 + 5 runs per node)."""
    interp = NodeCalls(gm)
    with torch.no_grad():
        interp.run(*example)
    nodes = [node for node in gm.graph.nodes if node.name in interp.calls]
    samples: dict[str, list[float]] = {node.name: [] for node in nodes}
    for round_index in range(warmup + rounds):
        random.Random(round_index).shuffle(nodes)
        for node in nodes:
            seconds = time_node(interp, node)
            if round_index >= warmup:
                samples[node.name].append(seconds)
    return {name: statistics.median(values) for name, values in samples.items()}


def back_to_back_profile(gm: fx.GraphModule, example: tuple[Any, ...]) -> dict[str, float]:
    from fxpipe.passes.costs import profile_times

    profile_times(gm, example, torch.device("cpu"))
    return {node.name: float(node.meta["time"]) for node in gm.graph.nodes if "time" in node.meta}


def block_spread(gm: fx.GraphModule, profile: dict[str, float]) -> Optional[float]:
    """max/min over the model's `blocks.<i>` of their profiled time (identical blocks in the GPT)."""
    sums: dict[int, float] = collections.defaultdict(float)
    for node in gm.graph.nodes:
        match = re.search(r"blocks\.(\d+)", str(node.meta.get("scope", "")))
        if match and node.name in profile:
            sums[int(match.group(1))] += profile[node.name]
    return max(sums.values()) / min(sums.values()) if len(sums) > 1 else None


def node_spread(profiles: Sequence[dict[str, float]]) -> float:
    """Median over nodes of the coefficient of variation of a node's time across profiles (nodes
    timed at zero in every profile left out)."""
    spreads = [statistics.pstdev(times) / statistics.fmean(times) for name in profiles[0] if statistics.fmean(times := [p[name] for p in profiles]) > 0]
    return statistics.median(spreads) if spreads else 0.0


def counts_of(cuts: Sequence[int], length: int) -> tuple[int, ...]:
    bounds = [0, *cuts, length]
    return tuple(b - a for a, b in zip(bounds, bounds[1:]))


def diagnose(case: Case, stages: int, args: argparse.Namespace) -> list[list[str]]:
    """Profile one graph several times by each method, cut by each profile as balance='time'
    does (min-max of the node times: receiving is free between CPU stages), and measure every cut."""
    from fxpipe.passes.partition import min_max_cuts

    base = fxpipe_split(case, stages, "time", args.sizes.chunks)
    gm = base.pipe.program().graph
    order = [name for stage in base.pipe.plan.stages for name in stage.nodes]
    example = tuple(base.pipe.bind(case.example).values())
    methods = {"back to back (fxpipe's profile_times)": back_to_back_profile, "interleaved rounds": interleaved_profile}
    profiles: dict[str, list[dict[str, float]]] = {kind: [] for kind in methods}
    seconds: dict[str, list[float]] = {kind: [] for kind in methods}
    for _ in range(args.profiles):
        for kind, profile in methods.items():
            start = time.perf_counter()
            profiles[kind].append(profile(gm, example))
            seconds[kind].append(time.perf_counter() - start)
    cuts = {kind: [counts_of(min_max_cuts([p[n] for n in order], stages), len(order)) for p in found] for kind, found in profiles.items()}
    splits = {counts: fxpipe_split(case, stages, list(counts), args.sizes.chunks) for found in cuts.values() for counts in found}
    measure([probe for split in splits.values() for probe in split.probes], args.warmup, args.repeats)
    rows = []
    for kind, found in profiles.items():
        spreads = [block_spread(gm, p) for p in found]
        rows.append([
            case.name, str(stages), kind, f"{statistics.fmean(seconds[kind]):.2f}", f"{node_spread(found):.3f}",
            " / ".join(f"{x:.2f}" for x in spreads if x is not None) or "n/a",
            "; ".join("/".join(map(str, counts)) for counts in cuts[kind]),
            " / ".join(f"{splits[counts].imbalance:.3f}" for counts in cuts[kind]),
        ])  # fmt: skip
    return rows


def diagnosis_table(rows: Sequence[Sequence[str]], args: argparse.Namespace) -> None:
    print(f"## 5. Diagnosis: the same graph profiled {args.profiles} times by each method, cut by each profile, every cut measured\n")
    header = ["model", "stages", "per-node profiler", "s per profile", "median node CV across profiles",
              "identical blocks' profiled max/min, per profile", "cut chosen by each profile (nodes per stage)",
              "measured max/mean of each cut"]  # fmt: skip
    print_table(header, rows)


# -- tables ---------------------------------------------------------------------------------
def print_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    for line in [header, ["---"] * len(header), *rows]:
        print("| " + " | ".join(line) + " |")
    print()


def ms(values: Sequence[float]) -> str:
    return " / ".join(f"{v * 1e3:.1f}" for v in values)


def ratios(measured: Sequence[float], predicted: Sequence[float]) -> str:
    return " / ".join(f"{m / p:.2f}" if p > 0 else "-" for m, p in zip(measured, predicted))


def imbalance_target(case: Case, stages: int) -> Optional[float]:
    return IMBALANCE_TARGET if stages == 4 and case.held_to_target else None


def pass_fail(ok: bool) -> str:
    return "pass" if ok else "**fail**"


def largest_node(split: Split) -> str:
    """The node with the most profiled time, against the mean predicted stage: how coarse the grain is."""
    nodes = [n for n in split.pipe.program().graph.graph.nodes if "time" in n.meta]
    node = max(nodes, key=lambda n: n.meta["time"])
    share = node.meta["time"] / statistics.fmean(split.predicted or [1.0])
    return f"{node.name} {node.meta['time'] * 1e3:.1f} ms ({share:.0%} of a mean stage)"


def time_table(results: Sequence[tuple[Case, int, dict[str, Split]]]) -> None:
    print("## 1. fxpipe balance='time': predicted against measured stage times\n")
    header = ["model", "stages", "nodes per stage", "predicted ms per stage", "measured ms per stage",
              "measured / predicted", "largest node", "predicted max/mean", "measured max/mean", "target", "pass"]  # fmt: skip
    rows = []
    for case, stages, splits in results:
        split = splits["fxpipe time"]
        assert split.predicted is not None
        target = imbalance_target(case, stages)
        rows.append([
            case.name, str(stages), " / ".join(map(str, split.sizes)), ms(split.predicted), ms(split.measured),
            ratios(split.measured, split.predicted), largest_node(split), f"{max_over_mean(split.predicted):.3f}", f"{split.imbalance:.3f}",
            f"<= {target:.2f}" if target else "", pass_fail(split.imbalance <= target) if target else "",
        ])  # fmt: skip
    print_table(header, rows)
    for case, stages, splits in results:
        split = splits["fxpipe time"]
        if case.identical_blocks:
            profile = {n.name: n.meta["time"] for n in split.pipe.program().graph.graph.nodes if "time" in n.meta}
            print(f"Profile repeatability, {case.name}, {stages} stages: its identical blocks were profiled "
                  f"max/min = {block_spread(split.pipe.program().graph, profile):.2f} apart.  ")
    print()


def imbalance_table(results: Sequence[tuple[Case, int, dict[str, Split]]]) -> None:
    print("## 2. Measured imbalance (max/mean of measured stage times) by how the cut was chosen\n")
    methods = [f"fxpipe {mode}" for mode in FXPIPE_MODES] + ["torchgpipe balance_by_time"]
    header = ["model", "stages", *(m.replace("fxpipe memory", "fxpipe memory (default)") for m in methods)]
    rows = []
    for case, stages, splits in results:
        cells = []
        for method in methods:
            split = splits[method]
            cells.append(split.note if not split.probes else f"{split.imbalance:.3f}" + (f" ({split.note})" if split.note else ""))
        rows.append([case.name, str(stages), *cells])
    print_table(header, rows)


def detail_table(results: Sequence[tuple[Case, int, dict[str, Split]]]) -> None:
    print("## 3. Every cut: nodes (fxpipe) or layers (torchgpipe) and measured ms per stage\n")
    header = ["model", "stages", "method", "nodes or layers per stage", "measured ms per stage", "max/mean", "s to compile (fxpipe) or balance (torchgpipe)"]
    rows = []
    for case, stages, splits in results:
        for split in splits.values():
            if split.probes:
                rows.append([case.name, str(stages), split.method, " / ".join(map(str, split.sizes)),
                             ms(split.measured), f"{split.imbalance:.3f}", f"{split.compile_s:.2f}"])  # fmt: skip
    print_table(header, rows)


def compile_rows(args: argparse.Namespace) -> list[list[str]]:
    """The compile-time targets: a 48-block GPT in a process that compiled before, and fresh."""
    s: Sizes = args.sizes
    rows = []
    big_gpt = f"compile_pipeline, GPT {s.big_gpt_layers} blocks x 64, batch {s.gpt_batch} x 16"
    for stages in (4, 8):
        first, median = compile_seconds(s, stages, repeats=3)
        rows.append([
            f"{big_gpt}, {stages} stages, balance='flops', in a process that compiled before (its first call here {first:.2f} s)",
            f"{median:.2f} s", f"<= {COMPILE_TARGET_S:.1f} s", pass_fail(median <= COMPILE_TARGET_S),
        ])  # fmt: skip
    fresh = fresh_compile_seconds(s, 4, repeats=1 if args.quick else 3)
    rows.append([
        f"{big_gpt}, 4 stages, balance='flops', the first compile in a new process (after imports)",
        f"{fresh:.2f} s", f"<= {COMPILE_TARGET_S:.1f} s", pass_fail(fresh <= COMPILE_TARGET_S),
    ])  # fmt: skip
    calls = compile_calls(s, 4)
    rows.append([f"{big_gpt}, 4 stages: Python calls in one compile (cProfile's count; the load does not move it)", f"{calls / 1e6:.2f} M", "", ""])
    return rows


def targets_table(results: Sequence[tuple[Case, int, dict[str, Split]]], args: argparse.Namespace) -> None:
    print("## 4. Targets\n")
    s: Sizes = args.sizes
    rows = []
    for case, stages, splits in results:
        target = imbalance_target(case, stages)
        if target:
            value = splits["fxpipe time"].imbalance
            rows.append([f"measured max/mean, {case.name}, {stages} stages, balance='time'", f"{value:.3f}", f"<= {target:.2f}", pass_fail(value <= target)])
    rows += compile_rows(args)
    first, median, quality = partition_seconds(s.positions, 8, repeats=3)
    rows.append([
        f"best_cuts, CutModel of {s.positions:,} random positions with skips, bandwidth 1e9, 8 stages "
        f"(first call {first:.2f} s; {quality})", f"{median:.2f} s", f"<= {PARTITION_TARGET_S:.1f} s", pass_fail(median <= PARTITION_TARGET_S),
    ])  # fmt: skip
    print_table(["target", "measured (median)", "limit", "pass"], rows)


# -- main -----------------------------------------------------------------------------------
def print_settings(args: argparse.Namespace, reexecuted: bool) -> None:
    print("# fxpipe stage balance on CPU\n")
    for line in command_lines(reexecuted, "glibc reads them at start-up"):
        print(f"{line}  ")
    s: Sizes = args.sizes
    print(
        f"settings: quick={args.quick}, warm-up runs per stage={args.warmup}, timed runs per stage={args.repeats}, "
        f"stages {' and '.join(map(str, STAGE_COUNTS))}, chunks {s.chunks}, checkpoint 'except_last', devices 'cpu' x stages; "
        f"torchgpipe balance_by_time timeout {s.gpipe_timeout} s  "
    )
    print(
        f"torch {torch.__version__}, torch threads={torch.get_num_threads()}, cores={os.cpu_count()}, "
        f"load average at start={os.getloadavg()[0]:.2f}  "
    )
    print(
        "method: every cut's stages are captured once on the full example batch (the stages run in order), then "
        "each stage alone is timed: forward plus torch.autograd.backward of its outputs with ones, inputs as fresh "
        "leaves; all stages of all cuts of one model run in rounds, in a new random order each round; median per stage. "
        "Imbalance = max/mean of a cut's measured stage times. Predicted = plan.stages[k].time (balance='time': "
        "the sum of the per-node forward+backward times profiled at compile).\n"
    )


def run_model(case: Case, args: argparse.Namespace) -> list[tuple[Case, int, dict[str, Split]]]:
    s: Sizes = args.sizes
    results = []
    for stages in STAGE_COUNTS:
        splits = {f"fxpipe {mode}": fxpipe_split(case, stages, mode, s.chunks) for mode in FXPIPE_MODES}
        gpipe = torchgpipe_split(case, stages, s.gpipe_timeout)
        splits[gpipe.method] = gpipe
        results.append((case, stages, splits))
    probes = [probe for _, _, splits in results for split in splits.values() for probe in split.probes]
    measure(probes, args.warmup, args.repeats)
    print(f"<!-- measured {case.name} at {time.strftime('%H:%M:%S')}, load average {os.getloadavg()[0]:.2f} -->", flush=True)
    return results


def main(argv: Optional[Sequence[str]] = None) -> None:
    reexecuted = ensure_malloc_env()
    args = parse_args(argv)
    torch.set_num_threads(1)
    sys.path.insert(0, str(ROOT / "examples"))
    print_settings(args, reexecuted)
    if args.compile_only:
        print_table(["target", "measured (median)", "limit", "pass"], compile_rows(args))
        return
    results = []
    for make_case in (unet_case, resnet_case, gpt_case):
        results += run_model(make_case(args.sizes), args)
    print()
    time_table(results)
    imbalance_table(results)
    detail_table(results)
    targets_table(results, args)
    if args.diagnose:
        diagnosis_table([row for make_case in (unet_case, gpt_case) for row in diagnose(make_case(args.sizes), 4, args)], args)
    print(f"load average at end={os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
