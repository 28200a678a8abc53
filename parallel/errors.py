"""The errors the parallel layer raises or recognises. The product's own (data, checkpoints, divergence) live in
trident/errors.py, which builds on these."""


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
