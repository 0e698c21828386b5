"""Where a training step's host time goes besides launching kernels: its waits for the GPU, its batches, its garbage
collections. For host-bound runs (the 125M presets), whose GPU idles while the host catches up.

    python3 -m benchmarks.host_waits --data_dir outputs/data/py [run_pretrain args, e.g. --preset recurrent-125m]

Trains `--max_steps` (16) steps through `scripts/run_pretrain.py` (default: transformer-125m at the comparison's batch
of 32, lr 1e-3; anything given wins) and prints
- the Python stacks of the operations that waited for the GPU in steps `--sync_from` and the one after (CUDA only:
  torch's sync debug mode, which flags explicit waits such as `.item()`, not a driver's implicit ones),
- the time of every batch fetch of the data loader's iterator (sampling, reading, collating, pinning), and of the
  samples' reads (`ShardedTokenDataset.__getitem__`) and the pinning in it,
- every garbage collection over 2 ms (generation, milliseconds, the step under way: 0 before the first).
"""

import argparse
import collections
import gc
import sys
import time
import traceback
import warnings

import torch
import torch.utils.data._utils.pin_memory as torch_pin_memory
import torch.utils.data.dataloader as torch_dataloader
from transformers import TrainerCallback

from scripts import run_pretrain
from trainer_ext.data.shards import ShardedTokenDataset

DEFAULTS = ["--preset", "transformer-125m", "--output_dir", "outputs/host_waits", "--max_steps", "16",
            "--per_device_train_batch_size", "32", "--learning_rate", "1e-3", "--logging_steps", "20",
            "--eval_strategy", "no", "--save_strategy", "no", "--save_final", "false", "--memory_cap_gib", "24",
            "--profile_steps", "0", "--overwrite_output_dir", "true"]


class _SyncWindow(TrainerCallback):
    """Torch's sync debug mode (warn) for two steps from `first` (CUDA only); `step`: the step under way."""

    def __init__(self, first: int):
        self.first = first
        self.step = 0

    def on_step_begin(self, args, state, control, **kwargs):
        self.step = state.global_step + 1
        if torch.cuda.is_available() and state.global_step in (self.first - 1, self.first + 1):
            torch.cuda.set_sync_debug_mode(1 if state.global_step == self.first - 1 else 0)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sync_from", type=int, default=9, help="First step whose waits are recorded.")
    args, rest = parser.parse_known_args(argv)

    waits = collections.Counter()

    def record_wait(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename][-7:]
            waits["\n".join(f"  {f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}" for f in frames)] += 1

    fetches, collections_ = [], []
    parts = {"read": 0.0, "pin": 0.0}  # of the fetch under way
    next_batch, read_sample, pin = (torch_dataloader._BaseDataLoaderIter.__next__, ShardedTokenDataset.__getitem__,
                                    torch_pin_memory.pin_memory)

    def timed(function, part):
        def call(*call_args, **call_kwargs):
            start = time.perf_counter()
            try:
                return function(*call_args, **call_kwargs)
            finally:
                parts[part] += time.perf_counter() - start
        return call

    def timed_next(iterator):
        parts.update(read=0.0, pin=0.0)
        start = time.perf_counter()
        try:
            return next_batch(iterator)
        finally:
            fetches.append((time.perf_counter() - start, parts["read"], parts["pin"]))

    started, window = {}, _SyncWindow(args.sync_from)

    def record_collection(phase, info):
        if phase == "start":
            started["t"] = time.perf_counter()
        else:
            collections_.append((info["generation"], time.perf_counter() - started["t"], window.step))

    def pretrain(*pretrain_args, **kwargs):
        return original_pretrain(*pretrain_args, **kwargs, callbacks=[window])

    original_pretrain = run_pretrain.pretrain
    torch_dataloader._BaseDataLoaderIter.__next__ = timed_next
    ShardedTokenDataset.__getitem__ = timed(read_sample, "read")
    torch_pin_memory.pin_memory = timed(pin, "pin")
    gc.callbacks.append(record_collection)
    run_pretrain.pretrain = pretrain
    try:
        with warnings.catch_warnings():  # restores the filters and showwarning
            warnings.simplefilter("always")
            warnings.showwarning = record_wait
            code = run_pretrain.main(DEFAULTS + rest)
    finally:
        run_pretrain.pretrain = original_pretrain
        torch_dataloader._BaseDataLoaderIter.__next__ = next_batch
        ShardedTokenDataset.__getitem__, torch_pin_memory.pin_memory = read_sample, pin
        gc.callbacks.remove(record_collection)
    print(f"Waits for the GPU in steps {args.sync_from}-{args.sync_from + 1} (count, stack):")
    for stack, count in waits.most_common(12):
        print(count, "\n" + stack)
    print("batch fetch ms (total / reading the samples / pinning):",
          [tuple(round(1e3 * t, 1) for t in fetch) for fetch in fetches])
    print("garbage collections over 2 ms (generation, ms, step):",
          [(generation, round(1e3 * t, 1), step) for generation, t, step in collections_ if t > 0.002])
    return {"exit_code": code, "waits": dict(waits), "fetch_seconds": fetches, "collections": collections_}


if __name__ == "__main__":
    sys.exit(main()["exit_code"])
