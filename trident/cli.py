"""Command-line plumbing around ``train.py``: every failure a user can fix ends as one ``error:`` line and exit
code 2, on every rank, before any collective can hang."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator

from hydra.errors import HydraException
from omegaconf.errors import OmegaConfBaseException

from trident.device import local_rank
from trident.errors import TridentError, one_line
from trident.parallel.groups import shutdown_distributed


def fail(message: str, every_rank: bool = False) -> None:
    """Print ``error: message`` and exit 2. An error every rank reaches alike is printed once per node;
    one that only some ranks hit is printed by each of them, so it is never lost when the launcher
    kills the rest."""
    if every_rank or local_rank() == 0:
        print(f"error: {message}", file=sys.stderr, flush=True)
    shutdown_distributed(barrier=False)
    sys.exit(2)


@contextlib.contextmanager
def user_errors() -> Iterator[None]:
    """Turn the errors a user can fix, raised while a run is built or trains, into ``fail``."""
    try:
        yield
    except TridentError as e:
        fail(str(e), every_rank=not e.agreed)
    except OSError as e:  # a full disk, a directory that cannot be written: the environment, not a bug
        fail(f"{e}; free space or point the path at a writable directory", every_rank=True)


def launch(hydra_main: Callable[[], None]) -> None:
    """Call a ``@hydra.main`` function so that Hydra's own errors (an unknown preset, a value of the wrong
    type, an unwritable hydra.run.dir) end the same way as ours. Hydra prints them over several lines unless
    HYDRA_FULL_ERROR=1 makes it raise; a user who set that themselves gets the full traceback."""
    wants_traceback = os.environ.get("HYDRA_FULL_ERROR") == "1"
    os.environ["HYDRA_FULL_ERROR"] = "1"
    # Hydra's branch comes first: its MissingConfigException (an unknown preset) is an IOError too.
    try:
        hydra_main()
    except (HydraException, OmegaConfBaseException) as e:
        if wants_traceback:
            raise
        cause = e.__cause__
        detail = f"\n{str(cause).splitlines()[0]}" if isinstance(cause, OmegaConfBaseException) else ""
        # Hydra appends its search path to a missing-preset message: noise for the user.
        fail(one_line(str(e).split("Config search path:")[0] + detail))
    except OSError as e:  # the run's own OSErrors are handled inside, so this is Hydra making the run directory
        if wants_traceback:
            raise
        fail(f"cannot create the run directory: {e}; set hydra.run.dir to a writable directory")
