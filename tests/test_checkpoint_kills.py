"""Checkpoints under kills and damage: a save interrupted at every file-system operation it makes never leaves a
checkpoint that resume picks up, and a damaged file in the checkpoint a resume reads is named with the fix."""

import hashlib
import os
import shutil
import sys
import threading
from types import SimpleNamespace

import pytest
import torch
import transformers.modeling_utils

from trainer_ext.checkpoints import check_resume_files, last_complete_checkpoint, missing_files
from trainer_ext.training.output_dir import resolve_checkpoint
from trainer_ext.training.trainer import RecurrentTrainer

from test_runs import listing, logged_losses, run


class Killed(BaseException):
    """A kill: not an Exception, so no `except Exception` in the save code can carry on after it."""


class FileOperationKiller:
    """Counts the file-system operations of the code run while `armed` and kills it at operation `kill_at`.

    Python-level operations are seen through an audit hook (file opens for writing, renames, removals, folder
    creation and removal, copies); torch.save and the safetensors writer open their files in C++ / Rust and are
    wrapped instead. A file write counts twice: killed before it (no file) and killed during it (the file cut short,
    or created empty)."""

    WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
    EVENTS = ("os.rename", "os.remove", "os.rmdir", "os.mkdir", "shutil.copyfile", "os.truncate")

    def __init__(self):
        self.kill_at, self.count, self.armed, self.thread, self.log = None, 0, False, None, []
        sys.addaudithook(self._audit)

    def arm(self, kill_at):
        self.kill_at, self.count, self.log, self.thread, self.armed = kill_at, 0, [], threading.get_ident(), True

    def disarm(self):
        self.armed = False

    def _counting(self):
        return self.armed and threading.get_ident() == self.thread

    def _step(self, what, path, cut=None):
        """Count one operation; at `kill_at`, leave the file system as a kill there would (`cut`) and raise."""
        self.count += 1
        self.log.append(f"{what} {path}")
        if self.count == self.kill_at:
            self.armed = False
            if cut is not None:
                cut()
            raise Killed(self.log[-1])

    def _audit(self, event, args):
        if not self._counting():
            return
        if event == "open":
            path, mode, flags = args
            writing = (mode is not None and any(c in mode for c in "wax+")) or (
                mode is None and isinstance(flags, int) and flags & self.WRITE_FLAGS)
            if writing and isinstance(path, (str, bytes, os.PathLike)):
                self._step("open", path)
                self._step("create", path, cut=lambda: open(path, "wb").close())
        elif event in self.EVENTS:
            self._step(event, args[0])

    def wrap_writer(self, write):
        """`write(obj, path, ...)` counted as two operations: before it, and during it (the file cut in half)."""
        def counted(obj, path, *args, **kwargs):
            if not self._counting() or not isinstance(path, (str, os.PathLike)):
                return write(obj, path, *args, **kwargs)
            self._step(write.__name__, path)
            self.armed = False  # the writer's own Python-level operations are part of this one
            try:
                write(obj, path, *args, **kwargs)
            finally:
                self.armed = True
            self._step(f"{write.__name__} (cut short)", path, cut=lambda: os.truncate(path, os.path.getsize(path) // 2))
        return counted


KILLER = None


def killer(monkeypatch):
    global KILLER
    if KILLER is None:  # an audit hook cannot be removed: one for the session
        KILLER = FileOperationKiller()
    monkeypatch.setattr(torch, "save", KILLER.wrap_writer(torch.save))
    monkeypatch.setattr(transformers.modeling_utils, "safe_save_file",
                        KILLER.wrap_writer(transformers.modeling_utils.safe_save_file))
    return KILLER


def resume_choices(out):
    """What each way of resuming picks in `out`: the last complete checkpoint, the automatic resume, `true`."""
    def resolve(resume):
        return resolve_checkpoint(SimpleNamespace(output_dir=str(out), resume_from_checkpoint=resume,
                                                  overwrite_output_dir=False))
    return {last_complete_checkpoint(str(out)), resolve(None), resolve("true")}


def digest(folder):
    """{file: sha256} of the files a resume reads (the model card is rewritten after each save)."""
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in sorted(os.listdir(folder))
            if name != "README.md"}


def test_a_save_killed_at_any_file_operation_is_never_resumed_and_a_rerun_resumes(tiny_data_dir, tmp_path,
                                                                                monkeypatch):
    """The save of step 6 (checkpoints 2 and 4 present, rotation deletes 2) is killed before and during each of its
    file operations in turn. After every kill the resume picks checkpoint-4 as it was, or checkpoint-6 once it is
    published whole; a rerun from the states a kill leaves trains on as the uninterrupted run did."""
    run(tiny_data_dir, tmp_path / "full", "--max_steps", "8")
    out, before_save = tmp_path / "run", tmp_path / "before-save"
    run(tiny_data_dir, out, "--max_steps", "4")
    kill = killer(monkeypatch)
    save = RecurrentTrainer._save_checkpoint
    outcomes, kept = [], {}

    def save_killed_at_every_operation(self, model, trial):
        if self.state.global_step != 6:
            return save(self, model, trial)
        shutil.copytree(out, before_save, ignore=shutil.ignore_patterns("README.md"))
        checkpoint_4, whole = digest(out / "checkpoint-4"), {name: digest(out / name) for name in ("checkpoint-2",
                                                                                              "checkpoint-4")}
        for kill_at in range(1, 200):
            shutil.rmtree(out)
            shutil.copytree(before_save, out)
            kill.arm(kill_at)
            try:
                save(self, model, trial)
            except Killed as killed:
                picked = resume_choices(out)
                assert len(picked) == 1, (killed, picked)
                picked = picked.pop()
                outcomes.append((str(killed), picked, digest(out / os.path.basename(picked))))
                assert os.path.basename(picked) in ("checkpoint-4", "checkpoint-6"), killed
                assert not missing_files(picked)
                check_resume_files(picked)
                for folder in sorted(out.glob("checkpoint-*")):  # none half-deleted, which an explicit resume could take
                    if folder.name in whole:
                        assert digest(folder) == whole[folder.name], (killed, folder.name)
                left = kept[os.path.basename(picked)] = tmp_path / f"left-by-{os.path.basename(picked)}"
                shutil.rmtree(left, ignore_errors=True)  # the last kill of each outcome leaves the most behind
                shutil.copytree(out, left)
            else:
                break
            finally:
                kill.disarm()
        else:
            pytest.fail("the save did not complete within 200 file operations")
        assert kill_at > 20  # every file of the save was written under a kill
        complete_6 = digest(out / "checkpoint-6")
        for killed, picked, files in outcomes:
            assert files == (complete_6 if picked.endswith("checkpoint-6") else checkpoint_4), killed
        # Killed before the rename: the previous checkpoint; after it (rotation under way): the new one.
        assert [os.path.basename(picked) for _, picked, _ in outcomes] == sorted(
            os.path.basename(picked) for _, picked, _ in outcomes)
        assert set(kept) == {"checkpoint-4", "checkpoint-6"}

    with monkeypatch.context() as patch:
        patch.setattr(RecurrentTrainer, "_save_checkpoint", save_killed_at_every_operation)
        run(tiny_data_dir, out, "--max_steps", "8")
    assert logged_losses(out) == pytest.approx(logged_losses(tmp_path / "full"), rel=1e-6)

    for name, folder in kept.items():  # a rerun of the same command from what the last kill of each outcome left
        run(tiny_data_dir, folder, "--max_steps", "8")
        assert logged_losses(folder) == pytest.approx(logged_losses(tmp_path / "full"), rel=1e-6), name
        assert listing(folder) == listing(tmp_path / "full"), name


@pytest.mark.parametrize("name, damage", [
    ("optimizer.pt", "truncate"),
    ("rng_state.pth", "empty"),
    ("scheduler.pt", "truncate"),
    ("model.safetensors", "truncate"),
])
def test_resuming_from_a_damaged_checkpoint_names_the_file_and_the_fix(tiny_data_dir, tmp_path, name, damage):
    out = tmp_path / "run"
    run(tiny_data_dir, out, "--max_steps", "4")
    file = out / "checkpoint-4" / name
    os.truncate(file, os.path.getsize(file) // 2 if damage == "truncate" else 0)
    before = listing(out)
    for resume in ([], ["--resume_from_checkpoint", "true"], ["--resume_from_checkpoint", str(out / "checkpoint-4")]):
        with pytest.raises(ValueError, match=rf"Cannot resume from {out / 'checkpoint-4'}: {name} \(.*\) is truncated "
                                             rf"or corrupt.*Delete {out / 'checkpoint-4'}.*"
                                             rf"--resume_from_checkpoint {out / 'checkpoint-2'}"):
            run(tiny_data_dir, out, "--max_steps", "6", *resume)
    assert listing(out) == before
    shutil.rmtree(out / "checkpoint-4")  # the fix the message gives
    run(tiny_data_dir, out, "--max_steps", "6")
    assert len(logged_losses(out)) == 6
