"""The package's shape (docs/architecture.md): no import cycle, no upward import, empty
subpackage __init__ files, and the light entry points stay light.  Read from the source
with ast, so an import inside a function counts as much as one at the top."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "perfectschedd"

# Each module's layer: it may import its own layer and those below, never above.  The
# longest matching prefix decides.  Field limits and the checks of a route's user and
# unit settings sit low because the config (read by everyone) uses them.
LAYERS: dict[str, int] = {
    "perfectschedd.errors": 0,
    "perfectschedd.fdguard": 0,
    "perfectschedd.logsetup": 0,
    "perfectschedd.paths": 0,  # the config's default paths; perfectschedctl needs the socket's
    "perfectschedd.secretfile": 0,  # secrets in files: the config and the notifiers read them
    "perfectschedd.vocabulary": 0,  # fields, states, tokens: the words every layer uses
    "perfectschedd.settings": 1,  # the checks of a route's and a notifier's settings
    "perfectschedd.config": 2,
    "perfectschedd": 2,  # __init__: the version and the lazy public names
    "perfectschedd.store": 3,
    "perfectschedd.metrics": 3,
    "perfectschedd.schedules": 4,
    "perfectschedd.executors": 4,
    "perfectschedd.control": 5,
    "perfectschedd.notify": 5,
    "perfectschedd.worker": 6,
    "perfectschedd.web": 6,  # the master's HTTP side: the control layer's commands over HTTP
    "perfectschedd.master": 7,
    "perfectschedd.__main__": 8,
}
# A module's lazy names (perfectschedd.__getattr__) load the library API on first use;
# they are a door for users, not a dependency of the package's own layers.
LAZY_DOOR = "perfectschedd"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def layer(module: str) -> int:
    best = max((p for p in LAYERS if module == p or module.startswith(p + ".")), key=len)
    return LAYERS[best]


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


def test_every_module_has_a_layer() -> None:
    assert all(m == "perfectschedd" or m.startswith("perfectschedd.") for m in MODULES)
    assert len(MODULES) > 40


def test_no_module_imports_from_a_layer_above_its_own() -> None:
    upward = sorted(f"{m} (layer {layer(m)}) imports {t} (layer {layer(t)})"
                    for m, targets in GRAPH.items() if m != LAZY_DOOR
                    for t in targets if layer(t) > layer(m))
    assert upward == []


def test_there_is_no_import_cycle() -> None:
    graph = {m: t - {LAZY_DOOR} if m != LAZY_DOOR else set() for m, t in GRAPH.items()}
    cycles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for t in sorted(graph[m]):
            if state.get(t) == 1:
                cycles.append(" -> ".join(path[path.index(t):] + [t]))
            elif t not in state:
                visit(t, path + [t])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [m])
    assert cycles == []


def test_the_checker_sees_a_cycle_and_an_upward_import() -> None:
    """The two rules above on a made-up graph: they would fail if the package broke them."""
    assert layer("perfectschedd.store.sql") < layer("perfectschedd.control.server")
    assert layer("perfectschedd.vocabulary.fields") == 0
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
