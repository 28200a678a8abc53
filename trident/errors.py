"""Errors a user can fix. ``train.py`` turns them into one line on stderr and exit code 2."""


class TridentError(Exception):
    """Base class: the message says what is wrong and how to fix it."""


class ConfigError(TridentError):
    """The configuration (or its fit to the launch) is invalid. Same on every rank."""


class DataError(TridentError):
    """The training data is missing, unreadable or too small."""


class CheckpointError(TridentError):
    """A checkpoint cannot be found or does not fit the model."""
