"""Optimizer quality at equal token budget: the low-memory optimizer (bf16 weights, in backward) against
torch AdamW with fp32 master weights and HF Adafactor (fp32 weights), through the same run_pretrain path.

    python -m benchmarks.bench_optimizer_quality --data_dir DIR --preset transformer-125m --steps 300 \
        --runs adamw hf_adafactor low_memory low_memory_momentum --learning_rates 1e-3 2e-3

Each run is one optimizer at one learning rate (cosine schedule, 10% warm-up). Prints each run's held-out
loss, and each optimizer at its best learning rate with its gap to AdamW at its best (the issue's bar:
within 1.5% of AdamW, and no worse than HF Adafactor). Finished runs are read back, not redone; each run's
log is <output_dir>/<optimizer>_lr<lr>/train.log. `--parallel N` runs N trainings at once (small models leave
most of a large GPU idle; results do not depend on it).
"""

import argparse
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

RUNS = {
    "low_memory": ["--dtype", "bfloat16", "--optimizer", "low_memory", "--optimizer_momentum", "0"],
    "low_memory_momentum": ["--dtype", "bfloat16", "--optimizer", "low_memory", "--optimizer_momentum", "0.9"],
    "adamw": ["--dtype", "float32", "--optimizer", "hf", "--optim", "adamw_torch", "--max_grad_norm", "1.0"],
    "hf_adafactor": ["--dtype", "float32", "--optimizer", "hf", "--optim", "adafactor", "--max_grad_norm", "1.0"],
}


def eval_loss(out_dir: str) -> float | None:
    path = os.path.join(out_dir, "log_history.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        losses = [e["eval_loss"] for e in json.load(f) if "eval_loss" in e]
    return losses[-1] if losses else None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--preset", default="transformer-125m")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch_size", type=int, default=4)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--learning_rates", type=float, nargs="+", default=[1e-3])
    parser.add_argument("--parallel", type=int, default=1, help="Trainings run at once.")
    parser.add_argument("--output_dir", default=os.path.join("outputs", "bench_optimizer_quality"))
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="More run_pretrain arguments.")
    args = parser.parse_args(argv)

    def train(name: str, lr: float, out_dir: str) -> None:
        command = [
            "--preset", args.preset, "--data_dir", args.data_dir, "--output_dir", out_dir,
            "--max_steps", str(args.steps), "--per_device_train_batch_size", str(args.batch_size),
            "--learning_rate", str(lr), "--warmup_steps", str(max(args.steps // 10, 1)),
            "--lr_scheduler_type", "cosine", "--eval_strategy", "no", "--save_strategy", "no",
            "--save_final", "false", "--logging_steps", str(max(args.steps // 10, 1)),
            "--disable_tqdm", "true", "--max_eval_samples", "1000000", *RUNS[name], *args.extra,
        ]
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "train.log"), "w") as log:
            code = ("from trainer_ext.training.pretrain import parse_pretrain_args, pretrain; "
                    f"pretrain(*parse_pretrain_args({command!r}))")
            subprocess.run([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT)
        print(json.dumps({"optimizer": name, "learning_rate": lr, "eval_loss": eval_loss(out_dir)}), flush=True)

    grid = [(name, lr, os.path.join(args.output_dir, f"{name}_lr{lr:g}"))
            for name in args.runs for lr in args.learning_rates]
    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        list(pool.map(lambda run: train(*run), [run for run in grid if eval_loss(run[2]) is None]))
    runs = [{"optimizer": name, "learning_rate": lr, "eval_loss": eval_loss(out_dir)} for name, lr, out_dir in grid]

    best = {}
    for run in runs:
        if run["eval_loss"] is not None and (run["optimizer"] not in best
                                             or run["eval_loss"] < best[run["optimizer"]]["eval_loss"]):
            best[run["optimizer"]] = run
    reference = best.get("adamw", {}).get("eval_loss")
    for run in best.values():
        if reference:
            run["gap_to_adamw"] = round(run["eval_loss"] / reference - 1, 4)
    results = {"runs": runs, "best": best}
    os.makedirs(args.output_dir, exist_ok=True)
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=2)
    print("best learning rate per optimizer:")
    for name, run in best.items():
        print(f"  {name:20s} lr {run['learning_rate']:g}  eval loss {run['eval_loss']:.4f}  "
              f"gap to AdamW {run.get('gap_to_adamw', float('nan')):+.2%}")
    return results


if __name__ == "__main__":
    main()
