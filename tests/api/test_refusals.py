"""Bad input gets one clear error that names the problem and the fix."""
from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any, Callable, Union

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils import prune
from torch.nn.utils.rnn import pack_padded_sequence

from fxpipe import PlacementError, StageError, TraceError, compile_pipeline
from helpers import X, FanOut, assert_call_and_grads_equal, assert_grads_equal, twin


def test_empty_batch() -> None:
    with pytest.raises(ValueError, match="the example batch is empty"):
        compile_pipeline(FanOut(), torch.randn(0, 6), ["cpu"])
    pipe = compile_pipeline(FanOut(), X, ["cpu"])
    with pytest.raises(ValueError, match=r"(?s)the input batch is empty \(size 0 along dim 0\).*How to fix: skip empty batches"):
        pipe(torch.randn(0, 6))
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8))  # its batch along dim 1, which is empty (before: "dim 0")
    pipe = compile_pipeline(model, torch.randn(5, 4, 8), ["cpu", "cpu"], chunks=2, chunk_spec={"input": 1})
    with pytest.raises(ValueError, match=r"the input batch is empty \(size 0 along dim 1\)"):
        pipe(torch.randn(5, 0, 8))


MOVES: dict[str, Callable[[Any], Any]] = {
    "to": lambda p: p.to("cpu"),
    "to with a dtype": lambda p: p.to(torch.device("cpu"), torch.float64),
    "cpu": lambda p: p.cpu(),
    "cuda": lambda p: p.cuda(),
    "xpu": lambda p: p.xpu(),
    "ipu": lambda p: p.ipu(),
    "mtia": lambda p: p.mtia(),
    "to_empty": lambda p: p.to_empty(device="meta"),  # (went through: every parameter on meta)
}


@pytest.mark.parametrize("move", MOVES)
def test_moving_a_pipeline_is_refused(move: str) -> None:
    pipe = compile_pipeline(FanOut(), X, ["cpu", "cpu"])
    before = {name: p.clone() for name, p in pipe.named_parameters()}
    with pytest.raises(PlacementError, match="placement is managed"):
        MOVES[move](pipe)
    assert all(torch.equal(p, before[name]) for name, p in pipe.named_parameters())
    assert pipe.to(torch.float64) is pipe


def test_moving_a_module_that_holds_a_pipeline_is_refused_and_casting_it_is_not() -> None:
    """Before, a holder's move reached the pipeline's tensors through `_apply`, around `to`:
    `wrapper.to("meta")` (on a GPU, `wrapper.cuda()`) moved every stage's parameters, and the next
    call failed with torch's raw error."""
    pipe = compile_pipeline(FanOut(), X, ["cpu", "cpu"])
    wrapper = nn.Sequential(pipe, nn.Linear(6, 6))  # (a part before the pipeline would be moved before it is refused)
    with pytest.raises(PlacementError, match="(?s)placement is managed.*A module that holds the pipeline moves it with itself"):
        wrapper.to("meta")
    assert all(p.device.type == "cpu" for p in pipe.parameters())
    wrapper.double()  # a cast keeps each tensor's device
    x = X.double()
    torch.testing.assert_close(wrapper(x), wrapper[1](pipe._owner(x)), rtol=0, atol=1e-12)


def test_calling_with_wrong_arguments() -> None:
    pipe = compile_pipeline(FanOut(), X, ["cpu"])
    with pytest.raises(TypeError, match="the pipeline takes the traced model's arguments"):
        pipe(X, X)


def test_second_backward_through_one_step() -> None:
    pipe = compile_pipeline(FanOut(), X, ["cpu", "cpu"])
    loss = pipe(X).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="retain_graph is not supported"):
        loss.backward()


class TwoHeads(nn.Module):
    """Two heads on branches that share nothing: the plain model's graphs for each are apart."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c, self.d = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.c(torch.tanh(self.a(x))), self.d(torch.tanh(self.b(x)))


def test_a_backward_from_each_output_in_turn_is_refused_naming_one_backward_for_all() -> None:
    """The plain model runs one backward per head; a pipeline call runs one for all its outputs.
    Before, the second was refused as a second backward "(retain_graph is not supported)", which
    the caller never asked for."""
    model, reference = twin(TwoHeads().double())
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    first, second = pipe(x)
    first.pow(2).sum().backward()
    with pytest.raises(RuntimeError, match=r"(?s)from some of its outputs alone \(1 of the 2 that take gradients\).*"
                       r"How to fix: one backward for all the losses.*torch.autograd.backward\(\[loss1, loss2\]\)"):  # fmt: skip
        second.pow(2).sum().backward()
    # One backward for both: the plain model's two, added.
    for m in (model, reference):
        m.zero_grad(set_to_none=True)
    torch.autograd.backward([o.pow(2).sum() for o in pipe(x)])
    for o in reference(x):
        o.pow(2).sum().backward()
    assert_grads_equal(model, reference, tol=1e-12)


class LooseScale(nn.Module):
    """A tensor attribute that requires grad but is not a parameter: the plain model's backward
    gives it a `.grad`."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6)
        self.scale = torch.ones(6, requires_grad=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x) * self.scale)


def test_tensor_that_requires_grad_but_is_no_parameter_is_refused() -> None:
    with pytest.raises(ValueError, match=r"require grad but are not parameters: scale\. (.|\n)*How to fix: register each tensor that learns as an nn\.Parameter"):
        compile_pipeline(LooseScale(), X, ["cpu", "cpu"], chunks=2)


class ReadsABuffer(nn.Module):
    scale: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6)
        self.register_buffer("scale", torch.full((6,), 0.7))
        self.gain = torch.full((6,), 2.0, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)) * self.scale * self.gain)


@pytest.mark.parametrize("name", ["scale", "gain"])
def test_a_buffer_or_tensor_attribute_made_to_require_grad_after_compiling_is_refused_at_the_call(name: str) -> None:
    """Before, each micro-batch's backward wrote its `.grad` (autograd.grad(loss, x) and
    backward(inputs=[x]) too, where the plain model leaves it None), a hook on it ran once per
    micro-batch, and autograd.grad(loss, it) found it unused. Under no_grad the call runs."""
    model, x = ReadsABuffer().double(), X.double().requires_grad_()
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    getattr(model, name).requires_grad_(True)
    with pytest.raises(RuntimeError, match=rf"(?s)require grad but are not nn.Parameters \({name}; made so after compiling.*register a tensor that learns as an nn.Parameter"):
        pipe(x)
    with pytest.raises(RuntimeError, match=rf"require grad but are not nn.Parameters \({name};"):
        pipe.train_step(x, target=torch.zeros(x.shape[0], 6, dtype=torch.float64), loss_fn=F.mse_loss)
    assert getattr(model, name).grad is None
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-12)
    getattr(model, name).requires_grad_(False)
    pipe(x).sum().backward()


class ScaleMadeOutsideForward(LooseScale):
    def __init__(self) -> None:
        super().__init__()
        self.log_scale = nn.Parameter(torch.zeros(6))
        self.scale = self.log_scale.exp()


def test_a_tensor_computed_with_gradients_outside_forward_is_refused() -> None:
    """Before, it compiled, and the first backward failed in a stage ('backward through the graph a
    second time'), with a hint about loss_fn that no call had; the plain model's first backward
    works, its second fails the same way."""
    with pytest.raises(ValueError, match=r"(?s)tensors computed with gradients outside forward .*: scale\..*"
                       r"How to fix: .*compute one made from parameters inside forward"):  # fmt: skip
        compile_pipeline(ScaleMadeOutsideForward(), X, ["cpu", "cpu"], chunks=2)


class _ClampsItsScale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.scale = nn.Linear(6, 6), nn.Linear(6, 6), nn.Parameter(torch.linspace(-2, 2, 6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            self.scale.clamp_(0.1, 1.0)
        return self.b(self.a(x) * self.scale)


def test_a_forward_that_keeps_its_parameter_in_range_is_refused_with_a_fix_that_works() -> None:
    """Before, compiling advised checkpoint='never', whose backward then failed with torch's bare
    'modified by an inplace operation'."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that torch.export took over from torch.fx
        with pytest.raises(ValueError, match=r"(?s)How to fix: write them outside forward \(after optimizer.step\(\).*or chunks=1"):
            compile_pipeline(_ClampsItsScale().double(), X.double(), ["cpu"], chunks=2)
        pipe = compile_pipeline(_ClampsItsScale().double(), X.double(), ["cpu"], chunks=2, checkpoint="never")
    with pytest.raises(Exception, match=r"(?s)modified by an inplace operation.*keep a parameter in range outside forward.*or chunks=1"):
        pipe(X.double()).sum().backward()


class _CountsItsCalls(nn.Module):
    n: torch.Tensor

    def __init__(self, copied: bool) -> None:
        super().__init__()
        self.a, self.b, self.copied = nn.Linear(6, 6), nn.Linear(6, 6), copied
        self.register_buffer("n", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.n.add_(1)
        return self.b(self.a(x) * (self.n.clone() if self.copied else self.n))


def test_a_counter_an_op_saves_is_refused_without_checkpoints_with_fixes_that_work() -> None:
    """Before, the hint spoke of a parameter written in forward, which the model has none of."""
    x = X.double()
    # (one stage: a value sent to the next stage is a copy of its own)
    pipe = compile_pipeline(_CountsItsCalls(copied=False).double(), x, ["cpu"], chunks=2, checkpoint="never")
    with pytest.raises(Exception, match=r"(?s)modified by an inplace operation.*a counter self.n.add_\(1\).*read a copy of a buffer \(self.n.clone\(\)\), or\s+checkpoint='always'"):
        pipe(x).sum().backward()
    for copied, checkpoint in ((True, "never"), (False, "always")):
        model = _CountsItsCalls(copied).double()
        reference = copy.deepcopy(model)
        pipe = compile_pipeline(model, x, ["cpu"], chunks=2, checkpoint=checkpoint)
        pipe(x).sum().backward()
        for piece in x.tensor_split(2):  # the micro-batches in turn, each backward after its forward
            reference(piece).sum().backward()
        assert_grads_equal(pipe, reference, tol=1e-12)


class _WritesWhatTanhSaved(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)).mul_(2))


def test_a_computed_value_the_model_writes_fails_as_the_plain_model_with_a_hint_that_names_it() -> None:
    """Before, the hint blamed a parameter or a buffer written across micro-batches, which the model
    has none of, and named checkpoint='always' and chunks=1, which fail alike."""
    x = X.double()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _WritesWhatTanhSaved().double()(x).sum().backward()  # the model's own error
    pipe = compile_pipeline(_WritesWhatTanhSaved().double(), x, ["cpu"], chunks=2, checkpoint="never")
    with pytest.raises(Exception, match=r"(?s)modified by an inplace operation.*the plain model's backward fails alike, and so does chunks=1.*write it out of place"):
        pipe(x).sum().backward()


class _Scaled(nn.Sequential):
    def __init__(self) -> None:
        super().__init__(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
        self.register_buffer("scale", torch.full((6,), 2.0, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale  # (autograd saves the buffer)


@pytest.mark.parametrize("written", ["optimizer.step()", "the input", "a buffer"])
def test_a_tensor_the_caller_writes_between_pipe_x_and_backward_fails_as_the_plain_model_with_a_note_that_says_so(written: str) -> None:
    """The plain model's backward fails alike. Before, the hint blamed the model's forward
    writing a parameter or a buffer, and named checkpoint='always' and chunks=1, which do not
    help; the note now says the caller wrote them after the forward, and how to order it."""
    model = _Scaled().double()
    x = X.double()
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, checkpoint="never")
    opt = torch.optim.SGD(pipe.parameters(), lr=0.1)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    x = x.clone().requires_grad_(False)
    out = pipe(x)
    with torch.no_grad():
        if written == "optimizer.step()":
            opt.step()
        else:
            (x if written == "the input" else model.get_buffer("scale")).mul_(2)
    with pytest.raises(StageError, match="modified by an inplace operation") as raised:
        out.sum().backward()
    notes = "\n".join(getattr(raised.value, "__notes__", []))
    assert "written in place after its forward" in notes and "How to fix: run the backward first" in notes, notes


class _Encoder(nn.Module):
    def __init__(self, nested: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8)
        layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=nested)
        self.head = nn.Linear(8, 3)

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(self.emb(ids), src_key_padding_mask=~mask))


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.filterwarnings("ignore:enable_nested_tensor is True")
def test_a_transformer_encoders_nested_fast_path_that_differs_by_micro_batch_is_refused_naming_the_switch() -> None:
    """In eval under no_grad, nn.TransformerEncoder gives padded positions zeros only where every
    row's mask is left-aligned: with one left-padded row, the whole batch computes them and a
    micro-batch without that row does not. Before, the refusal told to keep the mask whole,
    which does not help; with enable_nested_tensor=False the pipeline equals the plain model."""
    ids = torch.randint(0, 20, (8, 5), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(8, 5, dtype=torch.bool)
    mask[1, :2] = False  # left-padded
    mask[5, 3:] = False
    with torch.no_grad():
        with pytest.raises(ValueError, match=r"(?s)nn.TransformerEncoder enc takes its fast path.*enable_nested_tensor=False"):
            compile_pipeline(_Encoder(nested=True).double().eval(), (ids, mask), ["cpu", "cpu"], chunks=2)
    # Compiled in training mode, where the fast path is never taken, the pipeline would serve
    # pipe.eval() under no_grad as well: before, it compiled and gave the padded positions other
    # values there than the plain model (0.9 apart).
    with pytest.raises(ValueError, match=r"(?s)output head in eval mode.*nn.TransformerEncoder enc takes its fast path"):
        compile_pipeline(_Encoder(nested=True).double(), (ids, mask), ["cpu", "cpu"], chunks=2)
    model = _Encoder(nested=False).double()
    reference = copy.deepcopy(model).eval()
    pipe = compile_pipeline(model, (ids, mask), ["cpu", "cpu"], chunks=2).eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(ids, mask), reference(ids, mask), rtol=0, atol=1e-12)


class _PoolsInEval(nn.Module):
    """A block of the user's, called whole, that pools over the batch in eval mode alone."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.proj(x)
        return h if self.training else h - h.mean(0)


def test_a_module_called_whole_that_mixes_samples_in_eval_alone_is_refused_when_compiled_in_training_mode() -> None:
    """The parts' check compares eval mode too where the graph calls whole a module whose own code
    may read the mode; before, compiling passed and pipe.eval() gave other outputs."""
    model = nn.Sequential(nn.Linear(4, 4), _PoolsInEval(), nn.Linear(4, 2)).double()
    x = torch.randn(8, 4, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"(?s)output .* in eval mode: the parts' values"):
        compile_pipeline(copy.deepcopy(model), (x,), ["cpu", "cpu"], chunks=2, leaf_modules=[_PoolsInEval])
    pipe = compile_pipeline(copy.deepcopy(model), (x,), ["cpu", "cpu"], chunks=1, leaf_modules=[_PoolsInEval]).eval()
    torch.testing.assert_close(pipe(x), model.eval()(x), rtol=0, atol=1e-12)


class _TakesPacked(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.out = nn.LSTM(6, 8, batch_first=True), nn.Linear(8, 5)

    def forward(self, packed: Any) -> torch.Tensor:
        _, (h, _) = self.rnn(packed)
        return self.out(h[-1])


def test_a_packed_sequence_as_a_value_of_the_graph_is_refused_naming_the_layout_that_works() -> None:
    """Before, compiling failed with torch's 'tuple' object has no attribute 'device', at chunks=1 too."""
    packed = pack_padded_sequence(torch.randn(4, 7, 6), torch.tensor([4, 7, 2, 5]), batch_first=True, enforce_sorted=False)
    with pytest.raises(ValueError, match=r"a PackedSequence is a value of the graph.*\nHow to fix: pass the padded batch and its lengths"):
        compile_pipeline(_TakesPacked(), (packed,), ["cpu", "cpu"], chunks=1)


def test_the_same_tensor_without_grad_is_a_constant() -> None:
    model = LooseScale()
    model.scale.requires_grad_(False)
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    torch.testing.assert_close(pipe(X), model(X), rtol=0, atol=1e-6)


@dataclasses.dataclass
class Boxed:
    y: torch.Tensor


class Boxes(nn.Module):
    """Kept whole, it returns a dataclass pytree does not know."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> Boxed:
        return Boxed(torch.tanh(self.linear(x)))


class PassesADataclass(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = Boxes(), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(self.first(x).y)


def test_a_value_between_stages_that_hides_its_tensors_from_pytree_is_refused() -> None:
    """An unregistered dataclass would go whole from one stage to the next: unsplit, without
    gradients. (One the model returns is made again from its fields: tests/runtime/test_outputs.py.)"""
    with pytest.raises(ValueError, match=r"hold tensors pytree cannot see: first \(Boxed\)(.|\n)*How to fix: register the type.*or use a tuple or dict in its place"):
        compile_pipeline(PassesADataclass(), X, ["cpu", "cpu"], chunks=2, leaf_modules=[Boxes], split_points=["second"])


class Flagged(nn.Module):
    """Keyword arguments torch.fx cannot name: torch.export captures the model, and fixes
    `scale` to the example's value and the branch on the feature size to the example's."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, **options: float) -> torch.Tensor:
        h = self.second(torch.tanh(self.first(x))) * options.get("scale", 1.0)
        return h * 2 if x.shape[1] > 3 else h


def test_an_exported_pipeline_called_with_another_value_of_an_option_compiles_stages_for_it() -> None:
    """The graph holds the example's `scale`. Before, a call with another was refused ("Guard
    failed: scale == 1.0"); now it is another kind of call, compiled on its first such call."""
    model = Flagged().double()
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match="used torch.export"):
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, example_kwargs={"scale": 1.0})
    for scale in (1.0, 3.0, 1.0):
        torch.testing.assert_close(pipe(x, scale=scale), model(x, scale=scale), rtol=0, atol=1e-12)


class SwitchesGradOff(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        with torch.no_grad():
            gate = self.b(h)
        return self.c(h * gate)


def test_no_grad_inside_forward_is_kept() -> None:
    """torch.fx would keep the operations and lose the mode: the model goes through torch.export."""
    model = SwitchesGradOff().double()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match="switches gradients off"):
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    pipe(x).sum().backward()
    reference(x).sum().backward()
    assert model.b.weight.grad is None and reference.b.weight.grad is None
    torch.testing.assert_close(model.a.weight.grad, reference.a.weight.grad, rtol=0, atol=1e-12)
    y = torch.randn(4, 6, dtype=torch.float64)
    loss = pipe.train_step(x, target=y, loss_fn=torch.nn.functional.mse_loss)
    expected = torch.nn.functional.mse_loss(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert model.b.weight.grad is None
    torch.testing.assert_close(model.a.weight.grad, reference.a.weight.grad, rtol=0, atol=1e-12)
    pipe.eval()
    reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)


def test_no_grad_inside_forward_compiled_under_no_grad_serves_calls_under_no_grad_alone() -> None:
    """Compiled under no_grad, the part's no_grad() changed no mode: torch.fx kept its operations,
    and the pipeline trained the part's parameters (1.38 where the plain model has no gradient)."""
    model, reference = twin(SwitchesGradOff())
    x = torch.randn(4, 6, dtype=torch.float64)
    with torch.no_grad(), pytest.warns(UserWarning, match="switches gradients off"):
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    with pytest.raises(RuntimeError, match=r"(?s)compiled under torch.no_grad\(\).*made with gradients on.*How to fix: call it under torch.no_grad\(\); or compile outside"):
        pipe(x)
    with pytest.raises(RuntimeError, match="compiled under torch.no_grad"):
        pipe.train_step(x, target=x, loss_fn=torch.nn.functional.mse_loss)
    assert all(p.grad is None for p in model.parameters())
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)


class SwitchesGradOn(nn.Module):
    """Gradients on for a part, whatever the caller's: under no_grad its output still requires grad."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.enable_grad():
            return self.b(h)


def test_enable_grad_inside_forward_serves_calls_with_gradients_on_alone() -> None:
    """torch.fx refuses it, and torch.export's graph does not hold a switch to the mode it ran in:
    under the caller's no_grad the output had no gradient where the plain model's has one."""
    model, reference = twin(SwitchesGradOn())
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match="switches gradients on"):
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    with torch.no_grad(), pytest.raises(RuntimeError, match=r"(?s)compiled with gradients on.*under torch.no_grad\(\).*How to fix: call it with gradients on; or keep the module"):
        pipe(x)
    assert_call_and_grads_equal(pipe, reference, x)


class EntersInferenceMode(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        with torch.inference_mode():
            gate = torch.sigmoid(self.b(h.detach()))
        return self.c(h * gate.clone())


class _DerivativeInItsForward(nn.Module):
    """A physics-informed term in the model's own forward, under enable_grad."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(6, 6), nn.Linear(6, 1), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with torch.enable_grad():
            x = x.detach().requires_grad_(True)
            u = self.b(torch.tanh(self.a(x)))
            (du,) = torch.autograd.grad(u.sum(), x, create_graph=True)
        return self.c(du) + u


def test_a_derivative_in_the_models_own_forward_is_refused_with_the_fix_that_works() -> None:
    """Before, the refusal blamed data-dependent control flow and advised torch.cond."""
    with pytest.raises(Exception, match=r"(?s)switches gradients on for a part.*move that code into a submodule") as refused:
        compile_pipeline(_DerivativeInItsForward(), torch.randn(8, 6), ["cpu", "cpu"], chunks=2)
    assert "torch.cond" not in str(refused.value)


def test_inference_mode_inside_forward_is_refused_by_both_front_ends() -> None:
    """Both kept the part's operations without the mode: the pipeline trained b (1.38 where the
    plain model has no gradient)."""
    with pytest.raises(Exception, match=r"(?s)torch.fx: .*enters torch.inference_mode\(\).*torch.export: .*enters torch.inference_mode\(\).*How to fix: use .detach\(\)"):
        compile_pipeline(EntersInferenceMode(), torch.randn(4, 6), ["cpu", "cpu"], chunks=2)


class ReturnsCut(nn.Module):
    """Returns a value beside its cut copies: detached, and made under no_grad (torch.export)."""

    def __init__(self, no_grad: bool) -> None:
        super().__init__()
        self.a, self.c, self.no_grad = nn.Linear(4, 4), nn.Linear(4, 4), no_grad

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = torch.tanh(self.a(x))
        if not self.no_grad:
            return self.c(h), h.detach()
        with torch.no_grad():
            g = h * 2
        return self.c(h), h.detach(), g


@pytest.mark.filterwarnings("ignore:torch.fx could not trace")
@pytest.mark.parametrize("no_grad", [False, True], ids=["torch.fx", "torch.export"])
def test_an_output_cut_from_autograd_does_not_require_grad(no_grad: bool) -> None:
    """As in the plain model: its backward raises, and it gets no gradient from the pipeline."""
    model = ReturnsCut(no_grad).double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    got, expected = pipe(x), reference(x)
    assert [t.requires_grad for t in got] == [t.requires_grad for t in expected] == [True] + [False] * (len(got) - 1)
    for cut in got[1:]:
        with pytest.raises(RuntimeError, match="does not require grad"):
            cut.sum().backward()
    (got[0].sum() + sum(t.sum() for t in got[1:])).backward()
    (expected[0].sum() + sum(t.sum() for t in expected[1:])).backward()
    assert_grads_equal(pipe, reference)


class SequenceFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.rnn, self.head = nn.LSTM(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out)


def test_a_sequence_first_layer_is_refused_when_micro_batches_would_split_its_sequence() -> None:
    x = torch.randn(5, 4, 6)  # (sequence, batch, features)
    with pytest.raises(ValueError, match=r"batch_first=False\): rnn \(LSTM\)(.|\n)*How to fix: build them with batch_first=True"):
        compile_pipeline(SequenceFirst(), x, ["cpu", "cpu"], chunks=2)
    model = SequenceFirst()
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=1)
    torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-6)


class TransposedInside(nn.Module):
    """Batch-first at its boundary, sequence-first inside: x.transpose(0, 1) feeds the layers."""

    def __init__(self, layer: str) -> None:
        super().__init__()
        self.inp, self.out, self.recurrent = nn.Linear(5, 8), nn.Linear(8, 3), layer == "LSTM"
        self.inner: nn.Module = nn.LSTM(8, 8) if self.recurrent else nn.TransformerEncoder(
            nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0), 1, enable_nested_tensor=False)  # fmt: skip

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inner(self.inp(x).transpose(0, 1))
        return self.out((h[0] if self.recurrent else h).transpose(0, 1))


@pytest.mark.parametrize("layer", ["LSTM", "TransformerEncoder"])
def test_a_sequence_first_layer_the_model_feeds_the_batch_on_dim_1_is_split_as_the_plain_model(layer: str) -> None:
    """Before, any layer with batch_first=False was refused with chunks > 1, and its fix
    (chunk_spec={'x': 1}) split this model's sequence."""
    torch.manual_seed(0)
    model, reference = twin(TransposedInside(layer))
    x, y = torch.randn(8, 4, 5, dtype=torch.float64), torch.randn(8, 4, 3, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    assert_call_and_grads_equal(pipe, reference, x)
    pipe.zero_grad()
    reference.zero_grad()
    loss, expected = pipe.train_step(x, target=y, loss_fn=nn.functional.mse_loss), nn.functional.mse_loss(reference(x), y)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference)
    pipe.eval(), reference.eval()
    with torch.no_grad():
        torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)


class _SequenceFirstWithState(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gru, self.head = nn.GRU(6, 8), nn.Linear(8, 3)  # batch_first=False

    def forward(self, x: torch.Tensor, h0: torch.Tensor) -> torch.Tensor:
        return self.head(self.gru(x, h0)[0])


def test_a_chunk_spec_naming_the_state_but_not_the_sequence_first_input_names_the_input_to_add() -> None:
    """Before, the hint said h0 was split along dim 0 (chunk_spec split it along dim 1) and told to
    keep it whole, which led to the next refusal; x, whose dim 0 gave the batch, went unnamed."""
    model, reference = twin(_SequenceFirstWithState())
    x, h0 = torch.randn(7, 4, 6, dtype=torch.float64), torch.randn(1, 4, 8, dtype=torch.float64)
    with pytest.raises(ValueError) as refused:
        compile_pipeline(model, (x, h0), ["cpu", "cpu"], chunks=2, chunk_spec={"h0": 1})
    message = str(refused.value)
    assert "is that of x (7, 4, 6) along dim 0, which chunk_spec does not name, while it splits h0 along dim 1 (4)" in message
    assert "chunk_spec={..., 'x': 1}" in message and "split along dim 0 as it has the batch's size" not in message
    with pytest.raises(ValueError, match=r"batch_first=False.*\n.*chunk_spec=\{'x': 1, 'h0': 1\}"):
        compile_pipeline(model, (x, h0), ["cpu", "cpu"], chunks=2)
    pipe = compile_pipeline(model, (x, h0), ["cpu", "cpu"], chunks=2, chunk_spec={"x": 1, "h0": 1})  # as told
    torch.testing.assert_close(pipe(x, h0), reference(x, h0), rtol=0, atol=1e-12)


class CountsItsBatch(nn.Module):
    def __init__(self, compared: bool = False) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.compared = compared

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Union[int, bool]]:
        return self.b(self.a(x)), x.shape[0] > 4 if self.compared else x.shape[0]


@pytest.mark.parametrize("compared", [False, True], ids=["the size", "a bool from it"])
def test_an_output_that_is_no_tensor_and_differs_between_micro_batches_is_refused(compared: bool) -> None:
    """A bool made from the batch size was returned as the first micro-batch's (False where the
    plain model gives True), where the example's halves showed it differ: 8 > 4, 4 > 4."""
    example = torch.randn(8, 6) if compared else X
    pipe = compile_pipeline(CountsItsBatch(compared), example, ["cpu", "cpu"], chunks=2)
    for x in (torch.randn(5, 6), example):  # even halves give equal sizes: compiling saw the size differ from the whole batch's
        with pytest.raises(ValueError, match=r"(?s)returns output\[1\], a value made from the whole batch \(.*its size.*How to fix"):
            pipe(x)


class TwoInputs(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * mask)


def test_a_chunk_spec_naming_what_forward_does_not_take_is_refused() -> None:
    example = (X, torch.rand(6))
    with pytest.raises(ValueError, match=r"'msk' is not an argument of forward \(it takes x, mask\)(.|\n)*How to fix"):
        compile_pipeline(TwoInputs(), example, ["cpu", "cpu"], chunks=2, chunk_spec={"msk": None})
    with pytest.raises(ValueError, match=r"dim 5 of a tensor of shape \(4, 6\) does not exist"):
        compile_pipeline(TwoInputs(), example, ["cpu", "cpu"], chunks=2, chunk_spec={"x": 5})
    with pytest.raises(ValueError, match=r"'x': 'rows' is not a dim"):
        compile_pipeline(TwoInputs(), example, ["cpu", "cpu"], chunks=2, chunk_spec={"x": "rows"})  # type: ignore[dict-item]


def test_a_sequence_first_layer_is_refused_with_a_chunk_spec_that_splits_nothing_else() -> None:
    x = torch.randn(5, 4, 6)
    with pytest.raises(ValueError, match=r"batch_first=False\): rnn \(LSTM\)"):
        compile_pipeline(SequenceFirst(), x, ["cpu", "cpu"], chunks=2, chunk_spec={"x": 0})


def test_a_call_from_inside_one_of_its_own_stages_is_refused() -> None:
    model = FanOut()
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    seen: list[str] = []

    def hook(module: nn.Module, args: Any, out: torch.Tensor) -> None:
        try:
            pipe(X)
        except RuntimeError as e:
            seen.append(str(e))

    model.layers[7].register_forward_hook(hook)
    pipe(X)
    assert seen and all("called from inside one of its own stages" in s for s in seen)


def _transform_case() -> tuple[nn.Module, nn.Module, torch.Tensor]:
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    reference = copy.deepcopy(model)
    return model, reference, torch.randn(8, 6, dtype=torch.float64)


@pytest.mark.parametrize("transform", ["vmap", "grad of functional_call", "jvp", "forward-mode AD", "functional_call with grad"])
def test_transforms_the_stages_cannot_carry_are_refused(transform: str) -> None:
    """Each would lose its work in the stages (they run on tensors of their own, on other
    threads): torch.func.grad gave all-zero gradients, forward-mode AD no tangent."""
    from torch.autograd import forward_ad
    from torch.func import functional_call

    model, reference, x = _transform_case()
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    params = {name: p.detach().clone() for name, p in reference.named_parameters()}
    calls = {
        "vmap": lambda: torch.func.vmap(pipe)(x.unsqueeze(0).expand(3, 8, 6)),
        "grad of functional_call": lambda: torch.func.grad(lambda p: functional_call(pipe, p, (x,)).sum())(params),
        "jvp": lambda: torch.func.jvp(pipe, (x,), (torch.ones_like(x),)),
        "functional_call with grad": lambda: functional_call(pipe, {k: v.requires_grad_() for k, v in params.items()}, (x,)),
    }
    with pytest.raises(RuntimeError, match="(?s)cannot compute what the plain model would.*How to fix: apply such transforms to the plain model"):
        if transform == "forward-mode AD":
            with forward_ad.dual_level():
                pipe(forward_ad.make_dual(x, torch.ones_like(x)))
        else:
            calls[transform]()
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)  # and the next call runs


class _TiedAndScaled(nn.Module):
    """A weight both stages read (tied), and a buffer."""

    scale: torch.Tensor

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.b.weight = self.a.weight
        self.register_buffer("scale", torch.full((6,), 2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * self.scale)


@pytest.mark.parametrize("name", ["a.bias", "a.weight", "scale"], ids=["a parameter", "a tied parameter", "a buffer"])
def test_tangents_of_forward_mode_ad_on_what_the_stages_read_are_refused_naming_it(name: str) -> None:
    """functional_call swapping in a dual tensor for a parameter or a buffer: before, the
    pipeline's output had no tangent where the plain model's had one, and no error."""
    from torch.autograd import forward_ad
    from torch.func import functional_call

    model, reference = twin(_TiedAndScaled())
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, split_points=["b"])
    held = {**dict(reference.named_parameters()), **dict(reference.named_buffers())}
    with forward_ad.dual_level():
        dual = {name: forward_ad.make_dual(held[name].detach(), torch.ones_like(held[name]))}
        assert forward_ad.unpack_dual(functional_call(reference, dual, (x,))).tangent is not None
        with pytest.raises(RuntimeError, match=rf"(?s)cannot compute what the plain model would.*parameters or buffers the stages read carry tangents of forward-mode AD \({name}[^;]*; .*How to fix: apply such transforms to the plain model"):
            functional_call(pipe, dual, (x,))
        torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)  # its own, without tangents, run
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)


def test_a_dual_tensor_set_where_a_parameter_was_deleted_is_refused_naming_it() -> None:
    """Forward-mode AD's tutorial way with modules: `del lin.weight; lin.weight = make_dual(...)`.
    Before, the stages read the new tensor's values and dropped its tangent (the plain model's
    output tangent 0.9 at most, the pipeline's None), with no error."""
    from torch.autograd import forward_ad

    model, reference = twin(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6)))
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    layer = model[2]
    weight = layer.get_parameter("weight")
    with forward_ad.dual_level():
        del layer.weight
        layer.weight = forward_ad.make_dual(weight.detach(), torch.ones_like(weight))
        try:
            with pytest.raises(RuntimeError, match=r"(?s)carry tangents of forward-mode AD \(2.weight; .*How to fix: apply such transforms to the plain model"):
                pipe(x)
        finally:
            del layer.weight
            layer.weight = weight
    kept = reference[2].weight  # registered again, last, as the pipeline's is
    del reference[2].weight
    reference[2].weight = kept
    out, expected = pipe(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.sum().backward()
    expected.sum().backward()
    assert_grads_equal(model, reference, tol=1e-12)


def test_functional_call_with_tensors_that_do_not_require_grad_runs_on_them() -> None:
    from torch.func import functional_call

    model, reference, x = _transform_case()
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    other = {name: torch.randn_like(p) for name, p in reference.named_parameters()}
    torch.testing.assert_close(functional_call(pipe, other, (x,)), functional_call(reference, other, (x,)), rtol=0, atol=1e-12)
    with torch.no_grad():
        wanting = {k: v.clone().requires_grad_() for k, v in other.items()}
        torch.testing.assert_close(functional_call(pipe, wanting, (x,)), functional_call(reference, other, (x,)), rtol=0, atol=1e-12)
    out = pipe(x)  # its own parameters again, and their gradients
    out.sum().backward()
    reference(x).sum().backward()
    for p, q in zip(pipe.parameters(), reference.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=1e-12)


class _BranchesOnAShape(nn.Module):
    """torch.fx cannot trace the branch: torch.export captures the model."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(h.relu() if h.shape[1] > 4 else h)


def test_functional_call_with_tensors_that_require_grad_is_refused_as_such_on_an_exported_graph() -> None:
    """Before, the stages built on the swapped tensors refused them as the model's own tensors
    that are not parameters, advising nn.Parameter: they are, and functional_call was not named."""
    from torch.func import functional_call

    model = _BranchesOnAShape().double()
    reference, x = copy.deepcopy(model), X.double()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the note that torch.export took over
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    wanting = {name: p.detach().clone().requires_grad_() for name, p in pipe.named_parameters()}
    with pytest.raises(RuntimeError, match=r"(?s)swapped for tensors that require grad but are not nn.Parameters.*functional_call"):
        functional_call(pipe, wanting, (x,))
    assert_call_and_grads_equal(pipe, reference, x)


def test_a_sample_without_its_batch_dim_is_refused_not_split_along_its_features() -> None:
    pipe = compile_pipeline(nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 2)), X, ["cpu", "cpu"], chunks=2)
    with pytest.raises(ValueError, match=r"(?s)fewer dims than the example's.*input_1 \(6,\) \(the example's had 2 dims\).*x.unsqueeze\(0\)"):
        pipe(torch.randn(6))
    assert pipe(torch.randn(1, 6)).shape == (1, 2)


class Weighted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(self.a(x)) * w)  # w: a row of weights per sample


@pytest.mark.parametrize("example_rows", [8, 1], ids=["per sample", "broadcast"])
def test_a_batched_input_given_another_size_than_the_batch_is_refused_not_kept_whole(example_rows: int) -> None:
    """Kept whole, a w of 4 rows would broadcast against each micro-batch of 4: numbers, where
    the plain model refuses the sizes. Before, an example that gave w one row let it through."""
    model, reference = twin(Weighted())
    x, w = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, (x, w[:example_rows]), ["cpu", "cpu"], chunks=2)
    with pytest.raises(RuntimeError, match="must match"):
        reference(x, w[:4])
    with pytest.raises(ValueError, match=r"(?s)another size there than the batch's 8 \(nor 1\): w \(4, 6\).*How to fix"):
        pipe(x, w[:4])
    for w_now in (w[:1], w):  # one row broadcasts in both; the batch's rows split with it
        torch.testing.assert_close(pipe(x, w_now), reference(x, w_now), rtol=0, atol=1e-12)


@pytest.mark.filterwarnings("ignore::DeprecationWarning")
@pytest.mark.parametrize("capture", ["jit.script", "jit.trace", "export", "export strict"])
def test_capturing_a_pipeline_is_refused_naming_the_plain_model_as_the_fix(capture: str) -> None:
    """Each would otherwise fail inside the runtime (a type it cannot script, a tensor where the
    micro-batch split wants an int, a data-dependent guard), naming nothing the user wrote."""
    pipe = compile_pipeline(nn.Sequential(nn.Linear(4, 4), nn.Tanh(), nn.Linear(4, 4)), torch.randn(4, 4), ["cpu", "cpu"], chunks=2)
    x = torch.randn(4, 4)
    captures = {
        "jit.script": lambda: torch.jit.script(pipe),
        "jit.trace": lambda: torch.jit.trace(pipe, x),
        "export": lambda: torch.export.export(pipe, (x,), strict=False),
        "export strict": lambda: torch.export.export(pipe, (x,), strict=True),
    }
    with pytest.raises(Exception, match="a Pipeline cannot be captured by torch.jit.script") as caught:
        captures[capture]()
    assert "How to fix: capture the plain model" in str(caught.value)


class _StateTuple(nn.Module):
    """An LSTM given its initial state `(h0, c0)`, whose batch lies on dim 1."""

    def __init__(self) -> None:
        super().__init__()
        self.lstm, self.head = nn.LSTM(6, 6, batch_first=True), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, state: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        return self.head(self.lstm(x, state)[0])


def test_an_lstm_state_passed_whole_is_named_with_the_chunk_spec_that_splits_it() -> None:
    """Before, the refusal named no input for a tuple state (it did for a GRU's tensor one)."""
    torch.manual_seed(0)
    model = _StateTuple().double()
    x, state = torch.randn(4, 5, 6, dtype=torch.float64), (torch.randn(1, 4, 6, dtype=torch.float64), torch.randn(1, 4, 6, dtype=torch.float64))
    with pytest.raises(ValueError, match=r"state \(1, 4, 6\), \(1, 4, 6\)\. If that dim holds their batch, split them there: chunk_spec=\{'state': 1\}"):
        compile_pipeline(model, (x, state), ["cpu", "cpu"], chunks=2)
    pipe = compile_pipeline(model, (x, state), ["cpu", "cpu"], chunks=2, chunk_spec={"state": 1})
    torch.testing.assert_close(pipe(x, state), model(x, state), rtol=0, atol=1e-12)


def test_lazy_parameters_are_refused_with_the_fix() -> None:
    """Before, torch's own "uninitialized parameter" error came out of a pass."""
    model = nn.Sequential(nn.LazyLinear(6), nn.Linear(6, 6))
    with pytest.raises(ValueError, match=r"(?s)without a shape yet.*0\.weight, 0\.bias.*model\(example\)"):
        compile_pipeline(model, torch.randn(4, 6), ["cpu", "cpu"], chunks=2)
    model(torch.randn(4, 6))
    compile_pipeline(model, torch.randn(4, 6), ["cpu", "cpu"], chunks=2)


def test_a_long_list_of_names_in_a_message_says_how_many_more() -> None:
    """Messages name the first few and count the rest (before, some said only "and more")."""
    model = nn.Sequential(*(nn.LazyLinear(6) for _ in range(7)))
    with pytest.raises(ValueError, match=r"0\.weight, 0\.bias, 1\.weight, 1\.bias, 2\.weight and 9 more\.\n"):
        compile_pipeline(model, torch.randn(4, 6), ["cpu", "cpu"], chunks=2)


class _ReentrantDropout(nn.Module):
    """torch.utils.checkpoint (reentrant) around a block with dropout: it mixes no samples."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.block, self.b = nn.Linear(6, 6), nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.3)), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.utils.checkpoint.checkpoint(self.block, torch.tanh(self.a(x)), use_reentrant=True))


def test_a_reentrant_checkpoint_with_dropout_inside_is_refused_for_its_recompute_not_for_mixing_samples() -> None:
    """Before, it was refused as one that "mixes samples along the batch dim"; then it compiled,
    and torch's recompute in backward drew other masks than the forward (tests/runtime/test_recompute_state.py)."""
    torch.manual_seed(0)
    model = _ReentrantDropout().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    with pytest.raises(TraceError, match=r"recomputes random ops \(dropout\) in backward, in block") as raised:
        compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    assert "mixes samples" not in str(raised.value)
    setattr(model.block[1], "p", 0.0)  # nothing drawn: it compiles, and is exact
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-12)


@pytest.mark.parametrize("stages", [1, 2])
def test_a_micro_batch_too_small_for_batchnorm_says_to_use_fewer_chunks_and_leaves_the_model_as_it_was(stages: int) -> None:
    """The plain model normalises the whole batch of four; four micro-batches hold one sample
    each, one value per channel, which BatchNorm in training mode refuses. The call fails with
    torch's error and the fix, and leaves the model's statistics and gradients as they were; its
    next call, on micro-batches of two, computes what the plain model does on each in turn, as
    does a pipeline of two micro-batches compiled on the batch of four."""
    from fxpipe import StageError

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).double()
    plain = copy.deepcopy(model)
    x = torch.randn(4, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * stages, chunks=4)
    statistics = copy.deepcopy(model[1].state_dict())
    with pytest.raises(StageError, match=r"(?s)Expected more than 1 value per channel.*How to fix: fewer chunks, or a larger batch"):
        pipe(x).sum().backward()
    assert all(torch.equal(value, statistics[key]) for key, value in model[1].state_dict().items()), "statistics as they were"
    assert all(p.grad is None for p in model.parameters())
    # The same pipeline's next call, on a batch of eight (four micro-batches of two), computes
    # what the plain model does on each micro-batch in turn.
    x = torch.randn(8, 6, dtype=torch.float64)
    _equals_plain_per_micro_batch(pipe, model, plain, x, 4)
    # And a pipeline of two micro-batches, on the batch of four, computes what the plain model does
    # on each of its halves in turn.
    for p in [*model.parameters(), *plain.parameters()]:
        p.grad = None
    x = x[:4]
    _equals_plain_per_micro_batch(compile_pipeline(model, x, ["cpu"] * stages, chunks=2), model, plain, x, 2)


def test_a_call_of_one_sample_through_batchnorm_fails_as_the_plain_model_with_no_hint_of_micro_batches() -> None:
    """One sample is one micro-batch, whatever chunks says: the plain model refuses it too, and
    a hint that blames the micro-batches (and says the whole batch holds more) would mislead."""
    from fxpipe import StageError

    model = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).double()
    x = torch.randn(4, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        model(x[:1])
    with pytest.raises(StageError, match="Expected more than 1 value per channel when training") as failed:
        pipe(x[:1])
    assert "fewer chunks" not in str(failed.value) and "holds more" not in str(failed.value), str(failed.value)


class Halves(nn.Module):
    """Cuts its batch in two halves and joins them again: per sample, but a micro-batch of one
    sample has no second half."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 6), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        halves = self.a(x).relu().chunk(2, 0)
        return torch.cat([self.b(halves[0]), self.b(halves[1])])


def test_a_stage_failing_on_a_micro_batch_of_one_sample_says_so_with_the_fix() -> None:
    """Before, a raw IndexError, where the plain model runs the batch of five."""
    from fxpipe import StageError

    model = Halves().double()
    pipe = compile_pipeline(model, torch.randn(6, 4, dtype=torch.float64), ["cpu", "cpu"], chunks=3)
    x = torch.randn(5, 4, dtype=torch.float64)
    assert model(x).shape == (5, 3)
    with pytest.raises(StageError, match=r"(?s)micro-batch 2 in forward: IndexError.*holds one sample of the call's 5.*How to fix, then: a batch"):
        pipe(x)
    x = torch.randn(6, 4, dtype=torch.float64)  # micro-batches of two
    torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-12)


def _equals_plain_per_micro_batch(pipe: nn.Module, model: nn.Sequential, plain: nn.Sequential, x: torch.Tensor, chunks: int) -> None:
    """`pipe(x)` (on `model`) is the plain model run on each of the `chunks` micro-batches in turn:
    outputs, gradients, and the BatchNorm's (`[1]`) running statistics."""
    out = pipe(x)
    expected = torch.cat([plain(piece) for piece in x.tensor_split(chunks)])
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.pow(2).mean().backward()
    expected.pow(2).mean().backward()
    assert_grads_equal(model, plain, tol=1e-12)
    for key, value in model[1].state_dict().items():
        torch.testing.assert_close(value, plain[1].state_dict()[key], rtol=0, atol=1e-12)


def test_torch_compile_of_a_pipeline_runs_it_as_it_is_and_says_how_to_compile_the_stages() -> None:
    """Before, torch.compile traced the runtime's Python in pieces between graph breaks (threads,
    locks, the schedule), warning of builtins it could not trace, for seconds and no kernel."""
    torch.manual_seed(0)
    model, reference = twin(FanOut())
    pipe = compile_pipeline(model, X.double(), ["cpu", "cpu"], chunks=2)
    compiled = torch.compile(pipe)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    with pytest.warns(UserWarning, match=r"(?s)runs the pipeline as it is.*compile_stages=True") as caught:
        for x in (X.double(), 2 * X.double()):
            out = compiled(x)
            out.square().sum().backward()
            expected = reference(x)
            expected.square().sum().backward()
            torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, 1e-12)
    assert not torch._dynamo.utils.counters["stats"]["unique_graphs"], "no graph of the runtime is compiled"
    assert all("Dynamo" not in str(w.message) for w in caught), [str(w.message)[:80] for w in caught]


@pytest.mark.parametrize("strict", [False, True])
def test_torch_export_of_a_pipeline_says_why_strict_or_not(strict: bool) -> None:
    """Before, strict export buried the refusal under torch's "Observed exception"."""
    pipe = compile_pipeline(FanOut().double(), X.double(), ["cpu", "cpu"], chunks=2)
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"(?s)a Pipeline cannot be captured by .*torch.export.*How to fix: capture the plain model") as refused:
        torch.export.export(pipe, (X.double(),), strict=strict)
    said = str(refused.value).partition("Developer debug context")[0]  # what torch shows first
    assert "a Pipeline cannot be captured" in said and "Observed exception" not in said, said[:300]


def test_torch_fx_tracing_a_pipeline_is_refused_as_the_other_capture_tools_are() -> None:
    """Before, torch.fx.symbolic_trace(pipe) failed inside the pipeline's binding of its arguments
    ("Proxy object cannot be iterated"), and a model holding a pipeline traced through it."""
    pipe = compile_pipeline(FanOut().double(), X.double(), ["cpu", "cpu"], chunks=2)

    class Holds(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pipe = pipe

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.pipe(x) + 1

    for root in (pipe, Holds()):
        with pytest.raises(RuntimeError, match="a Pipeline cannot be captured by .*torch.fx"):
            torch.fx.symbolic_trace(root)


@pytest.mark.parametrize("how", ["the pipeline", "a function calling it", "a function calling train_step"])
def test_torch_compile_with_fullgraph_says_why_a_pipeline_is_no_one_graph(how: str) -> None:
    """Before, torch's message named its own `disable` and asked to file an issue to PyTorch (or,
    around train_step, named none of the pipeline)."""
    pipe = compile_pipeline(FanOut().double(), X.double(), ["cpu", "cpu"], chunks=2)
    torch._dynamo.reset()
    compiled = {
        "the pipeline": torch.compile(pipe, fullgraph=True),
        "a function calling it": torch.compile(lambda v: pipe(v).sum(), fullgraph=True),
        "a function calling train_step": torch.compile(lambda v: pipe.train_step(v, target=v, loss_fn=F.mse_loss), fullgraph=True),
    }[how]
    with pytest.raises(Exception, match=r"(?s)a Pipeline runs its stages on worker threads.*compile_stages=True\); or drop fullgraph=True"):
        compiled(X.double())


def test_torch_compile_of_a_function_calling_train_step_runs_the_step_as_it_is() -> None:
    """Before, torch.compile traced train_step's Python in pieces: 29 graph breaks and seconds of
    compiling, for the same numbers."""
    model, reference = twin(FanOut())
    pipe = compile_pipeline(model, X.double(), ["cpu", "cpu"], chunks=2)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    step = torch.compile(lambda v: pipe.train_step(v, target=v, loss_fn=F.mse_loss))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loss = step(X.double())
    expected = F.mse_loss(reference(X.double()), X.double())
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, 1e-12)
    assert sum(torch._dynamo.utils.counters["graph_break"].values()) <= 4, dict(torch._dynamo.utils.counters["graph_break"])


def test_torch_compile_of_a_pipeline_with_compiled_stages_runs_them_without_a_warning() -> None:
    """Stages on the calling thread (one device): torch.compile's own compile of the stages still
    runs inside the call that it leaves alone."""
    torch.manual_seed(0)
    model, reference = twin(FanOut())
    pipe = compile_pipeline(model, X.double(), ["cpu"], chunks=2, compile_stages={"backend": "eager"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.simplefilter("ignore", DeprecationWarning)  # torch's own, from what it imports on its first compile
        out = torch.compile(pipe)(X.double())
    out.square().sum().backward()
    expected = reference(X.double())
    expected.square().sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, 1e-12)
    assert pipe.compile_stats()[0].graphs >= 1


class _SparseInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.randn(8, 8, dtype=torch.float64)), nn.Linear(8, 8, dtype=torch.float64)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.tanh(torch.sparse.mm(x, self.w)))


@pytest.mark.parametrize("layout", ["coo", "csr"])
def test_a_sparse_input_runs_whole_and_is_refused_split_saying_so(layout: str) -> None:
    """Before, compiling failed inside torch ('aten::as_strided ... SparseCPU', or 'Sparse CSR
    tensors do not have strides'), and with chunks=1 every call did."""
    model = _SparseInput()
    dense = torch.randn(8, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    x = (dense * (dense > 0.3)).to_sparse() if layout == "coo" else (dense * (dense > 0.3)).to_sparse_csr()
    with pytest.raises(ValueError, match=rf"an input that holds the batch is a sparse_{layout} tensor of shape \(8, 8\).*\n.*to_dense\(\)"):
        compile_pipeline(model, x, ["cpu", "cpu"], chunks=4)
    reference = copy.deepcopy(model)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=1)
    out, expected = pipe(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_grads_equal(pipe, reference, tol=1e-12)


@pytest.mark.parametrize("where", ["the pipeline", "a block around it"])
def test_a_pipeline_inside_a_non_reentrant_checkpoint_is_refused_and_a_reentrant_one_is_exact(where: str) -> None:
    """Before, torch's non-reentrant checkpoint handed its saved-tensor hooks to the stages: its
    recompute then called the pipeline from a stage's backward (refused as a call from a hook on
    a module it runs), or torch raised its own CheckpointError, naming no pipeline."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 8)).double()
    plain = copy.deepcopy(model)
    x = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4)

    def block(net: nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return net if where == "the pipeline" else lambda t: torch.tanh(net(t)) * 2

    with pytest.raises(RuntimeError, match=r"inside torch.utils.checkpoint\(\.\.\., use_reentrant=False\).*\nHow to fix: let the pipeline checkpoint its stages itself"):
        torch.utils.checkpoint.checkpoint(block(pipe), x, use_reentrant=False)
    out = torch.utils.checkpoint.checkpoint(block(pipe), x, use_reentrant=True)
    out.square().sum().backward()
    plain_x = x.detach().clone().requires_grad_()
    torch.utils.checkpoint.checkpoint(block(plain), plain_x, use_reentrant=True).square().sum().backward()
    assert x.grad is not None
    torch.testing.assert_close(x.grad, plain_x.grad, rtol=0, atol=1e-12)
    assert_grads_equal(pipe, plain, 1e-12)


class PrunedTakingRest(nn.Module):
    """Only torch.export captures it (its forward takes *rest), and a layer of it is pruned."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6)
        prune.l1_unstructured(self.second, "weight", amount=0.5)

    def forward(self, x: torch.Tensor, *rest: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)))


def test_torch_s_own_weight_hooks_that_export_would_run_once_are_refused_naming_their_remove_functions() -> None:
    """Before, the advice was handle.remove(), for hooks the user holds no handle of, which would
    leave the weight the hook last computed; prune.remove makes the pruned weight permanent."""
    model = PrunedTakingRest()
    with pytest.raises(TraceError, match=r"(?s)run the model's hooks once.*prune\.remove\(module, 'weight'\) makes a pruned weight permanent"):
        compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    prune.remove(model.second, "weight")
    pipe = compile_pipeline(copy.deepcopy(model), X, ["cpu", "cpu"], chunks=2)
    torch.testing.assert_close(pipe(X), model(X), rtol=0, atol=1e-6)


class _OwnWeight(nn.Module):
    """A weight the model itself holds, beside its layers."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6)
        self.w = nn.Parameter(torch.randn(6, 6) / 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)) @ self.w)


class _OwnWeightTransposed(_OwnWeight):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.second(torch.tanh(self.first(x)) @ self.w.t())


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("hook", ["prune", "weight_norm"])
def test_a_weight_hook_of_torch_on_the_model_itself_is_refused_naming_it_and_what_works(hook: str, transposed: bool) -> None:
    """Before, it was blamed on the model's forward, with advice to keep the module that stores
    the weight whole: the model itself, which leaf_modules refuses; and where forward called a
    method of the weight (`self.w.t()`), the refusal of both front ends blamed parameters read
    on their values, with advice to read them by name."""
    model = _OwnWeightTransposed() if transposed else _OwnWeight()
    if hook == "prune":
        prune.l1_unstructured(model, "w", amount=0.5)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the hook form's deprecation
            nn.utils.weight_norm(model, "w")
    with pytest.raises(TraceError, match=r"(?s)a hook of torch.nn.utils on the model itself assigns 'w' \((L1Unstructured|WeightNorm)\).*How to fix: make it permanent") as refused:
        compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    assert "leaf_modules" not in str(refused.value) and "neither torch.fx nor torch.export" not in str(refused.value)
    if hook == "prune":
        prune.remove(model, "w")
    else:
        nn.utils.remove_weight_norm(model, "w")
    pipe = compile_pipeline(copy.deepcopy(model), X, ["cpu", "cpu"], chunks=2)
    torch.testing.assert_close(pipe(X), model(X), rtol=0, atol=1e-6)


class _AssignsItsOwn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6)
        self.last = torch.zeros(())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.first(x))
        self.last = h.mean()
        return self.second(h)


def test_an_attribute_the_model_itself_assigns_is_refused_without_asking_to_keep_the_model_whole() -> None:
    with pytest.raises(TraceError, match=r"(?s)assigns 'last'.*The model itself holds 'last', and is never kept whole: keep such a value in a submodule"):
        compile_pipeline(_AssignsItsOwn(), X, ["cpu", "cpu"], chunks=2)


class ViewOfAWeight(nn.Module):
    """A view of a parameter made in __init__: its backward saves nothing, and serves any number."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6, bias=False)
        self.transposed = self.second.weight.t()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.first(x)) @ self.transposed


class KeepsItsOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(self.lin(x))
        self.last = y  # kept for inspection, as attention maps often are
        return y


class HoldsAKeeper(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.inner, self.b = nn.Linear(6, 6), KeepsItsOutput(), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(self.inner(self.a(x)))


@pytest.mark.parametrize("case", ["a view of a weight", "an output a module kept whole keeps"])
def test_tensors_with_gradients_that_every_call_can_use_are_not_refused(case: str) -> None:
    """Before (the last commits), both were refused as tensors computed with gradients outside
    forward: a view saves nothing for backward, and a module kept whole makes its output again at
    every call (here after a step of the model before compiling)."""
    kind = ViewOfAWeight if case == "a view of a weight" else HoldsAKeeper
    torch.manual_seed(0)
    model = kind().double()
    torch.manual_seed(0)
    reference = kind().double()
    for net in (model, reference):  # a view made after the cast, of the weight the model holds
        if isinstance(net, ViewOfAWeight):
            net.transposed = net.second.weight.t()
    model(X.double()).square().mean().backward()  # a step before compiling: what a module kept whole keeps is left over
    model.zero_grad(set_to_none=True)
    pipe = compile_pipeline(model, X.double(), ["cpu", "cpu"], chunks=2, leaf_modules=[KeepsItsOutput])
    for _ in range(2):  # the view serves every backward
        pipe(X.double()).square().mean().backward()
        reference(X.double()).square().mean().backward()
    assert_grads_equal(pipe, reference, tol=1e-12)
