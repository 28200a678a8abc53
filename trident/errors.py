"""Errors a user can fix. ``train.py`` turns them into one line on stderr and an exit code (2 unless said).

The base class, the config error and the lost-peer test are the parallel layer's (parallel/errors.py),
which sits below the product; the rest are the product's own.
"""

from trident.parallel.errors import ConfigError, TridentError, gist, is_lost_peer

__all__ = ["CheckpointError", "ConfigError", "DataError", "DiskFullError", "DivergenceError", "RunDirError"]
__all__ += ["TridentError"]
__all__ += ["gist", "is_lost_peer", "one_line"]


class DataError(TridentError):
    """The training data is missing, unreadable or too small."""


class CheckpointError(TridentError):
    """A checkpoint cannot be found or does not fit the model."""


class RunDirError(TridentError):
    """The run directory (or checkpoint directory) belongs to another run that is still alive."""


class DivergenceError(TridentError):
    """Training diverged (losses or gradients not finite). Every rank sees the same losses and norms, so
    every rank raises it at the same step. Its own exit code lets a job script tell it from a bad config."""

    agreed = True
    exit_code = 3


class DiskFullError(TridentError):
    """A save found no room on its filesystem. Nothing is lost: the save is not published and the last complete
    checkpoint is kept. Its own exit code lets a job script tell it from a bad config (and free space, then resume)."""

    exit_code = 4


def one_line(text: str) -> str:
    """Fold a multi-line message (Hydra's, say) into one line: indented lines are items of the line above.

    "Available options in 'model':\\n\\tgpt-tiny\\n\\tgpt-mini" -> "Available options in 'model': gpt-tiny, gpt-mini"
    """
    out: list[str] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        if line[0].isspace() and out:
            out[-1] += (" " if out[-1].endswith(":") else ", ") + line.strip()
        else:
            out.append(line.strip())
    return "; ".join(line.rstrip(".") for line in out)
