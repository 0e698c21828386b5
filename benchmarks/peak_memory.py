"""What is live on the GPU at a training step's peak: the blocks allocated during one steady step, summed by where
in the code they were allocated, or by their size.

`PeakSnapshot` is a Trainer callback: for step `step` (counted from 0; after the warm-up, compilation included) it
records the CUDA caching allocator's history (`torch.cuda.memory._record_memory_history`); when the step ends,
`peak_composition` replays the trace: the allocated bytes through the step, the moment of their maximum and the
blocks live at that moment, summed by site (the innermost frame of this project's code, with the innermost Python
frame where that is another file: a compiled graph's generated code, torch's checkpoint), or, recorded without stack
traces (`context=None`), by block size, which names most tensors of a step (N x H bf16, V x H fp32, ...). With stack
traces (`context="all"`) the compiled recurrent-3.3b training step failed under torch 2.11 on an H100 (SystemError
from an autograd Function's apply); sizes worked. What was allocated before the step (weights, optimizer state,
anything kept across steps) is one line, less what the step freed of it.

    python3 -m benchmarks.memory_probe --verify --snapshot sizes ...   # the peak of each verified plan's step

The trace holds the allocator's own view, so the sum is allocated bytes (`torch.cuda.max_memory_allocated`), not
the reserved bytes above them (its cache of freed blocks).
"""

import torch
from transformers import TrainerCallback

from trainer_ext.devices import synchronize

MAX_ENTRIES = 1_000_000  # allocator events kept; a 3.3B step makes tens of thousands
TOP_SITES = 24
PROJECT_DIRS = ("hf_recurrent/", "trainer_ext/", "benchmarks/")
GIB = 2**30


def site(frames: list[dict]) -> str:
    """Where a block was allocated: `file:line function` of the innermost frame in this project's code, followed by
    `<- file:function` of the innermost Python frame where that is another one; "unknown" without Python frames."""
    frames = [frame for frame in frames if frame.get("filename", "").endswith(".py")]  # not the C++ ones
    if not frames:
        return "unknown"

    def short(frame, line=True):
        path = frame.get("filename", "?")
        for directory in PROJECT_DIRS:
            if directory in path:
                path = directory + path.split(directory, 1)[1]
                break
        else:
            path = path.rsplit("/", 1)[-1]
        return f"{path}:{frame.get('line', '?')} {frame.get('name', '?')}" if line else f"{path}:{frame.get('name')}"

    own = next((frame for frame in frames if any(d in frame.get("filename", "") for d in PROJECT_DIRS)), None)
    if own is None:
        return short(frames[0])
    return short(own) if own is frames[0] else f"{short(own)} <- {short(frames[0], line=False)}"


def peak_composition(events: list[dict], before: int, top: int = TOP_SITES) -> dict:
    """Replay an allocator trace (`snapshot["device_traces"][device]`) that starts with `before` bytes allocated:
    the peak of allocated bytes in it and the sites of the blocks live at that moment (GiB, largest first)."""

    def replay(stop: int | None):
        live, current, peak, peak_at, freed_before = {}, before, before, -1, 0
        for index, event in enumerate(events if stop is None else events[:stop + 1]):
            action, address = event.get("action"), event.get("addr")
            if action == "alloc":
                live[address] = event
                current += event["size"]
            elif action == "free_requested":  # the program freed it (free_completed follows once its streams are)
                if address in live:
                    current -= live.pop(address)["size"]
                else:  # a block from before the trace
                    current -= event["size"]
                    freed_before += event["size"]
            else:
                continue
            if current > peak:
                peak, peak_at = current, index
        return live, peak, peak_at, freed_before

    _, peak, peak_at, _ = replay(None)
    live, _, _, freed_before = replay(peak_at) if peak_at >= 0 else ({}, None, None, 0)
    sites: dict[str, list[int]] = {}
    for event in live.values():  # without frames (recorded with context=None): by the block's size
        name = site(event["frames"]) if event.get("frames") else f"blocks of {event['size'] / 2**20:.1f} MiB"
        entry = sites.setdefault(name, [0, 0])
        entry[0] += event["size"]
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda item: -item[1][0])
    rest = ranked[top:]
    return {
        "peak_allocated_gib": round(peak / GIB, 3),
        "peak_event": peak_at,
        "events": len(events),
        "held_from_before_gib": round((before - freed_before) / GIB, 3),
        "sites": [{"site": name, "gib": round(size / GIB, 4), "blocks": count} for name, (size, count) in ranked[:top]]
        + ([{"site": f"{len(rest)} other sites", "gib": round(sum(s for _, (s, _) in rest) / GIB, 4),
             "blocks": sum(c for _, (_, c) in rest)}] if rest else []),
    }


class PeakSnapshot(TrainerCallback):
    """Record the allocator's history through training step `step` (0-based) on CUDA and keep its peak's
    composition in `result` (None on a CPU or if training stopped before that step ended)."""

    def __init__(self, step: int, context: str | None = "all"):
        self.step, self.context, self.before, self.result = step, context, None, None

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.step and torch.cuda.is_available():
            synchronize()
            self.before = torch.cuda.memory_allocated()
            torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, context=self.context, stacks="python")

    def on_step_end(self, args, state, control, **kwargs):
        if self.before is not None and self.result is None and state.global_step == self.step + 1:
            synchronize()
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            events = snapshot["device_traces"][torch.cuda.current_device()]
            self.result = peak_composition(events, self.before)
