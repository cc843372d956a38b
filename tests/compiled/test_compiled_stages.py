"""Stages under torch.compile (compile_stages): the plain model's outputs and gradients on every
schedule and checkpoint mode, the masks of dropout replayed, recompiles counted and reported.

Compiling costs seconds per stage, so each model's pipeline is compiled once and shared by the
tests, which move it between schedules and checkpoint modes (its graphs do not depend on them).
"""
from __future__ import annotations

import copy
import threading
import time
import warnings
from contextlib import contextmanager
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import assert_grads_equal, grad_of, twin
from fxpipe import Pipeline, StageError, compile_pipeline

SCHEDULES = ("gpipe", "1f1b", "zb-h1")
MODES = ("never", "except_last", "always")


class SdpaBlock(nn.Module):
    """A pre-norm transformer block whose attention is torch's fused SDPA, causal."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class SdpaGPT(nn.Module):
    """A small GPT: token and position embeddings, SDPA blocks, a head tied to the embedding."""

    def __init__(self, vocab: int = 16, width: int = 16, blocks: int = 2, heads: int = 2) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(32, width)
        self.blocks = nn.Sequential(*[SdpaBlock(width, heads) for _ in range(blocks)])
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)
        self.head.weight = self.tok.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        return self.head(self.ln(self.blocks(x)))


Loss = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _mlp() -> tuple[nn.Module, torch.Tensor, torch.Tensor, Loss]:
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    return model, torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64), F.mse_loss


def _gpt() -> tuple[nn.Module, torch.Tensor, torch.Tensor, Loss]:
    def loss(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.cross_entropy(out.flatten(0, 1), target.flatten())

    return SdpaGPT(), torch.randint(0, 16, (8, 8)), torch.randint(0, 16, (8, 8)), loss


class SmallUNet(nn.Module):
    """A conv U-Net of two levels: convolutions, a norm, pooling, a transposed convolution and
    the skip concatenated back (examples/unet.py has four levels; compiling it takes a minute)."""

    def __init__(self, width: int = 4) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Conv2d(1, width, 3, padding=1), nn.GroupNorm(2, width), nn.SiLU())
        self.down = nn.Sequential(nn.MaxPool2d(2), nn.Conv2d(width, 2 * width, 3, padding=1), nn.SiLU())
        self.up = nn.ConvTranspose2d(2 * width, width, 2, stride=2)
        self.dec = nn.Sequential(nn.Conv2d(2 * width, width, 3, padding=1), nn.SiLU(), nn.Conv2d(width, 1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        skip = self.enc(x)
        return self.dec(torch.cat([self.up(self.down(skip)), skip], dim=1))


def _unet() -> tuple[nn.Module, torch.Tensor, torch.Tensor, Loss]:
    return SmallUNet(), torch.randn(4, 1, 8, 8, dtype=torch.float64), torch.randn(4, 1, 8, 8, dtype=torch.float64), F.mse_loss


MODELS = {"mlp": _mlp, "gpt": _gpt, "unet": _unet}


class Case:
    """A model, its plain twin, an input, a loss of the output, and the pipeline compiled once."""

    def __init__(self, name: str) -> None:
        torch.manual_seed(0)
        model, self.x, self.y, self.loss = MODELS[name]()
        self.plain = model.double()
        self.pipe = compile_pipeline(copy.deepcopy(self.plain), self.x, ["cpu", "cpu"], chunks=4, compile_stages=True)

    def reference(self) -> torch.Tensor:
        self.plain.zero_grad()
        loss = self.loss(self.plain(self.x), self.y)
        loss.backward()
        return loss.detach()


@pytest.fixture(autouse=True)
def _waits_past_a_compile(_bounded_waits: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage compiles on its first call while the next stage waits for its output: inductor
    builds C++ with gcc, tens of seconds on a loaded machine with a cold cache. A hang still
    fails, after two minutes instead of the suite's usual thirty seconds."""
    import fxpipe.runtime.step

    monkeypatch.setattr(fxpipe.runtime.step, "WAIT_TIMEOUT", 120.0)


@pytest.fixture(scope="module")
def cases() -> Iterator[dict[str, Case]]:
    found: dict[str, Case] = {}
    yield found
    for case in found.values():
        case.pipe.close()


def _case(cases: dict[str, Case], name: str) -> Case:
    if name not in cases:
        cases[name] = Case(name)
    return cases[name]


@contextmanager
def configured(pipe: Pipeline, schedule: str, checkpoint: str) -> Iterator[None]:
    """The pipeline under another schedule and checkpoint mode: its stages, and so their
    compiled graphs, are the same under all of them."""
    saved = pipe.plan.schedule, pipe.checkpoint
    pipe.plan.schedule, pipe.checkpoint = schedule, checkpoint
    try:
        yield
    finally:
        pipe.plan.schedule, pipe.checkpoint = saved


@pytest.mark.parametrize("name", list(MODELS))
def test_compiled_stages_give_the_plain_models_outputs_and_gradients(cases: dict[str, Case], name: str) -> None:
    """Inductor's stages (C++ on the CPU), in float64: pipe(x) and backward, and train_step under
    every schedule, in every checkpoint mode."""
    case = _case(cases, name)
    expected = case.reference()
    for checkpoint in MODES:
        with configured(case.pipe, "gpipe", checkpoint):
            case.pipe.zero_grad()
            loss = case.loss(case.pipe(case.x), case.y)
            loss.backward()
        torch.testing.assert_close(loss.detach(), expected, rtol=0, atol=1e-9)
        assert_grads_equal(case.pipe, case.plain, tol=1e-9)
        for schedule in SCHEDULES:
            with configured(case.pipe, schedule, checkpoint):
                case.pipe.zero_grad()
                total = case.pipe.train_step(case.x, target=case.y, loss_fn=case.loss)
            torch.testing.assert_close(total, expected, rtol=0, atol=1e-9, msg=lambda m: f"{schedule}, {checkpoint}: {m}")
            assert_grads_equal(case.pipe, case.plain, tol=1e-9)
    stats = case.pipe.compile_stats()
    # One graph per stage serves every checkpoint mode: a checkpointed forward runs the training
    # graph its recompute runs (before, a graph under no_grad too, whose kernels inductor may fuse apart)
    assert [s.stage for s in stats] == [0, 1] and all(s.graphs == 1 for s in stats), stats
    assert not any(s.recompiles for s in stats), stats


def test_compiled_stages_in_eval_no_grad_and_autocast(cases: dict[str, Case]) -> None:
    case = _case(cases, "mlp")
    with torch.no_grad():
        torch.testing.assert_close(case.pipe(case.x), case.plain(case.x), rtol=0, atol=1e-9)
    case.pipe.eval()
    try:
        torch.testing.assert_close(case.pipe(case.x), case.plain(case.x), rtol=0, atol=1e-9)
    finally:
        case.pipe.train()
    # Under autocast, against the eager pipeline: bfloat16 gradients summed over micro-batches
    # differ from the whole batch's by their rounding, in both.
    x = case.x.float()
    pipes = [
        compile_pipeline(copy.deepcopy(case.plain).float(), x, ["cpu", "cpu"], chunks=2, compile_stages=compiled)
        for compiled in ({"backend": "aot_eager"}, False)
    ]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = (pipe(x) for pipe in pipes)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)  # the same casts, the same ops
    out.float().square().mean().backward()
    expected.float().square().mean().backward()
    assert_grads_equal(pipes[0], pipes[1], tol=1e-6)


def test_a_grad_scaler_scales_and_unscales_compiled_stages_gradients(cases: dict[str, Case]) -> None:
    case = _case(cases, "mlp")
    pipe = compile_pipeline(copy.deepcopy(case.plain), case.x, ["cpu", "cpu"], chunks=4, compile_stages={"backend": "aot_eager"})
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    scaler.scale(F.mse_loss(pipe(case.x), case.y)).backward()
    scaler.unscale_(optimizer)
    case.reference()
    assert_grads_equal(pipe, case.plain, tol=1e-12)
    scaler.step(optimizer)
    scaler.update()
    assert scaler.get_scale() == 1024.0  # no overflow: the scale stays until its growth interval


def test_interleaved_compiled_stages(cases: dict[str, Case]) -> None:
    case = _case(cases, "mlp")
    pipe = compile_pipeline(
        copy.deepcopy(case.plain), case.x, ["cpu", "cpu"], chunks=4, schedule="interleaved-1f1b", stages_per_device=2,
        balance=[2, 1, 1, 1], compile_stages={"backend": "aot_eager"},
    )  # fmt: skip
    expected = case.reference()
    for checkpoint in MODES:
        with configured(pipe, "interleaved-1f1b", checkpoint):
            pipe.zero_grad()
            total = pipe.train_step(case.x, target=case.y, loss_fn=case.loss)
        torch.testing.assert_close(total, expected, rtol=0, atol=1e-12)
        assert_grads_equal(pipe, case.plain, tol=1e-12)
    assert len(pipe.compile_stats()) == 4


class MaskProbe(nn.Module):
    """Two dropouts in two stages on `x * w`: where the output is zero the forward's masks
    dropped it, and where the input's gradient is zero the recompute's masks did."""

    def __init__(self) -> None:
        super().__init__()
        self.w1, self.w2 = nn.Parameter(torch.ones(64)), nn.Parameter(torch.ones(64))
        self.drop1, self.drop2 = nn.Dropout(0.5), nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop2(self.drop1(x * self.w1) * self.w2)


@pytest.mark.parametrize("checkpoint", MODES)
def test_compiled_stages_replay_the_masks_their_forward_drew(checkpoint: str) -> None:
    """Bit for bit: the recompute's masks are the forward's, and the masks are those the eager
    pipeline draws with the same seed (each task's stream, outside the compiled graph)."""
    model = MaskProbe().double()
    x = torch.rand(8, 64, dtype=torch.float64) + 0.5
    results = []
    for compiled in (False, True):  # (inductor: its partition saves the mask)
        pipe = compile_pipeline(copy.deepcopy(model), x, ["cpu", "cpu"], chunks=4, checkpoint=checkpoint, split_points=["drop2"], compile_stages=compiled)
        leaf = x.clone().requires_grad_()
        torch.manual_seed(7)
        out = pipe(leaf)
        out.sum().backward()
        assert leaf.grad is not None
        assert torch.equal(out != 0, leaf.grad != 0), "the recompute drew other masks than the forward"
        results.append((out.detach(), leaf.grad))
    (eager_out, eager_grad), (out, grad) = results
    assert torch.equal(eager_out != 0, out != 0) and torch.equal(eager_grad, grad)
    assert 0.2 < (out == 0).double().mean().item() < 0.8


def test_a_stage_that_draws_under_fullgraph_is_refused() -> None:
    model = MaskProbe().double()
    x = torch.rand(4, 64, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, split_points=["drop2"], compile_stages={"backend": "aot_eager", "fullgraph": True})
    with pytest.raises(RuntimeError, match="fullgraph=True"):
        pipe(x)
    pipe.eval()  # nothing drawn: one graph per stage, as fullgraph asks
    torch.testing.assert_close(pipe(x), x, rtol=0, atol=0)


def test_a_recompile_is_reported_once_naming_the_stage_and_the_guard(cases: dict[str, Case]) -> None:
    case = _case(cases, "mlp")
    pipe = compile_pipeline(copy.deepcopy(case.plain), case.x, ["cpu", "cpu"], chunks=4, compile_stages={"backend": "aot_eager", "dynamic": False})
    x = torch.randn(12, 6, dtype=torch.float64)
    pipe(x[:8]).sum().backward()  # micro-batches of 2 rows
    with pytest.warns(UserWarning, match=r"stage 0 was compiled again: a guard .*size"):
        pipe(x[:4]).sum().backward()  # of 1 row: a new shape
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        pipe(x).sum().backward()  # of 3 rows: counted, not reported again
    stats = pipe.compile_stats()
    assert len(stats[0].recompiles) >= 2 and "size" in stats[0].recompiles[0], stats


def test_a_recompile_is_blamed_on_the_guard_of_its_own_calls_graph_and_warns_at_the_callers_line(cases: dict[str, Case]) -> None:
    """Before, a batch size changed after an autograd.grad call on the input was blamed on a
    frozen parameter: the graph made for that call (whose input requires grad) failed its own
    guard too, and its reason was read as well. And a warning raised on a stage's worker named
    threading.py as the line that caused it."""
    case = _case(cases, "mlp")
    pipe = compile_pipeline(copy.deepcopy(case.plain), case.x, ["cpu", "cpu"], chunks=2, compile_stages={"backend": "aot_eager", "dynamic": False})
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe(x).sum().backward()
    given = x.clone().requires_grad_()
    torch.autograd.grad(pipe(given).sum(), [given])  # another calling context: a graph of its own
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe(x[:6]).sum().backward()  # only the batch size changed
    reports = [w for w in caught if "compiled again" in str(w.message)]
    assert len(reports) == 2, [str(w.message)[:120] for w in caught]  # one per stage
    for report in reports:
        message = str(report.message)
        assert "size mismatch" in message and "requires_grad" not in message, message
        assert "How to fix: for a batch size that changes" in message and "frozen" not in message, message
        assert report.filename == __file__, (report.filename, message[:80])


def test_a_recompile_for_one_sample_under_dynamic_shapes_does_not_advise_dynamic_shapes(cases: dict[str, Case]) -> None:
    """Before, it told a pipeline compiled with dynamic=True to compile with dynamic=True."""
    case = _case(cases, "mlp")
    pipe = compile_pipeline(copy.deepcopy(case.plain), case.x, ["cpu", "cpu"], chunks=4, compile_stages={"backend": "aot_eager", "dynamic": True})
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe(x).sum().backward()  # micro-batches of 2 rows
    with pytest.warns(UserWarning, match=r"compiled again.*\nHow to fix: micro-batches of one sample compile apart even with dynamic=True") as caught:
        pipe(x[:4]).sum().backward()  # of 1 row
    assert "compile with compile_stages={'dynamic': True}" not in str(caught[0].message)


def test_dynamic_stages_take_every_batch_size_without_a_recompile(cases: dict[str, Case]) -> None:
    case = _case(cases, "mlp")
    pipe = compile_pipeline(copy.deepcopy(case.plain), case.x, ["cpu", "cpu"], chunks=4, compile_stages={"backend": "aot_eager", "dynamic": True})
    x = torch.randn(12, 6, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for rows in (8, 12, 10, 8):  # micro-batches of 2, 3, 3 and 2, 2; one sample compiles apart
            pipe.zero_grad()
            case.plain.zero_grad()
            pipe(x[:rows]).square().sum().backward()
            case.plain(x[:rows]).square().sum().backward()
            assert_grads_equal(pipe, case.plain, tol=1e-12)
    assert not any(s.recompiles for s in pipe.compile_stats())


def test_bad_compile_stages_are_refused_with_every_problem() -> None:
    model, x = nn.Linear(4, 4), torch.randn(4, 4)
    with pytest.raises(ValueError) as error:
        compile_pipeline(model, x, ["cpu"], compile_stages={"mdoe": "max", "mode": "fast", "fullgraph": "yes"})
    message = str(error.value)
    for part in ("'mdoe'", "compile_stages['mode'] must be one of", "compile_stages['fullgraph']"):
        assert part in message, message
    with pytest.raises(ValueError, match="compile_stages must be True, False or a dict"):
        compile_pipeline(model, x, ["cpu"], compile_stages="inductor")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="compile_stages\\['backend'\\] must be"):
        compile_pipeline(model, x, ["cpu"], compile_stages={"backend": "no-such-backend"})


def test_inductor_options_are_checked_before_the_model_is_traced() -> None:
    """Before, a misspelt option came back from the first stage compiled, after tracing, as
    inductor's own error listing its six hundred options."""
    model, x = nn.Linear(4, 4), torch.randn(4, 4)
    with pytest.raises(ValueError) as error:
        compile_pipeline(model, x, ["cpu"], compile_stages={"options": {"max_autotunee": True}})
    message = str(error.value)
    assert "'max_autotunee', which is not one of inductor's options (did you mean 'max_autotune'" in message, message
    assert len(message) < 1000, message
    with pytest.raises(ValueError, match="compile_stages\\['options'\\]: .*max_autotune.*bool"):
        compile_pipeline(model, x, ["cpu"], compile_stages={"options": {"max_autotune": 3}})


def test_eager_stages_report_no_compiles() -> None:
    pipe = compile_pipeline(nn.Linear(4, 4), torch.randn(4, 4), ["cpu"])
    assert pipe.compile_stats() == []


class WithUnused(nn.Module):
    """A parameter read detached: the plain model's backward leaves its gradient None."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.unused = nn.Linear(6, 6), nn.Linear(6, 3), nn.Linear(3, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) + self.unused.weight.detach().sum()


def test_stages_whose_outputs_are_static_memory_hand_out_their_own_values() -> None:
    """As under CUDA graphs (the option is inert on the CPU, the handling of static outputs is
    not): outputs and input gradients copied, parameters' gradients accumulated into their own
    memory, and a parameter no gradient reaches left at None."""
    torch.manual_seed(0)
    model = WithUnused().double()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, compile_stages={"backend": "inductor", "options": {"triton.cudagraphs": True}})
    assert all(stage.compiled is not None and stage.compiled.static_outputs for stage in pipe.program().stages)
    x_plain = x.detach().clone().requires_grad_()
    for _ in range(2):  # the second step accumulates into .grad
        pipe(x).square().mean().backward()
        plain(x_plain).square().mean().backward()
    torch.testing.assert_close(x.grad, x_plain.grad, rtol=0, atol=1e-12)
    for (name, p), q in zip(pipe.named_parameters(), plain.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)



def test_a_2bw_loop_draws_its_batches_between_the_compiles_of_its_stages() -> None:
    """dynamo puts torch's default generator back as it was when a compile began: a batch the
    caller's iterable drew while a stage compiled on its worker came again as the next one
    (batch 2 equal to batch 1, losses 0.75 off). The iterable here draws as soon as a compile
    has begun (or after a second): the loop makes it wait until the compile is done."""
    begun = threading.Event()

    def slow(gm: torch.fx.GraphModule, inputs: Any) -> Callable[..., Any]:
        begun.set()
        time.sleep(0.5)
        return gm.forward

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3)).double()
    pipe = compile_pipeline(model, torch.randn(8, 6, dtype=torch.float64), ["cpu", "cpu"], chunks=4, schedule="2bw", compile_stages={"backend": slow})
    drawn: list[torch.Tensor] = []

    def batches() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for index in range(4):
            if index:
                begun.wait(1.0)
            x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 3, dtype=torch.float64)
            drawn.append(x)
            yield x, y

    torch.manual_seed(5)
    list(pipe.train_steps(batches(), loss_fn=F.mse_loss, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1)))
    g = torch.Generator().manual_seed(5)
    expected = [(torch.randn(8, 6, dtype=torch.float64, generator=g), torch.randn(8, 3, dtype=torch.float64, generator=g))[0] for _ in range(4)]
    assert all(torch.equal(a, b) for a, b in zip(drawn, expected)), "a batch was drawn again"
    pipe.close()


def test_deferred_batch_norm_runs_outside_the_compiled_graph_with_no_recompile() -> None:
    """Before, dynamo traced the runtime's deferred BatchNorm: it guarded on the thread's batch
    statistics and compiled stages again for them, warning the caller of a guard on fxpipe's own
    state, and its frames, shared by every BatchNorm, hit the recompile limit at eight widths."""
    torch.manual_seed(0)
    model = nn.Sequential(*[m for i in range(10) for m in (nn.Linear(6 + i, 7 + i), nn.BatchNorm1d(7 + i), nn.Tanh())]).double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipes = [compile_pipeline(copy.deepcopy(model), x, ["cpu", "cpu"], chunks=4, deferred_batch_norm=True, compile_stages=c)
             for c in ({"backend": "aot_eager"}, False)]  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            for pipe in pipes:
                pipe(x).square().sum().backward()
    assert not [w for w in caught if "compiled again" in str(w.message)], [str(w.message)[:120] for w in caught]
    compiled, eager = pipes
    assert all(s.recompiles == [] for s in compiled.compile_stats()), compiled.compile_stats()
    for (name, a), b in zip(compiled.named_parameters(), eager.parameters()):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=0, msg=name)
    for (name, buffer), other in zip(compiled.named_buffers(), eager.buffers()):
        torch.testing.assert_close(buffer, other, rtol=0, atol=0, msg=name)


class TwoHeads(nn.Module):
    """Two outputs: `head` reaches only the first."""

    def __init__(self) -> None:
        super().__init__()
        self.l = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        a = torch.tanh(self.l[0](x))
        c = torch.tanh(self.l[2](torch.tanh(self.l[1](a)))) + a
        return self.head(c), c * 2


@pytest.mark.parametrize("how", ["backward", "two forwards", "autograd.grad", "train_step"])
def test_a_parameter_only_an_output_without_a_gradient_reaches_gets_none_as_in_the_plain_model(how: str) -> None:
    """A compiled stage's backward is one node that gives every parameter a gradient, zeros for
    one no output with a gradient reaches. Before, `head` got a `.grad` of zeros where the plain
    model leaves None (an AdamW step then decayed it: 3.5e-3 off), autograd.grad gave zeros for
    None, and without allow_unused raised nothing where the plain model raises."""
    torch.manual_seed(0)
    model = TwoHeads().double()
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, schedule="1f1b", compile_stages={"backend": "aot_eager"})
    if how == "train_step":
        loss = pipe.train_step(x, target=y, loss_fn=lambda out, target: F.mse_loss(out[1], target))
        expected = F.mse_loss(plain(x)[1], y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    elif how == "backward":
        pipe(x)[1].square().sum().backward()
        plain(x)[1].square().sum().backward()
    elif how == "two forwards":  # one backward of both
        (pipe(x)[1].square().sum() + pipe(2 * x)[1].sum()).backward()
        (plain(x)[1].square().sum() + plain(2 * x)[1].sum()).backward()
    else:
        got = torch.autograd.grad(pipe(x)[1].square().sum(), list(model.parameters()), allow_unused=True)
        want = torch.autograd.grad(plain(x)[1].square().sum(), list(plain.parameters()), allow_unused=True)
        assert [g is None for g in got] == [w is None for w in want] == [False] * 6 + [True, True]
        with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
            torch.autograd.grad(pipe(x)[1].sum(), list(model.parameters()))
        return
    assert model.head.weight.grad is None and plain.head.weight.grad is None
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
    opt, plain_opt = torch.optim.AdamW(model.parameters(), lr=0.1), torch.optim.AdamW(plain.parameters(), lr=0.1)
    opt.step(), plain_opt.step()
    torch.testing.assert_close(model.head.weight, plain.head.weight, rtol=0, atol=0)


class ProbeAndFeatures(nn.Module):
    """A linear probe on detached features (`cut='detach'`), or on their argmax's one-hot
    (`cut='argmax'`), and the features themselves, which the loss leaves unused: the layers
    below get no gradient in the plain model."""

    def __init__(self, cut: str) -> None:
        super().__init__()
        self.cut = cut
        self.l = nn.ModuleList(nn.Linear(6, 6) for _ in range(3))
        self.head = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        c = torch.tanh(self.l[2](torch.tanh(self.l[1](torch.tanh(self.l[0](x))))))
        cuts = {"detach": lambda: c.detach(), "data": lambda: c.data, "detach_": lambda: c.clone().detach_(), "new_tensor": lambda: c.new_tensor(c),
                "argmax": lambda: F.one_hot(c.argmax(-1), 6).to(c.dtype)}  # fmt: skip
        probe = cuts[self.cut]()
        return self.head(probe), c * 2


@pytest.mark.parametrize("cut", ["detach", "data", "detach_", "new_tensor", "argmax"])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_a_parameter_reached_only_through_a_cut_gets_none_as_in_the_plain_model(cut: str, checkpoint: str) -> None:
    """Before, the walk that tells which parameters a used output reaches went through
    `detach()` and through integer values: the layers below got a `.grad` of zeros from the
    unused output's compiled backward (an AdamW step then decayed them: 3.8e-4 off)."""
    torch.manual_seed(0)
    model = ProbeAndFeatures(cut).double()
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, checkpoint=checkpoint, compile_stages={"backend": "aot_eager"})
    F.mse_loss(pipe(x)[0], y).backward()
    F.mse_loss(plain(x)[0], y).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)
    assert plain.l[0].weight.grad is None


@pytest.mark.parametrize("how", ["autograd.grad", "train_step", "two forwards"])
def test_a_parameter_reached_only_through_a_cut_gets_none_in_every_use(how: str) -> None:
    """The probe on detached features of the test above, through autograd.grad (None where
    allow_unused), train_step (1f1b) and two forwards before one backward."""
    torch.manual_seed(0)
    model = ProbeAndFeatures("detach").double()
    plain = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, schedule="1f1b", compile_stages={"backend": "aot_eager"})
    if how == "autograd.grad":
        got = torch.autograd.grad(F.mse_loss(pipe(x)[0], y), list(model.parameters()), allow_unused=True)
        want = torch.autograd.grad(F.mse_loss(plain(x)[0], y), list(plain.parameters()), allow_unused=True)
        assert [g is None for g in got] == [w is None for w in want] == [True] * 6 + [False, False]
        for g, w in zip(got[6:], want[6:]):
            torch.testing.assert_close(g, w, rtol=0, atol=1e-12)
        return
    if how == "train_step":
        loss = pipe.train_step(x, target=y, loss_fn=lambda out, target: F.mse_loss(out[0], target))
        expected = F.mse_loss(plain(x)[0], y)
        expected.backward()
        torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    else:
        (F.mse_loss(pipe(x)[0], y) + F.mse_loss(pipe(2 * x)[0], y)).backward()
        (F.mse_loss(plain(x)[0], y) + F.mse_loss(plain(2 * x)[0], y)).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_under_autocast_compiled_stages_leave_none_where_the_eager_ones_do(checkpoint: str) -> None:
    """A parameter no output with a gradient reaches keeps None under bfloat16 autocast too, in
    every checkpoint mode (the recompute runs the compiled forward), and the others get the eager
    pipeline's gradients bit for bit."""
    torch.manual_seed(0)
    model, x = TwoHeads(), torch.randn(8, 6)
    grads = []
    for compiled in ({"backend": "aot_eager"}, False):
        copied = copy.deepcopy(model)
        pipe = compile_pipeline(copied, x, ["cpu", "cpu"], chunks=2, checkpoint=checkpoint, compile_stages=compiled)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = pipe(x)[1]
        assert out.dtype == torch.bfloat16
        out.float().square().sum().backward()
        grads.append([p.grad for p in copied.parameters()])
        pipe.close()
    assert [g is None for g in grads[0]] == [g is None for g in grads[1]] == [False] * 6 + [True, True]
    for got, expected in zip(*grads):
        if expected is not None:
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_a_call_under_inference_mode_is_a_calling_context_not_a_recompile() -> None:
    """Before, a call under torch.inference_mode() after one under no_grad was reported as a
    recompile (the guard on the inputs' dispatch keys), advising dynamic shapes for a batch size
    that never changed."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(copy.deepcopy(model), x, ["cpu", "cpu"], chunks=2, compile_stages={"backend": "aot_eager"})
    with torch.no_grad():
        pipe(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.inference_mode():
            out = pipe(x)
    torch.testing.assert_close(out, model(x), rtol=0, atol=1e-12)
    assert not any(s.recompiles for s in pipe.compile_stats())


class WritesItsInput(nn.Module):
    """A forward that writes one of its inputs in place, read by both stages."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        buf.mul_(2)
        return self.b(torch.tanh(self.a(x) + buf)) * buf


@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no_grad"])
def test_an_input_a_compiled_stage_writes_in_place_is_written_back_as_the_plain_model_writes_it(grad: bool) -> None:
    """Before, the caller's tensor was left as it was (each row up to 2.6 off the plain model's):
    a compiled stage returns a new tensor for the copy it wrote, whose version counter says
    nothing was written."""
    torch.manual_seed(0)
    model, x, buf = WritesItsInput().double(), torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    plain = copy.deepcopy(model)
    pipe = compile_pipeline(model, (x, buf.clone()), ["cpu", "cpu"], chunks=4, split_points=["b"], compile_stages={"backend": "aot_eager"})
    mine, theirs = buf.clone(), buf.clone()
    with torch.set_grad_enabled(grad):
        out, expected = pipe(x, mine), plain(x, theirs)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(mine, theirs, rtol=0, atol=0)
    if grad:
        out.sum().backward()
        expected.sum().backward()
        assert_grads_equal(pipe, plain, tol=1e-12)


def test_a_stage_with_a_forward_hook_under_fullgraph_is_refused_naming_what_may_draw() -> None:
    """Before, it was refused as a stage that 'draws random numbers (dropout, say)', advising eval
    mode, which was refused the same way: the hook's code, which the graph does not show, may draw."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    model[0].register_forward_hook(lambda module, args, out: None)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, compile_stages={"backend": "aot_eager", "fullgraph": True})
    pipe.eval()
    with pytest.raises(RuntimeError, match=r"(?s)stage 0 may draw random numbers.*a forward hook.*How to fix: .*no forward hooks"):
        pipe(x)
    pipe = compile_pipeline(plain, x, ["cpu", "cpu"], chunks=2, compile_stages={"backend": "aot_eager", "fullgraph": True})
    torch.testing.assert_close(pipe(x), copy.deepcopy(plain)(x), rtol=0, atol=1e-12)
    assert all(s.graphs >= 1 for s in pipe.compile_stats())


def test_a_stage_with_a_forward_hook_runs_eagerly_saying_so_once_at_the_callers_line() -> None:
    """The hook's code, which the graph does not show, may draw: the stage runs eagerly where it
    may, and says so once. Before, the warning named threading.py (a worker raised it)."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)).double()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    model[0].register_forward_hook(lambda module, args, out: out * 2)
    plain[0].register_forward_hook(lambda module, args, out: out * 2)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, compile_stages={"backend": "aot_eager"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = pipe(x)
        pipe(x)
    said = [w for w in caught if "runs eagerly in steps where it may draw" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__ and "stage 0" in str(said[0].message), [(w.filename, str(w.message)[:80]) for w in caught]
    torch.testing.assert_close(out, plain(x), rtol=0, atol=1e-12)


class CountsInFloat64(nn.Module):
    """Counters its forward writes in place: a 0-dim float64 one, and others torch.compile keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.steps64: torch.Tensor
        self.steps32: torch.Tensor
        self.vector64: torch.Tensor
        self.register_buffer("steps64", torch.zeros((), dtype=torch.float64))
        self.register_buffer("steps32", torch.zeros((), dtype=torch.float32))
        self.register_buffer("vector64", torch.zeros(1, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        self.steps64.add_(1)
        self.steps32.add_(1)
        return self.b(h) + self.vector64.add_(1)


def test_a_stage_writing_a_0_dim_float64_buffer_runs_eagerly_with_a_warning_and_counts_as_the_plain_model() -> None:
    """Before, the compiled stage's writes to it vanished (0 where the plain model counts 8):
    torch.compile loses in-place writes to a 0-dim float64 tensor."""
    model, x = CountsInFloat64(), torch.randn(8, 6)
    plain = copy.deepcopy(model)
    with pytest.warns(UserWarning, match=r"stage 0 runs eagerly: it writes the 0-dim float64 buffer steps64 in place"):
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, split_points=["b"], compile_stages={"backend": "aot_eager"})
    for _ in range(2):
        out = pipe(x)
        out.sum().backward()
        for part in x.chunk(4):
            plain(part)
    assert [b.item() for b in pipe.buffers()] == [b.item() for b in plain.buffers()] == [8.0, 8.0, 8.0]
    assert [(s.stage, s.graphs >= 1) for s in pipe.compile_stats()] == [(1, True)]  # the other stage runs compiled


class _Rounded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 4)
        self.drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(torch.relu(self.b(self.drop(torch.relu(self.a(x))))))


def test_under_saved_tensor_hooks_that_cast_the_stages_run_as_the_model_does() -> None:
    """Before, a hook that packs to bfloat16 gave gradients up to 1.58 off: the compiled backward
    saves ReLU's bool mask, which the model never saves, and took it back as a float."""

    def pack(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.bfloat16)

    def unpack(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float64)

    model = _Rounded().double()
    x = torch.randn(8, 8, dtype=torch.float64)
    results = []
    for compiled in (False, True):  # (inductor: its partition saves the mask)
        pipe = compile_pipeline(copy.deepcopy(model), x, ["cpu", "cpu"], chunks=2, split_points=["b"], compile_stages=compiled)
        torch.manual_seed(0)
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack), warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            pipe(x).square().sum().backward()
        assert any("stages run uncompiled" in str(w.message) for w in caught) == bool(compiled)
        results.append({name: grad_of(p) for name, p in pipe.named_parameters()})
        pipe.close()
    for name, grad in results[0].items():
        assert torch.equal(grad, results[1][name]), name


class _WritesWhatSigmoidSaved(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.sigmoid(self.a(x))
        h.mul_(2)  # sigmoid saved its output: the plain model's backward raises
        return self.b(h)


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_model_whose_own_backward_fails_is_told_apart_from_what_pipelining_does(chunks: int) -> None:
    """Before, every such error advised chunks=1 for a parameter written in forward (none is),
    and a compiled stage's failure in forward did not say the model itself may be at fault."""
    model, x = _WritesWhatSigmoidSaved().double(), torch.randn(8, 8, dtype=torch.float64)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        model(x).sum().backward()
    for compiled in (False, {"backend": "aot_eager"}):
        pipe = compile_pipeline(copy.deepcopy(model), x, ["cpu", "cpu"], chunks=chunks, split_points=["b"], compile_stages=compiled)
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as info:
            pipe(x).sum().backward()
        assert ("or chunks=1" in str(info.value)) == (chunks > 1 and not compiled)
        assert ("compile_stages=False runs the stage as the model runs" in str(info.value)) == bool(compiled)
        pipe.close()


class OptionalMask(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l = nn.ModuleList(nn.Linear(8, 8) for _ in range(4))

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.l[0](x).tanh()
        if mask is not None:
            h = h * mask
        for layer in self.l[1:]:
            h = layer(h).tanh()
        return h


def test_compile_stats_count_the_stages_compiled_for_another_kind_of_call() -> None:
    """Before, the graphs and recompiles of the stages a call with `mask` compiled went unreported."""
    pipe = compile_pipeline(OptionalMask().double(), torch.randn(8, 8, dtype=torch.float64), ["cpu", "cpu"], chunks=2,
                            compile_stages={"backend": "aot_eager"})  # fmt: skip
    pipe(torch.randn(8, 8, dtype=torch.float64)).sum().backward()
    before = [s.graphs for s in pipe.compile_stats()]
    x, mask = torch.randn(8, 8, dtype=torch.float64), (torch.randn(8, 8) > 0).double()
    pipe(x, mask=mask).sum().backward()
    after = [s.graphs for s in pipe.compile_stats()]
    assert len(after) == len(before) == 2 and all(a > b for a, b in zip(after, before)), (before, after)


def test_a_layer_frozen_between_calls_recompiles_with_advice_about_freezing() -> None:
    """Before, the warning advised dynamic=True for batch sizes that never changed."""
    model, plain = twin(nn.Sequential(*[nn.Linear(8, 8) for _ in range(4)]).double())
    x, y = torch.randn(8, 8, dtype=torch.float64), torch.randn(8, 8, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, compile_stages={"backend": "aot_eager"})
    F.mse_loss(pipe(x), y).backward()
    model[0].requires_grad_(False)
    plain[0].requires_grad_(False)
    with pytest.warns(UserWarning, match=r"(?s)compiled again.*How to fix: a parameter of the stage was frozen or unfrozen"):
        F.mse_loss(pipe(x), y).backward()
    model.zero_grad()
    F.mse_loss(pipe(x), y).backward()
    F.mse_loss(plain(x), y).backward()
    assert model[0].weight.grad is None
    assert_grads_equal(model, plain, tol=1e-12)


class SparseTowers(nn.Module):
    """A sparse embedding's gradient through a frozen layer into two towers: inductor cannot
    compile its backward (torch.compile of this model fails alike)."""

    def __init__(self, d: int = 8) -> None:
        super().__init__()
        self.t = nn.ModuleList(nn.Sequential(nn.Linear(d, d), nn.Tanh()) for _ in range(2))
        self.emb = nn.Embedding(10, d, sparse=True)
        self.frozen = nn.Linear(d, d).requires_grad_(False)

    def forward(self, x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        x = x + self.emb(idx)
        return torch.cat([t(self.frozen(x)) for t in self.t], -1)


def test_a_sparse_gradient_inductor_cannot_compile_is_refused_saying_what_compiles_it() -> None:
    """Before, the stage's error was inductor's alone ('Cannot access storage of
    SparseTensorImpl'), with no word of what to do; the backend it advises gives the plain
    model's gradients, sparse as the plain model's."""
    torch.manual_seed(0)
    model, plain = twin(SparseTowers().double())
    x, idx = torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 10, (8,))
    pipe = compile_pipeline(copy.deepcopy(model), (x, idx), ["cpu"], chunks=1, compile_stages=True)
    with pytest.raises(StageError, match=r"(?s)SparseTensorImpl.*inductor cannot compile a sparse gradient.*How to fix: compile_stages=\{'backend': 'aot_eager'\}"):
        pipe(x, idx).sum().backward()
    pipe = compile_pipeline(model, (x, idx), ["cpu", "cpu"], chunks=2, compile_stages={"backend": "aot_eager"})
    pipe(x, idx).sum().backward()
    plain(x, idx).sum().backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters()):
        assert (p.grad is None) == (q.grad is None), name
        if p.grad is not None and q.grad is not None:  # (a sparse one holds each micro-batch's rows apart: compared dense)
            assert p.grad.is_sparse == q.grad.is_sparse, name
            torch.testing.assert_close(p.grad.to_dense(), q.grad.to_dense(), rtol=0, atol=1e-12, msg=name)
    assert model.emb.weight.grad is not None and model.emb.weight.grad.is_sparse
