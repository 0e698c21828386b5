"""Output files that are either whole or absent, and the rerun check of a directory written by an earlier run.

Atomic writes: the data goes to `.{name}.tmp` beside the target, is fsynced, then renamed, so a crash leaves the
previous file or the complete new one, never half of one. Clean-up code of interrupted runs removes `.*.tmp`.

Reruns: a directory records the settings that made it (a manifest or state file); `check_same_run` refuses to
continue or reuse it under other settings, naming the fields that differ and the way out.

One writer: under torchrun / accelerate launch every process runs the same code, but files that all of them read
(prepared shards, a teacher cache, a state file) are written by one of them while the others wait
(`one_process_writes`); `launch_process_group` joins the processes of a command that forms no group of its own.

Disk space: a long write (data preparation, a teacher cache, a checkpoint) first checks the free space against its
expected size and refuses a shortfall with both numbers (`check_free_space`); a write that fills the disk anyway
removes its temporary files and says how much more space is needed (`disk_space_for`). Without this a full disk
surfaced as `OSError: [Errno 28]` or torch's "unexpected pos" error, and left gigabytes of temporary files that kept
the disk full for the rerun.
"""

import datetime
import errno
import json
import os
import shutil
from contextlib import contextmanager
from typing import Any, Callable, Iterable

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


def cpu_group():
    """A gloo group of the launch's processes, created by all of them on first use (a collective: every process
    must reach the first call at the same point); None without a process group of several processes. The processes
    waiting in `one_process_writes` wait in it, and small host-side agreements (the step a signal stops training
    at) use it: no GPU synchronization, and no NCCL watchdog that ends a long wait."""
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
    group = cpu_group()
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


# -- disk space

# Errors of a write that ran out of space: the errno (ENOSPC, or EDQUOT for a quota), and the texts of libraries
# that do not raise an OSError for it: torch.save's zip writer ("unexpected pos ... vs ...", "file write failed")
# and safetensors' Rust I/O error ("No space left on device (os error 28)", "StorageFull").
_DISK_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_DISK_FULL_TEXTS = ("no space left on device", "os error 28", "storagefull", "unexpected pos", "file write failed",
                    "disk quota exceeded")


class DiskFullError(OSError):
    """Not enough free space for a write: found before it (a shortfall) or by it (the disk filled up). An OSError
    with errno ENOSPC, so that code handling that keeps working; its message names the folder, the sizes and the fix."""

    def __init__(self, message: str):
        super().__init__(errno.ENOSPC, message)

    def __str__(self) -> str:
        return self.strerror


def format_bytes(num_bytes: float) -> str:
    """`num_bytes` for a reader: "512 B", "4.9 MiB", "16.0 GiB"."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(num_bytes) < 1024 or unit == "TiB":
            return f"{num_bytes:.0f} {unit}" if unit == "B" else f"{num_bytes:.1f} {unit}"
        num_bytes /= 1024
    raise AssertionError("unreachable")


def free_bytes(folder: str) -> int:
    """Free space (bytes) of the filesystem that holds `folder`, or would hold it: its nearest existing ancestor is
    asked when the folder is not created yet."""
    path = os.path.abspath(os.fspath(folder))
    while not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    return shutil.disk_usage(path).free


def check_free_space(folder: str, needed: int, what: str, fix: str = "") -> int:
    """Refuse to start writing `what` (about `needed` bytes) into `folder` when its filesystem has less free space;
    return the free bytes. The error names both numbers, the shortfall and `fix` (how this command needs less, e.g.
    "lower --max_tokens"), then the generic ways out: free space there or choose another folder."""
    free = free_bytes(folder)
    if free < needed:
        raise DiskFullError(
            f"Not enough free space in {folder} for {what}: it needs about {format_bytes(needed)}, the disk has "
            f"{format_bytes(free)} free. Free at least {format_bytes(needed - free)} there"
            + (f", {fix}" if fix else "") + ", or write to another folder; then run the same command again.")
    return free


def is_disk_full(err: BaseException) -> bool:
    """Whether `err` (or an error it was raised from) says the disk or the quota is full."""
    seen = set()
    while err is not None and id(err) not in seen:
        seen.add(id(err))
        if isinstance(err, OSError) and err.errno in _DISK_FULL_ERRNOS:
            return True
        if any(text in str(err).lower() for text in _DISK_FULL_TEXTS):
            return True
        err = err.__cause__ or err.__context__
    return False


def remove_paths(paths: Iterable[str]) -> list[str]:
    """Delete each of `paths` that exists (files and folders); return those deleted."""
    removed = []
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        elif os.path.lexists(path):
            os.remove(path)
        else:
            continue
        removed.append(path)
    return removed


@contextmanager
def disk_space_for(folder: str, needed: int, what: str,
                   remove: Iterable[str] | Callable[[], Iterable[str]] | None = None, fix: str = ""):
    """A long write of `what` (about `needed` bytes) into `folder`:

        with disk_space_for(cache_dir, shard_bytes, f"the teacher cache's {name}", remove=[tmp_path]):
            write(tmp_path)

    refuses to start on a shortfall (`check_free_space`), and when the block fails because the disk filled up
    removes `remove` (its temporary files; a callable returning paths is called then, for files known only by
    then) and raises DiskFullError saying how much more space is needed and that a rerun after freeing it works.
    Other failures pass through unchanged."""
    check_free_space(folder, needed, what, fix)
    try:
        yield
    except Exception as err:
        if not is_disk_full(err):
            raise
        paths = remove() if callable(remove) else (remove or [])
        raise disk_full_error(folder, needed, what, remove_paths(paths), fix, err) from err


def disk_full_error(folder: str, needed: int, what: str, removed: list[str], fix: str = "",
                    err: BaseException | None = None) -> DiskFullError:
    """The error of a write of `what` (about `needed` bytes) into `folder` that filled the disk, once its temporary
    files (`removed`) are deleted: how much more space is needed now, and that the same command works again then."""
    free = free_bytes(folder)
    more = (f"free at least {format_bytes(needed - free)} more" if needed > free
            else "free more (the size was underestimated, or other writes took the space meanwhile)")
    cleaned = (f" Removed the partial files ({', '.join(os.path.basename(os.path.normpath(p)) for p in removed)})."
               if removed else "")
    cause = f" ({type(err).__name__}: {err})" if err is not None else ""
    return DiskFullError(
        f"The disk is full: writing {what} to {folder} failed{cause}.{cleaned} It needs about "
        f"{format_bytes(needed)} and {format_bytes(free)} are free now: {more} there"
        + (f", {fix}" if fix else "") + ", or write to another folder; then run the same command again.")
