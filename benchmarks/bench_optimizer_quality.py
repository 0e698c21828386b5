"""Optimizer quality at equal tokens: the low-memory optimizer (bf16 weights, in backward) against torch AdamW with
fp32 master weights and HF Adafactor (fp32 weights), through the same run_pretrain path, over several seeds.

    python -m benchmarks.bench_optimizer_quality --data_dir DIR --preset transformer-125m --steps 300 \
        --runs adamw_fp32 low_memory low_memory_momentum low_memory_7b --learning_rates 1e-3 2e-3 --seeds 0 1 2

Each run is one configuration at one learning rate and one seed (the seed sets the initial weights, the data order
and the stochastic-rounding bits); every run trains the same number of steps on the same batch shape, so the same
tokens (a run that stopped early is reported and left out of the summary). Each configuration is judged at the
learning rate with the lowest mean held-out loss over the seeds, and reported with its spread over the seeds and its
gap to adamw_fp32; the bar of the 7B-class configuration is within 2% of adamw_fp32 with at most 2 GiB of extra
state for recurrent-7b (`state_gib_recurrent_7b`, from the real tensor shapes).

Writes <output_dir>/results.jsonl (one row per run) and <output_dir>/summary.md. Finished runs are read back, not
redone; each run's log is <output_dir>/<config>_lr<lr>_seed<seed>/train.log. `--parallel N` runs N trainings at
once (small models leave most of a large GPU idle; results do not depend on it). Runs on CPU at a toy size, e.g.
`--preset debug --steps 20 --batch_size 2`.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from trainer_ext.data.shards import read_manifest
from trainer_ext.optim.optimizer import SUBSPACE_MOMENTUM_FRACTION
from trainer_ext.optim.state import state_gib_for_preset

RUNS = {
    "low_memory": ["--dtype", "bfloat16", "--optimizer", "low_memory", "--optimizer_momentum", "0"],
    "low_memory_momentum": ["--dtype", "bfloat16", "--optimizer", "low_memory", "--optimizer_momentum", "0.9",
                            "--optimizer_momentum_rank_fraction", "1"],
    "low_memory_7b": ["--dtype", "bfloat16", "--optimizer", "low_memory", "--optimizer_momentum", "0.9",
                      "--optimizer_momentum_rank_fraction", str(SUBSPACE_MOMENTUM_FRACTION)],
    "adamw_fp32": ["--dtype", "float32", "--optimizer", "hf", "--optim", "adamw_torch", "--max_grad_norm", "1.0"],
    "hf_adafactor": ["--dtype", "float32", "--optimizer", "hf", "--optim", "adafactor", "--max_grad_norm", "1.0"],
}
# low_memory_7b as it was before the update outside the subspace was scaled down (the default since).
RUNS["low_memory_7b_residual_1"] = [*RUNS["low_memory_7b"], "--optimizer_subspace_residual", "1"]
ALIASES = {"adamw": "adamw_fp32"}  # the reference's earlier name
STATE_OF = {"low_memory_7b_residual_1": "low_memory_7b"}  # configurations that keep another's optimizer state
REFERENCE = "adamw_fp32"


def read_run(out_dir: str) -> tuple[float | None, int]:
    """(last held-out loss or None, last logged step) of a finished run."""
    path = os.path.join(out_dir, "log_history.json")
    if not os.path.exists(path):
        return None, 0
    with open(path) as f:
        history = json.load(f)
    losses = [e["eval_loss"] for e in history if "eval_loss" in e]
    return (losses[-1] if losses else None), max((e.get("step", 0) for e in history), default=0)


def summarize(rows: list[dict], seeds: list[int]) -> dict[str, dict]:
    """Per configuration: every learning rate's mean over the seeds, and the best rate's mean and spread.
    Only rates with a finished equal-token run for every seed compete."""
    summary = {}
    for config in dict.fromkeys(row["config"] for row in rows):
        per_lr = {}
        for lr in dict.fromkeys(row["learning_rate"] for row in rows if row["config"] == config):
            losses = [row["eval_loss"] for row in rows if row["config"] == config and row["learning_rate"] == lr
                      and row["eval_loss"] is not None and row["equal_tokens"]]
            per_lr[lr] = losses
        complete = {lr: losses for lr, losses in per_lr.items() if len(losses) == len(seeds)}
        entry = {"mean_by_lr": {lr: statistics.fmean(losses) if losses else None for lr, losses in per_lr.items()},
                 "state_gib_recurrent_7b": next(r["state_gib_recurrent_7b"] for r in rows if r["config"] == config)}
        if complete:
            lr = min(complete, key=lambda rate: statistics.fmean(complete[rate]))
            losses = complete[lr]
            entry.update(best_learning_rate=lr, mean=statistics.fmean(losses), min=min(losses), max=max(losses),
                         std=statistics.stdev(losses) if len(losses) > 1 else 0.0, seeds=len(losses))
        summary[config] = entry
    reference = summary.get(REFERENCE, {}).get("mean")
    for entry in summary.values():
        if reference and "mean" in entry:
            entry["gap_to_adamw_fp32"] = entry["mean"] / reference - 1
    return summary


def markdown(summary: dict[str, dict], args, tokens: int) -> str:
    lines = [f"# Optimizer quality: {args.preset}, {args.steps} steps x {args.batch_size} sequences "
             f"({tokens:,} tokens per run), seeds {' '.join(map(str, args.seeds))}", "",
             "Each configuration at the learning rate with the lowest mean held-out loss over the seeds; spread = "
             "sample standard deviation and range over the seeds. A best rate at the edge of the grid calls for a "
             "wider grid.", "",
             "| config | best lr | mean eval loss | std | min .. max | seeds | gap to adamw_fp32 | "
             "state_gib_recurrent_7b |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for config, entry in summary.items():
        gap = f"{entry['gap_to_adamw_fp32']:+.2%}" if "gap_to_adamw_fp32" in entry else "-"
        if "mean" in entry:
            edge = len(args.learning_rates) > 1 and entry["best_learning_rate"] in (min(args.learning_rates),
                                                                                    max(args.learning_rates))
            best = f"{entry['best_learning_rate']:g}" + (" (grid edge)" if edge else "")
            lines.append(f"| {config} | {best} | {entry['mean']:.4f} | {entry['std']:.4f} | "
                         f"{entry['min']:.4f} .. {entry['max']:.4f} | {entry['seeds']} | {gap} | "
                         f"{entry['state_gib_recurrent_7b']:.3f} |")
        else:
            lines.append(f"| {config} | - | (no learning rate finished every seed) | | | | | "
                         f"{entry['state_gib_recurrent_7b']:.3f} |")
    lines += ["", "Mean held-out loss per learning rate:", "",
              "| config | " + " | ".join(f"lr {lr:g}" for lr in args.learning_rates) + " |",
              "| --- |" + " --- |" * len(args.learning_rates)]
    for config, entry in summary.items():
        means = [entry["mean_by_lr"].get(lr) for lr in args.learning_rates]
        lines.append(f"| {config} | " + " | ".join("-" if m is None else f"{m:.4f}" for m in means) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--preset", default="transformer-125m")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--runs", nargs="+", choices=[*RUNS, *ALIASES], default=list(RUNS))
    parser.add_argument("--learning_rates", type=float, nargs="+", default=[1e-3])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=1, help="Trainings run at once.")
    parser.add_argument("--output_dir", default=os.path.join("outputs", "bench_optimizer_quality"))
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="More run_pretrain arguments.")
    args = parser.parse_args(argv)
    configs = list(dict.fromkeys(ALIASES.get(name, name) for name in args.runs))
    seq_len = read_manifest(args.data_dir)["seq_len"]
    tokens = args.steps * args.batch_size * seq_len
    state_gib = {config: round(state_gib_for_preset(STATE_OF.get(config, config), "recurrent-7b"), 4)
                 for config in configs}

    def train(config: str, lr: float, seed: int, out_dir: str) -> None:
        command = [
            "--preset", args.preset, "--data_dir", args.data_dir, "--output_dir", out_dir, "--seed", str(seed),
            "--max_steps", str(args.steps), "--per_device_train_batch_size", str(args.batch_size),
            "--learning_rate", str(lr), "--warmup_steps", str(max(args.steps // 10, 1)),
            "--lr_scheduler_type", "cosine", "--eval_strategy", "no", "--save_strategy", "no",
            "--save_final", "false", "--overwrite_output_dir", "true",  # only unfinished runs are redone
            "--logging_steps", str(max(args.steps // 10, 1)), "--disable_tqdm", "true", "--max_eval_samples", "1000000",
            *RUNS[config], *args.extra,
        ]
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "train.log"), "w") as log:
            code = ("from trainer_ext.run.pretrain import parse_pretrain_job, pretrain; "
                    f"pretrain(parse_pretrain_job({command!r}))")
            subprocess.run([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)
        print(json.dumps({"config": config, "seed": seed, "learning_rate": lr, "eval_loss": read_run(out_dir)[0]}),
              flush=True)

    grid = [(config, lr, seed, os.path.join(args.output_dir, f"{config}_lr{lr:g}_seed{seed}"))
            for config in configs for lr in args.learning_rates for seed in args.seeds]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        list(pool.map(lambda run: train(*run), [run for run in grid if read_run(run[3])[0] is None]))
    rows = []
    for config, lr, seed, out_dir in grid:
        loss, steps_done = read_run(out_dir)
        rows.append({"config": config, "seed": seed, "learning_rate": lr, "eval_loss": loss,
                     "state_gib_recurrent_7b": state_gib[config], "preset": args.preset, "steps": steps_done,
                     "tokens": steps_done * args.batch_size * seq_len,
                     "equal_tokens": steps_done == args.steps})
    summary = summarize(rows, args.seeds)
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    text = markdown(summary, args, tokens)
    with open(os.path.join(args.output_dir, "summary.md"), "w") as f:
        f.write(text)
    unequal = [row for row in rows if not row["equal_tokens"]]
    if unequal:
        print(f"{len(unequal)} run(s) did not reach {args.steps} steps (left out): "
              + ", ".join(f"{r['config']} lr {r['learning_rate']:g} seed {r['seed']}" for r in unequal))
    print(text, end="")
    return {"runs": rows, "summary": summary}


if __name__ == "__main__":
    main()
