"""The code's layout: imports point one way (docs/architecture.md), and no module or function grows
past what one reading holds.

Every import statement of ``orchestrator/`` and ``agents/`` counts, wherever it stands: at the top,
inside a function (a lazy import is still a dependency) or under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

#: The packages of ``orchestrator`` in the order of the job's path: a module may import its own
#: package and the ones before it, never one after it (``errors`` is the shared leaf).
ORDER = ("errors", "launchers", "spec", "planning", "checkpoints", "store", "observe", "provisioners",
         "supervision", "face")
#: Work without effects: no processes, sockets, databases or threads, tested without any.
PURE = ("launchers", "spec", "planning")
#: What a pure package must not import (standard library and third-party modules with effects).
EFFECTFUL_LIBRARIES = ("subprocess", "socket", "sqlite3", "threading", "multiprocessing", "concurrent", "asyncio",
                       "signal", "fcntl", "psutil", "paramiko", "ray", "httpx", "uvicorn", "fastapi",
                       "prometheus_client")
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def _modules() -> dict[str, Path]:
    """``{dotted module name: path}`` of every module of orchestrator/ and agents/."""
    out = {}
    for top in ("orchestrator", "agents"):
        for path in sorted((ROOT / top).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _package_of(module: str, path: Path) -> str:
    """The dotted package a module's relative imports start from."""
    return module if path.name == "__init__.py" else module.rpartition(".")[0]


def _imports(module: str, path: Path) -> list[tuple[str, int]]:
    """``[(imported name, line)]``: modules of this repository resolved to the module imported
    (``from pkg import mod`` is ``pkg.mod``), other names as written (``subprocess``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(alias.name, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module, path).split(".")
                base = base[:len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                out.append((sub if sub in MODULES else target, node.lineno))
    return out


def _graph() -> dict[str, list[tuple[str, int]]]:
    return {m: [(t, line) for t, line in _imports(m, p) if t in MODULES and t != m] for m, p in MODULES.items()}


def _cycles(graph: dict[str, list[tuple[str, int]]]) -> list[list[str]]:
    """Every strongly connected set of more than one module (Tarjan), each as a path that closes."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w, _ in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            members = []
            while True:
                w = stack.pop()
                members.append(w)
                if w == v:
                    break
            if len(members) > 1:
                found.append(sorted(members))

    for v in graph:
        if v not in index:
            visit(v)
    return found


def _ring(graph: dict[str, list[tuple[str, int]]], members: list[str]) -> str:
    """One shortest import path from the first of ``members`` back to itself, with each import's line:
    ``a -> b (b.py:3) -> a (a.py:7)``."""
    start, inside = members[0], set(members)
    came: dict[str, tuple[str, int]] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w, line in graph[v]:
                if w in inside and w not in came:
                    came[w] = (v, line)
                    nxt.append(w)
        if start in came:
            break
        frontier = nxt
    path, at = [], start
    while True:
        v, line = came[at]
        path.append(f"{at} ({MODULES[v].relative_to(ROOT)}:{line})")
        at = v
        if at == start:
            break
    return " -> ".join([start] + path[::-1])


def _layer(module: str) -> str | None:
    """The package of ``orchestrator`` a module belongs to (``errors`` for the shared leaf); None for the
    root package, ``__main__`` and agents."""
    parts = module.split(".")
    if parts[0] != "orchestrator" or len(parts) == 1 or parts[1] == "__main__":
        return None
    return parts[1]


def layering_problems(graph: dict[str, list[tuple[str, int]]]) -> list[str]:
    """Each import that points against :data:`ORDER`, or out of ``agents`` into ``orchestrator``."""
    problems = []
    for module, targets in sorted(graph.items()):
        where = MODULES[module].relative_to(ROOT)
        mine = _layer(module)
        for target, line in targets:
            theirs = _layer(target)
            if module.startswith("agents") and target.startswith("orchestrator") and target != "orchestrator":
                problems.append(f"{where}:{line}: agents import {target}; the node side may import only agents "
                                "and the root package orchestrator (its __version__)")
            elif target == "orchestrator.__main__":
                problems.append(f"{where}:{line}: nothing imports orchestrator.__main__")
            elif mine is not None and mine in PURE and target.startswith("agents"):
                problems.append(f"{where}:{line}: {mine} is pure but imports {target}")
            elif mine is not None and theirs is not None and ORDER.index(theirs) > ORDER.index(mine):
                problems.append(f"{where}:{line}: {mine} imports {target}, but {theirs} comes after {mine} "
                                f"(order: {' < '.join(ORDER)})")
    return problems


def test_every_package_has_a_place_and_says_what_it_may_import() -> None:
    for path in sorted((ROOT / "orchestrator").iterdir()):
        if path.is_dir() and (path / "__init__.py").exists():
            assert path.name in ORDER, f"orchestrator/{path.name} is a package not placed in ORDER"
            doc = ast.get_docstring(ast.parse((path / "__init__.py").read_text())) or ""
            assert "May import:" in doc, f"orchestrator/{path.name}/__init__.py: its docstring says what it may import"
        elif path.suffix == ".py":
            assert path.stem in ("__init__", "__main__", "errors"), \
                f"orchestrator/{path.name} is a module outside every package; put it in one"


def test_no_import_cycle() -> None:
    graph = _graph()
    cycles = _cycles(graph)
    assert not cycles, "import cycles: " + "; ".join(_ring(graph, c) for c in cycles)


def test_imports_point_one_way() -> None:
    problems = layering_problems(_graph())
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("package", PURE)
def test_pure_packages_import_nothing_with_effects(package: str) -> None:
    found = [f"{MODULES[m].relative_to(ROOT)}:{line}: {name}" for m in MODULES if _layer(m) == package
             for name, line in _imports(m, MODULES[m]) if name.split(".")[0] in EFFECTFUL_LIBRARIES]
    assert not found, f"{package} is pure, but imports: " + ", ".join(found)


def test_the_checks_catch_what_they_are_for() -> None:
    """The checks themselves: a spec module importing the provisioners, a cycle, agents reaching into
    the controller side, each found."""
    graph = {m: list(t) for m, t in _graph().items()}
    graph["orchestrator.spec.jobspec"].append(("orchestrator.provisioners", 1))
    assert any("spec imports orchestrator.provisioners, but provisioners comes after spec" in p
               for p in layering_problems(graph))
    graph["orchestrator.store.states"].append(("orchestrator.store.sqlite", 1))
    assert ["orchestrator.store.sqlite", "orchestrator.store.states"] in _cycles(graph)
    graph["agents.ranks"].append(("orchestrator.supervision", 1))
    assert any("agents import orchestrator.supervision" in p for p in layering_problems(graph))
def test_modules_and_functions_stay_short() -> None:
    long_modules, long_functions = [], []
    for path in MODULES.values():
        text = path.read_text()
        if text.count("\n") > MAX_MODULE_LINES:
            long_modules.append(f"{path.relative_to(ROOT)} ({text.count(chr(10))} lines)")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    long_functions.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long_modules, f"modules over {MAX_MODULE_LINES} lines: {', '.join(long_modules)}"
    assert not long_functions, f"functions over {MAX_FUNCTION_LINES} lines: {', '.join(long_functions)}"
