"""Static checks of the layout promised in docs/architecture.md: imports point one way with no
cycles, no module-level mutable state in the runtime and interpreter, and every function the
step table names exists where the table says."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# Source folder -> installed package (pyproject's package-dir).
FOLDERS = {"agentrt": "agentrt", "interpreter": "agentrt.interpreter", "tools": "agentrt.tools",
           "engine": "agentrt.engine", "kernels": "agentrt.kernels"}
# Layer -> layers it may import (docs/architecture.md's picture).
ALLOWED = {"agentrt": {"agentrt", "interpreter", "tools", "engine", "kernels"},
           "interpreter": {"interpreter", "tools"}, "tools": {"tools"},
           "engine": {"engine", "kernels"}, "kernels": {"kernels"}}
SUBPACKAGES = {"interpreter", "tools", "engine", "kernels"}
# Standard-library-only helpers every layer may use: lazy package exports, and the error root
# (AgentrtError) that every layer's errors derive from.
SHARED = {"agentrt.lazy_exports", "agentrt.errors"}


def module_files() -> dict[str, Path]:
    """Every module of the five layers by its installed dotted name."""
    modules = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = path.relative_to(ROOT / folder).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join((package, *parts))] = path
    return modules


MODULES = module_files()


def layer(module: str) -> str:
    """The layer a module belongs to (``agentrt.engine.x`` -> engine, ``agentrt.agent`` -> agentrt)."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in SUBPACKAGES else "agentrt"


def imports(module: str, top_level_only: bool) -> set[str]:
    """The project modules ``module`` imports (at import time only, or anywhere in it)."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base]) if base else ".".join(anchor)
            names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                     for alias in node.names]
        else:
            continue
        for name in names:
            while name and name not in MODULES:
                name = name.rpartition(".")[0]
            if name and name != module:
                found.add(name)
    return found


def test_layers_import_only_downwards():
    wrong = [f"{module} imports {target}" for module in MODULES
             for target in imports(module, top_level_only=False)
             if layer(target) not in ALLOWED[layer(module)] and target not in SHARED]
    wrong += [f"{module} (shared by every layer) imports {target}" for module in SHARED
              for target in imports(module, top_level_only=False)]
    assert not wrong, "\n".join(wrong)


def test_no_import_cycle():
    graph = {module: imports(module, top_level_only=True) for module in MODULES}
    cycles, stack, state = [], [], {}

    def visit(module: str) -> None:
        state[module] = "open"
        stack.append(module)
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                cycles.append(" -> ".join(stack[stack.index(target):] + [target]))
            elif target not in state:
                visit(target)
        stack.pop()
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module)
    # A package importing its own submodules is the usual package shape, not a cycle.
    real = [c for c in cycles if not all(_is_package_edge(a, b) for a, b in _pairs(c))]
    assert not real, "\n".join(real)


def _pairs(cycle: str) -> list[tuple[str, str]]:
    names = cycle.split(" -> ")
    return list(zip(names, names[1:]))


def _is_package_edge(a: str, b: str) -> bool:
    return b.startswith(a + ".") or a.startswith(b + ".")


MUTABLE_CALLS = {"dict", "list", "set", "defaultdict", "deque", "OrderedDict", "Counter",
                 "WeakValueDictionary", "WeakKeyDictionary", "WeakSet", "local"}


def _mutable(value: ast.expr | None) -> bool:
    if isinstance(value, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        return name in MUTABLE_CALLS
    return False


@pytest.mark.parametrize("folder", ["agentrt", "interpreter"])
def test_no_module_level_mutable_state(folder):
    found = []
    for path in sorted((ROOT / folder).rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(ROOT)
        for node in tree.body:
            targets = (node.targets if isinstance(node, ast.Assign)
                       else [node.target] if isinstance(node, ast.AnnAssign) else [])
            for target in targets:
                name = getattr(target, "id", "")
                constant = name.isupper() or (name.startswith("__") and name.endswith("__"))
                if name and not constant and _mutable(node.value):
                    found.append(f"{where}:{node.lineno} {name}")
        found += [f"{where}:{node.lineno} global {', '.join(node.names)}"
                  for node in ast.walk(tree) if isinstance(node, ast.Global)]
    assert not found, "module-level mutable state:\n" + "\n".join(found)


def _definitions(path: Path) -> tuple[set[str], dict[str, set[str]]]:
    """Top-level names of a module and, per class, the names defined in its body."""
    tree = ast.parse(path.read_text(), str(path))
    top: set[str] = set()
    classes: dict[str, set[str]] = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            top |= {t.id for t in targets if isinstance(t, ast.Name)}
        if isinstance(node, ast.ClassDef):
            members = set()
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                    members.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    members.add(item.target.id)
            classes[node.name] = members
    return top, classes


def step_table_rows() -> list[tuple[str, list[str]]]:
    text = (ROOT / "docs" / "architecture.md").read_text()
    rows = [line.split("|") for line in text.splitlines() if re.match(r"\| \d+ \|", line)]
    assert len(rows) >= 10, "the step table is missing from docs/architecture.md"
    return [(row[1].strip(), re.findall(r"`([^`]+)`", row[3])) for row in rows]


def test_every_function_in_the_step_table_exists_where_it_says():
    tokens = [token for _, row in step_table_rows() for token in row]
    files = {t: ROOT / t for t in tokens if t.endswith(".py")}
    missing_files = [t for t, path in files.items() if not path.is_file()]
    assert not missing_files, f"files named in the step table do not exist: {missing_files}"
    defs = {t: _definitions(path) for t, path in files.items()}
    class_home = {cls: t for t, (_, classes) in defs.items() for cls in classes}
    missing = []
    for step, row in step_table_rows():
        current: str | None = None
        for token in row:
            token = token.removesuffix("()")  # `Repl.messages()`: the method
            if token.endswith(".py"):
                current = token
                continue
            if not re.fullmatch(r"[A-Za-z_][\w.]*", token) or token.isupper():
                continue  # prose in backticks (e.g. FINAL)
            head, _, attr = token.partition(".")
            if attr:
                home = class_home.get(head)
                if home is None or attr not in defs[home][1][head]:
                    missing.append(f"step {step}: {token}")
                current = home or current
            elif current is None or not _defined_in(defs[current], token):
                missing.append(f"step {step}: {token} (in {current})")
    assert not missing, "named in docs/architecture.md but not defined there:\n" + "\n".join(missing)


def _defined_in(definitions: tuple[set[str], dict[str, set[str]]], name: str) -> bool:
    top, classes = definitions
    return name in top or any(name in members for members in classes.values())


def _class_members() -> dict[str, set[str]]:
    """Every class of the packages and the benchmarks by name, with the names its body defines,
    the attributes its methods set on ``self``, and (by base name) what its bases define."""
    own: dict[str, set[str]] = {}
    bases: dict[str, set[str]] = {}
    for folder in (*FOLDERS, "benchmarks"):
        for path in sorted((ROOT / folder).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if not isinstance(node, ast.ClassDef):
                    continue
                members = own.setdefault(node.name, set())
                bases.setdefault(node.name, set()).update(
                    getattr(base, "id", getattr(base, "attr", "")) for base in node.bases)
                for item in node.body:
                    if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                        members.add(item.name)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                        members.add(item.target.id)
                    elif isinstance(item, ast.Assign):
                        members |= {t.id for t in item.targets if isinstance(t, ast.Name)}
                members |= {sub.attr for sub in ast.walk(node)
                            if isinstance(sub, ast.Attribute) and isinstance(sub.ctx, ast.Store)
                            and isinstance(sub.value, ast.Name) and sub.value.id == "self"}

    def closure(name: str, seen: set[str]) -> set[str]:
        if name in seen:
            return set()
        seen.add(name)
        found = set(own.get(name, ()))
        for base in bases.get(name, ()):
            found |= closure(base, seen)
        return found

    return {name: closure(name, set()) for name in own}


def test_every_class_member_the_docs_name_exists():
    """``Class.member`` in README.md and docs/*.md, where Class is one of the project's
    classes, names something that class (or a base) defines; every ``layer/.../file.py`` or
    ``docs/x.md`` named exists."""
    members = _class_members()
    wrong = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for number, line in enumerate(doc.read_text().splitlines(), 1):
            where = f"{doc.relative_to(ROOT)}:{number}"
            for head, attr in re.findall(r"`([A-Z]\w*)\.([A-Za-z_]\w*)(?:\(\))?`", line):
                if head in members and not attr.startswith("__") and attr not in members[head]:
                    wrong.append(f"{where}: {head}.{attr}")
            for path in re.findall(r"`((?:agentrt|interpreter|tools|engine|kernels|benchmarks|"
                                   r"tests|docs)/[\w/.-]+\.(?:py|md))`", line):
                if not (ROOT / path).is_file():
                    wrong.append(f"{where}: {path} does not exist")
    assert not wrong, "named in the docs but not in the code:\n" + "\n".join(wrong)
