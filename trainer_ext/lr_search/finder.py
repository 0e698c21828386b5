"""Learning-rate threshold test: short trials at constant rates before a production run, one rate picked.

Why: the rate that diverges a billion-parameter run shows itself within tens of steps as loss spikes or a
growing gradient norm, long before the run's budget is spent. Each trial trains a fresh model from the same
weights (the init, or for large models weights trained `sweep_start_steps`, since a trained model breaks at rates a
fresh one takes) on the same batches with the production optimizer and memory settings (one trial at a time,
so the sweep fits the memory budget of the run it prepares), at a constant rate after a linear warm-up. The
pick is the largest rate that was stable, with every smaller rate stable too, divided by `margin`: a long
run at its threshold rate would ride the edge, and a short trial can miss slow instabilities.

At batch 1 the batch drawn moves one step's loss by more than a spike's size, and every trial draws the same
batches in the same order: rates are therefore judged on their residuals against the per-step median loss of the
trials (`judge_trials`), which takes each batch's difficulty out; trailing medians, not means, so that one outlier
step is not a lasting rise. Divergence (an error, non-finite values, no progress, a collapse; from trained weights,
a rise of the loss on fixed held-out samples) is judged per trial.

The trials are run in trainer_ext/lr_search/trials.py; the sweep's files (lr_sweep.json / .md / .png) are written
and read in trainer_ext/lr_search/sweep_file.py.
The summary, judgement and pick functions are pure (lists and dicts in, dicts out): they are tested on synthetic
curves and on the curves of a GPU sweep.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from trainer_ext.training.arguments import LARGE_MODEL_PARAMS

# Around the 3e-4 default for large models, up to where billion-scale runs are known to diverge.
DEFAULT_LEARNING_RATES = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3)
# Large models start their trials from weights trained for 100 steps: recurrent-7b's trials from the init found
# 4e-4 stable, yet a run broke 5 steps after warming up to 2e-4 over 100 steps; trials from 100 trained steps
# found that break (results/training-control).
LARGE_MODEL_SWEEP = {"learning_rates": list(DEFAULT_LEARNING_RATES), "sweep_steps": 60, "sweep_warmup_steps": 10,
                     "sweep_start_steps": 100}
# Models under LARGE_MODEL_PARAMS train at a 3e-3 default: their grid brackets that rate instead, and a shorter
# trial keeps the bare command (debug preset on a CPU) at about a minute.
SMALL_MODEL_SWEEP = {"learning_rates": [3e-3, 1e-2, 3e-2, 1e-1], "sweep_steps": 24, "sweep_warmup_steps": 6,
                     "sweep_start_steps": 0}
# Initial and final loss, and the trailing medians that judge a rise, span at most this many steps: one step's loss
# at batch 1 moves by more than a spike's size with the batch drawn.
LOSS_WINDOW = 10
# A rise is measured over the lowest trailing median of the last this many windows: a spike or a divergence rises
# within that span, while one curve drifting slowly against the others (a lead lost as they catch up) does not.
RISE_WINDOWS = 2
# Judging each rate against the per-step median of the trials needs at least this many comparable trials.
MIN_PAIRED_TRIALS = 3
# A trial stopped by an exception of these kinds is an unstable rate (e.g. the optimizer's stop after
# repeated non-finite gradients); anything else is a bug or a setup error and ends the sweep.
TRIAL_FAILURES = (RuntimeError, ArithmeticError)


@dataclass
class SweepArguments:
    # None where the user leaves them: `resolve_sweep_defaults` picks them from the model's size.
    learning_rates: list[float] | None = field(
        default=None, metadata={"help": "Rates to try, each a fresh trial from the same initial weights (default: "
                                        "1e-4 to 5e-3; 3e-3 to 1e-1 for models under 50M parameters)."})
    sweep_steps: int | None = field(
        default=None, metadata={"help": "Optimizer steps per trial, warm-up included (default: 60, small models 24)."})
    sweep_warmup_steps: int | None = field(
        default=None, metadata={"help": "Warm-up steps per trial; loss is judged after them (default 10, small 6)."})
    # A spike: a step after warm-up whose trailing median loss, against the other trials on the same batches, is
    # this many nats above its lowest so far.
    spike_nats: float = field(default=0.5, metadata={"help": "Nats of a lasting rise, paired with the other rates."})
    max_grad_norm_growth: float = field(
        default=10.0, metadata={"help": "Unstable when the median grad norm of a trial's last quarter exceeds this "
                                        "many times that of its first quarter."})
    margin: float = field(
        default=2.0, metadata={"help": "The pick: the largest rate stable with all smaller ones, divided by this."})
    sweep_start_steps: int | None = field(
        default=None, metadata={"help": "Train this many steps first, warming up linearly to the smallest rate, and "
                                        "start every trial from those weights (on the samples after them): a "
                                        "trained model can break at a rate that a fresh one takes. 0: trials from "
                                        "the init (default: 100; 0 for models under 50M parameters)."})
    # A trained model's loss falls less within a trial than the batch drawn moves it: its own losses cannot tell
    # whether an update broke it, a fixed held-out set can.
    sweep_eval_samples: int = field(
        default=8, metadata={"help": "With --sweep_start_steps: held-out samples (the data's eval split) on which "
                                     "the start and each trial are evaluated at their end; a trial that ends more "
                                     "than --spike_nats above the start's held-out loss broke the model."})
    skip_after_divergence: bool = field(
        default=True, metadata={"help": "After a trial diverges (non-finite loss or grad norm, no progress, a "
                                        "trailing median loss above the first, or a stop), record larger rates as "
                                        "skipped instead of running them; they cannot be picked."})

    def __post_init__(self):
        if self.learning_rates is not None:
            rates = [float(rate) for rate in self.learning_rates]
            if not rates or not all(math.isfinite(rate) and rate > 0 for rate in rates):
                raise ValueError(f"--learning_rates={self.learning_rates!r}: give one or more positive numbers, "
                                 "e.g. --learning_rates 1e-4 3e-4 1e-3.")
            self.learning_rates = sorted(set(rates))
        if self.sweep_warmup_steps is not None and self.sweep_warmup_steps < 0:
            raise ValueError(f"--sweep_warmup_steps={self.sweep_warmup_steps} must be >= 0.")
        if self.sweep_steps is not None and self.sweep_warmup_steps is not None \
                and self.sweep_steps - self.sweep_warmup_steps < 4:
            raise ValueError(
                f"--sweep_steps={self.sweep_steps} leaves {self.sweep_steps - self.sweep_warmup_steps} steps after "
                f"--sweep_warmup_steps={self.sweep_warmup_steps}; the summary needs at least 4 (first and last "
                "quarters): raise --sweep_steps or lower --sweep_warmup_steps.")
        if self.sweep_start_steps is not None and (
                not isinstance(self.sweep_start_steps, int) or self.sweep_start_steps < 0):
            raise ValueError(f"--sweep_start_steps={self.sweep_start_steps!r} must be an integer >= 0.")
        if not isinstance(self.sweep_eval_samples, int) or self.sweep_eval_samples < 1:
            raise ValueError(f"--sweep_eval_samples={self.sweep_eval_samples!r} must be an integer >= 1.")
        if not self.spike_nats > 0:
            raise ValueError(f"--spike_nats={self.spike_nats} must be > 0 (0.5 is a clear spike).")
        if not self.max_grad_norm_growth > 1:
            raise ValueError(f"--max_grad_norm_growth={self.max_grad_norm_growth} must be > 1.")
        if not self.margin >= 1:
            raise ValueError(f"--margin={self.margin} must be >= 1 (1 picks the largest stable rate itself).")


def resolve_sweep_defaults(sweep: SweepArguments, num_params: int) -> dict:
    """Fill the sweep fields left None, in place: SMALL_MODEL_SWEEP under LARGE_MODEL_PARAMS, else
    LARGE_MODEL_SWEEP; then check the combination. Returns the small-model settings applied, for the log."""
    small = num_params < LARGE_MODEL_PARAMS
    defaults = SMALL_MODEL_SWEEP if small else LARGE_MODEL_SWEEP
    applied = {name: list(value) if isinstance(value, list) else value for name, value in defaults.items()
               if getattr(sweep, name) is None}
    for name, value in applied.items():
        setattr(sweep, name, value)
    sweep.__post_init__()  # e.g. a --sweep_warmup_steps given with the small models' 24 steps
    return applied if small else {}


# ----------------------------------------------------------------------------- pure summary and pick


def curve_from_log_history(log_history: Sequence[dict]) -> dict[str, list]:
    """Per-step lists (step, loss, grad_norm, learning_rate) from a Trainer's log history logged every step."""
    rows = [entry for entry in log_history if "loss" in entry]
    return {
        "step": [int(entry.get("step", index + 1)) for index, entry in enumerate(rows)],
        "loss": [float(entry["loss"]) for entry in rows],
        "grad_norm": [None if entry.get("grad_norm") is None else float(entry["grad_norm"]) for entry in rows],
        "learning_rate": [entry.get("learning_rate") for entry in rows],
    }


def trailing_median(values: Sequence[float], window: int, start: int = 0) -> dict[int, float]:
    """{index: median of values[index - window + 1 : index + 1]} for every full window that begins at or after
    `start`. Non-finite values are left out of a window; a window with none finite is left out."""
    medians = {}
    for index in range(start + window - 1, len(values)):
        finite = [v for v in values[index - window + 1:index + 1] if v is not None and math.isfinite(v)]
        if finite:
            medians[index] = statistics.median(finite)
    return medians


def lasting_rise(
    losses: Sequence[float],
    warmup_steps: int,
    spike_nats: float,
    window: int = 1,
    reference: Sequence[float] | None = None,
    smaller: Sequence[Sequence[float]] = (),
) -> dict:
    """Steps after warm-up at which the `window`-step trailing median of the losses is more than `spike_nats` above
    its lowest value over the last RISE_WINDOWS x `window` steps (`spikes`), and the largest such rise in nats
    (`largest_rise`). Windows lie wholly after warm-up; a median ignores one outlier step (which the stability guard
    would skip in a real run), and a bounded look-back measures rises, not slow drifts of one curve against others.

    With a `reference` (the per-step median loss of the trials, which drew the same batches), the medians are of
    the residuals `loss - reference`: what the rate does, with the difficulty of each step's batch taken out. A
    residual rise then counts only at steps where one of the `smaller` rates' curves (same steps) is ahead, with a
    lower trailing median residual (the trial falls behind a more cautious rate), and where the rise exceeds the
    fall of the reference's trailing median over the same steps (the trial's own loss rose): a rate that falls
    more slowly than others, or loses an early lead as they catch up, is not unstable."""
    def smoothed_residuals(curve):
        residuals = curve if reference is None else [loss - ref for loss, ref in zip(curve, reference)]
        return trailing_median(residuals, window, warmup_steps)

    smoothed = smoothed_residuals(losses)
    others = [smoothed_residuals(curve) for curve in smaller] if reference is not None else []
    trend = {} if reference is None else trailing_median(reference, window, warmup_steps)
    spikes, largest = 0, 0.0
    for index, value in smoothed.items():
        lowest = min((i for i in smoothed if index - RISE_WINDOWS * window <= i <= index), key=smoothed.get)
        rise = value - smoothed[lowest]
        largest = max(largest, rise)
        behind = reference is None or any(other.get(index, math.inf) < value for other in others)
        own_rise = rise + trend.get(index, 0.0) - trend.get(lowest, 0.0)
        if rise > spike_nats and behind and own_rise > 0:
            spikes += 1
    return {"spikes": spikes, "largest_rise": largest}


def grad_norm_growth(grad_norms: Sequence[float | None]) -> float | None:
    """Median of the last quarter over the median of the first quarter (finite values only; None if unknown)."""
    values = [g for g in grad_norms if g is not None and math.isfinite(g)]
    if len(values) < 2:
        return None
    quarter = max(1, len(values) // 4)
    first, last = statistics.median(values[:quarter]), statistics.median(values[-quarter:])
    if first <= 0:
        return None if last <= 0 else math.inf
    return last / first


def summarize_trial(
    losses: Sequence[float],
    grad_norms: Sequence[float | None],
    *,
    planned_steps: int,
    warmup_steps: int,
    spike_nats: float,
    max_grad_norm_growth: float,
    error: str | None = None,
    reference: Sequence[float] | None = None,
    smaller: Sequence[Sequence[float]] = (),
    held_out: tuple[float | None, float | None] | None = None,
) -> dict:
    """What one trial says about its rate. Stable means: it ran all `planned_steps` without an error, no loss or
    grad norm was non-finite, no lasting rise after warm-up (`lasting_rise`: against `reference` and the `smaller`
    rates' loss curves when given, else on the trial's own losses), the loss after warm-up fell (final < initial)
    and ended below the very first loss, and the grad norm grew less than `max_grad_norm_growth` times (last
    quarter of the trial against its first quarter, medians).

    `initial_loss` / `final_loss` are medians of the first / last `window` = min(LOSS_WINDOW, quarter) steps after
    warm-up; rises are judged on `window`-step trailing medians. `final_vs_reference`: the median of the last
    `window` residuals (how far behind or ahead of the other rates the trial ended; None without a reference).
    `diverged` is judged on the trial alone, so that larger rates can be skipped before they run: stopped by an
    error, a non-finite loss or grad norm, no progress after warm-up (final >= initial), or a trailing median after
    warm-up more than `spike_nats` above the first loss (whatever was learnt is gone: a collapsed model can settle
    below its initial loss again, so a falling loss alone does not clear it).

    `held_out`: (the start's, the trial's) held-out loss, for a trial from trained weights. Its losses then need
    not fall or stay below its first (one batch of a model that has learnt most of what a few steps teach);
    instead it diverged where its held-out loss ended more than `spike_nats` above the start's, or is missing.
    Nor do rises of its own losses make it unstable unless judged against a `reference`: a recurrent-7b trial at
    1e-4 from 100 trained steps counted 7 on its own losses (batch 5 x 2048) while its held-out loss fell 0.45.
    """
    losses = [math.nan if loss is None else float(loss) for loss in losses]
    grad_norms = list(grad_norms)
    if reference is not None:
        assert len(reference) == len(losses), "a reference holds one loss per step of the trial"
    after = losses[warmup_steps:]
    window = max(1, min(LOSS_WINDOW, len(after) // 4))
    initial, final = _median_of_finite(after[:window]), _median_of_finite(after[-window:])
    nonfinite_losses = sum(not math.isfinite(loss) for loss in losses)
    nonfinite_grad_norms = sum(g is not None and not math.isfinite(g) for g in grad_norms)
    finite = [loss for loss in losses if math.isfinite(loss)]
    rise = lasting_rise(losses, warmup_steps, spike_nats, window, reference, smaller)
    spikes = rise["spikes"]
    # Over the whole trial, warm-up included: a blow-up that starts during warm-up counts too.
    growth = grad_norm_growth(grad_norms)
    held_out_rise = math.nan
    if held_out is None:
        fell = math.isfinite(final) and math.isfinite(initial) and final < initial
        below_start = bool(losses) and math.isfinite(final) and final < losses[0]
        above_start = bool(finite) and any(
            median > finite[0] + spike_nats for median in trailing_median(losses, window, warmup_steps).values())
    else:  # from trained weights the held-out set judges: above_start where it rose, or was not measured (NaN)
        start_held_out, end_held_out = (math.nan if value is None else value for value in held_out)
        held_out_rise = end_held_out - start_held_out
        fell = below_start = True
        above_start = not held_out_rise <= spike_nats
    behind = math.nan
    if reference is not None and after:
        behind = _median_of_finite([loss - ref for loss, ref in zip(losses, reference)][-window:])

    reasons = []
    if error is not None:
        reasons.append("stopped by an error")
    if len(losses) < planned_steps:
        reasons.append(f"ran {len(losses)} of {planned_steps} steps")
    if nonfinite_losses:
        reasons.append(f"{nonfinite_losses} non-finite losses")
    if nonfinite_grad_norms:
        reasons.append(f"{nonfinite_grad_norms} non-finite grad norms")
    if spikes and (held_out is None or reference is not None):
        reasons.append(f"{spikes} spike{'s' if spikes > 1 else ''}")
    if above_start and held_out is not None:
        reasons.append(f"held-out loss {format_rise(held_out_rise)} against the start's")
    elif above_start:
        reasons.append(f"loss rose over {spike_nats:g} nats above the first step's")
    if not fell:
        reasons.append("loss did not fall after warm-up")
    elif not below_start:
        reasons.append("loss ended above the first step's")
    if growth is not None and not growth < max_grad_norm_growth:
        reasons.append(f"grad norm grew x{growth:.3g}")
    return {
        "steps_run": len(losses),
        "start_loss": finite_or_none(losses[0]) if losses else None,
        "initial_loss": finite_or_none(initial),
        "final_loss": finite_or_none(final),
        "loss_trend": finite_or_none(final - initial),
        "grad_norm_ratio": finite_or_none(growth),
        "paired": reference is not None,
        "window": window,
        "final_vs_reference": finite_or_none(behind),
        "largest_rise": finite_or_none(rise["largest_rise"]),
        "held_out_loss": None if held_out is None else finite_or_none(held_out[1]),
        "held_out_rise": finite_or_none(held_out_rise),
        "spikes": spikes,
        "nonfinite_losses": nonfinite_losses,
        "nonfinite_grad_norms": nonfinite_grad_norms,
        "diverged": error is not None or nonfinite_losses > 0 or nonfinite_grad_norms > 0 or not fell or above_start,
        "stable": not reasons,
        "unstable_reasons": reasons,
        "error": error,
    }


def comparable(trial: dict, planned_steps: int) -> bool:
    """A trial that ran every planned step without an error and with finite losses: its losses can be compared
    step by step with the other trials', which drew the same batches in the same order."""
    losses = trial["curve"]["loss"] if not trial.get("skipped") else []
    return (len(losses) == planned_steps and trial.get("error") is None
            and all(loss is not None and math.isfinite(loss) for loss in losses))


def reference_losses(trials: Sequence[dict], planned_steps: int) -> list[float] | None:
    """The per-step median loss over the comparable trials (the difficulty of each step's batch, as every rate saw
    it); None with fewer than MIN_PAIRED_TRIALS of them, where a median would follow one trial's own moves."""
    curves = [trial["curve"]["loss"] for trial in trials if comparable(trial, planned_steps)]
    if len(curves) < MIN_PAIRED_TRIALS:
        return None
    return [statistics.median(step_losses) for step_losses in zip(*curves)]


def judge_trials(trials: Sequence[dict], sweep: SweepArguments,
                 start_held_out: float | None = None) -> tuple[list[dict], list[float] | None]:
    """Every trial that ran, summarised against the other trials (`reference_losses`) where it is comparable, else
    on its own; skipped trials are returned as they are. Returns (the trials in ascending rate order, the
    reference or None). `start_held_out`: the held-out loss of the weights the trials started from (with a sweep
    start; each trial then carries its own as `held_out_loss`).

    At batch 1 the batch drawn moves one step's loss by more than a spike's size, and every trial draws the same
    batches: the rise that judges a rate is measured on its residuals, which the shared batches do not move."""
    reference = reference_losses(trials, sweep.sweep_steps)
    judged, smaller = [], []  # smaller: the comparable curves of the rates below, in ascending order
    for trial in sorted(trials, key=lambda trial: trial["learning_rate"]):
        if trial.get("skipped"):
            judged.append(dict(trial))
            continue
        paired = reference is not None and comparable(trial, sweep.sweep_steps)
        summary = summarize_trial(
            trial["curve"]["loss"], trial["curve"]["grad_norm"], planned_steps=sweep.sweep_steps,
            warmup_steps=sweep.sweep_warmup_steps, spike_nats=sweep.spike_nats,
            max_grad_norm_growth=sweep.max_grad_norm_growth, error=trial.get("error"),
            reference=reference if paired else None, smaller=list(smaller) if paired else (),
            held_out=None if start_held_out is None else (start_held_out, trial.get("held_out_loss")))
        judged.append({**trial, **summary})
        if paired:
            smaller.append(trial["curve"]["loss"])
    return judged, reference


def pick_learning_rate(trials: Sequence[dict], margin: float) -> dict:
    """The largest rate such that it and every smaller rate were stable, divided by `margin`.

    A stable rate above an unstable one is not trusted (a lucky trial): the pick stays below the first
    unstable rate. `learning_rate` is None when the smallest rate was unstable.
    """
    ordered = sorted(trials, key=lambda trial: trial["learning_rate"])
    largest_stable, first_unstable = None, None
    for trial in ordered:
        if not trial["stable"]:
            first_unstable = trial["learning_rate"]
            break
        largest_stable = trial["learning_rate"]
    stable_above = [t["learning_rate"] for t in ordered
                    if t["stable"] and first_unstable is not None and t["learning_rate"] > first_unstable]
    return {
        "learning_rate": None if largest_stable is None else largest_stable / margin,
        "largest_stable_learning_rate": largest_stable,
        "first_unstable_learning_rate": first_unstable,
        "stable_above_first_unstable": stable_above,
        "margin": margin,
    }


def _median_of_finite(values: Sequence[float]) -> float:
    finite = [v for v in values if math.isfinite(v)]
    return statistics.median(finite) if finite else math.nan


def format_rise(rise: float) -> str:
    return f"{rise:+.2f} nats" if math.isfinite(rise) else "not measured (the trial stopped)"


def finite_or_none(value: float) -> float | None:
    """JSON has no NaN/Inf: a non-finite number is stored as null."""
    return float(value) if value is not None and math.isfinite(value) else None
