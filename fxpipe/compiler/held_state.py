"""Refusing a plan across processes in which one rank's copy of the model's state would go stale."""
from __future__ import annotations

from typing import Any

from torch import nn

from fxpipe.passes.state import parameters_written


def check_state_placement(owner: nn.Module, programs: dict[bool, Any]) -> None:
    """Each rank trains its own copy of what it holds; refuse, naming every tensor, a plan in
    which a copy would go stale: a tensor read in eval mode on a rank that does not hold it in
    training, or a buffer or parameter that forward writes and more than one rank reads."""
    names: dict[int, str] = {}
    for name, tensor in [*owner.named_parameters(remove_duplicate=False), *owner.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), name)
    readers = {mode: program.readers for mode, program in programs.items()}
    written = {id(b) for program in programs.values() for stage in program.stages for b in stage.writable_buffers.values()}
    problems = set()
    for key, ranks in readers[False].items():
        trained = readers[True].get(key)
        if key not in names:
            continue
        if trained is None and len(ranks) > 1:  # read in eval alone: each rank would train its own copy there
            problems.add(f"{names[key]!r} is read in eval mode alone, on pipeline ranks {sorted(ranks)}")
        elif trained is not None and ranks - trained:
            problems.add(f"{names[key]!r} is read on pipeline rank(s) {sorted(ranks - trained)} in eval mode and held on "
                         f"{sorted(trained)} in training, where it is trained")  # fmt: skip
    for found in readers.values():
        for key, ranks in found.items():
            if key in written and len(ranks) > 1:
                problems.add(f"buffer {names.get(key, '?')!r} is written in forward and read on pipeline ranks {sorted(ranks)}")
    for program in programs.values():
        for run in program.runs:
            for name, (tensor, writer) in parameters_written(program.cut.graph, run).items():
                ranks = program.readers.get(id(tensor), set())
                if len(ranks) > 1:
                    problems.add(f"parameter {names.get(id(tensor), name)!r} is written in place in forward by {writer}, "
                                 f"and read on pipeline ranks {sorted(ranks)}")  # fmt: skip
    if problems:
        raise ValueError(
            "this plan cannot run across processes: each rank keeps its own copy of what its stages read, and\n"
            + "\n".join(f"  - {p}" for p in sorted(problems))
            + "\nwould go stale on the other ranks.\nHow to fix: cut so that one rank holds each of them "
            "(split_points=[...]); a forward that branches on self.training is cut once per mode, so for "
            "inference alone compile the model in eval mode; a parameter forward writes in place can also be "
            "written outside forward (an Embedding's max_norm=None, and its rows renormalised before the step)."
        )
