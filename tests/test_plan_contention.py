"""A calibration knows when it is bad (trident_dev/plan/contention.py): it samples the cores other processes keep busy
while it measures, and one taken beside a busy loop is said, marked and not cached; a cached one carries when and
under what load it was taken (which the plan's first lines say), and one too old or from before the record is
taken again."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from trident.plan.conditions import MAX_AGE_S, Conditions
from trident.plan.profile import Needs, Profile, load_cached
from trident_dev.plan import calibrate as calibration
from trident_dev.plan.calibrate import calibrate, save_cached
from trident_dev.plan.contention import BUSY_CORES, OtherLoad, contended, describe_conditions, describe_profile

SMALL = ("fp32", 32, 32, 32, "nt")


def _profile(conditions: Conditions | None) -> Profile:
    return Profile("cpu: test", "cpu", "calibrated now", 1e9, 2, threads=1, ranks_per_node=1, conditions=conditions)


def test_conditions_say_contended_stale_and_how_old() -> None:
    now = time.time()
    idle = Conditions(now - 600, 0.02, 2)
    assert not contended(idle) and not idle.stale(now)
    assert describe_conditions(idle, now) == "taken 10 min ago, other processes busy on 0.02 of 2 cores meanwhile"
    busy = Conditions(now - 3 * 86400, BUSY_CORES + 0.5, 2)
    assert (
        contended(busy)
        and "(contended: above 0.25)" in describe_conditions(busy, now)
        and "3 days ago" in describe_conditions(busy, now)
    )
    assert Conditions(now - MAX_AGE_S - 1, 0.0, 2).stale(now)
    assert not contended(Conditions(now, None, 2))  # not observable: never called contended


def test_a_cached_calibration_is_used_only_while_it_holds(tmp_path: Path) -> None:
    cache = tmp_path / "profile.json"
    now = time.time()
    fresh = _profile(Conditions(now - 60, 0.01, 2))
    save_cached(fresh, cache)
    assert load_cached("cpu", 1, 1, cache) == fresh
    # The plan's first line ends with this: which figures, when, and under what load.
    said = "[calibrated now], taken 1 min ago, other processes busy on 0.01 of 2 cores meanwhile"
    assert describe_profile(fresh).endswith(said)
    for bad in (Conditions(now - MAX_AGE_S - 60, 0.01, 2), None):  # stale; saved before trident recorded conditions
        save_cached(_profile(bad), cache)
        assert load_cached("cpu", 1, 1, cache) is None, bad


def _foreign_busy_loop() -> int:
    """A busy process that is not this one's descendant (its shell parent exits: it is re-parented), as another
    job on the machine is."""
    out = subprocess.check_output(
        ["sh", "-c", f"{sys.executable} -c 'while True: pass' >/dev/null 2>&1 & echo $!"], text=True
    )
    return int(out)


@pytest.mark.multiprocess
def test_other_load_counts_others_and_not_this_process_tree() -> None:
    """Two samplers at once over the same busy children: one counting them as this tree's, one rooted elsewhere.
    Whatever else the machine does adds to both alike, so their difference is the children's share (one busy
    child per core: however loaded the machine, they get a good part of it)."""
    children = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(os.cpu_count() or 1)]
    try:
        with OtherLoad(root=os.getpid()) as mine, OtherLoad(root=1 << 30) as nobody:
            time.sleep(2.0)
    finally:
        for child in children:
            child.kill()
            child.wait()
    assert mine.samples and nobody.samples
    share = sum(nobody.samples) / len(nobody.samples) - sum(mine.samples) / len(mine.samples)
    assert share > 0.2, (mine.samples, nobody.samples)


@pytest.mark.multiprocess
def test_a_calibration_beside_a_busy_loop_is_said_and_not_cached(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(calibration, "cpu_threads_per_rank", lambda ranks_per_node: 1)
    cache = tmp_path / "profile.json"
    loops = [_foreign_busy_loop() for _ in range(os.cpu_count() or 1)]  # every core taken
    try:
        lines: list[str] = []
        profile = calibrate(Needs(matmuls={SMALL}, precisions={"fp32"}), 1, cache=cache, log=lines.append)
        accepted = calibrate(Needs(matmuls={SMALL}, precisions={"fp32"}), 1, cache=cache, accept_busy=True)
    finally:
        for pid in loops:
            os.kill(pid, signal.SIGKILL)
    assert profile.conditions is not None and contended(profile.conditions), profile.conditions
    said = [line for line in lines if "cores busy while it measured" in line]
    assert said and "not cached" in said[0] and "--accept-busy" in said[0], lines
    assert "(contended: above 0.25)" in describe_profile(profile)
    assert not any("saved to" in line for line in lines)
    # Accepted, it is cached, and a later plan that takes it says in its first lines that it was busy.
    assert accepted.conditions is not None and contended(accepted.conditions)
    again = load_cached("cpu", 1, 1, cache)
    assert again == accepted and "(contended: above 0.25)" in describe_profile(again)
