"""Bad input gets one clear error that names the problem and the fix."""
from __future__ import annotations

import copy
import dataclasses
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

from conftest import FanOut, assert_call_and_grads_equal, assert_grads_equal, twin
from fxpipe import PartitionError, PlacementError, TraceError, compile_pipeline

X = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))  # fixed whatever was imported first


class Nest(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Sequential(nn.Linear(6, 6), nn.ReLU())
        self.second = nn.Sequential(nn.Linear(6, 6), nn.ReLU())
        self.third = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.third(self.second(self.first(x)))


def test_empty_devices() -> None:
    with pytest.raises(ValueError, match="devices is empty"):
        compile_pipeline(FanOut(), X, [])


@pytest.mark.parametrize("chunks", [0, -2, 1.5])
def test_chunks_below_one(chunks: object) -> None:
    with pytest.raises(ValueError, match="chunks must be a whole number of micro-batches, at least 1"):
        compile_pipeline(FanOut(), X, ["cpu"], chunks=chunks)  # type: ignore[arg-type]


def test_unknown_checkpoint_mode() -> None:
    with pytest.raises(ValueError, match="checkpoint must be one of 'always', 'except_last', 'never' \\(got 'sometimes'\\)"):
        compile_pipeline(FanOut(), X, ["cpu"], checkpoint="sometimes")


def test_all_argument_problems_are_listed_together() -> None:
    with pytest.raises(ValueError) as info:
        compile_pipeline(FanOut(), X, [], chunks=0, checkpoint="bad")
    message = str(info.value)
    assert "devices is empty" in message and "chunks must" in message and "checkpoint must" in message


def test_split_point_that_is_not_a_module() -> None:
    with pytest.raises(PartitionError, match="split point 'fourth' is not a module that runs in the traced graph"):
        compile_pipeline(Nest(), X, ["cpu", "cpu"], split_points=["fourth"])
    with pytest.raises(PartitionError, match=r"split point 'secnd.0' is not a module that runs in the traced graph \(did you mean 'second.0'"):
        compile_pipeline(Nest(), X, ["cpu", "cpu"], split_points=["secnd.0"])


@pytest.mark.parametrize("leaves", [None, "second", Nest, ["second"]], ids=["None", "a name", "a type", "a list"])
def test_leaf_modules_may_be_none_one_name_or_type_or_a_list(leaves: Any) -> None:
    """Before, None failed inside compile_pipeline ('NoneType' object is not iterable) and a lone
    name was taken for a list of its letters."""
    model = nn.Sequential(Nest(), nn.Linear(6, 6)) if leaves is Nest else Nest()
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2, leaf_modules=leaves)
    torch.testing.assert_close(pipe(X), model(X), rtol=0, atol=0)
    if leaves is not None:
        kept = [n for n in pipe.program().graph.graph.nodes if n.op == "call_module"]
        assert {str(n.target) for n in kept} & {"second", "0"}, [str(n.target) for n in kept]


def test_split_points_out_of_order() -> None:
    with pytest.raises(PartitionError, match="split points are out of order"):
        compile_pipeline(Nest(), X, ["cpu"] * 3, split_points=["third", "second"])


def test_split_points_cut_where_the_modules_begin() -> None:
    pipe = compile_pipeline(Nest(), X, ["cpu"] * 3, split_points=["second", "third"])
    assert [stage.nodes for stage in pipe.plan.stages] == [["first_0", "first_1"], ["second_0", "second_1"], ["third"]]


def test_more_stages_than_nodes() -> None:
    with pytest.raises(PartitionError, match="6 stages but the graph has only 5 nodes to place"):
        compile_pipeline(Nest(), X, ["cpu"] * 6)


def test_balance_that_does_not_sum_to_the_node_count() -> None:
    with pytest.raises(PartitionError, match="balance sums to 4 but the graph has 5 nodes to place"):
        compile_pipeline(Nest(), X, ["cpu", "cpu"], balance=[2, 2])


class Untraceable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate = Gate()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.gate(x) * 2


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.sum() > 0:
            return x
        return -x


def test_untraceable_model_names_the_module_the_line_and_the_fix() -> None:
    with pytest.raises(TraceError) as info:
        compile_pipeline(Untraceable(), X, ["cpu"])
    message = str(info.value)
    assert "in module: gate" in message
    assert "test_errors.py" in message and "if x.sum() > 0:" in message
    assert "leaf_modules=['gate']" in message
    pipe = compile_pipeline(Untraceable(), X, ["cpu"], leaf_modules=["gate"])
    torch.testing.assert_close(pipe(X), Untraceable()(X))


def test_empty_batch() -> None:
    with pytest.raises(ValueError, match="the example batch is empty"):
        compile_pipeline(FanOut(), torch.randn(0, 6), ["cpu"])
    pipe = compile_pipeline(FanOut(), X, ["cpu"])
    with pytest.raises(ValueError, match="the input batch is empty"):
        pipe(torch.randn(0, 6))


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
    with pytest.raises(ValueError, match=r"require grad but are not parameters: scale\.\n(.|\n)*How to fix: register each as an nn\.Parameter"):
        compile_pipeline(LooseScale(), X, ["cpu", "cpu"], chunks=2)


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
    gradients. (One the model returns is made again from its fields: tests/test_outputs.py.)"""
    with pytest.raises(ValueError, match=r"hold tensors pytree cannot see: first \(Boxed\)(.|\n)*How to fix: register the type"):
        compile_pipeline(PassesADataclass(), X, ["cpu", "cpu"], chunks=2, leaf_modules=[Boxes], split_points=["second"])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = Block(), Block(), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c(self.b(self.a(x)))


def test_a_backward_hook_on_a_module_traced_through_is_refused_and_a_whole_module_keeps_it() -> None:
    model = Blocks()
    calls: list[int] = []

    def hook(module: nn.Module, grad_in: object, grad_out: object) -> None:
        calls.append(1)

    model.b.register_full_backward_hook(hook)
    with pytest.raises(ValueError, match=r"would never fire: b\.\nHow to fix: (.|\n)*leaf_modules=\['b'\]"):
        compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2, leaf_modules=["b"])
    pipe(X).sum().backward()
    assert len(calls) == 2  # once per micro-batch


@pytest.mark.parametrize("register", [nn.modules.module.register_module_full_backward_hook, nn.modules.module.register_module_full_backward_pre_hook])
def test_a_global_backward_hook_is_refused_and_the_model_left_as_it_was(register: Callable[..., Any]) -> None:
    """Before, it never fired for the modules the trace went through: a hook doubling the input
    gradients of the blocks left their weights' gradients 0.18 off, silently."""
    model = Blocks()
    state = copy.deepcopy(model.state_dict())
    handle = register(lambda module, *grads: None)
    try:
        with pytest.raises(ValueError, match=r"(?s)global backward hooks are registered.*How to fix: remove them"):
            compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    finally:
        handle.remove()
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name])
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)  # once removed, it compiles
    pipe(X).sum().backward()


def test_a_global_forward_hook_that_changes_outputs_is_refused_naming_it() -> None:
    """Before, the advice was about data-dependent control flow."""
    def shift(module: nn.Module, args: Any, out: Any) -> Any:
        return out + 0.01 if isinstance(out, torch.Tensor) else None

    handle = nn.modules.module.register_module_forward_hook(shift)
    try:
        with pytest.raises(TraceError, match=r"(?s)How to fix: global forward hooks are registered.*register it on the modules it is meant for"):
            compile_pipeline(Blocks(), X, ["cpu", "cpu"], chunks=2)
    finally:
        handle.remove()


class _PackedRNN(nn.Module):
    """Packing, an LSTM and unpacking: called whole, per micro-batch."""

    def __init__(self) -> None:
        super().__init__()
        self.rnn = nn.LSTM(6, 7, batch_first=True)

    def forward(self, h: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        packed = nn.utils.rnn.pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
        out, _ = self.rnn(packed)
        return nn.utils.rnn.pad_packed_sequence(out, batch_first=True, total_length=h.shape[1])[0]


class Packs(nn.Module):
    def __init__(self, inline: bool) -> None:
        super().__init__()
        self.emb, self.seq, self.head = nn.Linear(5, 6), _PackedRNN(), nn.Linear(7, 3)
        self.inline = inline

    def forward(self, x: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
        h = self.emb(x)
        if self.inline:
            packed = nn.utils.rnn.pack_padded_sequence(h, lengths, batch_first=True, enforce_sorted=False)
            h = nn.utils.rnn.pad_packed_sequence(self.seq.rnn(packed)[0], batch_first=True, total_length=x.shape[1])[0]
        else:
            h = self.seq(h, lengths)
        return self.head(h)


@pytest.mark.filterwarnings("ignore:The tensor attributes")
def test_packed_sequences_in_the_root_are_refused_naming_the_fix_and_in_a_submodule_it_is_called_whole() -> None:
    """Before, the advice was to rewrite control flow with torch.where, which does not apply;
    and packing in a submodule went to torch.export, which failed on it too."""
    x, lengths = torch.randn(8, 5, 5, dtype=torch.float64), torch.tensor([5, 3, 2, 5, 1, 4, 4, 2])
    with pytest.raises(TraceError, match=r"(?s)a packed sequence \(pack_padded_sequence\) cannot be traced: put the packing"):
        compile_pipeline(Packs(inline=True).double(), (x, lengths), ["cpu", "cpu"], chunks=2)
    model, reference = twin(Packs(inline=False))
    pipe = compile_pipeline(model, (x, lengths), ["cpu", "cpu"], chunks=2)
    assert any(n.op == "call_module" and n.target == "seq" for m in pipe.program().modules for n in m.graph.nodes), "called whole"
    assert_call_and_grads_equal(pipe, reference, x, lengths)


class Flagged(nn.Module):
    """Keyword arguments torch.fx cannot name: torch.export captures the model, and fixes
    `scale` to the example's value and the branch on the feature size to the example's."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, **options: float) -> torch.Tensor:
        h = self.second(torch.tanh(self.first(x))) * options.get("scale", 1.0)
        return h * 2 if x.shape[1] > 3 else h


def test_an_exported_pipeline_refuses_a_call_unlike_the_example() -> None:
    model = Flagged().double()
    x = torch.randn(4, 6, dtype=torch.float64)
    with pytest.warns(UserWarning, match="used torch.export"):
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, example_kwargs={"scale": 1.0})
    torch.testing.assert_close(pipe(x, scale=1.0), model(x, scale=1.0), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"torch.export made the graph for calls like the example(.|\n)*How to fix"):
        pipe(x, scale=3.0)
    with pytest.raises(ValueError, match=r"this call differs: Guard failed: scale == 1.0\.\n(.|\n)*  - x: shape \(4, 6\)"):
        pipe(x, scale=3.0)  # export's guard, naming the forward's arguments rather than its leaves


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
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        return self.b(self.a(x)), x.shape[0]


def test_an_output_that_is_no_tensor_and_differs_between_micro_batches_is_refused() -> None:
    pipe = compile_pipeline(CountsItsBatch(), X, ["cpu", "cpu"], chunks=2)
    for x in (torch.randn(5, 6), X):  # even halves give equal sizes: compiling saw the size differ from the whole batch's
        with pytest.raises(ValueError, match=r"(?s)returns output\[1\], a value made from the whole batch \(.*its size.*How to fix"):
            pipe(x)


def test_a_forward_hook_added_after_compiling_to_a_module_traced_through_is_refused() -> None:
    """The graph holds what a traced-through module's hooks did at compile time; a built-in
    layer is called whole, and its hooks run on every call."""
    model = Blocks()
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    calls: list[int] = []
    model.c.register_forward_hook(lambda module, args, out: calls.append(1))
    pipe(X)
    assert len(calls) == 2  # once per micro-batch
    handle = model.b.register_forward_hook(lambda module, args, out: out * 2)
    with pytest.raises(RuntimeError, match=r"hooks were added to, removed from or swapped on b since compiling(.|\n)*leaf_modules=\['b'\]"):
        pipe(X)
    handle.remove()
    torch.testing.assert_close(pipe(X), model(X), rtol=0, atol=1e-6)


def test_a_hook_swapped_backward_or_global_on_a_module_traced_through_is_refused() -> None:
    """A hook swapped for another (as many as before), a backward hook, and a global module hook:
    each would leave the graph computing what the model did at compile time."""
    model = Blocks()
    handle = model.b.register_forward_hook(lambda module, args, out: out * 2)
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    torch.testing.assert_close(pipe(X), model(X), rtol=0, atol=1e-6)
    handle.remove()
    handle = model.b.register_forward_hook(lambda module, args, out: out * 5)
    with pytest.raises(RuntimeError, match=r"swapped on b since compiling"):
        pipe(X)
    handle.remove()
    model = Blocks()
    pipe = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    def tripled(module: nn.Module, grad_out: Any) -> Any:
        return (grad_out[0] * 3,)

    handle = model.b.register_full_backward_pre_hook(tripled)
    with pytest.raises(RuntimeError, match=r"swapped on b since compiling"):
        pipe(X)
    handle.remove()
    handle = torch.nn.modules.module.register_module_forward_hook(lambda module, args, out: None)
    try:
        with pytest.raises(RuntimeError, match=r"global module hooks .* were added or removed since compiling"):
            pipe(X)
    finally:
        handle.remove()
    torch.testing.assert_close(pipe(X), model(X), rtol=0, atol=1e-6)


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
    for args in [(x, mask), (x,), (x, None), (x, mask)]:
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
    assert len(pipe._variants) == 1, "one pipeline for the calls without a mask, made once"


def test_the_kinds_of_call_kept_are_bounded_and_it_says_so(monkeypatch: pytest.MonkeyPatch) -> None:
    import fxpipe.pipeline

    monkeypatch.setattr(fxpipe.pipeline, "VARIANTS", 1)
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
        with pytest.raises(RuntimeError, match=rf"(?s)cannot compute what the plain model would.*parameters or buffers the stages read carry tangents of forward-mode AD \({name}; .*How to fix: apply such transforms to the plain model"):
            functional_call(pipe, dual, (x,))
        torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)  # its own, without tangents, run
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)


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


def test_a_batched_input_given_another_size_than_the_batch_is_refused_not_kept_whole() -> None:
    """Kept whole, a w of 4 rows would broadcast against each micro-batch of 4: numbers, where
    the plain model refuses the sizes."""
    model, reference = twin(Weighted())
    x, w = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, (x, w), ["cpu", "cpu"], chunks=2)
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


COUNTER = torch.zeros(2)  # a global a forward writes in place


class WritesOutside(nn.Module):
    """Writes a tensor it does not own: a tensor attribute that is not a buffer (`attribute`),
    a view of one (`view`), or a global (`global`); `made` writes only tensors it makes."""

    def __init__(self, target: str) -> None:
        super().__init__()
        self.target = target
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6)
        self.count = torch.zeros(2)  # not registered: a plain attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x)
        if self.target == "attribute":
            self.count.add_(1)
        elif self.target == "view":
            self.count[1:].add_(1)
        elif self.target == "global":
            COUNTER.add_(1)
        else:
            torch.zeros(2).add_(1)
        return self.second(h) * self.count.sum()


@pytest.mark.parametrize(
    "target, name", [("attribute", "the tensor attribute count"), ("view", "the tensor attribute count"), ("global", "the global tensor COUNTER")]
)
def test_a_write_to_a_tensor_the_model_does_not_own_is_refused_and_put_back(target: str, name: str) -> None:
    # Traced, the write would run once while tracing and never on a call: silently otherwise.
    model = WritesOutside(target)
    with pytest.raises(TraceError, match="register each as a buffer") as refused:
        compile_pipeline(model, X, ["cpu"] * 2, chunks=2)
    assert name in str(refused.value)
    assert model.count.eq(0).all() and COUNTER.eq(0).all()


def test_a_forward_writing_only_tensors_it_makes_compiles() -> None:
    model = WritesOutside("made")
    model.count += 1
    pipe = compile_pipeline(model, X, ["cpu"] * 2, chunks=2)
    torch.testing.assert_close(pipe(X), model(X), rtol=0, atol=0)


class Counts(nn.Module):
    """Counts its calls in a buffer, in place (`+=`) or by replacing it with a new tensor."""

    count: torch.Tensor

    def __init__(self, in_place: bool) -> None:
        super().__init__()
        self.in_place = in_place
        self.linear = nn.Linear(6, 6)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        if self.in_place:
            self.count += 1
        else:
            self.count = self.count + 1
        return self.linear(h) * self.count.clone()


def _two_steps_as_the_plain_model_on_the_halves(pipe: nn.Module, reference: nn.Module, x: torch.Tensor) -> None:
    for _ in range(2):
        out, expected = pipe(x), torch.cat([reference(half) for half in x.chunk(2)])
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
        out.sum().backward()
        expected.sum().backward()
    assert_grads_equal(pipe, reference)


@pytest.mark.parametrize("mode", ["always", "never"])
def test_a_buffer_counted_with_plus_equals_counts_as_in_the_plain_model(mode: str) -> None:
    # Before, the trace left an fx Proxy in the buffer, and compiling raised from inside fxpipe.
    model = nn.Sequential(nn.Linear(6, 6), Counts(in_place=True), nn.Linear(6, 6)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, checkpoint=mode)
    assert isinstance(model.get_buffer("1.count"), torch.Tensor) and int(model.get_buffer("1.count")) == 0
    _two_steps_as_the_plain_model_on_the_halves(pipe, reference, x)
    assert int(pipe.get_buffer("1.count")) == int(reference.get_buffer("1.count")) == 4


class _Stores(nn.Module):
    def forward(self, h: torch.Tensor) -> torch.Tensor:
        self.last = h.detach()  # called whole, which only torch.fx can do
        return h


class CountsAtTheRoot(Counts):
    def __init__(self) -> None:
        super().__init__(in_place=True)
        self.first, self.stores = nn.Linear(6, 6), _Stores()

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return super().forward(self.stores(torch.tanh(self.first(h))))


@pytest.mark.parametrize("mode", ["always", "never"])
def test_a_buffer_counted_with_plus_equals_at_the_root_is_written_where_torch_fx_traces_it(mode: str) -> None:
    """torch.fx adds out of place and assigns the sum: before, that counted as an assignment on
    the root, and a model that needs torch.fx for something else was refused."""
    model, reference = twin(CountsAtTheRoot())
    x = torch.randn(8, 6, dtype=torch.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no fallback to torch.export
        pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, checkpoint=mode)
    assert any(".copy_(" in stage.code for stage in pipe.stages)
    _two_steps_as_the_plain_model_on_the_halves(pipe, reference, x)
    assert int(model.count) == int(reference.count) == 4
    torch.testing.assert_close(model.stores.last, reference.stores.last, rtol=0, atol=0)


class UpdatesTheAverage(nn.Module):
    """An average in a buffer, read before and after its update through an alias (`twice`: a
    second update, or a write in place into the first's result)."""

    average: torch.Tensor

    def __init__(self, second: str = "") -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.register_buffer("average", torch.ones(6))
        self.second = second

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        before, alias = h + self.average, self.average  # sums: no backward saves the buffer
        self.average *= 0.5
        if self.second == "again":
            self.average += 1
        elif self.second == "in place":
            self.average.add_(1)
        return self.b(before * (h + alias))


@pytest.mark.parametrize("second", ["", "again", "in place"])
def test_an_update_of_a_buffer_read_through_an_alias_is_the_plain_models(second: str) -> None:
    """One `*=` is written in place where torch.fx traced it; two updates, or a write into the
    first's result, go to torch.export (before, the one write landed in the wrong place)."""
    model, reference = twin(UpdatesTheAverage(second))
    x = torch.randn(8, 6, dtype=torch.float64)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
    assert any("used torch.export" in str(w.message) for w in caught) == bool(second)
    _two_steps_as_the_plain_model_on_the_halves(pipe, reference, x)
    torch.testing.assert_close(model.average, reference.average, rtol=0, atol=0)


def test_a_buffer_replaced_by_a_new_tensor_is_refused_and_put_back() -> None:
    model = nn.Sequential(nn.Linear(6, 6), Counts(in_place=False), nn.Linear(6, 6))
    count = model.get_buffer("1.count")
    with pytest.raises(TraceError, match=r"replaces the buffers 1.count with new tensors") as refused:
        compile_pipeline(model, X, ["cpu"] * 2, chunks=2)
    assert "write each in place" in str(refused.value)
    assert model.get_buffer("1.count") is count and int(count) == 0


class BuildsOnFirstUse(nn.Module):
    """A bias table made at the first call (x-transformers' ALiBi): a buffer, None until then."""

    table: Optional[torch.Tensor]

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.register_buffer("table", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.table is None:
            self.table = torch.linspace(0, 1, x.shape[-1], dtype=x.dtype)
        return self.b(torch.tanh(self.a(x)) + self.table)


def test_a_buffer_built_on_first_use_is_refused_with_the_warm_up_as_the_fix() -> None:
    model = BuildsOnFirstUse().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    with pytest.raises(TraceError, match=r"(?s)builds the buffers table anew.*How to fix: call the model once before compiling"):
        compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
    assert model.table is None
    model(x)  # the fix
    reference = copy.deepcopy(model)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2)
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)


class HookedWhenTraining(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        if h.requires_grad:  # fx cannot trace the branch; torch.export would drop the hook
            h.register_hook(lambda g: g * 2)
        return self.b(h)


def test_a_hook_forward_registers_on_a_tensor_is_not_dropped_by_torch_export() -> None:
    # Before, torch.export captured the model without the hook: a's gradients were half the plain model's.
    with pytest.raises(TraceError, match=r"drops the hooks forward registers on tensors"):
        compile_pipeline(HookedWhenTraining(), X, ["cpu"] * 2, chunks=2)
    model = nn.Sequential(HookedWhenTraining(), nn.Linear(6, 6)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu"] * 2, chunks=2, leaf_modules=[HookedWhenTraining])
    pipe(x).sum().backward()
    reference(x).sum().backward()
    assert_grads_equal(pipe, reference)


class HookedAlways(HookedWhenTraining):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        h.register_hook(lambda g: g * 2)  # raises under torch.no_grad()
        return self.b(h)


def test_a_forward_that_runs_only_with_gradients_on_is_named_as_such() -> None:
    # Before, the error said the model does not run on the example, which it does.
    with pytest.raises(ValueError, match=r"runs on the example only with gradients on") as refused:
        compile_pipeline(HookedAlways(), X, ["cpu"] * 2, chunks=2)
    assert "if h.requires_grad:" in str(refused.value)


class BranchesOnValues(nn.Module):
    """A Python branch on a tensor's value, in a forward that takes **kwargs (torch.export)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, **kwargs: Any) -> torch.Tensor:
        h = self.a(x)
        if (h > 0).sum().item() > 3:
            h = h * 2
        return self.b(h)


def test_a_branch_torch_export_cannot_take_is_named_by_its_line_with_a_fix_that_applies() -> None:
    # Before, only export's first line was kept, and the fix named leaf_modules, which needs torch.fx.
    with pytest.raises(TraceError) as refused:
        compile_pipeline(BranchesOnValues(), X, ["cpu"] * 2)
    text = str(refused.value)
    assert "test_errors.py:" in text and "(if (h > 0).sum().item() > 3:)" in text, text
    assert "name forward's arguments, so that torch.fx traces the model" in text, text


class _Pair:
    """A class of the model's own, unknown to pytree."""

    def __init__(self, a: torch.Tensor, b: torch.Tensor) -> None:
        self.a, self.b = a, b


class ReturnsPair(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> _Pair:
        h = self.a(x)
        return _Pair(h, self.b(h))


def test_an_output_of_a_class_pytree_does_not_know_is_refused_with_what_works() -> None:
    """Not the advice about control flow: what both front ends failed on is the class."""
    with pytest.raises(TraceError) as info:
        compile_pipeline(ReturnsPair(), X, ["cpu", "cpu"], chunks=2)
    message = str(info.value)
    assert message.count("How to fix: return (and pass between modules) tuples, lists or dicts of tensors") == 2, message
    assert "control flow" not in message


def _tensors_only(x: torch.Tensor) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"Tensor type unknown to the library: {type(x)}")
    return x * 2


class CallsALibrary(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = _tensors_only(self.a(x))
        return self.b(h) if bool(h.sum() > 0) else h  # and a branch on a value, which stops torch.export


def test_a_library_function_that_refuses_a_proxy_is_named_with_torch_fx_wrap_as_the_fix() -> None:
    with pytest.raises(TraceError) as refused:
        compile_pipeline(CallsALibrary(), X, ["cpu", "cpu"])
    fx_reason = str(refused.value).split("torch.export:")[0]
    assert "Tensor type unknown to the library" in fx_reason
    assert "register the function with torch.fx.wrap" in fx_reason and "control flow" not in fx_reason


class _WritesItsInput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x.mul_(2)
        return self.a(x)


def test_an_example_the_model_itself_fails_on_after_tracing_is_named_so() -> None:
    """An inference tensor written in place traces, and the graph then fails on it as the model
    does: before, the error was torch.fx's interpreter's, with no fix."""
    with torch.inference_mode():
        x = torch.randn(8, 6)
    with pytest.raises(ValueError, match=r"(?s)_WritesItsInput does not run on the example: RuntimeError: Inplace update to inference tensor.*How to fix"):
        compile_pipeline(_WritesItsInput(), x, ["cpu", "cpu"], chunks=2)


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


class _ReentrantDropout(nn.Module):
    """torch.utils.checkpoint (reentrant) around a block with dropout: it mixes no samples."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.block, self.b = nn.Linear(6, 6), nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.3)), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.utils.checkpoint.checkpoint(self.block, torch.tanh(self.a(x)), use_reentrant=True))


def test_a_reentrant_checkpoint_with_dropout_inside_is_not_taken_for_mixing_samples() -> None:
    """Before, it was refused as one that "mixes samples along the batch dim"."""
    torch.manual_seed(0)
    model = _ReentrantDropout().double()
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    pipe.eval()
    model.eval()
    torch.testing.assert_close(pipe(x), model(x), rtol=0, atol=1e-12)
