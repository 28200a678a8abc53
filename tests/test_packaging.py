"""The distribution installs one top-level import name, ``trident``, and works installed, not just in the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the tracked files: setuptools writes build/ and *.egg-info into the source tree.
    source = tmp_path_factory.mktemp("source")
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    for name in tracked:
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    # No build isolation: the build backend (setuptools) is already here, and CI must not need to fetch it.
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)]
    subprocess.run(cmd, check=True, capture_output=True, timeout=300)
    (path,) = out.glob("*.whl")
    return path


@pytest.mark.multiprocess  # the wheel fixture builds it with pip in a subprocess
def test_wheel_has_one_top_level_name(wheel: Path) -> None:
    assert wheel.name.startswith("trident_pretrain-")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"trident"}, top
    for module in ("trident/parallel/topology.py", "trident/models/gpt.py", "trident/data/prepare.py"):
        assert module in names, module


@pytest.mark.multiprocess
def test_installed_wheel_imports_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    code = (
        "import trident.parallel.topology as t, trident.models.gpt as g, trident.loop;"
        "print(t.__file__); print(g.__file__)"
    )
    # PYTHONPATH comes before site-packages, where the editable install of the checkout lives; the
    # assertion below proves the installed copy is the one imported.
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    assert all(line.startswith(str(target)) for line in proc.stdout.split()), proc.stdout
    for bare in ("parallel", "models"):
        assert not (target / bare).exists()


def test_tools_do_not_edit_sys_path() -> None:
    for tool in (REPO / "tools").glob("*.py"):
        assert "sys.path" not in tool.read_text(), tool


@pytest.mark.multiprocess
def test_ruff_bans_the_bare_package_names(tmp_path: Path) -> None:
    """The lint rule is what keeps a stray ``from parallel.x import y`` out; prove it fires on one."""
    bad = tmp_path / "bad.py"
    bad.write_text("from parallel.topology import Topology\nimport models\n\nprint(Topology, models)\n")
    cmd = [sys.executable, "-m", "ruff", "check", "--config", str(REPO / "pyproject.toml"), "--select", "TID251"]
    proc = subprocess.run([*cmd, str(bad)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 1
    assert proc.stdout.count("TID251") == 2, proc.stdout
    clean = subprocess.run([*cmd, str(REPO)], capture_output=True, text=True, timeout=60)
    assert clean.returncode == 0, clean.stdout


def test_parallel_never_imports_the_product_above_it() -> None:
    """parallel/ sits below the product: its modules import torch and each other, never trident.<product>."""
    import ast

    for path in (REPO / "parallel").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            else:
                continue
            for name in names:
                if name.startswith("trident"):
                    assert name.startswith("trident.parallel"), f"{path.relative_to(REPO)} imports {name}"
