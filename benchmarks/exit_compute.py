"""How much core compute early exits leave out of a batched forward without a cache (evaluation, lm-eval's
loglikelihood), counted per token and step, against what each token's own exit would allow.

    python3 -m benchmarks.exit_compute --checkpoints outputs/depth_abl_cpu_0/scaled_init_seed0/final \
        --data_dir outputs/data/kjv --num_steps 12 --thresholds 0.5 0.3 0.1 --batch_size 8 --samples 32

A token that exits after j steps keeps its state, but later steps still read its keys and values: in a causal
forward its computation at step i > j changes as long as a token before it iterates, so what can be left out
exactly is, per row and step, the tokens after the row's last iterating token and the tokens before its first (the
latter only where their keys and values from an earlier step are kept). Per threshold, core layer-token products of
the call as a share of fixed depth n (so 1 / share bounds the speed-up of the core):

- `token`: each token its own steps (sum of `num_steps_used`): what exits save if nothing else had to run;
- `window`: each row, each step, from its first to its last iterating token: exactly computable, ragged;
- `run`: what `adaptive_depth` runs now (the rows with an iterating token, cut after the last such token of any of
  them, the cut rounded up to a multiple of `BLOCK_LENGTH_MULTIPLE` positions), counted by hooks on the core layers
  and checked against the same count from `num_steps_used`.

Held-out CE and its cost against fixed n come with each row. JSON lines on stdout.

`--speed_rounds R` also times the forward with exits against fixed n (`forward_speed`, as `hf-recurrent-evaluate`
does: a warm-up batch, the median of passes over the first 4 batches), in R rounds that alternate the ways a block
may run, so that a shared machine's drift falls on every variant alike: the cut's rounding (`--block_multiples`,
`BLOCK_LENGTH_MULTIPLE`: 1 cuts at the last iterating token) and the attention kernels of a block (`--block_sdpa`:
`no_cudnn`, `BLOCK_SDPA_BACKENDS`' default; `torch`: torch's own choice, cuDNN's on Hopper). One line per threshold
and variant with each round's speed-up and their median.
"""

import argparse
import json
import statistics
import sys

import torch
from transformers import AutoModelForCausalLM

import hf_recurrent  # noqa: F401
from hf_recurrent import adaptive_depth
from hf_recurrent.adaptive_depth import block_length
from trainer_ext.data.shards import ShardedTokenDataset
from trainer_ext.devices import resolve_device, resolve_dtype
from trainer_ext.evaluation.checkpoints import FORWARD_SPEED_BATCHES
from trainer_ext.evaluation.generation import forward_speed


BLOCK_SDPA = {"no_cudnn": adaptive_depth.BLOCK_SDPA_BACKENDS, "torch": None}  # --block_sdpa


def shares(steps_used: torch.Tensor, num_steps: int) -> dict:
    """Core token-steps of each count over fixed depth's (batch x seq x n), from steps used (B, T)."""
    batch, seq = steps_used.shape
    positions = torch.arange(seq)
    token = window = run = 0
    for step in range(1, num_steps + 1):
        iterating = steps_used >= step  # (B, T): the tokens step `step` computes a new state for
        token += int(iterating.sum())
        active = iterating.any(1)
        if not active.any():
            break
        last = torch.where(iterating, positions, -1).amax(1)
        first = torch.where(iterating, positions, seq).amin(1)
        window += int((last - first + 1)[active].sum())
        run += int(active.sum()) * block_length(int(last.max()) + 1, seq)
    fixed = batch * seq * num_steps
    return {"token": token / fixed, "window": window / fixed, "run": run / fixed}


def evaluate(model, batches, num_steps: int, threshold: float | None, counted: list) -> dict:
    nll = tokens = 0.0
    totals = {"token": 0.0, "window": 0.0, "run": 0.0}
    counted.clear()
    for batch in batches:
        with torch.no_grad():
            out = model(batch["input_ids"].to(model.device), num_steps=num_steps, exit_threshold=threshold)
        logits = out.logits.float()
        nll += float(torch.nn.functional.cross_entropy(logits.flatten(0, 1),
                                                       batch["shift_labels"].to(model.device).flatten(),
                                                       reduction="sum"))
        tokens += batch["shift_labels"].numel()
        steps_used = out.num_steps_used.cpu() if threshold is not None else torch.full(batch["input_ids"].shape,
                                                                                        num_steps)
        for key, value in shares(steps_used, num_steps).items():
            totals[key] += value / len(batches)
    fixed = sum(b["input_ids"].numel() for b in batches) * num_steps * len(model.model.core)
    return {"ce": nll / tokens, **{k: round(v, 4) for k, v in totals.items()},
            "run_counted": round(sum(counted) / fixed, 4)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoints", nargs="+", required=True)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--num_steps", type=int, default=12)
    parser.add_argument("--thresholds", type=float, nargs="+", default=[0.5, 0.3, 0.1])
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--samples", type=int, default=32)
    parser.add_argument("--device", default="auto", help="auto: CUDA when available, else the CPU.")
    parser.add_argument("--dtype", default="auto", help="auto: bf16 on CUDA, fp32 elsewhere.")
    parser.add_argument("--speed_rounds", type=int, default=0, help="Rounds of forward timings (0: none).")
    parser.add_argument("--block_multiples", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--block_sdpa", nargs="+", choices=sorted(BLOCK_SDPA), default=["no_cudnn"])
    args = parser.parse_args(argv)
    device = resolve_device(args.device)
    data = ShardedTokenDataset(args.data_dir, split="eval")
    rows = [data[i] for i in range(min(args.samples, len(data)))]
    batches = [{k: torch.stack([r[k] for r in rows[i:i + args.batch_size]]) for k in rows[0]}
               for i in range(0, len(rows), args.batch_size)]
    for path in args.checkpoints:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=resolve_dtype(args.dtype, device)).to(device).eval()
        counted = []
        for layer in model.model.core:
            layer.register_forward_hook(lambda module, inputs, output: counted.append(inputs[0].shape[:2].numel()))
        fixed = evaluate(model, batches, args.num_steps, None, counted)
        for threshold in [None, *args.thresholds]:
            row = fixed if threshold is None else evaluate(model, batches, args.num_steps, threshold, counted)
            print(json.dumps({"checkpoint": path, "num_steps": args.num_steps, "threshold": threshold,
                              "ce_cost": round(row["ce"] - fixed["ce"], 5), **row}), flush=True)
        for row in forward_speedups(model, data, args):
            print(json.dumps({"checkpoint": path, **row}), flush=True)
    return 0


def forward_speedups(model, data, args) -> list[dict]:
    """Per threshold, block multiple and block SDPA kernels: the forward's speed-up over fixed depth in each of
    `args.speed_rounds` rounds (each variant's fixed depth timed in the same round), and the median."""
    timed = dict(num_steps=args.num_steps, batch_size=args.batch_size,
                 batches=min(FORWARD_SPEED_BATCHES, -(-args.samples // args.batch_size)))
    found = {}
    defaults = adaptive_depth.BLOCK_LENGTH_MULTIPLE, adaptive_depth.BLOCK_SDPA_BACKENDS
    try:
        for _ in range(args.speed_rounds):
            for multiple in args.block_multiples:
                for sdpa in args.block_sdpa:
                    adaptive_depth.BLOCK_LENGTH_MULTIPLE = multiple
                    adaptive_depth.BLOCK_SDPA_BACKENDS = BLOCK_SDPA[sdpa]
                    fixed = forward_speed(model, data, **timed)
                    for threshold in args.thresholds:
                        rate = forward_speed(model, data, exit_threshold=threshold, **timed)
                        found.setdefault((threshold, multiple, sdpa), []).append(round(rate / fixed, 3))
    finally:
        adaptive_depth.BLOCK_LENGTH_MULTIPLE, adaptive_depth.BLOCK_SDPA_BACKENDS = defaults
    return [{"threshold": threshold, "block_multiple": multiple, "block_sdpa": sdpa, "forward_speedups": rounds,
             "forward_speedup": statistics.median(rounds)} for (threshold, multiple, sdpa), rounds in found.items()]


if __name__ == "__main__":
    sys.exit(main())
