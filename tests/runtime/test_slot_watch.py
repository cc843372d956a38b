"""SlotWatch: a parameter or buffer assigned while the stages of overlapping steps hold the model's slots."""
from __future__ import annotations

from typing import cast

import torch
from torch import nn

from fxpipe.compiled.program import HeldState
from fxpipe.runtime.checkpoint import swapped_slots
from fxpipe.runtime.versions import SlotWatch


def _model() -> nn.Sequential:
    return nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))


def _swaps(model: nn.Sequential) -> list[tuple[dict, str, torch.Tensor]]:  # type: ignore[type-arg]
    """A stage's own tensors for the first layer's weight and the norm's running mean."""
    linear, norm = cast(nn.Linear, model[0]), cast(nn.BatchNorm1d, model[1])
    return [(linear._parameters, "weight", linear.weight.detach().clone()), (norm._buffers, "running_mean", torch.ones(3))]


def test_slots_a_stage_holds_are_not_taken_for_assigned_and_are_put_back() -> None:
    model = _model()
    weight, mean = model[0].weight, model[1].running_mean
    watch = SlotWatch(HeldState.of(model))
    swaps = _swaps(model)
    with swapped_slots(swaps, watch):
        assert model[0]._parameters["weight"] is swaps[0][2]
        assert watch.assigned() == []  # read while held: the stage's own tensors
        with swapped_slots(swaps[:1], watch):  # a recompute's hold inside the forward's
            assert watch.assigned() == []
        assert model[0]._parameters["weight"] is swaps[0][2] and watch.assigned() == []
    assert model[0].weight is weight and model[1].running_mean is mean
    assert watch.assigned() == [] and watch.put == {}


def test_a_parameter_assigned_while_held_stays_assigned_and_is_named() -> None:
    """Before, the stage leaving the slot put back the tensor it found there, over the assignment."""
    model = _model()
    watch = SlotWatch(HeldState.of(model))
    assigned = nn.Parameter(torch.zeros(3, 3))
    with swapped_slots(_swaps(model), watch):
        model[0].weight = assigned
        assert watch.assigned() == ["0.weight"]  # seen while the stage still holds the slot
    assert model[0].weight is assigned
    assert watch.assigned() == ["0.weight"]


def test_a_buffer_assigned_before_a_stage_goes_in_is_noticed_by_the_stage() -> None:
    """The caller reads the slot while the stage holds it, and sees the stage's tensor: the
    stage, finding the assigned one there, says so."""
    model = _model()
    watch = SlotWatch(HeldState.of(model))
    assigned = torch.zeros(3)
    model[1].running_mean = assigned
    with swapped_slots(_swaps(model), watch):
        assert watch.noticed == ["1.running_mean"]
    assert model[1].running_mean is assigned
    assert watch.assigned() == ["1.running_mean"]


def test_a_slot_assigned_when_no_stage_holds_it_is_named() -> None:
    model = _model()
    watch = SlotWatch(HeldState.of(model))
    model[0].bias = nn.Parameter(torch.zeros(3))
    assert watch.assigned() == ["0.bias"]
