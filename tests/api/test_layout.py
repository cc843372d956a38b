"""The layout: imports go one way between the layers, with no circle, and the old paths of public names still work."""
import ast
import importlib
import itertools
import pathlib
import re
import subprocess
import sys
from typing import Iterator

import networkx as nx
import pytest

import fxpipe
from fxpipe._moved import MOVED
from fxpipe.core.own_code import is_ours

ROOT = pathlib.Path(fxpipe.__file__).resolve().parent
PASSES = pathlib.Path(importlib.import_module("fxpipe.passes").__file__ or "").resolve().parent

# Each layer and the layers its modules may import (besides their own). The data flows down this
# list; a layer reads what the layers above it made, never what those below it do.
LAYERS: dict[str, set[str]] = {
    "core": set(),
    "tracing": {"core"},
    "passes": {"core", "tracing"},
    "schedules": {"core"},
    "compiled": {"core", "tracing", "passes", "schedules"},
    "runtime": {"core", "schedules", "compiled"},  # the runtime reads only the compiled record
    "distributed": {"core", "schedules", "compiled", "runtime"},
    "compiler": {"core", "tracing", "passes", "schedules", "compiled", "runtime", "distributed"},
    "api": {"core", "tracing", "passes", "schedules", "compiled", "runtime", "distributed", "compiler"},
}


def modules() -> dict[str, pathlib.Path]:
    """Every module of the library, by dotted name."""
    found = {}
    for base, package in ((ROOT, "fxpipe"), (PASSES, "fxpipe.passes")):
        for path in sorted(base.rglob("*.py")):
            parts = path.relative_to(base).with_suffix("").parts
            if base == ROOT and parts[0] == "passes":  # a link to the passes' folder, in some checkouts
                continue
            name = ".".join((package, *parts)).removesuffix(".__init__")
            found[name] = path
    return found


def layer_of(module: str) -> str:
    """The layer a module or sub-package belongs to: its sub-package, or 'api' for the package's top-level modules."""
    parts = module.split(".")
    return parts[1] if len(parts) >= 2 and parts[1] in LAYERS else "api"


def imports_of(path: pathlib.Path, known: dict[str, pathlib.Path]) -> Iterator[tuple[str, int]]:
    """The library modules a file imports, anywhere in it (type-only and in-function imports too), with the line."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{alias.name}" if f"{node.module}.{alias.name}" in known else node.module for alias in node.names]
        else:
            continue
        for name in names:
            if name.startswith("fxpipe.") and name in known:
                yield name, node.lineno


def import_graph() -> nx.DiGraph:
    known = modules()
    graph = nx.DiGraph()
    graph.add_nodes_from(known)
    for module, path in known.items():
        for imported, line in imports_of(path, known):
            if imported != module and not module.endswith("__init__") and imported not in ("fxpipe", "fxpipe.passes"):
                graph.add_edge(module, imported, line=line)
    return graph


def test_every_import_goes_from_a_layer_to_one_it_may_read() -> None:
    graph = import_graph()
    wrong = [
        f"{a} ({layer_of(a)}, line {data['line']}) imports {b} ({layer_of(b)})"
        for a, b, data in graph.edges(data=True)
        if a != "fxpipe" and layer_of(b) != layer_of(a) and layer_of(b) not in LAYERS[layer_of(a)]
    ]
    assert not wrong, "imports against the layers:\n" + "\n".join(sorted(wrong))


def test_no_module_imports_itself_through_others() -> None:
    graph = import_graph()
    graph.remove_node("fxpipe")  # the package imports its public names from everywhere
    cycles = [" -> ".join([*cycle, cycle[0]]) for cycle in itertools.islice(nx.simple_cycles(graph), 20)]
    assert not cycles, "import circles:\n" + "\n".join(sorted(cycles))


def test_every_layer_is_a_package_and_every_module_belongs_to_one() -> None:
    for module in modules():
        assert layer_of(module) in LAYERS, module
    for layer in LAYERS:
        if layer != "api":
            assert f"fxpipe.{layer}" in modules(), f"no package fxpipe.{layer}"


DOCS = pathlib.Path(__file__).resolve().parents[2] / "docs" / "layout.md"
SECTION = "## Packages and modules"
HOMES = {"passes": "`passes/` (installed as `fxpipe.passes`)", "api": "the top-level modules of `fxpipe/`"}


def summary(path: pathlib.Path) -> str:
    """The first paragraph of a module's docstring, on one line."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    return " ".join(doc.split("\n\n")[0].split())


def modules_section() -> str:
    """docs/layout.md's list of packages and modules, made from their docstrings."""
    found = modules()
    lines = [SECTION, "", "Each package in the order of the layers, then one line per module, from its docstring.", ""]
    for layer in LAYERS:
        package = "fxpipe" if layer == "api" else f"fxpipe.{layer}"
        lines += [f"### {layer}: {HOMES.get(layer, f'`fxpipe/{layer}/`')}", "", summary(found[package]), ""]
        members = sorted(m for m in found if m != package and layer_of(m) == layer and m.count(".") == (1 if layer == "api" else 2))
        lines += [f"- `{m.rpartition('.')[2]}.py`: {summary(found[m])}" for m in members] + [""]
    return "\n".join(lines)


def test_the_layout_guide_lists_every_module_as_its_docstring_says() -> None:
    """docs/layout.md cannot drift from the tree: `python tests/api/test_layout.py` writes its list again."""
    text = DOCS.read_text()
    assert SECTION in text, f"{DOCS} has no section {SECTION!r}"
    assert text[text.index(SECTION):].rstrip() == modules_section().rstrip(), "docs/layout.md is stale: run python tests/api/test_layout.py"


def test_every_package_is_installed() -> None:
    """pyproject.toml lists the packages a wheel holds: a layer left out would import from a
    checkout and fail from an install."""
    text = (DOCS.parents[1] / "pyproject.toml").read_text()
    found = re.search(r"^packages = \[(?P<names>[^\]]*)\]", text, re.M)
    assert found, "pyproject.toml has no packages = [...] under [tool.setuptools]"
    listed = re.findall(r'"([\w.]+)"', found["names"])
    packages = {m for m, path in modules().items() if path.name == "__init__.py"}
    assert set(listed) == packages, f"pyproject.toml lists {sorted(listed)}; the packages are {sorted(packages)}"


def test_every_module_says_what_it_is_in_one_line_first() -> None:
    missing = [m for m, path in modules().items() if not (ast.get_docstring(ast.parse(path.read_text())) or "").strip()]
    assert not missing, f"modules without a docstring: {missing}"


def test_every_module_of_the_library_is_its_own_code_and_a_test_is_not() -> None:
    """Watches and errors skip fxpipe's frames to point at the model's line: wherever a module
    lives (the passes are installed from a folder of their own), it is fxpipe's."""
    for module, path in modules().items():
        assert is_ours(str(importlib.import_module(module).__file__)), f"{module} ({path}) is not taken for fxpipe's own code"
    assert not is_ours(__file__)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_public_name_imports_from_its_old_module(old: str) -> None:
    module = importlib.import_module(old)
    assert module is sys.modules[MOVED[old]]
    public = [name for name in fxpipe.__all__ if getattr(module, name, None) is getattr(fxpipe, name)]
    assert public, f"{old} holds none of fxpipe's public names"


if __name__ == "__main__":  # write docs/layout.md's list of modules again
    text = DOCS.read_text()
    DOCS.write_text(text[: text.index(SECTION)] + modules_section().rstrip() + "\n")


def test_importing_fxpipe_leaves_the_compiler_stack_unimported() -> None:
    """torch._dynamo alone takes seconds to import; a pipeline that compiles nothing never needs it."""
    code = "import sys, fxpipe; print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    found = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert found.stdout.strip() == "[]", found.stdout
