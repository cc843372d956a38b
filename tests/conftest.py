"""What every test runs under: a fixed seed, bounded waits, and the examples importable by name."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _bounded_waits(monkeypatch: pytest.MonkeyPatch) -> None:
    """A hang in the runtime fails its test in seconds, not at the suite's timeout."""
    import fxpipe.runtime.step

    monkeypatch.setattr(fxpipe.runtime.step, "WAIT_TIMEOUT", 30.0)
