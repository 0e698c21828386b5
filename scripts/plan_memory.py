"""Plan batch size and activation recompute for a memory cap, before training (no GPU needed):

    hf-recurrent-plan-memory --preset recurrent-3.3b --cap_gib 24 --seq_len 2048 [--json]
    hf-recurrent-plan-memory --preset recurrent-7b --cap_gib 24 --num_processes 2 --sharding fsdp2   # per card
    hf-recurrent-plan-memory --preset recurrent-7b --device_profile rtx3090   # a 3090's plan and speed, anywhere

A mixed-integer program picks, per batch size, where each prelude / coda layer and core step keeps what backward
needs (keep, recompute or recompute selectively; with --memory_placements all also offload to pinned host memory
within --memory_host_gib), fastest under a predicted peak reserved memory <= cap - margin; the batch of highest
predicted tokens/s wins. The calibration is an H200's; --device_profile (rtx3090, rtx4090: datasheets; measure: this
card, cached; or a file) scales its step times to the card's bf16 matmul rate and offers offload, priced at its
host-device bandwidth (training offloads only when asked: the last line gives the flags). Re-calibrate on yours:

    python3 -m benchmarks.memory_probe --output probes.jsonl            # on the GPU, a few minutes
    hf-recurrent-plan-memory --calibrate probes.jsonl --calibration my_card.json   # then plan with --calibration
"""

import argparse
import json
import sys

from trainer_ext.memory.calibrate import write_calibration_from_probes
from trainer_ext.memory.device_profile import SPEC_PROFILES, resolve_device_profile
from trainer_ext.memory.estimator import load_calibration
from trainer_ext.memory.placement import HOST_HELP, PLACEMENT_CHOICES, PLAN_PLACEMENTS_HELP
from trainer_ext.memory.plan import DEFAULT_MARGIN_GIB, MAX_BATCH_SIZE, plan_for_preset


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", help="A recurrent preset, e.g. recurrent-3.3b.")
    parser.add_argument("--cap_gib", type=float, default=None,
                        help="Memory of the card, GiB (default: the --device_profile's, else 24).")
    parser.add_argument("--device_profile", default=None,
                        help=f"The card to plan for: {', '.join(SPEC_PROFILES)} (datasheet), measure (this machine's, "
                             "cached) or a profile JSON file (default: the calibration's device).")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--margin_gib", type=float, default=DEFAULT_MARGIN_GIB,
                        help="Kept free below the cap: the CUDA context and the estimate's error.")
    parser.add_argument("--max_batch_size", type=int, default=MAX_BATCH_SIZE)
    parser.add_argument("--optimizer_momentum", type=float, default=None, help="0 plans without momentum.")
    parser.add_argument("--optimizer_momentum_rank_fraction", type=float, default=None)
    parser.add_argument("--torch_compile", choices=("auto", "true", "false"), default="auto",
                        help="auto: on where the calibration measured it faster.")
    parser.add_argument("--distill_topk", type=int, default=0, help="Top-k of a teacher cache in the batch.")
    parser.add_argument("--vocab_size", type=int, default=None, help="Your tokenizer's size (default: the preset's).")
    parser.add_argument("--num_processes", type=int, default=1, help="Processes (GPUs) of the launch; plans one.")
    parser.add_argument("--sharding", default=None,
                        help="ddp (data parallel: torchrun; the default for several processes), fsdp2 "
                             "(accelerate_fsdp2_<N>x24gb.yaml) or none (one process).")
    parser.add_argument("--mixed_precision", default="no",
                        help="accelerate's mixed_precision of an FSDP2 launch (accelerate_fsdp2_<N>x24gb.yaml: no): "
                             "other than no, accelerate keeps the shards as fp32 master weights.")
    parser.add_argument("--memory_host_gib", type=float, default=None, help=HOST_HELP)
    parser.add_argument("--memory_placements", choices=PLACEMENT_CHOICES, default=None, help=PLAN_PLACEMENTS_HELP)
    parser.add_argument("--calibration", default=None,
                        help="Calibration file to use (default: the package's), or to write with --calibrate.")
    parser.add_argument("--calibrate", metavar="PROBES", default=None,
                        help="Fit a calibration from a probe file (benchmarks/memory_probe.py) and write it.")
    parser.add_argument("--json", action="store_true", help="Print the plan as JSON.")
    args = parser.parse_args(argv)
    try:
        if args.calibrate:
            if not args.calibration:
                raise ValueError("--calibrate needs --calibration PATH: where to write the fitted calibration.")
            command = " ".join(["hf-recurrent-plan-memory", *(sys.argv[1:] if argv is None else argv)])
            print(f"Wrote {write_calibration_from_probes(args.calibrate, args.calibration, command=command)}")
            return 0
        if not args.preset:
            raise ValueError("--preset is required, e.g. --preset recurrent-3.3b.")
        compiled = None if args.torch_compile == "auto" else args.torch_compile == "true"
        profile = resolve_device_profile(args.device_profile, args.calibration)
        plan = plan_for_preset(args.preset, args.seq_len, args.cap_gib, args.calibration, args.margin_gib,
                               args.optimizer_momentum, args.optimizer_momentum_rank_fraction, compiled,
                               args.distill_topk, args.max_batch_size, args.num_processes, args.sharding,
                               args.mixed_precision, profile, args.vocab_size, args.memory_host_gib,
                               args.memory_placements)
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(plan.to_dict(), indent=1))
        return 0
    print(f"{args.preset}, {args.seq_len} tokens per sequence, cap {plan.cap_gib:g} GiB:")
    print(f"  --per_device_train_batch_size {plan.per_device_train_batch_size}")
    print("\n".join(f"  {line}" for line in plan.placement_lines()))
    print(f"  torch.compile {'on' if plan.torch_compile else 'off'}")
    # The speed is the calibration's device's, or scaled to the profile's matmul rate (re-calibrating fits a card).
    device = load_calibration(args.calibration).info.get("device_name") or "the calibration's device"
    device = (f"{profile.describe()}, the step times of {device} x {plan.device_profile['step_time_scale']:.3g}"
              if profile else f"{device} (the calibration's device)")
    print(f"  predicted peak reserved {plan.predicted_peak_gib:.2f} GiB; speed on {device}: "
          f"{plan.predicted_tokens_per_second:,.0f} tokens/s ({plan.predicted_step_seconds:.3f} s per step)")
    if plan.sharding:
        print(f"  {plan.describe_processes()}")
        if plan.sharding == "fsdp2" and args.mixed_precision != "no":
            print("  (fp32 master shards of accelerate's mixed precision; mixed_precision: no keeps them bf16)")
    launches = {"ddp": f"torchrun --nproc_per_node {args.num_processes} scripts/run_pretrain.py",
                "fsdp2": f"accelerate launch --config_file trainer_ext/configs/accelerate_fsdp2_2x24gb.yaml "
                         f"--num_processes {args.num_processes} scripts/run_pretrain.py"}
    launch = launches.get(plan.sharding, "hf-recurrent-pretrain")
    print(f"{launch} --preset {args.preset} applies it on such a card (--memory_plan auto, the default on CUDA, "
          f"plans for the memory free when the run starts; add {plan.exact_flags} for exactly this plan"
          + (", offload included: training offloads only when asked" if plan.host_gib else "") + ").")
    return 0


if __name__ == "__main__":
    sys.exit(main())
