"""The house stays as docs/design.md draws it: every import (function-level ones too) points at a room on a lower
floor or within its own room, and no modules import each other in a circle."""

import ast
from pathlib import Path

from conftest import REPO

FLOORS = [
    ["errors", "sizes", "phases", "sharding", "tensor_group", "callbacks"],
    ["compat", "config"],
    ["runtime", "mesh", "precision", "boundaries", "custom_calls"],
    ["data", "run"],
    ["models"],
    ["state", "muon", "pipeline", "torch_bridge", "hf"],
    ["optim", "observe", "evaluation"],
    ["lowering"],
    ["program"],
    ["trainer"],
    ["commands", "api"],
    ["cli"],
]
"""docs/design.md's floors, from the ground up: the rooms (a top-level module, or a folder) on each."""

PACKAGES = {"xlatrain": "xlatrain", "lowering": "xlatrain.lowering", "custom_calls": "xlatrain.custom_calls"}


def modules() -> dict[str, Path]:
    found = {}
    for folder, package in PACKAGES.items():
        for path in (REPO / folder).rglob("*.py"):
            parts = path.relative_to(REPO / folder).with_suffix("").parts
            found[".".join([package, *parts]).removesuffix(".__init__")] = path
    return found


def room(module: str) -> str:
    """`xlatrain.run.metrics` -> run, `xlatrain.program` -> program, `xlatrain.lowering.pipeline.chunks` -> lowering."""
    return module.split(".")[1] if module.count(".") else module


def imports(path: Path, known: set[str]) -> set[str]:
    """The xlatrain modules `path` imports, at any depth of the file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("xlatrain"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                found.add(name if name in known else node.module)
        elif isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names if alias.name.startswith("xlatrain")}
    return {name for name in found if name in known and name != "xlatrain"}


def test_every_import_points_down_or_within_its_room():
    floor = {name: level for level, rooms in enumerate(FLOORS) for name in rooms}
    graph = modules()
    assert set(map(room, graph)) - {"xlatrain"} == set(floor), "a room is missing from FLOORS (and docs/design.md)"
    upward = sorted(f"{module} -> {target}" for module, path in graph.items() if module != "xlatrain"
                    for target in imports(path, set(graph))
                    if room(target) != room(module) and floor[room(target)] >= floor[room(module)])
    assert not upward, upward


def test_no_modules_import_each_other_in_a_circle():
    graph = modules()
    edges = {module: imports(path, set(graph)) for module, path in graph.items()}
    done, on_path, circles = set(), [], []

    def visit(module: str) -> None:
        if module in on_path:
            circles.append(on_path[on_path.index(module):] + [module])
            return
        if module in done:
            return
        on_path.append(module)
        for target in sorted(edges[module]):
            visit(target)
        on_path.pop()
        done.add(module)

    for module in sorted(edges):
        visit(module)
    assert not circles, circles
