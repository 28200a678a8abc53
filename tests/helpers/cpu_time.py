"""A pytest plugin for CI-time work: the CPU seconds of each test and of every process it starts (rank pools,
torchrun, writers), one JSON line per test. Each pytest-xdist worker moves itself into a cpuacct cgroup of its own
(cgroup v1, as root), so its descendants are counted with it; wall time alone misleads on two cores, where a test
waits while the other worker's ranks run. Not loaded unless asked for::

    python -m pytest -q -n 2 --dist loadfile -p tests.helpers.cpu_time      # lines in $TRIDENT_CPU_LOG
    python - <<'EOF'                                                         # CPU-s per file, dearest first
    import collections, json, os
    per = collections.Counter()
    for line in open(os.environ.get("TRIDENT_CPU_LOG", "/tmp/trident-cpu.jsonl")):
        row = json.loads(line); per[row["test"].split("::")[0]] += row["cpu"]
    print(*(f"{v:7.1f} {k}" for k, v in per.most_common()), sep="\\n")
    EOF

Without a writable ``/sys/fs/cgroup/cpuacct`` (not root, cgroup v2 only) nothing is recorded. A process a test
leaves running is counted with the tests after it.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path("/sys/fs/cgroup/cpuacct/trident-tests")
_GROUP = pytest.StashKey[Path]()  # this worker's cgroup, where it could join one


def _usage(group: Path) -> float:
    return int((group / "cpuacct.usage").read_text()) / 1e9


def pytest_configure(config: pytest.Config) -> None:
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    group = ROOT / worker
    try:
        group.mkdir(parents=True, exist_ok=True)
        (group / "cgroup.procs").write_text(str(os.getpid()))
    except OSError:
        return
    config.stash[_GROUP] = group


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    group = item.config.stash.get(_GROUP, None)
    if group is None:
        yield
        return
    cpu, wall = _usage(group), time.monotonic()
    yield
    row = {"test": item.nodeid, "cpu": _usage(group) - cpu, "wall": time.monotonic() - wall}
    row["worker"] = os.environ.get("PYTEST_XDIST_WORKER", "main")
    with open(os.environ.get("TRIDENT_CPU_LOG", "/tmp/trident-cpu.jsonl"), "a") as f:
        f.write(json.dumps(row) + "\n")
