"""Checks of the operator tools' file arguments, shared by the commands.

Each raises ``ValueError`` with a one-line message that names the flag, the path and the fix;
the commands print it and exit 2. Output paths are checked before any work is done, so a
typo in ``--json`` does not cost a finished simulation.
"""

from __future__ import annotations

import json
import os
from typing import Any

from sglang_hisparse.config import json_error_hint


def check_output_path(path: str | None, flag: str) -> None:
    """``path`` can be created as a file: its folder exists and it is not itself a folder."""
    if path is None:
        return
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: is a folder; give a file name, e.g. {os.path.join(path, 'out')}")
    if not os.path.isdir(folder):
        raise ValueError(f"{flag} {path}: folder {folder} does not exist; create it (mkdir -p {folder}) "
                         "or write elsewhere")
    if not os.access(folder, os.W_OK):
        raise ValueError(f"{flag} {path}: folder {folder} is not writable; write elsewhere")


def model_config_path(path: str, flag: str = "--model-config") -> str:
    """The config.json a ``--model-config`` names: the file itself, or ``config.json`` in a folder."""
    if os.path.isdir(path):
        inner = os.path.join(path, "config.json")
        if not os.path.isfile(inner):
            raise ValueError(f"{flag} {path}: the folder has no config.json; pass the model's config.json "
                             "or the folder that holds it")
        return inner
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path}: cannot read it: no such file; pass the model's config.json or its folder")
    return path


def read_model_config(path: str, flag: str = "--model-config") -> dict[str, Any]:
    """The JSON object of a model's ``config.json`` (``path`` may be its folder)."""
    p = model_config_path(path, flag)
    try:
        with open(p, "rb") as f:
            text = f.read().decode("utf-8")
    except UnicodeDecodeError:
        raise ValueError(f"{flag} {p}: not a text file (binary, not UTF-8 JSON); pass the model's "
                         "config.json, not its weights") from None
    except OSError as e:
        raise ValueError(f"{flag} {p}: cannot read it ({e.strerror})") from None
    try:
        config = json.loads(text)
    except RecursionError:
        raise ValueError(f"{flag} {p}: the JSON is nested too deeply to parse; pass the model's "
                         "config.json") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} {p}: not valid JSON: {e.msg} at line {e.lineno} column {e.colno}; "
                         f"{json_error_hint(e)}") from None
    except ValueError:  # json's other refusal: an integer of more than 4300 digits
        raise ValueError(f"{flag} {p}: a number has more digits than Python converts (4300); "
                         "pass the model's config.json") from None
    if not isinstance(config, dict):
        raise ValueError(f"{flag} {p}: expected a JSON object (a model's config.json), got {type(config).__name__}")
    return config
