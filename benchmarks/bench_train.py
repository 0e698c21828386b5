"""Training throughput and peak memory under an emulated memory cap (e.g. a 24 GiB card on a larger GPU).

    python -m benchmarks.bench_train --data_dir DIR --presets recurrent-3.3b recurrent-7b --cap_gib 24 --steps 8

Each preset runs in its own process (clean peak-memory counters) through the same path as a real run:
scripts/run_pretrain.py with RecurrentTrainer, the low-memory optimizer in backward and the defaults: no batch
size unless --batch_size is given, so on CUDA the memory plan for --cap_gib decides it (and the recompute set).
The cap is `torch.cuda.set_per_process_memory_fraction(cap / total)`, set before anything is allocated.
Prints one row per preset: median tokens/s and MFU after warm-up, peak reserved GiB, first and last loss; each
run's whole output is also written, as it comes, to OUTPUT_DIR/train_PRESET.log.
Every step is logged unless --log_every says otherwise: each log line waits for the GPU (the Trainer reads the loss),
and the host's logging then runs while the GPU idles; the defaults log every 20 steps. With --log_every k the medians
are over windows of k steps.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.capped import set_memory_cap


def child(cap_gib: float, run_args: list[str], profile_path: str | None = None, deadline: float | None = None) -> None:
    """One benchmark run in this process, under the cap; with `deadline` (a `time.time()`) training stops after the
    first step that ends past it, and the run evaluates and writes its log history as after its last step."""
    set_memory_cap(cap_gib)
    from transformers import TrainerCallback

    from trainer_ext.run.pretrain import parse_pretrain_job, pretrain

    class StopAtDeadline(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if time.time() >= deadline and not control.should_training_stop:
                print(f"step {state.global_step}: the benchmark's deadline has passed; training stops", flush=True)
                control.should_training_stop = True

    callbacks = [StopAtDeadline()] if deadline is not None else []
    if profile_path:  # steps 7-10: the kernels by kind, where the GPU idled and what the host ran meanwhile
        from benchmarks.kernel_breakdown import KernelProfile

        callbacks.append(KernelProfile(start_step=6, stop_step=10, host=True, path=profile_path))
    pretrain(parse_pretrain_job(run_args), callbacks=callbacks or None)


def run_logged(command: list[str], log_path: str) -> int:
    """Run `command` with its output (stderr joined to stdout) passed through and written to `log_path` line by line
    as it comes, so that a run stopped from outside (a time limit) leaves there how far it got; its exit code."""
    with open(log_path, "w") as log, subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                      text=True, errors="replace",
                                                      env={**os.environ, "PYTHONUNBUFFERED": "1"}) as run:
        for line in run.stdout:
            sys.stdout.write(line)
            log.write(line)
            log.flush()
        return run.wait()


def rise_over_running_min(losses: list[float], start: int, window: int = 1) -> float:
    """Largest amount by which the loss (averaged over `window` steps) rises above its running minimum, counted
    from step `start` on: a spike of the training curve in nats."""
    smooth = [sum(losses[max(0, i - window + 1):i + 1]) / len(losses[max(0, i - window + 1):i + 1])
              for i in range(len(losses))]
    lowest, rise = float("inf"), 0.0
    for i, value in enumerate(smooth):
        lowest = min(lowest, value)
        if i >= start:
            rise = max(rise, value - lowest)
    return round(rise, 4)


def first_after(entries: list[dict], step: int) -> int:
    """Index of the first log entry after `step` (the warm-up's last): rises are counted from there on, over the
    minimum of all entries before."""
    return next((i for i, e in enumerate(entries) if e.get("step", i + 1) > step), len(entries))


def summarize(preset: str, out_dir: str, warmup: int, spike_from: int = 0) -> dict:
    with open(os.path.join(out_dir, "log_history.json")) as f:
        history = json.load(f)
    logs = [e for e in history if "loss" in e and "tokens_per_second" in e]
    evaluated = [e for e in history if "eval_loss" in e]
    evals = [e["eval_loss"] for e in evaluated]
    if not logs:  # e.g. a profiled run whose --log_every exceeds its steps: the profile is its result
        return {"preset": preset, "error": "no log line with a speed (the compile warm-up's steps and --log_every)"}
    losses = [e["loss"] for e in logs]
    # The steps after the first `warmup` that report a speed (a log line covers the steps since the one before it)
    steady = [e for e in logs if e.get("step", 0) >= logs[0].get("step", 0) + warmup] or logs
    row = {
        "preset": preset,
        "steps": len(logs),
        "last_step": logs[-1].get("step"),
        "tokens_per_second": round(statistics.median(e["tokens_per_second"] for e in steady), 1),
        "mfu": round(statistics.median(e.get("mfu", float("nan")) for e in steady), 4),
        # A recurrent run's figures depend on the depths its steps drew (seeded: the same in every run of a preset):
        # their mean beside the preset's says whether the timed steps stand for it.
        "depth_mean": round(statistics.mean(e["depth"] for e in steady), 3)
        if all("depth" in e for e in steady) else None,
        "peak_reserved_gib": max(e.get("peak_reserved_gib", 0) for e in logs),
        "peak_allocated_gib": max(e.get("peak_allocated_gib", 0) for e in logs),
        "loss_first": logs[0]["loss"],
        "loss_last": logs[-1]["loss"],
        "eval_loss": evals[-1] if evals else None,
        "grad_norm_first": logs[0].get("grad_norm"),
        "grad_norm_max": max((e.get("grad_norm") or 0) for e in logs),
        "loss_rise_over_min": rise_over_running_min(losses, first_after(logs, spike_from)),
        "loss_rise_over_min_10": rise_over_running_min(losses, first_after(logs, spike_from), window=10),
        # The held-out curve (with --eval_strategy steps): a spike of the model, not of the batches drawn.
        "eval_rise_over_min": rise_over_running_min(evals, first_after(evaluated, spike_from)) if evals else None,
    }
    row.update({k: v for e in logs for k, v in e.items() if k.startswith("profile/")})
    plan_path = os.path.join(out_dir, "memory_plan.json")  # written where the memory plan applied
    if os.path.exists(plan_path):
        with open(plan_path) as f:
            plan = json.load(f)
        row.update({f"plan/{k}": plan.get(k) for k in ("per_device_train_batch_size", "recompute_description",
                                                       "predicted_peak_gib", "measured_peak_gib",
                                                       "training_peak_gib")})
    return row


def run_arguments(preset: str, data_dir: str | None, out_dir: str, steps: int, warmup: int, cap_gib: float,
                  batch_size: int | None = None, log_every: int = 1) -> list[str]:
    """run_pretrain arguments of one benchmark run: a schedule under which the loss moves within a few steps (lr
    1e-3, constant, no warm-up), a log line every `log_every` steps, nothing saved. No batch size unless given: then
    the defaults decide it, on CUDA the memory plan for `cap_gib`."""
    return [
        "--preset", preset, "--output_dir", out_dir, "--max_steps", str(steps),
        *(["--data_dir", data_dir] if data_dir else []),
        *(["--per_device_train_batch_size", str(batch_size)] if batch_size is not None else []),
        "--memory_cap_gib", str(cap_gib), "--per_device_eval_batch_size", "1", "--max_eval_samples", "4",
        "--logging_steps", str(log_every), "--eval_strategy", "no", "--save_strategy", "no", "--save_final", "false",
        "--warmup_steps", "0", "--lr_scheduler_type", "constant", "--learning_rate", "1e-3",
        "--profile_steps", str(warmup),
    ]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--presets", nargs="+", default=["recurrent-3.3b", "recurrent-7b"])
    parser.add_argument("--cap_gib", type=float, default=24.0)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3, help="Logged steps left out of the medians.")
    parser.add_argument("--log_every", type=int, default=1,
                        help="Steps per log line (the defaults: 20); the medians are then over windows of this many "
                             "steps. 1: every step's speed and loss (the spikes' figures need them).")
    parser.add_argument("--spike_from", type=int, default=0,
                        help="Count loss rises over the running minimum at the steps after this one (the warm-up's last).")
    parser.add_argument("--batch_size", type=int, default=None,
                        help="Per-device batch size (default: not given, so the defaults decide: on CUDA the memory "
                             "plan for --cap_gib, with torch.compile).")
    parser.add_argument("--peak_flops", type=float, default=None, help="For MFU (default: datasheet peak).")
    parser.add_argument("--output_dir", default=os.path.join("outputs", "bench_train"))
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="More run_pretrain arguments.")
    parser.add_argument("--profile", action="store_true",
                        help="Steps 7-10 of each preset profiled: the breakdown of benchmarks/kernel_breakdown.py "
                             "with the host's operations in the GPU's idle gaps (profile_PRESET.json, in the row as "
                             "kernel_breakdown) and the profiler's tables (profile_PRESET.txt).")
    args = parser.parse_args(argv)

    os.makedirs(args.output_dir, exist_ok=True)
    rows = []
    for preset in args.presets:
        out_dir = os.path.join(args.output_dir, preset)
        run_args = [
            *run_arguments(preset, args.data_dir, out_dir, args.steps, args.warmup, args.cap_gib, args.batch_size,
                           args.log_every),
            "--bf16", "true", *(["--peak_flops", str(args.peak_flops)] if args.peak_flops else []), *args.extra,
        ]
        profile_path = os.path.join(args.output_dir, f"profile_{preset}.json") if args.profile else None
        code = f"from benchmarks.bench_train import child; child({args.cap_gib!r}, {run_args!r}, {profile_path!r})"
        returncode = run_logged([sys.executable, "-c", code], os.path.join(args.output_dir, f"train_{preset}.log"))
        if returncode != 0:
            rows.append({"preset": preset, "error": f"exit code {returncode}"})
            continue
        rows.append(summarize(preset, out_dir, args.warmup, args.spike_from))
        if profile_path and os.path.exists(profile_path):
            with open(profile_path) as f:
                rows[-1]["kernel_breakdown"] = json.load(f)
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(rows, f, indent=2)
    for row in rows:
        print(json.dumps(row))
    return rows


if __name__ == "__main__":
    main()
