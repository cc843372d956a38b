"""What forward does that a graph would lose (hooks, writes outside the graph, buffers rebuilt or replaced): kept as the plain model does, or refused."""
from __future__ import annotations

import copy
import warnings
from typing import Any, Callable, Optional

import pytest
import torch
from torch import nn

from fxpipe import TraceError, compile_pipeline
from helpers import X, Blocks, assert_grads_equal, twin


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
    handle = register(lambda module, *grads: None)  # registered after compiling: refused alike
    try:
        with pytest.raises(RuntimeError, match=r"(?s)global backward hooks are registered.*How to fix: remove them"):
            pipe(X)
    finally:
        handle.remove()
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


class WritesOutsideInEval(nn.Module):
    """Writes the global COUNTER in eval mode alone, asking `self.training` (`flag`) or a
    submodule's flag, through a helper (`helper`)."""

    def __init__(self, asks: str) -> None:
        super().__init__()
        self.asks = asks
        self.first, self.drop = nn.Linear(6, 6), nn.Dropout(0.0)

    def evaluating(self) -> bool:
        return not (self.training if self.asks == "flag" else getattr(self.drop, "training"))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.evaluating():
            COUNTER.add_(1)
        return self.drop(self.first(x))


@pytest.mark.parametrize("asks", ["flag", "helper"])
def test_a_write_outside_in_eval_mode_alone_is_refused_and_put_back(asks: str) -> None:
    """Compiling runs the model eagerly in eval mode too where its code asks for a flag; the
    training run alone would not see this write."""
    with pytest.raises(TraceError, match="the global tensor COUNTER"):
        compile_pipeline(WritesOutsideInEval(asks), X, ["cpu"] * 2, chunks=2)
    assert COUNTER.eq(0).all()


class WritesThroughADropout(nn.Module):
    """Writes a tensor attribute through a dropout's output, which in eval mode is the tensor
    itself (rate above 0; at rate 0 it is the tensor in both modes, and refused either way)."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.drop = nn.Linear(6, 6), nn.Dropout(0.1)
        self.table = torch.ones(6)  # not registered: a plain attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.first(x) * self.drop(self.table).add_(0.5)


class _Flagged(nn.Module):
    """Keeps its own `training` flag, in a property subclasses inherit."""

    @property  # type: ignore[override]
    def training(self) -> bool:
        return bool(self.__dict__["_flag"])

    @training.setter
    def training(self, value: bool) -> None:
        self.__dict__["_flag"] = value


class CountsOutsideWithItsOwnFlag(_Flagged):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6)
        self.stats = torch.zeros(6)  # not registered: a plain attribute

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.first(x) if self.training else self.first(x).clone()
        self.stats.add_(h.detach().mean(0))
        return self.second(h)


@pytest.mark.parametrize("make, name", [(WritesThroughADropout, "table"), (CountsOutsideWithItsOwnFlag, "stats")])
def test_a_write_outside_is_refused_however_the_mode_is_asked(make: Callable[[], nn.Module], name: str) -> None:
    """Before, a dropout's read of its flag was taken for one that changes no effect (in eval
    mode it returns its input itself, which the model then wrote), and a class inheriting a
    `training` property of its own had its property hidden by the watch's (the eager run failed,
    and every effect went unseen)."""
    model = make()
    with pytest.raises(TraceError, match=f"the tensor attribute {name} of"):
        compile_pipeline(model, X, ["cpu"] * 2, chunks=2)
    assert getattr(model, name).eq(1 if name == "table" else 0).all()
    assert "training" not in vars(CountsOutsideWithItsOwnFlag) and isinstance(vars(_Flagged)["training"], property)


class FillsOnce(nn.Module):
    """Fills a cache on its first call, and asks no mode."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = nn.Linear(6, 6), nn.Linear(6, 6)
        self.seen: dict[str, int] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.seen.setdefault("calls", 1)
        return self.second(self.first(x))


@pytest.mark.parametrize(
    "make, modes",
    [
        (lambda: nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.0), nn.BatchNorm1d(6)), [True]),  # built-in layers' own flags
        (lambda: nn.Sequential(nn.Linear(6, 6), nn.Dropout(0.1), nn.Linear(6, 6)), [True, False]),  # in eval, its input itself
        (lambda: WritesOutsideInEval("flag"), [True, False]),  # its code asks a flag
        (FillsOnce, [True, False]),  # the first run changed what the second would start from
    ],
)
def test_the_eager_run_in_eval_mode_is_left_out_only_where_it_runs_the_same_code(
    make: Callable[[], nn.Module], modes: list[bool], monkeypatch: pytest.MonkeyPatch,
) -> None:
    from fxpipe.compiler import effects

    entered: list[bool] = []
    real = effects.in_mode

    def in_mode(model: nn.Module, training: bool) -> Any:
        entered.append(training)
        return real(model, training)

    monkeypatch.setattr(effects, "in_mode", in_mode)
    model = make()
    try:
        compile_pipeline(model, X, ["cpu"] * 2, chunks=2)
    except TraceError:
        pass  # the write outside: refused after the runs counted here
    assert entered[:2] == modes  # (after the two, FillsOnce's cache is checked in both modes)
    assert COUNTER.eq(0).all()


def test_the_flags_watch_is_taken_off_and_reads_and_writes_go_through() -> None:
    from fxpipe.tracing.flag_reads import flag_reads_counted

    model = WritesOutsideInEval("flag")
    with flag_reads_counted(model) as reads:
        model.drop(torch.ones(2))  # a built-in layer's read of its own flag: not counted
        assert reads.none
        model.eval()
        assert not model.training and not model.drop.training and reads.count == 2  # eval() reads none; these two do
    assert reads.count == 2 and "training" not in vars(WritesOutsideInEval) and "training" not in vars(nn.Dropout)
    model.train()
    assert model.training and model.drop.training


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
        warnings.filterwarnings("error", message="torch.fx could not trace")  # no fallback to torch.export
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
