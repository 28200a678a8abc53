"""Command-line plumbing around ``train.py``: every failure a user can fix ends as one ``error:`` line and an exit
code (2 for a bad config or input), on every rank, before any collective can hang.

Whichever rank stops first, its cause must already be out: the launcher kills the other ranks as soon as one
exits, so a rank that left the printing to another could leave the user with nothing. Every rank that knows
the reason therefore writes it to torchrun's error file (whose closing summary then names it) and prints it,
then leaves with ``os._exit``: no process-group teardown, which with a peer gone could block, or abort the
process ("terminate called without an active exception"). A cause every rank met alike (a config error) is
printed once per node under torchrun: by the first rank of the node to meet it, the others exiting a little later.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from typing import NoReturn

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from trident.config.compose import hydra_error_line
from trident.error_file import record
from trident.errors import TridentError, gist, is_lost_peer
from trident.launcher import launcher_pid
from trident.signals import Stopped

# A rank that leaves an agreed error to the first rank of its node to meet it exits this much later, so that rank's
# line is out before the agent, seeing the first exit, ends the others (that rank exits first, so it costs nothing).
QUIET_EXIT_DELAY_S = 3.0


def _leave(code: int) -> NoReturn:
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def say(line: str) -> None:
    """Write ``line`` to stderr in one write. torchrun starts its workers unbuffered (``python -u``), where
    ``print`` writes the text and its newline apart: two ranks failing together would glue their lines into one
    ("error: a" "error: a" "\n" "\n"). One write of a short line to the shared pipe is never split."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _says_for_the_node() -> bool:
    """Whether this rank prints an error that every rank met alike: under torchrun, the first rank of the node to
    meet it (once per node: whichever rank gets there first, since the agent ends the others when it exits; the
    agent's summary, from the error files, names it too); ranks started otherwise each print it, since nothing
    else would. The first is the rank that creates a marker beside the agent's per-attempt error-file
    directories; without them (an agent that sets no error file), local rank 0."""
    if launcher_pid() is None:
        return True
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:
        marker = os.path.join(os.path.dirname(os.path.dirname(error_file)), "trident-error-said")
        try:
            os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            return True
        except FileExistsError:
            return False
        except OSError:
            pass
    return os.environ.get("LOCAL_RANK", "0") == "0"


def fail(message: str, code: int = 2, agreed: bool = False) -> NoReturn:
    """Print ``error: message`` and exit with ``code`` at once. ``agreed``: every rank met the same cause, which
    one rank of each node says."""
    line = f"error: {message}"
    record(line)
    if not agreed or _says_for_the_node():
        say(line)
    else:  # let the node's first rank say it before this exit makes the agent end it
        time.sleep(QUIET_EXIT_DELAY_S)
    _leave(code)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn the ways a run can end early, raised while it is built or trains, into one line and an exit code."""
    try:
        yield
    except Stopped as e:  # its line is printed already, by the rank that prints for all
        _leave(e.exit_code)
    except TridentError as e:
        fail(str(e), e.exit_code, e.agreed)
    except OSError as e:  # a full disk, a directory that cannot be written: the environment, not a bug
        fail(f"{e}; free space or point the path at a writable directory")
    except Exception as e:
        if is_lost_peer(e):
            # Another rank has gone: its own line, if it could leave one, is the cause and came first.
            fail(f"lost contact with another rank ({gist(e)}); the first error above, if any, says why it stopped", 1)
        traceback.print_exc()  # a bug: its traceback is the message, and it too must be out before the launcher acts
        record(f"{type(e).__name__}: {e}", traceback.format_exc())
        _leave(1)


def launch(hydra_main: Callable[[], None]) -> None:
    """Call a ``@hydra.main`` function so that Hydra's own errors (an unknown preset, a value of the wrong
    type, an unwritable hydra.run.dir) end the same way as ours. Hydra prints them over several lines unless
    HYDRA_FULL_ERROR=1 makes it raise; a user who set that themselves gets the full traceback."""
    wants_traceback = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    # Hydra's branch comes first: its MissingConfigException (an unknown preset) is an IOError too.
    try:
        hydra_main()
    except KeyboardInterrupt:  # Ctrl-C before the run's own handlers are in place
        say("stopped by SIGINT before training started")
        _leave(130)
    except (HydraException, OmegaConfBaseException) as e:
        if wants_traceback:
            raise
        fail(hydra_error_line(e), agreed=True)  # the same overrides compose alike on every rank
    except OSError as e:  # the run's own OSErrors are handled inside, so this is Hydra making the run directory
        if wants_traceback:
            raise
        fail(f"cannot create the run directory: {e}; set hydra.run.dir to a writable directory")
