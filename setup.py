"""The packages are found, not listed: trident/ and every package under it, and the repo's top-level parallel/ and
models/ with theirs, which install as trident.parallel and trident.models (so ``trident`` is the only top-level
name in site-packages). Everything else about the distribution is in pyproject.toml."""

from setuptools import find_packages, setup

ROOTS = {"trident": "trident", "trident.parallel": "parallel", "trident.models": "models"}

packages = []
for name, folder in ROOTS.items():
    packages += [name, *(f"{name}.{sub}" for sub in find_packages(folder))]

setup(package_dir=ROOTS, packages=packages)
