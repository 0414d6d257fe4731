"""User-facing errors: each carries one line that names the problem (key, file, value).

The command line catches :class:`SpecdecError` and prints its message without a traceback;
anything else is a bug and keeps its traceback.
"""


class SpecdecError(Exception):
    """Base class of every error a user can cause and fix."""


class ConfigError(SpecdecError):
    """A recipe or command-line value is unknown, mistyped, missing or out of range."""


class AssetError(SpecdecError):
    """A packaged model or data file could not be fetched, verified or read."""


class DataError(SpecdecError):
    """A dataset or prompt file has no usable rows or a malformed row."""


class ModelError(SpecdecError):
    """A target, draft model or checkpoint cannot be loaded or does not fit its partner."""


def first_line(err: BaseException) -> str:
    """The first line of an exception's message (its class name when it has none)."""
    lines = str(err).strip().splitlines()
    return lines[0] if lines else type(err).__name__
