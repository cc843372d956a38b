"""The layout: imports go one way between the layers, with no circle, and the old paths of public names still work."""
import ast
import importlib
import itertools
import pathlib
import sys
from typing import Iterator

import networkx as nx
import pytest

import fxpipe
from fxpipe._moved import MOVED

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
    """The layer a module belongs to: its sub-package, or 'api' for the package's top-level modules."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 and parts[1] in LAYERS else "api"


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


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_public_name_imports_from_its_old_module(old: str) -> None:
    module = importlib.import_module(old)
    assert module is sys.modules[MOVED[old]]
    public = [name for name in fxpipe.__all__ if getattr(module, name, None) is getattr(fxpipe, name)]
    assert public, f"{old} holds none of fxpipe's public names"
