"""RecurrentTrainer's side of the stability guard: stability.py decides, these methods carry it out.

A mixin of `RecurrentTrainer` (trainer.py), which sets `self.stability` (a `StabilityGuard`, or None when
`--stability_guard false`), `self._window` (the logging window's counters) and `unwrapped_optimizer`: the guard reads
each training loss before the step's first update (`_guarded_loss`), the optimizer's gradient norm a step later,
scales the learning rate, rolls the run back to a checkpoint or stops it, and writes the interventions.
"""

import logging
import math
import os

import torch

from trainer_ext.checkpoints import complete_checkpoints, read_trainer_state
from trainer_ext.devices import to_host_later
from trainer_ext.training.rollback import restore_in_place, unstable_training_message
from trainer_ext.training.stability import (
    STABILITY_STATE_KEY,
    StabilityGuard,
    UnstableTrainingError,
    write_interventions,
)

logger = logging.getLogger(__name__)

INTERVENTIONS_FILE = "stability_interventions.json"


class StabilityMixin:
    """The stability guard's actions inside `RecurrentTrainer` (see the module docstring)."""

    def _reset_stability_bookkeeping(self):
        self._skipping_step = None  # step whose update is being skipped
        self._grad_norm_step = None  # step whose gradient norm the guard has not seen yet
        self._scheduled_lrs = None  # the scheduler's learning rates while the guard's multiplier is applied
        self._pending_loss = None  # (step, its loss on its way to the host) until the guard decides in backward
        self._stop_after_backward = None  # an intervention that rolls back or stops once backward has ended

    def _start_stability_guard(self, state):
        """A fresh guard for each `train()`, or the checkpoint's when resuming."""
        self.stability = StabilityGuard(**self.args.stability_settings())
        saved = state.stateful_callbacks.get(STABILITY_STATE_KEY)
        if saved is not None:
            self.stability.load_state_dict(saved)
        self._reset_stability_bookkeeping()

    def _guarded_loss(self, model, loss):
        """What the Trainer backpropagates and sums for the log: `loss` where the guard lets the step update, else a
        stand-in (finite, as the loss where that is).

        The decision has to come before any update: the in-backward optimizer updates each weight as its gradient
        arrives. In one process it comes at the step's first update (`LowMemoryAdafactor.gate_backward`): the loss
        travels to the host behind the forward pass while backward's first operations are queued, so the GPU does
        not idle while the host waits for the loss and then launches backward; a skipped step drops its gradients
        as they arrive. Otherwise (stock optimizers, several processes, whose loss is averaged first) the loss is
        read here, and a skipped step gets a stand-in whose backward reaches no parameter, so no weight and no
        optimizer state changes (a zero gradient would not do: the second-moment and momentum decay would still
        run); the Trainer's `optimizer.step()` then only does bookkeeping (in backward) or passes over parameters
        without a gradient (stock optimizers). The scheduler steps as usual: the schedule stays a function of the
        step.
        """
        step = self.state.global_step + 1  # numbered as in the logs
        if self._skipping_step == step:  # an earlier micro-batch of this step was already bad
            return self._stand_in(loss)
        optimizer = self.unwrapped_optimizer
        if self.accelerator.num_processes == 1 and getattr(optimizer, "in_backward", False) \
                and hasattr(optimizer, "gate_backward"):
            self._pending_loss = (step, to_host_later(loss.detach()))
            optimizer.gate_backward(self._decide_pending)
            return self._stand_in(loss, keep_graph=True)
        if self._decide(step, self._loss_value(loss)):
            return loss
        if self.args.gradient_accumulation_steps > 1:
            model.zero_grad(set_to_none=True)  # the whole step is skipped, its earlier micro-batches too
        return self._stand_in(loss)

    def _decide(self, step: int, value: float) -> bool:
        """The guard's decision on step `step`'s loss `value`: True to update (at the rate it sets), False to skip.
        A stop or rollback runs now, or, inside backward, once it has ended (`_settle_stability`)."""
        self._observe_grad_norm()  # the previous step's, complete by now: the loss waited for more
        intervention = self.stability.check_loss(step, value)
        if math.isfinite(value):
            self._window["finite_sum"] += value
            self._window["finite"] += 1
        else:
            self._window["nonfinite"] += 1
        if intervention is None:
            self._scale_lr(self.stability.lr_scale(step))
            self._grad_norm_step = step
            return True
        logger.warning("stability guard: %s", intervention.describe())
        if self.stability.should_stop:
            if torch._C._current_graph_task_id() == -1:
                self._roll_back_or_stop(intervention)
            else:  # weights restored now would change what the rest of backward reads
                self._stop_after_backward = intervention
        self._skipping_step = step
        if self._grad_norm_step == step:
            self._grad_norm_step = None
        return False

    def _decide_pending(self) -> bool:
        step, value = self._pending_loss
        self._pending_loss = None
        return self._decide(step, value().item())

    def _settle_stability(self):
        """After backward, before the optimizer's step: a decision no update asked for (a backward that reached no
        parameter), and the stop or rollback decided inside backward."""
        if self._pending_loss is not None:
            self._decide_pending()
        if self._stop_after_backward is not None:
            intervention, self._stop_after_backward = self._stop_after_backward, None
            self._roll_back_or_stop(intervention)

    def _stand_in(self, loss, keep_graph: bool = False):
        """The loss value for the Trainer's running sum: detached from the graph (backward of it is a no-op), or,
        with `keep_graph`, the loss itself where it is finite.

        A non-finite loss is replaced by the running mean: the Trainer's sum would stay NaN for the rest of the run
        (or, with its NaN filter, count the step as a 0.0 loss at the start of a logging window). `log` then
        reports the window's finite losses, or NaN. `torch.where` keeps this free of a device sync.
        """
        mean = self.stability.loss_mean or 0.0
        if keep_graph:
            return torch.where(torch.isfinite(loss.detach()), loss, mean)
        finite = torch.where(torch.isfinite(loss), loss.detach(), mean)
        return finite.requires_grad_()

    def _loss_value(self, loss) -> float:
        """The loss on the host before backward, where the guard does not decide inside it: a device sync per step
        (on several processes, their mean, so that every process takes the same decision). Either way the guard's
        read replaces the two waits of the Trainer's NaN filter after backward, which is off inside guarded steps
        (`TrainingHooksCallback`): the guard's stand-ins keep the logged loss finite."""
        if self.accelerator.num_processes > 1:
            loss = self.accelerator.reduce(loss.detach(), reduction="mean")
        return loss.detach().item()

    def _observe_grad_norm(self):
        """Give the guard the gradient norm of the last step that was not skipped, once that step has run.

        LowMemoryAdafactor collects it on the device and hands it over a step late on GPU; read after this step's
        loss, it is ready and the read does not wait. Stock optimizers report no norm (the Trainer computes one
        only for clipping, inside its loop): there the guard acts on losses only.
        """
        step = self._grad_norm_step
        if step is None or step > self.state.global_step:
            return
        self._grad_norm_step = None
        optimizer = self.unwrapped_optimizer
        if not hasattr(optimizer, "last_grad_norm"):
            return
        intervention = self.stability.check_grad_norm(step, optimizer.last_grad_norm)
        if intervention is not None:
            logger.warning("stability guard: %s", intervention.describe())

    def _scale_lr(self, scale: float):
        """Multiply the scheduled learning rates for this step's update; `_restore_scheduled_lr` undoes it."""
        if scale == 1.0 and self._scheduled_lrs is None:
            return
        groups = self.optimizer.param_groups
        if self._scheduled_lrs is None:
            self._scheduled_lrs = [group["lr"] for group in groups]
        for group, lr in zip(groups, self._scheduled_lrs, strict=True):
            group["lr"] = lr * scale

    def _restore_scheduled_lr(self):
        # Put back the exact values: schedulers that build on the current rate stay on their schedule, and a
        # checkpoint holds the schedule's rates, so a resumed run applies the guard's multiplier the same way.
        if self._scheduled_lrs is None:
            return
        for group, lr in zip(self.optimizer.param_groups, self._scheduled_lrs, strict=True):
            group["lr"] = lr
        self._scheduled_lrs = None

    def _write_interventions(self):
        if self.args.should_save:
            write_interventions(os.path.join(self.args.output_dir, INTERVENTIONS_FILE), self.stability)

    def _roll_back_or_stop(self, intervention):
        """Restore the checkpoint the guard picks, in place (one process only), or stop training if it picks none."""
        single = self.accelerator.num_processes == 1  # sharded weights and state are not restored in place
        checkpoints = complete_checkpoints(self.args.output_dir) if single else {}
        target = self.stability.rollback_target(intervention.step, checkpoints)
        if target is None:
            self._write_interventions()
            raise UnstableTrainingError(unstable_training_message(self.stability, intervention, self.args.output_dir,
                                                                  INTERVENTIONS_FILE, several_processes=not single))
        restore_in_place(self.model, self.unwrapped_optimizer, checkpoints[target])
        saved = read_trainer_state(checkpoints[target]).get("stateful_callbacks", {}).get(STABILITY_STATE_KEY)
        rollback = self.stability.roll_back(intervention.step, target, checkpoints[target], saved)
        logger.warning("stability guard: %s", rollback.describe())
        self._grad_norm_step = None
        self._write_interventions()

    def _add_stability_logs(self, logs: dict):
        logs["stability/skipped_steps"] = self.stability.skipped_steps
        logs["stability/interventions"] = len(self.stability.interventions)
        logs["stability/lr_scale"] = self.stability.lr_scale(self.state.global_step)
