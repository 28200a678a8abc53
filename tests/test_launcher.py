"""The one rule for "started by torchrun": torchrun's own variable, not the ones other launchers set too."""

from __future__ import annotations

import os
import time

from trident.launcher import launcher, launcher_pid


def test_torchrun_is_told_by_its_run_id_alone(monkeypatch):
    for name in ("TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "LOCAL_RANK", "RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    # Ranks started by hand (or by another launcher) carry the rank variables but have no torchrun agent.
    for name, value in {"LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "1", "RANK": "1", "WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(name, value)
    assert launcher_pid() is None
    before = time.time()
    pid, started = launcher()
    assert pid == os.getpid() and before <= started <= time.time()  # this process launched itself, now

    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "none")  # torchrun's value without --rdzv-id
    assert launcher_pid() == os.getppid()
    pid, started = launcher()
    assert pid == os.getppid() and started < before  # the agent, which started before this test did
