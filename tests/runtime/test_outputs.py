"""Outputs come back as the model returns them: its own dataclasses, namedtuples and nested mixes,
with the plain model's values and gradients; outputs that cannot be put together are refused."""
from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import pytest
import torch
import torch.nn.functional as F
import torch.utils._pytree as pytree
from torch import nn

from helpers import Attends, ReturnsItsSize, assert_grads_equal
from fxpipe import compile_pipeline


@dataclasses.dataclass
class Output:
    sample: torch.Tensor
    hidden: Optional[torch.Tensor] = None
    steps: int = 0


@dataclasses.dataclass
class Nested:
    pair: tuple[torch.Tensor, torch.Tensor]
    inner: Output
    count: int = dataclasses.field(default=0, init=False)


class Pair(NamedTuple):
    first: torch.Tensor
    second: torch.Tensor


class Returns(nn.Module):
    """Returns one of several output structures, built of its two layers' values."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.tanh(self.a(x))
        y = self.b(h)
        if self.kind == "dataclass":
            return Output(y, h, steps=3)
        if self.kind == "dataclass, a field None":
            return Output(y)
        if self.kind == "nested":
            return {"out": Nested((y, h), Output(y * 2, None)), "pair": Pair(h, y)}
        return [Output(y, h), collections.OrderedDict(pair=Pair(y, h))]


def _leaves(value: Any) -> list[torch.Tensor]:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [t for f in dataclasses.fields(value) for t in _leaves(getattr(value, f.name))]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _leaves(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _leaves(v)]
    return [value] if isinstance(value, torch.Tensor) else []


def _squares(value: Any) -> torch.Tensor:
    return torch.stack([t.square().sum() for t in _leaves(value)]).sum()


def _same_structure(got: Any, expected: Any) -> None:
    assert type(got) is type(expected), (type(got), type(expected))
    if dataclasses.is_dataclass(expected):
        for f in dataclasses.fields(expected):
            _same_structure(getattr(got, f.name), getattr(expected, f.name))
    elif isinstance(expected, dict):
        assert list(got) == list(expected)
        for key in expected:
            _same_structure(got[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected)
        for a, b in zip(got, expected):
            _same_structure(a, b)
    elif isinstance(expected, torch.Tensor):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    else:
        assert got == expected


@pytest.mark.parametrize("kind", ["dataclass", "dataclass, a field None", "nested", "mixed"])
def test_the_models_own_output_types_come_back_with_its_values_and_gradients(kind: str) -> None:
    """Before, a dataclass output was refused ("values that hold tensors pytree cannot see")."""
    torch.manual_seed(0)
    model = Returns(kind).double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4, dtype=torch.float64)
    before = _registered()
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, split_points=["b"])
    out, expected = pipe(x), reference(x)
    _same_structure(out, expected)
    _squares(out).backward()
    _squares(expected).backward()
    assert_grads_equal(pipe, reference, tol=1e-12)
    assert _registered() == before, "compiling registered a type of the model's with pytree"


def _registered() -> dict[type, Any]:
    """The types pytree knows besides torch's own (whose modules, imported lazily, register theirs:
    the first compile of a process imports torch.distributed.tensor), with their key functions."""
    return {key: value.flatten_with_keys_fn for key, value in pytree.SUPPORTED_NODES.items() if not key.__module__.startswith("torch.")}


def test_train_step_returns_the_models_own_output_type() -> None:
    torch.manual_seed(0)
    model = Returns("dataclass").double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 4, dtype=torch.float64), torch.randn(8, 4, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4, split_points=["b"], schedule="1f1b")
    loss, out = pipe.train_step(x, target=y, loss_fn=lambda o, t: F.mse_loss(o.sample, t), return_outputs=True)
    expected = reference(x)
    F.mse_loss(expected.sample, y).backward()
    _same_structure(out, expected)
    torch.testing.assert_close(loss, F.mse_loss(expected.sample, y).detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


class TrimsPadding(nn.Module):
    """Cuts its output to the longest sequence in the batch, as a collator trimming padding does."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        longest = mask.sum(1).max()
        return self.b(torch.tanh(self.a(x)))[:, :longest]


def test_outputs_of_other_sizes_per_micro_batch_are_refused_naming_the_dims() -> None:
    """Before, the gather failed with torch.cat's own size error."""
    x = torch.randn(4, 6, 4, dtype=torch.float64)
    mask = torch.ones(4, 6, dtype=torch.long)
    pipe = compile_pipeline(TrimsPadding().double(), (x, mask), ["cpu", "cpu"], chunks=2, split_points=["b"])
    torch.testing.assert_close(pipe(x, mask).shape, torch.Size([4, 6, 4]))
    mask[2:, 3:] = 0  # the second micro-batch is shorter
    with pytest.raises(ValueError, match=r"(?s)differ in dim 1 besides the batch's \(dim 0\).*shapes \[\(2, 6, 4\), \(2, 3, 4\)\].*pad to a fixed length"):
        pipe(x, mask)


def test_outputs_trimmed_on_the_example_s_halves_are_put_together_where_the_micro_batches_agree() -> None:
    """An example whose halves trim to other lengths: before, every call was refused as "a value
    made from the whole batch", advising per-sample values, which the output already is."""
    model = TrimsPadding().double()
    x, mask = torch.randn(4, 6, 4, dtype=torch.float64), torch.ones(4, 6, dtype=torch.long)
    mask[2:, 3:] = 0
    pipe = compile_pipeline(copy.deepcopy(model), (x, mask), ["cpu", "cpu"], chunks=2, split_points=["b"])
    with pytest.raises(ValueError, match=r"(?s)differ in dim 1 besides the batch's \(dim 0\).*pad to a fixed length"):
        pipe(x, mask)
    mask[:, 3:] = 0  # every micro-batch as long as the batch: the plain model's output, put together
    out, expected = pipe(x, mask), model(x, mask)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    out.square().sum().backward()
    expected.square().sum().backward()
    assert_grads_equal(pipe, model)


@dataclasses.dataclass
class RegisteredWithoutKeys:
    """As a library registers its output type with pytree (diffusers' outputs): no keys."""

    sample: torch.Tensor


@dataclasses.dataclass
class DropsNone(collections.OrderedDict):  # type: ignore[type-arg]
    """An output record that is a dict of the fields given that are not None (as Hugging Face's
    and diffusers' are), registered with pytree as that dict, without keys."""

    sample: torch.Tensor
    extra: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) is not None:
                self[field.name] = getattr(self, field.name)


class NeedsExport(nn.Module):
    """Branches on a size, which torch.fx cannot trace: torch.export takes over."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.tanh(self.a(x))
        if x.shape[1] == 4:
            h = h * 2
        y = self.b(h)
        if self.kind == "drops None":
            return DropsNone(y)
        return Output(y, h) if self.kind == "own" else RegisteredWithoutKeys(y)


@pytest.fixture
def registered_without_keys() -> Any:
    pytree.register_pytree_node(
        RegisteredWithoutKeys, lambda o: ([o.sample], None), lambda values, _: RegisteredWithoutKeys(list(values)[0])
    )
    pytree.register_pytree_node(
        DropsNone, lambda o: (list(o.values()), list(o)), lambda values, keys: DropsNone(**dict(zip(keys, values))),
        serialized_type_name=f"{__name__}.DropsNone",
    )
    yield
    pytree._deregister_pytree_node(RegisteredWithoutKeys)
    pytree._deregister_pytree_node(DropsNone)


@pytest.mark.parametrize("kind", ["own", "registered without keys", "drops None"])
def test_dataclass_outputs_through_torch_export(kind: str, registered_without_keys: Any) -> None:
    """Before, torch.export refused the first two ("not a known type"; "Did not find a
    flatten_with_keys_fn"), and the third as a graph that "computes otherwise" (its None field
    returned as a key the model's record does not hold: diffusers' DecoderOutput)."""
    torch.manual_seed(0)
    model = NeedsExport(kind).double()
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4, dtype=torch.float64)
    before = _registered()
    with pytest.warns(UserWarning, match="torch.export"):
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=4)
    out, expected = pipe(x), reference(x)
    _same_structure(out, expected)
    _squares(out).backward()
    _squares(expected).backward()
    assert_grads_equal(pipe, reference, tol=1e-12)
    assert _registered() == before


class Aliased(nn.Module):
    """Returns its hidden state and a view of it (`how`), which share memory in the plain model."""

    def __init__(self, how: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.how = how

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.b(torch.tanh(self.a(x)))
        views = {"columns": lambda: h[:, 1:3], "transposed": h.t, "flat": lambda: h.view(-1), "blocks": lambda: h.view(-1, 2, 2),
                 "detached": h.detach}  # fmt: skip
        return h, views[self.how]()


@pytest.mark.parametrize("how", ["columns", "transposed", "flat", "blocks"])
@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("written", ["base", "view"])
def test_an_output_that_is_a_view_of_another_stays_one_through_writes_in_place(how: str, chunks: int, written: str) -> None:
    """Before, the two came back unrelated: a write in place to one did not reach the other's
    value (chunks > 1) nor, with one micro-batch, its gradient (autograd did not know it was a
    view): the bias's gradient was half the plain model's."""
    torch.manual_seed(0)
    model, x = Aliased(how).double(), torch.randn(6, 4, dtype=torch.float64)
    plain = copy.deepcopy(model)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=chunks, checkpoint="always" if chunks == 1 else "except_last")
    results = []
    for net in (pipe, plain):
        h, view = net(x)
        (h if written == "base" else view).mul_(2)
        (view.square().sum() + h.sum()).backward()
        results.append((h.detach(), view.detach()))
    for got, expected in zip(*results):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert_grads_equal(pipe, plain, tol=1e-12)
    pipe.close()


Regularised = NamedTuple("Regularised", [("logits", torch.Tensor), ("reg", torch.Tensor)])


class NamedWithAPenalty(nn.Module):
    """Returns a namedtuple whose second field is made from parameters alone (an L2 term)."""

    def __init__(self, by_keyword: bool) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.by_keyword = by_keyword

    def forward(self, x: torch.Tensor) -> Regularised:
        logits, reg = self.b(torch.tanh(self.a(x))), self.a.weight.pow(2).sum()
        return Regularised(reg=reg, logits=logits) if self.by_keyword else Regularised(logits, reg)


@pytest.mark.parametrize("by_keyword", [False, True])
def test_a_namedtuple_field_made_from_parameters_alone_is_returned_once(by_keyword: bool) -> None:
    """Before, torch.fx's one node for the namedtuple made its parameter field depend on the batch
    as its other field does: refused as "made from the whole batch", where a tuple ran."""
    torch.manual_seed(0)
    model = NamedWithAPenalty(by_keyword).double()
    reference = copy.deepcopy(model)
    x, y = torch.randn(8, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2, schedule="1f1b")
    out, expected = pipe(x), reference(x)
    assert type(out) is Regularised
    torch.testing.assert_close(tuple(out), tuple(expected), rtol=0, atol=1e-12)
    loss_fn = lambda o, t: F.mse_loss(o.logits, t) + 1e-3 * o.reg  # noqa: E731
    loss = pipe.train_step(x, target=y, loss_fn=loss_fn)
    expected_loss = loss_fn(reference(x), y)
    expected_loss.backward()
    torch.testing.assert_close(loss, expected_loss.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


@pytest.mark.parametrize("how", ["columns", "detached"])
@pytest.mark.parametrize("chunks", [1, 4])
def test_a_loss_on_an_output_and_a_view_or_detached_copy_of_it_trains_as_the_plain_model(how: str, chunks: int) -> None:
    """Before, `h.detach()` came back a view of h that required grad (5.8 times the plain
    gradient through a stop-gradient term); and train_step's check of the loss's gradient
    refused a loss of h and h[:, 1:3] (the gathered view took its gradient through h)."""
    torch.manual_seed(0)
    model, x = Aliased(how).double(), torch.randn(8, 4, dtype=torch.float64)
    plain = copy.deepcopy(model)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=chunks)
    y = torch.randn(8, 4, dtype=torch.float64)
    loss_fn = lambda out, t: F.mse_loss(out[0], t) + 3 * out[1].square().mean()  # noqa: E731
    out = pipe(x)
    assert out[1].requires_grad == plain(x)[1].requires_grad
    loss_fn(out, y).backward()
    expected = loss_fn(plain(x), y)
    expected.backward()
    assert_grads_equal(pipe, plain, tol=1e-12)
    pipe.zero_grad()
    plain.zero_grad()
    loss = pipe.train_step(x, target=y, loss_fn=loss_fn)
    loss_fn(plain(x), y).backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, plain, tol=1e-12)


@pytest.mark.parametrize("mode", ["eval", "no_grad", "autocast", "two forwards"])
def test_an_output_that_is_a_view_of_another_stays_one_in_every_mode(mode: str) -> None:
    """The view of the write-in-place test above, in the other modes a user calls in."""
    torch.manual_seed(0)
    model, x = Aliased("columns").double(), torch.randn(6, 4, dtype=torch.float64)
    plain = copy.deepcopy(model)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    if mode == "eval":
        pipe.eval(), plain.eval()
    results = []
    for net in (pipe, plain):
        with torch.no_grad() if mode == "no_grad" else torch.autocast("cpu", dtype=torch.bfloat16) if mode == "autocast" else contextlib.nullcontext():
            h, view = net(x)
            h.mul_(2)
        if mode == "two forwards":
            h2, view2 = net(2 * x)
            h2.mul_(3)
            (view.square().sum() + view2.sum()).backward()
        elif mode == "eval":
            view.square().sum().backward()
        results.append(view.detach().clone())
    torch.testing.assert_close(results[0], results[1], rtol=0, atol=1e-12)
    if mode in ("eval", "two forwards"):
        assert_grads_equal(pipe, plain, tol=1e-12)
    pipe.close()


def test_an_output_that_was_none_on_the_example_carries_its_gradient_when_a_call_returns_it() -> None:
    """Before, the weights came back without a gradient (the example had none to say what they
    are made of): a loss on them changed no parameter's gradient (0.09 off), with no error."""
    torch.manual_seed(0)
    reference = Attends().double()
    model = copy.deepcopy(reference)
    x = torch.randn(6, 5, 8, dtype=torch.float64)
    pipe = compile_pipeline(model, (x, False), ["cpu", "cpu"], chunks=2, split_points=["attention"])
    (out, weights), (expected, expected_weights) = pipe(x, True), reference(x, True)
    assert weights is not None and weights.requires_grad
    torch.testing.assert_close(weights, expected_weights, rtol=0, atol=1e-12)
    (out.square().mean() + weights.square().sum()).backward()
    (expected.square().mean() + expected_weights.square().sum()).backward()
    assert_grads_equal(pipe, reference, tol=1e-12)
    got = torch.autograd.grad(pipe(x, True)[1].square().sum(), model.a.weight)[0]
    torch.testing.assert_close(got, torch.autograd.grad(reference(x, True)[1].square().sum(), reference.a.weight)[0], rtol=0, atol=1e-12)


@pytest.mark.parametrize("chunks", [1, 2])
def test_a_size_returned_comes_back_as_a_size(chunks: int) -> None:
    """Before, it came back a tuple (pytree takes a torch.Size apart into one): `.numel()` failed."""
    model, x = ReturnsItsSize(), torch.randn(6, 4, 8)
    out, size = compile_pipeline(copy.deepcopy(model), x, ["cpu", "cpu"], chunks=chunks)(x)
    assert type(size) is torch.Size and size == model(x)[1] and size.numel() == 32


class SparseGraph(nn.Module):
    """A GCN's layers over a sparse adjacency it holds as a buffer; with `sparse_out`, a sparse output too."""

    def __init__(self, layout: torch.layout, sparse_out: bool = False) -> None:
        super().__init__()
        adjacency = (torch.rand(8, 8, generator=torch.Generator().manual_seed(0)) < 0.3).double()
        self.register_buffer("adj", adjacency.to_sparse() if layout == torch.sparse_coo else adjacency.to_sparse_csr())
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.sparse_out = sparse_out

    def forward(self, x: torch.Tensor) -> Any:
        h = torch.relu(torch.sparse.mm(self.adj, self.a(x)))
        out = torch.sparse.mm(self.adj, self.b(h))
        return (out, (h * (h > 0.3)).to_sparse()) if self.sparse_out else out


def _seeded(make: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return make().double()


@pytest.mark.filterwarnings("ignore:Sparse CSR tensor support is in beta")
@pytest.mark.parametrize("layout", [torch.sparse_coo, torch.sparse_csr], ids=["coo", "csr"])
@pytest.mark.parametrize("checkpoint", ["never", "always"])
def test_a_sparse_buffer_and_a_sparse_output_compile_with_one_micro_batch(layout: torch.layout, checkpoint: str) -> None:
    """Before, compiling failed in the graph's check (torch has no sparse isclose)."""
    x = torch.randn(8, 6, dtype=torch.float64)
    for sparse_out in (False, True):
        model, reference = (_seeded(lambda: SparseGraph(layout, sparse_out)) for _ in range(2))  # (torch cannot deepcopy a CSR tensor)
        pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=1, checkpoint=checkpoint)
        got, expected = pipe(x), reference(x)
        if sparse_out:
            assert got[1].layout == expected[1].layout == torch.sparse_coo
            torch.testing.assert_close(got[1].to_dense(), expected[1].to_dense(), rtol=0, atol=0)
            got, expected = got[0], expected[0]
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
        got.pow(2).sum().backward()
        expected.pow(2).sum().backward()
        assert_grads_equal(pipe, reference)


def test_a_sparse_output_with_micro_batches_is_refused_with_the_fix() -> None:
    class SparseOut(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(6, 6)

        def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            h = torch.relu(self.a(x))
            return h, (h * (h > 0.3)).to_sparse()

    with pytest.raises(ValueError, match=r"(?s)returns sparse tensors.*How to fix: return it dense \(.to_dense\(\)\), or use chunks=1"):
        compile_pipeline(SparseOut(), torch.randn(8, 6), ["cpu", "cpu"], chunks=2)


class ReturnsAConstantLikeItsActivation(nn.Module):
    """An auxiliary value made "like" an activation (a zero aux loss where routing is off, say)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)
        self.kind = kind

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        h = self.b(torch.relu(self.a(x)))
        made = {"new_zeros": lambda: h.new_zeros(()), "new_ones": lambda: h.new_ones(4), "zeros_like": lambda: torch.zeros_like(h[0])}
        return h, made[self.kind]()


@pytest.mark.parametrize("kind", ["new_zeros", "new_ones", "zeros_like"])
def test_a_constant_made_like_an_activation_is_returned_once(kind: str) -> None:
    """Before, it was refused as made from the whole batch: its node reads the activation, for
    its dtype, device or shape alone."""
    model, reference = (_seeded(lambda: ReturnsAConstantLikeItsActivation(kind)) for _ in range(2))
    x = torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(model, x, ["cpu", "cpu"], chunks=2)
    (out, aux), (expected, expected_aux) = pipe(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(aux, expected_aux, rtol=0, atol=0)
    assert not aux.requires_grad and not expected_aux.requires_grad
    loss, (_, stepped) = pipe.train_step(x, target=x, loss_fn=lambda o, t: F.mse_loss(o[0], t), return_outputs=True)
    torch.testing.assert_close(stepped, expected_aux, rtol=0, atol=0)
    torch.testing.assert_close(loss, F.mse_loss(expected, x), rtol=0, atol=1e-12)
