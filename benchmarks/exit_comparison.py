"""Learned exit gate against the state criterion: steps saved per nat lost, and what the gate costs to train.

    python -m benchmarks.exit_comparison --seeds 0 1 2      # the debug preset on the embedded corpus, CPU
    python -m benchmarks.exit_comparison --seeds 0 1 2 --config_overrides mean_recurrence=8,backprop_depth=4

For each seed, the `debug` preset is trained twice with the Quickstart's schedule (240 steps of 8 x 256 tokens, lr 3e-3,
30 warm-up steps, cosine), the same seed and data order: `plain` (today's loss at the sampled depth) and `gate`
(`--config_overrides exit_gate=true`: Ouro's expected loss over depths, trainer_ext/training/exit_gate.py; entropy
weight `--entropy_weight`). Each model is then evaluated on the held-out split (full forward passes, CE in nats per
token) at fixed depths 1..n_max (n_max: the trained config's mean_recurrence) and with adaptive depth at n_max: the
state criterion on both models, the gate criterion on the gate model, at several thresholds. Per row: mean core steps
per token, CE, the CE cost against the same model at the fixed depth n_max, and steps saved per nat lost (n_max - mean
steps) / CE cost (blank where the cost is <= 0: nothing lost). Training cost: seconds per optimizer step from the
trainer's own `train_seconds` between its first and last log (steps 20 to 240), gate over plain.

Writes <output_dir>/results.jsonl (one row per seed, model and setting), training logs under <output_dir>/<arm>_seed<s>
and a table per seed and a summary over seeds in results.md. Finished trainings are read back, not retrained.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from transformers import AutoModelForCausalLM

import hf_recurrent  # noqa: F401
from trainer_ext.data.prepare import DEFAULT_OUTPUT_DIR, PrepareDataArguments, prepare
from trainer_ext.data.shards import ShardedTokenDataset
from trainer_ext.evaluation.metrics import evaluate_model

ARMS = {"plain": "", "gate": "exit_gate=true"}


def train(arm: str, seed: int, args, out_dir: str) -> None:
    overrides = ",".join(filter(None, [args.config_overrides, ARMS[arm]]))
    command = [
        sys.executable, "-m", "scripts.run_pretrain", "--preset", "debug", "--data_dir", args.data_dir,
        "--output_dir", out_dir, "--max_steps", str(args.steps), "--per_device_train_batch_size", str(args.batch_size),
        "--learning_rate", str(args.learning_rate), "--warmup_steps", str(args.warmup_steps),
        "--lr_scheduler_type", "cosine", "--eval_strategy", "no", "--save_strategy", "no", "--logging_steps", "20",
        "--disable_tqdm", "true", "--seed", str(seed), "--report_to", "none", "--overwrite_output_dir", "true",
        "--exit_gate_entropy_weight", str(args.entropy_weight),
        *(["--config_overrides", overrides] if overrides else []),
    ]
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "train.log"), "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        raise SystemExit(f"{arm} seed {seed}: run_pretrain exited {code}; see {out_dir}/train.log")


def seconds_per_step(out_dir: str) -> float:
    """Steady state: the trainer's `train_seconds` from the first logged step to the last (start-up and the first
    steps left out)."""
    with open(os.path.join(out_dir, "log_history.json")) as f:
        logged = [e for e in json.load(f) if "loss" in e and "train_seconds" in e]
    first, last = logged[0], logged[-1]
    return (last["train_seconds"] - first["train_seconds"]) / (last["step"] - first["step"])


def evaluate(model, dataset, n_max: int, criterion: str | None, threshold: float | None) -> dict:
    start = time.perf_counter()
    result = evaluate_model(model, dataset, num_steps=n_max, batch_size=16, progress=False,
                            exit_threshold=threshold, exit_criterion=criterion)
    return {"ce": result["ce"], "mean_steps": result.get("mean_steps_used", n_max),
            "eval_seconds": round(time.perf_counter() - start, 2)}


def evaluate_arm(arm: str, seed: int, args, out_dir: str) -> list[dict]:
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "final")).eval()
    n_max = model.config.mean_recurrence
    dataset = ShardedTokenDataset(args.data_dir, "eval")
    base = {"seed": seed, "model": arm, "seconds_per_step": round(seconds_per_step(out_dir), 4)}
    rows = [dict(base, criterion="fixed", threshold=None, **evaluate(model, dataset, n, None, None))
            for n in range(1, n_max + 1)]
    fixed = rows[-1]["ce"]
    settings = [("state", t) for t in args.state_thresholds]
    if arm == "gate":
        settings += [("gate", t) for t in args.gate_thresholds]
    for criterion, threshold in settings:
        rows.append(dict(base, criterion=criterion, threshold=threshold,
                         **evaluate(model, dataset, n_max, criterion, threshold)))
    for row in rows:
        row["n_max"] = n_max
        row["ce_cost"] = row["ce"] - fixed
        saved = n_max - row["mean_steps"]
        row["steps_saved_per_nat"] = saved / row["ce_cost"] if row["ce_cost"] > 0 else None
    return rows


def setting(row: dict) -> str:
    return f"{row['model']} / {row['criterion']}" + ("" if row["threshold"] is None else f" {row['threshold']:g}")


def table(rows: list[dict]) -> str:
    """Mean over seeds (± standard deviation where there are several) per model, criterion and threshold."""
    groups = {}
    for row in rows:
        name = f"{row['model']} / fixed n = {row['mean_steps']}" if row["criterion"] == "fixed" else setting(row)
        groups.setdefault(name, []).append(row)
    lines = ["| model / criterion threshold | mean core steps | held-out CE | CE cost vs fixed n_max | "
             "steps saved per nat lost | seeds |", "|---|---:|---:|---:|---:|---:|"]

    def spread(values, digits):
        mean = statistics.fmean(values)
        return f"{mean:.{digits}f}" + (f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")

    for name, group in groups.items():
        ratios = [r["steps_saved_per_nat"] for r in group]
        ratio = spread(ratios, 1) if all(r is not None for r in ratios) else "- (no CE lost in " + \
            f"{sum(r is None for r in ratios)} of {len(ratios)})"
        lines.append(f"| {name} | {spread([r['mean_steps'] for r in group], 2)} | "
                     f"{spread([r['ce'] for r in group], 4)} | {spread([r['ce_cost'] for r in group], 4)} | "
                     f"{ratio} | {len(group)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=DEFAULT_OUTPUT_DIR, help="prepared shards (default: the embedded "
                                                                        "corpus, prepared there if missing)")
    parser.add_argument("--config_overrides", default="", help="Config overrides of both models (k=v,...), e.g. "
                        "mean_recurrence=8,backprop_depth=4 for recurrent-125m's depths (steps without gradients).")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--warmup_steps", type=int, default=30)
    parser.add_argument("--entropy_weight", type=float, default=0.05)
    parser.add_argument("--state_thresholds", type=float, nargs="+", default=[0.3, 0.1, 0.03])
    parser.add_argument("--gate_thresholds", type=float, nargs="+", default=[0.5, 0.7, 0.9, 0.99])
    parser.add_argument("--output_dir", default=os.path.join("outputs", "exit_comparison"))
    args = parser.parse_args()
    if not os.path.isfile(os.path.join(args.data_dir, "manifest.json")):
        prepare(PrepareDataArguments(output_dir=args.data_dir))
    os.makedirs(args.output_dir, exist_ok=True)
    rows = []
    for seed in args.seeds:
        for arm in ARMS:
            out_dir = os.path.join(args.output_dir, f"{arm}_seed{seed}")
            if not os.path.isfile(os.path.join(out_dir, "final", "config.json")):
                train(arm, seed, args, out_dir)
            arm_rows = evaluate_arm(arm, seed, args, out_dir)
            rows += arm_rows
            for row in arm_rows:
                print(json.dumps(row), flush=True)
    with open(os.path.join(args.output_dir, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    cost = [statistics.fmean(r["seconds_per_step"] for r in rows if r["model"] == arm and r["seed"] == seed)
            for seed in args.seeds for arm in ARMS]
    ratios = [gate / plain for plain, gate in zip(cost[::2], cost[1::2])]
    summary = (f"{table(rows)}\n\nSeconds per training step, plain / gate, per seed: "
               + ", ".join(f"{p:.3f} / {g:.3f}" for p, g in zip(cost[::2], cost[1::2]))
               + f"; gate over plain: {', '.join(f'{r:.2f}x' for r in ratios)}\n")
    with open(os.path.join(args.output_dir, "results.md"), "w") as f:
        f.write(summary)
    print(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
