"""Every way a caller runs a model: train and eval, no_grad and inference mode, autocast,
autograd.grad, backward(inputs=...), hooks, accumulation, and two forwards before one backward."""
from __future__ import annotations

import contextlib
import copy
import itertools
from typing import Any, Callable, Iterator

import pytest
import torch
import torch.nn.functional as F
from torch import is_autocast_enabled as autocast_on
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import FlopCounterMode

from helpers import CountingBlock, FanOut, SeqFirst, WithPositions, assert_call_and_grads_equal, assert_grads_equal, grad_of, twin
from fxpipe import compile_pipeline, pipe_split

MODES = ("always", "except_last", "never")


class Branchy(nn.Module):
    """Reads `self.training` in forward: a Python branch and a functional dropout."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if self.training:
            h = h * 2
        h = F.dropout(torch.tanh(self.b(h)), 0.5, self.training)
        return self.c(h)


@pytest.mark.parametrize("mode", MODES)
def test_eval_mode_runs_the_eval_graph(mode: str) -> None:
    model, reference = twin(Branchy())
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=4, checkpoint=mode)
    pipe.eval()
    reference.eval()
    assert not model.training
    out = pipe(x)
    torch.testing.assert_close(out, reference(x), rtol=0, atol=1e-12)
    out.sum().backward()
    reference(x).sum().backward()
    assert_grads_equal(pipe, reference)
    pipe.train()
    torch.manual_seed(0)
    trained = pipe(x)
    assert not torch.allclose(trained, out), "train mode must drop and double again"
    model.a.eval()  # a Linear, called whole: its flag decides nothing the graph holds
    assert pipe(x).shape == out.shape


class _FrozenNorm(Branchy):
    """A BatchNorm frozen while the rest trains (fine-tuning), in a forward that reads
    `self.training`; `*rest`: torch.export, which bakes each module's mode into its graph."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.BatchNorm1d(6).eval()

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return super().forward(self.norm(x))


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
@pytest.mark.parametrize("cls", [Branchy, _FrozenNorm], ids=["torch.fx", "torch.export"])
def test_a_module_set_apart_when_compiling_runs_the_graph_traced_so(cls: type[Branchy]) -> None:
    """Before, torch.export's pipeline refused the first call: mixed modes, 'compile the model in
    the mixed mode you need', which it was."""
    model, reference = twin(cls())
    model.a.eval(), reference.a.eval()  # set apart before compiling
    apart = [m for m in model.modules() if not m.training]
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
    torch.manual_seed(0)
    out = pipe(x)
    pipe.eval(), reference.eval()
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)
    pipe.train()
    refused = r"(?s)reads `self.training`, and no graph was traced with its modules in the modes they are in: norm in training mode now, where the training graph"
    with pytest.raises(RuntimeError, match=refused) if cls is _FrozenNorm else contextlib.nullcontext() as said:
        model.a.eval()  # the norm trains now, which torch.export's graph has in eval mode
        pipe(x)
    if said is not None:  # the whole pipeline in eval mode runs; in training mode it was just refused
        assert "whole pipeline in one mode (pipe.eval())" in str(said.value) and "pipe.train()" not in str(said.value)
    for module in apart:  # as compiled again
        module.eval()
    torch.manual_seed(0)
    torch.testing.assert_close(pipe(x), out, rtol=0, atol=0)


class _TrainsItsOwnWay(Branchy):
    """Overrides train() and reads its own flag there, as library models do (to clear a cache)."""

    def __init__(self) -> None:
        super().__init__()
        self.cache: dict[str, torch.Tensor] = {}

    def train(self, mode: bool = True) -> "_TrainsItsOwnWay":
        if self.training != mode:
            self.cache.clear()
        return super().train(mode)


class _KeepsItsNormFrozen(nn.Module):
    """Keeps its BatchNorm in eval mode while it trains, in its own train() (a detector's
    frozen backbone norms)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.norm, self.b = nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Linear(6, 6)

    def train(self, mode: bool = True) -> "_KeepsItsNormFrozen":
        super().train(mode)
        self.norm.eval()
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.norm(self.a(x))))


def test_pipe_train_and_eval_run_the_models_own_train() -> None:
    """Before, pipe.train() set the flags of the model's modules itself, past the model's own
    train(): the frozen norm trained (0.23 off in the loss, its statistics written)."""
    model, reference = twin(_KeepsItsNormFrozen())
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
    pipe.eval(), reference.eval()
    pipe.train(), reference.train()
    assert not model.norm.training and pipe.training and model.training
    loss = pipe.train_step(x, target=y, loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)
    assert_call_and_grads_equal(pipe, reference, x)  # and in a call: the norm's frozen statistics serve each micro-batch alike
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)
    for (name, got), want in zip(model.named_buffers(), reference.buffers()):
        torch.testing.assert_close(got, want, rtol=0, atol=0, msg=name)


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
@pytest.mark.parametrize("compiled_in", ["train", "eval"])
def test_a_train_override_that_reads_the_flag_decides_no_graph(compiled_in: str) -> None:
    """Before, the override's read of `self.training`, made while compiling set each trace's
    mode, was taken for the trace's: a model compiled in eval refused every call in training
    mode, advising pipe.train(), which had just been called."""
    model, reference = twin(_TrainsItsOwnWay())
    model.train(compiled_in == "train")
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
    for training in (True, False, True):
        pipe.train(training), reference.train(training)
        torch.manual_seed(0)
        out = pipe(x)
        torch.manual_seed(0)
        expected = torch.cat([reference(piece) for piece in x.chunk(2)]) if training else reference(x)
        if not training:
            torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
        else:  # each micro-batch draws its own dropout mask: the same shape, and scaled as training does
            assert out.shape == expected.shape and not torch.allclose(out, reference.eval()(x))


@pytest.mark.parametrize("stages", [1, 3])  # one worker runs its tasks on the caller's thread
def test_no_grad_and_inference_mode(stages: int) -> None:
    model, reference = twin(FanOut())
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * stages, chunks=4)
    with torch.no_grad():
        out = pipe(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, reference(x), rtol=0, atol=1e-12)
    with torch.inference_mode():
        out = pipe(x)
        assert out.is_inference()
        torch.testing.assert_close(out, reference(x), rtol=0, atol=1e-12)


class _CastsFirst(FanOut):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(x.to(torch.float64))


@pytest.mark.parametrize("stages", [1, 3])
def test_an_input_made_under_inference_mode_trains_outside_it(stages: int) -> None:
    """The plain model trains on it where forward makes a normal tensor of it (a cast, a copy).
    Before, the call failed with torch's bare 'Inference tensors do not track version counter'."""
    model, reference = twin(_CastsFirst())
    with torch.inference_mode():
        x = torch.randn(8, 6)
    pipe = compile_pipeline(model, x.clone(), ["cpu"] * stages, chunks=4)
    assert_call_and_grads_equal(pipe, reference, x)
    target = torch.randn(8, 6, dtype=torch.float64)
    for schedule in ("1f1b", "2bw"):
        model, reference = twin(_CastsFirst())
        pipe = compile_pipeline(model, x.clone(), ["cpu"] * max(stages, 2), chunks=4, schedule=schedule)
        optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
        losses = [float(loss) for loss in pipe.train_steps([(x, target)], loss_fn=F.mse_loss, optimizer=optimizer)]
        expected = F.mse_loss(reference(x), target)
        expected.backward()
        torch.optim.SGD(reference.parameters(), lr=0.1).step()
        assert losses == pytest.approx([float(expected)], rel=1e-12)
        assert_grads_equal(pipe, reference)
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-12)


@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_cpu_autocast_reaches_every_stage_and_the_recompute(mode: str, stages: int) -> None:
    model = FanOut(width=16)
    reference = copy.deepcopy(model)
    x = torch.randn(8, 16)
    pipe = compile_pipeline(model, x, ["cpu"] * stages, chunks=4, checkpoint=mode)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pipe(x)
        expected = reference(x)
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.float().sum().backward()
    expected.float().sum().backward()
    for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
        # bfloat16 rounds differently on 2-row micro-batches than on the batch: a few ulps
        assert p.grad is not None and q.grad is not None, name
        assert (p.grad - q.grad).norm() <= 2e-2 * q.grad.norm(), name


class _HalfOut(nn.Module):
    """Returns its features in float16, whatever the caller's autocast."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.a(x).relu()).half()


def test_an_output_of_another_low_precision_than_the_callers_autocast_comes_back_as_the_model_gave_it() -> None:
    """Before, putting the micro-batches' float16 outputs together under bfloat16 autocast raised
    torch's "Unexpected floating ScalarType in at::autocast::prioritize", at compile time too."""
    model, x = _HalfOut(), torch.randn(8, 16)
    reference = copy.deepcopy(model)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
        out, expected = pipe(x), reference(x)
        assert out.dtype == expected.dtype == torch.float16
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        loss = pipe.train_step(x, target=torch.zeros(8, 16), loss_fn=lambda o, t: (o.float() - t).pow(2).mean())
    torch.testing.assert_close(loss, (expected.float() - 0).pow(2).mean(), rtol=1e-3, atol=1e-3)


class _ReadTwiceAfterTheCut(nn.Module):
    """A float32 value read by two layers of the stage after the cut: autocast casts it at each."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x).float().tanh()
        pipe_split()
        return (self.b(h) + self.c(h)).float().tanh()


@pytest.mark.parametrize("mode", MODES)
def test_a_value_read_twice_after_the_cut_under_autocast_is_cast_at_each_use_as_in_the_plain_model(mode: str) -> None:
    """Before, a stage's inputs were leaves, whose casts autocast caches in a table every thread
    shares and any thread's closing region empties: whether the two reads shared one cast (their
    gradients then added in bfloat16) turned on the other stage's timing, and gradients differed
    from run to run and from the plain model. The loss reads the outputs the same way."""
    model = _ReadTwiceAfterTheCut()
    x, probe = torch.randn(8, 16), torch.randn(16, 16)

    def loss_fn(out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((out @ probe) * (out @ probe.T)).float().mean()  # two casts of the float32 output

    for _ in range(3):
        pipe_model, reference = copy.deepcopy(model), copy.deepcopy(model)
        pipe = compile_pipeline(pipe_model, x, ["cpu"] * 2, chunks=1, checkpoint=mode)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, expected = pipe(x), reference(x)
            loss, expected_loss = loss_fn(out, x), loss_fn(expected, x)
        loss.backward()
        expected_loss.backward()
        assert torch.equal(loss, expected_loss)
        assert_grads_equal(pipe, reference, tol=0.0)
        pipe_model.zero_grad()
        reference.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            step_loss = pipe.train_step(x, target=x, loss_fn=loss_fn)
            expected_loss = loss_fn(reference(x), x)
        expected_loss.backward()
        assert torch.equal(step_loss, expected_loss.detach())
        assert_grads_equal(pipe, reference, tol=0.0)
        pipe_model.zero_grad()
        reference.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):  # two forwards, then one backward
            losses = [loss_fn(pipe(x), x), loss_fn(pipe(2 * x), x)]
            expected_losses = [loss_fn(reference(x), x), loss_fn(reference(2 * x), x)]
        assert all(torch.equal(a, b) for a, b in zip(losses, expected_losses))
        (losses[0] + losses[1]).backward()
        (expected_losses[0] + expected_losses[1]).backward()
        # Not bit for bit: the plain model casts each weight once for its whole region and adds
        # the two forwards' gradients in bfloat16 before the cast back; each pipeline call casts
        # its own and they add up in float32. One bfloat16 step of the largest, at most.
        for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
            got, want = grad_of(p), grad_of(q)
            assert (got - want).abs().max() <= 2**-8 * want.abs().max(), name
        pipe.close()


def test_the_callers_autocast_region_keeps_its_casts_across_a_pipeline_call() -> None:
    """Autocast caches the casts of the caller's leaves (a layer's weight) for the length of its
    region, in a table every thread shares. Before, each stage's task emptied it as its own
    region closed: a layer of the caller's used before and after `pipe(x)` was cast twice where
    the plain model casts it once, and its gradient rounded otherwise (by 0.016)."""
    layer, body = nn.Linear(16, 16), nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    x = torch.randn(8, 16)
    grads = []
    for pipelined in (False, True):
        outer, inner = copy.deepcopy(layer), copy.deepcopy(body)
        run = compile_pipeline(inner, x, ["cpu"] * 2, chunks=1) if pipelined else inner
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = outer(run(outer(x).float()).float()).float().tanh()
        out.sum().backward()
        grads.append(grad_of(outer.weight))
    assert torch.equal(grads[0], grads[1]), (grads[0] - grads[1]).abs().max()


def _rounded(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float32) if t.dtype == torch.float64 else t


def _widened(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64) if t.dtype == torch.float32 else t


@pytest.mark.parametrize("stages", [1, 3])
@pytest.mark.parametrize("mode", MODES)
def test_saved_tensor_hooks_of_the_caller_pack_what_every_stage_saves(mode: str, stages: int) -> None:
    """Before, a stage worker saved its activations as they were, outside the caller's
    `saved_tensors_hooks` (thread-local in PyTorch): hooks that store a float64 activation in
    float32 changed the plain model's gradients by about 1e-8 and not the pipeline's. Every mode,
    on stage workers and on the caller's thread (one stage), with the memory meter counting too;
    `save_on_cpu` runs."""
    model, reference = twin(FanOut(width=16).double())
    x = torch.randn(8, 16, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * stages, chunks=1, checkpoint=mode)
    hooks = (lambda: torch.autograd.graph.saved_tensors_hooks(_rounded, _widened), torch.autograd.graph.save_on_cpu)
    for measured, saving in itertools.product((False, True), hooks):
        pipe.measure_memory = measured
        with saving():
            out, expected = pipe(x), reference(x)
            out.pow(2).sum().backward()
            expected.pow(2).sum().backward()
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
        assert_grads_equal(pipe, reference, tol=1e-12)
        assert not measured or max(pipe.last_peak_bytes) > 0, "the meter counts what the stages save"
        model.zero_grad()
        reference.zero_grad()
    # Two forwards under the hooks before one backward outside them; autograd.grad; eval.
    with torch.autograd.graph.saved_tensors_hooks(_rounded, _widened):
        outs, expected_outs = [pipe(x), pipe(2 * x)], [reference(x), reference(2 * x)]
    sum(o.pow(2).sum() for o in outs).backward()
    sum(o.pow(2).sum() for o in expected_outs).backward()
    assert_grads_equal(pipe, reference, tol=1e-12)
    params, ref_params = list(pipe.parameters()), list(reference.parameters())
    with torch.autograd.graph.saved_tensors_hooks(_rounded, _widened):
        grads = torch.autograd.grad(pipe(x).pow(2).sum(), params)
        expected_grads = torch.autograd.grad(reference(x).pow(2).sum(), ref_params)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    pipe.eval(), reference.eval()
    with torch.autograd.graph.saved_tensors_hooks(_rounded, _widened):
        out, expected = pipe(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


class _Counts(TorchDispatchMode):
    """Counts the aten ops this thread runs under it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.ops += 1
        return func(*args, **(kwargs or {}))


def test_a_mode_the_stages_would_not_see_is_refused_naming_it() -> None:
    """Modes are per thread. Before, a dispatch mode around pipe(x) on two devices saw 17 ops
    (the call's own), the plain model's 29: a mode that counts or changes values was silently
    left out of the stages. One device runs pipe(x) on the calling thread, under the mode."""
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16))
    x = torch.randn(8, 16)
    with _Counts() as plain:
        model(x)
    for devices in (["cpu"] * 2, ["cpu"]):
        pipe = compile_pipeline(copy.deepcopy(model), x, devices, chunks=2)
        for mode in (_Counts, lambda: torch.device("cpu")):
            with mode() as counts:
                if len(devices) > 1:
                    named = r"(_Counts \(a TorchDispatchMode\)|DeviceContext \(a TorchFunctionMode\))"
                    with pytest.raises(RuntimeError, match=rf"runs under {named}, which PyTorch keeps per thread(?s:.)*How to fix: enter the mode"):
                        pipe(x)
                else:
                    pipe(x)
                    assert not isinstance(counts, _Counts) or counts.ops > plain.ops
        # Its module tracker adds global hooks, which the guards refuse on any device: said so, and
        # on several devices the advice is not one device (before, it was, which refused it too).
        refused = r"global module hooks(?s:.)*under _FlopCounterMode(?s:.)*around the plain model" if len(devices) == 1 else \
            r"runs under _FlopCounterMode(?s:.)*around the plain model \(it tracks modules with global hooks, which a pipeline refuses on any device\)\.$"
        with pytest.raises(RuntimeError, match=refused):
            with FlopCounterMode(display=False):
                pipe(x)
        # After a refusal, a call and its backward are the plain model's, and the generator is where it was.
        pipe_model, reference = copy.deepcopy(model), copy.deepcopy(model)
        pipe = compile_pipeline(pipe_model, x, devices, chunks=2)
        generator = torch.get_rng_state()
        with _Counts(), contextlib.suppress(RuntimeError):
            pipe(x)
        assert torch.equal(torch.get_rng_state(), generator)
        out, expected = pipe(x), reference(x)
        torch.testing.assert_close(out, expected, rtol=0, atol=0)
        out.sum().backward()
        expected.sum().backward()
        assert_grads_equal(pipe, reference, tol=1e-6)
        pipe.close()
    # A loop of overlapping steps runs its stages on workers, even one alone.
    pipe = compile_pipeline(copy.deepcopy(model), x, ["cpu"], chunks=2, schedule="2bw")
    before = [p.detach().clone() for p in pipe.parameters()]
    with _Counts(), pytest.raises(RuntimeError, match="which PyTorch keeps per thread"):
        list(pipe.train_steps([(x, x)], loss_fn=F.mse_loss, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1)))
    assert all(torch.equal(p, b) and p.grad is None for p, b in zip(pipe.parameters(), before)), "nothing is left half-done"
    pipe.close()


def test_autograd_grad_on_inputs_leaves_parameters_alone() -> None:
    model, reference = twin(FanOut())
    x = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    pipe = compile_pipeline(model, x, ["cpu"] * 4, chunks=3)
    (grad,) = torch.autograd.grad(pipe(x).pow(2).sum(), x)
    (expected,) = torch.autograd.grad(reference(x).pow(2).sum(), x)
    torch.testing.assert_close(grad, expected, rtol=0, atol=1e-10)
    assert all(p.grad is None for p in pipe.parameters())
    pipe(x).sum().backward(inputs=[x])
    assert all(p.grad is None for p in pipe.parameters())


def test_gradient_penalty_then_backward_gives_the_plain_gradients() -> None:
    """A gradient penalty computed with autograd.grad, then loss.backward(): .grad holds only
    the second."""
    model, reference = twin(FanOut())
    x = torch.randn(8, 6, dtype=torch.float64, requires_grad=True)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=2)
    for net in (pipe, reference):
        torch.autograd.grad(net(x).sum(), x)
        net(x).pow(2).mean().backward()
    assert_grads_equal(pipe, reference)


def test_autograd_grad_on_parameters_does_not_touch_dot_grad() -> None:
    model, reference = twin(FanOut())
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=4)
    grads = torch.autograd.grad(pipe(x).pow(2).sum(), list(pipe.parameters()))
    expected = torch.autograd.grad(reference(x).pow(2).sum(), list(reference.parameters()))
    for g, e in zip(grads, expected):
        torch.testing.assert_close(g, e, rtol=0, atol=1e-10)
    assert all(p.grad is None for p in pipe.parameters())


def test_parameter_hooks_fire_once_with_the_full_gradient() -> None:
    model, reference = twin(FanOut())
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 3, chunks=4)
    seen: dict[str, list[torch.Tensor]] = {"pipe": [], "plain": []}
    first, plain_first = model.layers[0], reference.layers[0]
    assert isinstance(first, nn.Linear) and isinstance(plain_first, nn.Linear)
    first.weight.register_hook(lambda g: seen["pipe"].append(g.clone()))
    plain_first.weight.register_hook(lambda g: seen["plain"].append(g.clone()))
    pipe(x).sum().backward()
    reference(x).sum().backward()
    assert len(seen["pipe"]) == len(seen["plain"]) == 1
    torch.testing.assert_close(seen["pipe"][0], seen["plain"][0], rtol=0, atol=1e-10)


def test_create_graph_is_refused_clearly() -> None:
    model = FanOut().double()
    x = torch.randn(4, 6, dtype=torch.float64, requires_grad=True)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
    with pytest.raises(RuntimeError, match="create_graph=True"):
        torch.autograd.grad(pipe(x).sum(), x, create_graph=True)
    # torch.autograd.functional's jvp and hvp ask for it without the caller's writing it: named.
    for ask in (lambda: torch.autograd.functional.jvp(pipe, x, torch.ones_like(x)),
                lambda: torch.autograd.functional.hvp(lambda v: pipe(v).sum(), x, torch.ones_like(x))):  # fmt: skip
        with pytest.raises(RuntimeError, match="create_graph=True.*which torch.autograd.functional's jvp, hvp"):
            ask()


def test_batched_gradients_are_refused_clearly_and_the_next_call_is_exact() -> None:
    """Before, jacobian(vectorize=True) and is_grads_batched failed inside the pipeline on vmap's
    own "Batching rule not implemented for aten::detach"."""
    model, reference = twin(FanOut())
    x = torch.randn(4, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
    with pytest.raises(RuntimeError, match=r"(?s)cannot take batched gradients.*How to fix"):
        torch.autograd.functional.jacobian(pipe, x, vectorize=True)
    with pytest.raises(RuntimeError, match=r"(?s)cannot take batched gradients.*How to fix"):
        torch.autograd.grad(pipe(x), list(pipe.parameters()), torch.randn(3, 4, 6, dtype=torch.float64), is_grads_batched=True)
    with pytest.raises(RuntimeError, match=r"(?s)ran already.*jacobian and hessian, and torch.autograd.gradcheck, run one backward per output element"):
        torch.autograd.functional.jacobian(pipe, x)
    assert all(p.grad is None for p in pipe.parameters())
    pipe(x).pow(2).sum().backward()
    reference(x).pow(2).sum().backward()
    assert_grads_equal(pipe, reference)


@pytest.mark.parametrize("mode", MODES)
def test_two_forwards_then_one_backward_and_accumulation(mode: str) -> None:
    model, reference = twin(FanOut())
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(6, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 4, chunks=3, checkpoint=mode)
    (pipe(x).sum() + pipe(y).pow(2).sum()).backward()
    (reference(x).sum() + reference(y).pow(2).sum()).backward()
    pipe(y).sum().backward()
    reference(y).sum().backward()
    assert_grads_equal(pipe, reference)


@pytest.mark.parametrize("stages", [1, 2])
def test_anomaly_mode_reaches_the_stages(stages: int) -> None:
    class Sqrt(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.b(torch.sqrt(self.a(x) - 100))

    x = torch.randn(4, 4)
    pipe = compile_pipeline(Sqrt(), x, ["cpu"] * stages, chunks=2, checkpoint="never")
    with torch.autograd.set_detect_anomaly(True):
        with pytest.raises(Exception, match="nan|NaN"):
            pipe(x).sum().backward()


Changed = tuple[nn.Module, nn.Module, nn.Module, tuple[torch.Tensor, ...]]


def _cast() -> Changed:
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.BatchNorm1d(6), nn.Linear(6, 3))
    reference = copy.deepcopy(model).double()
    pipe = compile_pipeline(model, torch.randn(8, 6), ["cpu", "cpu"], chunks=2)
    model.double()
    return pipe, model, reference, (torch.randn(8, 6, dtype=torch.float64),)


def _assigned() -> Changed:
    model, reference = twin(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)))
    pipe = compile_pipeline(model, torch.randn(8, 4, dtype=torch.float64), ["cpu", "cpu"], chunks=2)
    model[2].weight = nn.Parameter(torch.randn(4, 4, dtype=torch.float64))
    reference[2].weight = nn.Parameter(model[2].weight.detach().clone())
    return pipe, model, reference, (torch.randn(8, 4, dtype=torch.float64),)


def _kept_whole() -> Changed:
    model, reference = twin(WithPositions())
    example = (torch.randn(8, 3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64))
    pipe = compile_pipeline(model, example, ["cpu", "cpu"], chunks=3)
    return pipe, model, reference, (torch.randn(3, 3, 4, dtype=torch.float64), torch.randn(3, 4, dtype=torch.float64))


def _along_dim_1() -> Changed:
    model, reference = twin(SeqFirst())
    pipe = compile_pipeline(model, torch.randn(5, 8, 4, dtype=torch.float64), ["cpu", "cpu"], chunks=2, chunk_spec={"x": 1})
    return pipe, model, reference, (torch.randn(5, 6, 4, dtype=torch.float64),)


class _CountedTwice(nn.Module):
    """A block kept whole counts in its child's buffer; the child, called again, counts again."""

    def __init__(self) -> None:
        super().__init__()
        self.block, self.mid = CountingBlock(4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block.cnt(torch.tanh(self.mid(self.block(x))))


def _counted_twice() -> Changed:
    model, reference = twin(_CountedTwice().double())
    pipe = compile_pipeline(model, torch.randn(8, 4, dtype=torch.float64), ["cpu", "cpu"], chunks=2, leaf_modules=["block"])
    return pipe, model, reference, (torch.randn(8, 4, dtype=torch.float64),)


# A pipeline on a model changed after compiling, the plain model changed alike, and a call's
# arguments: the model's own dtype cast, a parameter assigned, an input the example kept whole
# at a batch size equal to its length, outputs with the batch along dim 1; and a buffer that a
# module kept whole writes and the graph writes again (each micro-batch counts twice, in turn).
CHANGED: dict[str, Callable[[], Changed]] = {
    "cast": _cast, "assigned": _assigned, "kept whole": _kept_whole, "batch along dim 1": _along_dim_1, "counted twice": _counted_twice,
}


@pytest.mark.parametrize("case", list(CHANGED))
@pytest.mark.parametrize("mode", ["eval", "no_grad", "autocast", "after an error"])
def test_what_changed_after_compiling_in_every_mode(case: str, mode: str) -> None:
    pipe, model, reference, args = CHANGED[case]()
    if mode == "eval":
        pipe.eval()
        reference.eval()
    if mode == "after an error":
        bad = (torch.randn(4, *args[0].shape[1:-1], 7, dtype=torch.float64), *args[1:])  # wrong feature size
        with pytest.raises(Exception):
            pipe(*bad)
    if mode == "no_grad":
        with torch.no_grad():
            out = pipe(*args)
        assert not out.requires_grad
        assert all(p.grad is None for p in model.parameters())
        torch.testing.assert_close(out, _in_turn(reference, args, case), rtol=0, atol=1e-12)
        return
    if mode == "autocast":
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out, expected = pipe(*args), _in_turn(reference, args, case)
        assert out.dtype == expected.dtype
        torch.testing.assert_close(out, expected, rtol=2e-2, atol=2e-2)
        out.float().pow(2).sum().backward()
        expected.float().pow(2).sum().backward()
        for (name, p), q in zip(pipe.named_parameters(), reference.parameters()):
            assert p.grad is not None and q.grad is not None, name
            assert (p.grad - q.grad).norm() <= 5e-2 * q.grad.norm() + 1e-6, name
        return
    out, expected = pipe(*args), _in_turn(reference, args, case)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.pow(2).sum().backward()
    expected.pow(2).sum().backward()
    assert_grads_equal(pipe, reference, tol=1e-12)


def _in_turn(reference: nn.Module, args: tuple[torch.Tensor, ...], case: str) -> torch.Tensor:
    """The plain model on the whole batch; on the micro-batches in turn where BatchNorm in
    training mode, or a counter forward keeps, makes them differ."""
    if (case == "cast" and reference.training) or case == "counted twice":
        return torch.cat([reference(piece) for piece in args[0].tensor_split(2)])
    return reference(*args)


class UpcastsUnderAutocast(nn.Module):
    """Asks torch whether autocast is on, and computes the middle in float32 then (a model
    upcasting its attention, say)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if torch.is_autocast_enabled("cpu"):
            h = h.float() * 2
        return self.b(h)


def _by_halves(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The plain model on the pipeline's two micro-batches in turn: in float32, a matrix product
    of 4 rows may round otherwise than one of 8 (as the CPU's kernels block them)."""
    return torch.cat([model(half) for half in x.tensor_split(2)])


@pytest.mark.parametrize("compiled_under", [False, True], ids=["compiled-outside", "compiled-under-autocast"])
def test_a_forward_that_asks_about_autocast_is_refused_under_another_autocast(compiled_under: bool) -> None:
    """Before, the graph held the answer traced, and a call under the other autocast ran it: 0.49
    off the plain model without a word."""
    model = UpcastsUnderAutocast()
    x = torch.randn(8, 6)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=compiled_under):
        pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
        torch.testing.assert_close(pipe(x), _by_halves(model, x), rtol=0, atol=0)  # as compiled: the same answer
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not compiled_under):
        with pytest.raises(RuntimeError, match=rf"torch.is_autocast_enabled\('cpu'\): {compiled_under} when traced, {not compiled_under} now.*\n.*How to fix: compile"):
            pipe(x)
    kept = compile_pipeline(nn.Sequential(nn.Identity(), model), x, ["cpu"] * 2, chunks=2, leaf_modules=[UpcastsUnderAutocast])
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not compiled_under):
        torch.testing.assert_close(kept(x), _by_halves(model, x), rtol=0, atol=0)  # kept whole: asks as it runs


class AsksThroughItsOwnName(UpcastsUnderAutocast):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if autocast_on(device_type="cpu"):  # imported under a name of its own: `from torch import ...`
            h = h.float() * 2
        return self.b(h)


def test_an_autocast_question_asked_through_a_name_imported_from_torch_is_watched_too() -> None:
    """Before, only `torch.is_autocast_enabled` was watched: asked through its own name, the
    answer traced ran under another autocast without a word."""
    model = AsksThroughItsOwnName()
    x = torch.randn(8, 6)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
    assert globals()["autocast_on"] is torch.is_autocast_enabled, "the name is put back"
    with torch.autocast("cpu", dtype=torch.bfloat16):
        with pytest.raises(RuntimeError, match=r"torch.is_autocast_enabled\(device_type='cpu'\): False when traced, True now"):
            pipe(x)
    torch.testing.assert_close(pipe(x), _by_halves(model, x), rtol=0, atol=0)


@contextlib.contextmanager
def _setting(get: Callable[[], Any], set_: Callable[[Any], Any], value: Any) -> Iterator[None]:
    before = get()
    set_(value)
    try:
        yield
    finally:
        set_(before)


_STATE: dict[str, tuple[Callable[[], bool], Callable[[], Any]]] = {  # a question of torch's state; how to change its answer
    "default dtype": (lambda: torch.get_default_dtype() == torch.float32, lambda: _setting(torch.get_default_dtype, torch.set_default_dtype, torch.float64)),
    "deterministic": (lambda: torch.are_deterministic_algorithms_enabled(), lambda: _setting(torch.are_deterministic_algorithms_enabled, torch.use_deterministic_algorithms, True)),
    "inference mode": (lambda: torch.is_inference_mode_enabled(), torch.inference_mode),
    "threads": (lambda: torch.get_num_threads() > 1, lambda: _setting(torch.get_num_threads, torch.set_num_threads, 1 if torch.get_num_threads() > 1 else 2)),
}  # fmt: skip


class _AsksTorch(nn.Module):
    def __init__(self, asks: Callable[[], bool]) -> None:
        super().__init__()
        self.a, self.b, self.asks = nn.Linear(6, 6), nn.Linear(6, 6), asks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if self.asks():
            h = h * 2
        return self.b(torch.tanh(h))


@pytest.mark.parametrize("state", list(_STATE))
def test_a_forward_that_asks_torch_of_its_state_is_refused_where_the_answer_changed(state: str) -> None:
    """Before, the pipeline ran the answer traced after the state changed (0.3 off in the output,
    4.9 in a gradient, without a word): torch.get_default_dtype(), deterministic algorithms,
    inference mode, the number of threads."""
    asks, changed = _STATE[state]
    model, reference = twin(_AsksTorch(asks))
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
    with changed():
        with pytest.raises(RuntimeError, match=r"(?s)asks torch about its state, and the answers differ from when it was traced: torch\.\w+\(\): .* when traced, .* now.*How to fix: compile the model under the state it runs under"):
            pipe(x)
    assert_call_and_grads_equal(pipe, reference, x)  # the state back: the pipeline runs again


class _CallsDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.dropout(self.lin(x), 0.5, self.training)


def test_monte_carlo_dropout_compiled_then_turned_off_is_refused_not_run_with_dropout_on() -> None:
    """Compiled in eval with the modules that call F.dropout set to train: both traces kept them
    in training, so the graphs came out alike and the eval call after model.eval() drew masks
    (1.02 off the plain model). A module added after compiling decides nothing."""
    model, reference = twin(nn.Sequential(_CallsDropout(), nn.Tanh(), _CallsDropout(), nn.Linear(6, 3)))
    for m in (model, reference):
        m.eval(), m[0].train(), m[2].train()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
    with torch.no_grad():
        assert not torch.equal(pipe(x), pipe(x)), "Monte Carlo dropout, as compiled"
    model.eval()
    with pytest.raises(RuntimeError, match=r"no graph was traced with its modules in the modes they are in: 0 in eval mode, 2 in eval mode now, where the eval graph has them in the other"):
        pipe(x)
    model[0].train(), model[2].train()
    model[3].add_module("criterion", nn.CrossEntropyLoss())  # in eval mode: no trace read its flag
    with torch.no_grad():
        assert pipe(x).shape == (8, 3)


class _ScoresInFloat32(nn.Module):
    """Attention scores computed with autocast turned off, as many attention codes do."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.autocast("cpu", enabled=False):
            scores = h.float() @ h.float().transpose(1, 2)
        return self.b(scores.softmax(-1) @ h)


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
def test_an_autocast_block_in_forward_goes_to_torch_export_which_keeps_it() -> None:
    """Before, torch.fx traced through the block and kept its operations, not its autocast: under
    the caller's bfloat16 autocast the pipeline ran the scores in bfloat16 (0.0039 off)."""
    model = _ScoresInFloat32()
    x = torch.randn(4, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
        assert "its forward enters torch.autocast for a part" in pipe.plan.notes[0]
        torch.testing.assert_close(pipe(x), torch.cat([model(half) for half in x.chunk(2)]), rtol=0, atol=0)


def test_a_fused_transformer_layer_compiles_under_autocast() -> None:
    """Before, counting its FLOPs at compile broke its fused path under autocast: 'expected m1
    and m2 to have the same dtype'."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
    model = nn.Sequential(nn.Linear(8, 8), layer, nn.Linear(8, 8)).eval()
    x = torch.randn(4, 5, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
        torch.testing.assert_close(pipe(x), torch.cat([model(half) for half in x.chunk(2)]), rtol=0, atol=0)


class _Encoder(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(6, 16), nn.Linear(16, 3)
        self.enc = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True), 2)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.out(self.enc(self.inp(x), src_key_padding_mask=mask))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_an_encoder_given_a_padding_mask_compiles_under_autocast() -> None:
    """Before, compiling ran the encoder under no_grad, where torch takes its inference fast path,
    which fails under autocast ('expected scalar type Float but found BFloat16'); the plain model
    runs there with grad on, and so does the pipeline."""
    torch.manual_seed(0)
    model = _Encoder().eval()
    x, mask = torch.randn(8, 5, 6), torch.zeros(8, 5, dtype=torch.bool)
    mask[::2, 3:] = True
    with torch.autocast("cpu", dtype=torch.bfloat16):
        pipe = compile_pipeline(model, (x, mask), ["cpu"] * 2, chunks=2)
        out = pipe(x, mask)
        expected = torch.cat([model(a, b) for a, b in zip(x.chunk(2), mask.chunk(2))])
    assert out.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.float().sum().backward()
    assert all(p.grad is not None for p in model.parameters())


class _ReadsNoFlag(nn.Module):
    """Its forward reads no `training` flag: the dropout and the norm are called whole."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.drop, self.norm, self.b = nn.Linear(6, 6), nn.Dropout(0.5), nn.BatchNorm1d(6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.norm(self.drop(torch.tanh(self.a(x)))))


def _traces(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """The mode of each trace compiling makes."""
    import fxpipe.compiler.frontend as frontend

    made: list[bool] = []
    real = frontend.trace

    def counted(model: nn.Module, *args: object, **kwargs: object) -> object:
        made.append(vars(model)["training"])  # not read through the module: a read the trace would note
        return real(model, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(frontend, "trace", counted)
    return made


@pytest.mark.parametrize("compiled_in", ["train", "eval"])
def test_a_forward_that_reads_no_flag_is_traced_once_for_both_modes(monkeypatch: pytest.MonkeyPatch, compiled_in: str) -> None:
    traces = _traces(monkeypatch)
    model, reference = twin(_ReadsNoFlag())
    model.train(compiled_in == "train"), reference.train(compiled_in == "train")
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
    assert traces == [True] and pipe.program(True) is pipe.program(False)
    pipe.eval(), reference.eval()
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)
    pipe.train(), reference.train()
    out = pipe(x)  # each micro-batch draws its own mask and normalises by its own statistics
    assert out.shape == (8, 6) and not torch.allclose(out, reference.eval()(x))


@pytest.mark.parametrize("compiled_in", ["train", "eval"])
def test_a_train_override_gets_an_eval_trace_of_its_own(monkeypatch: pytest.MonkeyPatch, compiled_in: str) -> None:
    """An override of train() may set more than the flags (here a norm kept frozen): eval mode
    is traced apart, and each mode runs the plain model's forward."""
    traces = _traces(monkeypatch)
    model, reference = twin(_KeepsItsNormFrozen())
    model.train(compiled_in == "train"), reference.train(compiled_in == "train")
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
    assert sorted(traces) == [False, True]
    for training in (False, True, False):
        pipe.train(training), reference.train(training)
        assert_call_and_grads_equal(pipe, reference, x)


class _Penalised(nn.Module):
    """Differentiates its output by its input in forward (a PINN residual, a gradient penalty)."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            z = h if h.requires_grad else h.detach().requires_grad_()
            u = self.net(z)
            (du,) = torch.autograd.grad(u.sum(), z, create_graph=True)
        return du + u


@pytest.mark.parametrize("checkpoint", ["always", "except_last"])
def test_a_module_kept_whole_differentiating_its_input_runs_under_autocast_checkpointed(checkpoint: str) -> None:
    """Before, a checkpointed forward read its input through an alias made without gradients,
    which autograd.grad could not differentiate ('appears to not have been used in the graph')."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), _Penalised(), nn.Linear(6, 6))
    reference = copy.deepcopy(model)
    x = torch.randn(8, 6)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, checkpoint=checkpoint, leaf_modules=[_Penalised], split_points=["2"])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out, expected = pipe(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.float().pow(2).sum().backward()
    expected.float().pow(2).sum().backward()
    for got, want in zip(pipe.parameters(), reference.parameters()):
        torch.testing.assert_close(got.grad, want.grad, rtol=2e-2, atol=2e-2)
