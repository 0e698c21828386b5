"""Which training choices make depth pay: recurrent-125m trained once per arm on the same data, then held-out CE
at several depths.

    python benchmarks/depth_ablation.py --data_dir outputs/data/py --steps 300 --parallel 4 \
        --arms old_init scaled_init zeros_state add_injection full_backprop curriculum deep_supervision

Each arm is run_pretrain with the preset's defaults plus the arm's config overrides and arguments, the same seed,
data order and token budget. Writes <output_dir>/ablation.jsonl (one row per arm) and ablation.md; finished arms
are read back, not retrained. `--parallel N` trains N arms at once (a 125M model leaves a large GPU mostly idle).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from transformers import AutoModelForCausalLM

import hf_recurrent  # noqa: F401
from trainer_ext.data.shards import ShardedTokenDataset
from trainer_ext.evaluation.metrics import evaluate_model

# arm -> (config overrides, more run_pretrain arguments); "scaled_init" is the presets' current default.
ARMS = {
    "old_init": ("init_scheme=normal", []),
    "scaled_init": ("", []),
    "zeros_state": ("state_init=zeros", []),
    "add_injection": ("injection=add", []),
    "full_backprop": ("backprop_depth=null", []),
    "wide_depth": ("depth_sigma=1.0", []),
    "curriculum": ("depth_warmup_steps={curriculum}", []),
    "lr_1e-3": ("", ["--learning_rate", "1e-3"]),
    "zeros_add": ("state_init=zeros,injection=add", []),
    "mean_12": ("mean_recurrence=12,backprop_depth=6", []),
    # Depth beyond 4 bought nothing in every arm above: train deeper, as Huginn does (mean 32, gradients through 8).
    "mean_16_k8": ("mean_recurrence=16,backprop_depth=8", []),
    "mean_32_k8": ("mean_recurrence=32,backprop_depth=8", []),  # Huginn's own depths
    # The same means with gradients through 4 steps: what the depth buys without the longer backward.
    "mean_16_k4": ("mean_recurrence=16,backprop_depth=4", []),
    "mean_32_k4": ("mean_recurrence=32,backprop_depth=4", []),
    "mean_64_k4": ("mean_recurrence=64,backprop_depth=4", []),
    "fixed_12": ("depth_distribution=fixed,mean_recurrence=12,backprop_depth=6", []),
    # The loss on 4 depths of each step (evenly spaced among the steps with gradients, the last included), as Ouro's
    # expected loss over steps: every step's state is asked to be readable, and later ones to improve on it.
    "deep_supervision": ("", ["--depth_supervision", "4"]),
    "deep_supervision_linear": ("", ["--depth_supervision", "4", "--depth_supervision_weights", "linear"]),
    "mean_16_k8_deep_supervision": ("mean_recurrence=16,backprop_depth=8", ["--depth_supervision", "4"]),
    "mean_32_k4_deep_supervision": ("mean_recurrence=32,backprop_depth=4", ["--depth_supervision", "4"]),
    # Ouro's learned exit: the expected loss over depths (the gate on every step), minus an entropy term (exit_gate.py).
    "exit_gate": ("exit_gate=true", []),
    "mean_32_k4_exit_gate": ("mean_recurrence=32,backprop_depth=4,exit_gate=true", []),
    # The state's start and the prelude's injection on the deep candidate (tried at a mean of 8 on the GPU before).
    "mean_32_k4_zeros_state": ("mean_recurrence=32,backprop_depth=4,state_init=zeros", []),
    "mean_32_k4_add_injection": ("mean_recurrence=32,backprop_depth=4,injection=add", []),
}


def arm_overrides(arm: str, args) -> str:
    """The arm's config overrides after --config_overrides (the base of every arm; the arm's own keys win)."""
    merged = {}
    for text in (args.config_overrides, ARMS[arm][0].format(curriculum=args.steps // 2)):
        for item in filter(None, (text or "").split(",")):
            key, _, value = item.partition("=")
            merged[key.strip()] = value.strip()
    return ",".join(f"{key}={value}" for key, value in merged.items())


def train(arm: str, args, out_dir: str) -> float:
    extra = ARMS[arm][1]
    overrides = arm_overrides(arm, args)
    command = [
        sys.executable, "-m", "scripts.run_pretrain", "--preset", args.preset, "--data_dir", args.data_dir,
        "--output_dir", out_dir, "--max_steps", str(args.steps), "--per_device_train_batch_size",
        str(args.batch_size), "--learning_rate", str(args.learning_rate), "--warmup_steps", str(args.warmup_steps),
        "--lr_scheduler_type", "cosine", "--eval_strategy", "no", "--save_strategy", "no",
        "--logging_steps", "25", "--disable_tqdm", "true", "--max_eval_samples", "64", "--seed", str(args.seed),
        "--report_to", "none", *(["--config_overrides", overrides] if overrides else []), *extra,
        "--overwrite_output_dir", "true",  # only unfinished arms are trained; train.log is already in out_dir
    ]
    os.makedirs(out_dir, exist_ok=True)
    start = time.perf_counter()
    with open(os.path.join(out_dir, "train.log"), "w") as log:
        code = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT).returncode
    if code != 0:
        print(f"{arm}: run_pretrain exited {code}; see {out_dir}/train.log", flush=True)
    return time.perf_counter() - start


def evaluate_arm(arm: str, args, out_dir: str, seconds: float | None) -> dict:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = AutoModelForCausalLM.from_pretrained(os.path.join(out_dir, "final"), dtype=torch.bfloat16
                                                 if device == "cuda" else torch.float32).to(device)
    dataset = ShardedTokenDataset(args.data_dir, "eval")
    if len(dataset) > args.eval_samples:
        dataset = torch.utils.data.Subset(dataset, range(args.eval_samples))
    row = {"arm": arm, "overrides": arm_overrides(arm, args), "extra": " ".join(ARMS[arm][1]),
           "seed": args.seed, "steps": args.steps, "train_seconds": None if seconds is None else round(seconds, 1)}
    with open(os.path.join(out_dir, "log_history.json")) as f:
        history = json.load(f)
    row["tokens_per_second"] = max((e.get("tokens_per_second", 0) for e in history), default=None)
    row["grad_norm_first"] = next((e["grad_norm"] for e in history if "grad_norm" in e), None)
    # The trainer's count (hf_recurrent.flops_per_token at each step's depth, extra readouts of deep supervision in).
    row["train_flops"] = next((e["total_flos"] for e in reversed(history) if "total_flos" in e), None)
    for depth in args.depths:
        row[f"ce_n{depth}"] = round(evaluate_model(model, dataset, num_steps=depth, batch_size=16,
                                                   progress=False)["ce"], 4)
    del model
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--preset", default="recurrent-125m")
    parser.add_argument("--arms", nargs="+", choices=list(ARMS), default=list(ARMS))
    parser.add_argument("--config_overrides", default="",
                        help="Config overrides of every arm (k=v,...), before the arm's own, e.g. "
                             "mean_recurrence=8,backprop_depth=4 to give the debug preset recurrent-125m's depths.")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--learning_rate", type=float, default=3e-4)
    parser.add_argument("--warmup_steps", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--depths", type=int, nargs="+", default=[1, 4, 12])
    parser.add_argument("--eval_samples", type=int, default=256)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--output_dir", default=os.path.join("outputs", "depth_ablation"))
    args = parser.parse_args()

    runs = {arm: os.path.join(args.output_dir, f"{arm}_seed{args.seed}") for arm in args.arms}
    os.makedirs(args.output_dir, exist_ok=True)

    def run(arm: str) -> dict | None:
        out = runs[arm]
        done = os.path.isfile(os.path.join(out, "final", "config.json"))
        seconds = None if done else train(arm, args, out)
        if not os.path.isfile(os.path.join(out, "final", "config.json")):
            return None
        row = evaluate_arm(arm, args, out, seconds)
        print(json.dumps(row), flush=True)  # as soon as an arm is done: a long sweep shows partial results
        with open(os.path.join(args.output_dir, "ablation.jsonl"), "a") as f:
            f.write(json.dumps(row) + "\n")
        return row

    with ThreadPoolExecutor(max_workers=args.parallel) as pool:
        rows = [row for row in pool.map(run, args.arms) if row is not None]
    depth_columns = [f"ce_n{d}" for d in args.depths]
    lines = ["| arm | overrides | " + " | ".join(f"CE n = {d}" for d in args.depths)
             + " | first - last | tokens/s | training FLOPs |",
             "|---|---|" + "---:|" * (len(args.depths) + 3)]
    for row in rows:
        gain = row[depth_columns[0]] - row[depth_columns[-1]]
        lines.append(f"| {row['arm']} | {row['overrides'] or '-'} {row['extra']} | "
                     + " | ".join(f"{row[c]:.3f}" for c in depth_columns) + f" | {gain:+.3f} | "
                     f"{row['tokens_per_second'] or 0:,.0f} | {row.get('train_flops') or 0:.3g} |")
    with open(os.path.join(args.output_dir, "ablation.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if len(rows) == len(runs) else 1


if __name__ == "__main__":
    raise SystemExit(main())
