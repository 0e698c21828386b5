"""Atomic file writes: a crash leaves the previous file or the complete new one, never half of one.

The temporary file is `.{name}.tmp` beside the target; clean-up code of interrupted runs removes `.*.tmp`.
"""

import json
import os
from contextlib import contextmanager


@contextmanager
def atomic_open(path: str, mode: str = "w"):
    """Open a temporary file for writing; on success it is fsynced and renamed to `path`."""
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    os.makedirs(directory, exist_ok=True)
    tmp_path = os.path.join(directory, f".{name}.tmp")
    try:
        with open(tmp_path, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise


def write_text(path: str, text: str) -> str:
    with atomic_open(path) as f:
        f.write(text)
    return path


def write_json(path: str, obj) -> str:
    with atomic_open(path) as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    return path
