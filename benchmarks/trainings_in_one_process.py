"""Memory left behind by each finished training when several run in one process, as the comparison runs both models
of every cycle and the threshold test one model per rate.

    python benchmarks/trainings_in_one_process.py --data_dir outputs/data/py --presets recurrent-125m recurrent-125m

Each training is `hf-recurrent-pretrain`'s (`pretrain()`) with the defaults, `--max_steps` steps, no checkpoints.
After each, one JSON line: the held-out loss and, after a garbage collection, the memory still allocated on the GPU
(on a CPU: the bytes of live tensors of over 1,000 elements) and the training's own peak allocated (the trainer
resets the peak when it starts). A training that frees what it allocated leaves the same figure after every one.
"""

import argparse
import gc
import json

import torch

from trainer_ext.run.pretrain import parse_pretrain_job, pretrain


def left_behind_gib() -> float:
    """GiB still allocated on the GPU, or held by live tensors of over 1,000 elements on a CPU."""
    if torch.cuda.is_available():
        return torch.cuda.memory_allocated() / 2**30
    return sum(o.numel() * o.element_size() for o in gc.get_objects()
               if torch.is_tensor(o) and o.numel() > 1000) / 2**30


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--data_dir", required=True, help="shards of hf-recurrent-prepare-data")
    parser.add_argument("--presets", nargs="+", default=["recurrent-125m", "recurrent-125m"],
                        help="one training per entry, in this order")
    parser.add_argument("--max_steps", type=int, default=20)
    parser.add_argument("--output_dir", default="outputs/trainings_in_one_process")
    args = parser.parse_args(argv)
    on_gpu = torch.cuda.is_available()
    extra = ["--bf16", "true", "--per_device_train_batch_size", "32"] if on_gpu else []
    for index, preset in enumerate(args.presets):
        metrics = pretrain(parse_pretrain_job([
            "--preset", preset, "--data_dir", args.data_dir, "--max_steps", str(args.max_steps),
            "--output_dir", f"{args.output_dir}/{index}", "--overwrite_output_dir", "true", "--save_strategy", "no",
            "--logging_steps", "10", "--max_eval_samples", "16", *extra]))
        gc.collect()
        print(json.dumps({"training": index, "preset": preset, "eval_loss": round(metrics["eval_loss"], 4),
                          "left_behind_gib": round(left_behind_gib(), 3),
                          "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3)
                          if on_gpu else None}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
