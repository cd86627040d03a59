"""What is wrong with a file that does not have the shape its reader expects, field by field.

The files this tool reads back (LOCK, run.json, a Hugging Face config.json, ...) are checked against pydantic
models; a `ValidationError` becomes one line for the user's message: `pid='abc': Input should be a valid
integer; host missing`.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError


def shown(value: Any) -> str:
    """A value from the file, for a message: cut short if long."""
    text = repr(value)
    return text if len(text) <= 120 else text[:110] + "..."


def problems(error: ValidationError) -> str:
    """Each field's problem, `key=value: what was expected`, or `key missing`."""
    parts = []
    for e in error.errors(include_url=False):
        key = ".".join(str(part) for part in e["loc"])
        message = e["msg"].removeprefix("Value error, ").split(" or instance of ")[0]
        if e["type"] == "missing" or (key and e["input"] is None):
            parts.append(f"{key} missing" + (" (null)" if e["type"] != "missing" else ""))
        else:
            parts.append(f"{key}={shown(e['input'])}: {message}" if key else message)
    return "; ".join(parts)
