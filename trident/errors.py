"""Errors a user can fix. ``train.py`` turns them into one line on stderr and exit code 2."""


class TridentError(Exception):
    """Base class: the message says what is wrong and how to fix it.

    ``agreed`` marks an error that every rank raises alike, so one rank per node is enough to print it;
    any other error is printed by the rank that hit it, so no message is lost when only some ranks fail.
    """

    agreed = False


class ConfigError(TridentError):
    """The configuration (or its fit to the launch) is invalid. Same on every rank."""

    agreed = True


class DataError(TridentError):
    """The training data is missing, unreadable or too small."""


class CheckpointError(TridentError):
    """A checkpoint cannot be found or does not fit the model."""


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
