"""What each rank runs in the multi-process tests: pipelines on a "pp" DeviceMesh, checked on
the rank against the plain model (float64), each rank checking the parameters it holds."""
from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import math
import random
import time
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from helpers import Counts, FanOut, PaddedLM, RenormTied, TiedEnds, TiedUnderReentrant, WindowBlock, WithPositions, example_module, grad_of, padded_labels
from dag_models import OPTIMIZERS, Op, Spec, delayed_loop, make_model, mean_loss_of
from fxpipe import StageError, compile_pipeline

Made = tuple[nn.Module, list[tuple[Any, Any]], Callable[[Any, Any], torch.Tensor]]


def _example(name: str, batches: list[dict[str, int]], **sizes: Any) -> Made:
    m = example_module(name)
    pairs = [m.make_batch(seed=k, **b) if name == "gpt" else m.make_batch(seed=k, dtype=torch.float64, **b) for k, b in enumerate(batches)]
    return m.make_model(**sizes).double(), pairs, m.loss_fn


def _fan_out() -> Made:
    g = torch.Generator().manual_seed(1)
    pairs = [(torch.randn(n, 6, dtype=torch.float64, generator=g), torch.randn(n, 6, dtype=torch.float64, generator=g)) for n in (6, 9)]
    return FanOut().double(), pairs, F.mse_loss


def _random_dag(seed: int) -> Made:
    """A random graph of tanh(Linear) ops, tied weights, views and in-place writes; every value
    picks one or two earlier ones, so values skip stages and feed several."""
    rng = random.Random(seed)
    n = rng.randint(5, 8)
    kinds = ["linear", "linear", "tied", "views", "inplace", "function"]
    ops = [Op(rng.choice(kinds), tuple(sorted({rng.randint(0, i), rng.randint(0, i)})), rng.randint(0, 5)) for i in range(n)]
    ops[0].kind = ops[-1].kind = "tied"  # the first and last stage share a weight
    spec = Spec(rng.choice([4, 6]), ops, (rng.randint(1, n),) if rng.random() < 0.5 else ())
    g = torch.Generator().manual_seed(seed)
    pairs = [(torch.randn(b, spec.width, dtype=torch.float64, generator=g), None) for b in (6, 7)]
    return make_model(spec, 0.0, seed, torch.float64), pairs, lambda out, _: mean_loss_of(out)


def _branches() -> Made:
    """Three feature towers side by side, then residual blocks (examples/branches.py)."""
    kind = example_module("branches").CandleUno
    g = torch.Generator().manual_seed(3)
    pairs = [(kind.example(n, torch.float64), torch.randn(n, 1, dtype=torch.float64, generator=g)) for n in (6, 9)]
    return kind(dropout=0.0).double(), pairs, F.mse_loss


MODELS: dict[str, Callable[[], Made]] = {
    "unet": lambda: _example("unet", [dict(batch_size=6, size=16), dict(batch_size=9, size=16)], base=4),
    "gpt": lambda: _example("gpt", [dict(batch_size=6), dict(batch_size=9, seq_len=12)], n_layer=3, n_embd=16),
    "fan_out": _fan_out,
    "dag_1": lambda: _random_dag(1),
    "dag_2": lambda: _random_dag(2),
    "branches": _branches,
}
STAGE_DAGS = ("branches",)  # compiled with stage_graph='dag'



def _max_diff(a: Any, b: Any) -> float:
    return float((a.detach().cpu() - b.detach().cpu()).abs().max()) if a.numel() else 0.0


def train_cases(rank: int, world: int, cases: list[tuple[str, ...]]) -> list[dict[str, Any]]:
    """For each (model, schedule, checkpoint mode[, "posted when read" or "compiled"]): two train
    steps of different batch sizes (and sequence lengths), gradients accumulated; the loss of
    each, the forward-only output, and the gradient of each parameter this rank holds, against
    the plain model's. "posted when read": each receive is posted only when its message is read,
    as on NCCL; "compiled": each rank's stages under torch.compile (AOTAutograd, eager kernels)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    report = []
    for name, schedule, mode, *posting in cases:
        torch.manual_seed(0)
        model, batches, loss_fn = MODELS[name]()
        reference = copy.deepcopy(model)
        extra: dict[str, Any] = dict(stages_per_device=2) if schedule == "interleaved-1f1b" else {}
        if posting == ["compiled"]:
            extra["compile_stages"] = {"backend": "aot_eager"}
        if name in STAGE_DAGS:
            extra["stage_graph"] = "dag"
        pipe = compile_pipeline(model, batches[0][0], mesh=mesh, chunks=world, checkpoint=mode, schedule=schedule, timeout=60, **extra)
        if posting == ["posted when read"]:
            assert pipe._channel is not None
            pipe._channel.early = False  # the NCCL path's posting, on gloo
        losses, expected = [], []
        for x, y in batches:
            args = x if isinstance(x, tuple) else (x,)  # a model of several inputs takes a tuple
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", "stage .* was compiled again")  # compiled: the second batch's shapes
                losses.append(float(pipe.train_step(*args, target=y, loss_fn=loss_fn)))
            loss = loss_fn(reference(*args), y)
            loss.backward()
            expected.append(loss.item())
        ref = dict(reference.named_parameters())
        grads = {n: _max_diff(p.grad, ref[n].grad) for n, p in pipe.named_parameters() if p.grad is not None}
        first = batches[0][0] if isinstance(batches[0][0], tuple) else (batches[0][0],)
        with torch.no_grad():
            out = pipe(*first)
            out_error = None if out is None else max(_max_diff(a, b) for a, b in zip(_tensors(out), _tensors(reference(*first))))
        report.append(dict(
            case=(name, schedule, mode, *posting), losses=losses, expected=expected, grads=grads,
            names=sorted(n for n, p in ref.items() if p.grad is not None), all_state_keys=sorted(reference.state_dict()),
            missing=[n for n, p in pipe.named_parameters() if p.grad is None and ref[n].grad is not None],
            out_error=out_error, state_keys=sorted(pipe.state_dict()), depth=pipe.plan.depth, stages=len(pipe.plan.stages),
        ))  # fmt: skip
    return report


def _tensors(out: Any) -> list[torch.Tensor]:
    if isinstance(out, dict):
        return list(out.values())
    return list(out) if isinstance(out, (tuple, list)) else [out]


class FailsAt(nn.Module):
    """Raises in forward on the micro-batch whose first row is marked (on the stage it is cut into)."""

    calls: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        h = torch.tanh(self.a(x))
        h = torch.tanh(self.b(h))
        h = _check(h, x)
        return self.c(h)


@torch.fx.wrap
def _check(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if bool((x[:, 0] == 99).any()):
        raise ValueError("marked row reached the check")
    if bool((x[:, 0] == 77).any()):
        raise KeyboardInterrupt  # as Ctrl-C would
    return h


def failing_step(rank: int, world: int, schedule: str) -> dict[str, Any]:
    """A stage raises on micro-batch 2: every rank raises the same StageError, in bounded time,
    the gradient of a temperature the loss reads (outside every stage) is put back as it was
    before the step; and the next step runs."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = FailsAt().double()
    reference = copy.deepcopy(model)
    x, zeros = torch.randn(8, 4, dtype=torch.float64), torch.zeros(8, 4, dtype=torch.float64)
    temperature = nn.Parameter(torch.tensor(2.0, dtype=torch.float64))

    def loss_fn(out: torch.Tensor, target: torch.Tensor, reduction: str = "mean") -> torch.Tensor:
        return F.mse_loss(out / temperature, target, reduction=reduction)

    pipe = compile_pipeline(model, x, mesh=mesh, chunks=4, schedule=schedule, timeout=20, split_points=["c"] if world == 2 else None)
    pipe.train_step(x, target=zeros, loss_fn=loss_fn)
    held = None if temperature.grad is None else temperature.grad.clone()
    bad = x.clone()
    bad[4, 0] = 99  # micro-batch 2 of 4
    calls = model.calls.clone()
    start = time.monotonic()
    try:
        pipe.train_step(bad, target=zeros, loss_fn=loss_fn)
        error = None
    except StageError as e:
        error = (str(e), e.stage, e.micro_batch, e.phase, e.rank)
    took = time.monotonic() - start
    put_back = (held is None and temperature.grad is None) or (held is not None and temperature.grad is not None and torch.equal(held, temperature.grad))
    put_back = put_back and (model.calls.is_meta or torch.equal(model.calls, calls))  # the counter, where held
    ok_loss = float(pipe.train_step(x, target=zeros, loss_fn=loss_fn))
    expected = F.mse_loss(reference(x) / 2, zeros).item()
    bad[4, 0] = 77  # a Ctrl-C in the same place: bare where it struck, named with its place elsewhere
    try:
        pipe.train_step(bad, target=zeros, loss_fn=loss_fn)
        interrupted = "no error"
    except BaseException as e:  # noqa: BLE001 - what the test inspects
        interrupted = f"{type(e).__name__}: {e}"

    def interrupting(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        raise KeyboardInterrupt

    try:  # in the loss: the others say so (before, "in forward")
        pipe.train_step(x, target=zeros, loss_fn=interrupting)
        in_loss = "no error"
    except BaseException as e:  # noqa: BLE001 - what the test inspects
        in_loss = f"{type(e).__name__}: {e}"
    return dict(error=error, took=took, next_loss=ok_loss, expected=expected, put_back=put_back, held=held is not None, interrupted=interrupted, in_loss=in_loss)


class _CountsThenFails(nn.Module):
    """A counter and BatchNorm's statistics written on the first stage; the check on the last."""

    calls: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.bn = nn.Linear(4, 4), nn.Linear(4, 4), nn.BatchNorm1d(4)
        self.register_buffer("calls", torch.zeros((), dtype=torch.int64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls.add_(1)
        return _check(self.b(self.bn(torch.tanh(self.a(x)))), x)


def failing_forward(rank: int, world: int) -> dict[str, Any]:
    """pipe(x) under no_grad whose last stage raises once the first stage's rank is done: what
    the first stage wrote (a counter, BatchNorm's running statistics) is put back there too."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = _CountsThenFails().double()
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, mesh=mesh, chunks=4, split_points=["b"], timeout=20)
    mean = model.bn.running_mean
    assert mean is not None
    held = None if model.calls.is_meta else (model.calls.clone(), mean.clone())
    bad = x.clone()
    bad[6, 0] = 99  # the last micro-batch: the first stage ran every one
    try:
        with torch.no_grad():
            pipe(bad)
        error = "no error"
    except StageError as e:
        error = str(e)
    put_back = held is None or (torch.equal(held[0], model.calls) and torch.equal(held[1], mean))
    return dict(error=error, put_back=put_back, holds=held is not None)


def dying_rank(rank: int, world: int) -> dict[str, Any]:
    """The last rank exits in the middle of a step: the others raise, naming it."""
    import os
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = FanOut().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, mesh=mesh, chunks=4, schedule="1f1b", timeout=20)
    pipe.train_step(x, target=torch.zeros_like(x), loss_fn=F.mse_loss)
    dist.barrier()
    if rank == world - 1:
        os._exit(3)
    start = time.monotonic()
    try:
        pipe.train_step(x, target=torch.zeros_like(x), loss_fn=F.mse_loss)
        return dict(error=None, took=time.monotonic() - start)
    except Exception as e:  # noqa: BLE001 - what the test inspects
        return dict(error=f"{type(e).__name__}: {e}", took=time.monotonic() - start)


def never_compiles(rank: int, world: int, dies: bool) -> dict[str, Any]:
    """The last rank never calls compile_pipeline: it exits (`dies`), or stays alive past the
    others' timeout and then exits. The others raise, within their timeout, saying why."""
    import os
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    if rank == world - 1:
        if not dies:
            time.sleep(6)
        os._exit(0)
    start = time.monotonic()
    try:
        compile_pipeline(FanOut().double(), torch.randn(8, 6, dtype=torch.float64), mesh=mesh, chunks=2, timeout=3)
        return dict(error=None, took=time.monotonic() - start)
    except Exception as e:  # noqa: BLE001 - what the test inspects
        return dict(error=f"{type(e).__name__}: {e}", took=time.monotonic() - start)


def unfillable_across(rank: int, world: int) -> str:
    """A model built on the meta device whose last stage reads a buffer no checkpoint holds:
    every rank refuses it, naming the rank."""
    from helpers import Positions

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    with torch.device("meta"):
        model = nn.Sequential(nn.Linear(6, 6), nn.Linear(6, 6), Positions(), nn.Linear(6, 6)).double()
    try:
        compile_pipeline(model, torch.randn(4, 6, dtype=torch.float64), mesh=mesh, chunks=2, split_points=["2"], timeout=30)
    except ValueError as e:
        return str(e)
    return "compiled"


def mismatched_plans(rank: int, world: int) -> list[str]:
    """Ranks that compile different models (cut elsewhere; a layer wider on one rank; other
    settings of the same layers): every rank raises, naming what differs."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    x = torch.randn(8, 6, dtype=torch.float64)
    width = 8 if rank == 1 else 6
    wider = nn.Sequential(nn.Linear(6, width), nn.Tanh(), nn.Linear(width, 6)).double()
    # the same nodes and parameters, other settings: LayerNorm's eps, GELU's approximate=
    settings = nn.Sequential(nn.Linear(6, 6), nn.LayerNorm(6, eps=0.5 if rank else 1e-5), nn.GELU("tanh" if rank else "none"), nn.Linear(6, 6)).double()
    found = []
    for model, splits in [(FanOut().double(), ["layers.2"] if rank == 0 else ["layers.4"]), (wider, ["2"]), (settings, ["2"])]:
        try:
            compile_pipeline(model, x, mesh=mesh, chunks=2, split_points=splits)
            found.append("no error")
        except RuntimeError as e:
            found.append(str(e))
    return found


def refusals(rank: int, world: int) -> list[str]:
    """What one process group cannot do yet is refused on every rank, before anything is sent."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = FanOut().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, mesh=mesh, chunks=2)
    errors = [_said(lambda: pipe(x)), _said(lambda: pipe.train_step(x.requires_grad_(), target=x.detach(), loss_fn=F.mse_loss))]
    x = x.detach()
    loss = pipe.train_step(x, target=x, loss_fn=F.mse_loss)  # and the pipeline still runs
    errors.append(f"loss {loss.item():.6f}")
    totals = compile_pipeline(_WithTotal().double(), x, mesh=mesh, chunks=2, timeout=60)
    errors.append(_said(lambda: totals(x), ValueError, under=torch.no_grad()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bare = compile_pipeline(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Tanh()).double(), x, mesh=mesh, chunks=2, split_points=["2"])
    errors.append(" | ".join(str(w.message) for w in caught if "none of the model's parameters" in str(w.message)))
    errors.append(f"{len(list(bare.parameters()))} parameters")
    errors.append(_said(lambda: compile_pipeline(_CentresItsInput().double(), x.clone(), mesh=mesh, chunks=2), ValueError))
    errors.append(_said(lambda: compile_pipeline(TiedUnderReentrant().double(), torch.randint(0, 16, (4, 5)), mesh=mesh, chunks=2, split_points=["mid"]), ValueError))
    # a bad timeout listed with the others, on every rank, before anything is sent
    errors.append(_said(lambda: compile_pipeline(FanOut().double(), x, mesh=mesh, chunks=0, checkpoint="sometimes", timeout=0), ValueError))
    import numpy  # (a test dependency)

    errors.append(f"{compile_pipeline(FanOut().double(), x, mesh=mesh, chunks=numpy.int64(2), timeout=numpy.int64(60)).chunks} chunks")  # type: ignore[arg-type]
    handle = model.register_forward_hook(lambda module, args, out: out * 2)  # the model's own: output on one rank alone
    errors.append(_said(lambda: pipe(x), RuntimeError, under=torch.no_grad()))
    handle.remove()
    with torch.no_grad():
        out = pipe(x)
    errors.append("ran" if (out is None) == (rank == 0) else "ran wrong")
    logger = model.register_forward_pre_hook(lambda module, args: None) if rank == 1 else None  # on one rank alone
    errors.append(_said(lambda: pipe.train_step(x, target=x, loss_fn=F.mse_loss), RuntimeError))
    if logger is not None:
        logger.remove()
    errors.append(f"loss {pipe.train_step(x, target=x, loss_fn=F.mse_loss).item():.6f}")
    y = x.clone()

    def smoothing(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out, t.mul_(0.9))  # the target written in place: the loss's rank alone would see it

    errors.append(_said(lambda: pipe.train_step(x, target=y, loss_fn=smoothing)))
    errors.append("target as given" if torch.equal(y, x) else "target written")
    return errors


def _said(attempt: Callable[[], Any], *refused: type[Exception], under: Any = None) -> str:
    """The message of the error `attempt` raises (of the kinds `refused`: RuntimeError and
    ValueError by default), or "no error"."""
    try:
        with under if under is not None else contextlib.nullcontext():
            attempt()
        return "no error"
    except refused or (RuntimeError, ValueError) as e:
        return str(e)


class _CentresItsInput(nn.Module):
    """Writes its input in place: a target that is the input would be read unwritten on the loss rank."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.sub_(x.mean(dim=1, keepdim=True))
        return self.b(torch.tanh(self.a(x)))


class _WithTotal(nn.Module):
    """Returns a sum over the whole batch besides its output."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.b(torch.tanh(self.a(x)))
        return h, h.sum()


def clipped(rank: int, world: int) -> list[dict[str, Any]]:
    """pipe.clip_grad_norm_ by the norm of every rank's gradients, a tied weight counted once:
    the plain model's norm on every rank, and after an SGD step the plain model's parameters
    (tied copies alike on both ranks)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    report = []
    for norm_type in (2.0, float("inf")):
        torch.manual_seed(0)
        model, batches, loss_fn = MODELS["gpt"]()  # its head is tied to the embedding: one copy per rank
        reference = copy.deepcopy(model)
        pipe = compile_pipeline(model, batches[0][0], mesh=mesh, chunks=2, schedule="1f1b", timeout=60)
        opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)
        norms = []
        for x, y in batches:
            opt.zero_grad(), ref_opt.zero_grad()
            pipe.train_step(x, target=y, loss_fn=loss_fn)
            loss_fn(reference(x), y).backward()
            got = pipe.clip_grad_norm_(0.1, norm_type)
            expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1, norm_type)
            norms.append((float(got), float(expected)))
            opt.step(), ref_opt.step()
        ref = dict(reference.named_parameters())
        params = {n: _max_diff(p, ref[n]) for n, p in pipe.named_parameters()}
        tied = pipe.get_parameter("head.weight") if "head.weight" in dict(pipe.named_parameters()) else pipe.get_parameter("tok_emb.weight")
        report.append(dict(norm_type=norm_type, norms=norms, params=params, tied=tied.detach().tolist()))
    return report


def clipped_by_any_norm(rank: int, world: int) -> list[dict[str, Any]]:
    """pipe.clip_grad_norm_ of every order torch takes (0 counts the gradients that are not all
    zero, -inf is the smallest entry), and a NaN on the second rank alone, against the plain
    model's: the norm, the error of error_if_nonfinite=True, and the gradients clipped."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    reference = copy.deepcopy(model)  # (compiling frees on each rank the parameters the other holds)
    pipe = compile_pipeline(model, x, mesh=mesh, chunks=2, split_points=["2"], timeout=60)
    report = []
    for norm_type, nan, strict in [(0.0, False, False), (-math.inf, False, False), (-2.0, False, False), (0.5, False, False),
                                   (math.inf, True, False), (math.inf, True, True), (2.0, True, True)]:  # fmt: skip
        found: dict[str, Any] = dict(norm_type=norm_type, nan=nan, strict=strict)
        for key, module in (("pipe", pipe), ("plain", reference)):
            module.zero_grad()
            F.mse_loss(reference(x), y).backward() if key == "plain" else pipe.train_step(x, target=y, loss_fn=F.mse_loss)
            if nan and (key == "plain" or rank == 1):
                module.get_parameter("4.weight").grad[0, 0] = math.nan  # type: ignore[index]
            clip = pipe.clip_grad_norm_ if key == "pipe" else functools.partial(torch.nn.utils.clip_grad_norm_, reference.parameters())
            try:
                found[key] = float(clip(1e-3, norm_type, error_if_nonfinite=strict))
            except RuntimeError as e:
                found[key] = "non-finite" if "non-finite" in str(e) else str(e)
            found[f"{key} grads"] = {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}
        found["grads"] = max(_max_diff(g, found["plain grads"][n]) for n, g in found.pop("pipe grads").items())
        del found["plain grads"]
        report.append(found)
    single = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3).requires_grad_(False))  # rank 1 holds no gradient
    pipe = compile_pipeline(single, x.float(), mesh=mesh, chunks=2, split_points=["2"], timeout=60)
    pipe.train_step(x.float(), target=y.float(), loss_fn=F.mse_loss)
    report.append(dict(dtype=str(pipe.clip_grad_norm_(1.0).dtype)))  # before, float64 there, float32 on rank 0
    return report


class _Overflow(torch.autograd.Function):
    """h + p, whose gradient for p is infinite on a batch with a marked row: an overflow in the
    first stage only, as fp16 gives."""

    @staticmethod
    def forward(ctx: Any, h: torch.Tensor, p: torch.Tensor, marked: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(marked)
        return h + p

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        (marked,) = ctx.saved_tensors
        return grad, grad.sum(0) * (float("inf") if bool(marked.any()) else 1.0), None


class Overflows(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 8), nn.Linear(8, 8), nn.Linear(8, 3)
        self.p = nn.Parameter(torch.zeros(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _Overflow.apply(torch.tanh(self.a(x)), self.p, x[:, :1] == 42)
        return self.c(torch.tanh(self.b(h)))


def scaled(rank: int, world: int) -> list[tuple[float, float, float]]:
    """The README's GradScaler recipe across processes: ShardedGradScaler over the pipeline group
    agrees on every rank whether a step overflowed; the step that overflows on the first stage
    only is skipped on every rank, as by the plain model's scaler."""
    from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = Overflows().double()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(8, 6, dtype=torch.float64, generator=g), torch.randn(8, 3, dtype=torch.float64, generator=g)) for _ in range(3)]
    data[1][0][5, 0] = 42.0
    pipe = compile_pipeline(model, data[0][0], mesh=mesh, chunks=2, split_points=["b"], schedule="1f1b", timeout=30)
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler = ShardedGradScaler("cpu", init_scale=1024.0, process_group=mesh.get_group("pp"))
    scaler.scale(torch.ones(()))  # its scale, on the ranks whose stages do not compute the loss too
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    log = []
    for x, y in data:
        opt.zero_grad(), ref_opt.zero_grad()
        pipe.train_step(x, target=y, loss_fn=lambda out, t: scaler.scale(F.mse_loss(out, t)))
        ref_scaler.scale(F.mse_loss(reference(x), y)).backward()
        for each, optimizer in ((scaler, opt), (ref_scaler, ref_opt)):
            each.step(optimizer)
            each.update()
        ref = dict(reference.named_parameters())
        log.append((scaler.get_scale(), ref_scaler.get_scale(), max(_max_diff(p, ref[n]) for n, p in pipe.named_parameters())))
    return log


class Scaled(nn.Module):
    """Two stages that both read a plain (non-tensor) argument."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        return self.b(self.a(x) * scale) * scale


class PartlyNoGrad(nn.Module):
    """A `with torch.no_grad():` block in forward: torch.fx cannot capture it, torch.export does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(6, 6) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            shift = self.b(h).mean(1, keepdim=True)
        return self.d(torch.tanh(self.c(h) + shift))


class Penalised(nn.Module):
    """Adds a penalty over self.parameters(): torch.fx would keep it as a constant, torch.export
    captures it; the failed trace must leave nothing holding the parameters."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(6, 6) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.d(torch.tanh(self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))))
        return h + 0.01 * sum(p.pow(2).sum() for p in self.parameters())


EXPORTED = {"no_grad block": PartlyNoGrad, "penalty": Penalised}


def exported_across(rank: int, world: int, name: str) -> dict[str, Any]:
    """A model captured by torch.export, across processes: each rank keeps its own stages'
    tensors only, and a step gives the plain model's loss and gradients."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = EXPORTED[name]().double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, mesh=mesh, chunks=2, schedule="1f1b", timeout=30)
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    theirs = dict(reference.named_parameters())
    held = {name: p for name, p in pipe.named_parameters() if not p.is_meta}
    torch.manual_seed(1)
    plain = EXPORTED[name]()
    with torch.autocast("cpu", dtype=torch.bfloat16):  # as the README says to compile it for autocast
        under = compile_pipeline(copy.deepcopy(plain), x.float(), mesh=mesh, chunks=2, timeout=30)
        autocast_loss = float(under.train_step(x.float(), target=y.float(), loss_fn=F.mse_loss))
        autocast_expected = F.mse_loss(plain(x.float()), y.float()).item()
    return dict(
        autocast=abs(autocast_loss - autocast_expected) / autocast_expected,
        note=pipe.plan.notes[0],
        held=sorted(held),
        freed=sorted(name for name, p in model.named_parameters() if p.is_meta),
        loss=abs(float(loss) - expected.item()),
        grads=max(_max_diff(p.grad, theirs[name].grad) for name, p in held.items() if theirs[name].grad is not None),
        no_grads=sorted(name for name, p in held.items() if (p.grad is None) != (theirs[name].grad is None)),
    )


@torch.fx.wrap
def _checked(h: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    if bool((x.abs() > 1e9).any()):  # a check of the data: it cannot run on the meta device
        raise ValueError("an input out of range")
    return h


class Checked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_checked(torch.tanh(self.a(x)), x))


def compiled_again(rank: int, world: int) -> dict[str, Any]:
    """One model object compiled again after a first compile freed on each rank the tensors of
    the other ranks' stages: with the same cut it trains as the plain model; with another cut,
    or when it cannot be captured again, every rank says why."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = FanOut().double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    theirs = dict(reference.named_parameters())
    found: dict[str, Any] = {}
    for schedule in ("1f1b", "zb-h1"):  # the same cut, twice
        pipe = compile_pipeline(model, x, mesh=mesh, chunks=2, split_points=["layers.4"], schedule=schedule, timeout=30)
        pipe.zero_grad(set_to_none=True)
        loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        found[schedule] = max(abs(float(loss) - expected.item()), *(_max_diff(p.grad, theirs[n].grad) for n, p in pipe.named_parameters()))
    try:
        compile_pipeline(model, x, mesh=mesh, chunks=2, split_points=["layers.2"], timeout=30)
        found["another cut"] = "compiled"
    except ValueError as e:
        found["another cut"] = f"{type(e).__name__}: {e}"
    checked = Checked().double()
    compile_pipeline(checked, x, mesh=mesh, chunks=2, timeout=30)
    try:
        compile_pipeline(checked, x, mesh=mesh, chunks=2, schedule="zb-h1", timeout=30)
        found["captured again"] = "compiled"
    except Exception as e:  # noqa: BLE001 - what the test inspects
        found["captured again"] = getattr(e, "__notes__", [])
    return found


def _fan_out_on(mesh: Any, timeout: float) -> tuple[Any, nn.Module, torch.Tensor, torch.Tensor]:
    """The fan-out model under 1f1b on `mesh`, its plain twin, and a batch with its target."""
    torch.manual_seed(0)
    model = FanOut().double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    return compile_pipeline(model, x, mesh=mesh, chunks=4, schedule="1f1b", timeout=timeout), reference, x, y


def calls_that_differ(rank: int, world: int) -> dict[str, Any]:
    """Each rank makes its own call, and one of them differs, or is refused on one rank only: every
    rank raises within the step, before any gradient moves, and the next step is the plain model's."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    pipe, reference, x, y = _fan_out_on(mesh, timeout=20)
    scaled = compile_pipeline(Scaled().double(), (x, 2.0), mesh=mesh, chunks=2, timeout=20)
    last = rank == world - 1
    odd: dict[str, Callable[[], Any]] = {
        # (the batch's size on dim 1 alone: refused as not split along dim 0; one with no dim of its size goes whole)
        "a target refused on one rank": lambda: pipe.train_step(x, target=torch.zeros(7, 8) if last else y, loss_fn=F.mse_loss),
        "another batch size": lambda: pipe.train_step(x[:6] if last else x, target=y[:6] if last else y, loss_fn=F.mse_loss),
        "no_grad on one rank": lambda: _under(torch.no_grad() if last else contextlib.nullcontext(), lambda: pipe.train_step(x, target=y, loss_fn=F.mse_loss)),
        "eval on one rank": lambda: _in_mode(pipe, not last, lambda: pipe.train_step(x, target=y, loss_fn=F.mse_loss)),
        "a plain argument of its own": lambda: scaled.train_step(x, 3.0 if last else 2.0, target=y, loss_fn=F.mse_loss),
        "autocast on one rank": lambda: _under(torch.autocast("cpu", torch.bfloat16) if last else contextlib.nullcontext(), lambda: pipe.train_step(x, target=y, loss_fn=F.mse_loss)),
        "other inputs on one rank": lambda: pipe.train_step(x + last, target=y, loss_fn=F.mse_loss),
        "other targets on one rank": lambda: pipe.train_step(x, target=y + last, loss_fn=F.mse_loss),
        "other inputs on one rank, forward": lambda: _under(torch.no_grad(), lambda: pipe(x + last)),
        "another pipeline on one rank": lambda: (scaled.train_step(x, 2.0, target=y, loss_fn=F.mse_loss) if last else pipe.train_step(x, target=y, loss_fn=F.mse_loss)),
    }
    torch.manual_seed(0)
    tied = TiedEnds().double()
    if last:  # initialised apart on one rank: its copy of the tied weight differs
        with torch.no_grad():
            tied.a.weight.add_(0.1)
    apart = compile_pipeline(tied, x, mesh=mesh, chunks=2, split_points=["b"], timeout=20)
    odd["another reduction"] = lambda: pipe.train_step(x, target=y, loss_fn=_summed if last else F.mse_loss, reduction="sum" if last else "mean")
    odd["tied copies apart, forward"] = lambda: _under(torch.no_grad(), lambda: apart(x))
    odd["tied copies apart, step"] = lambda: apart.train_step(x, target=y, loss_fn=F.mse_loss)
    for how, change in (("two values swapped", lambda w: w[[0, 2], [1, 3]].flip(0)), ("1e-9 apart", lambda w: w[[0, 2], [1, 3]] + 1e-9)):
        torch.manual_seed(0)
        held = TiedEnds().double()
        if last:  # the same sums and squares, or all but equal: the copies still differ
            with torch.no_grad():
                held.a.weight[[0, 2], [1, 3]] = change(held.a.weight)
        near = compile_pipeline(held, x, mesh=mesh, chunks=2, split_points=["b"], timeout=20)
        odd[f"tied copies {how}, step"] = functools.partial(near.train_step, x, target=y, loss_fn=F.mse_loss)
    torch.manual_seed(0)
    drops = compile_pipeline(nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.3), nn.Linear(6, 6)).double(), x, mesh=mesh, chunks=2, split_points=["2"], timeout=20)
    odd["eval on one rank, a model that draws"] = lambda: _in_mode(drops, not last, lambda: drops.train_step(x, target=y, loss_fn=F.mse_loss))
    report: dict[str, Any] = {}
    for what, call in odd.items():
        start = time.monotonic()
        try:
            call()
            report[what] = ("no error", time.monotonic() - start)
        except (RuntimeError, ValueError) as e:
            report[what] = (str(e), time.monotonic() - start)
    report["grads after"] = [name for name, p in pipe.named_parameters() if p.grad is not None]
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    report["next step"] = max(abs(float(loss) - expected.item()), *(_max_diff(p.grad, dict(reference.named_parameters())[n].grad) for n, p in pipe.named_parameters()))
    return report


def _summed(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target, reduction="sum")


def dropped_after_refusal(rank: int, world: int, rounds: int = 3) -> list[float]:
    """A pipeline whose last call was refused (ranks called differently) is dropped, and another
    compiled on the same mesh trains: its loss's distance from the plain model's, per round.
    What the refused step left in flight must neither be lost nor stop the next pipeline's."""
    import gc

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    found = []
    for _ in range(rounds):
        torch.manual_seed(1)
        model = Scaled().double()
        reference = copy.deepcopy(model)
        dropped = compile_pipeline(copy.deepcopy(model), (x, 2.0), mesh=mesh, chunks=2, timeout=20)
        with contextlib.suppress(RuntimeError):
            dropped.train_step(x, 2.0 + rank, target=y, loss_fn=F.mse_loss)
        del dropped
        gc.collect()
        pipe = compile_pipeline(model, (x, 2.0), mesh=mesh, chunks=2, timeout=20)
        loss = pipe.train_step(x, 2.0, target=y, loss_fn=F.mse_loss)
        found.append(abs(float(loss) - F.mse_loss(reference(x, 2.0), y).item()))
    return found


def _under(context: Any, call: Callable[[], Any]) -> Any:
    with context:
        return call()


def _in_mode(pipe: Any, training: bool, call: Callable[[], Any]) -> Any:
    pipe.train(training)
    try:
        return call()
    finally:
        pipe.train()


def replicated(rank: int, world: int, names: list[str]) -> list[dict[str, Any]]:
    """pp x dp = 2 x 2: each replica trains on its own share of the batch (uneven shares); the
    loss and every gradient equal the plain model's on the whole batch."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    replica = mesh.get_local_rank("dp")
    report = []
    for name, schedule in zip(names, ("1f1b", "zb-h1", "gpipe")):
        torch.manual_seed(0)
        model, batches, loss_fn = MODELS[name]()
        reference = copy.deepcopy(model)
        x, y = batches[1]  # 9 samples: replica 0 trains on 4, replica 1 on 5
        share = slice(0, 4) if replica == 0 else slice(4, None)
        pipe = compile_pipeline(model, x[share], mesh=mesh, chunks=2, schedule=schedule, timeout=60)
        losses = [pipe.train_step(x[share], target=None if y is None else y[share], loss_fn=loss_fn).item() for _ in range(2)]
        expected = loss_fn(reference(x), y)
        (2 * expected).backward()  # two steps, accumulated
        ref = dict(reference.named_parameters())
        grads = {n: _max_diff(p.grad, ref[n].grad) for n, p in pipe.named_parameters() if p.grad is not None}
        report.append(dict(case=(name, schedule), losses=losses, expected=expected.item(), grads=grads, names=sorted(ref)))
    return report


class OwnSummedLoss(nn.Module):
    """FanOut returning its own loss: squared errors summed over samples, divided by `count`,
    given whole (as Hugging Face's Trainer gives num_items_in_batch, counted over every replica)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = FanOut()

    def forward(self, x: torch.Tensor, y: torch.Tensor, count: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"loss": F.mse_loss(self.body(x), y, reduction="sum") / count}


def replicated_own_losses(rank: int, world: int) -> list[dict[str, Any]]:
    """pp x dp = 2 x 2, the model's own loss: a sum over samples divided by the whole batch's
    count, which compiling finds the sum of its halves' and the replicas sum too; and a mean
    cross-entropy over the labels not padded, which each replica weighs by the labels it counts
    (with class weights, by their weights' sum)."""
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("pp", "dp"))
    share = slice(0, 4) if mesh.get_local_rank("dp") == 0 else slice(4, None)  # 4 samples and 5 (4 and 4 labelled)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(9, 6, dtype=torch.float64, generator=g), torch.randn(9, 6, dtype=torch.float64, generator=g)
    ids, labels = padded_labels(1, pads=(7, 2, 0, 5, 6, 1, 3, 8))
    cases: dict[str, tuple[nn.Module, tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]] = {
        "summed": (OwnSummedLoss(), (x, y, torch.tensor(54.0, dtype=torch.float64)), (x[share], y[share])),
        "counted": (PaddedLM(), (ids, labels), (ids[share], labels[share])),
        "weighted": (PaddedLM("weighted"), (ids, labels), (ids[share], labels[share])),
    }
    report = []
    for name, (made, whole, mine) in cases.items():
        torch.manual_seed(0)
        model = made.double()
        reference = copy.deepcopy(model)
        given = (*mine, *whole[len(mine):])  # the count is given whole
        pipe = compile_pipeline(model, given, mesh=mesh, chunks=2, schedule="1f1b", timeout=60)
        losses = [pipe.train_step(*given).item() for _ in range(2)]  # accumulated
        expected = reference(*whole)["loss"]
        (2 * expected).backward()
        ref = dict(reference.named_parameters())
        grads = {n: _max_diff(p.grad, ref[n].grad) for n, p in pipe.named_parameters() if p.grad is not None}
        report.append(dict(case=name, losses=losses, expected=expected.item(), grads=grads, counted=pipe.program().loss_counter is not None))
    return report


def checkpoint_round(rank: int, world: int, load_from: str, save_to: str, out_path: str, seed: int, meta: bool = False) -> list[str]:
    """Load a checkpoint (torch.distributed.checkpoint) into this rank's part of a freshly made
    model (`meta`: built on the meta device, each rank making its own stages only), run it,
    train a step, save, run again: the outputs go to `out_path`."""
    import torch.distributed.checkpoint as dcp

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(seed)
    with torch.device("meta" if meta else "cpu"):
        model, _, loss_fn = MODELS["gpt"]()
    _, batches, _ = MODELS["gpt"]()
    x, y = batches[0]
    held = [t for t in [*model.parameters(), *model.buffers()] if not t.is_meta]
    pipe = compile_pipeline(model, x, mesh=mesh, chunks=2, schedule="1f1b", timeout=60)
    if meta:  # nothing was made before compiling; now only this rank's stages are
        assert not held and all(not t.is_meta for t in [*pipe.parameters(), *pipe.buffers()])
        assert len(list(pipe.parameters())) < len(list(model.parameters()))
    state = pipe.state_dict()
    dcp.load(state, checkpoint_id=load_from)  # in place, into this rank's tensors
    pipe.load_state_dict(state)
    with torch.no_grad():
        loaded = pipe(x)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.5)
    pipe.train_step(x, target=y, loss_fn=loss_fn)
    opt.step()
    dcp.save(pipe.state_dict(), checkpoint_id=save_to)
    with torch.no_grad():
        trained = pipe(x)
    if trained is not None:
        torch.save({"loaded": loaded, "trained": trained}, out_path)
    return sorted(pipe.state_dict())


def sample_values(step: int) -> dict[str, Any]:
    """Values a stage may send: every dtype, 0-dim and empty tensors, one too big for a frame,
    a structure whose header alone is too big for one, and non-tensor leaves; in each step the
    same keys with other shapes and leaves (a sender that reused a header would send the old)."""
    g = torch.Generator().manual_seed(3 + step)
    big = torch.randn(300, 300, dtype=torch.float64, generator=g)  # 720 KB: sent after the frame
    z = torch.randn(3, dtype=torch.complex128, generator=g)
    return {
        "floats": (torch.randn(3 + step, 4, generator=g).requires_grad_(step == 0), torch.randn(5, dtype=torch.float64, generator=g)),
        # equal leaves of other types, each arriving as itself: 1 == True == 1.0, 0.0 == -0.0
        "equals": [(1, True, 1.0, 0.0), (True, 1, 1.0, -0.0)][step],
        # views with the conjugate and negative bits set, in the frame and (the last) after it
        "conjugate": (z.conj(), z.conj().imag, big.to(torch.complex128)[:40].conj()),
        "kinds": [torch.tensor([True, False]), torch.arange(7), torch.randn(4, generator=g).to(torch.bfloat16),
                  torch.randn(3, dtype=torch.complex64, generator=g), torch.tensor(2.5), torch.empty(0, 3)],
        "big": big,
        "strided": big[::7, ::3],
        # dense in another order: they arrive in that layout (the last, one sample's channels-last
        # with a batch stride no contiguous tensor has); an expanded one arrives contiguous
        "layouts": (big[:6, :8].t().contiguous().t(), torch.randn(1, 2, 2, 4, generator=g).permute(0, 3, 1, 2),
                    torch.as_strided(torch.randn(16, generator=g), (1, 4, 2, 2), (4, 1, 8, 4)), big[0].expand(3, 300)),
        "many": {f"k{i}": (i, f"text {i}" * 20, None) for i in range(800)},  # a header of about 140 KB
        # so many large tensors that their sizes and the small ones leave no room in the frame
        "crowd": ([torch.full((1200,), float(i)) for i in range(400)], [torch.full((20,), float(i)) for i in range(40)]),
        "none": None,
    }  # fmt: skip


def echo(rank: int, world: int) -> list[str]:
    """Rank 0 sends each sample value on the channel, in two steps; rank 1 takes them out of
    order and reports what differs."""
    from fxpipe.distributed.channel import Channel

    channel = Channel(dist.group.WORLD, list(range(world)), rank, torch.device("cpu"), 30.0)
    problems = []
    for step in range(2):
        values = sample_values(step)
        channel.begin()
        if rank == 0:
            for name, value in values.items():
                channel.send(1, name, value)
        else:
            for name in reversed(list(values)):
                problems += _differences(name, channel.take(0, name), values[name])
        channel.finish()
    return problems


def _differences(path: str, got: Any, expected: Any) -> list[str]:
    if isinstance(expected, torch.Tensor):
        ok = isinstance(got, torch.Tensor) and got.dtype == expected.dtype and got.shape == expected.shape
        ok = ok and torch.equal(got, expected.detach()) and got.requires_grad == expected.requires_grad
        ok = ok and got.stride() == torch.empty_like(expected).stride()  # dense layouts kept, others contiguous
        return [] if ok else [f"{path}: {got!r} != {expected!r}"]
    if isinstance(expected, (tuple, list)):
        if type(got) is not type(expected) or len(got) != len(expected):
            return [f"{path}: {type(got).__name__} != {type(expected).__name__}"]
        return [d for i, (a, b) in enumerate(zip(got, expected)) for d in _differences(f"{path}[{i}]", a, b)]
    if isinstance(expected, dict):
        if not isinstance(got, dict) or list(got) != list(expected):
            return [f"{path}: keys differ"]
        return [d for k in expected for d in _differences(f"{path}.{k}", got[k], expected[k])]
    same = type(got) is type(expected) and got == expected and repr(got) == repr(expected)  # -0.0 is not 0.0 here
    return [] if same else [f"{path}: {got!r} != {expected!r}"]


def timed_plans(rank: int, world: int) -> tuple[list[list[str]], float, float]:
    """balance='time' measures on every rank, each its own times (rank 1's skewed on purpose, so
    that on its own it would cut elsewhere): the ranks still cut alike."""
    import fxpipe.compiler.cuts

    measure = fxpipe.compiler.cuts.profile_times

    def skewed(gm: Any, *args: Any, **kwargs: Any) -> Any:
        measured = measure(gm, *args, **kwargs)
        for node in gm.graph.nodes:
            if "time" in node.meta and rank == 1 and "layers_0" in node.name:
                node.meta["time"] *= 1000.0
        return measured

    fxpipe.compiler.cuts.profile_times = skewed
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = FanOut().double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, mesh=mesh, chunks=2, balance="time")
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss).item()
    return [s.nodes for s in pipe.plan.stages], loss, F.mse_loss(reference(x), y).item()


def feature_spec(feature: str, seed: int) -> Spec:
    """A random graph with the ops of `feature` (tests/dag_models.py), drawn as the property
    test draws them, from a seed."""
    from dag_models import FEATURE_OPS

    rng = random.Random(seed)
    kinds = FEATURE_OPS[feature]
    n = rng.randint(4 if feature == "fanout" else 2, 8 if feature == "mixed" else 5)
    ops = []
    for i in range(n):
        first, second = rng.randint(0, i), rng.choice([None, rng.randint(0, i)])
        picks = (first,) if second is None or second == first else (first, second)
        ops.append(Op(rng.choice(("linear", *kinds)), picks, rng.randint(0, 5)))
    if kinds and not any(op.kind in kinds for op in ops):
        ops[-1].kind = rng.choice(kinds)
    if feature in ("tied_weights", "module_twice"):
        ops[0].kind = ops[-1].kind = kinds[0]
    if feature == "fanout":
        for op in ops[1:]:
            if 1 not in op.picks:
                op.picks = (op.picks[0], 1)
    return Spec(rng.choice([4, 6, 8]), ops, (rng.randint(1, n),) if rng.random() < 0.5 else ())


def dag_features(rank: int, world: int, cases: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Random graphs with every feature of the property test (dropout at p = 0): two SGD steps
    through train_step under a drawn schedule and checkpoint mode, against the plain model run
    on the same micro-batches; per step the loss, the outputs (on the loss rank) and the state
    (parameters, gradients, buffers) of what this rank holds; then an eval-mode forward."""
    from dag_models import detach, mean_loss_of, micro_batched

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    report = []
    for feature, seed in cases:
        rng = random.Random(seed)
        spec = feature_spec(feature, seed)
        schedule = rng.choice(["gpipe", "1f1b", "zb-h1", "interleaved-1f1b"])
        mode = rng.choice(["always", "except_last", "never"])
        chunks = world * rng.randint(1, 2)
        batch = 2 * chunks + rng.randint(0, 3)  # BatchNorm needs two rows per micro-batch
        g = torch.Generator().manual_seed(seed)
        xs = [torch.randn(b, spec.width, generator=g, dtype=torch.float64) for b in (batch, batch + 1)]
        model = make_model(spec, 0.0, seed, torch.float64)
        reference = copy.deepcopy(model)
        extra: dict[str, Any] = dict(stages_per_device=2) if schedule == "interleaved-1f1b" else {}
        entry: dict[str, Any] = dict(case=(feature, seed, schedule, mode, chunks), problems=[])
        try:
            pipe = compile_pipeline(model, xs[0], mesh=mesh, chunks=chunks, checkpoint=mode, schedule=schedule, timeout=60, **extra)
        except ValueError as e:
            if "nodes to place" not in str(e) and "cannot run across processes" not in str(e):
                raise
            entry["skipped"] = str(e)
            report.append(entry)
            continue
        for step, x in enumerate(xs):
            loss, out = pipe.train_step(x, loss_fn=lambda o, _: mean_loss_of(o), return_outputs=True)
            expected_out = micro_batched(reference, chunks)(x)
            expected = mean_loss_of(expected_out)
            expected.backward()
            entry["problems"] += _compare(f"step {step} loss", loss, expected.detach())
            if out is not None:
                entry["problems"] += [p for a, b in zip(detach(out), detach(expected_out)) for p in _compare(f"step {step} out", a, b)]
            mine, theirs = pipe.state_dict(keep_vars=True), reference.state_dict(keep_vars=True)
            for name, value in mine.items():
                entry["problems"] += _compare(f"step {step} {name}", value, theirs[name])
                grad, ref_grad = getattr(value, "grad", None), getattr(theirs[name], "grad", None)
                if (grad is None) != (ref_grad is None):
                    entry["problems"].append(f"step {step} {name}.grad: {grad is None=} {ref_grad is None=}")
                elif grad is not None and ref_grad is not None:
                    entry["problems"] += _compare(f"step {step} {name}.grad", grad, ref_grad)
            for module in (pipe, reference):
                torch.optim.SGD(module.parameters(), lr=0.1).step()
                module.zero_grad(set_to_none=True)
        pipe.eval()  # the eval graph, where the model branches on self.training, cut to follow
        reference.eval()
        with torch.no_grad():
            out = pipe(xs[0])
            expected_out = micro_batched(reference, chunks)(xs[0])
        if out is not None:
            entry["problems"] += [p for a, b in zip(detach(out), detach(expected_out)) for p in _compare("eval out", a, b)]
        entry["held"] = sorted(pipe.state_dict())
        report.append(entry)
    return report


def _compare(what: str, got: torch.Tensor, expected: torch.Tensor) -> list[str]:
    got, expected = got.detach(), expected.detach()
    if got.shape != expected.shape or got.dtype != expected.dtype:
        return [f"{what}: {tuple(got.shape)} {got.dtype} != {tuple(expected.shape)} {expected.dtype}"]
    if got.is_floating_point() and not torch.allclose(got, expected, rtol=1e-12, atol=1e-10, equal_nan=True):
        return [f"{what}: differs by {float((got - expected).abs().max()):.3g}"]
    if not got.is_floating_point() and not torch.equal(got, expected):
        return [f"{what}: {got} != {expected}"]
    return []


class Swapped(nn.Module):
    """Runs l1 then l2 in training, l2 then l1 in eval: cut after l1, l1's weights would be read
    in eval on the rank that does not train them."""

    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training:
            return self.l2(torch.tanh(self.l1(x)))
        return self.l1(torch.tanh(self.l2(x)))


def stale_copies(rank: int, world: int) -> list[str]:
    """Plans whose copies would go stale: a parameter read in eval mode alone on another rank; a
    parameter forward renormalises in place, tied to a later rank's head (with one micro-batch,
    where no check of the halves sees it: before, each rank ran its own copy, 2.6 off)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    found = []
    for model, x, splits in [
        (Swapped(), torch.randn(4, 4), ["l2"]),
        (RenormTied(False), torch.randint(0, 10, (8, 5)), ["b"]),
        (RenormTied(True), torch.randint(0, 10, (8, 5)), ["b"]),
    ]:
        try:
            compile_pipeline(model, x, mesh=mesh, split_points=splits, timeout=30)
            found.append("no error")
        except ValueError as e:
            found.append(str(e))
    return found


def held_elsewhere(rank: int, world: int) -> dict[str, Any]:
    """An output of the plain model kept with its graph, which holds the weights every rank would
    free: every rank refuses, naming them, with nothing moved; compiled again once it is dropped,
    a step is exact; a parameter added afterwards is refused on every rank."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(6, 6) for _ in range(4)]).double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    held = model(x)
    report: dict[str, Any] = {}
    try:
        compile_pipeline(model, x, mesh=mesh, chunks=2, timeout=60)
    except RuntimeError as e:
        report["refused"] = str(e)
    report["on meta"] = [name for name, p in model.named_parameters() if p.is_meta]
    del held
    pipe = compile_pipeline(model, x, mesh=mesh, chunks=2, timeout=60)
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    theirs = dict(reference.named_parameters())
    report["loss"] = abs(float(loss) - expected.item())
    report["grads"] = max(_max_diff(p.grad, theirs[name].grad) for name, p in model.named_parameters() if not p.is_meta)
    # A parameter added since (an adapter), or replaced (a layer initialised again), a module of
    # them added: a rank that does not hold the layer would keep a copy, untrained.
    changes = {
        "added": lambda: setattr(model[0], "adapter", nn.Parameter(torch.zeros(6, dtype=torch.float64))),
        "replaced": lambda: setattr(model[3], "weight", nn.Parameter(torch.zeros(6, 6, dtype=torch.float64))),
        "module added": lambda: setattr(model[0], "lora", nn.Linear(6, 2).double()),
    }
    for what, change in changes.items():
        before = dict(model[3]._parameters)
        change()
        try:
            pipe(x)
        except RuntimeError as e:
            report[what] = str(e)
        model[3]._parameters.update(before)  # put back: the next change alone
        model[0]._parameters.pop("adapter", None)
        model[0]._modules.pop("lora", None)
    return report


class EvalScaled(nn.Module):
    """A parameter read in eval mode alone, on the last stage: no training stage holds it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.scale = nn.Linear(4, 4), nn.Linear(4, 4), nn.Parameter(torch.full((4,), 1.1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.b(torch.tanh(self.a(x)))
        return h if self.training else h * self.scale


def eval_only_parameter(rank: int, world: int) -> dict[str, float]:
    """Compiled where it was refused as a copy that would go stale: a training step, then eval
    outputs, exact on the output's rank."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = EvalScaled().double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(6, 4, dtype=torch.float64), torch.randn(6, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, mesh=mesh, chunks=2, split_points=["b"], timeout=60)
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    found = {"loss": abs(float(loss) - float(expected))}
    held = [(name, p) for name, p in model.named_parameters() if p.device.type != "meta" and p.grad is not None]
    found["grads"] = max(_max_diff(p.grad, reference.get_parameter(name).grad) for name, p in held)
    pipe.eval()
    reference.eval()
    with torch.no_grad():
        out = pipe(x)
        if out is not None:
            found["eval"] = _max_diff(out, reference(x))
    return found


def dropout_draws(rank: int, world: int, cases: list[tuple[str, int]]) -> list[dict[str, Any]]:
    """Dropout drawing (p = 0.5) on random graphs: the pipeline across processes draws the masks
    the one-process pipeline draws on the same cut, forward and recompute alike: the same losses
    and gradients, step after step."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    from dag_models import mean_loss_of

    report = []
    for feature, seed in cases:
        rng = random.Random(seed)
        spec = feature_spec(feature, seed)
        schedule, mode = rng.choice(["gpipe", "1f1b", "zb-h1"]), rng.choice(["always", "except_last", "never"])
        x = torch.randn(2 * world + 1, spec.width, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        across = make_model(spec, 0.5, seed, torch.float64)
        alone = copy.deepcopy(across)
        entry: dict[str, Any] = dict(case=(feature, seed, schedule, mode), problems=[])
        try:
            pipe = compile_pipeline(across, x, mesh=mesh, chunks=world, checkpoint=mode, schedule=schedule, timeout=60)
        except ValueError as e:
            entry["skipped"] = str(e)
            report.append(entry)
            continue
        counts = [len(s.nodes) for s in pipe.plan.stages]
        single = compile_pipeline(alone, x, ["cpu"] * world, chunks=world, checkpoint=mode, schedule=schedule, balance=counts)
        for step in range(2):
            losses = []
            for p in (pipe, single):
                torch.manual_seed(100 + step)
                losses.append(p.train_step(x, loss_fn=lambda o, _: mean_loss_of(o)))
            entry["problems"] += _compare(f"step {step} loss", losses[0], losses[1])
            theirs = dict(single.named_parameters())
            for name, param in pipe.named_parameters():
                expected = theirs[name].grad
                if param.grad is not None and expected is not None:
                    entry["problems"] += _compare(f"step {step} {name}.grad", param.grad, expected)
                elif (param.grad is None) != (expected is None):
                    entry["problems"].append(f"step {step} {name}.grad: one of the two is None")
        single.close()
        report.append(entry)
    return report


def directional(rank: int, world: int) -> list[dict[str, Any]]:
    """The groups values travel on: the U-Net and GPT under 1f1b and zb-h1, on a 2 x 2 mesh; each
    entry says which ranks the groups this rank sent and received on hold, and how many there were
    (made once per mesh, so both pipelines use the same)."""
    import fxpipe.distributed.channel

    used: dict[str, dict[int, Any]] = {"send": {}, "receive": {}}

    class Spied:
        """A process group that notes each way it is used in."""

        def __init__(self, group: Any) -> None:
            self.group = group

        def send(self, *args: Any) -> Any:
            used["send"][id(self.group)] = self.group
            return self.group.send(*args)

        def recv(self, *args: Any) -> Any:
            used["receive"][id(self.group)] = self.group
            return self.group.recv(*args)

    spied: dict[int, Spied] = {}  # one per group: a channel finds a group's posted receives by its identity
    route = fxpipe.distributed.channel._route

    def routed(group: Any, global_rank: int) -> tuple[Any, int]:
        real, rank = route(group, global_rank)
        return spied.setdefault(id(real), Spied(real)), rank

    fxpipe.distributed.channel._route = routed
    try:
        report = replicated(rank, world, ["gpt", "unet"])
    finally:
        fxpipe.distributed.channel._route = route
    groups = {way: [sorted(dist.get_process_group_ranks(g)) for g in found.values()] for way, found in used.items()}
    return [dict(entry, groups=groups, same_group=bool(set(used["send"]) & set(used["receive"]))) for entry in report]


def modes_across(rank: int, world: int) -> dict[str, float]:
    """The modes a user trains and evaluates in, across processes, each against the plain model:
    train_step under no_grad (the loss alone), a sum-reduced loss, bfloat16 autocast, and eval."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    pipe, reference, x, y = _fan_out_on(mesh, timeout=60)
    found: dict[str, float] = {}
    with torch.no_grad():
        found["no_grad loss"] = abs(pipe.train_step(x, target=y, loss_fn=F.mse_loss).item() - F.mse_loss(reference(x), y).item())
    found["no_grad: gradients made"] = float(sum(p.grad is not None for p in pipe.parameters()))
    summed = lambda out, target: F.mse_loss(out, target, reduction="sum")  # noqa: E731
    loss = pipe.train_step(x, target=y, loss_fn=summed, reduction="sum")
    expected = summed(reference(x), y)
    expected.backward()
    found["sum loss"] = abs(loss.item() - expected.item())
    ref = dict(reference.named_parameters())
    found["sum gradients"] = max(_max_diff(grad_of(p), grad_of(ref[n])) for n, p in pipe.named_parameters())
    single = FanOut()  # autocast casts float32 work
    single_pipe = compile_pipeline(copy.deepcopy(single), x.float(), mesh=mesh, chunks=4, schedule="zb-h1", timeout=60)
    with torch.autocast("cpu", torch.bfloat16):
        loss, out = single_pipe.train_step(x.float(), target=y.float(), loss_fn=F.mse_loss, return_outputs=True)
        expected = F.mse_loss(single(x.float()), y.float())
    found["bf16 loss"] = abs(loss.item() - expected.item()) / max(abs(expected.item()), 1e-6)
    found["bf16 outputs"] = -1.0 if out is None else float(out.dtype == torch.bfloat16)
    # The model's own mean over the labels it counts (-100 padding, uneven between micro-batches).
    torch.manual_seed(0)
    own = PaddedLM().double()
    own_reference = copy.deepcopy(own)
    ids, labels = padded_labels(1)
    own_pipe = compile_pipeline(own, (ids, labels), mesh=mesh, chunks=4, schedule="1f1b", timeout=60)
    loss = own_pipe.train_step(ids, labels)
    expected = own_reference(ids, labels)["loss"]
    expected.backward()
    found["own mean loss"] = abs(loss.item() - expected.item())
    references = dict(own_reference.named_parameters())
    found["own mean gradients"] = max(_max_diff(grad_of(p), grad_of(references[n])) for n, p in own_pipe.named_parameters())
    pipe.eval()
    reference.eval()
    with torch.no_grad():
        out = pipe(x)
        found["eval out"] = -1.0 if out is None else float((out - reference(x)).abs().max())
    return {**found, **_batch_dims_across(mesh), **_changed_across(mesh), **_layouts_across(mesh)}


def _changed_across(mesh: Any) -> dict[str, float]:
    """What changed after compiling, on every rank: the model cast to float64 (the stages are built
    again), and an input the example kept whole at a batch size equal to its length."""
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), Counts())  # Counts writes a buffer: cast, it is another
    reference = copy.deepcopy(model).double()
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    pipe = compile_pipeline(model, x.float(), mesh=mesh, chunks=4, schedule="zb-h1", timeout=60)
    model.double()
    found = _step_against(pipe, reference, (x,), y, "cast", chunks=4)
    held = [b for b in model.buffers() if not b.is_meta]  # the count, on the rank that holds it
    found["cast count"] = max((abs(float(b.sum()) - 4.0) for b in held), default=0.0)
    model = WithPositions().double()
    reference = copy.deepcopy(model)
    example = (torch.randn(8, 3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64))
    pipe = compile_pipeline(model, example, mesh=mesh, chunks=3, schedule="1f1b", timeout=60)
    args = (torch.randn(3, 3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64))
    return {**found, **_step_against(pipe, reference, args, torch.randn(3, 3, 3, dtype=torch.float64), "whole")}


def _layouts_across(mesh: Any) -> dict[str, float]:
    """One-sample micro-batches of a BatchNorm before a window partition, cut after it: the
    gradient the first rank receives keeps the layout the second rank's backward made."""
    torch.manual_seed(0)
    model = WindowBlock().double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 3, 2, 2, dtype=torch.float64), torch.randn(4, 3, dtype=torch.float64)
    pipe = compile_pipeline(model, x, mesh=mesh, chunks=4, split_points=["grid"], schedule="zb-h1", timeout=60)
    return _step_against(pipe, reference, (x,), y, "layouts", chunks=4)


def _step_against(pipe: Any, reference: nn.Module, args: tuple[torch.Tensor, ...], y: torch.Tensor, name: str, chunks: int = 1) -> dict[str, float]:
    """One train step against the plain model (run on the micro-batches in turn if `chunks`)."""
    loss = pipe.train_step(*args, target=y, loss_fn=F.mse_loss)
    out = reference(*args) if chunks == 1 else torch.cat([reference(piece) for piece in args[0].tensor_split(chunks)])
    expected = F.mse_loss(out, y)
    expected.backward()
    ref = dict(reference.named_parameters())
    return {
        f"{name} loss": abs(loss.item() - expected.item()),
        f"{name} gradients": max(_max_diff(grad_of(p), grad_of(ref[n])) for n, p in pipe.named_parameters()),
    }


class TimeFirst(nn.Module):
    """Takes (time, batch, features); returns the sequence and a tensor of parameters alone."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(3, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.b(torch.tanh(self.a(x))), self.b.weight * 2


def _batch_dims_across(mesh: Any) -> dict[str, float]:
    """Outputs put together along their batch dims on the last rank: the sequence along dim 1
    (chunk_spec), the parameters' tensor once."""
    torch.manual_seed(0)
    model = TimeFirst().double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(5, 8, 3, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)

    def loss_fn(out: Any, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out[0][-1], target) + out[1].pow(2).mean()

    pipe = compile_pipeline(model, x, mesh=mesh, chunks=4, chunk_spec={"x": 1}, schedule="1f1b", timeout=60)
    loss, out = pipe.train_step(x, target=y, loss_fn=loss_fn, return_outputs=True)
    expected_out = reference(x)
    expected = loss_fn(expected_out, y)
    expected.backward()
    ref = dict(reference.named_parameters())
    return {
        "dims loss": abs(loss.item() - expected.item()),
        "dims gradients": max(_max_diff(grad_of(p), grad_of(ref[n])) for n, p in pipe.named_parameters()),
        "dims outputs": -1.0 if out is None else max(_max_diff(o, e) for o, e in zip(out, expected_out)),
    }


class _PartlyFrozen(nn.Module):
    """A trained layer, a frozen one, and a parameter the forward never reads."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)
        self.frozen = nn.Linear(6, 6).requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.frozen(torch.tanh(self.a(x))))


def replicas_through_ddp(rank: int, world: int) -> dict[str, Any]:
    """One stage, two replicas built from different seeds: DDP makes replica 1 replica 0's copy at
    compile time, then averages their gradients (uneven shares, a mean and then a sum loss), in
    float64 after the model is cast (DDP's float32 buckets would round them)."""
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(rank)
    model = _PartlyFrozen()
    torch.manual_seed(0)
    reference = _PartlyFrozen().double()
    g = torch.Generator().manual_seed(5)
    x, y = torch.randn(9, 6, dtype=torch.float64, generator=g), torch.randn(9, 6, dtype=torch.float64, generator=g)
    share = slice(0, 4) if rank == 0 else slice(4, None)
    pipe = compile_pipeline(model, x[share].float(), mesh=mesh, chunks=2, schedule="1f1b", timeout=60)
    model.double()
    ref = dict(reference.named_parameters())
    start = max(_max_diff(p, ref[n]) for n, p in model.named_parameters() if n != "unused")
    mean = pipe.train_step(x[share], target=y[share], loss_fn=F.mse_loss)
    total = pipe.train_step(x[share], target=y[share], loss_fn=lambda out, t: F.mse_loss(out, t, reduction="sum"), reduction="sum")
    expected_mean, expected_sum = F.mse_loss(reference(x), y), F.mse_loss(reference(x), y, reduction="sum")
    (expected_mean + expected_sum).backward()
    return dict(
        start=start,
        losses=max(abs(mean.item() - expected_mean.item()), abs(total.item() - expected_sum.item())),
        grads=max(_max_diff(p.grad, ref[n].grad) for n, p in model.named_parameters() if p.requires_grad and n != "unused"),
        unused=model.unused.grad is None,
    )


def clipped_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 clips and the other does not: rank 0 raises within the timeout, saying what it
    waited for and that every rank must call it."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    pipe, _, x, y = _fan_out_on(mesh, timeout=3)
    pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    if rank != 0:
        time.sleep(4.5)  # past rank 0's timeout, alive
        return dict(error="", took=0.0)
    start = time.monotonic()
    try:
        pipe.clip_grad_norm_(1.0)
        return dict(error="", took=time.monotonic() - start)
    except RuntimeError as e:
        return dict(error=str(e), took=time.monotonic() - start)


def frozen_through_pipe(rank: int, world: int) -> dict[str, Any]:
    """The same freezing loop over pipe.named_parameters() on every rank (each freezes what it
    holds; the tied GPT's other copies keep their flags): the plain model's frozen gradients.
    Then the tied weight frozen on one rank's copy only: refused on every rank, naming it."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model, batches, loss_fn = MODELS["gpt"]()
    reference = copy.deepcopy(model)
    pipe = compile_pipeline(model, batches[0][0], mesh=mesh, chunks=2, schedule="1f1b", timeout=30)
    for name, p in pipe.named_parameters():
        if name.startswith("blocks.0."):
            p.requires_grad_(False)
    reference.get_submodule("blocks.0").requires_grad_(False)
    x, y = batches[0]
    loss = pipe.train_step(x, target=y, loss_fn=loss_fn)
    expected = loss_fn(reference(x), y)
    expected.backward()
    ref = dict(reference.named_parameters())
    found: dict[str, Any] = dict(
        loss=abs(loss.item() - expected.item()),
        grads=max(_max_diff(p.grad, ref[n].grad) for n, p in pipe.named_parameters() if p.requires_grad),
        frozen=[n for n, p in pipe.named_parameters() if not p.requires_grad and p.grad is not None],
    )
    if rank == world - 1:
        pipe.get_parameter("head.weight").requires_grad_(False)
    try:
        pipe.train_step(x, target=y, loss_fn=loss_fn)
        found["error"] = ""
    except Exception as e:  # noqa: BLE001 - what the test inspects
        found["error"] = f"{type(e).__name__}: {e}"
    return found


def replica_fails(rank: int, world: int) -> dict[str, Any]:
    """Replica 1's share has a row that makes its stage raise: both replicas raise, the healthy
    one naming the failed one's rank and error; the next step trains as the plain model does."""
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    model = FailsAt().double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    share = slice(4 * rank, 4 * rank + 4)
    pipe = compile_pipeline(model, x[share], mesh=mesh, chunks=2, schedule="1f1b", timeout=30)
    bad = x[share].clone()
    if rank == 1:
        bad[2, 0] = 99
    try:
        pipe.train_step(bad, target=y[share], loss_fn=F.mse_loss)
        error = ""
    except Exception as e:  # noqa: BLE001 - what the test inspects
        error = f"{type(e).__name__}: {e}"
    for p in model.parameters():
        p.grad = None
    loss = pipe.train_step(x[share], target=y[share], loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    ref = dict(reference.named_parameters())
    found = dict(
        error=error,
        loss=abs(loss.item() - expected.item()),
        grads=max(_max_diff(p.grad, ref[n].grad) for n, p in model.named_parameters()),
    )
    # Replicas reducing their losses differently cannot combine their gradients: both refuse.
    try:
        pipe.train_step(x[share], target=y[share], loss_fn=_summed if rank == 1 else F.mse_loss, reduction="sum" if rank == 1 else "mean")
        found["reductions"] = "no error"
    except RuntimeError as e:
        found["reductions"] = str(e)
    try:
        _in_mode(pipe, rank == 0, lambda: pipe.train_step(x[share], target=y[share], loss_fn=F.mse_loss))
        found["modes"] = "no error"
    except RuntimeError as e:
        found["modes"] = str(e)
    # Last (the group may be broken after): a hook on a parameter raising inside the gradient
    # all-reduce on replica 1; replica 0, waiting for its share, raises within the timeout.
    quick = compile_pipeline(FailsAt().double(), x[share], mesh=mesh, chunks=2, timeout=3)
    quick.train_step(x[share], target=y[share], loss_fn=F.mse_loss)
    if rank == 1:
        next(iter(quick.parameters())).register_hook(_refusing_hook)
    start = time.monotonic()
    try:
        quick.train_step(x[share], target=y[share], loss_fn=F.mse_loss)
        found["hook"] = "no error"
    except Exception as e:  # noqa: BLE001 - what the test inspects
        found["hook"] = f"{type(e).__name__}: {e}"
    found["hook took"] = time.monotonic() - start
    return found


def _refusing_hook(grad: torch.Tensor) -> torch.Tensor:
    raise ValueError("the hook refuses")


class _WithUnread(nn.Module):
    """A parameter and a buffer that forward never reads, beside two layers."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.spare = nn.Parameter(torch.randn(3))
        self.version: torch.Tensor
        self.register_buffer("version", torch.tensor([7.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)))


def unread_state(rank: int, world: int) -> dict[str, Any]:
    """What no stage reads stays on the first rank, with its values, in its part of the state dict."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = _WithUnread()
    plain = model.state_dict()
    plain = {k: v.clone() for k, v in plain.items()}
    pipe = compile_pipeline(model, torch.randn(4, 4), mesh=mesh, chunks=2, timeout=60)
    state = pipe.state_dict()
    with torch.device("meta"):
        torch.manual_seed(0)
        built_on_meta = _WithUnread()
    meta_pipe = compile_pipeline(built_on_meta, torch.randn(4, 4), mesh=mesh, chunks=2, timeout=60)
    return dict(
        keys=sorted(state),
        plain_keys=sorted(plain),
        equal=all(torch.equal(v, plain[k]) for k, v in state.items()),
        meta_keys=sorted(meta_pipe.state_dict()),
        rnn=_rnn_across(mesh),
    )


class _Recurrent(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre, self.r, self.post = nn.Linear(6, 8), nn.LSTM(8, 8, batch_first=True), nn.Linear(8, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.post(self.r(self.pre(x))[0])


def _rnn_across(mesh: Any) -> float:
    """An LSTM's train step across ranks against the plain model's (its weights, which it keeps
    weak references to, freed on the other rank): the largest difference of the loss and of this
    rank's gradients. Before, compiling was refused as tensors something else holds."""
    torch.manual_seed(0)
    model = _Recurrent().double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(4, 5, 6, dtype=torch.float64), torch.randn(4, 5, 3, dtype=torch.float64)
    pipe = compile_pipeline(model, x, mesh=mesh, chunks=2, timeout=60, split_points=["r"])
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    plain = dict(reference.named_parameters())
    grads = [_max_diff(grad_of(p), grad_of(plain[name])) for name, p in pipe.named_parameters()]
    return max([abs(float(loss) - float(expected)), *grads])


def accumulated_without_sync(rank: int, world: int) -> dict[str, Any]:
    """Two steps inside `pipe.no_sync()` and one after, each replica on its own share: the replicas'
    gradients differ until the last step, which makes them those of the three whole batches."""
    mesh = init_device_mesh("cpu", (1, world), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(7, 4, dtype=torch.float64, generator=g), torch.randn(7, 2, dtype=torch.float64, generator=g)) for _ in range(3)]
    share = slice(0, 3) if rank == 0 else slice(3, None)
    pipe = compile_pipeline(model, batches[0][0][share], mesh=mesh, chunks=2, timeout=60)
    with pipe.no_sync():
        for x, y in batches[:2]:
            pipe.train_step(x[share], target=y[share], loss_fn=F.mse_loss)
    unsynced = [p.grad.flatten().tolist() for p in model.parameters() if p.grad is not None]
    x, y = batches[2]
    pipe.train_step(x[share], target=y[share], loss_fn=F.mse_loss)
    for x, y in batches:
        F.mse_loss(reference(x), y).backward()
    grads = max(_max_diff(grad_of(p), grad_of(q)) for p, q in zip(model.parameters(), reference.parameters()))
    before = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    with torch.no_grad():  # the loss of the whole batch alone, no gradient synced or made
        no_grad_loss = pipe.train_step(x[share], target=y[share], loss_fn=F.mse_loss).item()
    kept = all(torch.equal(a, grad_of(p)) for a, p in zip(before, model.parameters()))
    pipe.eval()
    with torch.no_grad():
        out = pipe(x[share])
    return dict(
        unsynced=unsynced,
        grads=grads,
        no_grad_loss=abs(no_grad_loss - F.mse_loss(reference(x), y).item()),
        grads_kept=kept,
        eval_out=_max_diff(out, reference(x[share])),
    )


class DropsAtTheHead(nn.Module):
    """Dropout in the last stage only: the other rank's stage draws nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh())
        self.drop, self.head = nn.Dropout(0.3), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.body(x)))


def generators_after_a_step(rank: int, world: int) -> str:
    """What the caller's generator holds after a step: the same on every rank (a DataLoader's
    shuffle after the step must agree), though only one rank's stage drew."""
    import hashlib

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(DropsAtTheHead().double(), x, mesh=mesh, chunks=2, split_points=["drop"], timeout=30)
    torch.manual_seed(1)
    pipe.train_step(x, target=torch.zeros(8, 3, dtype=torch.float64), loss_fn=F.mse_loss)
    return hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()


def generators_seeded_per_rank(rank: int, world: int) -> dict[str, Any]:
    """Ranks seeded `seed + rank` (a common habit under torchrun): a model that draws is refused on
    every rank, one that does not runs; seeded alike, the step equals the one-process pipeline's."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.zeros(8, 3, dtype=torch.float64)
    drawing = DropsAtTheHead().double()
    local = compile_pipeline(copy.deepcopy(drawing), x, ["cpu"] * world, chunks=2, split_points=["drop"])
    pipe = compile_pipeline(drawing, x, mesh=mesh, chunks=2, split_points=["drop"], timeout=30)
    drawing.drop.p = 0.0
    quiet = compile_pipeline(copy.deepcopy(drawing), x, mesh=mesh, chunks=2, split_points=["drop"], timeout=30)
    drawing.drop.p = 0.3
    report: dict[str, Any] = {}
    torch.manual_seed(100 + rank)
    try:
        pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        report["apart"] = "no error"
    except RuntimeError as e:
        report["apart"] = str(e)
    torch.manual_seed(100 + rank)
    try:
        with torch.no_grad():
            pipe(x)  # in training mode: dropout draws
        report["apart, forward"] = "no error"
    except RuntimeError as e:
        report["apart, forward"] = str(e)
    torch.manual_seed(100 + rank)
    report["apart, drawing nothing"] = float(quiet.train_step(x, target=y, loss_fn=F.mse_loss))
    torch.manual_seed(100)
    loss = float(pipe.train_step(x, target=y, loss_fn=F.mse_loss))
    torch.manual_seed(100)
    report["alike, against one process"] = abs(loss - float(local.train_step(x, target=y, loss_fn=F.mse_loss)))
    return report


class _StoresLast(nn.Module):
    """Called whole (it stores an attribute): a module the graph cannot see inside, which may
    draw, and does not."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.lin(x))
        self.last = h.detach()
        return h


def _noisy(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target + 0.1 * torch.randn_like(target))


def a_loss_that_draws(rank: int, world: int, whole: bool) -> dict[str, Any]:
    """A loss_fn that draws (label noise), on the last rank, beside a module called whole that
    draws nothing, or none: the loss, the gradients and the generator after the step are the
    plain model's, on every rank; a step whose loss fails leaves every generator as it was."""
    import hashlib

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), _StoresLast() if whole else nn.Tanh(), nn.Linear(6, 6)).double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, mesh=mesh, chunks=2, timeout=30)
    torch.manual_seed(3)
    loss = pipe.train_step(x, target=y, loss_fn=_noisy)
    after = torch.get_rng_state()
    torch.manual_seed(3)
    expected = _noisy(reference(x[:4]), y[:4]) * 0.5 + _noisy(reference(x[4:]), y[4:]) * 0.5  # in turn
    plain_after = torch.get_rng_state()
    expected.backward()
    grads = [float((p.grad - grad_of(q)).abs().max()) for p, q in zip(model.parameters(), reference.parameters()) if p.grad is not None]

    def failing(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        _noisy(out, target)
        raise RuntimeError("after drawing")

    torch.manual_seed(5)
    with contextlib.suppress(StageError):
        pipe.train_step(x, target=y, loss_fn=failing)
    left = torch.get_rng_state()
    torch.manual_seed(5)
    return {
        "loss": abs(float(loss) - float(expected)), "grads": max(grads), "plain's generator": torch.equal(after, plain_after),
        "hash": hashlib.sha1(after.numpy().tobytes()).hexdigest(), "failed step's generator put back": torch.equal(left, torch.get_rng_state()),
    }  # fmt: skip


def out_of_step(rank: int, world: int) -> dict[str, str]:
    """Rank 0 breaks out of a 1f1b loop after two losses and starts another, where rank 1 goes on
    with the first: rank 0's next batch meets rank 1's batch 2."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randn(8, 6, dtype=torch.float64, generator=g), torch.randn(8, 6, dtype=torch.float64, generator=g)) for _ in range(4)]
    pipe = compile_pipeline(model, batches[0][0], mesh=mesh, chunks=2, schedule="1f1b", timeout=30)
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    try:
        for given, _ in enumerate(pipe.train_steps(batches, loss_fn=F.mse_loss, optimizer=opt), 1):
            if given == 2 and rank == 0:
                break
        list(pipe.train_steps(batches, loss_fn=F.mse_loss, optimizer=opt))
    except RuntimeError as e:
        return dict(error=f"{type(e).__name__}: {e}")
    return dict(error="")


def looped(rank: int, world: int) -> dict[str, Any]:
    """pipe.train_steps across processes under 1f1b: the plain loop's losses and parameters on
    every rank (tied weights included); batches that end early on one rank, or raise there,
    make every rank raise at that batch with its parameters after the last update."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model, batches, loss_fn = MODELS["gpt"]()  # its head is tied to the embedding
    batches = batches[:1] * 3 + batches[1:] * 2
    reference = copy.deepcopy(model)
    pipe = compile_pipeline(model, batches[0][0], mesh=mesh, chunks=2, schedule="1f1b", timeout=60)
    opt, ref_opt = torch.optim.Adam(pipe.parameters(), lr=0.01), torch.optim.Adam(reference.parameters(), lr=0.01)
    losses = [float(loss) for loss in pipe.train_steps(batches, loss_fn=loss_fn, optimizer=opt)]
    expected = []
    for x, y in batches:
        ref_opt.zero_grad()
        loss = loss_fn(reference(x), y)
        loss.backward()
        ref_opt.step()
        expected.append(float(loss.detach()))
    ref = dict(reference.named_parameters())
    params = {n: _max_diff(p, ref[n]) for n, p in pipe.named_parameters()}
    # the last rank's batches end after two; rank 0's raise after three on another try
    ended, raised = "", ""
    try:
        list(pipe.train_steps(batches[:2] if rank == world - 1 else batches, loss_fn=loss_fn, optimizer=opt))
    except ValueError as e:
        ended = str(e)
    mine = copy.deepcopy({n: p.detach() for n, p in pipe.named_parameters()})

    def failing() -> Any:
        yield from batches[:3]
        if rank == 0:
            raise OSError("the file went away")
        yield from batches[3:]

    try:
        list(pipe.train_steps(failing(), loss_fn=loss_fn, optimizer=opt))
    except (OSError, RuntimeError) as e:
        raised = f"{type(e).__name__}: {e} | {' '.join(getattr(e, '__notes__', []))}"
    after = {n: p.detach() for n, p in pipe.named_parameters()}
    moved = all(not torch.equal(after[n], mine[n]) for n in mine)  # three updates ran
    return dict(losses=losses, expected=expected, params=params, ended=ended, raised=raised, moved=moved)


def _held_here(pipe: Any, reference: nn.Module) -> dict[str, float]:
    """Each parameter this rank holds against the reference's."""
    ref = dict(reference.named_parameters(remove_duplicate=False))
    return {n: _max_diff(p, ref[n]) for n, p in pipe.named_parameters() if p.device.type != "meta"}


def _plain_2bw(
    model: nn.Module, batches: list[tuple[Any, Any]], make: Callable[[Any], torch.optim.Optimizer], loss_fn: Any, clip: float = 0.0,
) -> list[float]:
    """The plain model trained as PipeDream-2BW trains: batch t on W(t - 1), its update on W(t);
    with `clip`, its gradients clipped to that norm before each update."""

    def step(x: Any, y: Any) -> torch.Tensor:
        loss = loss_fn(model(x), y)
        loss.backward()
        if clip:
            nn.utils.clip_grad_norm_(model.parameters(), clip)
        return loss

    return [float(loss) for loss in delayed_loop(list(model.parameters()), make(model.parameters()), batches, step)]


def looped_2bw(rank: int, world: int) -> dict[str, Any]:
    """train_steps with schedule='2bw' across processes: the plain model's delayed loop on every
    rank, for a weight tied across the ranks and for skips, SGD with momentum and Adam; dropout
    as a twin pipeline stepping one batch at a time on the stale weights draws, in float64 and
    under the caller's bfloat16 autocast; gradients clipped
    in `after_backward` by the norm of every rank's; batches that raise on one rank, differ on
    one, or make a stage raise, stop every rank at the same batch, the updates of the losses
    given applied on each; data-parallel replicas are refused."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    g = torch.Generator().manual_seed(5)
    batches = [(torch.randn(8, 6, dtype=torch.float64, generator=g), torch.randn(8, 6, dtype=torch.float64, generator=g)) for _ in range(6)]
    report: dict[str, Any] = {"exact": []}
    cases = (("tied", "sgd-momentum", "except_last", 0.0), ("fan_out", "adam", "always", 0.0), ("tied", "adam", "never", 0.0),
             ("tied", "sgd-momentum", "except_last", 0.05))  # fmt: skip
    for kind, optimizer, checkpoint, clip in cases:
        torch.manual_seed(0)
        model = (TiedEnds() if kind == "tied" else FanOut()).double()
        reference = copy.deepcopy(model)
        pipe = compile_pipeline(model, batches[0][0], mesh=mesh, chunks=4, schedule="2bw", checkpoint=checkpoint, timeout=60)
        norms: list[float] = []
        clipped = (lambda: norms.append(float(pipe.clip_grad_norm_(clip)))) if clip else None
        optimizer_ = OPTIMIZERS[optimizer](pipe.parameters())
        losses = [float(loss) for loss in pipe.train_steps(batches, loss_fn=F.mse_loss, optimizer=optimizer_, after_backward=clipped)]
        expected = _plain_2bw(reference, batches, OPTIMIZERS[optimizer], F.mse_loss, clip)
        held = sum(p.numel() * p.element_size() for p in {id(p): p for p in pipe.parameters() if p.device.type != "meta"}.values())
        report["exact"].append(dict(
            case=(kind, optimizer, checkpoint, clip), losses=losses, expected=expected, params=_held_here(pipe, reference),
            clipped=not clip or max(norms) > clip, versions=pipe.last_parameter_bytes / held,
        ))  # fmt: skip
    report["dropout"] = _2bw_against_stepwise(mesh, autocast=False)
    report["autocast"] = _2bw_against_stepwise(mesh, autocast=True)
    report["failed"] = _2bw_failures(rank, world, mesh, batches)
    replicas = init_device_mesh("cpu", (1, world), mesh_dim_names=("pp", "dp"))
    pipe = compile_pipeline(FanOut().double(), batches[0][0], mesh=replicas, chunks=4, schedule="2bw", timeout=60)
    try:
        list(pipe.train_steps(batches, loss_fn=F.mse_loss, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1)))  # refused as it reads a batch
        report["replicas"] = ""
    except RuntimeError as e:
        report["replicas"] = str(e)
    return report


def _2bw_against_stepwise(mesh: Any, autocast: bool) -> dict[str, Any]:
    """A GPT with dropout, its head tied to the embedding (on both ranks): the 2bw loop against a
    twin pipeline stepping one batch at a time on the stale weights, which draws the same masks;
    with `autocast`, in float32 under the caller's bfloat16 autocast, else in float64."""
    gpt = example_module("gpt")
    torch.manual_seed(0)
    model = gpt.make_model(n_layer=2, n_embd=16, dropout=0.2).to(torch.float32 if autocast else torch.float64)
    twin = copy.deepcopy(model)
    batches = [gpt.make_batch(4, seed=k) for k in range(5)]
    pipe = compile_pipeline(model, batches[0][0], mesh=mesh, chunks=2, schedule="2bw", timeout=60)
    stepwise = compile_pipeline(twin, batches[0][0], mesh=mesh, chunks=2, schedule="1f1b", timeout=60)
    opt, twin_opt = torch.optim.AdamW(pipe.parameters(), lr=1e-2), torch.optim.AdamW(stepwise.parameters(), lr=1e-2)
    cast = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    torch.manual_seed(3)
    with cast:
        losses = [float(loss) for loss in pipe.train_steps(batches, loss_fn=gpt.loss_fn, optimizer=opt)]
    after = torch.get_rng_state()
    torch.manual_seed(3)
    step = lambda x, y: stepwise.train_step(x, target=y, loss_fn=gpt.loss_fn)  # noqa: E731
    with cast:
        expected = [float(loss) for loss in delayed_loop([p for p in stepwise.parameters() if p.device.type != "meta"], twin_opt, batches, step)]
    twin_params = dict(stepwise.named_parameters())
    params = {n: _max_diff(p, twin_params[n]) for n, p in pipe.named_parameters() if p.device.type != "meta"}
    return dict(losses=losses, expected=expected, params=params, generator=torch.equal(after, torch.get_rng_state()))


def _raise_on(condition: bool) -> None:
    if condition:
        raise RuntimeError("the hook failed")


class _Fussy(nn.Module):
    """Refuses an input out of range: a stage that fails on one batch (kept whole: its check is Python)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if bool(x.abs().max() > 50):
            raise ValueError("a value out of range")
        return x


class _FussyTied(nn.Module):
    """TiedEnds with the input reaching the last stage, through `_Fussy`."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.fussy, self.c = nn.Linear(6, 6), nn.Linear(6, 6), _Fussy(), nn.Linear(6, 6)
        self.c.weight = self.a.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.fussy(self.b(torch.tanh(self.a(x))) + x)))


def _2bw_failures(rank: int, world: int, mesh: Any, batches: list[tuple[Any, Any]]) -> dict[str, Any]:
    """Rank 0's batches raise before batch 3, or rank 1's batch 3 differs, or the last stage
    raises on batch 3 (one of its inputs out of range), or the last rank's `after_backward`
    raises on batch 2, or the last rank's batch 3 holds half the samples, or the last rank froze
    its copy of the tied weight, or is in eval mode, or rank 0 alone holds a forward hook, or the
    last rank replaced a parameter since compiling; or every rank breaks out of the loop after
    three losses."""
    found: dict[str, Any] = {}
    for how in ("raises", "differs", "stage", "hook", "smaller", "break", "frozen", "eval", "hooked", "replaced"):
        torch.manual_seed(0)
        model = (_FussyTied() if how == "stage" else TiedEnds()).double()
        reference = copy.deepcopy(model)
        if how == "hooked" and rank == 0:
            model.a.register_forward_hook(lambda module, args, out: out)
        extra: dict[str, Any] = dict(split_points=["b"], leaf_modules=[_Fussy]) if how == "stage" else {}
        pipe = compile_pipeline(model, batches[0][0], mesh=mesh, chunks=4, schedule="2bw", timeout=60, **extra)
        make = OPTIMIZERS["sgd-momentum"]
        if how == "frozen" and rank == world - 1:
            dict(pipe.named_parameters())["a.weight"].requires_grad_(False)  # the tied weight, on one rank only
        if how == "eval" and rank == world - 1:
            pipe.eval()
        kept_bias = model.a.bias
        if how == "replaced" and rank == world - 1:
            model.a.bias = nn.Parameter(kept_bias.detach().clone())

        def given() -> Any:
            yield from batches[:3]
            if rank == 0 and how == "raises":
                raise OSError("the file went away")
            x, y = batches[3]
            last = rank == world - 1
            yield (x + 1, y) if last and how == "differs" else (x[:4], y[:4]) if last and how == "smaller" else (x + 100, y) if how == "stage" else (x, y)
            yield from batches[4:]

        losses: list[float] = []
        hook = (lambda: _raise_on(len(losses) == 2 and rank == world - 1)) if how == "hook" else None
        started = time.perf_counter()
        try:
            for loss in pipe.train_steps(given(), loss_fn=F.mse_loss, optimizer=make(pipe.parameters()), after_backward=hook):
                losses.append(float(loss))
                if how == "break" and len(losses) == 3:
                    break  # on every rank: the update of batch 2 completes, batch 3 in flight is dropped
            error = ""
        except (OSError, RuntimeError, StageError, ValueError) as e:
            error = f"{type(e).__name__}: {e} | {' '.join(getattr(e, '__notes__', []))}"
        seconds = time.perf_counter() - started
        if how == "frozen":
            dict(pipe.named_parameters())["a.weight"].requires_grad_(True)
        model.a.bias = kept_bias
        pipe.train()
        _plain_2bw(reference, batches[: len(losses)], make, F.mse_loss)  # the updates of the losses given
        found[how] = dict(error=error, given=len(losses), params=_held_here(pipe, reference), seconds=seconds)
        if how == "hooked":
            continue  # (its hook stays on one rank: every step is refused alike)
        # and the pipeline goes on: a synchronous step after the failed loop, as the plain model's
        x, y = batches[0]
        after = float(pipe.train_step(x, target=y, loss_fn=F.mse_loss))
        found[how]["after"] = abs(after - float(F.mse_loss(reference(x), y)))
    return found


class _FussyChain(nn.Module):
    """Three stages (split at b and c); `_Fussy` checks the input in the first (`where` 0) or in
    the second (1, the input reaching it on a skip), or nowhere (None)."""

    def __init__(self, where: Optional[int]) -> None:
        super().__init__()
        self.a, self.b, self.c, self.fussy, self.where = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6), _Fussy(), where

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(self.fussy(x) if self.where == 0 else x))
        h = torch.tanh(self.b(h) + (self.fussy(x) if self.where == 1 else x))
        return self.c(h)


def _fussy_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    if bool(target.abs().max() > 500):
        raise KeyboardInterrupt("interrupted in the loss")
    if bool(target.abs().max() > 50):
        raise ValueError("the loss refused its target")
    return F.mse_loss(out, target)


def failures_of_2bw_on_three_ranks(rank: int, world: int) -> dict[str, Any]:
    """A 2bw loop over a chain of three ranks whose batch 1 makes the first stage raise (rank 2
    reads nothing from rank 0), or the middle stage, or the loss function: how long the loop
    took to stop, the error, the losses given, this rank's parameters against the delayed plain
    loop of those losses, and a synchronous step after it against the plain model; or the loss
    function is interrupted (KeyboardInterrupt, as it is on the rank where it struck)."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    g = torch.Generator().manual_seed(7)
    batches = [(torch.randn(8, 6, dtype=torch.float64, generator=g), torch.randn(8, 6, dtype=torch.float64, generator=g)) for _ in range(4)]
    found: dict[str, Any] = {}
    for how, where in (("first", 0), ("middle", 1), ("loss", None), ("interrupt", None)):
        torch.manual_seed(0)
        model = _FussyChain(where).double()
        reference = copy.deepcopy(model)
        pipe = compile_pipeline(
            model, batches[0][0], mesh=mesh, chunks=4, schedule="2bw", timeout=30, split_points=["b", "c"], leaf_modules=[_Fussy],
        )  # fmt: skip
        x, y = batches[1]
        poisoned = [batches[0], (x, y + 100) if how == "loss" else (x, y + 1000) if how == "interrupt" else (x + 100, y), *batches[2:]]
        make = OPTIMIZERS["sgd-momentum"]
        losses: list[float] = []
        optimizer = make(pipe.parameters())  # (a process's first imports torch._dynamo: seconds)
        start = time.perf_counter()
        try:
            for loss in pipe.train_steps(poisoned, loss_fn=_fussy_loss, optimizer=optimizer):
                losses.append(float(loss))
            error = ""
        except (RuntimeError, StageError, ValueError, KeyboardInterrupt) as e:
            error = f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - start
        _plain_2bw(reference, batches[: len(losses)], make, F.mse_loss)  # the updates of the losses given
        x, y = batches[0]
        after = abs(float(pipe.train_step(x, target=y, loss_fn=F.mse_loss)) - float(F.mse_loss(reference(x), y).detach()))
        found[how] = dict(error=error, given=len(losses), seconds=seconds, params=_held_here(pipe, reference), after=after)
    return found


def sequence_slices_across(rank: int, world: int) -> dict[str, float]:
    """A causal GPT compiled with sequence_chunks, each stage on its own rank: train_step under
    1f1b and zb-h1 (rows of uneven slices, every checkpoint mode), and pipe(x) in eval, against the
    plain model on every rank (each rank checking the parameters it holds)."""
    from sequence_models import RotaryGPT, tokens

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    found: dict[str, float] = {}
    loss_fn = lambda out, t: F.cross_entropy(out.flatten(0, 1), t.flatten())  # noqa: E731
    x, y = tokens(4, 12), tokens(4, 12, seed=5)
    for schedule, checkpoint in (("1f1b", "except_last"), ("zb-h1", "always"), ("gpipe", "never")):
        torch.manual_seed(0)
        model = RotaryGPT(layers=2).double()
        for block in model.blocks:  # written before compiling (a checkpoint loaded): each rank frees another's
            block.get_buffer("bias").mul_(1)
        reference = copy.deepcopy(model)
        pipe = compile_pipeline(model, x, mesh=mesh, chunks=2, sequence_chunks=[5, 3, 4], schedule=schedule, checkpoint=checkpoint, timeout=60)
        loss = pipe.train_step(x, target=y, loss_fn=loss_fn)
        expected = loss_fn(reference(x), y)
        expected.backward()
        found[f"{schedule} loss"] = abs(loss.item() - expected.item())
        ref = dict(reference.named_parameters())
        held = [(n, p) for n, p in pipe.named_parameters() if p.grad is not None]
        found[f"{schedule} gradients"] = max(_max_diff(grad_of(p), grad_of(ref[n])) for n, p in held)
        found[f"{schedule} held"] = float(len(held))
    pipe.eval()
    reference.eval()
    with torch.no_grad():
        out = pipe(x)
        found["eval out"] = -1.0 if out is None else float((out - reference(x)).abs().max())
    # A 2bw loop of slices, against the delayed plain loop.
    torch.manual_seed(0)
    model = RotaryGPT(layers=2).double()
    reference = copy.deepcopy(model)
    batches = [(tokens(4, 12, seed=s), tokens(4, 12, seed=s + 1)) for s in (1, 3, 5)]
    pipe = compile_pipeline(model, x, mesh=mesh, chunks=2, sequence_chunks=[5, 3, 4], schedule="2bw", timeout=60)
    losses = list(pipe.train_steps(batches, loss_fn=loss_fn, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)))

    def step(inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(reference(inputs), target)
        loss.backward()
        return loss

    delayed = delayed_loop(list(reference.parameters()), torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), batches, step)
    found["2bw losses"] = max(abs(a.item() - b.item()) for a, b in zip(losses, delayed))
    ref = dict(reference.named_parameters())
    found["2bw parameters"] = max(_max_diff(p, ref[n]) for n, p in pipe.named_parameters())
    found.update(_auto_slices_in_a_2bw_loop(mesh, x, loss_fn))
    return found


def _auto_slices_in_a_2bw_loop(mesh: Any, x: torch.Tensor, loss_fn: Callable[..., torch.Tensor]) -> dict[str, float]:
    """sequence_chunks='auto' in a 2bw loop whose batches change length (12 and 10 positions): every
    rank cuts each batch into the first batch's count of slices, and the loop is the delayed plain one."""
    from sequence_models import RotaryGPT, tokens

    torch.manual_seed(0)
    model = RotaryGPT(layers=2).double()
    reference = copy.deepcopy(model)
    batches = [(tokens(4, n, seed=s), tokens(4, n, seed=s + 1)) for s, n in ((1, 12), (3, 10), (5, 12))]
    pipe = compile_pipeline(model, x, mesh=mesh, chunks=2, sequence_chunks="auto", schedule="2bw", timeout=60)
    assert pipe._compiled.slicing is not None
    # Costs under which 'auto' cuts 12 positions into 6 slices (a small model's own cut none).
    pipe._compiled.slicing = dataclasses.replace(pipe._compiled.slicing, auto=(1.0, 0.0, 0.2, 2))
    losses = list(pipe.train_steps(batches, loss_fn=loss_fn, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9)))
    ran = {r.micro_batch for r in pipe.timeline().records}

    def step(inputs: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        loss = loss_fn(reference(inputs), target)
        loss.backward()
        return loss

    delayed = delayed_loop(list(reference.parameters()), torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9), batches, step)
    ref = dict(reference.named_parameters())
    return {
        "2bw auto losses": max(abs(a.item() - b.item()) for a, b in zip(losses, delayed)),
        "2bw auto parameters": max(_max_diff(p, ref[n]) for n, p in pipe.named_parameters()),
        "2bw auto micro-batches": float(len(ran)),
    }


def one_rank_failing_in_the_loop(rank: int, world: int) -> dict[str, Any]:
    """train_steps under 1f1b and 2bw where rank 1 alone fails on batch 1, in after_backward, in
    the optimizer's step or in after_step: how long each rank took to stop, its error, the losses
    given, and this rank's parameters against the plain loop after one update and after two."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randn(8, 6, dtype=torch.float64, generator=g), torch.randn(8, 6, dtype=torch.float64, generator=g)) for _ in range(4)]
    found: dict[str, Any] = {}
    for schedule in ("1f1b", "2bw"):
        for what in ("after_backward", "step", "after_step"):
            torch.manual_seed(0)
            model = FanOut().double()
            reference = copy.deepcopy(model)
            pipe = compile_pipeline(model, batches[0][0], mesh=mesh, chunks=4, schedule=schedule, timeout=30)
            calls = {"after_backward": 0, "step": 0, "after_step": 0}

            def fails(where: str) -> None:
                calls[where] += 1
                if where == what and rank == 1 and calls[where] == 2:
                    raise ValueError(f"{where} failed here")

            class Failing(torch.optim.SGD):
                def step(self, closure: Any = None) -> Any:
                    fails("step")
                    return super().step(closure)

            losses: list[float] = []
            start = time.perf_counter()
            try:
                for loss in pipe.train_steps(batches, loss_fn=F.mse_loss, optimizer=Failing(pipe.parameters(), lr=0.1),
                                             after_backward=lambda: fails("after_backward"), after_step=lambda: fails("after_step")):  # fmt: skip
                    losses.append(float(loss))
                error = ""
            except (RuntimeError, StageError, ValueError) as e:
                error = f"{type(e).__name__}: {e} {getattr(e, '__notes__', '')}"
            seconds = time.perf_counter() - start
            held = {}
            for updates in (1, 2):
                plain = copy.deepcopy(reference)
                make = lambda params: torch.optim.SGD(params, lr=0.1)  # noqa: E731
                if schedule == "2bw":
                    _plain_2bw(plain, batches[:updates], make, F.mse_loss)
                else:
                    optimizer = make(plain.parameters())
                    for x, y in batches[:updates]:
                        optimizer.zero_grad()
                        F.mse_loss(plain(x), y).backward()
                        optimizer.step()
                held[updates] = max(_held_here(pipe, plain).values())
            found[f"{schedule} {what}"] = dict(error=error, given=len(losses), seconds=seconds, held=held)
    return found


def assigned_apart(rank: int, world: int) -> dict[str, Any]:
    """A weight tied across two ranks, loaded with `assign=True` (which unties it, as in plain
    PyTorch), then a step: the keys each rank's state dict holds, and how far each is from the
    plain model loaded and stepped alike."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    whole = {k: v.clone() + 0.5 for k, v in TiedEnds().double().state_dict().items()}
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(TiedEnds().double(), x, mesh=mesh, chunks=2, split_points=["b"], timeout=60)
    pipe.load_state_dict({k: v.clone() for k, v in whole.items()}, assign=True)
    plain = TiedEnds().double()
    plain.load_state_dict({k: v.clone() for k, v in whole.items()}, assign=True)
    for model in (pipe, plain):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
        if model is pipe:
            pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        else:
            F.mse_loss(plain(x), y).backward()
        optimizer.step()
    expected = plain.state_dict()
    held = {k: v for k, v in pipe.state_dict().items() if v.device.type != "meta"}
    shared = TiedEnds().double().state_dict()  # as torch.load gives a tied weight: its keys one memory
    before = {k: v.clone() for k, v in pipe.state_dict().items()}
    try:
        pipe.load_state_dict(shared, assign=True)
        refused = "no error"
    except RuntimeError as e:
        refused = str(e)
    unchanged = all(torch.equal(v, before[k]) for k, v in pipe.state_dict().items() if v.device.type != "meta")
    return {"keys": sorted(held), "apart": {k: _max_diff(v, expected[k]) for k, v in held.items()}, "refused": refused, "unchanged": unchanged}


class _SparseTied(nn.Module):
    """A sparse embedding (its gradient a sparse tensor), tied to the head or not."""

    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.emb, self.mid, self.head = nn.Embedding(11, 6, sparse=True), nn.Linear(6, 6), nn.Linear(6, 11, bias=False)
        if tied:
            self.head.weight = self.emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mid(self.emb(idx))))


def sparse_embeddings(rank: int, world: int, layout: str) -> dict[str, Any]:
    """'pp': the sparse embedding tied to the head on the other rank, its gradients summed across
    the ranks ('pp-untied': apart); 'dp': two replicas of one stage, a step under no_sync and a
    synced one, the sparse gradient averaged as DDP averages it. Against the plain model on the
    whole batch; then clipped."""
    mesh = init_device_mesh("cpu", (1, world) if layout == "dp" else (world, 1), mesh_dim_names=("pp", "dp"))
    torch.manual_seed(0)
    model = _SparseTied(tied=layout == "pp").double()
    reference = copy.deepcopy(model)
    g = torch.Generator().manual_seed(3)
    x, y = torch.randint(0, 11, (8, 5), generator=g), torch.randint(0, 11, (8, 5), generator=g)

    def loss_fn(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), t.flatten())

    share = slice(4 * rank, 4 * rank + 4) if layout == "dp" else slice(None)
    pipe = compile_pipeline(model, x[share], mesh=mesh, chunks=2, split_points=None if layout == "dp" else ["head"], timeout=30)
    with pipe.no_sync() if layout == "dp" else contextlib.nullcontext():
        pipe.train_step(x[share], target=y[share], loss_fn=loss_fn)
    pipe.train_step(x[share], target=y[share], loss_fn=loss_fn)
    (2 * loss_fn(reference(x), y)).backward()
    ref = dict(reference.named_parameters())
    held = [(n, p) for n, p in model.named_parameters() if p.grad is not None and not p.grad.is_meta]
    found: dict[str, Any] = dict(
        grads=max(_max_diff(grad_of(p).to_dense(), grad_of(ref[n]).to_dense()) for n, p in held),
        sparse=[n for n, p in held if p.grad is not None and p.grad.layout == torch.sparse_coo],
    )
    start = time.monotonic()
    found["clipped"] = _said(lambda: pipe.clip_grad_norm_(1.0), RuntimeError, NotImplementedError)  # (torch's takes no sparse gradient)
    found["took"] = time.monotonic() - start
    return found


def one_rank_stepping_apart_under_2bw(rank: int, world: int) -> dict[str, Any]:
    """A 2bw loop over TiedEnds (its weight tied across the two ranks) where rank 1 alone, after
    the loss of batch 1, clears the optimizer's state ("state") or writes the gradients in place
    ("written"), or in its own after_backward clips by torch's clip_grad_norm_ over its own
    parameters ("clipped"), or in its after_step of batch 0 halves its lr ("lr"), or breaks out
    of the loop after the loss of batch 1 ("break"), or its loop body raises there ("body"); or
    no rank does ("none"): how long each rank took to stop, its error, the losses given, the
    parameters against the delayed plain loop of those losses, and a train_step after the loop
    against the plain model's."""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    g = torch.Generator().manual_seed(11)
    batches = [(torch.randn(8, 6, dtype=torch.float64, generator=g), torch.randn(8, 6, dtype=torch.float64, generator=g)) for _ in range(6)]
    make = OPTIMIZERS["sgd-momentum"]
    found: dict[str, Any] = {}
    for how in ("state", "written", "clipped", "lr", "break", "body", "none"):
        torch.manual_seed(0)
        model = TiedEnds().double()
        reference = copy.deepcopy(model)
        pipe = compile_pipeline(model, batches[0][0], mesh=mesh, chunks=4, schedule="2bw", timeout=30)
        optimizer = make(pipe.parameters())
        apart = rank == 1
        held = [p for p in pipe.parameters() if p.device.type != "meta"]
        clip = (lambda: nn.utils.clip_grad_norm_(held, 1e-3)) if how == "clipped" and apart else None

        steps: list[int] = []

        def halve() -> None:
            steps.append(1)
            if how == "lr" and apart and len(steps) == 1:
                for group in optimizer.param_groups:
                    group["lr"] *= 0.5

        losses: list[float] = []
        start = time.perf_counter()
        try:
            for loss in pipe.train_steps(batches, loss_fn=F.mse_loss, optimizer=optimizer, after_backward=clip, after_step=halve):
                losses.append(float(loss))
                if len(losses) == 2 and apart and how == "state":
                    optimizer.state.clear()
                if len(losses) == 2 and apart and how == "written":
                    for p in held:
                        p.grad.mul_(0.5)  # type: ignore[union-attr]
                if len(losses) == 2 and apart and how == "break":
                    break
                if len(losses) == 2 and apart and how == "body":
                    raise KeyError("the loop body failed")
            error = ""
        except (KeyError, RuntimeError, StageError, ValueError) as e:
            error = f"{type(e).__name__}: {e}"
        seconds = time.perf_counter() - start
        _plain_2bw(reference, batches[: len(losses)], make, F.mse_loss)
        found[how] = dict(error=error, given=len(losses), seconds=seconds, params=max(_held_here(pipe, reference).values()))
        if how in ("break", "body"):  # the ranks stopped at one batch: a step after the loop runs on both
            x, y = batches[0]
            found[how]["after"] = abs(float(pipe.train_step(x, target=y, loss_fn=F.mse_loss)) - float(F.mse_loss(reference(x), y)))
    return found


def refused_on_one_rank(rank: int, world: int) -> dict[str, Any]:
    """train_step and pipe(x) refused by a check of rank 1's own before the ranks meet (a call
    inside torch.nn.utils.parametrize.cached() there alone): how long each rank took to raise
    and what, then a train_step on every rank against the plain model's."""
    from torch.nn.utils import parametrize

    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("pp",))
    torch.manual_seed(0)
    model = FanOut().double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, mesh=mesh, chunks=4, timeout=30)
    found: dict[str, Any] = {}
    for what, call in (("train_step", lambda: pipe.train_step(x, target=y, loss_fn=F.mse_loss)), ("pipe(x)", lambda: pipe(x))):
        start = time.perf_counter()
        try:
            with parametrize.cached() if rank == 1 else contextlib.nullcontext(), torch.no_grad() if what == "pipe(x)" else contextlib.nullcontext():
                call()
            error = ""
        except RuntimeError as e:
            error = f"{type(e).__name__}: {e}"
        found[what] = dict(error=error, seconds=time.perf_counter() - start)
    found["after"] = abs(float(pipe.train_step(x, target=y, loss_fn=F.mse_loss)) - float(F.mse_loss(reference(x), y)))
    return found
