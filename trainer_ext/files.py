"""Output files that are either whole or absent, and the rerun check of a directory written by an earlier run.

Atomic writes: the data goes to `.{name}.tmp` beside the target, is fsynced, then renamed, so a crash leaves the
previous file or the complete new one, never half of one. Clean-up code of interrupted runs removes `.*.tmp`.

Reruns: a directory records the settings that made it (a manifest or state file); `check_same_run` refuses to
continue or reuse it under other settings, naming the fields that differ and the way out.
"""

import json
import os
from contextlib import contextmanager
from typing import Any


@contextmanager
def atomic_path(path: str):
    """Yield a temporary path to write `path`'s content to; on success it is fsynced and renamed to `path`, on
    failure removed. A temporary file left by an interrupted write is replaced."""
    directory, name = os.path.split(os.path.abspath(os.fspath(path)))
    os.makedirs(directory, exist_ok=True)
    tmp_path = os.path.join(directory, f".{name}.tmp")
    if os.path.exists(tmp_path):
        os.remove(tmp_path)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())  # the data is on disk before the rename makes it visible
        os.replace(tmp_path, path)
    except BaseException:
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        raise


@contextmanager
def atomic_open(path: str, mode: str = "w"):
    """Open a temporary file for writing (text as UTF-8); on success it is fsynced and renamed to `path`."""
    with atomic_path(path) as tmp_path:
        with open(tmp_path, mode, **({} if "b" in mode else {"encoding": "utf-8"})) as f:
            yield f


def write_text(path: str, text: str) -> str:
    with atomic_open(path) as f:
        f.write(text)
    return path


def write_json(path: str, obj) -> str:
    with atomic_open(path) as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
    return path


def differing_fields(saved: Any, current: Any, name: str = "") -> list[str]:
    """Names of the leaf fields whose values differ, in sorted key order; nested dicts are groups whose own names
    are not repeated (a differing non-dict value at the top level is named "settings")."""
    if isinstance(saved, dict) and isinstance(current, dict):
        return [field for key in sorted(set(saved) | set(current))
                for field in differing_fields(saved.get(key), current.get(key), key)]
    return [name or "settings"] if saved != current else []


def check_same_run(what: str, saved: dict, current: dict, fix: str) -> None:
    """Raise ValueError unless `saved` (what an earlier run recorded) equals `current` (this run's settings).

    The message is "{what} with other settings (differs in: {fields}). {fix}", e.g. what = "out/manifest.json:
    this directory holds data prepared", fix = "Pass --overwrite to replace it, or choose another --output_dir.".
    """
    differences = differing_fields(saved, current)
    if differences:
        raise ValueError(f"{what} with other settings (differs in: {', '.join(differences)}). {fix}")
