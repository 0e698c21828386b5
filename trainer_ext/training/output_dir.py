"""A run's output directory, transformers' run_clm.py rule: a non-empty --output_dir resumes from its last complete
checkpoint (incomplete ones, from a save interrupted by a kill, are passed over), one without a complete checkpoint
is refused, and --overwrite_output_dir starts afresh there. A run already at --max_steps is not resumed (nothing
would train). A resumed run keeps the momentum its optimizer was trained with (`resume_momentum`)."""

import logging
import os
import shutil

import torch
from transformers.trainer import OPTIMIZER_NAME

from trainer_ext.checkpoints import (
    FINAL_DIR,
    check_checkpoint,
    is_staging_dir,
    last_complete_checkpoint,
    list_checkpoints,
    missing_files,
    read_trainer_state,
)

logger = logging.getLogger(__name__)


def _incomplete_note(output_dir: str) -> str:
    incomplete = [path for path in list_checkpoints(output_dir) if missing_files(path)]
    if not incomplete:
        return ""
    names = ", ".join(f"{os.path.basename(path)} (missing {', '.join(missing_files(path))})" for path in incomplete)
    return f"; incomplete, from a save interrupted by a kill: {names}"


def resolve_checkpoint(training_args) -> str | None:
    """The checkpoint to resume from, or None to start afresh; reads the output directory, writes nothing.

    An explicit `--resume_from_checkpoint PATH` must be complete; `--resume_from_checkpoint true` takes the last
    complete checkpoint in --output_dir. Without it, a non-empty --output_dir resumes from its last complete
    checkpoint, and one without any is refused; `--overwrite_output_dir` starts afresh (see `clear_output_dir`).
    """
    output_dir = training_args.output_dir
    resume = training_args.resume_from_checkpoint
    overwrite = training_args.overwrite_output_dir
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"--output_dir {output_dir} is a file, not a folder; choose another --output_dir.")
    if resume is not None and overwrite:
        raise ValueError(f"--overwrite_output_dir starts afresh (deleting the checkpoints in {output_dir}) and "
                         f"--resume_from_checkpoint {resume} continues a run; pass one of them.")
    if resume is not None:
        if resume.strip().lower() != "true":
            return check_checkpoint(resume)
        last = last_complete_checkpoint(output_dir)
        if last is None:
            raise ValueError(
                f"--resume_from_checkpoint true: --output_dir {output_dir} holds no complete checkpoint to resume "
                f"from{_incomplete_note(output_dir)}. Leave --resume_from_checkpoint out to start afresh (with "
                "--overwrite_output_dir if the folder is not empty), or pass a checkpoint folder.")
        return last
    entries = sorted(name for name in os.listdir(output_dir) if not is_staging_dir(name)) \
        if os.path.isdir(output_dir) else []
    if overwrite or not entries:
        return None
    last = last_complete_checkpoint(output_dir)
    if last is None:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ValueError(
            f"--output_dir {output_dir} is not empty ({shown}) and holds no complete checkpoint to resume "
            f"from{_incomplete_note(output_dir)}. Pass --overwrite_output_dir to train afresh there (its "
            "checkpoints and final/ are deleted), or choose another --output_dir.")
    return last


def log_resume(checkpoint: str | None, training_args) -> None:
    """Say which checkpoint `resolve_checkpoint` found in --output_dir (an explicit path needs no word)."""
    resume = training_args.resume_from_checkpoint
    if checkpoint is None or (resume is not None and resume.strip().lower() != "true"):
        return
    logger.info("Resuming from %s, the last complete checkpoint in %s%s.", checkpoint, training_args.output_dir,
                " (--overwrite_output_dir starts afresh instead)" if resume is None else "")


def check_steps_left(checkpoint: str, training_args) -> None:
    """Refuse to continue a run found in --output_dir that is already at or past --max_steps.

    Resuming it would train nothing and rewrite final/ from its last checkpoint, under a command that meant to
    train a new run; the user asked for something else and must say which."""
    max_steps = training_args.max_steps
    if max_steps is None or max_steps <= 0:  # an epoch budget: the Trainer decides from the data's length
        return
    step = read_trainer_state(checkpoint).get("global_step", 0)
    if step < max_steps:
        return
    output_dir = training_args.output_dir
    finished = os.path.isdir(os.path.join(output_dir, FINAL_DIR))
    raise ValueError(
        f"--output_dir {output_dir} holds a {'finished' if finished else 'previous'} run at step {step} "
        f"({os.path.basename(checkpoint)}{', final/' if finished else ''}); with --max_steps {max_steps} there is "
        "nothing left to train. Pass a larger --max_steps to continue that run, --overwrite_output_dir to train "
        "afresh there (its checkpoints and final/ are deleted), or choose another --output_dir.")


def resume_momentum(checkpoint: str | None, training_args) -> None:
    """Resume with the momentum the checkpoint's optimizer was trained with.

    Loading a checkpoint's optimizer state replaces the new optimizer's settings with the saved ones, so a resumed run
    keeps its momentum whatever the arguments say, while the memory plan is made, before, from the arguments: where
    the default differs from the checkpoint's (recurrent-3.3b's full momentum became subspace momentum), the plan would
    leave out 6 GiB the resumed optimizer holds. Where the arguments leave momentum unset, they take the checkpoint's
    (logged); a given one that differs is refused here, before any work. A checkpoint without `optimizer.pt` (FSDP2
    saves its shards apart) or of another optimizer is left alone."""
    path = None if checkpoint is None else os.path.join(checkpoint, OPTIMIZER_NAME)
    if training_args.optimizer != "low_memory" or path is None or not os.path.isfile(path):
        return
    groups = torch.load(path, map_location="cpu", weights_only=True, mmap=True)["param_groups"]  # tensors not read
    if not groups or "momentum_rank_fraction" not in groups[0]:
        return
    saved = {"optimizer_momentum": groups[0]["momentum"] or 0.0}  # None: trained without momentum
    if saved["optimizer_momentum"]:  # None: full momentum
        saved["optimizer_momentum_rank_fraction"] = groups[0]["momentum_rank_fraction"] or 1.0
    adopted = []
    for name, value in saved.items():
        given = getattr(training_args, name)
        if given is None:
            setattr(training_args, name, value)
            adopted.append(f"--{name} {value:g}")
        elif given != value:
            raise ValueError(f"--{name} {given:g} differs from the optimizer of {checkpoint}, trained with {value:g}: "
                             f"a resumed optimizer keeps its saved momentum. Leave --{name} unset to resume as it was "
                             "trained, or pass --overwrite_output_dir to start afresh with yours.")
    if adopted:
        logger.info("Resuming with the momentum of the checkpoint's optimizer: %s.", ", ".join(adopted))


def clear_output_dir(output_dir: str) -> list[str]:
    """Delete what a previous run left in `output_dir` that a new one must not mix with: its checkpoints (a later
    automatic resume would pick the old run's highest step), saves under way and final/. Returns what went."""
    if not os.path.isdir(output_dir):
        return []
    doomed = list_checkpoints(output_dir) + [os.path.join(output_dir, name) for name in os.listdir(output_dir)
                                             if is_staging_dir(name)]
    final_dir = os.path.join(output_dir, FINAL_DIR)
    if os.path.isdir(final_dir):
        doomed.append(final_dir)
    for path in doomed:
        shutil.rmtree(path)
    return doomed
