"""Calls unlike the example (an argument left out or left None): stages compiled for them, a bounded number kept, each exact."""
from __future__ import annotations

import copy
import warnings
from typing import Any, Optional

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxpipe import Pipeline, compile_pipeline
from helpers import X, OwnLoss, assert_call_and_grads_equal, assert_grads_equal, twin


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if mask is not None:
            h = h * mask
        return self.b(h)


@pytest.mark.parametrize("how", ["pipe(x)", "train_step"])
def test_an_argument_left_none_where_the_example_gave_one_compiles_stages_for_that_call(how: str) -> None:
    """Before, it was refused ("leaves mask None where the example gave a value"), where the plain
    model takes both calls: now each kind of call runs stages traced for it, on the one model."""
    model, reference = twin(Gated())
    x, mask, y = X.double(), torch.rand(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, (x, mask), ["cpu", "cpu"], chunks=2)
    _each_equals_the_plain_model(pipe, reference, [(x, mask), (x,), (x, None), (x, mask)], how, y)
    assert len(pipe._variants) == 1, "one pipeline for the calls without a mask, made once"


def _each_equals_the_plain_model(pipe: Pipeline, reference: nn.Module, calls: list[tuple[Any, ...]], how: str, y: torch.Tensor) -> None:
    """Each call, `pipe(x)` (with autograd.grad) or a train_step, against the plain model's."""
    for args in calls:
        pipe.zero_grad()
        reference.zero_grad()
        if how == "pipe(x)":
            assert_call_and_grads_equal(pipe, reference, *args)
        else:
            loss = pipe.train_step(*args, target=y, loss_fn=nn.functional.mse_loss)
            expected = nn.functional.mse_loss(reference(*args), y)
            expected.backward()
            torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
            assert_grads_equal(pipe, reference)


class GatedByDict(Gated):
    """Takes its inputs in a dict, the mask maybe None."""

    def forward(self, batch: dict[str, Optional[torch.Tensor]]) -> torch.Tensor:  # type: ignore[override]
        assert batch["x"] is not None
        return super().forward(batch["x"], batch.get("mask"))


class DefaultUnlessGiven(Gated):
    """A learned default where the first of its extras is None."""

    def __init__(self) -> None:
        super().__init__()
        self.default = nn.Parameter(torch.randn(6))

    def forward(self, x: torch.Tensor, extras: list[Optional[torch.Tensor]]) -> torch.Tensor:  # type: ignore[override]
        h = torch.tanh(self.a(x))
        h = h + self.default if extras[0] is None else h * extras[0]
        return self.b(h)


@pytest.mark.parametrize("how", ["pipe(x)", "train_step"])
@pytest.mark.parametrize("held", ["dict", "list"])
def test_a_none_inside_a_container_where_the_example_gave_a_tensor_compiles_stages_for_that_call(held: str, how: str) -> None:
    """Before, only arguments left None at the top were another kind of call: a None in a list
    silently ran the example's branch (1.15 off), one in a dict failed in a stage."""
    x, mask, y = X.double(), torch.rand(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    model, reference = twin(GatedByDict() if held == "dict" else DefaultUnlessGiven())

    def args(m: Optional[torch.Tensor]) -> tuple[Any, ...]:
        return ({"x": x, "mask": m},) if held == "dict" else (x, [m])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the call without a mask may be captured by torch.export, and says so
        pipe = compile_pipeline(model, args(mask), ["cpu", "cpu"], chunks=2)
        for m in (mask, None, mask, None):
            pipe.zero_grad(set_to_none=True)
            reference.zero_grad(set_to_none=True)
            if how == "pipe(x)":
                out, expected = pipe(*args(m)), reference(*args(m))
                torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
                out.square().sum().backward()
                expected.square().sum().backward()
            else:
                loss = pipe.train_step(*args(m), target=y, loss_fn=nn.functional.mse_loss)
                expected = nn.functional.mse_loss(reference(*args(m)), y)
                expected.backward()
                torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
            for (name, p), q in zip(model.named_parameters(), reference.parameters()):
                assert (p.grad is None) == (q.grad is None), name
                if q.grad is not None:
                    torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12, msg=name)
    assert len(pipe._variants) == 1, "one pipeline for the calls without a mask, made once"


def test_the_kinds_of_call_kept_are_bounded_and_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import fxpipe.calls

    monkeypatch.setattr(fxpipe.calls, "VARIANTS", 1)
    model = TwoOptional()
    mask, shift = torch.rand(4, 6), torch.rand(6)
    pipe = compile_pipeline(model, (X, mask, shift), ["cpu", "cpu"], chunks=2)
    torch.testing.assert_close(pipe(X, shift=shift), model(X, shift=shift), rtol=0, atol=1e-6)  # one kind kept
    with pytest.warns(UserWarning, match="more than 1 kinds of call"):
        torch.testing.assert_close(pipe(X, mask), model(X, mask), rtol=0, atol=1e-6)  # a second: the first let go
    torch.testing.assert_close(pipe(X, shift=shift), model(X, shift=shift), rtol=0, atol=1e-6)  # compiled again
    assert len(pipe._variants) == 1
    pipe.close()


class TwoOptional(Gated):
    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None, shift: Optional[torch.Tensor] = None) -> torch.Tensor:
        out = super().forward(x, mask)
        return out if shift is None else out + shift


class GatedAndScaled(Gated):
    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None, gain: float = 1.5) -> torch.Tensor:
        return super().forward(x, mask) * gain


@pytest.mark.parametrize("given", [False, True], ids=["left-out", "given-none"])
def test_an_argument_the_example_leaves_none_is_traced_as_none_by_torch_fx(given: bool) -> None:
    """Before, torch.fx traced it as an input, took the `if mask is not None:` branch, failed its
    check and left the model to torch.export, which then refused calls giving `gain`."""
    model = GatedAndScaled()
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2, example_kwargs={"mask": None} if given else None)
    assert "torch.fx" in pipe.plan.notes[0]
    torch.testing.assert_close(pipe(X, gain=2.0), model(X, gain=2.0), rtol=0, atol=1e-6)
    torch.testing.assert_close(pipe(X, None, 3.0), model(X, None, 3.0), rtol=0, atol=1e-6)
    mask = torch.rand(4, 6)
    torch.testing.assert_close(pipe(X, mask), model(X, mask), rtol=0, atol=1e-6)  # traced for this call


def test_an_argument_traced_as_none_is_exact_in_every_mode() -> None:
    model, reference = twin(GatedAndScaled())
    x, y = X.double(), torch.randn(4, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, checkpoint="always")
    loss = pipe.train_step(x, gain=2.0, target=y, loss_fn=nn.functional.mse_loss)
    expected = nn.functional.mse_loss(reference(x, gain=2.0), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)
    assert_call_and_grads_equal(pipe, reference, x, None, 3.0)
    with torch.no_grad():
        torch.testing.assert_close(pipe(x, gain=0.5), reference(x, gain=0.5), rtol=0, atol=1e-12)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.testing.assert_close(pipe(x, gain=2.0), reference(x, gain=2.0), rtol=0, atol=1e-12)
    pipe.eval()
    torch.testing.assert_close(pipe(x), reference.eval()(x), rtol=0, atol=1e-12)


class GatedByItsOwnBias(nn.Module):
    """An argument named like one of its parameters: torch.fx calls its input `bias_1`."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.bias = nn.Linear(6, 6), nn.Parameter(torch.zeros(6))

    def forward(self, x: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = self.a(x) + self.bias
        return h if bias is None else h + bias


def test_an_argument_named_like_a_parameter_given_where_the_example_left_it_none() -> None:
    model = GatedByItsOwnBias()
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    bias = torch.rand(6)
    torch.testing.assert_close(pipe(X, bias), model(X, bias), rtol=0, atol=1e-6)


class Moded(nn.Module):
    """A str argument torch.fx cannot branch on: it goes through torch.export."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mode: str, extra: Optional[torch.Tensor] = None) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        if mode == "double":
            h = h * 2
        if extra is not None:
            h = h * extra
        return self.b(h)


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
@pytest.mark.parametrize("how", ["pipe(x)", "train_step"])
def test_an_exported_pipeline_called_with_a_tensor_where_the_example_gave_none_compiles_stages_for_it(how: str) -> None:
    """Before, a positional None of the example and a tensor of the call flattened alike: the
    call ran the graph exported without the argument, 1.26 off with no error. A value where the
    example gave a tensor failed inside export's guards (AttributeError: no attribute 'size')."""
    model, reference = twin(Moded())
    x, extra, y = X.double(), torch.rand(4, 6, dtype=torch.float64), torch.randn(4, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, (x, "double", None), ["cpu", "cpu"], chunks=2)
    assert "torch.export" in pipe.plan.notes[0]
    _each_equals_the_plain_model(pipe, reference, [(x, "double", extra), (x, "double", None), (x, "double", 0.5), (x, "double", extra)], how, y)
    assert len(pipe._variants) == 2, "one pipeline for the calls with a tensor, one for those with a number"
    pipe.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x, "double", extra), reference(x, "double", extra), rtol=0, atol=1e-12)


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
def test_an_exported_pipeline_names_an_argument_the_forward_does_not_take() -> None:
    """Before, a misspelt keyword was refused as a call 'shaped' unlike the example, with two
    pytree structures and the advice to call it like the example."""
    model = Moded()
    pipe = compile_pipeline(model, (X, "double"), ["cpu", "cpu"], chunks=2)
    with pytest.raises(TypeError, match=r"takes the traced model's arguments \(x.*unexpected keyword argument 'extar'"):
        pipe(X, "double", extar=X)
    with pytest.raises(TypeError, match="missing a required argument: 'mode'"):
        pipe(X)
    assert not pipe._variants


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
def test_an_exported_pipeline_takes_arguments_by_keyword_or_by_position_as_one_call() -> None:
    """Before, `pipe(x=x)` on a pipeline compiled from `(x,)` was another kind of call: every
    stage compiled again (6 s on a small RoBERTa), and a 2bw loop of dict batches was refused."""
    model, reference = twin(Moded())
    x, extra = X.double(), torch.rand(4, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, (x, "double"), ["cpu", "cpu"], chunks=2, example_kwargs={"extra": extra})
    calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = [
        ((), {"x": x, "mode": "double", "extra": extra}), ((x, "double", extra), {}), ((x,), {"extra": extra, "mode": "double"}),
    ]
    for args, kwargs in calls:
        pipe.zero_grad()
        reference.zero_grad()
        assert_call_and_grads_equal(pipe, reference, *args, **kwargs)
    assert not pipe._variants, "one kind of call"
    losses = []
    for given in ("by keyword", "by position"):
        torch.manual_seed(0)
        looped = compile_pipeline(copy.deepcopy(reference), (x, "double"), ["cpu", "cpu"], chunks=2, example_kwargs={"extra": extra}, schedule="2bw")
        batches = [({"x": x + k, "mode": "double", "extra": extra} if given == "by keyword" else (x + k, "double", extra), x) for k in range(3)]
        losses.append([float(loss) for loss in looped.train_steps(batches, loss_fn=nn.functional.mse_loss, optimizer=torch.optim.SGD(looped.parameters(), lr=0.1))])
    assert losses[0] == losses[1] and len(losses[0]) == 3


class ConvStarArgs(nn.Module):
    """A conv net whose forward takes *args: torch.export captures it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding=1), nn.Conv2d(4, 2, 3, padding=1)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(args[0]))).mean((2, 3))


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
def test_an_exported_pipeline_keeps_image_sizes_and_compiles_stages_for_another() -> None:
    """Images vary in their batch dim alone: symbolic heights and widths cost torch.export
    minutes on a tiny Swin (437 s to compile, 61 s now, under one load). A call with another image size compiles
    stages for it, once."""
    model, reference = twin(ConvStarArgs())
    pipe = compile_pipeline(model, torch.randn(4, 3, 8, 8, dtype=torch.float64), ["cpu", "cpu"], chunks=2)
    for shape in [(6, 3, 8, 8), (4, 3, 12, 10), (2, 3, 12, 10)]:
        pipe.zero_grad()
        reference.zero_grad()
        assert_call_and_grads_equal(pipe, reference, torch.randn(*shape, dtype=torch.float64))
    assert len(pipe._variants) == 1, "one pipeline for the images of 12 x 10"
    pipe.eval(), reference.eval()
    with torch.no_grad():
        images = torch.randn(4, 3, 12, 10, dtype=torch.float64)
        torch.testing.assert_close(pipe(images), reference(images), rtol=0, atol=1e-12)


class WithTable(nn.Module):
    """`vec` holds one value per feature, never per sample; through torch.export where
    `exported` (a shape check torch.fx cannot trace)."""

    def __init__(self, exported: bool) -> None:
        super().__init__()
        self.exported = exported
        self.a, self.b = nn.Linear(12, 12), nn.Linear(12, 12)

    def forward(self, x: torch.Tensor, vec: torch.Tensor, extra: Optional[torch.Tensor] = None) -> torch.Tensor:
        if self.exported and x.shape[1] != 12:
            raise ValueError("12 features")
        h = torch.tanh(self.a(x)) + vec
        return self.b(h if extra is None else h + extra)


@pytest.mark.parametrize("how", ["pipe(x)", "train_step"])
@pytest.mark.parametrize("exported", [False, True])
def test_stages_for_another_kind_of_call_keep_whole_what_the_example_kept_whole(exported: bool, how: str) -> None:
    """Before, stages compiled from a first call of another kind whose batch size happened to be
    `vec`'s length split `vec` (the example, of 8 samples, kept it whole), and the call was
    refused as an OtherCall; a first call of 8 samples compiled them right."""
    model, reference = twin(WithTable(exported))
    g = torch.Generator().manual_seed(0)
    x, vec, extra = (torch.randn(*shape, dtype=torch.float64, generator=g) for shape in [(8, 12), (12,), (8, 12)])
    x12, e12, y = (torch.randn(12, 12, dtype=torch.float64, generator=g) for _ in range(3))
    pipe = compile_pipeline(model, (x, vec, extra), ["cpu", "cpu"], chunks=2)
    _each_equals_the_plain_model(pipe, reference, [(x12, vec), (x12, vec, e12), (x12, vec)], how, y)
    assert len(pipe._variants) == 1


class OneSample(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, extra: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.shape[1] != 6:  # torch.export
            raise ValueError("6 features")
        h = torch.tanh(self.a(x))
        return self.b(h if extra is None else h * extra)


def test_stages_for_another_kind_of_call_that_cannot_compile_from_it_say_why_and_which_call() -> None:
    """Before, the binding's own refusal came out (an internal OtherCall, telling to call as the
    example did, against the docs), the reason in a note."""
    pipe = compile_pipeline(OneSample(), torch.randn(8, 6), ["cpu", "cpu"], chunks=2)
    with pytest.raises(ValueError, match="does not run on the example.*size of tensor a") as raised:
        pipe(torch.randn(4, 6), extra=torch.randn(4, 5))  # the model's own failure, on this call
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "This call is of another kind than the example" in notes and "with that call as their example" in notes, notes
    assert "this call differs:)" not in notes and "extra" in notes, "the note says what differs"


class DeeperOneSample(OneSample):
    def __init__(self) -> None:
        super().__init__()
        self.c, self.d = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, extra: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.d(torch.tanh(self.c(torch.tanh(super().forward(x, extra)))))


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
@pytest.mark.parametrize("first", ["one sample", "four samples"])
@pytest.mark.parametrize("schedule", ["gpipe", "interleaved-1f1b"])
def test_a_first_call_of_one_sample_of_another_kind_runs_as_the_plain_model_whichever_call_comes_first(first: str, schedule: str) -> None:
    """torch.export makes a graph for one sample alone from a call of one sample. Before, such a
    call of another kind (a new image size) was refused, telling to give two samples or more, where
    a call of four first compiled stages that then ran it: one sample runs as one micro-batch, and
    the first call of more samples compiles stages that split them."""
    model, reference = twin(DeeperOneSample())
    per_device = 2 if schedule == "interleaved-1f1b" else 1
    pipe = compile_pipeline(model, torch.randn(8, 6, dtype=torch.float64), ["cpu", "cpu"], chunks=2, schedule=schedule, stages_per_device=per_device)
    g = torch.Generator().manual_seed(0)
    calls = [tuple(torch.randn(n, 6, dtype=torch.float64, generator=g) for _ in range(2)) for n in (1, 4, 1)]
    for x, extra in calls if first == "one sample" else calls[1:]:
        pipe.zero_grad()
        reference.zero_grad()
        assert_call_and_grads_equal(pipe, reference, x, extra)
    (variant,) = pipe._variants.values()
    assert variant._chunks == 2, "stages that split a call of four samples serve the calls of this kind"
    pipe.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(*calls[0]), reference(*calls[0]), rtol=0, atol=0)


def test_balance_as_node_counts_cuts_another_kind_of_call_as_balance_none_saying_so() -> None:
    """The counts are the example's graph's. Before, a call of another kind (a mask left out)
    failed: its graph has another node count, and no one list fits both."""
    model, reference = twin(Gated())
    x, mask = X.double(), torch.rand(4, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, (x, mask), ["cpu", "cpu"], chunks=2, balance=[2, 2])
    with pytest.warns(UserWarning, match=r"balance=\[2, 2\] counts the nodes of the example's graph.*cut as with balance=None.*split_points"):
        assert_call_and_grads_equal(pipe, reference, x)
    assert_call_and_grads_equal(pipe, reference, x, mask)


class MakesOnes(nn.Module):
    """Makes a tensor of the input's dtype in forward, in a call torch.fx cannot trace: torch.export
    captures it, holding the example's dtype."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x))) + torch.ones(x.shape[0], 1, dtype=x.dtype) / 3


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_an_exported_pipeline_cast_after_compiling_compiles_stages_for_calls_of_the_new_dtype(dtype: torch.dtype) -> None:
    """Before, the graph made its tensor in the example's float32: a bfloat16 call came back in
    float32 (2.6e-3 off), a float64 one 1e-8 off."""
    model, x = MakesOnes(), torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    reference = copy.deepcopy(model).to(dtype)
    with pytest.warns(UserWarning, match="used torch.export"):
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    pipe.to(dtype)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the new kind of call is captured by torch.export again, and says so
        out = pipe(x.to(dtype))
    pieces = [reference(piece) for piece in x.to(dtype).chunk(2)]
    assert out.dtype == dtype
    torch.testing.assert_close(out, torch.cat(pieces), rtol=0, atol=0)
    out.float().square().sum().backward()  # the new dtype's stages, recomputed ('except_last')
    torch.stack([piece.float().square().sum() for piece in pieces]).sum().backward()
    _assert_grads_exact(model, reference)
    model.zero_grad(set_to_none=True)
    reference.zero_grad(set_to_none=True)
    y = torch.randn(8, 8).to(dtype)
    loss = pipe.train_step(x.to(dtype), target=y, loss_fn=F.mse_loss)
    expected = torch.stack([F.mse_loss(reference(piece), target) for piece, target in zip(x.to(dtype).chunk(2), y.chunk(2))]).mean()
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=0)
    _assert_grads_exact(model, reference)


class _ReadsItsDtype(nn.Module):
    """Embeds a time step in the model's own dtype (`self.dtype`, as diffusers' and Hugging
    Face's models do), and clamps where it is float64, a branch torch.fx cannot trace."""

    def __init__(self, branches: bool) -> None:
        super().__init__()
        self.branches = branches
        self.embed, self.a, self.b = nn.Embedding(10, 8), nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, ids: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        dtype = next(self.parameters()).dtype
        h = torch.tanh(self.a(self.embed(ids))) + t[:, None].to(dtype) / 7
        if self.branches and h.dtype == torch.float64:
            h = h.clamp(-0.5, 0.5)
        return self.b(h)


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
@pytest.mark.parametrize("exported", [False, True], ids=["torch.fx", "torch.export"])
def test_a_model_that_reads_its_own_dtype_cast_after_compiling_is_refused_or_compiled_again(exported: bool) -> None:
    """Before, the graph kept the dtype the trace read: after pipe.double() the stages cast to
    float32 (outputs 1.5e-6 off, silently), and an exported graph kept its float32 branch (2.97
    off after pipe.half()). Token ids keep their dtype: the call's kind alone did not change."""
    model, ids, t = _ReadsItsDtype(exported), torch.randint(0, 10, (8,)), torch.arange(8)
    reference = copy.deepcopy(model).double()
    pipe = compile_pipeline(model, (ids, t), ["cpu", "cpu"], chunks=2)
    pipe.double()
    if not exported:
        with pytest.raises(RuntimeError, match=r"cast from torch.float32 to torch.float64 since compiling.*\n.*compile the model again"):
            pipe(ids, t)
        pipe = compile_pipeline(model, (ids, t), ["cpu", "cpu"], chunks=2)
    assert_call_and_grads_equal(pipe, reference, ids, t, tol=1e-12)


def _assert_grads_exact(model: nn.Module, reference: nn.Module) -> None:
    for (name, p), q in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)


def test_warnings_name_the_callers_line_however_deep_the_call_compiles() -> None:
    """Before, a warning of a kind of call compiled later (here: torch.export taking over again)
    named a line of fxpipe/compile.py, and train_step's about the model's own loss one of
    fxpipe's; each names the line of the call now, as compiling's own does."""
    model, x = MakesOnes(), torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    with pytest.warns(UserWarning, match="used torch.export") as compiled:
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    pipe.double()
    with pytest.warns(UserWarning, match="used torch.export") as called:
        pipe(x.double())
    own = compile_pipeline(_OwnMean(), (x, x), ["cpu", "cpu"], chunks=2)
    with pytest.warns(UserWarning, match="cannot check that it is one") as stepped:
        own.train_step(x, x)
    for record in (*compiled, *called, *stepped):
        assert record.filename == __file__, (record.filename, str(record.message)[:80])


class _OwnMean(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.b(torch.tanh(self.a(x))), y)


def test_a_string_other_than_the_examples_compiles_stages_for_that_call() -> None:
    """Before, what compiling proved on the example's `reduction='mean'` judged a call's 'sum':
    train_step refused reduction='sum', and its advice (leave it at 'mean') gave half the plain
    model's loss and gradients; an example of 'none' made pipe(x, y, 'mean') fail in torch."""
    model, reference = twin(OwnLoss())
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randint(0, 4, (8,))
    pipe = compile_pipeline(model, (x, y), ["cpu", "cpu"], chunks=2)
    with pytest.warns(UserWarning, match="cannot check that it is one on every batch"):
        loss = pipe.train_step(x, y, "sum", reduction="sum")
    expected = reference(x, y, "sum")
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)
    with pytest.raises(ValueError, match=r"(?s)on the example the model's own loss is the sum of its parts' losses.*pass reduction='sum'"):
        pipe.train_step(x, y, "sum")
    assert len(pipe._variants) == 1
    per_sample = compile_pipeline(copy.deepcopy(reference), (x, y, "none"), ["cpu", "cpu"], chunks=2)
    torch.testing.assert_close(per_sample(x, y, "none"), reference(x, y, "none"), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="a value made from the whole batch"):
        per_sample(x, y, "mean")


class MarksItsInput(nn.Module):
    """Marks its input as requiring grad, for a saliency map read from x.grad after backward."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.requires_grad_()
        return self.b(torch.tanh(self.a(x))) * x


@pytest.mark.parametrize("grad", [True, False])
def test_an_input_the_forward_marks_as_requiring_grad_is_the_callers_tensor(grad: bool) -> None:
    """Before, the stages marked their micro-batches of it: the caller's tensor stayed unmarked
    and got no gradient, where the plain model's x.grad holds the saliency."""
    model, reference = twin(MarksItsInput())
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x.clone(), ["cpu", "cpu"], chunks=2)
    mine, theirs = x.clone(), x.clone()
    with torch.set_grad_enabled(grad):
        out, expected = pipe(mine), reference(theirs)
    assert mine.requires_grad and theirs.requires_grad
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    if grad:
        out.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=0, atol=1e-12)
        assert_grads_equal(pipe, reference)


class _MaskedByKeyword(nn.Module):
    """An optional mask, and **kwargs (torch.fx cannot trace it: torch.export captures it)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor] = None, **kwargs: Any) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h if mask is None else h * mask)


def test_a_new_kind_of_call_made_first_inside_functional_call_says_to_make_it_outside() -> None:
    """torch.export takes only nn.Parameters: before, the refusal named export's own check and
    advised torch.where and eval mode. Made once outside, the same call inside runs exactly."""
    model, reference = twin(_MaskedByKeyword())
    x, mask = torch.randn(8, 6, dtype=torch.float64), (torch.rand(8, 6) > 0.5).double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.fx could not trace it
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
        new = {name: torch.randn_like(p) for name, p in model.named_parameters()}
        with torch.no_grad():
            with pytest.raises(Exception, match=r"(?s)hold other tensors \(as torch.func.functional_call swaps them in\).*How to fix: make the call of this kind once outside functional_call"):
                torch.func.functional_call(pipe, new, (x,), {"mask": mask})
            pipe(x, mask=mask)
            got = torch.func.functional_call(pipe, new, (x,), {"mask": mask})
    torch.testing.assert_close(got, torch.func.functional_call(reference, new, (x,), {"mask": mask}), rtol=0, atol=1e-12)
