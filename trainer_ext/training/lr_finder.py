"""Learning-rate threshold test: short trials at constant rates before a production run, one rate picked.

Why: the rate that diverges a billion-parameter run shows itself within tens of steps as loss spikes or a
growing gradient norm, long before the run's budget is spent. Each trial trains a fresh model from the same
initial weights on the same batches with the production optimizer and memory settings (one trial at a time,
so the sweep fits the memory budget of the run it prepares), at a constant rate after a linear warm-up. The
pick is the largest rate that was stable, with every smaller rate stable too, divided by `margin`: a long
run at its threshold rate would ride the edge, and a short trial can miss slow instabilities.

Files written into the output folder (all read and written here):

    lr_sweep.json   the setting (model, seq_len, batch size), per-trial summaries and per-step curves, and
                    the `learning_rate` that `hf-recurrent-pretrain --learning_rate_from` takes
    lr_sweep.md     a table: lr | initial loss | final loss | spikes | grad-norm ratio | stable
    lr_sweep.png    loss and gradient norm per step, one line per rate

The summary and pick functions are pure (lists of floats in, dicts out) so they are tested on synthetic curves.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import math
import os
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from transformers import PrinterCallback, ProgressCallback

from trainer_ext.files import atomic_open, write_json, write_text
from trainer_ext.data.shards import load_manifest
from trainer_ext.training.trainer import RecurrentTrainer

logger = logging.getLogger(__name__)

SWEEP_FILE, REPORT_FILE, PLOT_FILE = "lr_sweep.json", "lr_sweep.md", "lr_sweep.png"
FORMAT_VERSION = 1
# Around run_pretrain's 3e-4 default for large models, up to where billion-scale runs are known to diverge.
DEFAULT_LEARNING_RATES = (1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3)
# Initial and final loss are means over at most this many steps: one step's loss is too noisy to compare.
LOSS_WINDOW = 10
# A trial stopped by an exception of these kinds is an unstable rate (e.g. the optimizer's stop after
# repeated non-finite gradients); anything else is a bug or a setup error and ends the sweep.
TRIAL_FAILURES = (RuntimeError, ArithmeticError)


@dataclass
class SweepArguments:
    learning_rates: list[float] = field(
        default_factory=lambda: list(DEFAULT_LEARNING_RATES),
        metadata={"help": "Rates to try, each a fresh trial from the same initial weights (sorted ascending)."})
    sweep_steps: int = field(default=60, metadata={"help": "Optimizer steps per trial, warm-up included."})
    sweep_warmup_steps: int = field(
        default=10, metadata={"help": "Linear warm-up steps of each trial; loss is judged after them."})
    spike_nats: float = field(
        default=0.5, metadata={"help": "A spike: a loss after warm-up this many nats above the lowest loss so far."})
    max_grad_norm_growth: float = field(
        default=10.0, metadata={"help": "Unstable when the median grad norm of a trial's last quarter exceeds this "
                                        "many times that of its first quarter."})
    margin: float = field(
        default=2.0, metadata={"help": "The pick is the largest stable rate divided by this (not snapped to the "
                                       "grid): the largest rate such that it and every smaller rate were stable."})
    skip_after_divergence: bool = field(
        default=True, metadata={"help": "After a trial diverges (non-finite loss or grad norm, no progress, a loss "
                                        "above the first, or a stop), record larger rates as skipped instead of "
                                        "running them; they cannot be picked."})

    def __post_init__(self):
        rates = [float(rate) for rate in self.learning_rates]
        if not rates or not all(math.isfinite(rate) and rate > 0 for rate in rates):
            raise ValueError(f"--learning_rates={self.learning_rates!r}: give one or more positive numbers, "
                             "e.g. --learning_rates 1e-4 3e-4 1e-3.")
        self.learning_rates = sorted(set(rates))
        if self.sweep_warmup_steps < 0:
            raise ValueError(f"--sweep_warmup_steps={self.sweep_warmup_steps} must be >= 0.")
        if self.sweep_steps - self.sweep_warmup_steps < 4:
            raise ValueError(
                f"--sweep_steps={self.sweep_steps} leaves {self.sweep_steps - self.sweep_warmup_steps} steps after "
                f"--sweep_warmup_steps={self.sweep_warmup_steps}; the summary needs at least 4 (first and last "
                "quarters): raise --sweep_steps or lower --sweep_warmup_steps.")
        if not self.spike_nats > 0:
            raise ValueError(f"--spike_nats={self.spike_nats} must be > 0 (0.5 is a clear spike).")
        if not self.max_grad_norm_growth > 1:
            raise ValueError(f"--max_grad_norm_growth={self.max_grad_norm_growth} must be > 1.")
        if not self.margin >= 1:
            raise ValueError(f"--margin={self.margin} must be >= 1 (1 picks the largest stable rate itself).")


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


def trailing_mean(losses: Sequence[float], window: int) -> list[float]:
    """Mean of each loss and the `window - 1` before it (fewer at the start)."""
    return [_mean(losses[max(0, i - window + 1):i + 1]) for i in range(len(losses))]


def count_spikes(losses: Sequence[float], warmup_steps: int, spike_nats: float, window: int = 1) -> int:
    """Steps after warm-up whose loss, averaged over `window` steps, is more than `spike_nats` above the lowest
    such average so far. One step's loss at a small batch moves by more than a spike's size (0.6 nats at batch 1 x
    2048 on recurrent-3.3b), so the summary judges `window`-step means: a spike is a rise that lasts."""
    spikes, running_min = 0, math.inf
    for index, loss in enumerate(trailing_mean(losses, window) if window > 1 else losses):
        if not math.isfinite(loss):
            continue  # non-finite losses are counted as divergence, not as spikes
        running_min = min(running_min, loss)
        if index >= warmup_steps and loss > running_min + spike_nats:
            spikes += 1
    return spikes


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
) -> dict:
    """What one trial says about its rate. Stable means: it ran all `planned_steps` without an error, no loss or
    grad norm was non-finite, no spike after warm-up, the loss after warm-up fell (final < initial) and ended
    below the very first loss, and the grad norm grew less than `max_grad_norm_growth` times (last quarter of
    the trial against its first quarter, medians).

    `initial_loss` / `final_loss` are means of the first / last min(LOSS_WINDOW, quarter) steps after warm-up;
    spikes and the rise over the first loss are judged on trailing means over as many steps.
    `diverged`: stopped by an error, a non-finite loss or grad norm, no progress after warm-up (final >= initial),
    or a loss more than `spike_nats` above the first one (whatever was learnt is gone: a collapsed model can
    settle below its initial loss again, so a falling loss alone does not clear it).
    """
    losses = [math.nan if loss is None else float(loss) for loss in losses]
    grad_norms = list(grad_norms)
    after = losses[warmup_steps:]
    window = max(1, min(LOSS_WINDOW, len(after) // 4))
    initial = _mean(after[:window]) if after else math.nan
    final = _mean(after[-window:]) if after else math.nan
    nonfinite_losses = sum(not math.isfinite(loss) for loss in losses)
    nonfinite_grad_norms = sum(g is not None and not math.isfinite(g) for g in grad_norms)
    finite = [loss for loss in losses if math.isfinite(loss)]
    spikes = count_spikes(losses, warmup_steps, spike_nats, window)
    # Over the whole trial, warm-up included: a blow-up that starts during warm-up counts too.
    growth = grad_norm_growth(grad_norms)
    fell = math.isfinite(final) and math.isfinite(initial) and final < initial
    below_start = bool(losses) and math.isfinite(final) and final < losses[0]
    above_start = bool(finite) and any(loss > finite[0] + spike_nats for loss in trailing_mean(finite, window))

    reasons = []
    if error is not None:
        reasons.append("stopped by an error")
    if len(losses) < planned_steps:
        reasons.append(f"ran {len(losses)} of {planned_steps} steps")
    if nonfinite_losses:
        reasons.append(f"{nonfinite_losses} non-finite losses")
    if nonfinite_grad_norms:
        reasons.append(f"{nonfinite_grad_norms} non-finite grad norms")
    if spikes:
        reasons.append(f"{spikes} spike{'s' if spikes > 1 else ''}")
    if above_start:
        reasons.append(f"loss rose over {spike_nats:g} nats above the first step's")
    if not fell:
        reasons.append("loss did not fall after warm-up")
    elif not below_start:
        reasons.append("loss ended above the first step's")
    if growth is not None and not growth < max_grad_norm_growth:
        reasons.append(f"grad norm grew x{growth:.3g}")
    return {
        "steps_run": len(losses),
        "start_loss": _finite_or_none(losses[0]) if losses else None,
        "initial_loss": _finite_or_none(initial),
        "final_loss": _finite_or_none(final),
        "loss_trend": _finite_or_none(final - initial),
        "grad_norm_ratio": _finite_or_none(growth),
        "spikes": spikes,
        "nonfinite_losses": nonfinite_losses,
        "nonfinite_grad_norms": nonfinite_grad_norms,
        "diverged": error is not None or nonfinite_losses > 0 or nonfinite_grad_norms > 0 or not fell or above_start,
        "stable": not reasons,
        "unstable_reasons": reasons,
        "error": error,
    }


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


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values)


def _finite_or_none(value: float) -> float | None:
    """JSON has no NaN/Inf: a non-finite number is stored as null."""
    return float(value) if value is not None and math.isfinite(value) else None


# ----------------------------------------------------------------------------- running the trials


def trial_arguments(training_args, learning_rate: float, sweep: SweepArguments):
    """The production arguments (optimizer, precision, checkpointing, batch size) with a trial's schedule: constant
    rate after a linear warm-up, a log entry every step, no evaluation, no checkpoints, no hub push, and no
    stability guard: it skips spiking updates and lowers the rate, which would hide what the trial measures."""
    no_guard = {"stability_guard": False} if hasattr(training_args, "stability_guard") else {}
    return dataclasses.replace(
        training_args,
        **no_guard,
        learning_rate=learning_rate,
        max_steps=sweep.sweep_steps,
        lr_scheduler_type="constant_with_warmup",
        lr_scheduler_kwargs={},
        warmup_steps=sweep.sweep_warmup_steps,
        logging_strategy="steps",
        logging_steps=1,
        logging_first_step=False,
        # The Trainer's filter replaces a NaN/Inf loss with the running mean: the sweep must see it.
        logging_nan_inf_filter=False,
        eval_strategy="no",
        eval_on_start=False,
        save_strategy="no",
        load_best_model_at_end=False,
        push_to_hub=False,
        resume_from_checkpoint=None,
        disable_tqdm=True,
    )


def run_trial(make_model: Callable[[], torch.nn.Module], args, train_dataset, trainer_kwargs: dict) -> dict:
    """Train one fresh model; returns its per-step curve, the error that stopped it (if any) and its peak memory.

    Nothing of the trial outlives this call: the trainer, model and optimizer are released before it returns.
    """
    on_cuda = args.device.type == "cuda"
    if on_cuda:
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    model = make_model()
    trainer = RecurrentTrainer(model=model, args=args, train_dataset=train_dataset, **trainer_kwargs)
    # One progress line per trial instead of the Trainer's line per step.
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    error = None
    try:
        trainer.train()
    except torch.cuda.OutOfMemoryError:
        raise  # the setting does not fit at any rate: not a verdict on this one
    except TRIAL_FAILURES as exc:
        error = f"{type(exc).__name__}: {exc}"
    curve = curve_from_log_history(trainer.state.log_history)
    trainer.accelerator.free_memory()
    del trainer, model
    gc.collect()
    peak = torch.cuda.max_memory_reserved() / 2**30 if on_cuda else None
    if on_cuda:
        torch.cuda.empty_cache()
    return {"curve": curve, "error": error, "seconds": round(time.perf_counter() - start, 2),
            "peak_reserved_gib": None if peak is None else round(peak, 3)}


def run_sweep(
    make_model: Callable[[], torch.nn.Module],
    training_args,
    train_dataset,
    sweep: SweepArguments,
    trainer_kwargs: dict | None = None,
    info: dict | None = None,
) -> dict:
    """Run the trials in ascending rate order, summarise each, pick a rate; returns the lr_sweep.json record.

    `make_model` must return the same initial weights each call (seed it): the trials then differ only in rate.
    `trainer_kwargs` go to each RecurrentTrainer (processing_class, teacher, ...). Writes nothing.
    """
    trials, diverged_at = [], None
    total = len(sweep.learning_rates)
    for index, rate in enumerate(sweep.learning_rates, 1):
        if diverged_at is not None and sweep.skip_after_divergence:
            trials.append({"learning_rate": rate, "skipped": True, "stable": False,
                           "unstable_reasons": [f"skipped: {diverged_at:g} diverged"]})
            logger.info("[%d/%d] lr %.3g: skipped (lr %.3g diverged)", index, total, rate, diverged_at)
            continue
        outcome = run_trial(make_model, trial_arguments(training_args, rate, sweep), train_dataset,
                            dict(trainer_kwargs or {}))
        curve = outcome["curve"]
        summary = summarize_trial(curve["loss"], curve["grad_norm"], planned_steps=sweep.sweep_steps,
                                  warmup_steps=sweep.sweep_warmup_steps, spike_nats=sweep.spike_nats,
                                  max_grad_norm_growth=sweep.max_grad_norm_growth, error=outcome["error"])
        trial = {"learning_rate": rate, "skipped": False, **summary, "seconds": outcome["seconds"],
                 "peak_reserved_gib": outcome["peak_reserved_gib"],
                 "curve": {key: [_finite_or_none(v) if isinstance(v, float) else v for v in values]
                           for key, values in curve.items()}}
        trials.append(trial)
        logger.info("[%d/%d] %s", index, total, _progress_line(trial))
        if trial["diverged"] and diverged_at is None:
            diverged_at = rate
    return {
        "format_version": FORMAT_VERSION,
        **(info or {}),
        "sweep": dataclasses.asdict(sweep),
        "trials": trials,
        **pick_learning_rate(trials, sweep.margin),
    }


def _progress_line(trial: dict) -> str:
    verdict = "stable" if trial["stable"] else f"UNSTABLE ({', '.join(trial['unstable_reasons'])})"
    return (f"lr {trial['learning_rate']:.3g}: loss {_fmt(trial['initial_loss'])} -> {_fmt(trial['final_loss'])}, "
            f"{trial['spikes']} spikes, grad-norm ratio {_fmt(trial['grad_norm_ratio'], '.2f')}, {verdict} "
            f"[{trial['seconds']:.0f}s]")


def _fmt(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


# ----------------------------------------------------------------------------- files


def find_learning_rate(make_model, training_args, train_dataset, sweep: SweepArguments,
                       trainer_kwargs: dict | None = None, info: dict | None = None) -> dict:
    """run_sweep, then lr_sweep.json / .md / .png into `training_args.output_dir` (main process only)."""
    result = run_sweep(make_model, training_args, train_dataset, sweep, trainer_kwargs, info)
    if training_args.process_index == 0:
        paths = write_sweep(training_args.output_dir, result)
        logger.info("Wrote %s", ", ".join(paths))
    return result


def write_sweep(output_dir: str, result: dict) -> list[str]:
    """The three files of a sweep; each written atomically."""
    return [
        write_json(os.path.join(output_dir, SWEEP_FILE), result),
        write_text(os.path.join(output_dir, REPORT_FILE), format_report(result)),
        plot_sweep(result, os.path.join(output_dir, PLOT_FILE)),
    ]


def format_report(result: dict) -> str:
    sweep = result["sweep"]
    lines = [
        "# Learning-rate sweep",
        "",
        f"Model {result.get('model', '?')} ({_fmt_params(result.get('num_parameters'))}), seq_len "
        f"{result.get('seq_len', '?')}, batch {result.get('per_device_train_batch_size', '?')} per device, "
        f"{sweep['sweep_steps']} steps per trial ({sweep['sweep_warmup_steps']} warm-up, then constant).",
        f"Initial / final loss: means of the first / last steps after warm-up. Spike: a loss "
        f"{sweep['spike_nats']} nats above the lowest so far. Grad-norm ratio: median of the last quarter of the "
        f"trial / median of its first quarter (unstable from {sweep['max_grad_norm_growth']:g}).",
        "",
        "| lr | initial loss | final loss | spikes | grad-norm ratio | stable |",
        "| ---: | ---: | ---: | ---: | ---: | --- |",
    ]
    for trial in result["trials"]:
        if trial.get("skipped"):
            lines.append(f"| {trial['learning_rate']:g} | - | - | - | - | {trial['unstable_reasons'][0]} |")
            continue
        verdict = "yes" if trial["stable"] else f"no: {', '.join(trial['unstable_reasons'])}"
        lines.append(f"| {trial['learning_rate']:g} | {_fmt(trial['initial_loss'])} | {_fmt(trial['final_loss'])} "
                     f"| {trial['spikes']} | {_fmt(trial['grad_norm_ratio'], '.2f')} | {verdict} |")
    lines.append("")
    if result["learning_rate"] is None:
        lines.append("No rate was stable from the smallest up: try smaller rates with `--learning_rates`.")
    else:
        lines.append(
            f"**Chosen: learning_rate {result['learning_rate']:.3g}** (largest stable "
            f"{result['largest_stable_learning_rate']:g} / margin {result['margin']:g}), found with "
            f"{result['sweep']['sweep_warmup_steps']} warm-up steps. Train with `hf-recurrent-pretrain ... "
            f"--learning_rate_from` and this folder's {SWEEP_FILE} (the run keeps its own warm-up).")
        if result["first_unstable_learning_rate"] is None:
            lines.append("")
            lines.append("Every rate was stable: the threshold lies above the grid; add larger rates to find it.")
        if result["stable_above_first_unstable"]:
            lines.append("")
            lines.append(f"Stable above the first unstable rate ({result['first_unstable_learning_rate']:g}), "
                         f"not trusted: {', '.join(f'{r:g}' for r in result['stable_above_first_unstable'])}.")
    return "\n".join(lines) + "\n"


def _fmt_params(num_parameters) -> str:
    return "? parameters" if num_parameters is None else f"{num_parameters / 1e6:.1f}M parameters"


def plot_sweep(result: dict, path: str) -> str:
    """Loss and grad norm per step, one line per rate; unstable rates dashed, the warm-up end marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    figure = Figure(figsize=(11.0, 4.0), layout="constrained")
    FigureCanvasAgg(figure)
    loss_ax, grad_ax = figure.add_subplot(1, 2, 1), figure.add_subplot(1, 2, 2)
    ran = [trial for trial in result["trials"] if not trial.get("skipped")]
    for index, trial in enumerate(ran):
        curve = trial["curve"]
        style = {"color": f"C{index % 10}", "linewidth": 1.2, "linestyle": "-" if trial["stable"] else "--",
                 "label": f"{trial['learning_rate']:g}" + ("" if trial["stable"] else " (unstable)")}
        loss_ax.plot(*_points(curve["step"], curve["loss"]), **style)
        grad_ax.plot(*_points(curve["step"], curve["grad_norm"]), **style)
    # A diverged trial's loss would squash the others: the axis ends a little above the highest first loss.
    starts = [trial["start_loss"] for trial in ran if trial.get("start_loss") is not None]
    lows = [v for trial in ran for v in trial["curve"]["loss"] if v is not None]
    if starts and lows:
        loss_ax.set_ylim(min(lows) - 0.1, max(starts) + 0.5)
    if any(v is not None and v > 0 for trial in ran for v in trial["curve"]["grad_norm"]):
        grad_ax.set_yscale("log")
    for ax, label in ((loss_ax, "training loss (nats/token)"), (grad_ax, "gradient norm")):
        ax.axvline(result["sweep"]["sweep_warmup_steps"], color="gray", linewidth=0.8, linestyle=":")
        ax.set_xlabel("step")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
    loss_ax.legend(title="learning rate", fontsize="small")
    chosen = result["learning_rate"]
    figure.suptitle(f"{result.get('model', '')}: chosen learning rate "
                    + ("none (no stable rate)" if chosen is None else f"{chosen:.3g}"))
    with atomic_open(path, "wb") as f:
        figure.savefig(f, format="png", dpi=110)
    return path


def _points(steps: list, values: list) -> tuple[list, list]:
    pairs = [(s, v) for s, v in zip(steps, values) if v is not None]
    return [s for s, _ in pairs], [v for _, v in pairs]


# ----------------------------------------------------------------------------- reading the pick


def read_sweep_choice(path: str) -> dict:
    """`learning_rate` from an lr_sweep.json, or from the folder holding one.

    Raises ValueError naming the file and the fix when it is missing, malformed, or holds no stable rate.
    """
    if os.path.isdir(path):
        path = os.path.join(path, SWEEP_FILE)
    rerun = f"run hf-recurrent-find-lr (it writes <output_dir>/{SWEEP_FILE}) and pass that file to --learning_rate_from"
    data = load_manifest(path, ("format_version", "learning_rate"), FORMAT_VERSION, not_found=f"{rerun}.", fix=rerun)
    rate = data["learning_rate"]
    if rate is None:
        raise ValueError(f"--learning_rate_from {path}: the sweep found no stable learning rate; rerun "
                         "hf-recurrent-find-lr with smaller --learning_rates.")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not (math.isfinite(rate) and rate > 0):
        raise ValueError(f"--learning_rate_from {path}: 'learning_rate' is {rate!r}, not a positive number; {rerun}.")
    # Only the rate: the trials' short warm-up was enough for a few dozen steps, not for a long run, whose
    # warm-up stays the command line's or the large-model default.
    return {"learning_rate": float(rate)}
