"""The trainings of a comparison cycle: the typed arguments of one model's training, and its whole-cycle loss.

Both models train with the same options (`TrainingOptions`); per model and cycle the pipeline sets the start
(cycle 1: the model's preset; later cycles: the previous cycle's final weights), the cycle's data and step
count, the model's own learning rate if given, and whether an interrupted training resumes.
"""

from __future__ import annotations

import dataclasses
import logging

from trainer_ext.checkpoints import last_complete_checkpoint
from trainer_ext.comparison.arguments import CYCLE_WARMUP_STEPS, CompareArguments, TrainingOptions
from trainer_ext.training.arguments import DataArguments, ModelArguments, RecurrentTrainingArguments

logger = logging.getLogger(__name__)


@dataclasses.dataclass
class CycleTraining:
    """Where one model's training of one cycle starts, reads and writes."""

    model: str  # "recurrent" or "baseline"
    output_dir: str
    data_dir: str
    max_steps: int
    previous_final: str | None = None  # the previous cycle's final weights (None in cycle 1)
    teacher_cache_dir: str | None = None

    def arguments(self, args: CompareArguments, options: TrainingOptions
                  ) -> tuple[ModelArguments, DataArguments, RecurrentTrainingArguments]:
        """The typed arguments of `trainer_ext.run.pretrain.pretrain` for this training."""
        if self.previous_final is None:
            model_args = dataclasses.replace(options.model, preset=getattr(args, f"{self.model}_preset"),
                                             config_overrides=getattr(args, f"{self.model}_config_overrides"))
        else:
            model_args = dataclasses.replace(options.model, model_name_or_path=self.previous_final)
        data_args = dataclasses.replace(options.data, data_dir=self.data_dir, teacher_cache_dir=self.teacher_cache_dir,
                                        save_final=True)
        shared = options.training
        learning_rate = getattr(args, f"{self.model}_learning_rate")
        # The cycle's folder is the pipeline's own: resumed from its last checkpoint, else started afresh whatever
        # an interrupted start left there.
        checkpoint = last_complete_checkpoint(self.output_dir)
        training_args = dataclasses.replace(
            shared, output_dir=self.output_dir, max_steps=self.max_steps,
            learning_rate=shared.learning_rate if learning_rate is None else learning_rate,
            warmup_steps=CYCLE_WARMUP_STEPS if shared.warmup_steps is None else shared.warmup_steps,
            resume_from_checkpoint=checkpoint, overwrite_output_dir=checkpoint is None, push_to_hub=False)
        return model_args, data_args, training_args


def whole_run_train_loss(log_history: list[dict], resumed_step: int | None, trainer_loss: float | None):
    """The mean training loss of a whole cycle, also when it was resumed after a kill.

    After a resume the Trainer's `train_loss` does not cover the cycle: transformers 5.24 averages the steps run
    after the resume, 5.17 divides their sum by all steps. The log history (carried over by the resume) holds `loss`
    entries, each the mean since the previous one: weighted by the steps they cover, they give the whole cycle's
    mean. Steps after the last log entry were never logged and cannot count. Without a resume the Trainer's
    figure is right and is kept."""
    if not resumed_step or trainer_loss is None:
        return trainer_loss
    logged = sorted((entry["step"], entry["loss"]) for entry in log_history if "loss" in entry and "step" in entry)
    if not logged:
        return trainer_loss
    weighted, previous = 0.0, 0
    for step, loss in logged:
        weighted += loss * (step - previous)
        previous = step
    return weighted / previous
