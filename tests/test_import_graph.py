"""The package's shape (docs/architecture.md): no import cycle, no upward import, empty
subpackage __init__ files, and the light entry points stay light.  Read from the source
with ast, so an import inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "perfectschedd"

# Each folder's (and top-level module's) layer: a module may import its own layer and
# those below, never above.  A folder is one layer, whatever its modules: a module that
# must sit lower moves to a lower folder (vocabulary/, settings/), no list of exceptions.
LAYERS: dict[str, int] = {
    "errors": 0,
    "fdguard": 0,
    "logsetup": 0,
    "paths": 0,  # the config's default paths; perfectschedctl needs the socket's
    "secretfile": 0,  # secrets in files: the config and the notifiers read them
    "vocabulary": 0,  # fields, outcomes, states, the history row, tokens: every layer's words
    "settings": 1,  # the checks of a route's and a notifier's settings
    "config": 2,
    "__init__": 2,  # the version and the lazy public names
    "store": 3,
    "metrics": 3,
    "schedules": 4,
    "executors": 4,
    "control": 5,
    "notify": 5,
    "worker": 6,
    "web": 6,  # the master's HTTP side: the control layer's commands over HTTP
    "master": 7,
    "__main__": 8,
}
# A module's lazy names (perfectschedd.__getattr__) load the library API on first use;
# they are a door for users, not a dependency of the package's own layers.
LAZY_DOOR = "perfectschedd"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    """The layer of the folder (or top-level module) `module` is in."""
    parts = module.split(".")
    return LAYERS["__init__" if len(parts) == 1 else parts[1]]


def imports_of(module: str) -> set[str]:
    """The package's modules that `module` imports, anywhere in it."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base
                     for a in node.names]
        else:
            continue
        found.update(n for n in names if n in MODULES and n != module)
    return found


GRAPH = {m: imports_of(m) for m in MODULES}


def upward_imports(graph: Mapping[str, set[str]]) -> list[str]:
    """Each import of a module from a layer above its own."""
    return sorted(f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
                  for m, targets in graph.items() if m != LAZY_DOOR
                  for t in targets if layer(t) > layer(m))


def cycles_in(graph: Mapping[str, set[str]]) -> list[str]:
    """The import cycles of `graph` (the lazy door's imports left out), one path each."""
    graph = {m: t - {LAZY_DOOR} if m != LAZY_DOOR else set() for m, t in graph.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph.get(m, ())):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    return cycles


def test_every_module_is_in_a_folder_or_top_level_module_with_a_layer() -> None:
    assert all(m == "perfectschedd" or m.startswith("perfectschedd.") for m in MODULES)
    assert len(MODULES) > 40
    tops = {m.split(".")[1] for m in MODULES if "." in m}
    assert tops <= set(LAYERS), tops - set(LAYERS)
    assert set(LAYERS) - {"__init__"} <= tops, "a layer names no folder or module"


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    assert upward_imports(GRAPH) == []


def test_there_is_no_import_cycle() -> None:
    assert cycles_in(GRAPH) == []


def test_the_checkers_see_a_made_up_cycle_and_upward_import() -> None:
    """The two checks above, shown what they must catch: a cycle of three modules inside
    one layer, and the store importing the master."""
    made_up = {**GRAPH,
               "perfectschedd.store.sql": GRAPH["perfectschedd.store.sql"]
               | {"perfectschedd.master.supervisor"},
               "perfectschedd.schedules.cron": {"perfectschedd.schedules.policy"},
               "perfectschedd.schedules.policy": {"perfectschedd.schedules.preview"},
               "perfectschedd.schedules.preview": {"perfectschedd.schedules.cron"}}
    assert upward_imports(made_up) == [
        "perfectschedd.store.sql (layer 3) imports perfectschedd.master.supervisor (layer 7)"]
    assert "perfectschedd.schedules.cron -> perfectschedd.schedules.policy -> " \
        "perfectschedd.schedules.preview -> perfectschedd.schedules.cron" in cycles_in(made_up)
    # ... and what the package really holds is read: the store is imported by the API.
    assert "perfectschedd.store.sql" in GRAPH["perfectschedd.schedules.collection"]


def test_subpackage_init_files_are_empty() -> None:
    """Importing one module of a subpackage loads that module's imports only."""
    inits = [p for p in PACKAGE.rglob("__init__.py") if p.parent != PACKAGE]
    assert inits and all(p.read_text().strip() == "" for p in inits), inits


@pytest.mark.parametrize("module", [
    "perfectschedd.control.protocol", "perfectschedctl.cli", "perfectschedd.config",
    "perfectschedd.schedules.from_crontab",
])
def test_light_entry_points_load_no_heavy_library(module: str) -> None:
    """The client, the protocol and the crontab importer talk to no database and no
    bus: SQLAlchemy and dbus-next would double the client's start."""
    code = (f"import sys, {module}\n"
            "print(sorted({m.split('.')[0] for m in sys.modules}"
            " & {'sqlalchemy', 'dbus_next'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True).stdout
    assert out.strip() == "[]"


def test_every_name_read_from_a_package_module_exists() -> None:
    """`module.NAME` where `module` is one of ours imported by name: NAME is there.  No
    linter sees it, and a name moved or renamed breaks only the path that reads it (the
    API's `next` answered 500 once, when a bound was renamed)."""
    import importlib

    missing = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        imported = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (
                    node.module or "").startswith("perfectschedd"):
                for a in node.names:
                    if f"{node.module}.{a.name}" in MODULES:
                        imported[a.asname or a.name] = f"{node.module}.{a.name}"
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                    and node.value.id in imported and isinstance(node.ctx, ast.Load):
                target = importlib.import_module(imported[node.value.id])
                if not hasattr(target, node.attr) and \
                        f"{imported[node.value.id]}.{node.attr}" not in MODULES:
                    missing.append(f"{module}:{node.lineno}: {node.value.id}.{node.attr}")
    assert missing == []


def test_the_bench_scripts_import_names_that_exist() -> None:
    """bench/ runs no test: a name it imports from the package that has moved (the
    lease pipeline's split moved HISTORY_FLUSH) breaks `make bench` unseen."""
    import importlib

    missing = []
    for path in sorted((PACKAGE.parent / "bench").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (
                    node.module or "").startswith("perfectschedd"):
                target = importlib.import_module(node.module or "")
                missing += [f"bench/{path.name}:{node.lineno}: {node.module}.{a.name}"
                            for a in node.names if not hasattr(target, a.name)
                            and f"{node.module}.{a.name}" not in MODULES]
    assert missing == []
