"""Stability guard: running statistics of the training loss and gradient norm, and what to do when one jumps.

Pure Python over floats, with no torch or Trainer in it, so that every decision can be tested directly.
`RecurrentTrainer` feeds it one loss per micro-batch (before backward) and one gradient norm per optimizer step
(a step late on GPU) and carries out its answers:

* loss spike: the loss is more than max(`loss_spike` nats, `loss_spike_sigmas` running standard deviations) above
  its running mean, once `warmup_steps` losses were seen, or it is not finite (at any time). The step's update is
  skipped: weights and optimizer state untouched. The deviation term keeps small batches from being skipped for
  ordinary noise: at batch 1 x 2048 the loss of recurrent-3.3b varies by 0.6 nats from step to step, and a fixed
  1-nat limit skipped 8% of a 300-step run's steps, mostly those that drew a large depth. Replayed on that run's
  logged losses, 2.5 deviations skip 6 (2%), among them the four warm-up losses above ln(vocabulary size); 4 skip
  none of them.
* gradient-norm blow-up: the norm is more than `grad_norm_factor` times its running typical value, once
  `warmup_steps` norms were seen, or it is not finite. The learning rate is multiplied by `lr_factor` for the
  next `cooldown_steps` steps and then brought back to the full rate linearly over as many steps: a sudden
  return can set off again what the lower rate had just calmed. A blow-up during a cool-down starts it again
  from `lr_factor` (the factor does not compound, so the rate never drifts towards zero).
* persistent trouble: `max_consecutive_skips` skipped steps in a row. Skipped steps change nothing, so the live
  weights are those of the last step that was applied, and the model may have drifted into the trouble before it
  (a slow divergence the running statistics followed). So the guard rolls back: `rollback_target` picks the newest
  checkpoint older than the last applied update, outside every stretch an earlier rollback abandoned; the trainer
  restores its weights and optimizer state in place, and `roll_back` records it, takes back the checkpoint's
  running statistics and multiplies the learning rate by `lr_factor` from then on (once more per rollback). The
  data goes on (the batches of the trouble are not replayed). With no such checkpoint, or `max_rollbacks` used up,
  `should_stop` holds and the trainer stops with the fix named.

Running statistics are exponential moving averages, bias-corrected as Adam's moments are, so that the first
steps are not pulled towards zero: of the loss, and of log(gradient norm) (a ratio test on a quantity that spans
orders of magnitude over a run). A skipped loss never enters the mean: the guard would otherwise learn to accept
the divergence it is there to catch. A blown-up norm enters clipped to the threshold, so a lasting change of
level (norms do drift over a run) is followed within some tens of steps instead of holding the rate down forever.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from trainer_ext.files import write_json

__all__ = ["EMA_DECAY", "GRAD_NORM_BLOWUP", "Intervention", "LOSS_SPIKE", "ROLLBACK", "STABILITY_STATE_KEY",
           "StabilityGuard", "UnstableTrainingError", "check_settings", "write_interventions"]

# The guard's running statistics live in the trainer state (trainer_state.json of each checkpoint) under this key,
# so that a resumed run takes the decisions an uninterrupted one would have taken.
STABILITY_STATE_KEY = "StabilityGuard"

# Weight of the past in the running statistics: a memory of about 1 / (1 - 0.95) = 20 observations, long enough
# to average out batch-to-batch noise, short enough to follow a loss that falls quickly early in training.
EMA_DECAY = 0.95

LOSS_SPIKE, GRAD_NORM_BLOWUP, ROLLBACK = "loss_spike", "grad_norm_blowup", "rollback"


class UnstableTrainingError(RuntimeError):
    """Training was stopped: the guard skipped too many steps in a row, or the model collapsed to uniform
    predictions (RecurrentTrainer's collapse check)."""


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_settings(*, warmup_steps, loss_spike, loss_spike_sigmas, grad_norm_factor, lr_factor, cooldown_steps,
                   max_consecutive_skips, max_rollbacks, name_prefix: str = "") -> None:
    """Raise ValueError naming the first setting out of its range (`name_prefix` + name, e.g. a CLI flag)."""
    rules = (
        ("warmup_steps", warmup_steps, _is_int(warmup_steps) and warmup_steps >= 1, "an integer >= 1"),
        ("loss_spike", loss_spike, _is_number(loss_spike) and loss_spike > 0, "a number > 0 (nats)"),
        ("loss_spike_sigmas", loss_spike_sigmas, _is_number(loss_spike_sigmas) and loss_spike_sigmas >= 0,
         "a number >= 0 (0: the fixed limit alone)"),
        ("grad_norm_factor", grad_norm_factor, _is_number(grad_norm_factor) and grad_norm_factor > 1,
         "a number > 1"),
        ("lr_factor", lr_factor, _is_number(lr_factor) and 0 < lr_factor < 1, "a number in (0, 1)"),
        ("cooldown_steps", cooldown_steps, _is_int(cooldown_steps) and cooldown_steps >= 1, "an integer >= 1"),
        ("max_consecutive_skips", max_consecutive_skips,
         _is_int(max_consecutive_skips) and max_consecutive_skips >= 1, "an integer >= 1"),
        ("max_rollbacks", max_rollbacks, _is_int(max_rollbacks) and max_rollbacks >= 0,
         "an integer >= 0 (0: stop instead of rolling back)"),
    )
    for name, value, ok, allowed in rules:
        if not ok:
            raise ValueError(f"{name_prefix}{name}={value!r} is not allowed; it must be {allowed}.")


@dataclass(frozen=True)
class Intervention:
    """One thing the guard did. `step` counts optimizer steps from 1, as the Trainer's logs do."""

    step: int
    kind: str  # LOSS_SPIKE (a non-finite loss included), GRAD_NORM_BLOWUP or ROLLBACK
    value: float  # the loss or the gradient norm; nan/inf as seen, never replaced (ROLLBACK: the steps skipped)
    running: float | None  # the running mean loss or typical norm it was compared with (None: not warmed up)
    limit: float  # nats above the mean, or the factor over the typical norm (ROLLBACK: the checkpoint's step)
    action: str

    def describe(self) -> str:
        if self.kind == ROLLBACK:
            return f"step {self.step}: {self.value:.0f} steps in a row were skipped; {self.action}"
        if self.kind == LOSS_SPIKE:
            if math.isfinite(self.value):
                seen = (f"loss {self.value:.4f} is {self.value - self.running:.2f} nats above its running mean "
                        f"{self.running:.4f} (limit +{self.limit:g} nats)")
            else:
                seen = f"loss {self.value} is not finite"
                if self.running is not None:
                    seen += f" (running mean {self.running:.4f})"
        elif not math.isfinite(self.value):
            seen = f"gradient norm {self.value} is not finite"
        else:
            seen = (f"gradient norm {self.value:.4g} is {self.value / self.running:.1f}x its running typical value "
                    f"{self.running:.4g} (limit {self.limit:g}x)")
        return f"step {self.step}: {seen}; {self.action}"


class _Average:
    """Bias-corrected exponential moving average of a stream of floats."""

    def __init__(self, decay: float):
        self.decay = decay
        self.biased = 0.0
        self.count = 0

    def update(self, value: float) -> None:
        self.biased = self.decay * self.biased + (1.0 - self.decay) * value
        self.count += 1

    @property
    def value(self) -> float | None:
        if not self.count:
            return None
        return self.biased / (1.0 - self.decay**self.count)


class StabilityGuard:
    """Decides, from running statistics, when to skip an update and when to lower the learning rate.

    Call `check_loss` with each training loss before its backward and `check_grad_norm` with each step's
    gradient norm; read `lr_scale(step)` for the multiplier of the scheduled learning rate at `step`.
    """

    def __init__(self, warmup_steps: int = 20, loss_spike: float = 1.0, loss_spike_sigmas: float = 2.5,
                 grad_norm_factor: float = 10.0, lr_factor: float = 0.5, cooldown_steps: int = 100,
                 max_consecutive_skips: int = 20, max_rollbacks: int = 2, ema_decay: float = EMA_DECAY):
        check_settings(warmup_steps=warmup_steps, loss_spike=loss_spike, loss_spike_sigmas=loss_spike_sigmas,
                       grad_norm_factor=grad_norm_factor, lr_factor=lr_factor, cooldown_steps=cooldown_steps,
                       max_consecutive_skips=max_consecutive_skips, max_rollbacks=max_rollbacks)
        if not _is_number(ema_decay) or not 0 < ema_decay < 1:
            raise ValueError(f"ema_decay={ema_decay!r} is not allowed; it must be a number in (0, 1).")
        self.warmup_steps = warmup_steps
        self.loss_spike = loss_spike
        self.loss_spike_sigmas = loss_spike_sigmas
        self.grad_norm_factor = grad_norm_factor
        self.lr_factor = lr_factor
        self.cooldown_steps = cooldown_steps
        self.max_consecutive_skips = max_consecutive_skips
        self.max_rollbacks = max_rollbacks
        self._loss = _Average(ema_decay)
        self._loss_variance = _Average(ema_decay)  # of (loss - running mean) ** 2
        self._log_grad_norm = _Average(ema_decay)
        self.blowup_step: int | None = None  # step of the last gradient-norm blow-up
        self.skipped_steps = 0
        self.consecutive_skips = 0  # length of the latest run of skipped steps
        self._last_skipped_step: int | None = None
        self.rollbacks: list[list[int]] = []  # [checkpoint step, step of the rollback] of each rollback
        self.interventions: list[Intervention] = []

    # -- running values

    @property
    def loss_mean(self) -> float | None:
        return self._loss.value

    @property
    def loss_limit(self) -> float:
        """How many nats above the running mean a loss may be before its update is skipped."""
        variance = self._loss_variance.value
        noise = 0.0 if variance is None else self.loss_spike_sigmas * math.sqrt(variance)
        return max(self.loss_spike, noise)

    @property
    def typical_grad_norm(self) -> float | None:
        log_norm = self._log_grad_norm.value
        return None if log_norm is None else math.exp(log_norm)

    @property
    def should_stop(self) -> bool:
        return self.consecutive_skips >= self.max_consecutive_skips

    # -- decisions

    def check_loss(self, step: int, loss: float) -> Intervention | None:
        """Skip (an Intervention) or go ahead (None, and `loss` enters the running mean).

        May be called several times per step (micro-batches of gradient accumulation); a step counts as
        skipped once however many of its micro-batches were bad.
        """
        mean, limit = self._loss.value, self.loss_limit
        warmed_up = self._loss.count >= self.warmup_steps
        if math.isfinite(loss) and not (warmed_up and loss - mean > limit):
            if mean is not None:
                self._loss_variance.update((loss - mean) ** 2)
            self._loss.update(loss)
            return None
        if step != self._last_skipped_step:
            consecutive = self._last_skipped_step is not None and self._last_skipped_step == step - 1
            self.consecutive_skips = self.consecutive_skips + 1 if consecutive else 1
            self.skipped_steps += 1
            self._last_skipped_step = step
        return self._record(Intervention(step=step, kind=LOSS_SPIKE, value=float(loss), running=mean,
                                         limit=limit, action="update skipped"))

    def check_grad_norm(self, step: int, grad_norm: float) -> Intervention | None:
        """Lower the learning rate after `step` (an Intervention) or not (None)."""
        log_typical = self._log_grad_norm.value
        if not math.isfinite(grad_norm):
            return self._blowup(step, grad_norm, log_typical)
        if grad_norm <= 0.0:
            return None  # no gradient at all (nothing to compare); log() of it is not defined
        log_norm, log_limit = math.log(grad_norm), math.log(self.grad_norm_factor)
        blown_up = self._log_grad_norm.count >= self.warmup_steps and log_norm - log_typical > log_limit
        self._log_grad_norm.update(min(log_norm, log_typical + log_limit) if blown_up else log_norm)
        return self._blowup(step, grad_norm, log_typical) if blown_up else None

    def _blowup(self, step: int, grad_norm: float, log_typical: float | None) -> Intervention:
        self.blowup_step = step
        action = (f"learning rate x{self.lr_factor:g} for {self.cooldown_steps} steps, then back to x1 "
                  f"over {self.cooldown_steps} steps")
        typical = None if log_typical is None else math.exp(log_typical)
        return self._record(Intervention(step=step, kind=GRAD_NORM_BLOWUP, value=float(grad_norm),
                                         running=typical, limit=self.grad_norm_factor, action=action))

    def _record(self, intervention: Intervention) -> Intervention:
        self.interventions.append(intervention)
        return intervention

    def lr_scale(self, step: int) -> float:
        """Multiplier of the scheduled learning rate for the update of `step`."""
        rolled_back = self.lr_factor ** sum(1 for _, at in self.rollbacks if at < step)
        if self.blowup_step is None or step <= self.blowup_step:
            return rolled_back
        since = step - self.blowup_step  # 1 for the first step after the blow-up
        if since <= self.cooldown_steps:
            return rolled_back * self.lr_factor
        ramp = min((since - self.cooldown_steps) / self.cooldown_steps, 1.0)
        return rolled_back * (self.lr_factor + (1.0 - self.lr_factor) * ramp)

    # -- rollbacks

    def rollback_target(self, step: int, checkpoint_steps) -> int | None:
        """The step of the checkpoint to roll back to at `step` (which hit `max_consecutive_skips`), or None.

        A checkpoint saved at or after the last applied update holds the live weights; one inside a stretch an
        earlier rollback abandoned ((its checkpoint, its step]) holds weights of that abandoned run. If nothing was
        applied since the last rollback, its own checkpoint holds the live weights too, so the search goes further
        back.
        """
        if len(self.rollbacks) >= self.max_rollbacks:
            return None
        last_applied = step - self.consecutive_skips  # the live weights are this step's
        if self.rollbacks and last_applied == self.rollbacks[-1][1]:
            last_applied = self.rollbacks[-1][0]
        usable = [n for n in checkpoint_steps
                  if n < last_applied and not any(lo < n <= hi for lo, hi in self.rollbacks)]
        return max(usable, default=None)

    def roll_back(self, step: int, checkpoint_step: int, checkpoint: str, saved_state: dict | None) -> Intervention:
        """Record that the weights and optimizer state of `checkpoint` were restored at `step`; take back its running
        statistics (`saved_state`: the guard's state saved with it, None if it has none) and lower the rate."""
        skipped = self.consecutive_skips
        self.rollbacks.append([checkpoint_step, step])
        if saved_state is not None:
            self._load_statistics(saved_state)
        self.consecutive_skips = 0
        action = (f"weights and optimizer state of {checkpoint} restored; learning rate x{self.lr_scale(step + 1):g} "
                  f"from step {step + 1} on (rollback {len(self.rollbacks)} of at most {self.max_rollbacks})")
        return self._record(Intervention(step=step, kind=ROLLBACK, value=float(skipped), running=self.loss_mean,
                                         limit=float(checkpoint_step), action=action))

    # -- checkpoints (JSON-compatible: the trainer keeps it in trainer_state.json)

    def state_dict(self) -> dict:
        return {
            "loss_ema": [self._loss.biased, self._loss.count],
            "loss_variance_ema": [self._loss_variance.biased, self._loss_variance.count],
            "log_grad_norm_ema": [self._log_grad_norm.biased, self._log_grad_norm.count],
            "blowup_step": self.blowup_step,
            "skipped_steps": self.skipped_steps,
            "consecutive_skips": self.consecutive_skips,
            "last_skipped_step": self._last_skipped_step,
            "rollbacks": self.rollbacks,
            "interventions": [asdict(i) for i in self.interventions],
        }

    def _load_statistics(self, state: dict) -> None:
        self._loss.biased, self._loss.count = state["loss_ema"]
        # Checkpoints written before the deviation term existed start its statistics afresh.
        self._loss_variance.biased, self._loss_variance.count = state.get("loss_variance_ema", [0.0, 0])
        self._log_grad_norm.biased, self._log_grad_norm.count = state["log_grad_norm_ema"]

    def load_state_dict(self, state: dict) -> None:
        self._load_statistics(state)
        self.rollbacks = [list(r) for r in state.get("rollbacks", [])]  # none in checkpoints from before rollbacks
        self.blowup_step = state["blowup_step"]
        self.skipped_steps = state["skipped_steps"]
        self.consecutive_skips = state["consecutive_skips"]
        self._last_skipped_step = state["last_skipped_step"]
        self.interventions = [Intervention(**i) for i in state["interventions"]]


def write_interventions(path: str, guard: StabilityGuard) -> str:
    """The run's interventions as JSON (non-finite values as NaN/Infinity, as Python's json writes them)."""
    return write_json(path, {"skipped_steps": guard.skipped_steps,
                             "interventions": [asdict(i) for i in guard.interventions]})
