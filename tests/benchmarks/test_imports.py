"""The benchmarks' modules import one way: no cycle among them, counting the imports made inside
functions too (a cycle through a deferred import is still one)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def modules() -> dict[str, Path]:
    """Every module of the ``benchmarks`` package by its dotted name."""
    found = {}
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


MODULES = modules()


def imports(module: str) -> set[str]:
    """The ``benchmarks`` modules ``module`` imports, anywhere in it (its own package excepted)."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            names = [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module and not module.startswith(name + "."):
                found.add(name)
    return found


def test_no_import_cycle_among_the_benchmarks():
    graph = {module: imports(module) for module in MODULES}
    cycles, stack, state = [], [], {}

    def visit(module: str) -> None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join([*stack[stack.index(target):], target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    assert not cycles, "\n".join(cycles)
