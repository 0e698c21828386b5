"""The callbacks `RecurrentTrainer` adds to the Trainer's loop: phase timing of the optimizer step, the stability
guard's points outside `compute_loss` (and the Trainer's NaN filter off inside guarded steps), the start of the
collapse / skipped-update bookkeeping, the timing of a compiled run's first steps, a checkpoint where the warm-up
ends, Python's garbage collection between steps, and a checkpoint before stopping on SIGINT / SIGTERM."""

import contextlib
import gc
import logging
import os
import signal
import sys
import threading

from transformers import TrainerCallback

from trainer_ext.files import cpu_group
from trainer_ext.training.stability import STABILITY_STATE_KEY
from trainer_ext.training.telemetry import PhaseProfiler

logger = logging.getLogger(__name__)


class PhaseTimingCallback(TrainerCallback):
    """Times the optimizer step the Trainer runs between backward and the next batch."""

    def __init__(self, profiler: PhaseProfiler):
        self.profiler = profiler
        self._phase = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._phase = self.profiler.phase("optimizer")
        self._phase.__enter__()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._phase is not None:
            self._phase.__exit__(None, None, None)
            self._phase = None

    def on_step_end(self, args, state, control, **kwargs):
        self.profiler.mark_step_end()


def warmup_warning(args, max_steps: int) -> str | None:
    """What to say where the warm-up takes the whole schedule of a decaying learning rate (never at its peak, never
    decayed: a short run with the default 30 steps), else None. A constant rate warmed up to its end (the learning
    rate search's start) is meant."""
    warmup = args.get_warmup_steps(max_steps)
    if max_steps <= 0 or warmup < max_steps or args.lr_scheduler_type.value.startswith("constant"):
        return None
    return (f"--warmup_steps {args.warmup_steps:g} covers all {max_steps} steps of this {args.lr_scheduler_type.value} "
            f"schedule: the learning rate never reaches --learning_rate {args.learning_rate:g} and never decays. Lower "
            "--warmup_steps (a number below 1 is a share of the run, e.g. 0.1) or train more steps.")


class TrainingHooksCallback(TrainerCallback):
    """`RecurrentTrainer`'s points in the Trainer's loop outside `compute_loss`: the stability guard's (with
    `args.stability_guard`) and the start of the collapse / skipped-update bookkeeping of each `train()`, once a
    resumed optimizer is loaded."""

    def __init__(self, trainer):  # a RecurrentTrainer, which builds this callback
        self.trainer = trainer
        self._nan_filter = None  # the user's logging_nan_inf_filter while a guarded step has it off

    def restore_nan_filter(self, args) -> None:
        if self._nan_filter is not None:
            args.logging_nan_inf_filter, self._nan_filter = self._nan_filter, None

    def on_train_begin(self, args, state, control, **kwargs):
        warning = warmup_warning(args, state.max_steps)
        if warning and state.is_world_process_zero:
            logger.warning(warning)
        self.trainer._bind_optimizer()  # the model is wrapped (DDP, FSDP2) by now, not yet run
        self.trainer._start_training_clock()  # after a resumed checkpoint's log history is loaded
        if args.stability_guard:
            self.trainer._start_stability_guard(state)
        self.trainer._reset_health_bookkeeping()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if args.stability_guard:
            # Before the scheduler steps: it must never see (and build on) the guard's lowered rate.
            self.trainer._restore_scheduled_lr()

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        if args.stability_guard:
            self.trainer._settle_stability()

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer._count_warmup_step(starting=True)
        if args.stability_guard and self._nan_filter is None:
            # The guard has read each training loss and hands the Trainer a finite stand-in for a non-finite one, so
            # the Trainer's NaN filter would only wait for the GPU twice per step (`isnan(loss) or isinf(loss)`, after
            # backward: the next step's host work would wait too). Off inside steps; evaluation keeps the setting.
            self._nan_filter, args.logging_nan_inf_filter = args.logging_nan_inf_filter, False

    def on_step_end(self, args, state, control, **kwargs):
        self.restore_nan_filter(args)
        self.trainer._count_warmup_step()
        if not args.stability_guard:
            return
        if control.should_save:
            # The step's gradient norm is otherwise read at the next step, which a run resumed from this
            # checkpoint would never see; waiting for it costs nothing next to writing a checkpoint.
            self.trainer._observe_grad_norm()
        state.stateful_callbacks[STABILITY_STATE_KEY] = self.trainer.stability.state_dict()

    def on_train_end(self, args, state, control, **kwargs):
        if args.stability_guard:
            self.trainer._write_interventions()


class GarbageCollectionCallback(TrainerCallback):
    """Python's cyclic garbage collector between steps instead of inside them.

    Left automatic, the collector runs whenever its allocation counters say, inside a step, and a full collection
    scans every object of the process (a compiled model's are hundreds of thousands: 0.2 s on a CPU for the debug
    preset), a pause the GPU waits through. While `during_training()` holds, automatic collection is off, the objects
    that exist when training starts are frozen (never scanned again, as they outlive the run), and a full collection
    of the rest runs after every `interval`-th step. What outlives the first of these (the compiled graphs of the
    first steps, hundreds of thousands of objects) is frozen too, so that the later ones scan only what the steps
    since have left. On leaving (also on an exception) the collector is as before.
    """

    def __init__(self, interval: int):
        self.interval = interval
        self._first_done = False

    @contextlib.contextmanager
    def during_training(self):
        enabled = gc.isenabled()
        self._first_done = False
        gc.collect()
        gc.freeze()
        gc.disable()
        try:
            yield
        finally:
            gc.unfreeze()
            if enabled:
                gc.enable()

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step % self.interval == 0:
            gc.collect()
            if not self._first_done:
                gc.freeze()
                self._first_done = True


class WarmupEndCheckpointCallback(TrainerCallback):
    """Saves a checkpoint at the step the learning-rate warm-up ends (`--stability_checkpoint_after_warmup`), where
    checkpoints are saved at all. A run can break in its first steps at the full rate (recurrent-7b at 2e-4
    broke 5 steps after its 100-step warm-up, BENCHMARKS.md), before the first regular save: this is the checkpoint
    the stability guard can roll back to then. A resumed run past that step saves nothing extra."""

    def __init__(self):
        self.step = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.step = args.get_warmup_steps(state.max_steps) if args.save_strategy != "no" else 0

    def on_step_end(self, args, state, control, **kwargs):
        if self.step and state.global_step == self.step:
            control.should_save = True


class TrainingInterrupted(SystemExit):
    """Training stopped by a signal after saving a checkpoint. A SystemExit, so that an uncaught one ends the process
    with the shell's status for that signal (128 + its number: 130 for SIGINT, 143 for SIGTERM) and no traceback;
    the message is logged where it is raised. `signal` is the signal's number, `checkpoint` the folder saved."""

    def __init__(self, signum: int, message: str, checkpoint: str | None):
        super().__init__(128 + signum)
        self.signal, self.message, self.checkpoint = signum, message, checkpoint

    def __str__(self) -> str:
        return self.message


class StopOnSignalCallback(TrainerCallback):
    """SIGINT (Ctrl-C) and SIGTERM (a shutdown: Windows rebooting the WSL2 machine for an update, a job scheduler)
    during training: the step under way finishes, a checkpoint of it is saved (atomically, as every checkpoint) and
    training stops; `RecurrentTrainer.train` then raises TrainingInterrupted. Without this the steps since the last
    save were lost. A second signal ends the process at once, without saving (a save in progress stays under its
    staging name, which is never resumed from).

    `handling()` installs the handlers for the duration of train() (the main thread only: Python delivers signals
    there) and restores the previous ones after. Under a launch of several processes (the launcher passes the signal
    on to each) they agree after every step whether one of them has received it, in a small all-reduce on the host,
    and all stop after the same step: one saving alone would wait in the save's collectives for the others."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.received = None  # the first signal's number (on any process of a launch)
        self.stopped_at = None  # the step that was saved and after which training stopped
        self._group = None  # the launch's processes, to agree on the step to stop after

    @contextlib.contextmanager
    def handling(self):
        self.received = self.stopped_at = None
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {signum: signal.signal(signum, self._on_signal) for signum in self.SIGNALS}
        try:
            yield
        finally:
            for signum, handler in previous.items():
                signal.signal(signum, handler)

    def _on_signal(self, signum, frame):
        name = signal.Signals(signum).name
        if self.received is not None:
            logger.error("%s again: exiting at once, without saving; the last complete checkpoint is kept.", name)
            for stream in (sys.stdout, sys.stderr):
                stream.flush()
            os._exit(128 + signum)
        self.received = signum
        logger.warning("%s: training stops after the step under way, once its checkpoint is saved (%s again stops at "
                       "once, without saving).", name, name)

    def on_train_begin(self, args, state, control, **kwargs):
        self._group = cpu_group()

    def on_step_end(self, args, state, control, **kwargs):
        if self.stopped_at is not None:
            return
        if self._group is not None:
            import torch
            import torch.distributed as dist

            received = torch.tensor([self.received or 0], dtype=torch.int32)
            dist.all_reduce(received, op=dist.ReduceOp.MAX, group=self._group)
            self.received = self.received or int(received.item()) or None
        if self.received is not None:
            control.should_save = True
            control.should_training_stop = True
            self.stopped_at = state.global_step
