"""Random ops draw from the task's own stream: replayed exactly by the recompute, different per
micro-batch, and without a Python hook on every op where the graph shows them."""
from __future__ import annotations

import copy
import warnings
import dataclasses
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxpipe
from helpers import assert_grads_equal, grad_of
from fxpipe import compile_pipeline
import fxpipe.core.randomness as randomness
from fxpipe.core.randomness import TaskRandomness, TaskStream, Unseen, begin_draws, task_stream


class Draws(nn.Module):
    """Each random op the graph can show: a dropout module, F.dropout, torch.rand_like and a
    tensor method drawing in place."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(8, 8) for _ in range(4))
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.tanh(self.a(x)))
        h = F.dropout(torch.tanh(self.b(h)), 0.4, self.training)
        h = torch.tanh(self.c(h)) * torch.rand_like(h)
        noise = torch.empty_like(h).bernoulli_(0.5)
        return self.d(h + noise)


class Attention(nn.Module):
    """Attention with dropout: the op draws inside, where no generator can be handed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.q(x).unsqueeze(1)
        return self.out(F.scaled_dot_product_attention(q, q, q, dropout_p=0.3).squeeze(1))


class RandomSlopes(nn.Module):
    """RReLU draws its slopes while training: a built-in module that holds no dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.act = nn.RReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.act(self.b(self.act(self.a(x)))))


class Remembers(nn.Module):
    """Stores an attribute, so it is called whole: the graph cannot show whether it draws."""

    def __init__(self, p: float, slopes: bool = False) -> None:
        super().__init__()
        self.a, self.drop = nn.Linear(8, 8), nn.RReLU() if slopes else nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(self.a(x))
        self.last = h.detach()
        return h


def _step(make: Callable[[], nn.Module], mode: str, seed: int) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = make().double()
    x = torch.randn(8, 8, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4, checkpoint=mode, balance=None)
    torch.manual_seed(seed)
    out = pipe(x)
    out.pow(2).sum().backward()
    return out.detach(), [grad_of(p).clone() for p in pipe.parameters()]


class _DropsPath(nn.TransformerEncoderLayer):
    """An encoder layer of the model's own that drops its residual branch per sample (torch.rand)."""

    def forward(self, src: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        out = super().forward(src, *args, **kwargs)
        keep = (torch.rand(src.shape[0], 1, 1, dtype=src.dtype) >= 0.5).to(src.dtype)
        return src + (out - src) * keep * 2


class DrawsInsideABuiltIn(nn.Module):
    """The drawing layer inside a built-in container, which the graph calls whole, with
    dropouts of rate 0: the container's dropouts draw nothing, its layers do."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        layer = _DropsPath(8, 2, 16, dropout=0.0, batch_first=True)
        self.body = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.body(torch.tanh(self.a(x)).unsqueeze(1)).squeeze(1))


class _MaskedDropout(torch.autograd.Function):
    """A dropout of the model's own: it draws its mask in forward and keeps it for backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        mask = (torch.rand_like(x) > 0.5).to(x.dtype) * 2
        ctx.save_for_backward(mask)
        return x * mask

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (mask,) = ctx.saved_tensors
        return grad * mask


class DrawsInAFunction(nn.Module):
    """Its autograd Function draws: the graph holds one call of it, whose forward it cannot see."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_MaskedDropout.apply(torch.tanh(self.a(x))))


@torch.library.custom_op("fxpipe_tests::masked_dropout", mutates_args=())
def _library_dropout(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A fused dropout of a library's own: its kernel draws, unseen by the graph."""
    mask = (torch.rand_like(x) > 0.5).to(x.dtype) * 2
    return x * mask, mask


@_library_dropout.register_fake
def _(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(x), torch.empty_like(x)


def _keep_mask(ctx: Any, inputs: Any, output: Any) -> None:
    ctx.save_for_backward(output[1])


def _through_mask(ctx: Any, grad: torch.Tensor, _: Any) -> torch.Tensor:
    (mask,) = ctx.saved_tensors
    return grad * mask


_library_dropout.register_autograd(_through_mask, setup_context=_keep_mask)


class DrawsInALibraryOp(nn.Module):
    """Before, a library's op counted as drawing nothing: a checkpointed micro-batch's recompute
    drew another mask, and the gradients were those of that mask (1.2 off)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_library_dropout(torch.tanh(self.a(x)))[0])


def test_a_library_op_that_draws_under_the_check_of_micro_batches_is_named_as_such() -> None:
    """Its draws cannot be held fixed by the check of the example's parts: the refusal says so
    of the op where the difference starts, rather than blame the model for mixing samples alone."""
    class Twice(DrawsInALibraryOp):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(_library_dropout(_library_dropout(torch.tanh(self.a(x)))[0])[0])

    with pytest.raises(ValueError, match=r"masked_dropout\.default\(tanh\) \(an op of the library 'fxpipe_tests': if it draws random numbers"):
        compile_pipeline(Twice().double(), torch.randn(8, 8, dtype=torch.float64), ["cpu"] * 2, chunks=2)


class DrawsOtherwise(nn.Module):
    """Noise drawn by nn.init on a fresh tensor, and by torch.binomial: before, neither was known
    to draw, and a checkpointed micro-batch's recompute drew anew (gradients 1.4 and 5.0 off);
    and a draw given generator=None (diffusers' randn_tensor), which failed at every call."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        eps = nn.init.normal_(torch.empty_like(h))
        counts = torch.binomial(torch.full_like(h, 3.0), torch.full_like(h, 0.5))
        shift = torch.randn(h.shape, generator=None, dtype=h.dtype)
        return self.b(h * (1 + 0.1 * eps) + 0.1 * counts * h + 0.1 * shift)


class FractionalPool(nn.Module):
    """A fractional max pool draws its pooling regions, in eval mode too: as a module, or as
    the function, which torch.fx keeps as one call."""

    def __init__(self, functional: bool = False) -> None:
        super().__init__()
        self.functional = functional
        self.a, self.pool, self.b = nn.Linear(8, 50), nn.FractionalMaxPool2d(2, output_size=3), nn.Linear(18, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.a(x)).view(-1, 2, 5, 5)  # (5 rows into 3 regions of 2: where they start is drawn)
        y = F.fractional_max_pool2d(y, 2, output_size=3) if self.functional else self.pool(y)
        return self.b(y.flatten(1))


class FunctionalAttention(nn.Module):
    """Attention through `F.multi_head_attention_forward`, whose dropout_p draws while training."""

    def __init__(self) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, q = self.attention, x.unsqueeze(0)  # (one position, the samples, features)
        out, _ = F.multi_head_attention_forward(
            q, q, q, 8, 2, a.in_proj_weight, a.in_proj_bias, None, None, False, 0.3, a.out_proj.weight, a.out_proj.bias,
            training=self.training, need_weights=False,
        )  # fmt: skip
        return out.squeeze(0)


DRAWING = [Draws, Attention, RandomSlopes, DrawsInsideABuiltIn, DrawsInAFunction, lambda: _StochasticDepth("batch"), DrawsOtherwise,
           DrawsInALibraryOp, FractionalPool, lambda: FractionalPool(functional=True), FunctionalAttention]  # fmt: skip


@pytest.mark.parametrize("make", DRAWING)
def test_every_checkpoint_mode_draws_the_same_numbers(make: Callable[[], nn.Module]) -> None:
    out, grads = _step(make, "never", seed=5)
    for mode in ("always", "except_last"):
        other, other_grads = _step(make, mode, seed=5)
        assert torch.equal(out, other), mode
        assert all(torch.equal(g, h) for g, h in zip(grads, other_grads)), mode
    assert not torch.equal(out, _step(make, "never", seed=6)[0]), "the step's seed must matter"


@torch.library.custom_op("fxpipe_tests::slow_dropout", mutates_args=())
def _slow_dropout(x: torch.Tensor) -> torch.Tensor:
    """A library's dropout whose kernel takes a while: its draw takes no generator, so the stage
    lends it the task's stream as torch's default generator for that long."""
    keep = torch.rand_like(x) > 0.5
    time.sleep(0.01)
    return x * keep * 2


@_slow_dropout.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


_slow_dropout.register_autograd(lambda ctx, g: g * (ctx.saved_tensors[0] != 0) * 2, setup_context=lambda ctx, inputs, output: ctx.save_for_backward(output))


class DrawsSlowly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(_slow_dropout(torch.tanh(self.a(x))))))


def _noisy_slow_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    time.sleep(0.002)
    return ((out - target) * torch.rand_like(out)).pow(2).sum()


def test_a_loss_that_draws_beside_a_stage_lending_its_stream_draws_the_callers_numbers() -> None:
    """Before, the loss (on the last stage's worker) drew from the stream the first stage had
    lent the default generator meanwhile: the same seed gave other losses, gradients and
    generator states from one checkpoint mode (and one run) to the next."""
    torch.manual_seed(0)
    model = DrawsSlowly().double()
    x, y = torch.randn(16, 8, dtype=torch.float64), torch.randn(16, 8, dtype=torch.float64)
    seen = []
    for mode in ("never", "always", "never"):
        pipe = compile_pipeline(copy.deepcopy(model), x, ["cpu"] * 2, chunks=8, checkpoint=mode, schedule="1f1b", split_points=["b"])
        torch.manual_seed(3)
        with pytest.warns(UserWarning, match="loss_fn draws random numbers"):
            loss = pipe.train_step(x, target=y, loss_fn=_noisy_slow_loss, reduction="sum")
        seen.append((loss, grad_of(pipe.parameters().__next__()).clone(), torch.rand(())))
    for other in seen[1:]:
        assert all(torch.equal(a, b) for a, b in zip(seen[0], other))


def test_rrelu_takes_its_generator_by_position_without_lending_the_default_one(monkeypatch: pytest.MonkeyPatch) -> None:
    lent: list[torch.device] = []
    lend = randomness._default_generator

    def lent_and_lend(device: torch.device) -> torch.Generator:
        lent.append(device)
        return lend(device)

    monkeypatch.setattr(randomness, "_default_generator", lent_and_lend)
    out, grads = _step(RandomSlopes, "never", seed=5)
    other, other_grads = _step(RandomSlopes, "always", seed=5)
    assert torch.equal(out, other) and all(torch.equal(g, h) for g, h in zip(grads, other_grads))
    assert not lent


@pytest.mark.parametrize("functional", [False, True])
def test_a_fractional_pool_draws_alike_in_every_checkpoint_mode_in_eval_mode_too(functional: bool) -> None:
    out, grads = _step(lambda: FractionalPool(functional).eval(), "never", seed=5)
    other, other_grads = _step(lambda: FractionalPool(functional).eval(), "always", seed=5)
    assert torch.equal(out, other) and all(torch.equal(g, h) for g, h in zip(grads, other_grads))


def test_ops_the_graph_shows_need_no_dispatch_mode() -> None:
    x = torch.randn(4, 8)
    shown = compile_pipeline(Draws(), x, ["cpu"] * 2, balance=None)
    assert all(r.draws() == (True, Unseen.NOWHERE) for r in shown.program().stages)
    assert "dropout_module" in shown.stages[0].code
    attention = Attention()
    hidden = compile_pipeline(attention, x, ["cpu"], balance=None)
    assert hidden.program().stages[0].draws() == (True, Unseen.MARKED)
    attention.q.register_forward_hook(lambda m, i, o: None)  # a hook may draw around any op
    assert hidden.program().stages[0].draws() == (True, Unseen.ANYWHERE)


@contextmanager
def _ops_seen_by_the_dispatch_mode() -> Iterator[list[str]]:
    seen: list[str] = []
    original = TaskRandomness.__torch_dispatch__

    def spy(self: TaskRandomness, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        seen.append(func.__name__)
        return original(self, func, types, args, kwargs)

    TaskRandomness.__torch_dispatch__ = spy  # type: ignore[method-assign]
    try:
        yield seen
    finally:
        TaskRandomness.__torch_dispatch__ = original  # type: ignore[method-assign]


@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_the_dispatch_mode_runs_only_around_the_nodes_that_may_draw_unseen(checkpoint: str) -> None:
    """It costs a Python call per op: the rest of the stage (its Linears, its tanh) runs without
    it, and the draws in the Function take the task's stream (that every checkpoint mode draws
    the same masks is checked above)."""
    torch.manual_seed(0)
    model = DrawsInAFunction().double()
    x = torch.randn(8, 8, dtype=torch.float64)
    pipe = compile_pipeline(copy.deepcopy(model), x, ["cpu"] * 2, chunks=2, balance=None, checkpoint=checkpoint)
    with _ops_seen_by_the_dispatch_mode() as seen:
        out = pipe(x)
        out.sum().backward()
    assert seen and not any(name.startswith(("addmm", "tanh", "t.")) for name in seen), seen
    assert any(name.startswith(("rand_like", "uniform_")) for name in seen), seen


class _RaisesWhenAsked(torch.autograd.Function):
    fail = False

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand_like(x)
        if _RaisesWhenAsked.fail:
            raise ValueError("asked to fail")
        return x + noise

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


class RaisesInAFunction(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(_RaisesWhenAsked.apply(torch.tanh(self.a(x))))


def test_a_node_that_raises_while_it_may_draw_leaves_no_dispatch_mode_behind() -> None:
    """The mode entered before the node is left by the task, which the node's failure ends: the
    workers' next calls run the stage's other ops without it, and compute what they did."""
    x = torch.randn(8, 8)
    pipe = compile_pipeline(RaisesInAFunction(), x, ["cpu"] * 2, chunks=2, balance=None)
    torch.manual_seed(1)
    before = pipe(x)
    _RaisesWhenAsked.fail = True
    try:
        with pytest.raises(fxpipe.StageError, match="asked to fail"):
            pipe(x)
    finally:
        _RaisesWhenAsked.fail = False
    with _ops_seen_by_the_dispatch_mode() as seen:
        torch.manual_seed(1)
        after = pipe(x)
    assert not any(name.startswith(("addmm", "tanh")) for name in seen), seen
    assert torch.equal(before, after)


def test_a_task_stream_leaves_the_mode_a_failed_node_entered() -> None:
    stream = TaskStream(0, 0, 0, per_node=True)
    depth = torch._C._len_torch_dispatch_stack()
    with pytest.raises(RuntimeError, match="inside"):
        with task_stream(stream):
            begin_draws(7)
            assert torch._C._len_torch_dispatch_stack() == depth + 1
            raise RuntimeError("inside the node")
    assert torch._C._len_torch_dispatch_stack() == depth and stream.mode is None


def test_a_stage_without_random_ops_draws_nothing() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0), nn.Linear(4, 4), nn.Dropout(0.5))
    pipe = compile_pipeline(model, torch.randn(4, 4), ["cpu"] * 2, balance=[2, 2])
    first, second = pipe.program().stages
    assert not first.draws()[0] and second.draws()[0]
    dropout = model[1]
    assert isinstance(dropout, nn.Dropout)
    dropout.p = 0.2
    assert first.draws()[0]
    model.eval()
    assert not first.draws()[0] and not second.draws()[0]


@pytest.mark.parametrize(
    "make,draws",
    [(lambda: nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)), (False, False)),
     (lambda: nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.3), nn.Linear(8, 8)), (True, False)),
     (Draws, (True, True)), (Attention, (True, True)),
     (lambda: nn.Sequential(nn.Linear(8, 8), Remembers(0.0), nn.Linear(8, 8)), (False, False)),
     (lambda: nn.Sequential(nn.Linear(8, 8), Remembers(0.3), nn.Linear(8, 8)), (True, False)),
     (lambda: nn.Sequential(nn.Linear(8, 8), Remembers(0.0, slopes=True), nn.Linear(8, 8)), (True, False))],
    ids=["no random ops", "dropout", "graph", "hidden", "whole, deterministic", "whole, dropout", "whole, RReLU"],
)  # fmt: skip
def test_the_callers_generator_moves_only_where_a_stage_draws(make: Callable[[], nn.Module], draws: tuple[bool, bool]) -> None:
    """Without random ops (or dropout in eval mode) the plain model leaves the caller's
    generator as it was, and so does the pipeline: the data a script samples next is the same
    either way. (`torch.rand_like`, and attention's dropout_p, draw in eval mode too.)"""
    model = make().double()
    x = torch.randn(8, 8, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=4)
    for training, drawn in zip((True, False), draws):
        pipe.train(training)
        torch.manual_seed(0)
        pipe(x).sum().backward()
        after = torch.rand(3)
        torch.manual_seed(0)
        assert torch.equal(after, torch.rand(3)) is not drawn, (training, drawn)
        torch.manual_seed(0)
        pipe.train_step(x, target=torch.zeros_like(x), loss_fn=F.mse_loss)
        after = torch.rand(3)
        torch.manual_seed(0)
        assert torch.equal(after, torch.rand(3)) is not drawn, ("train_step", training, drawn)


def _noisy_loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.mse_loss(out, target + 0.1 * torch.randn_like(target))  # label noise: the loss draws


def test_a_loss_that_draws_draws_what_it_draws_after_the_plain_model() -> None:
    """A model whose stages draw nothing (a module called whole that only may): the step's seed
    is only read, so the loss draws from the generator as the plain model leaves it."""
    model = nn.Sequential(nn.Linear(8, 8), Remembers(0.0), nn.Linear(8, 3)).double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=1)
    torch.manual_seed(7)
    loss = pipe.train_step(x, target=y, loss_fn=_noisy_loss)
    after = torch.get_rng_state()
    torch.manual_seed(7)
    expected = _noisy_loss(reference(x), y)
    expected.backward()
    assert torch.equal(loss, expected.detach()) and torch.equal(after, torch.get_rng_state())
    for p, q in zip(pipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-15)


class _Reseeds(nn.Module):
    """Draws the same rotation on every call: it seeds torch's generator itself first."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        torch.manual_seed(42)
        return self.b(self.a(x) @ torch.randn(8, 8, dtype=x.dtype))


class _MakesItsGenerator(_Reseeds):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        generator = torch.Generator().manual_seed(0)
        h = self.a(x)
        return self.b(h + torch.randn(h.shape, generator=generator, dtype=h.dtype))


class _ReseedsAForkedState(_Reseeds):
    """Fixed noise under torch.random.fork_rng(): the caller's generator is put back after."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.random.fork_rng():
            torch.manual_seed(42)
            noise = torch.randn(8, 8, dtype=x.dtype)
        return self.b(self.a(x) @ noise)


@pytest.mark.parametrize("cls", [_Reseeds, _MakesItsGenerator, _ReseedsAForkedState], ids=["manual_seed", "a generator made in forward", "fork_rng"])
def test_a_forward_that_sets_the_random_state_it_draws_from_is_refused(cls: type[nn.Module]) -> None:
    """Before, the graph kept the draws and lost the seeding: 1.2 off the plain model (drawing
    from the pipeline's streams), or 1.8 off (one generator made while tracing, drawn on and on);
    under fork_rng the graph's check failed first, and its refusal blamed data-dependent control flow."""
    model, x = cls().double(), torch.randn(4, 8, dtype=torch.float64)
    state = torch.get_rng_state()
    with pytest.raises(ValueError, match=r"(?s)forward sets the random state it draws from \((torch.manual_seed at .*test_randomness.py:\d+|a generator made in forward, drawn from by randn)\).*How to fix: draw the fixed numbers once"):
        compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    assert torch.equal(torch.get_rng_state(), state), "the caller's generator as it was"


class _MaskHook:
    """A dropout-like forward hook, `out * (torch.rand_like(out) > 0.5)`, that keeps each
    module's masks from the forwards (a recompute must draw them again), in order; `replay`
    applies them instead, for the plain model run on the micro-batches in turn."""

    def __init__(self) -> None:
        self.only: type[nn.Module] = nn.Module
        self.masks: dict[int, list[torch.Tensor]] = {}

    def __call__(self, module: nn.Module, args: tuple[torch.Tensor, ...], out: torch.Tensor) -> Optional[torch.Tensor]:
        if not isinstance(module, self.only):
            return None
        mask = (torch.rand_like(out) > 0.5).to(out.dtype)
        if not fxpipe.is_recomputing():
            self.masks.setdefault(id(module), []).append(mask)
        return out * mask

    def replay(self, pipe: nn.Module, reference: nn.Module) -> None:
        """Each module of `reference` multiplies by the masks its twin in `pipe` drew, in turn."""
        twins = dict(zip((id(m) for m in pipe.modules()), reference.modules()))
        for key, masks in self.masks.items():
            twins[key].register_forward_hook(lambda module, args, out, masks=list(masks): out * masks.pop(0))


HOOKS = ("on a leaf module", "on a leaf module, after compiling", "global")


@contextmanager
def _registered_globally(hook: _MaskHook, where: str) -> Iterator[None]:
    """Where it is global: the hook on every nn.Linear, for the block."""
    hook.only = nn.Linear if where == "global" else nn.Module
    # Typed as a hook that returns None; one may return the output that replaces the module's.
    handle = nn.modules.module.register_module_forward_hook(hook) if where == "global" else None  # type: ignore[arg-type]
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()


def _hooked_step(where: str, mode: str, schedule: str, train_step: bool) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor]:
    """One step with a hook that draws: its output (or loss), gradients and the generator after,
    checked against the plain model drawing the same masks, on the micro-batches in turn."""
    hook = _MaskHook()
    torch.manual_seed(1)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    reference = copy.deepcopy(model)
    with _registered_globally(hook, where):
        if where == "on a leaf module":
            model[2].register_forward_hook(hook)
        pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, checkpoint=mode, schedule=schedule, split_points=["3"])
        if where == "on a leaf module, after compiling":
            model[2].register_forward_hook(hook)
        hook.masks.clear()  # drawn while compiling
        torch.manual_seed(5)
        if train_step:
            out = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
        else:
            out = pipe(x)
            out.pow(2).sum().backward()
        after = torch.get_rng_state()
    hook.replay(pipe, reference)
    if train_step:
        expected = sum(F.mse_loss(reference(a), b) / 2 for a, b in zip(x.chunk(2), y.chunk(2)))
        assert isinstance(expected, torch.Tensor)
        expected.backward()
    else:
        expected = torch.cat([reference(a) for a in x.chunk(2)])
        expected.pow(2).sum().backward()
    torch.testing.assert_close(out.detach(), expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)
    return out.detach(), [grad_of(p).clone() for p in pipe.parameters()], after


@pytest.mark.parametrize("where", HOOKS)
@pytest.mark.parametrize("how", ["pipe(x)", "gpipe", "1f1b", "zb-h1"])
def test_a_forward_hook_that_draws_is_replayed_by_the_recompute(where: str, how: str) -> None:
    """A hook's draws do not show in the graph: the stage that calls a hooked module (or any
    module, under a global hook) draws from its task's stream. Before, the recompute drew a new
    mask: the gradients were those of another forward (0.39 off), and the caller's generator was
    left elsewhere than with checkpoint="never"; a global hook was refused when compiling, as
    mixing samples (its halves drew other masks than the whole)."""
    train_step = how != "pipe(x)"
    schedule = how if train_step else "gpipe"
    out, grads, after = _hooked_step(where, "never", schedule, train_step)
    for mode in ("always", "except_last"):
        other, other_grads, other_after = _hooked_step(where, mode, schedule, train_step)
        assert torch.equal(out, other), mode
        assert all(torch.equal(g, h) for g, h in zip(grads, other_grads)), mode
        assert torch.equal(after, other_after), mode


@dataclasses.dataclass
class _Count:
    calls: int = 0


class _CountsAndDrops(nn.Module):
    """Called whole (it counts, in a settings object and on itself), with a dropout inside; its
    weight is tied to a layer on the next stage, so that stage's copy is passed in at each call."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.lin, self.drop, self.count = nn.Linear(8, 8), nn.Dropout(p), _Count()
        self.calls = 0

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.count.calls += 1
        self.calls += 2
        return h + self.drop(torch.tanh(self.lin(h))) * (1.0 + 0.05 * self.count.calls + 0.01 * self.calls)


class _Tied(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.a, self.c, self.b = nn.Linear(8, 8), _CountsAndDrops(p), nn.Linear(8, 8)
        self.b.weight = self.c.lin.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.c(torch.tanh(self.a(x)))))


def _tied_step(p: float, mode: str) -> tuple[torch.Tensor, list[torch.Tensor], torch.Tensor, _Tied, torch.Tensor]:
    torch.manual_seed(0)
    model = _Tied(p).double()
    x = torch.randn(8, 8, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, checkpoint=mode, balance=[4, 1])
    torch.manual_seed(3)
    out = pipe(x)
    out.pow(2).mean().backward()
    return out.detach(), [grad_of(q).clone() for q in pipe.parameters()], torch.get_rng_state(), model, x


@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
def test_a_module_whose_weight_another_stage_reads_counts_and_draws_as_one_called_whole(mode: str) -> None:
    """Such a module is called through a private copy, which the passes did not take for a call
    of it: before, its dropout drew from the caller's generator and the recompute drew other
    masks (gradients 0.01 off), a recompute counted again (the count 8 where it is 4), and a
    count on the module itself stayed 0 (its copy counted): 0.05 off."""
    out, grads, _, model, x = _tied_step(0.0, mode)
    torch.manual_seed(0)
    reference = _Tied(0.0).double()
    expected = torch.cat([reference(part) for part in x.chunk(4)])
    expected.pow(2).mean().backward()
    torch.testing.assert_close(out, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(model, reference, tol=1e-12)
    assert model.c.count.calls == reference.c.count.calls == 4 and model.c.calls == reference.c.calls == 8
    drawn, drawn_grads, after, _, _ = _tied_step(0.5, "never")
    other, other_grads, other_after, _, _ = _tied_step(0.5, mode)
    assert torch.equal(drawn, other) and torch.equal(after, other_after)
    assert all(torch.equal(g, h) for g, h in zip(drawn_grads, other_grads))


class _Scaled(nn.Module):
    """A dropout between two layers, to hook."""

    def __init__(self, p: float) -> None:
        super().__init__()
        self.a, self.drop, self.b = nn.Linear(8, 8), nn.Dropout(p), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.drop(torch.tanh(self.a(x))))


def _hook_dropout(model: _Scaled, backward_calls: list[int]) -> None:
    """Its input doubled before it, its output times four after it (both exact), and its
    backward counted."""
    model.drop.register_forward_pre_hook(lambda module, args: (args[0] * 2,))
    model.drop.register_forward_hook(lambda module, args, out: out * 4)
    model.drop.register_full_backward_hook(lambda module, grad_in, grad_out: backward_calls.append(1))


@pytest.mark.parametrize("mode", ["always", "except_last", "never"])
@pytest.mark.parametrize("when", ["before compiling", "after compiling, the rate raised from 0"])
def test_hooks_on_a_dropout_run_in_every_mode(mode: str, when: str) -> None:
    """Before, the dropout of a stage drew its mask without calling the module while training: its
    hooks did not run (the output was the unhooked one, bit for bit), where the plain model ran them."""
    torch.manual_seed(0)
    plain = _Scaled(0.5).double()
    x = torch.randn(8, 8, dtype=torch.float64)
    results = []
    for hooked in (False, True):
        model = copy.deepcopy(plain)
        calls: list[int] = []
        if when == "before compiling" and hooked:
            _hook_dropout(model, calls)
        if when != "before compiling":
            model.drop.p = 0.0
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, checkpoint=mode, split_points=["b"])
        if when != "before compiling":
            model.drop.p = 0.5
            if hooked:
                _hook_dropout(model, calls)
        torch.manual_seed(3)
        leaf = x.clone().requires_grad_()
        pipe(leaf).sum().backward()
        assert leaf.grad is not None
        results.append((leaf.grad, calls, pipe, model))
    (plain_grad, _, _, _), (grad, calls, pipe, model) = results
    assert len(calls) == 4, "the full backward hook runs once per micro-batch"
    # The same masks, and the hooks' factors: the input's gradient is the unhooked one's times 8.
    torch.testing.assert_close(grad, plain_grad * 8, rtol=1e-12, atol=0)
    pipe.eval()
    torch.testing.assert_close(pipe(x), model.b(8 * torch.tanh(model.a(x))), rtol=0, atol=1e-12)


class _DroppingBlock(nn.Module):
    """A transformer block with dropout modules and attention dropout (SDPA), traced through."""

    def __init__(self, width: int = 16, heads: int = 2, p: float = 0.2) -> None:
        super().__init__()
        self.heads, self.p = heads, p
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width), nn.Dropout(p))
        self.drop = nn.Dropout(p)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=self.p if self.training else 0.0, is_causal=True)
        x = x + self.drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.mlp(self.ln2(x))


class _DroppingGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos, self.drop = nn.Embedding(16, 16), nn.Embedding(16, 16), nn.Dropout(0.2)
        self.blocks = nn.Sequential(_DroppingBlock(), _DroppingBlock())
        self.head = nn.Linear(16, 16)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(self.drop(self.tok(idx) + self.pos(torch.arange(idx.shape[1])))))


def test_every_checkpoint_mode_trains_on_the_same_masks_where_each_cuts_elsewhere() -> None:
    """The default balance counts the activations a mode keeps, so each mode may cut the model
    elsewhere. Before, the streams were per stage: a dropout that moved to the other stage drew
    other masks, and 'always' trained on other numbers than 'never' (outputs 1.1 apart)."""
    torch.manual_seed(0)
    model = _DroppingGPT().double()
    x = torch.randint(0, 16, (8, 16))
    results, cuts = {}, {}
    for mode in ("never", "except_last", "always"):
        pipe = compile_pipeline(copy.deepcopy(model), x, ["cpu", "cpu"], chunks=4, checkpoint=mode)
        cuts[mode] = [len(s.nodes) for s in pipe.plan.stages]
        torch.manual_seed(5)
        out = pipe(x)
        out.square().mean().backward()
        results[mode] = (out.detach(), [grad_of(p).clone() for p in pipe.parameters()])
    assert len({tuple(c) for c in cuts.values()}) > 1, f"the modes cut alike ({cuts}): the test needs cuts that differ"
    out, grads = results["never"]
    for mode in ("except_last", "always"):
        assert torch.equal(results[mode][0], out), mode
        assert all(torch.equal(g, h) for g, h in zip(results[mode][1], grads)), mode


class _TwoDropouts(nn.Module):
    """The same input through two dropouts of the same rate, cut into two stages."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.lin, self.second = nn.Dropout(0.5), nn.Linear(64, 64), nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.first(x), self.second(x + 0 * self.lin(x))


def test_two_dropouts_draw_apart_and_alike_at_any_stage_count() -> None:
    """The per-stage counterpart of the per-micro-batch test: a stream that ignored where a draw
    is made would give both dropouts one mask. And a node's masks do not depend on the cut."""
    x = torch.ones(8, 64, dtype=torch.float64)
    masks = {}
    for devices in (["cpu"], ["cpu", "cpu"]):
        pipe = compile_pipeline(_TwoDropouts().double(), x, devices, chunks=2, split_points=["second"] if len(devices) > 1 else None)
        torch.manual_seed(11)
        with torch.no_grad():
            first, second = pipe(x)
        masks[len(devices)] = (first != 0, second != 0)
        assert not torch.equal(first != 0, second != 0), "two dropouts drew one mask"
        assert not torch.equal(first[:4] != 0, first[4:] != 0), "two micro-batches drew one mask"
    assert all(torch.equal(a, b) for a, b in zip(masks[1], masks[2])), "the cut changed the masks"


def _stochastic_depth(x: torch.Tensor, p: float, mode: str) -> torch.Tensor:
    """As torchvision.ops.stochastic_depth writes it: mode "batch" draws one number for the batch."""
    size = [x.shape[0]] + [1] * (x.ndim - 1) if mode == "row" else [1] * x.ndim
    noise = torch.empty(size, dtype=x.dtype, device=x.device).bernoulli_(1 - p)
    return x * noise.div_(1 - p)


def _wrapped_depth(x: torch.Tensor, p: float, mode: str) -> torch.Tensor:
    """As torchvision's own: a function torch.fx keeps whole (torch.fx.wrap), one node."""
    return _stochastic_depth(x, p, mode)


torch.fx.wrap("_wrapped_depth")


class _Depth(nn.Module):
    """As torchvision.ops.StochasticDepth, a module; kept whole here by leaf_modules."""

    def __init__(self, mode: str) -> None:
        super().__init__()
        self.mode = mode

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _stochastic_depth(x, 0.5, self.mode)


class _StochasticDepth(nn.Module):
    """A residual branch kept or dropped by stochastic depth (traced, a wrapped function, or a
    module kept whole); with `parts`, the branch and a noise drawn once for every sample are
    returned too."""

    def __init__(self, mode: str, parts: bool = False, form: str = "traced") -> None:
        super().__init__()
        self.mode, self.parts, self.branch, self.head = mode, parts, nn.Linear(8, 8), nn.Linear(8, 8)
        self.form, self.depth = form, _Depth(mode)

    def forward(self, x: torch.Tensor) -> Any:
        h = self.branch(x)
        dropped = {"traced": _stochastic_depth, "wrapped": _wrapped_depth}[self.form](h, 0.5, self.mode) if self.form != "module" else self.depth(h)
        kept = x + dropped
        if not self.parts:
            return self.head(kept)
        return self.head(kept), kept - x, torch.randn(8, dtype=x.dtype).expand(x.shape[0], 8)


@pytest.mark.parametrize("mode,form", [("batch", "traced"), ("row", "traced"), ("batch", "wrapped"), ("batch", "module"), ("row", "module")])
def test_a_draw_for_the_whole_batch_is_drawn_alike_by_every_micro_batch(mode: str, form: str) -> None:
    """Before, each micro-batch drew its own: one call dropped the branch of some samples and
    kept the others' (19 calls in 20), where the plain model keeps or drops it for all; and
    where the draw was inside one node (torchvision's StochasticDepth module, its function
    wrapped), still 18 in 20, the node's output being per sample."""
    torch.manual_seed(0)
    model = _StochasticDepth(mode, parts=True, form=form).double()
    x = torch.randn(8, 8, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, split_points=["head"], leaf_modules=[_Depth])
    patterns = set()
    for seed in range(6):
        torch.manual_seed(seed)
        with torch.no_grad():
            _, branch, noise = pipe(x)
        patterns.add(tuple(bool(row.abs().sum() > 0) for row in branch))
        assert torch.equal(noise, noise[:1].expand(8, 8)), "a noise drawn once is every sample's"
    if mode == "batch":
        assert patterns == {(True,) * 8, (False,) * 8}, patterns
    else:
        assert any(len(set(pattern)) == 2 for pattern in patterns), "row mode draws per sample"


@pytest.mark.parametrize("form", ["wrapped", "module"])
def test_a_draw_for_the_whole_batch_inside_one_node_trains_alike_in_every_checkpoint_mode(form: str) -> None:
    """The recompute of a whole-batch draw made inside one node draws what its forward drew:
    every checkpoint mode, from one seed, gives the same outputs and gradients."""
    x = torch.randn(8, 8, dtype=torch.float64)
    results = []
    for mode in ("never", "except_last", "always"):
        torch.manual_seed(0)
        model = _StochasticDepth("batch", form=form).double()
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, split_points=["head"], leaf_modules=[_Depth], checkpoint=mode)
        torch.manual_seed(1)
        out = pipe(x)
        out.square().sum().backward()
        results.append((out.detach(), [grad_of(p).clone() for p in pipe.parameters()]))
        pipe.close()
    for out, grads in results[1:]:
        assert torch.equal(out, results[0][0]) and all(torch.equal(a, b) for a, b in zip(grads, results[0][1]))


def test_the_per_step_reads_of_draws_and_hooks_walk_every_module_once() -> None:
    """Whether a stage may draw, or runs hooks, is read at every step by a walk of the modules'
    tables: it reaches modules nested at any depth, each once, and ends on a model that holds a
    module twice or holds itself."""
    from fxpipe.core.randomness import draws_now, runs_hooks

    identity, dropout = nn.Identity(), nn.Dropout(0.0)
    inner = nn.Sequential(nn.Linear(2, 2), nn.Sequential(identity, dropout))
    model = nn.Sequential(inner, nn.ReLU(), inner)
    model.add_module("itself", model)
    assert not draws_now([model]) and not runs_hooks([model])
    dropout.p = 0.3  # a rate raised after compiling, deep inside
    assert draws_now([model])
    dropout.training = False  # (model.eval() would recurse into the model it holds)
    assert not draws_now([model])
    handle = identity.register_forward_pre_hook(lambda module, args: None)
    assert runs_hooks([model])
    handle.remove()
    assert not runs_hooks([model])


class DrawsFromItsOwnGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        self.noise = torch.Generator().manual_seed(7)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x) * torch.empty_like(x).bernoulli_(0.5, generator=self.noise))


@pytest.mark.parametrize("kept_whole", [False, True])
def test_a_generator_the_model_holds_and_draws_from_is_refused_naming_it(kept_whole: bool) -> None:
    """Before, the graph's check failed ('computes otherwise than the model') with advice about
    data-dependent control flow, which keeping the module whole did not fix."""
    model = nn.Sequential(nn.Linear(8, 8), DrawsFromItsOwnGenerator())
    inner = model[1]
    assert isinstance(inner, DrawsFromItsOwnGenerator)
    state = inner.noise.get_state()
    with pytest.raises(fxpipe.TraceError, match=r"(?s)draws from torch.Generator objects it holds \(1.noise\).*How to fix: draw without generator="):
        compile_pipeline(model, torch.randn(4, 8), ["cpu", "cpu"], chunks=2, leaf_modules=[DrawsFromItsOwnGenerator] if kept_whole else ())
    assert torch.equal(inner.noise.get_state(), state), "the model's generator is left as it was"


_NOISE = torch.Generator().manual_seed(11)


class _DrawsFromAModuleLevelGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h + torch.randn(h.shape, generator=_NOISE, dtype=h.dtype))


class _DrawsFromAGeneratorInAClosure(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)
        generator = torch.Generator().manual_seed(13)
        self.noise = lambda t: torch.empty_like(t).normal_(generator=generator)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h + self.noise(h))


@pytest.mark.parametrize("cls", [_DrawsFromAModuleLevelGenerator, _DrawsFromAGeneratorInAClosure])
def test_a_generator_the_model_does_not_hold_is_refused_naming_the_draw(cls: type[nn.Module]) -> None:
    """A module-level generator, or one a closure holds: before, the graph's check failed ('computes
    otherwise than the model') with advice about data-dependent control flow; now the draw is named,
    and compiling leaves the generator's state as it was."""
    model = cls()
    generator = _NOISE if cls is _DrawsFromAModuleLevelGenerator else model.noise.__closure__[0].cell_contents  # type: ignore[union-attr, index]
    state = generator.get_state()
    with pytest.raises(fxpipe.TraceError, match=r"(?s)draws from a torch.Generator of its code's own, not torch's default \(generator= at .*test_randomness.py:\d+\).*How to fix: draw without generator="):
        compile_pipeline(model, torch.randn(4, 8), ["cpu", "cpu"], chunks=2)
    assert torch.equal(generator.get_state(), state)


def test_the_dispatch_mode_keeps_a_generator_the_op_was_given_and_fills_one_given_as_none() -> None:
    stream = TaskStream(0, 0, 0)
    mine, slopes = torch.Generator().manual_seed(3), torch.Generator().manual_seed(5)
    expected = torch.rand(4, generator=torch.Generator().manual_seed(3))
    with TaskRandomness(stream):
        drawn = torch.rand(4, generator=mine)  # given: kept
        masked = torch.bernoulli(torch.full((4,), 0.5), generator=None)  # given as None: the stream's
        torch.ops.aten.rrelu_with_noise(torch.randn(4), torch.empty(4), 0.1, 0.3, True, slopes)  # by position: kept
    assert torch.equal(drawn, expected) and masked.shape == (4,)
    assert not torch.equal(slopes.get_state(), torch.Generator().manual_seed(5).get_state()), "the op drew from the one it was given"


class _NoisyTeacher(nn.Module):
    """A student and a teacher run under no_grad in forward (a target for the student), the
    teacher with dropout or a BatchNorm in training mode: torch.export captures its region."""

    def __init__(self, teacher_layer: str) -> None:
        super().__init__()
        self.student = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
        middle = nn.Dropout(0.5) if teacher_layer == "dropout" else nn.BatchNorm1d(8)
        self.teacher = nn.Sequential(nn.Linear(8, 8), middle, nn.ReLU(), nn.Linear(8, 8)).requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s = self.student(x)
        with torch.no_grad():
            t = self.teacher(x)
        return (F.log_softmax(s, -1) * F.softmax(t, -1)).sum(-1)


@pytest.mark.parametrize("teacher_layer", ["dropout", "batch_norm"])
def test_a_no_grad_region_draws_and_writes_alike_in_every_checkpoint_mode(teacher_layer: str) -> None:
    """Before, the dropout inside the region a recompute ran again drew new masks (student
    gradients 0.1 apart between modes, the caller's generator left elsewhere), and its BatchNorm's
    running statistics were written again (0.05-0.08 off)."""
    torch.manual_seed(0)
    model = _NoisyTeacher(teacher_layer).double()
    x = torch.randn(8, 8, dtype=torch.float64)
    seen = []
    for mode in ("never", "except_last", "always"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (torch.export's fallback)
            pipe = compile_pipeline(copy.deepcopy(model), x, ["cpu", "cpu"], chunks=2, checkpoint=mode)
        torch.manual_seed(5)
        out = pipe(x)
        out.sum().backward()
        student = pipe.get_submodule("student")
        grads = [p.grad.clone() for p in student.parameters() if p.grad is not None]
        seen.append((out.detach(), grads, dict(pipe.named_buffers()), torch.rand(())))
    first = seen[0]
    for other in seen[1:]:
        assert torch.equal(other[0], first[0])
        assert all(torch.equal(a, b) for a, b in zip(other[1], first[1]))
        assert all(torch.equal(other[2][k], v) for k, v in first[2].items())
        assert torch.equal(other[3], first[3]), "the caller's generator moves alike"
