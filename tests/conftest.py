"""Shared fixtures: a small real dataset (a few standard-library packages, 512-piece BPE tokenizer) and the
one-process reference runs (each trained once per session); and the two test tiers: every test is ``pure``
unless marked ``multiprocess``, and a pure test that starts a process fails.
A test marked ``gpu`` (the GPU check kit, tests/test_gpu.py) needs CUDA and is skipped without it; it is pure or
multiprocess like any other, so ``-m gpu`` runs the kit on a GPU machine and CI only sees the skips."""

from __future__ import annotations

import compileall
import gc
import os
import subprocess
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import tests.helpers.warm
import trident_dev.ranks
from tests.helpers import REPO, SMALL_CORPUS
from tests.helpers.layouts import References
from trident.data.prepare import prepare_dataset
from trident.data.sources import collect_text_files
from trident.parallel.groups import build_process_groups
from trident.parallel.topology import Topology

# The processes the tests start (ranks, tools, train.py under torchrun) import the development package from tools/,
# as this process does (pyproject.toml's pytest ``pythonpath``).
os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "tools"), os.environ.get("PYTHONPATH")]))


@pytest.fixture(scope="session")
def tiny_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A prepared dataset directory for gpt-tiny (vocab 512): ~300k tokens of real Python source."""
    files = collect_text_files(SMALL_CORPUS, [".py"])
    return prepare_dataset(files, tmp_path_factory.mktemp("data") / "tiny", vocab_size=512, log=lambda _: None)


@pytest.fixture(scope="session")
def references(tmp_path_factory: pytest.TempPathFactory) -> References:
    """The one-process runs the layouts are compared with, by their overrides: each trained once per session."""
    return References(tmp_path_factory.mktemp("references"))


@pytest.fixture
def one_process():
    """A one-process gloo group (as a plain ``python train.py`` has), torn down after the test."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield build_process_groups(Topology(dp=1, pp=1, tp=1), timeout_s=60)
    finally:
        if dist.is_initialized():  # a test may have ended it early
            dist.destroy_process_group()


class TierViolation(BaseException):
    """Not an Exception: a test expecting a rank's or a subprocess's error must not swallow it."""


# The files that take longest, longest first, by the CPU seconds of each file's tests and all their processes
# (measured in a cgroup per xdist worker: the suite is CPU-bound on two cores, so these order it as wall time
# would on an idle machine). ``--dist loadfile`` hands files out in collection order once pytest_configure below
# turns off xdist's own order (files with the most tests first), so these start first and the run does not end
# with one worker on a long file and the other idle.
LONGEST_FIRST = (
    "test_fuzz.py",
    "test_multinode.py",
    "test_llama_layouts.py",
    "test_lifecycle.py",
    "test_memory.py",
    "test_train.py",
    "test_bench.py",
    "test_async_checkpoint.py",
    "test_cp_layouts.py",
    "test_3d.py",
    "test_failures.py",
    "test_compile.py",
    "test_muon_layouts.py",
    "test_fp8.py",
    "test_muon.py",
    "test_plan_auto.py",
    "test_moe_ep.py",
    "test_hf_families.py",
    "test_hf_trained.py",
    "test_plan.py",
    "test_plan_measure.py",
    "test_pipeline_layouts.py",
    "test_zero.py",
    "test_dropout.py",
    "test_layouts.py",
    "test_docs.py",
)


def pytest_configure(config: pytest.Config) -> None:
    """A pytest-xdist worker takes its share of the cores for torch's threads (two workers on two cores: one each),
    so the workers' matmuls do not spin against each other; the controller hands out files in LONGEST_FIRST's
    order."""
    if hasattr(config.option, "loadscopereorder"):  # the xdist controller: LONGEST_FIRST's order, not its own
        config.option.loadscopereorder = False
    if not hasattr(config, "workerinput"):  # once, before any worker or process starts
        _compile_checkout()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // workers))


def _compile_checkout() -> None:
    """Byte-code for the checkout's modules, written once. Where PYTHONDONTWRITEBYTECODE is set (CI's image sets
    it), Python never writes it on import, and every interpreter the tests start (train.py, torchrun's workers, the
    tools) would compile the package from source again: about 0.1-0.2 CPU-s each, some two hundred times a run."""
    for name in ("trident", "parallel", "models", "tools", "tests"):
        compileall.compile_dir(REPO / name, quiet=1)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    no_gpu = None if torch.cuda.is_available() else pytest.mark.skip(reason="gpu tier: no CUDA device visible")
    # The planner's CPU lab calibrates this 2-core VM (tools/trident_dev/plan), which users' GPU plans never read: its
    # heaviest runs (a whole calibration, --measure of real runs) are a tier of their own, run by -m lab.
    lab = "lab" in (config.getoption("markexpr") or "")
    no_lab = None if lab else pytest.mark.skip(reason="lab tier: the planner's CPU lab; run with -m lab")
    for item in items:
        if no_lab is not None and item.get_closest_marker("lab") is not None:
            item.add_marker(no_lab)
        if item.get_closest_marker("multiprocess") is None:
            item.add_marker(pytest.mark.pure)
        if no_gpu is not None and item.get_closest_marker("gpu") is not None:
            item.add_marker(no_gpu)
    first = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: first.get(item.path.name, len(first)))  # stable: each file's own order kept


def pytest_collection_finish(session: pytest.Session) -> None:
    """With multiprocess tests to run, start the fork server that ranks and warm processes are forked from, with
    torch, train.py and the helpers imported once (tests/helpers/warm.py).

    Then what the imports and the collection made, which lives for the session, is frozen out of the garbage
    collector's view: a full collection (the estimator tests' gc.collect per measured forward, and Python's own)
    then looks only at what the tests make, not at torch's millions of objects (about 0.3 s a collection before).
    """
    gc.collect()
    gc.freeze()
    if any(item.get_closest_marker("multiprocess") is not None for item in session.items):
        tests.helpers.warm.start_fork_server()


@pytest.fixture(autouse=True)
def _tier_guard(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> None:
    """Keep the tiers honest: a test not marked multiprocess may not start ranks or subprocesses."""
    if request.node.get_closest_marker("multiprocess") is not None:
        return

    def refuse(*args: object, **kwargs: object) -> None:
        raise TierViolation(f"{request.node.nodeid} starts a process: mark it pytest.mark.multiprocess")

    monkeypatch.setattr(trident_dev.ranks, "_pool", refuse)
    monkeypatch.setattr(subprocess, "Popen", refuse)
    monkeypatch.setattr(tests.helpers.warm.WarmProcess, "__init__", refuse)
