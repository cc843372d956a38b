"""What a failed rank tells the others, and the errors a rank raises when another failed or was lost."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Failure:
    """What a failed rank tells the others: where it failed, and the error as text."""

    rank: int
    stage: int
    micro_batch: int
    phase: str
    error: str  # "TypeName: message"

    def describe(self) -> str:
        where = f"stage {self.stage} (rank {self.rank})" if self.stage >= 0 else f"rank {self.rank}"
        if self.micro_batch >= 0:
            where += f" failed on micro-batch {self.micro_batch} in {self.phase}"
        else:
            where += f" failed in {self.phase}"
        return f"{where}: {self.error}"


class RemoteFailure(Exception):
    """Another rank failed in this step (`failure` says where)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.describe())
        self.failure = failure

    def __reduce__(self) -> tuple[Any, ...]:
        return type(self), (self.failure,), {k: v for k, v in self.__dict__.items() if k != "failure"}


class PeerLost(RuntimeError):
    """A rank stopped answering: it died, or waited longer than the timeout."""
