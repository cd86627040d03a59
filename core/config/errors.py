"""The errors a user can fix, each shown as one line that names the key or file instead of a traceback.

    ConfigError   a setting that is well-typed but unusable (exit code 2, "config error: ...")
    DataError     a data file or folder that cannot be used as given: names the file, and the setting or
                  option that gave it (exit code 2, "data error: ...")

core/session.py:exit_on_error turns them into that line and exit code; RECIPES_DEBUG=1 adds the traceback.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config value that is well-typed but unusable; the message names the key."""


class DataError(ConfigError):
    """A data file or folder that cannot be used: missing, damaged, of the wrong shape or kind. The message
    names the file and what gave it (`data.root=...`, `predict.folder=...`, `--input ...`) and what to do."""


class MissingDataError(DataError, FileNotFoundError):
    """A data file or folder that is not there; also a FileNotFoundError, for a caller that can do without it
    (predict.py on new images with only the checkpoint)."""


def require(condition: bool, message: str) -> None:
    """Raise ConfigError(message) unless `condition` holds."""
    if not condition:
        raise ConfigError(message)


# Set to 1 to print the traceback of a ConfigError, DataError or checkpoint error as well as its line.
DEBUG_ENV = "RECIPES_DEBUG"


def message_of(error: BaseException) -> str:
    """The error's own message. One raised in a DataLoader worker reaches the main process re-raised with the
    worker's whole traceback as its text ("Caught DataError in DataLoader worker process 0. Original Traceback
    ... recipes.x.DataError: <message>"): the message is what follows the last line naming its type."""
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(error, OmegaConfBaseException):  # the key, and the first line of OmegaConf's message
        return (
            f"{getattr(error, 'full_key', None) or 'the config'}: {str(getattr(error, 'msg', error)).splitlines()[0]}"
        )
    text = str(error)
    if not (text.startswith("Caught ") and "\nOriginal Traceback" in text):
        return text
    kind = type(error)
    names = (f"{kind.__module__}.{kind.__qualname__}: ", f"{kind.__qualname__}: ")
    lines = text.rstrip("\n").split("\n")
    for i in range(len(lines) - 1, -1, -1):
        for name in names:
            if lines[i].startswith(name):
                return "\n".join([lines[i][len(name) :], *lines[i + 1 :]]) + " (in a data loader worker)"
    return text
