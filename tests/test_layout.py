"""The package's import rules: no cycle, no import of an entry point, floors one way.

docs/design.md "Code layout" states them.

Reads the source with ``ast`` (nothing is imported), so it is fast and sees
imports inside functions too. Importing ``a.b.c`` from outside package ``a.b``
also runs ``a/b/__init__.py``: that counts as an import of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "ckless_lightning"
ROOT = Path(__file__).resolve().parents[1] / PACKAGE

ENTRY_POINTS = {
    f"{PACKAGE}.rank",
    f"{PACKAGE}.spare",
    f"{PACKAGE}.forkserver",
    f"{PACKAGE}.run",
    f"{PACKAGE}.report",
    f"{PACKAGE}.store",
    f"{PACKAGE}.data.cache_reader",
}
# Floors, top down: entry points (4) use the job runners (3: the launcher's core ``cli``, which
# launch.py and the runner share; the rank's job; a script's rank; the in-process loop; the agent),
# which use the Lightning and recovery pieces (2), which use the leaves (1). Longest prefix wins.
FLOORS = {
    f"{PACKAGE}.rank": 4,
    f"{PACKAGE}.spare": 4,
    f"{PACKAGE}.forkserver": 4,
    f"{PACKAGE}.run": 4,
    f"{PACKAGE}.cli": 3,
    f"{PACKAGE}.report": 4,
    f"{PACKAGE}.store": 4,
    f"{PACKAGE}.data.cache_reader": 4,
    f"{PACKAGE}.training.job": 3,
    f"{PACKAGE}.training.rank_process": 3,
    f"{PACKAGE}.training.script_rank": 3,
    f"{PACKAGE}.recovery": 3,
    f"{PACKAGE}.recovery.loop": 3,
    f"{PACKAGE}.agent": 3,
    f"{PACKAGE}.training": 2,
    f"{PACKAGE}.recovery.memory": 2,
    f"{PACKAGE}.recovery.verify": 2,
    f"{PACKAGE}.recovery.session": 2,
    f"{PACKAGE}.recovery.commit": 2,
    f"{PACKAGE}.recovery.digest": 2,
    f"{PACKAGE}.recovery.sever": 2,
    f"{PACKAGE}.recovery.device_fault": 2,
    f"{PACKAGE}.recovery.elastic": 2,
    f"{PACKAGE}.models": 1,
    f"{PACKAGE}.replication": 1,
    f"{PACKAGE}.data": 1,
    f"{PACKAGE}.comm": 1,
    f"{PACKAGE}.runtime": 1,
    f"{PACKAGE}.record": 1,
    PACKAGE: 1,
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    return {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The package's modules that ``name`` imports (``from x import y`` counts ``x.y`` if a module)."""
    is_package = path.name == "__init__.py"
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative import
                anchor = name.split(".") if is_package else name.split(".")[:-1]
                anchor = anchor[: len(anchor) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    ours = {m for m in found if m in modules and m != name}
    # Importing a.b.c from outside a.b also runs a.b's __init__ (the root package's is trivial).
    for module in list(ours):
        parts = module.split(".")
        for i in range(2, len(parts)):
            package = ".".join(parts[:i])
            if not name.startswith(package + ".") and name != package:
                ours.add(package)
    return ours


def _floor(module: str) -> int:
    best = max((p for p in FLOORS if module == p or module.startswith(p + ".")), key=len)
    return FLOORS[best]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def test_every_module_has_a_floor(graph: dict[str, set[str]]) -> None:
    for module in graph:
        assert _floor(module) in (1, 2, 3, 4)


def test_no_module_imports_an_entry_point(graph: dict[str, set[str]]) -> None:
    offenders = sorted((m, e) for m, deps in graph.items() for e in deps & ENTRY_POINTS)
    assert not offenders, f"entry points are imported by nothing: {offenders}"


def test_imports_never_go_up_a_floor(graph: dict[str, set[str]]) -> None:
    upward = sorted(
        (m, _floor(m), d, _floor(d)) for m, deps in graph.items() for d in deps if _floor(d) > _floor(m)
    )
    assert not upward, f"(module, floor, imports, its floor) going up: {upward}"


def test_no_import_cycle(graph: dict[str, set[str]]) -> None:
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(module: str) -> None:
        state[module] = 1
        stack.append(module)
        for dep in sorted(graph[module]):
            if state.get(dep) == 1:
                cycle = [*stack[stack.index(dep) :], dep]
                raise AssertionError(f"import cycle: {' -> '.join(cycle)}")
            if dep not in state:
                visit(dep)
        stack.pop()
        state[module] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module)


def test_models_import_nothing_else_of_ours(graph: dict[str, set[str]]) -> None:
    models = f"{PACKAGE}.models"
    for module, deps in graph.items():
        if module == models or module.startswith(models + "."):
            assert all(d == models or d.startswith(models + ".") for d in deps), (module, deps)


def test_agent_and_runtime_do_not_import_lightning() -> None:
    """The agent process supervises ranks without Lightning; the runtime leaves are what it imports."""
    for sub in ("agent", "runtime", "comm", "record"):
        for path in sorted((ROOT / sub).rglob("*.py")):
            for node in ast.walk(ast.parse(path.read_text())):
                names = (
                    [a.name for a in node.names]
                    if isinstance(node, ast.Import)
                    else [node.module or ""]
                    if isinstance(node, ast.ImportFrom)
                    else []
                )
                assert not any(n == "lightning" or n.startswith("lightning.") for n in names), path


def test_the_root_holds_only_entry_points() -> None:
    loose = sorted(p.name for p in ROOT.glob("*.py"))
    assert loose == [
        "__init__.py",
        "cli.py",
        "forkserver.py",
        "rank.py",
        "report.py",
        "run.py",
        "spare.py",
        "store.py",
    ], loose
