"""The trainings of a comparison cycle: the typed arguments of one model's training, where it stops, its loss and
its compute.

Each model's cycles are one training cut into pieces. The Trainer of every cycle is given the whole schedule
(`max_steps`: the steps of every planned cycle, so one warm-up and one learning-rate schedule span the run) and
`CycleEnd` stops it at the cycle's last step with a checkpoint there; the next cycle resumes that checkpoint with
the Trainer's own `resume_from_checkpoint`: weights, optimizer state, scheduler position, RNG states and trainer
state (step, FLOPs, log history) carry over, so N cycles train as one uninterrupted run over the same tokens.
Cycle k's data is the Trainer's epoch k - 1 (each cycle's shards hold exactly one cycle's steps), as it is in such
a run. Per model and cycle the pipeline sets the start (cycle 1: the model's preset; later cycles: the previous
cycle's final weights and last checkpoint), the cycle's data, the model's own learning rate if given, and the
checkpoint an interrupted training resumes.
"""

from __future__ import annotations

import dataclasses
import logging
import os

from transformers import TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from trainer_ext.checkpoints import checkpoint_step, last_complete_checkpoint
from trainer_ext.comparison.arguments import RUN_WARMUP_STEPS, CompareArguments, TrainingOptions, model_option
from trainer_ext.training.arguments import DataArguments, ModelArguments, RecurrentTrainingArguments

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CycleTraining:
    """Where one model's training of one cycle starts, reads, stops and writes."""

    model: str  # "recurrent", "baseline" or "compute_baseline"
    output_dir: str
    data_dir: str
    first_step: int  # optimizer steps of the cycles before this one
    last_step: int  # the step this cycle ends at
    total_steps: int  # the steps the learning-rate schedule spans: every planned cycle's
    previous_final: str | None = None  # the previous cycle's final weights (None in cycle 1)
    previous_checkpoint: str | None = None  # the previous cycle's last checkpoint, with its optimizer state
    teacher_cache_dir: str | None = None
    config_overrides: str | None = None  # the model's --config_overrides (cycle 1 builds it from its preset)

    @property
    def end_checkpoint(self) -> str:
        """The checkpoint this cycle ends with, which the next cycle resumes."""
        return os.path.join(self.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.last_step}")

    def checkpoint(self) -> str | None:
        """Where the training resumes: the cycle's own last checkpoint (an interrupted start), else the previous
        cycle's last one (None: cycle 1 from the preset). A checkpoint of its own at the cycle's end (a training
        that finished but was not recorded) is passed over: the cycle trains again from its start, to the same
        result, rather than a step too far."""
        own = last_complete_checkpoint(self.output_dir)
        if own is not None and checkpoint_step(own) < self.last_step:
            return own
        return self.previous_checkpoint

    def arguments(self, args: CompareArguments, options: TrainingOptions
                  ) -> tuple[ModelArguments, DataArguments, RecurrentTrainingArguments]:
        """The typed arguments of `trainer_ext.run.pretrain.pretrain` for this training."""
        if self.previous_final is None:
            model_args = dataclasses.replace(options.model, preset=model_option(args, self.model, "preset"),
                                             config_overrides=self.config_overrides)
        else:  # the weights are the checkpoint's, which the resume loads again with the optimizer state
            model_args = dataclasses.replace(options.model, model_name_or_path=self.previous_final)
        data_args = dataclasses.replace(options.data, data_dir=self.data_dir, teacher_cache_dir=self.teacher_cache_dir,
                                        save_final=True)
        shared = options.training
        learning_rate = model_option(args, self.model, "learning_rate")
        # The cycle's folder is the pipeline's own: without a checkpoint to resume (cycle 1), started afresh whatever
        # an interrupted start left there.
        checkpoint = self.checkpoint()
        training_args = dataclasses.replace(
            shared, output_dir=self.output_dir, max_steps=self.total_steps,
            learning_rate=shared.learning_rate if learning_rate is None else learning_rate,
            warmup_steps=RUN_WARMUP_STEPS if shared.warmup_steps is None else shared.warmup_steps,
            resume_from_checkpoint=checkpoint, overwrite_output_dir=checkpoint is None, push_to_hub=False)
        return model_args, data_args, training_args


class CycleEnd(TrainerCallback):
    """Stops a training at the cycle's last step, logging and saving there: the next cycle resumes that checkpoint,
    and a log line at every cycle's end keeps each logged loss within one cycle."""

    def __init__(self, last_step: int):
        self.last_step = last_step

    def on_train_begin(self, args, state, control, **kwargs):
        assert state.global_step < self.last_step, (state.global_step, self.last_step)  # else a step too many

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step >= self.last_step:
            control.should_training_stop = control.should_save = control.should_log = True


def whole_run_train_loss(log_history: list[dict], resumed_step: int | None, trainer_loss: float | None,
                         first_step: int = 0):
    """The mean training loss of a whole cycle (the steps after `first_step`), also when its training resumed: from
    the previous cycle's checkpoint or, after a kill, from one of its own (`resumed_step`).

    After a resume the Trainer's `train_loss` does not cover the cycle: transformers 5.24 averages the steps run
    after the resume, 5.17 divides their sum by all steps. The log history (carried over by the resume) holds `loss`
    entries, each the mean since the previous one, and one at every cycle's end: weighted by the steps they cover,
    those after `first_step` give the cycle's mean. Steps after the last log entry were never logged and cannot
    count. A training that ran the whole cycle from step 0 keeps the Trainer's figure."""
    if not resumed_step or trainer_loss is None:
        return trainer_loss
    logged = sorted((entry["step"], entry["loss"]) for entry in log_history
                    if "loss" in entry and entry.get("step", 0) > first_step)
    if not logged:
        return trainer_loss
    weighted, previous = 0.0, first_step
    for step, loss in logged:
        weighted += loss * (step - previous)
        previous = step
    return weighted / (previous - first_step)


def training_compute(state, model: str, cycle: int, tokens_per_cycle: int) -> dict:
    """What `model`'s training cost up to the end of `cycle` (`state`: the run's `CompareState`): wall seconds in
    training and FLOPs at the depths its steps ran (`RecurrentTrainer.floating_point_ops`), the one training's own
    counts over cycles 1..cycle, and this cycle's tokens/s. None where the training recorded none."""
    stage = state.stage(cycle, f"train_{model}")
    seconds = stage.get("train_seconds")
    before = state.stage(cycle - 1, f"train_{model}").get("train_seconds") if cycle > 1 else 0.0
    cycle_seconds = seconds - before if seconds is not None and before is not None else None
    return {"train_seconds": seconds, "train_flops": stage.get("train_flops"),
            "train_tokens_per_second": round(tokens_per_cycle / cycle_seconds, 1) if cycle_seconds else None}
