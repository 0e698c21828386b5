"""Where a training step's GPU time goes: the kernels of a few steady-state steps, by kind, and the time the GPU idled.

`KernelProfile` is a Trainer callback: from step `start_step` (after the warm-up, compilation included) to the end
of training it records the CUDA kernels with torch.profiler and, when training ends, sums their durations by
category (`CATEGORIES`: matrix products, attention, the loss kernels (plain CE and the distillation kernels), the
optimizer's kernels, other elementwise / norm work (compiled or eager), copies). `idle` is the profiled wall time
(synchronized at both ends) the GPU ran no kernel: the host's share (Python, launches, the data loader, waits).

    python3 -m benchmarks.memory_probe --verify --breakdown ...   # a breakdown of each verified plan's steps

The categories come from kernel names: cuBLAS / CUTLASS products, flash / cuDNN attention, our Triton kernels by
their function names (trainer_ext/distill/ce_triton.py, kd_triton.py; trainer_ext/optim/triton_kernels.py),
inductor's fused kernels (`triton_*`). The products of a recomputed forward are not told apart from the first
forward's: the recompute's cost is the executed FLOPs over the model's (`flops_ratio` in the verify output).
"""

import json
import os
import re
import tempfile
import time

import torch
from transformers import TrainerCallback

from trainer_ext.devices import synchronize

# (category, pattern of the kernel's name), first match wins.
CATEGORIES = (
    ("loss_kernels", r"^_(ce|lse|grad)_kernel"),
    ("optimizer_kernels", r"^_(stats|scalar|factor|update_sq|momentum|apply|vector)_kernel"),
    ("attention", r"flash|fmha|attention|sdpa"),
    ("matmul", r"gemm|cutlass|nvjet|xmma|wgmma|cublas|splitk|sm\d+_"),
    ("compiled_elementwise", r"^triton_"),
    ("copies", r"memcpy|memset|copy_kernel|Memcpy|Memset"),
)
COPY_CATEGORIES = ("gpu_memcpy", "gpu_memset")


def category(name: str) -> str:
    """The category of a kernel name ("other": eager elementwise, norms, reductions and anything unmatched)."""
    for label, pattern in CATEGORIES:
        if re.search(pattern, name):
            return label
    return "other"


def _busy_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of (start, end) intervals."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def breakdown_from_trace(trace: dict, wall_seconds: float, steps: int) -> dict:
    """Seconds per step by category, their shares of the wall time, and the idle share, from a Chrome trace."""
    seconds, intervals = {}, []
    for event in trace.get("traceEvents", ()):
        kind = event.get("cat")
        if kind not in ("kernel", *COPY_CATEGORIES) or "dur" not in event:
            continue
        label = "copies" if kind in COPY_CATEGORIES else category(event.get("name", ""))
        seconds[label] = seconds.get(label, 0.0) + event["dur"] / 1e6
        intervals.append((float(event["ts"]), float(event["ts"]) + float(event["dur"])))
    busy = _busy_us(intervals) / 1e6
    wall = max(wall_seconds, busy)
    per_step = {label: round(value / steps, 7) for label, value in sorted(seconds.items(), key=lambda kv: -kv[1])}
    shares = {label: round(value / wall, 4) for label, value in seconds.items()}
    shares["idle"] = round(1 - busy / wall, 4) if wall else 0.0
    return {"steps": steps, "step_seconds": round(wall / steps, 7) if steps else None,
            "kernel_seconds_per_step": per_step, "shares": shares}


class KernelProfile(TrainerCallback):
    """Trainer callback: the kernels from `start_step` to the end of training. `result` holds
    `breakdown_from_trace`'s dictionary after training; None if no step was profiled."""

    def __init__(self, start_step: int):
        self.start_step, self.result = start_step, None
        self._profiler, self._started, self._steps = None, None, 0

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.start_step and self._profiler is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else [ProfilerActivity.CPU]
            synchronize()
            self._profiler = profile(activities=activities)
            self._profiler.__enter__()
            self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._profiler is not None:
            self._steps += 1

    def on_train_end(self, args, state, control, **kwargs):
        if self._profiler is None:
            return
        synchronize()
        wall = time.perf_counter() - self._started
        self._profiler.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as folder:
            path = os.path.join(folder, "trace.json")
            self._profiler.export_chrome_trace(path)
            with open(path) as f:
                trace = json.load(f)
        self._profiler = None
        self.result = breakdown_from_trace(trace, wall, max(self._steps, 1))
