"""The error line reaches the shared stderr in one piece, as torchrun's unbuffered workers write it."""

from __future__ import annotations

import io
import sys

import pytest

from trident import cli


class Unbuffered(io.StringIO):
    """A stderr as ``python -u`` has it (torchrun's workers): every ``write`` call goes to the pipe at once."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[str] = []

    def write(self, text: str) -> int:
        self.writes.append(text)
        return super().write(text)


def test_print_would_write_a_line_and_its_newline_apart() -> None:
    """Why ``say`` exists: two ranks printing at once could glue their lines (fuzz seed 7, case 152)."""
    err = Unbuffered()
    print("error: x", file=err, flush=True)
    assert err.writes == ["error: x", "\n"]


def test_the_error_line_is_one_write(monkeypatch: pytest.MonkeyPatch) -> None:
    err = Unbuffered()
    monkeypatch.setattr(sys, "stderr", err)
    cli.say("error: parallel.vpp=2 needs parallel.schedule=interleaved (got 1f1b)")
    assert err.writes == ["error: parallel.vpp=2 needs parallel.schedule=interleaved (got 1f1b)\n"]


def test_the_first_rank_of_a_node_to_meet_an_agreed_error_says_it(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under torchrun whichever local rank gets there first prints (a loaded machine can leave local rank 0
    seconds behind, and the agent ends it when the first rank exits); each node's agent has its own directory."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "run")
    said = {}
    for node in ("a", "b"):
        for local_rank in (1, 0):
            monkeypatch.setenv("LOCAL_RANK", str(local_rank))
            monkeypatch.setenv(
                "TORCHELASTIC_ERROR_FILE", str(tmp_path / node / "attempt_0" / str(local_rank) / "e.json")
            )
            (tmp_path / node / "attempt_0" / str(local_rank)).mkdir(parents=True, exist_ok=True)
            said[node, local_rank] = cli._says_for_the_node()
    assert said == {("a", 1): True, ("a", 0): False, ("b", 1): True, ("b", 0): False}
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")  # an agent without error files: local rank 0 says it
    assert cli._says_for_the_node()  # LOCAL_RANK is 0
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert not cli._says_for_the_node()


@pytest.mark.multiprocess
def test_a_rank_the_agent_ends_during_start_up_leaves_its_line_in_the_error_file(tmp_path) -> None:
    """torchrun ends the other workers when one fails; one still starting exits on its SIGTERM with 143 and, before
    this, no error file, so the agent's summary said "To enable traceback see ..." for it (seen on a loaded CI)."""
    import json
    import os
    import signal
    import subprocess
    import textwrap

    error_file = tmp_path / "error.json"
    code = textwrap.dedent(
        """
        import os, signal, time
        from trident.signals import StopRequest
        with StopRequest(grace_s=5.0):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(30)
        """
    )
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(error_file)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    message = json.loads(error_file.read_text())["message"]["message"]
    assert message == "stopped by SIGTERM before training started; rerun the same command to start"


def test_an_error_file_is_written_whole_or_not_at_all(tmp_path, monkeypatch) -> None:
    """A rank ended mid-write (torchrun's SIGTERM after another rank's refusal) left an empty error file, and the
    agent's summary died on it with JSONDecodeError instead of naming the cause (seen on a loaded CI)."""
    import json

    from trident import error_file

    path = tmp_path / "error.json"
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))

    def cut_short(obj, f) -> None:  # the process ends after the file is opened, before the JSON is in it
        f.write('{"mess')
        raise SystemExit(143)

    monkeypatch.setattr(error_file.json, "dump", cut_short)
    with pytest.raises(SystemExit):
        error_file.record("error: one line")
    assert not path.exists()  # the agent finds no file (and says so), not a broken one

    monkeypatch.undo()
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    error_file.record("error: one line")
    assert json.loads(path.read_text())["message"]["message"] == "error: one line"
    assert [p.name for p in tmp_path.iterdir()] == ["error.json"]
