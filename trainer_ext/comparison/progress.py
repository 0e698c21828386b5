"""What a comparison run shows while it works: one progress bar for the whole run.

The bar has one unit per stage and advances per optimizer step inside trainings, so the time left follows the real
work; its postfix says where the run is (cycle, model, stage or step, tokens). The progress bars of the work
inside a stage (tokenizing, loading and saving weights, the Trainer's) are switched off meanwhile. In a log file
the bar is a progress line every 30 s instead (`trainer_ext.progress`): a bar there wrote 130 carriage-return
updates a minute.
"""

from __future__ import annotations

import logging

from transformers import TrainerCallback

from trainer_ext.hub.model_card import format_count
from trainer_ext.progress import Progress, library_bars_off

logger = logging.getLogger(__name__)


class RunProgress:
    """One bar for the whole run, `done` of its `total` stages finished by earlier starts; `shown` False hides it
    (the processes of a launch other than the first, which would draw the same bar again)."""

    def __init__(self, total: int, done: int, shown: bool = True):
        self.bar = Progress(total=total, initial=min(done, total), desc="compare", unit="stage", dynamic_ncols=True,
                            disable=not shown,
                            bar_format="{l_bar}{bar}| {percentage:3.0f}% [{elapsed}<{remaining}{postfix}]")
        self.stage_start = self.bar.n

    def begin(self, cycle: int | str, model: str, stage: str) -> None:
        self.stage_start = float(round(self.bar.n))
        self.show(f"cycle={cycle}, model={model}, stage={stage}")

    def show(self, where: str) -> None:
        self.bar.set_postfix_str(where)

    def training_step(self, cycle: int, model: str, step: int, max_steps: int, tokens: int) -> None:
        self._advance_to(self.stage_start + min(step / max(max_steps, 1), 0.999))
        self.show(f"cycle={cycle}, model={model}, step={step}/{max_steps}, tokens={format_count(tokens)}")

    def end(self) -> None:
        self._advance_to(self.stage_start + 1)

    def _advance_to(self, value: float) -> None:
        if value > self.bar.n:
            self.bar.update(value - self.bar.n)

    def close(self) -> None:
        self.bar.close()


class StepProgress(TrainerCallback):
    """Moves the run's bar after every optimizer step of one training (one model, one cycle: the steps after
    `first_step` of the model's one training); logs the schedule the training continues, defaults resolved from the
    model's size included."""

    def __init__(self, progress: RunProgress, cycle: int, model: str, first_step: int, steps: int,
                 tokens_per_step: int):
        self.progress, self.cycle, self.model = progress, cycle, model
        self.first_step, self.steps, self.tokens_per_step = first_step, steps, tokens_per_step

    def on_train_begin(self, args, state, control, **kwargs):
        logger.info("Cycle %d, %s: steps %d-%d of a %s schedule over %d steps at learning rate %g (%g warm-up steps "
                    "at its start).", self.cycle, self.model, self.first_step + 1, self.first_step + self.steps,
                    args.lr_scheduler_type.value, state.max_steps, args.learning_rate, args.warmup_steps)

    def on_step_end(self, args, state, control, **kwargs):
        self.progress.training_step(self.cycle, self.model, state.global_step - self.first_step, self.steps,
                                    state.global_step * self.tokens_per_step)


def inner_bars_off():
    """Silence the progress bars of the work inside a stage, so the run's bar is the only one."""
    return library_bars_off()
