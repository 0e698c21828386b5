"""Rolling a run back to one of its checkpoints in place, and the message when there is none to roll back to.

The stability guard (stability.py) decides when and to which checkpoint; RecurrentTrainer calls these. Restoring in
place (weights copied into the live parameters one tensor at a time, optimizer state loaded on the CPU first) keeps
the peak memory of a rollback at one tensor above training's, so it fits wherever training fits, and leaves the
optimizer's in-backward hooks and any compiled layers as they are.
"""

from __future__ import annotations

import json
import os

import torch
from safetensors import safe_open
from transformers.trainer import OPTIMIZER_NAME
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME

from trainer_ext.checkpoints import last_complete_checkpoint


def _weight_files(checkpoint: str) -> list[str]:
    index = os.path.join(checkpoint, SAFE_WEIGHTS_INDEX_NAME)
    if os.path.isfile(index):
        with open(index) as f:
            return sorted({os.path.join(checkpoint, name) for name in json.load(f)["weight_map"].values()})
    return [os.path.join(checkpoint, SAFE_WEIGHTS_NAME)]


@torch.no_grad()
def restore_in_place(model: torch.nn.Module, optimizer: torch.optim.Optimizer, checkpoint: str) -> None:
    """Copy the weights and the optimizer state of `checkpoint` into `model` and `optimizer`.

    Every tensor of the model's state dict must come back (tied weights count once: they share storage); raises
    ValueError naming the checkpoint and the missing names otherwise, before the optimizer state is touched.
    """
    live = model.state_dict(keep_vars=True)  # layers compile in place: names as saved, no `_orig_mod.`
    restored = set()
    for path in _weight_files(checkpoint):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                live[name].copy_(f.get_tensor(name))
                restored.add(live[name].data_ptr())
    missing = sorted(name for name, tensor in live.items() if tensor.data_ptr() not in restored)
    if missing:
        raise ValueError(f"cannot roll back to {checkpoint}: its weights lack {', '.join(missing[:5])}"
                         f"{' ...' if len(missing) > 5 else ''}")
    state = torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True)
    optimizer.load_state_dict(state)


def unstable_training_message(guard, intervention, output_dir: str, interventions_file: str,
                              several_processes: bool = False) -> str:
    """Why training stopped after `max_consecutive_skips` skipped steps with nothing to roll back to, and the fix."""
    skips, step = guard.consecutive_skips, intervention.step
    last = last_complete_checkpoint(output_dir)
    checkpoint = f"the last checkpoint ({last}) is intact" if last else "no checkpoint had been saved yet"
    if several_processes:
        rolled = " (rollbacks run in a single process only)"
    elif guard.rollbacks:
        rolled = (f" after {len(guard.rollbacks)} rollback(s) at a lower learning rate (the limit, "
                  "--stability_max_rollbacks, is reached or no older checkpoint was left)")
    else:
        rolled = " with no checkpoint from before the trouble to roll back to"
    return (
        f"Training stopped by the stability guard at step {step}{rolled}: the last {skips} steps were all skipped "
        f"(this one: {intervention.describe()}). No update was applied after step {step - skips}, so the "
        f"weights and optimizer state are those of that step; {checkpoint}. The learning rate is most likely "
        "too high for this model and batch: lower --learning_rate (2-4x is a usual first try; resuming a "
        "checkpoint keeps its schedule, so start the schedule again) or run the learning-rate threshold test "
        "to find the largest rate that stays stable. With a non-finite loss, check the training data at these "
        f"steps as well. Interventions: {os.path.join(output_dir, interventions_file)}. Limits: "
        "--stability_loss_spike, --stability_max_consecutive_skips, --stability_max_rollbacks (--stability_guard "
        "false turns it off)."
    )
