"""Output files that are either whole or absent, and the rerun check of a directory written by an earlier run.

Atomic writes: the data goes to `.{name}.tmp` beside the target, is fsynced, then renamed, so a crash leaves the
previous file or the complete new one, never half of one. Clean-up code of interrupted runs removes `.*.tmp`.

Reruns: a directory records the settings that made it (a manifest or state file); `check_same_run` refuses to
continue or reuse it under other settings, naming the fields that differ and the way out.

One writer: under torchrun / accelerate launch every process runs the same code, but files that all of them read
(prepared shards, a teacher cache, a state file) are written by one of them while the others wait
(`one_process_writes`); `launch_process_group` joins the processes of a command that forms no group of its own.
"""

import datetime
import json
import os
from contextlib import contextmanager
from typing import Any

# A preparation or a teacher cache can take hours, longer than a launch's own timeout (--ddp_timeout, 30 minutes by
# default): the processes waiting for one wait up to this long. A failure of the writing process ends their wait at
# once, so this bounds only a hang.
WRITER_WAIT = datetime.timedelta(days=7)
_writer_wait = {"world": None, "group": None}  # the launch's group, and the group its processes wait in
_writing = False


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


def _writer_wait_group():
    """The gloo group the processes of a launch wait in, created by all of them on first use (a collective, as every
    process reaches `one_process_writes` at the same point); None without a process group of several processes."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return None
    if _writer_wait["world"] is not dist.group.WORLD:  # first use, or a group formed after another one ended
        _writer_wait["group"] = dist.new_group(backend="gloo", timeout=WRITER_WAIT)
        _writer_wait["world"] = dist.group.WORLD
    return _writer_wait["group"]


@contextmanager
def one_process_writes(what: str):
    """Yield True on the one process that writes `what` (rank 0) and False on the others, which enter the block
    only once it is written, then read it:

        with one_process_writes(f"the data in {path}") as writes:
            if writes:
                prepare(...)
        manifest = read_manifest(path)

    Under a launch of several processes every one must reach the block at the same point; without a process group
    it yields True and does nothing else. The others wait in a gloo group of their own, with WRITER_WAIT as timeout:
    in the launch's group NCCL's watchdog would end them during a long preparation. If the writer fails inside the
    block they raise RuntimeError rather than read what it left half-written. One filesystem is assumed shared by
    all processes, as for the Trainer's checkpoints. Blocks do not nest (only the writer would reach the inner one)."""
    global _writing
    group = _writer_wait_group()
    if group is None:
        yield True
        return
    import torch
    import torch.distributed as dist

    assert not _writing, f"one_process_writes({what!r}) inside another one: the processes would wait for each other"
    written = torch.zeros(1, dtype=torch.int32)
    if dist.get_rank() != 0:
        dist.broadcast(written, src=0, group=group)
        if not written.item():
            raise RuntimeError(f"Process 0 failed while writing {what} (its error is in its output); process "
                               f"{dist.get_rank()} stops rather than read what it left.")
        yield False
        return
    _writing = True
    try:
        yield True
        written.fill_(1)
    finally:
        _writing = False
        dist.broadcast(written, src=0, group=group)


@contextmanager
def launch_process_group():
    """For a command that trains nothing (the data preparation, the teacher cache) started by torchrun /
    accelerate launch: its processes joined in a gloo group for the block, so that `one_process_writes` lets one
    of them write. Nothing without a launcher (WORLD_SIZE unset or 1) or where a group exists already."""
    import torch.distributed as dist

    if int(os.environ.get("WORLD_SIZE", "1")) == 1 or not dist.is_available() or dist.is_initialized():
        yield
        return
    dist.init_process_group(backend="gloo")
    try:
        yield
        dist.barrier()  # no process ends the group while another still receives from it
    finally:
        dist.destroy_process_group()
