"""Bad arguments to compile_pipeline: one ValueError, every problem with its fix, before the model runs."""
from __future__ import annotations

import copy
import inspect
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxpipe import PartitionError, compile_pipeline
from fxpipe.compiler.binding import OPTIONS
from helpers import FanOut, assert_grads_equal

X = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))  # fixed whatever was imported first


class NeverRun(nn.Module):
    """Arguments are checked before the model is traced or run."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise AssertionError("the model ran before its arguments were checked")


def _message(**kwargs: Any) -> str:
    kwargs.setdefault("devices", ["cpu"])
    with pytest.raises(ValueError) as info:
        compile_pipeline(NeverRun(), X, **kwargs)
    return str(info.value)


@pytest.mark.parametrize("devices", ["cpu", torch.device("cpu")])
def test_one_device_instead_of_a_list(devices: Any) -> None:
    message = _message(devices=devices)
    assert "devices must be a list with one device per stage, e.g. devices=['cpu']" in message
    assert "'c' is not a device" not in message


def test_a_device_that_is_not_one() -> None:
    assert "'gpu0' is not a device: write one like 'cpu' or 'cuda:0'" in _message(devices=["cpu", "gpu0"])


@pytest.mark.skipif(torch.cuda.is_available(), reason="a number names a CUDA device, which this machine has")
def test_a_number_for_a_device_without_cuda_says_so_once() -> None:
    """Before: "0 is not a device", once per stage; and `devices=0` was told to write ['0']."""
    message = _message(devices=[0, 0])
    assert message.count("0: a number names a CUDA device, and CUDA is not available on this machine") == 1, message
    assert "not a count: e.g. devices=['cpu', 'cpu']" in _message(devices=0)


def test_a_stage_count_for_devices_is_answered_with_a_list_of_that_many() -> None:
    """Before, devices=2 was told to write [2], which names CUDA device 2."""
    assert "devices must be a list with one device per stage, not a count: e.g. devices=['cpu', 'cpu'], or ['cuda:0', 'cuda:1'] (got 2)" in _message(devices=2)


@pytest.mark.parametrize("name,value", [("chunk_spec", [0]), ("chunk_spec", ("x", 0)), ("example_kwargs", [("mask", X)])])
def test_a_mapping_argument_given_as_something_else_is_named(name: str, value: Any) -> None:
    """Before, `dict(...)` of it raised a bare TypeError or ValueError naming no argument."""
    assert f"{name} must be a dict" in _message(**{name: value})


def test_a_device_type_that_cannot_run_a_stage() -> None:
    message = _message(devices=["cpu", "meta"])
    assert "'meta': stages run on 'cpu' and 'cuda' devices only; 'meta' cannot run one" in message


@pytest.mark.skipif(torch.cuda.device_count() > 7, reason="this machine has a cuda:7")
def test_a_cuda_device_this_machine_lacks() -> None:
    message = _message(devices=["cuda:7"])
    if torch.cuda.is_available():
        assert f"'cuda:7': this machine has {torch.cuda.device_count()} CUDA device" in message
    else:
        assert "'cuda:7': CUDA is not available on this machine; use 'cpu' devices" in message


def test_a_cuda_index_past_the_device_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    message = _message(devices=["cuda:1", "cuda:2"])
    assert "'cuda:2': this machine has 2 CUDA devices (cuda:0 to cuda:1)" in message
    assert "'cuda:1'" not in message


@pytest.mark.parametrize("balance", [{"a": 1}, "fast", [2, 0], [1.5, 2], [True, 1], 3])
def test_balance_that_is_neither_a_mode_nor_node_counts(balance: Any) -> None:
    message = _message(devices=["cpu", "cpu"], balance=balance)
    assert "balance must be one of 'time', 'flops', 'params', 'memory', or a list of node counts per stage, each at least 1" in message
    assert f"(got {balance!r})" in message


@pytest.mark.parametrize("split_points", ["a", [1]])
def test_split_points_that_are_not_module_names(split_points: Any) -> None:
    message = _message(devices=["cpu", "cpu"], split_points=split_points)
    assert "split_points must be a list of module names where stages 1, 2, ... begin, e.g. ['blocks.4']" in message


@pytest.mark.parametrize("name,value,message", [
    ("bandwidth", 0.0, "bandwidth must be a number, positive (got 0.0)"),
    ("bandwidth", -5.0, "bandwidth must be a number, positive (got -5.0)"),
    ("flop_rate", -1.0, "flop_rate must be a number, positive (got -1.0)"),
    ("param_scale", -3.0, "param_scale must be a number, zero or more (got -3.0)"),
    ("device_memory", [1e9, 0], "device_memory must be bytes, positive"),
    ("bandwidth", "fast", "bandwidth must be a number, positive (got 'fast')"),
])
def test_cost_model_numbers_out_of_range(name: str, value: Any, message: str) -> None:
    """Before, a bandwidth of 0 raised ZeroDivisionError, and negative rates turned the cut around."""
    with pytest.raises(ValueError, match=re.escape(message)):
        compile_pipeline(Blocks(), X, ["cpu"] * 2, balance="flops", **{name: value})


def test_every_problem_is_listed_in_one_message() -> None:
    message = _message(devices=["cpu", "meta", "cuda:7", "nonsense"], chunks=0, checkpoint="bad", balance={"a": 1})
    problems = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(problems) == 6, message
    assert "'meta': stages run on" in message and "'cuda:7':" in message and "'nonsense' is not a device" in message
    assert "chunks must" in message and "checkpoint must" in message and "balance must" in message


def test_counts_known_from_the_arguments_are_listed_with_the_other_problems() -> None:
    """Before, the timeout was refused alone, and device_memory's and balance's lengths only once
    every other argument was right: five attempts to see five problems."""
    message = _message(devices=["cpu", "cpu"], chunks=0, device_memory=[1e9], balance=[1, 1, 1], timeout=-1)
    problems = [line for line in message.splitlines() if line.startswith("  - ")]
    assert len(problems) == 4, message
    assert "timeout must be a positive number of seconds (got -1)" in message and "chunks must" in message
    assert "device_memory has 1 entry for 2 devices" in message and "balance has 3 entries for 2 stages" in message


def test_numbers_and_arrays_from_numpy_are_taken_as_python_s() -> None:
    """Before, chunks=np.int64(2) was "not a whole number", and np.diff's cut not node counts."""
    import numpy as np  # (a test dependency)

    model = nn.Sequential(*(nn.Linear(6, 6) for _ in range(4)))
    plain = compile_pipeline(model, X, ["cpu", "cpu"], chunks=2, balance=[2, 2], device_memory=2**30)
    given = compile_pipeline(model, X, np.array(["cpu", "cpu"]), chunks=np.int64(2), balance=np.diff([0, 2, 4]), device_memory=np.int64(2**30))  # type: ignore[arg-type]
    assert given.plan.to_dict() == plain.plan.to_dict()
    given.close()
    plain.close()


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, x: torch.Tensor, scale: Any = None) -> torch.Tensor:
        h = self.a(x)
        return self.b(h if scale is None else h * scale)


def test_devices_given_as_an_iterator_serve_calls_of_another_kind() -> None:
    """Before, the iterator compiling read was kept for later calls: the first call of another
    kind (a tensor where the example had None) was refused as "devices is empty"."""
    model = _Scaled()
    pipe = compile_pipeline(model, X, iter(["cpu", "cpu"]), chunks=2)  # type: ignore[arg-type]
    scale = torch.rand(4, 6)
    torch.testing.assert_close(pipe(X, scale), model(X, scale), rtol=0, atol=0)
    pipe.close()


class _Heads(nn.Module):
    def __init__(self, names: list[str]) -> None:
        super().__init__()
        self.heads = nn.ModuleDict({name: nn.Linear(6, 6) for name in names})  # keys from a dataset's labels

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for name in self.heads:
            x = torch.tanh(self.heads[name](x))
        return x


@pytest.mark.parametrize("name", ['6" screen', "path\\"])
def test_a_name_the_generated_code_cannot_hold_is_refused_naming_it(name: str) -> None:
    """Before, both front ends' code failed to compile (a SyntaxError), and the advice was to
    keep a module with control flow whole, which did not help."""
    with pytest.raises(ValueError, match=rf"(?s)bad arguments.*cannot write into the code they generate \('heads\.{re.escape(name)}'\).*rename them"):
        compile_pipeline(_Heads([name, "b"]), X, ["cpu", "cpu"], chunks=2)
    model = _Heads(["screen", "b"])
    torch.testing.assert_close(compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)(X), model(X), rtol=0, atol=0)


def test_one_device_string_is_listed_with_the_other_problems() -> None:
    message = _message(devices="cpu", chunks=0, split_points="a")
    assert "devices must be a list" in message and "chunks must" in message and "split_points must" in message


def test_cuda_without_an_index_is_the_current_device(monkeypatch: pytest.MonkeyPatch) -> None:
    """'cuda', torch.device('cuda') and 'cuda:0' name one device: the plan shows 'cuda:0'."""
    from fxpipe.compiler.arguments import _parse_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    named = [_parse_device(d)[0] for d in ("cuda", torch.device("cuda"), "cuda:1")]
    assert named == [torch.device("cuda", 1)] * 3


@pytest.mark.parametrize("devices", [["cpu", "cpu:0"], ["cpu:0", "cpu:1"], [torch.device("cpu", 0), "cpu"]])
def test_a_cpu_device_with_an_index_is_the_cpu(devices: list[Any]) -> None:
    """torch puts CPU tensors on 'cpu', whatever index the device was named with. Before, every
    call was refused as a model moved since compiling ("stage 1's on cpu (placed on cpu:0)")."""
    model = FanOut().double()
    reference = copy.deepcopy(model)
    x = X.double()
    pipe = compile_pipeline(model, x, devices, chunks=2)
    assert [str(d) for d in pipe.devices] == ["cpu", "cpu"]
    torch.testing.assert_close(pipe(x), reference(x), rtol=0, atol=1e-12)
    loss = pipe.train_step(x, target=x, loss_fn=F.mse_loss)
    expected = F.mse_loss(reference(x), x)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), rtol=0, atol=1e-12)
    assert_grads_equal(pipe, reference, tol=1e-12)


class Blocks(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.block = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
        self.head = nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.block(x))


def test_a_misspelt_leaf_module_is_named_with_the_names_it_may_mean() -> None:
    """Unchecked, it would keep nothing whole without a word."""
    with pytest.raises(ValueError) as info:
        compile_pipeline(Blocks(), X, ["cpu"], leaf_modules=["blok", nn.Linear, 3], chunks=0)  # type: ignore[list-item]
    message = str(info.value)
    assert "leaf_modules names 'blok', which is no submodule of Blocks (did you mean 'block'" in message
    assert "leaf_modules takes module types or qualified submodule names, not 3" in message
    assert "chunks must" in message  # with the other problems
    assert compile_pipeline(Blocks(), X, ["cpu"], leaf_modules=["block", nn.Linear]).plan is not None
    shared = Blocks()
    shared.again = shared.block  # one module under two names: either names it
    kept = compile_pipeline(shared, X, ["cpu"], leaf_modules=["again"])
    assert "self.block(" in kept.stages[0].code, "called whole, by the name forward calls it by"


def test_the_models_own_class_as_a_leaf_module_is_refused() -> None:
    """Before, it was accepted and ignored: the model was traced and cut as without it."""
    with pytest.raises(ValueError, match="leaf_modules names Blocks, the model's own class, which no submodule is"):
        compile_pipeline(Blocks(), X, ["cpu"] * 2, leaf_modules=[Blocks])
    nested = nn.Sequential(nn.Sequential(nn.Linear(6, 6), nn.Tanh()), nn.Linear(6, 6))
    assert compile_pipeline(nested, X, ["cpu"] * 2, leaf_modules=[nn.Sequential]).plan.stages[0].modules == ["0"]


@pytest.mark.parametrize("chunk_spec", [{"x": None}, None], ids=["kept whole", "no dim"])
def test_chunks_with_no_input_to_split_is_refused(chunk_spec: Any) -> None:
    """Before, every call ran one micro-batch, while the plan said chunks=4."""
    x = X if chunk_spec else torch.tensor(2.0)
    with pytest.raises(ValueError, match="chunks=4, but no input of the example is split into micro-batches"):
        compile_pipeline(Blocks() if chunk_spec else nn.Sequential(nn.Tanh(), nn.Tanh()), x, ["cpu"] * 2, chunks=4, chunk_spec=chunk_spec)
    assert compile_pipeline(Blocks(), X, ["cpu"] * 2, chunks=1, chunk_spec={"x": None}).plan is not None


def test_a_model_that_is_not_a_module_is_refused_with_the_fix() -> None:
    def function(x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(x)

    with pytest.raises(ValueError, match="model must be an nn.Module .*not function: wrap a function in a module"):
        compile_pipeline(function, X, ["cpu"])  # type: ignore[arg-type]


@pytest.mark.parametrize(
    "example,error",
    [(X.double(), "must have the same dtype"), (torch.randn(4, 5), "cannot be multiplied"),
     ([X], "must be Tensor, not list"), (None, "not NoneType")],
    ids=["dtype", "shape", "list", "None"],
)  # fmt: skip
def test_an_example_the_model_does_not_take_is_named_with_the_fix(example: Any, error: str) -> None:
    with pytest.raises(ValueError, match=f"(?s)Blocks does not run on the example: .*{error}.*How to fix: give compile_pipeline an example"):
        compile_pipeline(Blocks(), example, ["cpu", "cpu"], chunks=2)


@pytest.mark.parametrize(
    "example,kwargs,error",
    [((X, X), {}, "too many positional arguments"), (X, {"y": X}, "got an unexpected keyword argument 'y'"),
     ((), {}, "missing a required argument: 'x'")],
    ids=["one-too-many", "unknown-keyword", "none"],
)  # fmt: skip
def test_an_example_that_does_not_fit_forwards_arguments_is_named_before_the_model_runs(example: Any, kwargs: dict[str, Any], error: str) -> None:
    """Before, the binder of the traced graph said it, as if the pipeline had been called."""
    with pytest.raises(TypeError, match=rf"(?s)the example does not fit NeverRun.forward\(x\): {error}.*How to fix: "):
        compile_pipeline(NeverRun(), example, ["cpu"], example_kwargs=kwargs)


@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")
def test_a_model_holding_a_torchscript_module_is_refused_naming_it() -> None:
    """Before, compiling crashed putting the model's state back (a ScriptModule's tables)."""
    model = Blocks()
    model.block = torch.jit.script(model.block)  # type: ignore[assignment]
    before = {name: t.clone() for name, t in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"the model holds TorchScript modules \(block\), which fxpipe cannot trace"):
        compile_pipeline(model, X, ["cpu", "cpu"], chunks=2)
    assert all(torch.equal(t, before[name]) for name, t in model.state_dict().items())


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


def test_split_points_naming_the_whole_model_or_one_module_twice() -> None:
    """Before, '' (the root's name in named_modules()) cut after the first module, and a name
    given twice was called out of order."""
    with pytest.raises(PartitionError, match="split point '' is the whole model"):
        compile_pipeline(Nest(), X, ["cpu"] * 2, split_points=[""])
    with pytest.raises(PartitionError, match="'second' named more than once in split_points") as twice:
        compile_pipeline(Nest(), X, ["cpu"] * 3, split_points=["second", "second"])
    assert "out of order" not in str(twice.value)


def test_split_points_cut_where_the_modules_begin() -> None:
    pipe = compile_pipeline(Nest(), X, ["cpu"] * 3, split_points=["second", "third"])
    assert [stage.nodes for stage in pipe.plan.stages] == [["first_0", "first_1"], ["second_0", "second_1"], ["third"]]


def test_more_stages_than_nodes() -> None:
    with pytest.raises(PartitionError, match="6 stages but the graph has only 5 nodes to place"):
        compile_pipeline(Nest(), X, ["cpu"] * 6)


def test_balance_that_does_not_sum_to_the_node_count() -> None:
    with pytest.raises(PartitionError, match="balance sums to 4 but the graph has 5 nodes to place"):
        compile_pipeline(Nest(), X, ["cpu", "cpu"], balance=[2, 2])


class _HoldsAPipeline(nn.Module):
    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner, self.head = inner, nn.Linear(6, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.inner(x))


@pytest.mark.parametrize("how", ["the pipeline", "a model holding it", "kept whole"])
def test_a_pipeline_compiled_again_is_refused_saying_to_compile_the_plain_model(how: str) -> None:
    """Before, the trace's refusals advised naming forward's arguments or torch.cond, and
    keeping it whole compiled, then failed at the first call inside the pipeline's own dispatch
    mode, advising to enter 'the mode' around the plain model."""
    plain = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    pipe = compile_pipeline(plain, X, ["cpu", "cpu"], chunks=2)
    model = pipe if how == "the pipeline" else _HoldsAPipeline(pipe)
    leaves = ["inner"] if how == "kept whole" else []
    with pytest.raises(ValueError, match=r"the model is or holds a Pipeline \((the model itself|inner)\).*compile the plain model"):
        compile_pipeline(model, X, ["cpu", "cpu"], chunks=2, leaf_modules=leaves)


class _BankFirst(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 6), nn.Linear(6, 6)

    def forward(self, bank: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.a(x))
        return self.b(h + (h @ bank.t()) @ bank)


def test_an_empty_side_input_kept_whole_is_no_empty_batch() -> None:
    """Before, the batch was sized from the first input before chunk_spec kept it whole: an empty
    memory bank made "the example batch is empty", where the plain model runs."""
    model = _BankFirst().double()
    bank, x = torch.zeros(0, 6, dtype=torch.float64), torch.randn(8, 6, dtype=torch.float64)
    pipe = compile_pipeline(copy.deepcopy(model), (bank, x), ["cpu", "cpu"], chunks=4, chunk_spec={"bank": None})
    torch.testing.assert_close(pipe(bank, x), model(bank, x), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="the example batch is empty"):
        compile_pipeline(copy.deepcopy(model), (bank, x[:0]), ["cpu", "cpu"], chunks=4, chunk_spec={"bank": None})


class _DoublesLinear(nn.Parameter):
    """A weight whose class doubles F.linear's output, in __torch_function__."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **(kwargs or {}))
        return out * 2 if func is F.linear else out


def test_a_tensor_class_that_overrides_torch_function_is_refused_naming_it() -> None:
    """Before, the stages ran on plain tensors standing for it, and the override never ran: the
    pipeline computed the model without it (0.23 off), without a word."""
    model = nn.Sequential(nn.Linear(6, 6), nn.Tanh(), nn.Linear(6, 6))
    first = model[0]
    assert isinstance(first, nn.Linear)
    first.weight = _DoublesLinear(first.weight.detach())
    with pytest.raises(ValueError, match=r"(?s)override __torch_function__ or __torch_dispatch__ \(0.weight \(_DoublesLinear\)\).*apply what it does in a module's"):
        compile_pipeline(model, X, ["cpu", "cpu"])
    plain = nn.Sequential(nn.Linear(6, 6), nn.Tanh())
    plain.kept = nn.Buffer(torch.zeros(2))  # torch's own tensor classes are not refused
    assert compile_pipeline(plain, X, ["cpu"]).plan is not None


def test_an_option_of_compiling_given_to_a_call_is_said_to_belong_to_compile_pipeline() -> None:
    """Before, train_step(..., schedule='1f1b') said only 'got an unexpected keyword argument'."""
    x = torch.randn(8, 4)
    pipe = compile_pipeline(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), x, ["cpu", "cpu"], chunks=2)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'schedule'\nHow to fix: schedule= is an option of compile_pipeline"):
        pipe.train_step(x, target=x, loss_fn=nn.functional.mse_loss, schedule="1f1b")
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'chunks'\nHow to fix: chunks= is an option of compile_pipeline"):
        pipe(x, chunks=4)
    assert OPTIONS == set(inspect.signature(compile_pipeline).parameters) - {"model", "example"}  # the list the hint reads
