"""Random DAG models as Python source, the uses a pipeline must get right, and the checks.

A model is described by a `Spec` (width, a list of ops each reading 1-2 earlier values, a
dropout rate) and generated as the source of a `Model(nn.Module)` class, so that a failing case
prints a model one can paste and run. `check(...)` runs one (model, stages, chunks, mode, use)
case against the plain model and raises AssertionError on the first difference.
"""
from __future__ import annotations

import copy
import linecache
import random
import textwrap
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Union, cast

import torch
import torch.nn.functional as F  # noqa: F401  (used by the generated sources)
from torch import nn

from fxpipe import Pipeline, compile_pipeline
# torch.manual_seed without its recording of the caller's stack for accelerators not started (slow here)
from fxpipe.core.randomness import seed_started_generators

MODES = ("always", "except_last", "never")
USES = ("train_step", "eval", "no_grad", "autocast_bf16", "two_forwards", "grad_inputs", "scheduled")
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")

# Each op makes one value `v{k}` from `h`, the sum of the values it picks.
OP_KINDS = (
    "linear",  # tanh(Linear(h))
    "dropout_module",  # nn.Dropout(p) after tanh(Linear(h))
    "dropout_functional",  # F.dropout(tanh(Linear(h)), self.p, self.training)
    "batchnorm",  # tanh(BatchNorm1d(Linear(h)))
    "buffer_count",  # self.count.add_(1) on a registered buffer, read by the value
    "running_mean",  # a buffer updated with mul_/add_ from the batch, subtracted from the value
    "inplace",  # add_, mul_, relu_ on an intermediate, one read made before the writes
    "views",  # slices, view, transpose, cat
    "view_write",  # an in-place write through a view (slice / view / transpose)
    "tied",  # two Linear layers sharing one weight (two ops of this kind)
    "twice",  # one module called at two places (two ops of this kind)
    "training_branch",  # if self.training: ... else: ...
    "function",  # a custom autograd Function whose backward is not autograd's of its forward
    "aliases",  # a parameter and a module each held under two names
    "buffer_read",  # a buffer read through an op (clone), not only passed to a module
    "dict_output",  # the model returns a dict
    "tensor_default",  # a forward argument with a tensor default
)

FEATURES = (
    "plain",
    "dropout_module",
    "dropout_functional",
    "batchnorm",
    "buffer_count",
    "running_mean",
    "inplace",
    "views",
    "view_write",
    "fanout",
    "tied_weights",
    "module_twice",
    "training_branch",
    "function",
    "aliases",
    "buffer_read",
    "dict_output",
    "tensor_default",
    "mixed",
)

FEATURE_OPS = {
    "plain": (),
    "dropout_module": ("dropout_module",),
    "dropout_functional": ("dropout_functional",),
    "batchnorm": ("batchnorm",),
    "buffer_count": ("buffer_count",),
    "running_mean": ("running_mean",),
    "inplace": ("inplace",),
    "views": ("views",),
    "view_write": ("view_write",),
    "fanout": (),
    "tied_weights": ("tied",),
    "module_twice": ("twice",),
    "training_branch": ("training_branch",),
    "function": ("function",),
    "aliases": ("aliases",),
    "buffer_read": ("buffer_read",),
    "dict_output": ("dict_output",),
    "tensor_default": ("tensor_default",),
    "mixed": tuple(k for k in OP_KINDS if k != "linear"),
}


@dataclass
class Op:
    kind: str
    picks: tuple[int, ...]
    variant: int = 0


@dataclass
class Spec:
    width: int
    ops: list[Op]
    returns: tuple[int, ...]  # values returned besides the head (sum of every unused value)
    p: float = 0.0
    notes: list[str] = field(default_factory=list)
    # "torch.export": forward takes *inputs, which torch.fx cannot trace, so that compiling
    # goes through torch.export
    front_end: str = "torch.fx"

    def has(self, *kinds: str) -> bool:
        return any(op.kind in kinds for op in self.ops)

    @property
    def drops(self) -> bool:
        return self.has("dropout_module", "dropout_functional")

    @property
    def stateful(self) -> bool:
        return self.has("batchnorm", "buffer_count", "running_mean")


class Doubled(torch.autograd.Function):
    """Identity in forward; doubles the gradient in backward (autograd of the forward would not)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return grad * 2


# -- the source of a model -----------------------------------------------------------------------
def source(spec: Spec, name: str = "Model") -> str:
    w = spec.width
    init = ["super().__init__()", "self.p = p"]
    body: list[str] = ["v0 = x"]
    used: set[int] = set()
    tied_seen = twice_seen = 0
    late: list[str] = []  # buffers the head reads
    for k, op in enumerate(spec.ops, start=1):
        used.update(op.picks)
        h = " + ".join(f"v{j}" for j in op.picks)
        body.append(f"h = {h}")
        kind, var = op.kind, op.variant
        if kind == "linear":
            init.append(f"self.l{k} = nn.Linear({w}, {w})")
            body.append(f"v{k} = torch.tanh(self.l{k}(h))")
        elif kind == "dropout_module":
            init += [f"self.l{k} = nn.Linear({w}, {w})", f"self.drop{k} = nn.Dropout(p)"]
            body.append(f"v{k} = self.drop{k}(torch.tanh(self.l{k}(h)))")
        elif kind == "dropout_functional":
            init.append(f"self.l{k} = nn.Linear({w}, {w})")
            body.append(f"v{k} = F.dropout(torch.tanh(self.l{k}(h)), self.p, self.training)")
        elif kind == "batchnorm":
            init += [f"self.l{k} = nn.Linear({w}, {w})", f"self.bn{k} = nn.BatchNorm1d({w})"]
            body.append(f"v{k} = torch.tanh(self.bn{k}(self.l{k}(h)))")
        elif kind == "buffer_count":  # variant 1, 2: the head reads the count too (a later stage)
            init += [f"self.l{k} = nn.Linear({w}, {w})", f'self.register_buffer("count{k}", torch.zeros((), dtype=torch.long))']
            body.append(f"self.count{k}.add_(1)")
            body.append(f"v{k} = torch.tanh(self.l{k}(h))" if var % 3 == 1 else f"v{k} = torch.tanh(self.l{k}(h) + 0.1 * self.count{k})")
            if var % 3:
                late.append(f"0.01 * self.count{k}")
        elif kind == "running_mean":  # variant 1, 2: the head reads the mean too
            init += [f"self.l{k} = nn.Linear({w}, {w})", f'self.register_buffer("mean{k}", torch.zeros({w}))']
            body += [f"y = self.l{k}(h)", f"self.mean{k}.mul_(0.9).add_(0.1 * y.detach().mean(0))"]
            body.append(f"v{k} = torch.tanh(y)" if var % 3 == 1 else f"v{k} = torch.tanh(y - self.mean{k})")
            if var % 3:
                late.append(f"self.mean{k}")
        elif kind == "inplace":
            init.append(f"self.l{k} = nn.Linear({w}, {w})")
            body += [f"y = self.l{k}(h)", "r = y * 2"]  # read before the writes
            body += ["y.add_(h)", "y.mul_(0.5)"] if var % 2 == 0 else ["y.mul_(0.5)", "y.add_(h)"]
            body += ["y.relu_()", f"v{k} = torch.tanh(y) + r"]
        elif kind == "views":
            init.append(f"self.l{k} = nn.Linear({w}, {w})")
            body.append(f"y = torch.tanh(self.l{k}(h))")
            if var % 3 == 0:
                body.append(f"v{k} = torch.cat([y[:, {w // 2}:], y[:, :{w // 2}] * 2], 1)")
            elif var % 3 == 1:
                body.append(f"v{k} = y.view(-1, 2, {w // 2}).transpose(1, 2).reshape(-1, {w})")
            else:
                body.append(f"v{k} = y.transpose(0, 1)[1:].transpose(0, 1).sum(1, keepdim=True) + y")
        elif kind == "view_write":
            init.append(f"self.l{k} = nn.Linear({w}, {w})")
            body.append(f"y = self.l{k}(h)")
            if var >= 3:  # a read before the write, used after it
                body.append("r = y.sum(1, keepdim=True)")
            if var % 3 == 0:
                body.append("y[:, :2].mul_(2)")
            elif var % 3 == 1:
                body.append(f"y.view(-1, 2, {w // 2})[:, 1].add_(1)")
            else:
                body.append("y.transpose(0, 1)[0].mul_(3)")
            body.append(f"v{k} = y + r" if var >= 3 else f"v{k} = y")
        elif kind == "tied":
            if tied_seen == 0:
                init.append(f"self.tie_a = nn.Linear({w}, {w})")
                body.append(f"v{k} = torch.tanh(self.tie_a(h))")
            else:
                init += [f"self.tie_b{k} = nn.Linear({w}, {w})", f"self.tie_b{k}.weight = self.tie_a.weight"]
                body.append(f"v{k} = torch.tanh(self.tie_b{k}(h))")
            tied_seen += 1
        elif kind == "twice":
            if twice_seen == 0:
                init.append(f"self.shared = nn.Linear({w}, {w})")
            body.append(f"v{k} = torch.tanh(self.shared(h))")
            twice_seen += 1
        elif kind == "training_branch":
            init.append(f"self.l{k} = nn.Linear({w}, {w})")
            body += [
                f"y = self.l{k}(h)",
                "if self.training:",
                "    y = y * 0.5 + 0.25",
                "else:",
                "    y = torch.sigmoid(y) - 0.5",
                f"v{k} = torch.tanh(y)",
            ]
        elif kind == "function":
            init.append(f"self.l{k} = nn.Linear({w}, {w})")
            body.append(f"v{k} = Doubled.apply(torch.tanh(self.l{k}(h)))")
        elif kind == "aliases":
            init += [
                f"self.p{k} = nn.Parameter(torch.randn({w}, {w}) * 0.3)", f"self.q{k} = self.p{k}",
                f"self.l{k} = nn.Linear({w}, {w})", f"self.m{k} = self.l{k}",
            ]  # fmt: skip
            body.append(f"v{k} = torch.tanh(self.m{k}(h @ self.p{k}) + h @ self.q{k}.t())")
        elif kind == "buffer_read":
            init += [f"self.l{k} = nn.Linear({w}, {w})", f'self.register_buffer("c{k}", torch.randn({w}))']
            body.append(f"v{k} = torch.tanh(self.l{k}(h) + self.c{k}.clone() * 0.5)")
        elif kind in ("dict_output", "tensor_default"):
            init.append(f"self.l{k} = nn.Linear({w}, {w})")
            body.append(f"v{k} = torch.tanh(self.l{k}(h) + bias)" if kind == "tensor_default" else f"v{k} = torch.tanh(self.l{k}(h))")
        else:
            raise ValueError(kind)
    n = len(spec.ops)
    unused = [j for j in range(1, n + 1) if j not in used] or [n]
    init.append(f"self.head = nn.Linear({w}, {w})")
    body.append(f"out = self.head({' + '.join(f'v{j}' for j in unused)})")
    if late:
        body.append(f"out = out - {' - '.join(late)}")
    if spec.has("dict_output"):
        body.append(f"return {{'out': out, {', '.join(f'{chr(39)}v{j}{chr(39)}: v{j}' for j in spec.returns)}}}")
    elif spec.returns:
        body.append(f"return out, {', '.join(f'v{j}' for j in spec.returns)}")
    else:
        body.append("return out")
    ind = " " * 8
    return (
        f"class {name}(nn.Module):\n"
        f"    def __init__(self, p={spec.p}):\n" + "".join(f"{ind}{line}\n" for line in init) + "\n"
        + _signature(spec)
        + "".join(f"{ind}{line}\n" for line in body)
    )


def _signature(spec: Spec) -> str:
    default = ", bias=torch.full((1,), 0.1)" if spec.has("tensor_default") else ""
    if spec.front_end == "torch.export":
        return f"    def forward(self, *inputs{default}):\n        x = inputs[0]\n"
    return f"    def forward(self, x{default}):\n"


_counter = [0]


def model_class(spec: Spec) -> type:
    """Exec the source with a file name linecache knows, so tracebacks and fx show the lines."""
    src = source(spec)
    _counter[0] += 1
    filename = f"<fxpipe-dag-{_counter[0]}>"
    linecache.cache[filename] = (len(src), None, src.splitlines(True), filename)
    namespace: dict[str, Any] = {"torch": torch, "nn": nn, "F": F, "Doubled": Doubled}
    exec(compile(src, filename, "exec"), namespace)
    return namespace["Model"]


def make_model(spec: Spec, p: Optional[float], seed: int, dtype: torch.dtype) -> nn.Module:
    seed_started_generators(seed)
    model = model_class(spec)(spec.p if p is None else p)
    return model.to(dtype)


# -- running a use -------------------------------------------------------------------------------
def as_tuple(out: Any) -> tuple[torch.Tensor, ...]:
    if isinstance(out, dict):
        assert type(out) is dict, f"a {type(out).__name__} instead of the model's dict"
        return tuple(out.values())
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def mean_loss_of(out: Any) -> torch.Tensor:
    """A loss that is a mean over samples, as `train_step` combines micro-batch losses."""
    total: Union[torch.Tensor, int] = 0
    for i, o in enumerate(as_tuple(out)):
        total = total + o.pow(2).mean() + (i + 1) * 0.1 * o.mean()
    return cast(torch.Tensor, total)  # a sum of tensors: the outputs are never empty


def loss_of(out: Any) -> torch.Tensor:
    total: Union[torch.Tensor, int] = 0
    for i, o in enumerate(as_tuple(out)):
        total = total + (o.float() if o.dtype == torch.bfloat16 else o).pow(2).mean() + (i + 1) * 0.1 * o.sum()
    return cast(torch.Tensor, total)  # a sum of tensors: the outputs are never empty


def micro_batched(model: nn.Module, chunks: int) -> Callable[[torch.Tensor], Any]:
    """The plain model run on the micro-batches one after another, outputs concatenated."""

    def forward(x: torch.Tensor) -> Any:
        outs = [as_tuple(model(piece)) for piece in torch.tensor_split(x, chunks)]
        cat = tuple(torch.cat([o[i] for o in outs]) for i in range(len(outs[0])))
        return cat if len(cat) > 1 else cat[0]

    return forward


def state(module: nn.Module) -> dict[str, Any]:
    return {
        "params": {n: p.detach().clone() for n, p in module.named_parameters()},
        "grads": {n: (None if p.grad is None else p.grad.detach().clone()) for n, p in module.named_parameters()},
        "buffers": {n: b.detach().clone() for n, b in module.named_buffers()},
    }


Optimizer = Callable[[Any], torch.optim.Optimizer]
# The optimizers the delayed-update (2BW) loops are checked with, by name, from the parameters.
OPTIMIZERS: dict[str, Optimizer] = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def delayed_loop(
    params: list[torch.Tensor], optimizer: torch.optim.Optimizer, batches: list[tuple[Any, Any]], step: Callable[[Any, Any], torch.Tensor],
) -> list[torch.Tensor]:
    """PipeDream-2BW's updates: batch t's loss and gradients (`step(x, y)`, which runs the
    backward) on W(t - 1), the optimizer's step applied to W(t); buffers (one copy) move with
    every forward."""
    stale = [p.detach().clone() for p in params]
    losses = []
    for x, y in batches:
        live = [p.detach().clone() for p in params]
        with torch.no_grad():
            for p, old in zip(params, stale):
                p.copy_(old)
        optimizer.zero_grad()
        losses.append(step(x, y).detach().clone())
        with torch.no_grad():
            for p, new in zip(params, live):
                p.copy_(new)
        optimizer.step()
        stale = live
    return losses


def _backward_of(loss: torch.Tensor) -> torch.Tensor:
    loss.backward()
    return loss


def detach(out: Any) -> tuple[torch.Tensor, ...]:
    return tuple(o.detach().clone() for o in as_tuple(out))


def run_use(use: str, module: nn.Module, forward: Callable[[torch.Tensor], Any], xs: list[torch.Tensor], dropout_active: bool) -> dict[str, Any]:
    """Run `use` through `forward` (the pipeline, or the plain model on micro-batches) and
    return what must match: outputs, their dtypes, gradients, buffers, input gradients."""
    result: dict[str, Any] = {}
    x, x2 = xs[0].clone(), xs[1].clone()
    if use == "train_step":  # two steps of SGD: the second sees the parameters the first left
        out = forward(x)
        loss_of(out).backward()
        result["out"] = detach(out)
        result["step 1 state"] = state(module)
        torch.optim.SGD(module.parameters(), lr=0.1).step()
        module.zero_grad(set_to_none=True)
        out = forward(x2)
        loss_of(out).backward()
        result["step 2 out"] = detach(out)
    elif use == "scheduled":  # two steps of SGD through train_step, under the pipeline's schedule
        for k, batch in enumerate((x, x2)):
            if hasattr(module, "train_step"):
                loss, out = cast(Pipeline, module).train_step(batch, loss_fn=lambda o, _: mean_loss_of(o), return_outputs=True)
            else:
                out = forward(batch)
                loss = mean_loss_of(out)
                loss.backward()
            result[f"step {k + 1} loss"] = loss.detach().clone()
            result[f"step {k + 1} out"] = detach(out)
            result[f"step {k + 1} state"] = state(module)
            torch.optim.SGD(module.parameters(), lr=0.1).step()
            module.zero_grad(set_to_none=True)
    elif use == "loop_2bw":  # four batches of SGD with momentum, each on the weights of the batch before last
        batches = [(batch, None) for batch in (x, x2, x, x2)]
        if hasattr(module, "train_steps"):
            optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
            steps = cast(Pipeline, module).train_steps(batches, loss_fn=lambda o, _: mean_loss_of(o), optimizer=optimizer)
            losses = list(steps)
        else:
            optimizer = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
            losses = delayed_loop(list(module.parameters()), optimizer, batches, lambda x, _: _backward_of(mean_loss_of(forward(x))))
        result["losses"] = torch.stack(losses)
        result["state after the loop"] = state(module)
    elif use == "eval":
        if not dropout_active:
            with torch.no_grad():
                forward(x2)  # a training forward first: running statistics and counters move
        module.eval()
        out = forward(x)
        loss_of(out).backward()
        result["eval out"] = detach(out)
        result["eval state"] = state(module)
        module.train()
        with torch.no_grad():
            back = forward(x2)
        if not dropout_active:
            result["train out after eval"] = detach(back)
        else:  # its masks (and what BatchNorm saw through them) are the pipeline's own now
            result["dropout active again after train()"] = not all(
                torch.equal(a, b) for a, b in zip(as_tuple(back), detach(forward_eval_probe(module, forward, x2)))
            )
            return result
    elif use == "no_grad":
        with torch.no_grad():
            out = forward(x)
        result["out"] = detach(out)
        result["requires_grad"] = [o.requires_grad for o in as_tuple(out)]
    elif use == "autocast_bf16":
        with torch.autocast("cpu", torch.bfloat16):
            out = forward(x)
            loss = loss_of(out)
        loss.backward()
        result["out"] = detach(out)
        result["dtypes"] = [o.dtype for o in as_tuple(out)]
    elif use == "two_forwards":
        out1 = forward(x)
        out2 = forward(x2)
        (loss_of(out1) + loss_of(out2)).backward()
        result["out1"] = detach(out1)
        result["out2"] = detach(out2)
    elif use == "grad_inputs":
        xg = x.detach().clone().requires_grad_()
        out = forward(xg)
        (g,) = torch.autograd.grad(loss_of(out), xg)
        result["out"] = detach(out)
        result["x grad"] = g.detach().clone()
        result["parameters with .grad after autograd.grad"] = sorted(n for n, p in module.named_parameters() if p.grad is not None)
    else:
        raise ValueError(use)
    result["state"] = state(module)
    return result


def forward_eval_probe(module: nn.Module, forward: Callable[[torch.Tensor], Any], x: torch.Tensor) -> Any:
    module.eval()
    try:
        with torch.no_grad():
            return forward(x)
    finally:
        module.train()


# -- comparing -----------------------------------------------------------------------------------
def assert_same(got: Any, expected: Any, path: str, atol: float, rtol: float, scaled: bool = False) -> None:
    if isinstance(expected, dict):
        assert isinstance(got, dict), f"{path}: {type(got)}"
        assert list(got) == list(expected), f"{path}: keys {list(got)} != {list(expected)}"
        for key in expected:
            assert_same(got[key], expected[key], f"{path}/{key}", atol, rtol, scaled)
    elif isinstance(expected, (tuple, list)):
        assert isinstance(got, (tuple, list)) and len(got) == len(expected), f"{path}: {got!r} != {expected!r}"
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same(a, b, f"{path}[{i}]", atol, rtol, scaled)
    elif isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{path}: got {got!r}, expected a tensor"
        assert got.dtype == expected.dtype, f"{path}: dtype {got.dtype} != {expected.dtype}"
        assert got.shape == expected.shape, f"{path}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
        if atol == 0 and rtol == 0:
            assert torch.equal(got, expected), f"{path}: not bitwise equal, max |diff| {_maxdiff(got, expected)}"
        else:
            # `scaled` (bfloat16): sums in another order round otherwise (gradients of a value read
            # by several stages add up in each stage, then across them), by a step of the sum's
            # largest terms, not of the result: as large as atol in a tensor of values over 1, so
            # the tolerance scales with the tensor's largest value.
            floating = expected.numel() and expected.is_floating_point()
            scale = max(1.0, float(expected.detach().abs().max())) if scaled and floating else 1.0
            said = f" (atol scaled by {scale:.3g})" if scale != 1.0 else ""
            torch.testing.assert_close(got.cpu(), expected, atol=atol * scale, rtol=rtol, msg=lambda m: f"{path}: {m}{said}")
    else:
        assert got == expected, f"{path}: {got!r} != {expected!r}"


def _maxdiff(a: torch.Tensor, b: torch.Tensor) -> float:
    if not a.is_floating_point():
        return float((a - b).abs().max())
    return float((a.double() - b.double()).abs().nan_to_num(float("inf")).max())


# -- one case ------------------------------------------------------------------------------------
@dataclass
class Case:
    spec: Spec
    use: str
    stages: int
    chunks: int
    mode: str
    cuts_seed: Optional[int]  # None: the default balance
    batch: int
    seed: int
    batch2: int = 0  # the second batch (two_forwards, the second train step, eval): 0 is `batch`
    schedule: str = "gpipe"  # what train_step runs ('scheduled')
    stage_graph: str = "auto"  # 'dag': the graph search's cut (with the default balance)

    def describe(self, balance: Any = "?") -> str:
        bal = "default" if self.cuts_seed is None else f"balance={balance} (cuts_seed={self.cuts_seed})"
        return (
            f"use={self.use!r} stages={self.stages} chunks={self.chunks} checkpoint={self.mode!r} {bal} "
            f"batch={self.batch} batch2={self.batch2} seed={self.seed} width={self.spec.width} p={self.spec.p} "
            f"schedule={self.schedule!r} stage_graph={self.stage_graph!r}\n"
            + textwrap.indent(source(self.spec), "    ")
        )


class NotACase(Exception):
    """The plain model itself fails on the micro-batches: nothing to compare."""


class Refused(Exception):
    """compile_pipeline refused a cut the caller forced, with a clear error."""


def node_count(model: nn.Module, x: torch.Tensor) -> int:
    pipe = compile_pipeline(copy.deepcopy(model), x, ["cpu"], chunks=1)
    try:
        return sum(len(s.nodes) for s in pipe.plan.stages)
    finally:
        pipe.close()


def balance_for(case: Case, model: nn.Module, x: torch.Tensor) -> Optional[list[int]]:
    if case.cuts_seed is None:
        return None
    n = node_count(model, x)
    if n < case.stages:
        return None
    rng = random.Random(case.cuts_seed)
    cuts = sorted(rng.sample(range(1, n), case.stages - 1))
    bounds = [0, *cuts, n]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def compiled(model: nn.Module, x: torch.Tensor, case: Case, mode: str, balance: Optional[list[int]]) -> Any:
    kwargs: dict[str, Any] = dict(chunks=case.chunks, checkpoint=mode, schedule=case.schedule, stage_graph=case.stage_graph)
    if balance is not None:
        kwargs["balance"] = balance
    devices = case.stages
    if case.schedule == "interleaved-1f1b":  # two devices where the counts allow, else one
        devices = 2 if case.stages % 2 == 0 and case.chunks % 2 == 0 else 1
        kwargs["stages_per_device"] = case.stages // devices
    try:
        return compile_pipeline(model, x, ["cpu"] * devices, **kwargs)
    except ValueError as e:  # PartitionError, InplaceError: a cut the caller chose that cannot work
        if balance is not None and type(e).__name__ in ("PartitionError", "InplaceError"):
            raise Refused(f"{type(e).__name__}: {e}") from e
        raise


def check(case: Case) -> None:
    """The pipeline equals the plain model on `case.use`, or raises AssertionError (or the
    library's own error). A compile-time refusal of a forced cut raises Refused."""
    spec, use = case.spec, case.use
    autocast = use == "autocast_bf16"
    dtype = torch.float32 if autocast else torch.float64
    # A train step sums the micro-batches' weighted losses: the last bits of a large loss may differ.
    atol, rtol = (1e-2, 1.6e-2) if autocast else (1e-10, 1e-12 if use in ("scheduled", "loop_2bw") else 0.0)
    gen = torch.Generator().manual_seed(case.seed)
    xs = [torch.randn(b or case.batch, spec.width, generator=gen, dtype=dtype) for b in (case.batch, case.batch2)]
    dropout_active = spec.drops  # every use runs in train mode at some point

    base = make_model(spec, None, case.seed, dtype)
    balance = balance_for(case, base, xs[0])

    # 1. Against the plain model: with p = 0 when dropout would draw in train mode.
    p_ref = 0.0 if dropout_active and use != "eval" else None
    model = make_model(spec, p_ref, case.seed, dtype)
    reference = copy.deepcopy(model)
    seed_started_generators(1234)
    try:
        expected = run_use(use, reference, micro_batched(reference, case.chunks), xs, dropout_active and p_ref is None)
    except Exception as e:  # a BatchNorm on a one-row micro-batch, say: the plain model fails too
        raise NotACase(f"the plain model fails on these micro-batches: {type(e).__name__}: {e}") from e
    pipe = compiled(model, xs[0], case, case.mode, balance)
    try:
        seed_started_generators(1234)
        got = run_use(use, pipe, pipe, xs, dropout_active and p_ref is None)
        if not (dropout_active and use == "eval"):  # the model itself holds what the pipeline did
            got["the model's own state"], expected["the model's own state"] = state(model), state(reference)
        assert_same(got, expected, "pipeline vs plain model", atol, rtol, scaled=autocast)
        if p_ref is None and dropout_active and use == "eval":
            assert got["dropout active again after train()"], "dropout does not draw after pipe.train()"
    finally:
        pipe.close()

    # 2. With dropout drawing, and under autocast (where the tolerance against the plain model
    # would hide a recompute in float32): the pipeline against itself across checkpoint modes,
    # bit for bit.
    if (dropout_active and use != "eval") or autocast:
        # Each mode cut as it cuts itself: the default balance counts the activations a mode
        # keeps, and may cut each elsewhere; a node draws the same numbers in whichever stage.
        # Cut alike, the modes agree bit for bit. Cut elsewhere, a value read in several stages
        # has its gradient summed in another order, which rounds otherwise (a few ulps): there the
        # modes agree to a tolerance far below what another draw or a recompute in another dtype
        # would change.
        results, cuts = {}, {}
        for mode in (case.mode, *(m for m in MODES if m != case.mode)):
            m = make_model(spec, None, case.seed, dtype)
            pipe = compiled(m, xs[0], case, mode, balance)
            cuts[mode] = [stage.nodes for stage in pipe.plan.stages]
            try:
                seed_started_generators(4321)
                results[mode] = run_use(use, pipe, pipe, xs, dropout_active)
            finally:
                pipe.close()
        # Under bfloat16 autocast such a sum rounds by a step of bfloat16, not of float32: there the
        # modes agree to the tolerance against the plain model (cut alike, still bit for bit).
        what = f"dropout p={spec.p}" if dropout_active else "autocast"
        rounding = (atol, rtol) if autocast else (1e-12, 1e-12)  # float64 but under autocast
        for mode in MODES:
            if mode != case.mode:
                alike = cuts[mode] == cuts[case.mode]
                tols = (0.0, 0.0) if alike else rounding
                where = "" if alike else f", cut otherwise than {case.mode!r}"
                what_where = f"{what}, balance={balance}: checkpoint={mode!r}{where} vs {case.mode!r}"
                assert_same(results[mode], results[case.mode], what_where, *tols, scaled=autocast and not alike)
        if not dropout_active:
            return
        # and dropout does draw in train mode
        zero = make_model(spec, 0.0, case.seed, dtype)
        seed_started_generators(4321)
        with torch.no_grad():
            plain_zero = detach(micro_batched(zero, case.chunks)(xs[0]))
        first = results[case.mode]
        if use == "loop_2bw":  # a loop gives its losses alone
            assert not torch.equal(first["losses"][0], mean_loss_of(plain_zero)), f"dropout p={spec.p} in train mode changed nothing in the loop's first loss"
            return
        drawn = first.get("out", first.get("out1", first.get("step 1 out")))
        assert drawn is not None and not all(torch.equal(a, b) for a, b in zip(drawn, plain_zero)), (
            f"dropout p={spec.p} in train mode changed nothing in the pipeline's output"
        )


def reproducer(case: Case, balance: Any = None) -> str:
    """A standalone script for one case (run from the repository root)."""
    spec = case.spec
    return (
        "import sys; sys.path.insert(0, 'tests')\n"
        "from dag_models import Case, Op, Spec, check\n"
        f"spec = Spec(width={spec.width}, p={spec.p}, returns={spec.returns!r}, front_end={spec.front_end!r}, ops=[\n"
        + "".join(f"    Op({op.kind!r}, {op.picks!r}, {op.variant}),\n" for op in spec.ops)
        + "])\n"
        f"check(Case(spec, use={case.use!r}, stages={case.stages}, chunks={case.chunks}, mode={case.mode!r}, "
        f"cuts_seed={case.cuts_seed!r}, batch={case.batch}, seed={case.seed}, batch2={case.batch2}, "
        f"schedule={case.schedule!r}, stage_graph={case.stage_graph!r}))\n"
    )


__all__ = ["Case", "NotACase", "FEATURES", "MODES", "Op", "Refused", "Spec", "USES", "check", "reproducer", "source"]
