"""Running the learning-rate threshold test's trials: each trial trains a fresh model (from the same initial weights,
or from the weights of `--sweep_start_steps` trained steps) at one constant rate with the production optimizer and
memory settings, one trial at a time, and releases everything it held before the next; `run_sweep` runs them in
ascending order and hands the curves to the pure judgement of trainer_ext/lr_search/finder.py."""

from __future__ import annotations

import dataclasses
import gc
import logging
import time
from collections.abc import Callable, Sequence

import torch
from transformers import PrinterCallback, ProgressCallback

from trainer_ext.lr_search.finder import (
    MIN_PAIRED_TRIALS,
    TRIAL_FAILURES,
    SweepArguments,
    curve_from_log_history,
    finite_or_none,
    judge_trials,
    pick_learning_rate,
    summarize_trial,
)
from trainer_ext.lr_search.sweep_file import FORMAT_VERSION, format_optional, write_sweep
from trainer_ext.training.telemetry import memory_stats
from trainer_ext.training.trainer import RecurrentTrainer

logger = logging.getLogger(__name__)


def trial_arguments(training_args, learning_rate: float, sweep: SweepArguments):
    """The production arguments (optimizer, precision, checkpointing, batch size) with a trial's schedule: constant
    rate after a linear warm-up, a log entry every step, no evaluation, no checkpoints, no hub push, and no
    stability guard: it skips spiking updates and lowers the rate, which would hide what the trial measures."""
    return dataclasses.replace(
        training_args,
        stability_guard=False,
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


def run_trial(make_model: Callable[[], torch.nn.Module], args, train_dataset, trainer_kwargs: dict,
              save_to: str | None = None, eval_dataset=None) -> dict:
    """Train one fresh model; returns its per-step curve, the error that stopped it (if any), its peak reserved
    memory from the start of its training (where RecurrentTrainer.train resets the peaks) through its evaluation and
    of the training alone (`train_peak_reserved_gib`) and, with `eval_dataset`, its loss there at the end
    (`held_out_loss`; None after an error). With `save_to`, the trained model is saved there (`Trainer.save_model`)
    when no error stopped it.

    Nothing of the trial outlives this call: the trainer, model and optimizer are released before it returns.
    """
    on_cuda = args.device.type == "cuda"
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
    train_peak = memory_stats()["peak_reserved_gib"] if on_cuda else None
    held_out = None
    if eval_dataset is not None and error is None:
        held_out = trainer.evaluate(eval_dataset=eval_dataset)["eval_loss"]
    if save_to is not None and error is None:
        trainer.save_model(save_to)  # by the main process; every process then loads it
        trainer.accelerator.wait_for_everyone()
    peak = memory_stats()["peak_reserved_gib"] if on_cuda else None
    release_trial(trainer)
    del trainer, model
    gc.collect()
    if on_cuda:
        torch.cuda.empty_cache()
    return {"curve": curve, "error": error, "seconds": round(time.perf_counter() - start, 2),
            "peak_reserved_gib": peak, "train_peak_reserved_gib": train_peak, "held_out_loss": held_out}


def memory_note(outcome: dict) -> str:
    """", peak X GiB reserved (Y in training)" of a trial's outcome on CUDA; "" elsewhere."""
    if outcome["peak_reserved_gib"] is None:
        return ""
    return (f", peak {outcome['peak_reserved_gib']:.2f} GiB reserved "
            f"({outcome['train_peak_reserved_gib']:.2f} in training)")


def release_trial(trainer) -> None:
    """Free a finished trial's tensors even where a reference to its model or optimizer outlives the trainer: each
    7B trial of a sweep on CUDA (compiled layers) peaked about 14 GiB above the one before (20.8, 36.0, 50.6 GiB
    reserved; 24.75 GiB for each trial with this release, results/training-control), the size of the 7B weights:
    most likely the optimizer's in-backward hooks, which held it and the weights until they reached it by weak
    reference (results/in-process-trainings; not re-measured at 7B). This release stays for any other reference.
    Empties the weights, gradients and optimizer state in place, removes the optimizer's backward hooks and drops
    torch.compile's caches (the next trial builds its own model)."""
    optimizer = getattr(trainer.optimizer, "optimizer", trainer.optimizer)  # under accelerate's wrapper
    if optimizer is not None:
        if hasattr(optimizer, "detach_from_backward"):
            optimizer.detach_from_backward()
        optimizer.state.clear()
    for tensor in [*trainer.model.parameters(), *trainer.model.buffers()]:
        tensor.grad = None
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)
    trainer.accelerator.free_memory()
    torch.compiler.reset()


def run_sweep(
    make_model: Callable[[], torch.nn.Module],
    training_args,
    train_dataset,
    sweep: SweepArguments,
    trainer_kwargs: dict | None = None,
    info: dict | None = None,
    eval_dataset=None,
    start_held_out: float | None = None,
    finished: Sequence[dict] = (),
    on_trial: Callable[[list[dict]], None] | None = None,
) -> dict:
    """Run the trials in ascending rate order, judge them (`judge_trials`), pick a rate; returns the lr_sweep.json
    record. Divergence is judged after each trial on its own (to skip larger rates); the rest once all have run.
    With `eval_dataset` each trial ends with an evaluation there; with `start_held_out` (the held-out loss of the
    trained weights that `make_model` returns) that evaluation judges divergence instead of the trial's own fall.

    `make_model` must return the same initial weights each call (seed it): the trials then differ only in rate.
    `trainer_kwargs` go to each RecurrentTrainer (processing_class, teacher, ...). Writes nothing: `on_trial` gets
    the trials run so far after each new one, and `finished` (what it got in an earlier run) is not run again.
    """
    unset = [name for name in ("learning_rates", "sweep_steps", "sweep_warmup_steps") if getattr(sweep, name) is None]
    if unset:
        raise ValueError(f"SweepArguments {unset} unset: call resolve_sweep_defaults(sweep, num_params) first.")
    trials, diverged_at = [], None
    earlier = {trial["learning_rate"]: trial for trial in finished if not trial.get("skipped")}
    total = len(sweep.learning_rates)
    for index, rate in enumerate(sweep.learning_rates, 1):
        if rate in earlier and not (diverged_at is not None and sweep.skip_after_divergence):
            trials.append(earlier[rate])
            logger.info("[%d/%d] lr %.3g: run before (%s)", index, total, rate,
                        "diverged" if earlier[rate]["diverged"] else "no divergence")
            if earlier[rate]["diverged"] and diverged_at is None:
                diverged_at = rate
            continue
        if diverged_at is not None and sweep.skip_after_divergence:
            trials.append({"learning_rate": rate, "skipped": True, "stable": False,
                           "unstable_reasons": [f"skipped: {diverged_at:g} diverged"]})
            logger.info("[%d/%d] lr %.3g: skipped (lr %.3g diverged)", index, total, rate, diverged_at)
            continue
        outcome = run_trial(make_model, trial_arguments(training_args, rate, sweep), train_dataset,
                            dict(trainer_kwargs or {}), eval_dataset=eval_dataset)
        curve = outcome["curve"]
        summary = summarize_trial(
            curve["loss"], curve["grad_norm"], planned_steps=sweep.sweep_steps, warmup_steps=sweep.sweep_warmup_steps,
            spike_nats=sweep.spike_nats, max_grad_norm_growth=sweep.max_grad_norm_growth, error=outcome["error"],
            held_out=None if start_held_out is None else (start_held_out, outcome["held_out_loss"]))
        trial = {"learning_rate": rate, "skipped": False, **summary, "held_out_loss": outcome["held_out_loss"],
                 "seconds": outcome["seconds"],
                 "peak_reserved_gib": outcome["peak_reserved_gib"],
                 "train_peak_reserved_gib": outcome["train_peak_reserved_gib"],
                 "curve": {key: [finite_or_none(v) if isinstance(v, float) else v for v in values]
                           for key, values in curve.items()}}
        trials.append(trial)
        if on_trial is not None:
            on_trial(trials)
        logger.info("[%d/%d] lr %.3g: loss %s -> %s, %s [%.0fs%s]", index, total, rate,
                    format_optional(trial["initial_loss"]), format_optional(trial["final_loss"]),
                    f"DIVERGED ({', '.join(trial['unstable_reasons'])})" if trial["diverged"] else "no divergence",
                    trial["seconds"], memory_note(trial))
        if trial["diverged"] and diverged_at is None:
            diverged_at = rate
    trials, reference = judge_trials(trials, sweep, start_held_out)
    compared = sum(bool(trial.get("paired")) for trial in trials)
    logger.info("Verdicts (%s):", f"residuals against the per-step median of {compared} trials" if reference
                else "each trial on its own: fewer than %d comparable trials" % MIN_PAIRED_TRIALS)
    for trial in trials:
        if not trial.get("skipped"):
            logger.info("  %s", _progress_line(trial))
    return {
        "format_version": FORMAT_VERSION,
        **(info or {}),
        "sweep": dataclasses.asdict(sweep),
        "start_held_out_loss": start_held_out,
        "trials": trials,
        "reference_loss": reference,
        **pick_learning_rate(trials, sweep.margin),
    }


def _progress_line(trial: dict) -> str:
    verdict = "stable" if trial["stable"] else f"UNSTABLE ({', '.join(trial['unstable_reasons'])})"
    behind = trial.get("final_vs_reference")
    return (f"lr {trial['learning_rate']:.3g}: loss {format_optional(trial['initial_loss'])} -> "
            f"{format_optional(trial['final_loss'])}"
            + ("" if behind is None else f" ({behind:+.3f} against the others)")
            + f", largest rise {format_optional(trial['largest_rise'], '.2f')}, grad-norm ratio "
            f"{format_optional(trial['grad_norm_ratio'], '.2f')}: {verdict}")


def find_learning_rate(make_model, training_args, train_dataset, sweep: SweepArguments,
                       trainer_kwargs: dict | None = None, info: dict | None = None, **resumable) -> dict:
    """run_sweep (`resumable`: its eval_dataset, start_held_out, finished, on_trial), then lr_sweep.json / .md /
    .png into `training_args.output_dir` (main process only)."""
    result = run_sweep(make_model, training_args, train_dataset, sweep, trainer_kwargs, info, **resumable)
    if training_args.process_index == 0:
        paths = write_sweep(training_args.output_dir, result)
        logger.info("Wrote %s", ", ".join(paths))
    return result
