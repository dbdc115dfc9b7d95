"""The packages import downward only (docs/ARCHITECTURE.md, "Floors").

lanegate <- vad <- engines <- lanes <- workers, gateway. The two process
packages sit on one floor and do not import each other. Every import counts,
lazy ones inside functions included.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

FLOORS: dict[str, int] = {
    "lanegate": 0,
    "vad": 1,
    "engines": 2,
    "lanes": 3,
    "workers": 4,
    "gateway": 4,
}


def imported_packages(source: str) -> set[str]:
    """The top-level packages that ``source`` imports, absolute imports only."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module.split(".")[0])
    return found


def violations(package: str, source: str) -> list[str]:
    """The imports in ``source`` (a module of ``package``) that point up or sideways."""
    floor = FLOORS[package]
    bad = []
    for target in sorted(imported_packages(source)):
        if target == package or target not in FLOORS:
            continue
        if FLOORS[target] >= floor:
            bad.append(target)
    return bad


def test_every_package_imports_downward_only() -> None:
    problems = []
    for package in FLOORS:
        for path in sorted((ROOT / package).rglob("*.py")):
            for target in violations(package, path.read_text()):
                problems.append(f"{path.relative_to(ROOT)} imports {target}")
    assert problems == []


@pytest.mark.parametrize(
    ("package", "source"),
    [
        ("engines", "from lanes.cost import CostModel\n"),
        ("lanegate", "def f():\n    from lanes.registry import list_workers\n"),
        ("gateway", "import workers.link\n"),
        ("vad", "from engines import base\n"),
    ],
)
def test_a_planted_upward_import_is_caught(package: str, source: str) -> None:
    assert violations(package, source) != []


def test_downward_and_foreign_imports_pass() -> None:
    source = "import json\nfrom lanegate.settings import Settings\nfrom engines import base\n"
    assert violations("lanes", source) == []


OURS = frozenset(FLOORS) | {"bench"}


def private_imports(source: str) -> list[str]:
    """The modules ``source`` imports from another distribution's private parts
    (a dotted name with a component that starts with ``_``)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
    return [n for n in names if n.split(".")[0] not in OURS
            and any(part.startswith("_") and part != "__future__" for part in n.split("."))]


@pytest.mark.parametrize("package", sorted(OURS))
def test_no_module_imports_a_library_private_module(package: str) -> None:
    """A private module of a dependency (``aiohttp._websocket``) may change in any
    release; the product and the bench use public names only (issue 34)."""
    found = {str(path.relative_to(ROOT)): bad for path in sorted((ROOT / package).rglob("*.py"))
             if (bad := private_imports(path.read_text()))}
    assert found == {}
