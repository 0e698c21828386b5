"""A training run's peak as a record of the planner's calibration: the plan it trained with, its measured peak.

    python3 -m benchmarks.run_records --preset recurrent-3.3b --vocab_size 99520 --distill_topk 64 \
        --log results/gpu-2026-12-05/distill-v99520/distill_cache/recurrent-3.3b/log_history.json \
        --calibration old_calibration.json --batch_size 5 --output results/memory-probes/probes.jsonl

Probes train on random tokens at a fixed depth; a training run samples its depth every step and reads real data, and
the allocator's cache grows further (on the H200 at V = 99,520 a cached-teacher plan peaked at 22.36 GiB as a probe
and 22.68 GiB in training). A record of such a run, fitted with the probes, keeps the plans at or above what training
measures. The run's plan is computed again from the preset, the vocabulary and the calibration it was made with
(`--batch_size` checks it is the same plan); its peak is the largest `peak_reserved_gib` the trainer logged, its
step time the logged tokens/s at the depths the steps sampled (a run of 16 steps samples a mean depth of about 10 where
recurrent-3.3b's mean is 12: the fit takes the run's own). The trainer logs these figures as strings in GiB to 2-4
significant digits: the record rounds the peak up by 0.005 GiB so that the rounding never makes it lower than it was.
"""

import argparse
import ast
import json
import os
import sys

from benchmarks.memory_probe import config_fields
from hf_recurrent import presets
from trainer_ext.memory.placement import PLACEMENT_CHOICES
from trainer_ext.memory.plan import PLAN_FILE, plan_for_preset, training_shape
from trainer_ext.memory.probes import HEAD_GRAD_IN_WEIGHT_DTYPE

ROUNDING_GIB = 0.005


def read_log(path: str) -> list[dict]:
    """The trainer's log entries: a JSON list (log_history.json) or one Python dict per line (a console log)."""
    with open(path) as f:
        text = f.read()
    if text.lstrip().startswith("["):
        return json.loads(text)
    return [ast.literal_eval(line) for line in text.splitlines() if line.startswith("{'")]


def run_plan(log: str) -> dict:
    """The run's plan file (beside the log), or {} where there is none."""
    path = os.path.join(os.path.dirname(os.path.abspath(log)), PLAN_FILE)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def run_vocab_size(log: str, given: int | None, run_planned: dict) -> int:
    """The vocabulary the run's model had: its plan file's (`run_planned`, beside the log), which `given` must match;
    else `given`."""
    planned = run_planned.get("vocab_size")
    if planned is None and given is None:
        raise SystemExit(f"--log {log}: no {PLAN_FILE} with the run's vocab_size beside it; give --vocab_size, the "
                         "size of the run's head (its data tokenizer's, padded to a multiple of 64).")
    if planned is not None and given is not None and presets.pad_vocab(given) != planned:
        raise SystemExit(f"--vocab_size {given} is not the run's: its {PLAN_FILE} says {planned}; leave --vocab_size "
                         "out.")
    return planned if planned is not None else given


def run_record(args) -> dict:
    run_planned = run_plan(args.log)
    args.vocab_size = run_vocab_size(args.log, args.vocab_size, run_planned)
    # Plan files before the field were written when the plan kept or recomputed only, unless `all` was asked for; a
    # log without one does not say, and the default placements changed (selective since 2026-12-07).
    if not (args.memory_placements or run_planned):
        raise SystemExit(f"--log {args.log}: no {PLAN_FILE} beside it says the placements the run chose among; give "
                         "--memory_placements: selective for a run with the defaults since 2026-12-07, recompute "
                         "before.")
    placements = args.memory_placements or run_planned.get("placements", "recompute")
    plan = plan_for_preset(args.preset, args.seq_len, args.cap_gib, args.calibration, distill_topk=args.distill_topk,
                           vocab_size=args.vocab_size, rank_fraction=args.optimizer_momentum_rank_fraction,
                           placements=placements)
    if args.batch_size is not None and plan.per_device_train_batch_size != args.batch_size:
        raise SystemExit(f"--calibration {args.calibration} plans batch {plan.per_device_train_batch_size}, the run "
                         f"trained at --batch_size {args.batch_size}: give the calibration the run was planned with.")
    planned_state = run_planned.get("per_rank_fixed_gib", {}).get("optimizer_state")
    if planned_state is not None and abs(planned_state - plan.fixed_gib["optimizer_state"]) > 1e-3:
        raise SystemExit(f"The run's optimizer state ({planned_state:g} GiB, its {PLAN_FILE}) is not the "
                         f"{plan.fixed_gib['optimizer_state']:g} GiB of --optimizer_momentum_rank_fraction "
                         f"{args.optimizer_momentum_rank_fraction}: give the fraction the run trained with (1: full "
                         "momentum).")
    entries = [e for e in read_log(args.log) if "peak_reserved_gib" in e]
    if not entries:
        raise SystemExit(f"--log {args.log} has no peak_reserved_gib entries: give the trainer's log of the run.")
    timed = [e for e in entries if "tokens_per_second" in e]
    if len(timed) < 2:  # the fit leaves out records of fewer (`usable_probes`)
        raise SystemExit(f"--log {args.log} has {len(timed)} steps with tokens_per_second; a record needs 2 steps.")
    config = presets.get(args.preset, args.vocab_size)
    shape = training_shape(config, rank_fraction=args.optimizer_momentum_rank_fraction)
    tokens = plan.per_device_train_batch_size * args.seq_len
    return {
        "preset": args.preset, "source": "training run", "log": args.log, "seq_len": args.seq_len,
        "batch_size": plan.per_device_train_batch_size, "recompute": "plan", "recompute_set": plan.recompute.to_dict(),
        "compile": plan.torch_compile, "distill": bool(args.distill_topk), "distill_topk": args.distill_topk,
        "vocab_size": config.vocab_size, "params": shape.params, "optimizer_state_bytes": shape.optimizer_state_bytes,
        "graph_steps": shape.graph_steps, "num_steps": shape.num_steps,
        "config": config_fields(config), "outer_norms": "compiled" if plan.torch_compile else "eager",
        "head_grad": HEAD_GRAD_IN_WEIGHT_DTYPE,
        "status": "ok", "peak_reserved_bytes": int((max(float(e["peak_reserved_gib"]) for e in entries)
                                                    + ROUNDING_GIB) * 2**30),
        "peak_allocated_bytes": int((max(float(e["peak_allocated_gib"]) for e in entries) + ROUNDING_GIB) * 2**30),
        "step_seconds": [round(tokens / float(e["tokens_per_second"]), 5) for e in timed],
        # each timed step's sampled depth: the fit times the run at their mean (`estimator.record_time_features`)
        "depths": [int(float(e["depth"])) for e in timed] if all("depth" in e for e in timed) else None,
        "device_name": args.device_name, "cap_gib": args.cap_gib, "allocator": args.allocator}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", required=True, choices=presets.NAMES)
    parser.add_argument("--vocab_size", type=int, default=None,
                        help="The run's head size (default: its memory_plan.json's; required without one).")
    parser.add_argument("--distill_topk", type=int, default=0)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--cap_gib", type=float, default=24.0)
    parser.add_argument("--calibration", required=True, help="The calibration the run's plan was made with.")
    parser.add_argument("--batch_size", type=int, default=None, help="The run's batch size (checked).")
    parser.add_argument("--memory_placements", choices=PLACEMENT_CHOICES, default=None,
                        help="The placements the run's plan chose among (default: its plan file's; recompute where "
                             "the plan file predates the field; required without a plan file).")
    parser.add_argument("--optimizer_momentum_rank_fraction", type=float, default=None,
                        help="The run's, if it gave one (1: full momentum; default: the size-based default); checked "
                             "against its plan file's optimizer state.")
    parser.add_argument("--log", required=True, help="log_history.json or the console log of the run.")
    parser.add_argument("--device_name", default="NVIDIA H200")
    parser.add_argument("--allocator", default="", help="The run's PYTORCH_ALLOC_CONF (default: the defaults).")
    parser.add_argument("--output", required=True, help="JSON lines to append the record to.")
    args = parser.parse_args(argv)
    for name in ("calibration", "log"):
        if not os.path.isfile(getattr(args, name)):
            raise SystemExit(f"--{name} {getattr(args, name)} not found.")
    record = run_record(args)
    with open(args.output, "a") as f:
        f.write(json.dumps(record) + "\n")
    print(json.dumps({k: record[k] for k in ("preset", "batch_size", "distill_topk", "vocab_size")}
                     | {"peak_reserved_gib": round(record["peak_reserved_bytes"] / 2**30, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
