"""Throughput, MFU and memory figures, and the synchronized phase profiler of the first training steps."""

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

from trainer_ext.devices import synchronize

# Dense bf16 tensor-core peaks from the vendors' datasheets, FLOP/s. Measured peaks are lower (an H200 gives
# about 780 TFLOP/s on a large matmul); pass `peak_flops` to use a measured figure instead.
_PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "RTX 4090": 165e12,
    "RTX 3090": 71e12,
    "A6000": 155e12,
}


def device_peak_flops() -> float | None:
    """The bf16 peak of the current CUDA device, or None where unknown (CPU included)."""
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, peak in _PEAK_BF16_FLOPS.items():
        if key in name:
            return peak
    return None


def memory_stats() -> dict[str, float]:
    """Peak memory since the last reset, GiB (what counts on a 24 GB card is the peak reserved)."""
    if not torch.cuda.is_available():
        return {}
    gib = 2**30
    return {
        "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / gib, 3),
        "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / gib, 3),
    }


def reset_memory_peaks() -> None:
    """Start memory_stats' peaks from now: a training's logged peaks are its own, not those of an earlier training
    in the same process (the comparison trains both models of every cycle in one)."""
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()


class PhaseProfiler:
    """Times named phases with device synchronization for the first `num_steps` steps, then turns itself off,
    so the steady state runs without the synchronizations that the timing needs."""

    def __init__(self, num_steps: int = 30):
        self.num_steps = num_steps
        self.steps_seen = 0
        self.seconds = defaultdict(float)
        self._last_mark = None

    @property
    def active(self) -> bool:
        return self.steps_seen < self.num_steps

    @contextmanager
    def phase(self, name: str):
        if not self.active:
            yield
            return
        synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            synchronize()
            self.seconds[name] += time.perf_counter() - start

    def mark_step_start(self) -> None:
        """Time since the previous step ended is the wait for data (plus the loop's own bookkeeping)."""
        if self.active and self._last_mark is not None:
            synchronize()
            self.seconds["data_wait"] += time.perf_counter() - self._last_mark

    def mark_step_end(self) -> None:
        if not self.active:
            return
        synchronize()
        self._last_mark = time.perf_counter()
        self.steps_seen += 1

    def breakdown(self) -> dict[str, float]:
        """Share of each phase in the profiled time, e.g. {"profile/forward_share": 0.25, ...}."""
        seconds = dict(self.seconds)
        if "training_step" in seconds:  # the Trainer's step = forward + loss + backward (+ in-backward updates)
            step = seconds.pop("training_step")
            seconds["backward"] = max(step - seconds.get("forward", 0.0) - seconds.get("loss", 0.0), 0.0)
        total = sum(seconds.values()) or 1.0
        shares = {f"profile/{name}_share": round(sec / total, 4) for name, sec in seconds.items()}
        shares["profile/steps"] = self.steps_seen
        return shares
