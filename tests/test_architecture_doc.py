"""docs/architecture.md against the tree, as test_docs.py holds the man pages to the
code: its table of folders names every module of each folder (and no module that is
gone), its layer table is the import-graph test's, and every path it or the other docs
name in backticks exists."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from test_import_graph import LAYERS

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "perfectschedd"
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
# Paths the docs name: a top folder of the repository or of the package, then a file.
PATH = re.compile(r"`((?:perfectschedd/|perfectschedctl/|tests/|bench/|docs/|etc/|packaging/)?"
                  r"(?:[a-z_]+/)*[a-z_]+\.(?:py|md|yml|sh))(?:::[\w:]+)?`")
TOP_FOLDERS = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}


def _table(heading: str) -> list[list[str]]:
    """The rows of the first table after `heading`, as lists of cells."""
    section = ARCHITECTURE.split(heading, 1)[1]
    rows = re.findall(r"^\|(.+)\|$", section.split("\n\n|", 1)[1].split("\n\n")[0]
                      if not section.lstrip().startswith("|") else section, re.M)
    return [[c.strip() for c in r.split("|")] for r in rows if not set(r) <= set("-| ")]


def _folder_rows() -> dict[str, str]:
    rows = {}
    for cells in _table("## Subpackages, by who runs them"):
        folder = re.fullmatch(r"`(\w+)/`", cells[0])
        if folder:
            rows[folder.group(1)] = cells[1]
    return rows


def _modules_named(cell: str, folder: str) -> set[str]:
    """The modules a row names: `a.py`, and `x/`: `b.py` for a subfolder's."""
    named: set[str] = set()
    for part in re.split(r";\s*", cell):
        sub = re.match(r"`(\w+)/`:", part)
        prefix = f"{sub.group(1)}/" if sub else ""
        named.update(prefix + m for m in re.findall(r"`(\w+\.py)`", part))
        named.update(f"{s}/" for s in re.findall(r"`(\w+)/`(?!:)", part))
    return {f"{folder}/{n}" for n in named}


def test_the_folder_table_names_every_module_and_only_real_ones() -> None:
    rows = _folder_rows()
    wrong: list[str] = []
    assert set(rows) == TOP_FOLDERS | {"perfectschedctl"}, set(rows) ^ TOP_FOLDERS
    for folder, cell in rows.items():
        base = ROOT if folder == "perfectschedctl" else PACKAGE
        named = _modules_named(cell, folder)
        real = {str(p.relative_to(base)) for p in (base / folder).rglob("*.py")
                if p.name != "__init__.py"}
        subfolders = {f"{folder}/{p.name}/" for p in (base / folder).iterdir()
                      if p.is_dir() and p.name != "__pycache__"}
        # A `sub/` named of a real subfolder lists it whole; another folder's name is a
        # reference (`web/` in the control row), not a claim about this one.
        named = {n for n in named if not n.endswith("/") or n in subfolders}
        listed_whole = {m for m in real for s in named if s.endswith("/") and m.startswith(s)}
        wrong += [f"gone: {m}" for m in sorted(named - real - subfolders)]
        wrong += [f"not named: {m}" for m in sorted(real - named - listed_whole)]
    assert wrong == [], "\n".join(wrong)


def test_the_layer_table_is_the_import_graph_tests() -> None:
    documented = {}
    for cells in _table("Layers (a module imports"):
        if cells[0].isdigit():
            for name in re.findall(r"`(\w+)/?`", cells[1]):
                documented[name] = int(cells[0])
    expected = {k: v for k, v in LAYERS.items() if k not in ("__init__", "__main__")}
    documented.pop("perfectschedd", None)
    assert documented == expected


@pytest.mark.parametrize("doc", sorted(p.name for p in (ROOT / "docs").glob("*.md")))
def test_every_path_a_doc_names_exists(doc: str) -> None:
    text = (ROOT / "docs" / doc).read_text()
    missing = []
    for path in sorted(set(PATH.findall(text))):
        first = path.split("/")[0]
        if "/" not in path:
            continue  # a bare file name: its folder is said around it
        candidates = [ROOT / path, PACKAGE / path]
        if first not in TOP_FOLDERS | {"perfectschedd", "perfectschedctl", "tests", "bench",
                                       "docs", "etc", "packaging"}:
            continue  # not a path of this repository (/etc/..., a user's file)
        if not any(c.exists() for c in candidates):
            missing.append(path)
    assert missing == [], f"docs/{doc} names paths that do not exist: {missing}"
