"""The core library's import rules, checked statically over the source tree (no imports run).

- `rollart/` never imports Prefect nor the orchestration packages (`blocks`, `flows`, `tasks`,
  `infra`, `cli`): everything in the core runs, and is tested, without a Prefect server.
- `rollart/` has no import cycle, counting imports inside functions and
  `importlib.import_module("...")` with a literal name (a lazy import hides a cycle, it does not
  remove it); imports under `if TYPE_CHECKING:` never run and are not counted.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("prefect", "prefect_dask", "prefect_aws", "blocks", "flows", "tasks", "infra", "cli")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def imported_names(path: Path, package: str = "") -> list[str]:
    """Every module name `path` imports (absolute, dotted; `from a import b` gives a and a.b);
    `package` resolves relative imports."""
    tree = ast.parse(path.read_text(), str(path))
    skip: set[int] = set()
    for node in ast.walk(tree):  # the bodies of `if TYPE_CHECKING:` never run
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    names: list[str] = []
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            names.extend(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            names.append(mod)
            names.extend(f"{mod}.{a.name}" for a in node.names)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr == "import_module" and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            names.append(node.args[0].value)
    return names


def core_modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted((ROOT / "rollart").rglob("*.py"))}


def import_graph() -> dict[str, set[str]]:
    """Edges between core modules: to the deepest module a name resolves to, and to the
    packages above it (importing `a.b.c` runs `a/b/__init__.py` first), except the importer's
    own packages (already initialised when it runs)."""
    mods = core_modules()
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for name in imported_names(path, package):
            target = next((c for c in (name, name.rpartition(".")[0]) if c in mods), None)
            if target is None or target == mod:
                continue
            graph[mod].add(target)
            parts = target.split(".")
            for i in range(1, len(parts)):
                pkg = ".".join(parts[:i])
                if pkg in mods and not (mod + ".").startswith(pkg + "."):
                    graph[mod].add(pkg)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_core_never_imports_orchestration() -> None:
    bad = [f"{mod} imports {name}" for mod, path in core_modules().items()
           for name in imported_names(path) if name.split(".")[0] in FORBIDDEN]
    assert not bad, "rollart/ must not import Prefect or the orchestration packages:\n" + \
        "\n".join(bad)


def test_core_has_no_import_cycle() -> None:
    found = cycles(import_graph())
    assert not found, "import cycles in rollart/:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """The detectors themselves: a planted cycle and a planted Prefect import are found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import flows\n"
                   "def f():\n    import prefect.blocks\n"
                   "    importlib.import_module('blocks.secrets')\n")
    names = imported_names(src)
    assert "prefect.blocks" in names and "blocks.secrets" in names and "flows" not in names
