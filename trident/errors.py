"""Errors a user can fix. ``train.py`` turns them into one line on stderr and an exit code (2 unless said)."""


class TridentError(Exception):
    """Base class: the message says what is wrong and how to fix it.

    ``agreed`` marks an error that every rank raises alike (a config rule, or an outcome the ranks exchanged);
    any other error was met by some ranks alone. Either way every rank that knows it prints it.
    """

    agreed = False
    exit_code = 2


class ConfigError(TridentError):
    """The configuration (or its fit to the launch) is invalid. Same on every rank."""

    agreed = True


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


def is_lost_peer(error: BaseException) -> bool:
    """A collective failed because another rank is gone: torch raises ``DistError`` (NCCL, the store), gloo a plain
    RuntimeError from its transport ("[.../gloo/transport/tcp/pair.cc:537] Read error ...: Connection reset")."""
    import torch.distributed as dist  # here, not at the top: tools/prepare_data.py imports this module without torch

    return isinstance(error, dist.DistError) or (isinstance(error, RuntimeError) and "gloo/transport" in str(error))


def gist(error: BaseException) -> str:
    """The first sentence of a collective's error, without gloo's source location:
    "[.../pair.cc:537] Read error [127.0.0.1]:22433: Connection reset by peer. This is typically..." ->
    "Read error [127.0.0.1]:22433: Connection reset by peer"."""
    text = " ".join(str(error).split()) or type(error).__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ", 1)[0]
