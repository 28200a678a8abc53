"""One thing, one name: no two public classes or functions defined in different modules of the package share a
name, so a name read anywhere (an import, a traceback, a docstring) says which one it is."""

from __future__ import annotations

import importlib
import inspect
import pkgutil
from collections import defaultdict
from types import ModuleType

import trident
import trident.models
import trident.parallel
import trident_dev


def package_modules() -> list[ModuleType]:
    """Every module of trident, trident.parallel and trident.models, and of the development package beside them
    (trident_dev). Each package is walked from its own directory only: in a checkout, trident's path also holds the
    repository root (trident/__init__.py), whose tests/ and tools/ are no part of the package."""
    names = set()
    for package in (trident, trident.parallel, trident.models, trident_dev):
        names.add(package.__name__)
        names.update(m.name for m in pkgutil.walk_packages(package.__path__[:1], package.__name__ + "."))
    return [importlib.import_module(name) for name in sorted(names)]


def is_bench_subcommand(module: ModuleType) -> bool:
    """A module of ``tools/bench.py``'s subcommands: each has the same shape (``add_arguments``, ``run``, its own
    ``Job`` and table helpers), is loaded by the tool by its module name, and none imports another's names, so
    the names they share among themselves are one interface, not two things under one name."""
    return module.__name__.startswith("trident_dev.bench.") and hasattr(module, "add_arguments")


def test_no_two_modules_define_a_public_class_or_function_of_the_same_name() -> None:
    defined: dict[str, set[str]] = defaultdict(set)
    subcommands = set()
    for module in package_modules():
        if is_bench_subcommand(module):
            subcommands.add(module.__name__)
        for name, obj in vars(module).items():
            is_own = (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ == module.__name__
            if is_own and not name.startswith("_"):  # a re-export's __module__ is the module that defines it
                defined[name].add(module.__name__)
    assert len(subcommands) >= 2  # the exemption below still matches the bench's subcommands
    shared = {
        name: sorted(modules) for name, modules in defined.items() if len(modules) > 1 and not modules <= subcommands
    }
    assert not shared, f"one name for different things (rename one, or say here why it is right): {shared}"
    assert defined["Placement"] == {"trident.parallel.placement"}  # the walk reached the subpackages
