"""Every ```python block of README.md and docs/*.md runs, each in a fresh namespace and a temporary directory."""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest

import fxpipe

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LANGUAGES = {"python", "py", "python3"}
# A block that cannot run here says why on its fence: ```python no-run: needs a GPU
NO_RUN = re.compile(r"no-run:\s*(?P<reason>\S.*)")
# A script for torchrun says how many processes run it: ```python torchrun: 2
TORCHRUN = re.compile(r"torchrun:\s*(?P<processes>[1-9])")
TORCHRUN_TIMEOUT = 180  # seconds for the whole run, start-up included
FENCE = re.compile(r"^(?P<indent> {0,3})(?P<fence>`{3,}|~{3,})(?P<info>[^`]*)$")


@dataclass(frozen=True)
class Block:
    """One fenced block of Python: where it is, its code, and why it does not run, if it does not."""

    page: str  # relative to the repository
    index: int  # among the page's Python blocks, from 0
    line: int  # of its first line of code in the page, from 1
    code: str
    no_run: Optional[str]  # the reason on its fence
    processes: int  # under torchrun, so many; 0 runs it in this process
    bad_marker: Optional[str]  # what follows the language on a fence that is neither plain, no-run nor torchrun

    @property
    def name(self) -> str:
        return f"{self.page}-{self.index}"


def blocks_of(page: Path) -> list[Block]:
    """The Python blocks of a Markdown page, in order."""
    found: list[Block] = []
    lines = page.read_text(encoding="utf-8").splitlines()
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if opening is None:
            i += 1
            continue
        fence, indent = opening["fence"], len(opening["indent"])
        words = opening["info"].strip().split(maxsplit=1)
        closing = re.compile(rf"^ {{0,3}}{re.escape(fence[0])}{{{len(fence)},}}\s*$")
        end = i + 1
        while end < len(lines) and not closing.match(lines[end]):
            end += 1
        if words and words[0] in LANGUAGES:
            rest = words[1] if len(words) > 1 else ""
            marker = NO_RUN.fullmatch(rest)
            spawned = TORCHRUN.fullmatch(rest)
            body = [re.sub(rf"^ {{0,{indent}}}", "", line) for line in lines[i + 1 : end]]  # the fence's indent off
            found.append(
                Block(
                    page=page.relative_to(ROOT).as_posix(),
                    index=len(found),
                    line=i + 2,
                    code="\n".join(body) + "\n",
                    no_run=marker["reason"].strip() if marker else None,
                    processes=int(spawned["processes"]) if spawned else 0,
                    bad_marker=rest if rest and not marker and not spawned else None,
                )
            )
        i = end + 1
    return found


BLOCKS = [block for page in PAGES for block in blocks_of(page)]


def case(block: Block) -> object:
    marks = [pytest.mark.skip(reason=f"{block.name} (line {block.line}): {block.no_run}")] if block.no_run else []
    return pytest.param(block, id=block.name, marks=marks)


def test_the_pages_hold_blocks_that_run() -> None:
    pages = {block.page for block in BLOCKS if block.no_run is None}
    assert "README.md" in pages, "the README's example is not found"
    assert len(pages) >= 2, f"runnable blocks found only in {sorted(pages)}"


@pytest.mark.parametrize("block", [case(block) for block in BLOCKS])
def test_block_runs(block: Block, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert block.bad_marker is None, (
        f"{block.page}, line {block.line - 1}: the fence says 'python {block.bad_marker}'; "
        "a block runs under a plain ```python fence, or says why not as 'python no-run: <reason>'"
    )
    monkeypatch.chdir(tmp_path)
    if block.processes:
        run_under_torchrun(block, tmp_path)
        return
    # Blank lines first, so that a traceback names the page and the line the code has there.
    code = compile("\n" * (block.line - 1) + block.code, str(ROOT / block.page), "exec")
    namespace: dict[str, object] = {"__name__": "__docs__"}
    try:
        exec(code, namespace)
    finally:
        for value in namespace.values():
            if isinstance(value, fxpipe.Pipeline):
                value.close()


def run_under_torchrun(block: Block, folder: Path) -> None:
    """The block as a script, one process per rank on 127.0.0.1 (torchrun --standalone picks a free
    port); every process is gone when this returns, whether the run ends, fails or times out."""
    script = folder / "script.py"
    script.write_text("\n" * (block.line - 1) + block.code)
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={block.processes}", str(script)]
    with subprocess.Popen(command, cwd=folder, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True) as run:
        try:
            output, _ = run.communicate(timeout=TORCHRUN_TIMEOUT)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(run.pid, signal.SIGKILL)  # the ranks too, not only torchrun
    assert run.returncode == 0, f"{block.page}, line {block.line}: torchrun exited with {run.returncode}\n{output[-3000:]}"
