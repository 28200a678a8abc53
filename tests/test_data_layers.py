"""trident/data/__init__.py lists every module of the package, and each imports only modules listed above it: the
config's path through data preparation and reading runs one way (nothing below prepare.py calls back into it)."""

from __future__ import annotations

import ast
import re

import trident.data
from tests.helpers import REPO

DATA = REPO / "trident" / "data"


def listed() -> list[str]:
    """The modules the package's docstring lists, in its order."""
    return re.findall(r"^    (\w+)  ", trident.data.__doc__ or "", flags=re.MULTILINE)


def data_imports(name: str) -> set[str]:
    """The trident.data modules ``name`` imports."""
    tree = ast.parse((DATA / f"{name}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("trident.data."):
            found.add(node.module.split(".")[2])
        elif isinstance(node, ast.Import):
            found |= {a.name.split(".")[2] for a in node.names if a.name.startswith("trident.data.")}
    return found


def test_the_package_docstring_lists_every_module() -> None:
    modules = sorted(p.stem for p in DATA.glob("*.py") if p.stem != "__init__")
    assert sorted(listed()) == modules


def test_each_module_imports_only_modules_listed_above_it() -> None:
    order = listed()
    for i, name in enumerate(order):
        below = data_imports(name) - set(order[:i])
        assert not below, f"trident/data/{name}.py imports {sorted(below)}, listed below it"
