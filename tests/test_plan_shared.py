"""trident/plan/shared.py: the ranks of a node plan once between them, and a rank that dies planning holds no one."""

from __future__ import annotations

import multiprocessing as mp
import os
from pathlib import Path

import pytest

from trident.plan.shared import digest, once_per_node


def _count_and_answer(folder: str, log: str, die: bool) -> None:
    def compute() -> dict:
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        if die:
            os._exit(3)  # dies holding the lock
        return {"keys": {"parallel.tp": 2}, "line": "planned"}

    answer = once_per_node("question", compute, Path(folder))
    assert answer == {"keys": {"parallel.tp": 2}, "line": "planned"}


@pytest.mark.multiprocess
def test_four_ranks_asking_together_plan_once_and_read_one_answer(tmp_path: Path) -> None:
    log = tmp_path / "computed"
    ctx = mp.get_context("fork")
    ranks = [ctx.Process(target=_count_and_answer, args=(str(tmp_path), str(log), False)) for _ in range(4)]
    for p in ranks:
        p.start()
    for p in ranks:
        p.join(60)
    assert [p.exitcode for p in ranks] == [0, 0, 0, 0]
    assert len(log.read_text().split()) == 1


@pytest.mark.multiprocess
def test_a_rank_that_dies_planning_leaves_the_plan_to_the_next(tmp_path: Path) -> None:
    log = tmp_path / "computed"
    ctx = mp.get_context("fork")
    dying = ctx.Process(target=_count_and_answer, args=(str(tmp_path), str(log), True))
    dying.start()
    dying.join(60)
    assert dying.exitcode == 3
    after = ctx.Process(target=_count_and_answer, args=(str(tmp_path), str(log), False))
    after.start()
    after.join(60)
    assert after.exitcode == 0
    assert len(log.read_text().split()) == 2  # nothing was left by the first: the second planned


def test_an_unwritable_cache_costs_a_plan_not_an_error(tmp_path: Path) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("")  # a file where the folder would be
    calls = []
    for _ in range(2):
        assert once_per_node("q", lambda: calls.append(1) or {"line": "x"}, blocked / "plans") == {"line": "x"}
    assert len(calls) == 2


def test_another_question_is_another_answer() -> None:
    assert digest("cfg", 8) == digest("cfg", 8)
    assert digest("cfg", 8) != digest("cfg", 4)
    assert digest({"tp": 2}) != digest({"tp": 1})
