"""Scaling over the GPUs of one machine: tokens/s, MFU and peak memory on 1, 2, ... N GPUs, each under an emulated
24 GiB cap, with the README's defaults (the memory plan decides the batch per device), data parallel and FSDP2.

    python -m benchmarks.bench_scaleout --data_dir DIR --presets recurrent-3.3b recurrent-7b --steps 12

1 GPU: one process, as `hf-recurrent-pretrain` runs on one card (plus, with --fsdp2_on_one, the FSDP2 path on one
process: the same code as on several, for a correctness and overhead row). N > 1 GPUs, for each of --shardings:
`accelerate launch --config_file trainer_ext/configs/accelerate_{ddp,fsdp2}_<N>x24gb.yaml` (the 4-card files with
--num_processes N above 4), each process capped on its own GPU (benchmarks/capped.py). Every run goes through
scripts/run_pretrain.py, so what is measured is what a user launches.

Each process logs its own tokens/s (its batch); the machine's is N times the main process's. Scaling efficiency:
the N-GPU tokens/s over N times the 1-GPU tokens/s of the same preset. Peak reserved is the main process's GPU.
Rows go to OUTPUT_DIR/results.jsonl and a Markdown table to OUTPUT_DIR/scaleout.md.
"""

import argparse
import json
import os
import subprocess
import sys

from benchmarks.bench_train import run_arguments, summarize

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "trainer_ext", "configs")


def config_file(sharding: str, gpus: int) -> str:
    cards = 2 if gpus <= 2 else 4
    return os.path.join(CONFIGS, f"accelerate_{sharding}_{cards}x24gb.yaml")


def launch_command(sharding: str | None, gpus: int, cap_gib: float, run_args: list[str]) -> list[str]:
    capped = ["-m", "benchmarks.capped", str(cap_gib), "scripts.run_pretrain", *run_args]
    if sharding is None:
        return [sys.executable, *capped]
    return [sys.executable, "-m", "accelerate.commands.launch", "--config_file", config_file(sharding, gpus),
            "--num_processes", str(gpus), *capped]


def runs(gpu_counts: list[int], shardings: list[str], fsdp2_on_one: bool):
    """(gpus, sharding) of every run: the 1-GPU baseline first."""
    yield 1, None
    if fsdp2_on_one:
        yield 1, "fsdp2"
    for gpus in gpu_counts:
        if gpus > 1:
            for sharding in shardings:
                yield gpus, sharding


def table(rows: list[dict]) -> str:
    lines = ["| preset | GPUs | sharding | batch / GPU | tokens/s (all GPUs) | MFU | peak reserved GiB / GPU | "
             "scaling efficiency |", "|---|---:|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['preset']} | {row['gpus']} | {row['sharding']} | - | {row['error']} | - | - | - |")
            continue
        efficiency = row.get("scaling_efficiency")
        lines.append(
            f"| {row['preset']} | {row['gpus']} | {row['sharding']} | {row.get('plan/per_device_train_batch_size')} | "
            f"{row['machine_tokens_per_second']:,.0f} | {row['mfu']:.1%} | {row['peak_reserved_gib']:.2f} | "
            f"{'-' if efficiency is None else f'{efficiency:.2f}'} |")
    return "\n".join(lines)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--presets", nargs="+", default=["recurrent-3.3b", "recurrent-7b"])
    parser.add_argument("--gpus", nargs="+", type=int, default=None,
                        help="GPU counts (default 1, 2, 4, 8 up to the machine's).")
    parser.add_argument("--shardings", nargs="+", choices=["ddp", "fsdp2"], default=["ddp", "fsdp2"])
    parser.add_argument("--fsdp2_on_one", action="store_true", help="Also FSDP2 on one process (the 1-GPU rows).")
    parser.add_argument("--cap_gib", type=float, default=24.0)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=4, help="Logged steps left out of the medians.")
    parser.add_argument("--peak_flops", type=float, default=None, help="For MFU (default: datasheet peak).")
    parser.add_argument("--output_dir", default=os.path.join("outputs", "bench_scaleout"))
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="More run_pretrain arguments.")
    args = parser.parse_args(argv)

    import torch

    available = torch.cuda.device_count()
    if available == 0:
        sys.exit("bench_scaleout: no CUDA device")
    gpu_counts = args.gpus or [n for n in (1, 2, 4, 8) if n <= available]
    too_many = [n for n in gpu_counts if n > available]
    if too_many:
        sys.exit(f"bench_scaleout: --gpus {too_many} but this machine has {available} GPU(s)")
    os.makedirs(args.output_dir, exist_ok=True)
    env = {**os.environ, "NCCL_NVLS_ENABLE": "0"}  # no NVLink multicast: what a PCIe workstation has
    rows, single = [], {}
    for preset in args.presets:
        for gpus, sharding in runs(gpu_counts, args.shardings, args.fsdp2_on_one):
            name = f"{preset}-{gpus}gpu-{sharding or 'single'}"
            out_dir = os.path.join(args.output_dir, name)
            run_args = [*run_arguments(preset, args.data_dir, out_dir, args.steps, args.warmup, args.cap_gib),
                        *(["--peak_flops", str(args.peak_flops)] if args.peak_flops else []), *args.extra]
            print(f"== {name}", flush=True)
            with open(os.path.join(args.output_dir, f"{name}.log"), "w") as log:
                result = subprocess.run(launch_command(sharding, gpus, args.cap_gib, run_args), env=env,
                                        stdout=log, stderr=subprocess.STDOUT)
            base = {"preset": preset, "gpus": gpus, "sharding": sharding or "single"}
            if result.returncode != 0:
                row = {**base, "error": f"exit code {result.returncode} ({name}.log)"}
            else:
                row = {**base, **summarize(preset, out_dir, args.warmup)}
                row["machine_tokens_per_second"] = row["tokens_per_second"] * gpus
                if sharding is None:
                    single[preset] = row["tokens_per_second"]
                if preset in single:
                    row["scaling_efficiency"] = round(row["machine_tokens_per_second"] / (gpus * single[preset]), 3)
            rows.append(row)
            print(json.dumps(row), flush=True)
    with open(os.path.join(args.output_dir, "results.jsonl"), "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    markdown = table(rows)
    with open(os.path.join(args.output_dir, "scaleout.md"), "w") as f:
        f.write(markdown + "\n")
    print(markdown)
    return rows


if __name__ == "__main__":
    main()
