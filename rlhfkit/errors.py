"""User-facing errors.

Anything a user can cause (bad data, a wrong directory, a bad flag combination) raises
:class:`RlhfkitError` with one message that says what is wrong and what to do. The programs catch
it at the top, print the message (no traceback) and exit with status 2.
"""


class RlhfkitError(Exception):
    """An error caused by input or setup, with a message meant for the user."""


class DataError(RlhfkitError):
    """A data file is missing, unreadable, of an unknown format, or has no usable rows."""


class CheckpointError(RlhfkitError):
    """A model/checkpoint directory is missing, half-written, of the wrong stage, or mismatched."""


class ConfigError(RlhfkitError):
    """A configuration value is invalid or two values contradict each other."""
