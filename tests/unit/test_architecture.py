"""The core library's import rules, checked statically over the source tree (no imports run).

- `rollart/` never imports Prefect nor the orchestration packages (`blocks`, `flows`, `tasks`,
  `infra`, `cli`): everything in the core runs, and is tested, without a Prefect server.
- `rollart/` has no import cycle, counting imports inside functions and
  `importlib.import_module("...")` with a literal name (a lazy import hides a cycle, it does not
  remove it); imports under `if TYPE_CHECKING:` never run and are not counted.
- Inside `rollart/`: the run package (`rollart.runner`: driver, stages, lifecycle, recovery, the
  two modes) may import every other part; nothing outside it imports it. The config package
  (`rollart.config`) imports nothing of rollart but itself and the few leaf modules its
  validators need (`CONFIG_MAY_IMPORT`), so every package can import the config.
- Between the top-level packages, each imports only those below it (`LAYERS`): `tasks` never
  imports `flows`; `blocks` and `infra` never import `flows`, `tasks` or `cli`; `flows` never
  imports `cli`.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = ("prefect", "prefect_dask", "prefect_aws", "blocks", "flows", "tasks", "infra", "cli")
RUNNER = "rollart.runner"
CONFIG = "rollart.config"
# What the config's validators import outside the config package (modules and the packages
# above them, which run first): CPU lists, the hardware catalog, the reward handler registry.
CONFIG_MAY_IMPORT = frozenset({
    "rollart.cpu_pinning", "rollart.routing", "rollart.routing.catalog", "rollart.rewards",
    "rollart.rewards.registry"})
# Top-level package -> the top-level packages it must never import.
LAYERS = {
    "tasks": ("flows", "cli"),
    "blocks": ("flows", "tasks", "cli"),
    "infra": ("flows", "tasks", "cli"),
    "flows": ("cli",),
}


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


def _inside(mod: str, pkg: str) -> bool:
    return mod == pkg or mod.startswith(pkg + ".")


def runner_violations(graph: dict[str, set[str]]) -> list[str]:
    return [f"{mod} imports {t}" for mod, targets in sorted(graph.items())
            if not _inside(mod, RUNNER) for t in sorted(targets) if _inside(t, RUNNER)]


def config_violations(graph: dict[str, set[str]]) -> list[str]:
    return [f"{mod} imports {t}" for mod, targets in sorted(graph.items())
            if _inside(mod, CONFIG) for t in sorted(targets)
            if not _inside(t, CONFIG) and t not in CONFIG_MAY_IMPORT]


def layer_violations(root: Path = ROOT) -> list[str]:
    bad = []
    for pkg, forbidden in sorted(LAYERS.items()):
        for path in sorted((root / pkg).rglob("*.py")):
            mod = ".".join(path.relative_to(root).with_suffix("").parts)
            package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
            bad += [f"{mod} imports {name}" for name in imported_names(path, package)
                    if name.split(".")[0] in forbidden]
    return bad


def test_nothing_outside_the_runner_imports_it() -> None:
    bad = runner_violations(import_graph())
    assert not bad, f"only {RUNNER} may import {RUNNER}:\n" + "\n".join(bad)


def test_config_imports_only_its_validators_needs() -> None:
    bad = config_violations(import_graph())
    assert not bad, (f"{CONFIG} may import, outside itself, only {sorted(CONFIG_MAY_IMPORT)}:\n"
                     + "\n".join(bad))


def test_top_level_packages_import_only_those_below() -> None:
    bad = layer_violations()
    assert not bad, "imports against the package layers (LAYERS):\n" + "\n".join(bad)


def test_the_checks_can_fail(tmp_path: Path) -> None:
    """The detectors themselves: a planted cycle and a planted Prefect import are found."""
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    src = tmp_path / "m.py"
    src.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import flows\n"
                   "def f():\n    import prefect.blocks\n"
                   "    importlib.import_module('blocks.secrets')\n")
    names = imported_names(src)
    assert "prefect.blocks" in names and "blocks.secrets" in names and "flows" not in names
    graph = {"rollart.rollout.service": {"rollart.runner.driver"},
             "rollart.runner.driver": {"rollart.config"},
             "rollart.config.run": {"rollart.routing.catalog", "rollart.storage.store"}}
    assert runner_violations(graph) == ["rollart.rollout.service imports rollart.runner.driver"]
    assert config_violations(graph) == ["rollart.config.run imports rollart.storage.store"]
    for pkg, line in (("tasks", "from flows.train import train"),
                      ("blocks", "import tasks.stages"), ("infra", "from cli import main"),
                      ("flows", "from cli.main import app")):
        (tmp_path / pkg).mkdir()
        (tmp_path / pkg / "m.py").write_text(line + "\n")
    assert {v.split()[0] for v in layer_violations(tmp_path)} == {
        "tasks.m", "blocks.m", "infra.m", "flows.m"}
    (tmp_path / "flows" / "m.py").write_text("from tasks.stages import collect\n")
    assert "flows.m" not in {v.split()[0] for v in layer_violations(tmp_path)}
