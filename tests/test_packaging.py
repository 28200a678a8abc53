"""The distribution installs one top-level import name, ``trident``, and works installed, not just in the checkout."""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.helpers import REPO
from tests.helpers.corpus import texts

# Where each source folder of the checkout lands in the installed package.
ROOTS = {"trident": "trident", "parallel": "trident/parallel", "models": "trident/models"}


def _tracked() -> list[str]:
    return subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()


def _installed_name(tracked: str) -> str | None:
    """The path a tracked file of the package has inside the wheel (None: not part of the package)."""
    root, _, rest = tracked.partition("/")
    return f"{ROOTS[root]}/{rest}" if root in ROOTS and rest else None


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    # Built from a copy of the tracked files: setuptools writes build/ and *.egg-info into the source tree.
    source = tmp_path_factory.mktemp("source")
    for name in _tracked():
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / name, source / name)
    # No build isolation: the build backend (setuptools) is already here, and CI must not need to fetch it.
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(source)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (path,) = out.glob("*.whl")
    return path


@pytest.mark.multiprocess  # the wheel fixture builds it with pip in a subprocess
def test_wheel_has_one_top_level_name_and_every_package_file(wheel: Path) -> None:
    assert wheel.name.startswith("trident_pretrain-")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert top == {"trident"}, top
    # Every tracked file under trident/, parallel/ and models/ (modules and any data read at run time).
    missing = [n for n in map(_installed_name, _tracked()) if n is not None and n not in names]
    assert not missing, f"not in the wheel: {missing}"


# Run by the venv's python from outside the checkout: import every module of the installed package, say where each
# came from, then run train.py (its path and overrides in argv) as `python train.py ...` would, in the same process:
# one interpreter start (torch's import alone takes seconds on a loaded machine).
IMPORT_ALL_THEN_TRAIN = """
import importlib, json, pkgutil, runpy, sys
import trident

def fail(name):
    raise ImportError(f"cannot import {name}")

names = ["trident", *(m.name for m in pkgutil.walk_packages(trident.__path__, "trident.", onerror=fail))]
print(json.dumps({name: importlib.import_module(name).__file__ for name in names}), flush=True)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.multiprocess
def test_the_installed_wheel_imports_whole_and_trains_outside_the_checkout(wheel: Path, tmp_path: Path) -> None:
    """A fresh environment holding the wheel and nothing of the checkout: the machine's packages (torch, ...) come
    in through a .pth naming their directories, a plain path line that adds them without running their own .pth
    files, so the editable install's import hook never sees this interpreter. Every module imports with the
    declared dependencies (none needs an optional one), and train.py trains on it."""
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    where = [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"]  # as the venv sees it
    lib = Path(subprocess.run(where, capture_output=True, text=True, check=True, timeout=60).stdout.strip())
    found = [*site.getsitepackages(), *([site.getusersitepackages()] if site.ENABLE_USER_SITE else [])]
    (lib / "machine.pth").write_text("".join(f"{d}\n" for d in found if os.path.isdir(d)))
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(lib)]
    subprocess.run([*install, str(wheel)], check=True, capture_output=True, timeout=300)

    job = tmp_path / "job"  # outside the checkout: copies of train.py and conf/, and a small text to train on
    job.mkdir()
    shutil.copy2(REPO / "train.py", job / "train.py")
    shutil.copytree(REPO / "conf", job / "conf")
    (job / "text.txt").write_text("".join(texts(100)))
    overrides = [
        "model=gpt-tiny",
        "train.steps=2",
        f"data.text=[{job / 'text.txt'}]",
        f"data.cache_dir={tmp_path / 'cache'}",
        f"hydra.run.dir={tmp_path / 'run'}",
        "wandb.mode=disabled",
        "train.eval_every=0",
        "train.global_batch_size=4",
        "logging.peak_tflops=1",
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HYDRA_FULL_ERROR="0")
    cmd = [python, "-c", IMPORT_ALL_THEN_TRAIN, "train.py", *overrides]
    proc = subprocess.run(cmd, cwd=job, capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, f"--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}"

    files = json.loads(proc.stdout.splitlines()[0])
    strays = {name: f for name, f in files.items() if not Path(f).is_relative_to(lib)}
    assert not strays, f"imported from outside the venv: {strays}"
    # The walk found every module of the checkout: nothing the source holds is missing from the package.
    expected = set()
    for name in map(_installed_name, _tracked()):
        if name is not None and name.endswith(".py"):
            expected.add(name.removesuffix(".py").removesuffix("/__init__").replace("/", "."))
    assert set(files) == expected, (sorted(expected - set(files)), sorted(set(files) - expected))
    assert "trident.plan.auto" in files  # train.py's planner, which the hand-written package list left out
    assert "done: 2 steps" in proc.stdout, proc.stdout


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


@pytest.mark.multiprocess  # a fresh interpreter: the test process has imported everything already
def test_importing_train_leaves_dynamo_and_dcp_to_what_uses_them() -> None:
    """Every torchrun rank, tool and checkpoint writer process starts by importing train.py's modules: dynamo
    (0.6 s) comes with torch.compile or an optimizer, torch.distributed.checkpoint (0.65 s, DTensor and sympy
    with it) with a checkpoint's save or load, neither with the import (a module-level decorator or import of
    either would bring it back)."""
    heavy = ["torch._dynamo", "torch.distributed.checkpoint"]
    code = f"import sys, train; print([name for name in {heavy!r} if name in sys.modules])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def _wheel_modules() -> dict[str, Path]:
    """Every module of the wheel by its import name (trident, trident.parallel, trident.models), from the checkout."""
    out = {}
    for root, folder in ROOTS.items():
        package = folder.replace("/", ".")
        for path in sorted((REPO / root).rglob("*.py")):
            rel = path.relative_to(REPO / root).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            if root == "trident" and parts[:1] in (["parallel"], ["models"]):
                continue
            out[name] = path
    return out


def test_the_wheel_holds_at_most_20k_lines_and_long_files_say_why() -> None:
    """The package users install is the training code; the development tooling lives in tools/trident_dev. A file
    past ~400 lines says in its opening docstring why it is one idea."""
    import ast

    modules = _wheel_modules()
    lengths = {name: len(path.read_text().splitlines()) for name, path in modules.items()}
    assert sum(lengths.values()) <= 20_000, sum(lengths.values())
    for name, n in lengths.items():
        if n > 410:
            doc = ast.get_docstring(ast.parse(modules[name].read_text())) or ""
            assert "past ~400 lines" in doc or "at\n~400 lines" in doc or "~400 lines" in doc, f"{name}: {n} lines"


def test_the_wheel_has_no_import_circles() -> None:
    """No module of the wheel imports, directly or through others, one that imports it back: every import counted,
    inside functions and under TYPE_CHECKING too (a package's own ``__init__`` re-exports excepted)."""
    import ast

    modules = _wheel_modules()
    edges: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.ImportFrom) and node.module:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]  # fmt: skip
            elif isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            edges[name] |= {t for t in targets if t in modules and t != name and not name.startswith(f"{t}.")}
    # A depth-first walk that meets a module on its own stack has found a circle.
    state: dict[str, int] = {}

    def walk(m: str, stack: list[str]) -> None:
        state[m] = 1
        for t in sorted(edges[m]):
            assert state.get(t) != 1, " -> ".join([*stack[stack.index(t) :], t])
            if t not in state:
                walk(t, [*stack, t])
        state[m] = 2

    for m in sorted(modules):
        if m not in state:
            walk(m, [m])


@pytest.mark.multiprocess  # a fresh interpreter: the test process has imported everything already
def test_importing_the_training_loop_imports_no_planner_benchmark_or_fuzzer() -> None:
    code = (
        "import sys, trident.loop, trident.build; "
        "print(sorted(m for m in sys.modules if m.startswith(('trident.plan', 'trident_dev'))))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
