"""Trainer checkpoints on disk: which ones are complete, the last complete one, and publishing a new one atomically.

A `checkpoint-N` folder counts as complete when it holds a readable `trainer_state.json` and the model weights. The
Trainer writes `trainer_state.json` last, so a save killed before the end leaves a folder without it; transformers'
`get_last_checkpoint` would still pick that folder, and resuming from it fails with a raw `FileNotFoundError`.
`RecurrentTrainer` writes each checkpoint under a staging folder (`tmp-checkpoint-N`, see `staging_dir`) and
renames it into place when every file is written, so a `checkpoint-N` folder is either complete or absent; the
completeness check still guards checkpoints written by other code or older versions.

The same knowledge checks a folder before it is opened as a model or tokenizer (`check_model_dir`,
`load_tokenizer`): a run folder given instead of its `final/`, a truncated weights file and missing tokenizer
files otherwise surface as library errors that name neither the file nor the fix.

Disk space: `expected_checkpoint_bytes` is what the next save needs (the last complete checkpoint's size, else the
weights plus the optimizer state), checked before a save writes anything; a recurrent-7b checkpoint with its
optimizer state is about 16 GB.
"""

from __future__ import annotations

import json
import os
import re
import shutil

from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, sort_checkpoints
from transformers.utils import (
    ADAPTER_SAFE_WEIGHTS_NAME,
    ADAPTER_WEIGHTS_NAME,
    SAFE_WEIGHTS_INDEX_NAME,
    SAFE_WEIGHTS_NAME,
    WEIGHTS_INDEX_NAME,
    WEIGHTS_NAME,
)

TRAINER_STATE_NAME = "trainer_state.json"
# What the Trainer's own loader accepts as model weights (`Trainer._load_from_checkpoint`): one of these files, or
# an FSDP state dict (a `pytorch_model_fsdp*` file or folder).
WEIGHT_NAMES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_NAME, WEIGHTS_INDEX_NAME,
                ADAPTER_SAFE_WEIGHTS_NAME, ADAPTER_WEIGHTS_NAME)
FSDP_WEIGHTS_PREFIX = "pytorch_model_fsdp"
# Folders of saves under way (or killed): never picked for resuming, removed when the same save runs again.
STAGING_PREFIX = "tmp-"
_CHECKPOINT_NAME = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


def missing_files(checkpoint: str) -> list[str]:
    """What `checkpoint` lacks to be resumed from (empty when complete)."""
    if not os.path.isdir(checkpoint):
        return ["the folder itself"]
    missing = []
    state_file = os.path.join(checkpoint, TRAINER_STATE_NAME)
    try:
        with open(state_file, encoding="utf-8") as f:
            json.load(f)
    except FileNotFoundError:
        missing.append(TRAINER_STATE_NAME)
    except (OSError, ValueError):  # cut short by a kill while the Trainer wrote it
        missing.append(f"{TRAINER_STATE_NAME} (unreadable)")
    names = os.listdir(checkpoint)
    if not any(name in WEIGHT_NAMES or name.startswith(FSDP_WEIGHTS_PREFIX) for name in names):
        missing.append(f"model weights ({SAFE_WEIGHTS_NAME} or another weights file)")
    return missing


def is_complete(checkpoint: str) -> bool:
    return not missing_files(checkpoint)


def checkpoint_step(path: str) -> int | None:
    """N of a `checkpoint-N` folder name, else None."""
    match = _CHECKPOINT_NAME.match(os.path.basename(os.path.normpath(path)))
    return int(match.group(1)) if match else None


def list_checkpoints(output_dir: str) -> list[str]:
    """Every `checkpoint-N` folder in `output_dir`, complete or not, by step."""
    if not os.path.isdir(output_dir):
        return []
    found = [(checkpoint_step(name), os.path.join(output_dir, name)) for name in os.listdir(output_dir)]
    return [path for step, path in sorted(item for item in found if item[0] is not None) if os.path.isdir(path)]


def last_complete_checkpoint(output_dir: str) -> str | None:
    """The complete checkpoint of the highest step in `output_dir`, if any (incomplete ones are passed over)."""
    for path in reversed(list_checkpoints(output_dir)):
        if is_complete(path):
            return path
    return None


def complete_checkpoints(output_dir: str) -> dict[int, str]:
    """The complete checkpoints of `output_dir` by step."""
    return {checkpoint_step(path): path for path in list_checkpoints(output_dir) if is_complete(path)}


def folder_bytes(path: str) -> int:
    """Bytes of the files under `path`."""
    return sum(os.path.getsize(os.path.join(root, name)) for root, _, names in os.walk(path) for name in names)


def _tensor_bytes(tensors) -> int:
    """Bytes of the distinct tensors among `tensors` (tied weights are saved once), at their full size (a DTensor
    shard counts as the whole parameter, which the saved weights hold)."""
    import torch

    seen, total = set(), 0
    for tensor in tensors:
        if not isinstance(tensor, torch.Tensor):
            continue
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        key = (local.data_ptr(), local.dtype, tuple(local.shape))
        if local.data_ptr() and key in seen:
            continue
        seen.add(key)
        total += tensor.numel() * tensor.element_size()
    return total


def _state_tensors(state):
    if isinstance(state, dict):
        for value in state.values():
            yield from _state_tensors(value)
    elif isinstance(state, (list, tuple)):
        for value in state:
            yield from _state_tensors(value)
    else:
        yield state


def expected_checkpoint_bytes(model, optimizer, run_dir: str) -> int:
    """About what the next checkpoint of a run in `run_dir` takes on disk: the size of its last complete checkpoint
    (everything a save writes: weights, optimizer, scheduler and RNG states, tokenizer files), else the model's
    parameters and buffers plus the optimizer's state tensors (`optimizer` None: the weights alone)."""
    last = last_complete_checkpoint(run_dir)
    if last is not None:
        return folder_bytes(last)
    total = _tensor_bytes([*model.parameters(), *model.buffers()])
    if optimizer is not None:
        total += _tensor_bytes(_state_tensors(list(optimizer.state.values())))
    return total


def read_trainer_state(checkpoint: str) -> dict:
    with open(os.path.join(checkpoint, TRAINER_STATE_NAME), encoding="utf-8") as f:
        return json.load(f)


def check_checkpoint(checkpoint: str, option: str = "--resume_from_checkpoint") -> str:
    """`checkpoint` if it can be resumed from, else ValueError naming it, what it lacks and what to pass instead."""
    missing = missing_files(checkpoint)
    if not missing:
        return checkpoint
    parent = os.path.dirname(os.path.normpath(checkpoint))
    last = last_complete_checkpoint(parent) if parent else None
    instead = (f"the last complete checkpoint there is {last}" if last
               else "there is no complete checkpoint beside it")
    what = ("does not exist" if missing == ["the folder itself"]
            else f"is not a complete checkpoint (missing {', '.join(missing)}; a save interrupted by a kill leaves "
                 "such a folder)")
    raise ValueError(f"{option} {checkpoint} {what}: {instead}. Pass a complete checkpoint, `{option} true` for "
                     "the last complete one in --output_dir, or leave it out to start afresh.")


# Written by torch.save (a zip archive): the optimizer, scheduler, RNG states, training arguments, `.bin` weights.
TORCH_FILE_SUFFIXES = (".pt", ".pth", ".bin")
_ZIP_MAGIC = b"PK\x03\x04"


def _torch_file_damage(file: str) -> str | None:
    """Why the torch.save file `file` cannot be read, or None. Reads the zip directory at the file's end (a cut-short
    file has none; torch's own error, "failed finding central directory", names no file), not the tensors."""
    import zipfile

    with open(file, "rb") as f:
        head = f.read(len(_ZIP_MAGIC))
    if not head:
        return "it is empty"
    if head != _ZIP_MAGIC:
        return None  # the legacy (pre-zip) format: torch checks it while loading
    try:
        with zipfile.ZipFile(file) as archive:
            size = os.path.getsize(file)
            if any(info.header_offset + info.compress_size > size for info in archive.infolist()):
                return "its records run past the end of the file"
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        return f"no readable zip directory: {err}"
    return None


def check_resume_files(checkpoint: str, option: str = "--resume_from_checkpoint") -> None:
    """Before resuming from `checkpoint`: every weights and training-state file in it reads, else a ValueError naming
    the file and the fix. A truncated file (a kill or full disk during a copy, a save by other code) otherwise fails
    inside the Trainer's loading with a library error that names no file, after the model is built."""
    from safetensors import SafetensorError, safe_open

    damaged = []
    for name in sorted(os.listdir(checkpoint)):
        file = os.path.join(checkpoint, name)
        if not os.path.isfile(file):
            continue
        if name.endswith(".safetensors"):
            try:
                with safe_open(file, framework="pt"):
                    pass
            except SafetensorError as err:
                damaged.append(f"{name} ({err})")
        elif name.endswith(TORCH_FILE_SUFFIXES):
            reason = _torch_file_damage(file)
            if reason:
                damaged.append(f"{name} ({reason})")
    if not damaged:
        return
    parent = os.path.dirname(os.path.normpath(checkpoint))
    earlier = [path for step, path in complete_checkpoints(parent).items() if step < (checkpoint_step(checkpoint) or 0)]
    instead = (f"`{option} {earlier[-1]}` (the last complete checkpoint before it)" if earlier
               else f"`{option}` with an earlier checkpoint (there is none beside it)")
    raise ValueError(f"Cannot resume from {checkpoint}: {'; '.join(damaged)} {'is' if len(damaged) == 1 else 'are'} "
                     "truncated or corrupt (an interrupted copy or save leaves such a file). Delete "
                     f"{checkpoint} (a rerun then resumes from the complete checkpoint before it), pass {instead}, "
                     "or start afresh with --overwrite_output_dir.")


_DELETED_SUFFIX = ".deleted"


def staging_dir(checkpoint: str) -> str:
    """Where the save of `checkpoint` (…/checkpoint-N) is written before it is renamed into place."""
    parent, name = os.path.split(os.path.normpath(checkpoint))
    return os.path.join(parent, STAGING_PREFIX + name)


def is_staging_dir(name: str) -> bool:
    return name.startswith(STAGING_PREFIX + PREFIX_CHECKPOINT_DIR + "-")


def publish(staged: str, checkpoint: str) -> None:
    """Rename the finished save `staged` to `checkpoint`, replacing an older folder of that name.

    A rename within one folder is atomic: readers see the old folder or the complete new one. A folder cannot be
    renamed over a non-empty one, so an existing `checkpoint` is first moved aside (for that instant the folder
    is absent, never half-written) and deleted afterwards. The folders are then dated for the rotation that
    follows (`date_by_save_time`).
    """
    replaced = None
    if os.path.exists(checkpoint):
        replaced = staging_dir(checkpoint) + ".replaced"
        shutil.rmtree(replaced, ignore_errors=True)
        os.replace(checkpoint, replaced)
    os.replace(staged, checkpoint)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    date_by_save_time(os.path.dirname(checkpoint))


def date_by_save_time(run_dir: str) -> None:
    """Date every `checkpoint-N` folder in `run_dir` by its `trainer_state.json` (folders without one: the epoch).

    The rotation (`rotate_checkpoints`, as transformers') deletes the folders of the oldest modification
    time first. Deleting files from a folder makes it new: a rotation killed midway leaves a half-deleted folder
    that the next rotation would keep as the newest while deleting complete ones. Dated by their save, half-deleted
    and incomplete folders go first."""
    for path in list_checkpoints(run_dir):
        state = os.path.join(path, TRAINER_STATE_NAME)
        saved = os.path.getmtime(state) if os.path.isfile(state) else 0
        os.utime(path, (saved, saved))


def rotate_checkpoints(run_dir: str, save_total_limit: int | None, best_model_checkpoint: str | None = None) -> list[str]:
    """Keep at most `save_total_limit` checkpoints in `run_dir` (oldest saves go first; the newest and the best are
    kept), as transformers' rotation does, but each deletion is atomic: the folder is first renamed out of the
    `checkpoint-N` names (to a staging name, which resume detection and the output-dir rules pass over), then its
    files are removed. A kill midway leaves no half-deleted `checkpoint-N` that `--resume_from_checkpoint` could
    take. Leftovers of earlier killed deletions are removed first. Returns the checkpoints deleted."""
    for name in os.listdir(run_dir):
        if name.startswith(STAGING_PREFIX) and name.endswith(_DELETED_SUFFIX):
            shutil.rmtree(os.path.join(run_dir, name), ignore_errors=True)
    if not save_total_limit or save_total_limit <= 0:
        return []
    checkpoints = sort_checkpoints(run_dir, PREFIX_CHECKPOINT_DIR, use_mtime=True)
    protected = {checkpoints[-1]} if checkpoints else set()
    if best_model_checkpoint is not None:
        protected.add(os.path.normpath(best_model_checkpoint))
    excess = len(checkpoints) - max(save_total_limit, len(protected))
    doomed = [path for path in checkpoints if os.path.normpath(path) not in protected][:max(excess, 0)]
    for checkpoint in doomed:
        aside = staging_dir(checkpoint) + _DELETED_SUFFIX
        os.replace(checkpoint, aside)
        shutil.rmtree(aside, ignore_errors=True)
    return doomed


# -- opening a model or tokenizer folder: library errors turned into ones that name the file and the fix

FINAL_DIR = "final"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def check_not_run_dir(path: str, option: str) -> None:
    """Refuse a training run's output folder (`pretrain`'s) given where a model is expected.

    Such a folder holds `checkpoint-N/` and `final/` but no config.json of its own; transformers then fails with
    a message about sentencepiece / tiktoken (the tokenizer) or a missing `model_type`, neither naming the cause."""
    if not os.path.isdir(path) or os.path.isfile(os.path.join(path, "config.json")):
        return
    final_dir = os.path.join(path, FINAL_DIR)
    if os.path.isfile(os.path.join(final_dir, "config.json")):
        raise ValueError(f"{option} {path} is a training run's folder, not a model checkpoint (no config.json): "
                         f"pass {final_dir}, the run's final checkpoint.")
    if list_checkpoints(path):
        last = last_complete_checkpoint(path)
        instead = f"pass {last}, its last complete checkpoint" if last else "it holds no complete checkpoint yet"
        raise ValueError(f"{option} {path} is a training run's folder without {FINAL_DIR}/ (the run has not "
                         f"finished) and no config.json of its own: {instead}, or {os.path.join(path, FINAL_DIR)} "
                         "once the run ends.")


def check_weight_files(path: str, option: str) -> None:
    """Open the header of every safetensors file in the folder `path`, so a truncated or corrupt one is named.

    Reading the headers maps the files without loading tensors (milliseconds); safetensors' own error on a cut-short
    download or an interrupted save ("incomplete metadata", "header too small") names no file."""
    if not os.path.isdir(path):
        return  # a hub id: transformers downloads and checks it
    from safetensors import SafetensorError, safe_open

    for name in sorted(os.listdir(path)):
        if not name.endswith(".safetensors"):
            continue
        file = os.path.join(path, name)
        try:
            with safe_open(file, framework="pt"):
                pass
        except SafetensorError as err:
            raise ValueError(f"{option} {path}: {file} is truncated or corrupt ({err}). Download it again, or save "
                             "the checkpoint again (save_pretrained); an interrupted copy or save leaves such a "
                             "file.") from err


def check_model_dir(path: str, option: str) -> None:
    """Before `from_pretrained(path)`: refuse a run folder (pass its final/) and truncated weight files."""
    check_not_run_dir(path, option)
    check_weight_files(path, option)


def load_tokenizer(path: str, option: str, fix: str, **kwargs):
    """`AutoTokenizer.from_pretrained(path, **kwargs)` whose failure names the folder, what it lacks and `fix`.

    Without tokenizer files transformers tries to convert a slow tokenizer and asks for sentencepiece or tiktoken,
    which is not the problem."""
    from transformers import AutoTokenizer

    check_not_run_dir(path, option)
    try:
        return AutoTokenizer.from_pretrained(path, **kwargs)
    except (OSError, ValueError) as err:
        if not os.path.isdir(path) and (os.path.isabs(path) or path.startswith((".", "~"))):  # a path, not a hub id
            raise ValueError(f"{option} {path}: no such directory; give a local checkpoint directory or a hub id."
                             ) from err
        if not os.path.isdir(path):
            raise ValueError(f"{option} {path}: no tokenizer could be loaded ({err}). {fix}") from err
        present = [name for name in TOKENIZER_FILES if os.path.isfile(os.path.join(path, name))]
        what = (f"has no tokenizer files ({' / '.join(TOKENIZER_FILES)} missing)" if not present
                else f"holds {', '.join(present)} but no tokenizer could be loaded from it ({err})")
        raise ValueError(f"{option} {path} {what}. {fix}") from err
