"""`pipe.train_steps`: a loop of steps, each `train_step` then the optimizer's step, against the plain loop."""
from __future__ import annotations

import collections
import copy
import gc
import itertools
import warnings
from typing import Any, Callable, Iterator, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from helpers import FanOut, TiedEnds, example_module, twin
from fxpipe import compile_pipeline

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zb-h1")
Optimizer = Callable[[Any], torch.optim.Optimizer]
OPTIMIZERS: dict[str, Optimizer] = {
    "sgd-momentum": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9),
    "adam": lambda params: torch.optim.Adam(params, lr=0.01),
}


def _batches(n: int, width: int = 6, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(8, width, dtype=torch.float64, generator=g), torch.randn(8, width, dtype=torch.float64, generator=g)) for _ in range(n)]


def _pipe(model: nn.Module, x: Any, schedule: str, stages: int = 4, **kwargs: Any) -> Any:
    if schedule == "interleaved-1f1b":
        return compile_pipeline(model, x, ["cpu"] * (stages // 2), schedule=schedule, stages_per_device=2, chunks=4, **kwargs)
    return compile_pipeline(model, x, ["cpu"] * stages, schedule=schedule, chunks=4, **kwargs)


def _plain_loop(
    model: nn.Module, batches: list[Any], loss_fn: Any, optimizer: torch.optim.Optimizer,
    after_backward: Optional[Callable[[], Any]] = None, after_step: Optional[Callable[[], Any]] = None,
) -> list[float]:
    losses = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if after_backward is not None:
            after_backward()
        optimizer.step()
        if after_step is not None:
            after_step()
        losses.append(float(loss.detach()))
    return losses


def _assert_parameters_equal(got: nn.Module, expected: nn.Module, tol: float = 1e-10) -> None:
    for (name, p), q in zip(got.named_parameters(), expected.parameters()):
        torch.testing.assert_close(p, q, rtol=0, atol=tol, msg=name)


@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("model_kind", [FanOut, TiedEnds])
def test_train_steps_equal_the_plain_loop(model_kind: type[nn.Module], schedule: str, optimizer: str) -> None:
    """Skips to several later stages (FanOut), a weight tied across stages (TiedEnds)."""
    model, reference = twin(model_kind())
    batches = _batches(5)
    pipe = _pipe(model, batches[0][0], schedule)
    opt, ref_opt = OPTIMIZERS[optimizer](pipe.parameters()), OPTIMIZERS[optimizer](reference.parameters())
    losses = [float(loss) for loss in pipe.train_steps(batches, loss_fn=F.mse_loss, optimizer=opt)]
    expected = _plain_loop(reference, batches, F.mse_loss, ref_opt)
    assert losses == pytest.approx(expected, rel=0, abs=1e-10) and len(losses) == 5
    _assert_parameters_equal(model, reference)


def test_a_model_that_draws_trains_as_train_step_then_step_does() -> None:
    """Dropout: each micro-batch draws its own masks, so the reference is the pipeline's own
    loop, train_step then step, from the same seed: bit for bit."""
    gpt = example_module("gpt")
    model = gpt.make_model(n_layer=2, n_embd=16, dropout=0.2).double()
    other = copy.deepcopy(model)
    batches = [gpt.make_batch(4, seed=k) for k in range(5)]
    pipe, by_hand = (compile_pipeline(m, batches[0][0], ["cpu"] * 2, chunks=2) for m in (model, other))
    opt, hand_opt = torch.optim.AdamW(pipe.parameters(), lr=1e-3), torch.optim.AdamW(by_hand.parameters(), lr=1e-3)
    torch.manual_seed(3)
    losses = list(pipe.train_steps(batches, loss_fn=gpt.loss_fn, optimizer=opt))
    torch.manual_seed(3)
    expected = []
    for x, y in batches:
        hand_opt.zero_grad()
        expected.append(by_hand.train_step(x, target=y, loss_fn=gpt.loss_fn))
        hand_opt.step()
    assert torch.equal(torch.stack(losses), torch.stack(expected))
    _assert_parameters_equal(model, other, tol=0)


def test_the_hooks_clip_and_schedule_as_in_the_plain_loop() -> None:
    model, reference = twin(FanOut())
    batches = _batches(5)
    pipe = _pipe(model, batches[0][0], "1f1b")
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.5), torch.optim.SGD(reference.parameters(), lr=0.5)
    sched, ref_sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5), torch.optim.lr_scheduler.StepLR(ref_opt, 2, 0.5)
    norms: list[float] = []
    losses = list(pipe.train_steps(
        batches, loss_fn=F.mse_loss, optimizer=opt, after_backward=lambda: norms.append(float(pipe.clip_grad_norm_(0.05))),
        after_step=sched.step,
    ))  # fmt: skip
    expected_norms: list[float] = []
    expected = _plain_loop(
        reference, batches, F.mse_loss, ref_opt, after_step=ref_sched.step,
        after_backward=lambda: expected_norms.append(float(nn.utils.clip_grad_norm_(reference.parameters(), 0.05))),
    )  # fmt: skip
    assert [float(loss) for loss in losses] == pytest.approx(expected, rel=0, abs=1e-10)
    assert norms == pytest.approx(expected_norms, rel=1e-10) and max(norms) > 0.05  # it clipped
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == 0.125
    _assert_parameters_equal(model, reference)


class _TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)) * scale)))


@pytest.mark.parametrize("given", ["tuple", "dict", "mapping"])
def test_inputs_given_as_a_tuple_or_a_dict(given: str) -> None:
    """A mapping of another type than dict (Hugging Face's BatchEncoding is a UserDict) holds
    keyword inputs too: before, it was passed as one positional input."""
    model, reference = twin(_TwoInputs())
    batches = _batches(3)
    scales = [torch.rand(8, 1, dtype=torch.float64) for _ in batches]
    kinds: dict[str, Callable[[torch.Tensor, torch.Tensor], Any]] = {
        "tuple": lambda x, s: (x, s), "dict": lambda x, s: dict(x=x, scale=s), "mapping": lambda x, s: collections.UserDict(x=x, scale=s),
    }
    inputs = [kinds[given](x, s) for (x, _), s in zip(batches, scales)]
    pipe = compile_pipeline(model, (batches[0][0], scales[0]), ["cpu"] * 2, chunks=2)
    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1), torch.optim.SGD(reference.parameters(), lr=0.1)
    losses = list(pipe.train_steps(zip(inputs, (y for _, y in batches)), loss_fn=F.mse_loss, optimizer=opt))
    for (x, y), s, loss in zip(batches, scales, losses):
        ref_opt.zero_grad()
        expected = F.mse_loss(reference(x, s), y)
        expected.backward()
        ref_opt.step()
        torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-10)
    _assert_parameters_equal(model, reference)


@pytest.mark.parametrize("schedule", [*SCHEDULES, "2bw"])
@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_loop_iterated_without_gradients_is_refused_before_it_reads_a_batch(schedule: str, mode: str) -> None:
    """A loop runs its batches as the caller iterates it, in the grad mode of that moment. Before,
    a synchronous loop there gave each batch's loss and stepped the optimizer on no gradient
    (nothing trained, where the plain loop's backward raises); 2bw's, begun with gradients,
    failed with a KeyError inside a stage."""
    model, reference = twin(FanOut())
    batches = _batches(3)
    pipe = _pipe(model, batches[0][0], schedule) if schedule != "2bw" else compile_pipeline(model, batches[0][0], ["cpu"] * 2, schedule="2bw", chunks=4)
    source = iter(batches)
    steps = pipe.train_steps(source, loss_fn=F.mse_loss, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1))
    where = "no_grad" if mode == "no_grad" else "inference_mode"
    with torch.no_grad() if mode == "no_grad" else torch.inference_mode():
        with pytest.raises(RuntimeError, match=rf"batch 0 was asked for under torch.{where}\(\).*\n.*How to fix: iterate the loop with gradients on"):
            next(steps)
    assert next(source) is batches[0], "the refused loop read a batch"
    _assert_parameters_equal(model, reference, tol=0)
    losses = list(pipe.train_steps(batches[1:], loss_fn=F.mse_loss, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1)))
    assert len(losses) == 2  # the next loop runs


def test_the_loop_reads_batches_as_it_goes_and_ends_with_them() -> None:
    model, _ = twin(FanOut())
    batches = _batches(4)
    pipe = _pipe(model, batches[0][0], "1f1b")
    read: list[int] = []

    def source() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for k, batch in enumerate(batches):
            read.append(k)
            yield batch

    steps = pipe.train_steps(source(), loss_fn=F.mse_loss, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1))
    assert read == []  # nothing runs before the first loss is asked for
    next(steps)
    assert read == [0]
    assert len(list(steps)) == 3 and read == [0, 1, 2, 3]
    assert list(pipe.train_steps([], loss_fn=F.mse_loss, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1))) == []


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_a_loop_dropped_before_its_first_loss_warns_that_it_trained_nothing(schedule: str) -> None:
    """A loop is lazy, as a generator is: one made and dropped (the losses never asked for) trained
    nothing, which is said where it was made; one iterated, or closed on purpose, is not warned of."""
    model, _ = twin(FanOut())
    batches = _batches(2)
    pipe = compile_pipeline(model, batches[0][0], ["cpu"] * 2, schedule=schedule, chunks=4)
    before = copy.deepcopy(model.state_dict())
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    with pytest.warns(RuntimeWarning, match=r"train_steps\(\.\.\.\) made at .*test_train_steps.py:\d+ was never iterated, so it trained nothing.*\nHow to fix: iterate it"):
        pipe.train_steps(batches, loss_fn=F.mse_loss, optimizer=optimizer)
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        loop = pipe.train_steps(batches, loss_fn=F.mse_loss, optimizer=optimizer)
        loop.close()
        del loop
        collections.deque(pipe.train_steps(batches, loss_fn=F.mse_loss, optimizer=optimizer), maxlen=0)
        gc.collect()


@pytest.mark.parametrize("where", ["batches", "stage"])
def test_a_failure_names_its_batch_and_leaves_the_last_update(where: str) -> None:
    """The batches raise before batch 3, or a stage raises on it: the parameters are those after
    batch 2's update, and the error says so."""
    model, reference = twin(FanOut())
    batches = _batches(5)
    pipe = _pipe(model, batches[0][0], "1f1b")

    def source() -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        yield from batches[:3]
        if where == "batches":
            raise OSError("the file went away")
        yield torch.randn(8, 5, dtype=torch.float64), batches[3][1]  # a width the first stage refuses

    opt, ref_opt = torch.optim.SGD(pipe.parameters(), lr=0.1, momentum=0.9), torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    losses = []
    with pytest.raises(Exception) as raised:
        for loss in pipe.train_steps(source(), loss_fn=F.mse_loss, optimizer=opt):
            losses.append(loss)
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert len(losses) == 3 and "batch 2's update" in notes, notes
    assert ("the batches raised before batch 3" if where == "batches" else "batch 3 failed before its update") in notes
    _plain_loop(reference, batches[:3], F.mse_loss, ref_opt)
    _assert_parameters_equal(model, reference)
    assert all(p.grad is None or not p.grad.any() for p in pipe.parameters()) if where == "stage" else True
    # and the loop starts again where it stopped, exact
    list(pipe.train_steps(batches[3:], loss_fn=F.mse_loss, optimizer=opt))
    _plain_loop(reference, batches[3:], F.mse_loss, ref_opt)
    _assert_parameters_equal(model, reference)


def test_bad_arguments_are_refused_together_before_anything_runs() -> None:
    model, _ = twin(FanOut())
    batches = _batches(2)
    pipe = _pipe(model, batches[0][0], "gpipe")
    with pytest.raises(TypeError) as raised:
        pipe.train_steps(42, loss_fn=F.mse_loss, optimizer="sgd", reduction="max", after_step=1)  # type: ignore[arg-type]
    text = str(raised.value)
    assert all(word in text for word in ("batches must be", "optimizer must be", "reduction must be", "after_step must be")), text
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    with pytest.raises(TypeError, match=r"batch 1 is a tuple of 3"):
        list(pipe.train_steps([batches[0], (*batches[1], None)], loss_fn=F.mse_loss, optimizer=opt))


def test_parameters_between_losses_are_a_whole_version() -> None:
    """A state_dict taken between two losses is the plain loop's after as many batches."""
    model, reference = twin(TiedEnds())
    batches = _batches(4)
    pipe = _pipe(model, batches[0][0], "zb-h1", stages=2)
    opt, ref_opt = torch.optim.Adam(pipe.parameters(), lr=0.01), torch.optim.Adam(reference.parameters(), lr=0.01)
    for k, _ in zip(itertools.count(), pipe.train_steps(batches, loss_fn=F.mse_loss, optimizer=opt)):
        _plain_loop(reference, batches[k : k + 1], F.mse_loss, ref_opt)
        state = pipe.state_dict()
        for name, value in reference.state_dict().items():
            torch.testing.assert_close(state[name], value, rtol=0, atol=1e-10, msg=name)


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_an_optimizer_that_needs_a_closure_is_refused_with_the_loop_that_trains_it(schedule: str) -> None:
    """Before, LBFGS failed in torch's step with a bare TypeError (under 2bw after two batches had
    run, with a note that the parameters held an update in part). The loop the refusal writes
    out trains as the plain one."""
    model, reference = twin(FanOut())
    batches = _batches(3)
    pipe = _pipe(model, batches[0][0], schedule, stages=2)
    lbfgs = torch.optim.LBFGS(pipe.parameters(), lr=0.5, max_iter=3)
    with pytest.raises(TypeError, match=r"(?s)LBFGS.step needs a closure.*optimizer.step\(lambda: \(optimizer.zero_grad\(\), pipe.train_step"):
        pipe.train_steps(batches, loss_fn=F.mse_loss, optimizer=lbfgs)
    assert all(p.grad is None for p in pipe.parameters())
    plain = torch.optim.LBFGS(reference.parameters(), lr=0.5, max_iter=3)
    for x, y in batches:
        lbfgs.step(lambda: (lbfgs.zero_grad(), pipe.train_step(x, target=y, loss_fn=F.mse_loss))[1])
        plain.step(lambda: (plain.zero_grad(), F.mse_loss(reference(x), y).backward(), F.mse_loss(reference(x), y))[2])
    _assert_parameters_equal(model, reference)


class _OwnLoss(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 4)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.b(torch.tanh(self.a(x))), labels)


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_a_model_that_returns_its_own_loss_trains_without_a_loss_fn(schedule: str) -> None:
    """Before, loss_fn was a required keyword of train_steps (not of train_step)."""
    model, plain = twin(_OwnLoss())
    g = torch.Generator().manual_seed(0)
    batches = [((torch.randn(8, 6, generator=g, dtype=torch.float64), torch.randn(8, 4, generator=g, dtype=torch.float64)), None) for _ in range(3)]
    pipe = compile_pipeline(model, batches[0][0], ["cpu", "cpu"], chunks=2, schedule=schedule)
    losses = [float(loss) for loss in pipe.train_steps(batches, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.0))]
    assert losses == pytest.approx([float(plain(*inputs)) for inputs, _ in batches], rel=0, abs=1e-12)
    pipe.close()


class _Counted(nn.Module):
    """A cross-entropy that counts its calls: state a loss object keeps."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, out: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return F.cross_entropy(out, target)


@pytest.mark.parametrize("schedule", ["1f1b", "2bw"])
def test_a_loss_fn_that_keeps_state_is_refused_in_a_loop_and_put_back(schedule: str) -> None:
    """Before, its counter moved chunks + 1 times a batch, where the plain loop moves it once."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    pipe = compile_pipeline(model, torch.randn(8, 8, dtype=torch.float64), ["cpu", "cpu"], chunks=4, schedule=schedule)
    optimizer = torch.optim.SGD(pipe.parameters(), lr=0.1)
    batches = [(torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))) for _ in range(3)]
    before = [p.detach().clone() for p in model.parameters()]
    counted = _Counted()
    with pytest.raises(ValueError, match=r"loss_fn changes its own state when called: calls \(0 -> \d+\)"):
        list(pipe.train_steps(batches, loss_fn=counted, optimizer=optimizer))
    assert counted.calls == 0
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    assert len(list(pipe.train_steps(batches, loss_fn=F.cross_entropy, optimizer=optimizer))) == 3  # and the loop runs again


def test_a_2bw_loop_on_a_pipeline_not_yet_checked_is_refused_before_it_starts() -> None:
    """Compiled on samples all alike (zeros), the check waits for a call of its own: before, a
    2bw loop never ran it, and a model centred over the batch trained on other numbers."""
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)).double()
    with pytest.warns(UserWarning, match="samples all hold the same values"):
        pipe = compile_pipeline(model, torch.zeros(8, 8, dtype=torch.float64), ["cpu", "cpu"], chunks=4, schedule="2bw")
    before = [p.detach().clone() for p in model.parameters()]
    batches = [(torch.randn(8, 8, dtype=torch.float64), torch.randint(0, 4, (8,))) for _ in range(2)]
    with pytest.raises(ValueError, match=r"(?s)has not checked yet.*How to fix: call it once on a batch of samples that differ"):
        list(pipe.train_steps(batches, loss_fn=F.cross_entropy, optimizer=torch.optim.SGD(pipe.parameters(), lr=0.1)))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
