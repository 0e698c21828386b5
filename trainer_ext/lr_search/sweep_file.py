"""The files of a learning-rate sweep, written and read here: lr_sweep.json (the record, and the `learning_rate`
that `hf-recurrent-pretrain --learning_rate_from` takes), lr_sweep.md (a table) and lr_sweep.png (the curves); while
it runs, lr_sweep.progress.json (the finished trials, so that a sweep stopped midway resumes where it was)."""

from __future__ import annotations

import math
import os

from trainer_ext.data.shards import load_manifest
from trainer_ext.files import atomic_open, check_same_run, write_json, write_text

SWEEP_FILE, REPORT_FILE, PLOT_FILE = "lr_sweep.json", "lr_sweep.md", "lr_sweep.png"
PROGRESS_FILE = "lr_sweep.progress.json"
# 2: rates judged on residuals against the per-step median of the trials (`reference_loss`, per trial `paired`,
# `final_vs_reference`, `largest_rise`); initial / final losses and rises are medians. Version 1 files were
# judged on raw batch losses, so their picks are not read.
FORMAT_VERSION = 2


def format_optional(value, spec: str = ".3f") -> str:
    return "-" if value is None else format(value, spec)


def write_sweep(output_dir: str, result: dict) -> list[str]:
    """The three files of a sweep; each written atomically."""
    return [
        write_json(os.path.join(output_dir, SWEEP_FILE), result),
        write_text(os.path.join(output_dir, REPORT_FILE), format_report(result)),
        plot_sweep(result, os.path.join(output_dir, PLOT_FILE)),
    ]


def format_report(result: dict) -> str:
    sweep = result["sweep"]
    from_start = result.get("start_held_out_loss") is not None  # trials from trained weights, judged held out
    lines = [
        "# Learning-rate sweep",
        "",
        f"Model {result.get('model', '?')} ({_fmt_params(result.get('num_parameters'))}), seq_len "
        f"{result.get('seq_len', '?')}, batch {result.get('per_device_train_batch_size', '?')} per device, "
        f"{sweep['sweep_steps']} steps per trial ({sweep['sweep_warmup_steps']} warm-up, then constant)"
        + (f", each from the weights of {sweep['sweep_start_steps']} steps warming up to the smallest rate "
           f"({result.get('sweep_start')})." if sweep.get("sweep_start_steps") else ", each from the init."),
        f"Initial / final loss: medians of the first / last {_window_text(result)} steps after warm-up. "
        + (f"Each rate is judged on its residuals: its loss minus the per-step median loss of the {_paired(result)} "
           "trials that ran every step (they drew the same batches in the same order, so this takes out each "
           "batch's difficulty). vs others: the median residual over the last steps (negative: ahead). "
           if result.get("reference_loss") else
           "Too few trials ran every step to compare them step by step, so each rate is judged on its own losses "
           "(noisier at batch 1). ")
        + f"Spike: a step after warm-up at which the trailing median is more than {sweep['spike_nats']} nats above "
        "its lowest over the last two windows (against the others, only where a smaller rate is ahead and the rise "
        "exceeds the others' fall meanwhile: a slower fall is not instability); largest rise: the largest such "
        "rise. "
        + ("Divergence (an error, non-finite values, a held-out loss at the trial's end more than "
           f"{sweep['spike_nats']} nats above the start's {format_optional(result.get('start_held_out_loss'))} on "
           f"{sweep.get('sweep_eval_samples')} held-out samples) " if from_start else
           "Divergence (an error, non-finite values, no fall after warm-up, a trailing median above the first "
           "loss) ")
        + "is judged per trial; larger rates are skipped after it. "
        f"Grad-norm ratio: median of the last quarter of the trial / median of its first quarter (unstable from "
        f"{sweep['max_grad_norm_growth']:g}).",
        "",
        "| lr | initial loss | final loss | vs others | largest rise | spikes | grad-norm ratio |"
        + (" held-out loss |" if from_start else "") + " stable |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: |" + (" ---: |" if from_start else "") + " --- |",
    ]
    for trial in result["trials"]:
        if trial.get("skipped"):
            lines.append(f"| {trial['learning_rate']:g} |" + " - |" * (7 if from_start else 6)
                         + f" {trial['unstable_reasons'][0]} |")
            continue
        verdict = "yes" if trial["stable"] else f"no: {', '.join(trial['unstable_reasons'])}"
        cells = [f"{trial['learning_rate']:g}", format_optional(trial["initial_loss"]),
                 format_optional(trial["final_loss"]), format_optional(trial["final_vs_reference"], "+.3f"),
                 format_optional(trial["largest_rise"], ".2f"), str(trial["spikes"]),
                 format_optional(trial["grad_norm_ratio"], ".2f"),
                 *([format_optional(trial.get("held_out_loss"))] if from_start else []), verdict]
        lines.append(f"| {' | '.join(cells)} |")
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


def _window_text(result: dict) -> str:
    windows = {trial["window"] for trial in result["trials"] if "window" in trial}
    return "/".join(str(window) for window in sorted(windows)) or "?"


def _paired(result: dict) -> int:
    return sum(bool(trial.get("paired")) for trial in result["trials"])


def _fmt_params(num_parameters) -> str:
    return "? parameters" if num_parameters is None else f"{num_parameters / 1e6:.1f}M parameters"


def plot_sweep(result: dict, path: str) -> str:
    """Loss and grad norm per step, one line per rate, and (when the trials were compared) each rate's loss minus
    the per-step median of the trials, the residuals the rates were judged on; unstable rates dashed, the warm-up
    end marked."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    reference = result.get("reference_loss")
    panels = 3 if reference else 2
    figure = Figure(figsize=(5.5 * panels, 4.0), layout="constrained")
    FigureCanvasAgg(figure)
    loss_ax, grad_ax = figure.add_subplot(1, panels, 1), figure.add_subplot(1, panels, 2)
    axes = [(loss_ax, "training loss (nats/token)"), (grad_ax, "gradient norm")]
    if reference:
        residual_ax = figure.add_subplot(1, panels, 3)
        residual_ax.axhline(0.0, color="gray", linewidth=0.8)
        axes.append((residual_ax, "loss - per-step median of the trials"))
    ran = [trial for trial in result["trials"] if not trial.get("skipped")]
    for index, trial in enumerate(ran):
        curve = trial["curve"]
        style = {"color": f"C{index % 10}", "linewidth": 1.2, "linestyle": "-" if trial["stable"] else "--",
                 "label": f"{trial['learning_rate']:g}" + ("" if trial["stable"] else " (unstable)")}
        loss_ax.plot(*_points(curve["step"], curve["loss"]), **style)
        grad_ax.plot(*_points(curve["step"], curve["grad_norm"]), **style)
        if reference and trial.get("paired"):
            residuals = [None if loss is None else loss - ref for loss, ref in zip(curve["loss"], reference)]
            residual_ax.plot(*_points(curve["step"], residuals), **{**style, "linewidth": 0.8, "alpha": 0.7})
    # A diverged trial's loss would squash the others: the axis ends a little above the highest first loss.
    starts = [trial["start_loss"] for trial in ran if trial.get("start_loss") is not None]
    lows = [v for trial in ran for v in trial["curve"]["loss"] if v is not None]
    if starts and lows:
        loss_ax.set_ylim(min(lows) - 0.1, max(starts) + 0.5)
    if any(v is not None and v > 0 for trial in ran for v in trial["curve"]["grad_norm"]):
        grad_ax.set_yscale("log")
    for ax, label in axes:
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


# ----------------------------------------------------------------------------- progress of a running sweep


def write_progress(output_dir: str, settings: dict, start_held_out: float | None, trials: list[dict]) -> str:
    """What a sweep has finished so far: the held-out loss of its start (None: no start, or not trained yet) and
    its trials as run (before the judgement against each other), with the settings they were run with."""
    return write_json(os.path.join(output_dir, PROGRESS_FILE), {
        "format_version": FORMAT_VERSION, "settings": settings, "start_held_out_loss": start_held_out,
        "trials": trials})


def read_progress(output_dir: str, settings: dict) -> dict | None:
    """The progress an earlier run of the same sweep left in `output_dir` (None where there is none). ValueError
    naming the differing settings where it was run with others."""
    path = os.path.join(output_dir, PROGRESS_FILE)
    if not os.path.isfile(path):
        return None
    fix = f"remove {path} (or pass --overwrite_output_dir true) to start the sweep afresh"
    progress = load_manifest(path, ("format_version", "settings", "start_held_out_loss", "trials"), FORMAT_VERSION,
                             not_found=fix, fix=fix)
    check_same_run(f"{path}: this --output_dir holds part of a sweep", progress["settings"], settings,
                   f"Rerun with the same settings to resume it; or {fix}, or choose another --output_dir.")
    return progress


def remove_progress(output_dir: str) -> None:
    path = os.path.join(output_dir, PROGRESS_FILE)
    if os.path.exists(path):
        os.remove(path)


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
