"""Where a training step's GPU time goes: the kernels of a few steady-state steps, by kind, and the time the GPU idled.

`KernelProfile` is a Trainer callback: from step `start_step` (after the warm-up, compilation included) to the end
of training it records the CUDA kernels with torch.profiler and, when training ends, sums their durations by
category (`CATEGORIES`: matrix products, attention, the loss kernels (plain CE and the distillation kernels), the
optimizer's kernels, other elementwise / norm work (compiled or eager), copies). `idle` is the profiled wall time
(synchronized at both ends) the GPU ran no kernel: the host's share (Python, launches, the data loader, waits).
`overlapped_seconds_per_step` is the kernel and copy time that ran beside other kernels (on another stream: offload's
copies beside the compute) beyond the time any of them ran. `idle_gaps` says where in the step it idled: the gaps of at
least `GAP_US` between kernels, summed by the kinds of the kernels on either side (e.g. `loss_kernels -> matmul`:
between the forward's loss and the backward's first product, where the host reads the loss for the stability guard),
with the names of the longest such gap's kernels; `top_kernels` names the kernels that take the most time outside the
matrix products (what a fused kernel could take next). With `host=True` the host's operations are recorded too, and
`host_in_gaps` says what the host was running while the GPU idled in gaps of at least `HOST_GAP_US`: the host events
overlapping them, summed by name (a call and the calls inside it each count the same stretch), the Python side of a step
that starves the GPU. Where the host's launches are recorded, `idle_by_launch` splits all the idle time between
operations, short gaps included, into the host's lateness (the next operation launched only after the GPU ran dry) and
the device's own latency between operations already queued. With them `phases` splits the GPU's operations by the
part of the step that launched them (`phase_of_launches`): forward (the training's thread), backward (autograd's
thread), recompute (a compiled forward that autograd's thread ran: a checkpointed layer run again), optimizer (launched
inside a parameter's gradient accumulation, where the in-backward update hooks run; under DDP they run in its
communication hook and count as backward), transfers (copies between host and device, whoever launched them), with
each phase's operations a step (`phase_operations_per_step`) and its time by kind of kernel (`phase_kinds`). Time on
several streams at once (the updates' own stream, offload's copies) counts in each phase it belongs to.

    python3 -m benchmarks.memory_probe --verify --breakdown ...   # a breakdown of each verified plan's steps
    python3 -m benchmarks.kernel_breakdown PROFILE.json   # a written profile again, from its trace (.trace.json.gz)

The categories come from kernel names: cuBLAS / CUTLASS products, flash / cuDNN attention, our Triton kernels by
their function names (trainer_ext/distill/ce_triton.py, kd_triton.py; trainer_ext/optim/triton_kernels.py),
inductor's fused kernels (`triton_*`). The products of a recomputed forward are not told apart from the first
forward's: the recompute's cost is the executed FLOPs over the model's (`flops_ratio` in the verify output).
"""

import argparse
import bisect
import gzip
import json
import os
import re
import shutil
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
GAP_US = 50.0  # shorter gaps are a launch's latency, not the host falling behind
HOST_GAP_US = 500.0
HOST_CATEGORIES = ("cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver")
TOP_GAPS = 8
TOP_KERNELS = 12


def category(name: str) -> str:
    """The category of a kernel name ("other": eager elementwise, norms, reductions and anything unmatched)."""
    for label, pattern in CATEGORIES:
        if re.search(pattern, name):
            return label
    return "other"


def _busy_and_gaps(kernels: list[tuple[float, float, str]]) -> tuple[float, list[tuple[float, str, str, float]]]:
    """Length of the union of the kernels' (start, end) intervals, and each gap of at least GAP_US in it as
    (microseconds, the name of the kernel that ended last before it, the name of the kernel after it, its start)."""
    busy, end, last, gaps = 0.0, float("-inf"), "", []
    for start, stop, name in sorted(kernels):
        if last and start - end >= GAP_US:
            gaps.append((start - end, last, name, end))
        if stop > end:
            busy += stop - max(start, end)
            end, last = stop, name
    return busy, gaps


def _idle_gaps(gaps: list[tuple[float, str, str, float]], steps: int) -> list[dict]:
    """The gaps summed by the kinds of the kernels around them, longest total first (TOP_GAPS of them)."""
    groups = {}
    for micros, before, after, _ in gaps:
        key = f"{category(before)} -> {category(after)}"
        group = groups.setdefault(key, {"between": key, "seconds_per_step": 0.0, "per_step": 0, "longest": None})
        group["seconds_per_step"] += micros / 1e6 / steps
        group["per_step"] += 1 / steps
        if group["longest"] is None or micros > group["longest"]["micros"]:
            group["longest"] = {"micros": round(micros, 1), "before": before[:80], "after": after[:80]}
    ranked = sorted(groups.values(), key=lambda g: -g["seconds_per_step"])[:TOP_GAPS]
    return [{**g, "seconds_per_step": round(g["seconds_per_step"], 7), "per_step": round(g["per_step"], 2)}
            for g in ranked]


def _host_in_gaps(host: list[tuple[float, float, str]], gaps: list[tuple[float, str, str, float]],
                  steps: int) -> list[dict]:
    """The host events overlapping the gaps of at least HOST_GAP_US, by name: seconds of overlap per step, most
    first (TOP_KERNELS of them)."""
    windows = sorted((start, start + micros) for micros, _, _, start in gaps if micros >= HOST_GAP_US)
    overlap = {}
    for start, stop, name in host:
        for low, high in windows:
            if low >= stop:
                break
            if high > start:
                overlap[name] = overlap.get(name, 0.0) + min(stop, high) - max(start, low)
    ranked = sorted(overlap.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]
    return [{"name": name[:100], "seconds_per_step": round(micros / 1e6 / steps, 7)} for name, micros in ranked]


def _idle_by_launch(ops: list[tuple[float, float, int | None]], launches: dict[int, float], steps: int) -> dict:
    """Every gap between the GPU's operations (start, end, correlation id), short ones included, split by when the
    operation after it was launched: at or after the GPU ran dry (the host was late: Python, launches, waits) or
    before (the device's own latency between queued operations), seconds per step; with the operations a step."""
    late = queued = 0.0
    end = float("-inf")
    for start, stop, correlation in sorted(ops):
        if start > end > float("-inf"):
            launched = launches.get(correlation)
            if launched is not None and launched >= end:
                late += start - end
            else:
                queued += start - end
        end = max(end, stop)
    return {"host_late_seconds_per_step": round(late / 1e6 / steps, 7),
            "queued_seconds_per_step": round(queued / 1e6 / steps, 7),
            "operations_per_step": round(len(ops) / steps, 1)}


FORWARD_REGIONS = re.compile(r"^(CompiledFunction$|Torch-Compiled Region)")
UPDATE_REGIONS = re.compile(r"AccumulateGrad")


def _union(ranges: list[tuple[float, float]]) -> tuple[list[float], list[float]]:
    """Sorted, merged (starts, ends) of the ranges."""
    starts, ends = [], []
    for start, stop in sorted(ranges):
        if ends and start <= ends[-1]:
            ends[-1] = max(ends[-1], stop)
        else:
            starts.append(start)
            ends.append(stop)
    return starts, ends


def _inside(merged: tuple[list[float], list[float]], ts: float) -> bool:
    index = bisect.bisect_right(merged[0], ts) - 1
    return index >= 0 and ts <= merged[1][index]


def phase_of_launches(events: list[dict]) -> dict:
    """Correlation id -> the phase of the step that launched it, from a trace's host events: "backward" where autograd's
    thread launched it (the thread running `autograd::engine` functions), "optimizer" inside that thread's gradient
    accumulation, "recompute" inside a compiled forward on that thread, "forward" on any other thread."""
    backward_threads = {e.get("tid") for e in events
                        if e.get("cat") == "cpu_op" and e.get("name", "").startswith("autograd::engine")}
    ops = [e for e in events if e.get("cat") == "cpu_op" and e.get("tid") in backward_threads and "dur" in e]
    regions = {label: {tid: _union([(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in ops
                                    if e["tid"] == tid and pattern.search(e["name"])])
                       for tid in backward_threads}
               for label, pattern in (("optimizer", UPDATE_REGIONS), ("recompute", FORWARD_REGIONS))}
    phases = {}
    for e in events:
        if e.get("cat") not in ("cuda_runtime", "cuda_driver") or "correlation" not in e.get("args", {}):
            continue
        tid, ts, phase = e.get("tid"), float(e["ts"]), "forward"
        if tid in backward_threads:
            phase = next((label for label in ("optimizer", "recompute") if _inside(regions[label][tid], ts)),
                         "backward")
        phases[e["args"]["correlation"]] = phase
    return phases


def breakdown_from_trace(trace: dict, wall_seconds: float, steps: int) -> dict:
    """Seconds per step by category, their shares of the wall time, the idle share and where the idle gaps lie,
    from a Chrome trace; `host_in_gaps` where it holds host events."""
    seconds, kernels, by_name, host, ops, launches, transfers, labels = {}, [], {}, [], [], {}, set(), []
    for event in trace.get("traceEvents", ()):
        kind = event.get("cat")
        if kind in HOST_CATEGORIES and "dur" in event:
            host.append((float(event["ts"]), float(event["ts"]) + float(event["dur"]), event.get("name", "")))
            if kind in ("cuda_runtime", "cuda_driver") and "correlation" in event.get("args", {}):
                launches[event["args"]["correlation"]] = float(event["ts"])
        if kind not in ("kernel", *COPY_CATEGORIES) or "dur" not in event:
            continue
        ops.append((float(event["ts"]), float(event["ts"]) + float(event["dur"]),
                    event.get("args", {}).get("correlation")))
        name = event.get("name", "")
        if re.search(r"HtoD|DtoH", name):
            transfers.add(len(ops) - 1)
        label = "copies" if kind in COPY_CATEGORIES else category(name)
        labels.append(label)
        seconds[label] = seconds.get(label, 0.0) + event["dur"] / 1e6
        if label != "matmul":
            key = (label, name[:100])
            by_name[key] = by_name.get(key, 0.0) + event["dur"] / 1e6
        kernels.append((float(event["ts"]), float(event["ts"]) + float(event["dur"]), name))
    busy_us, gaps = _busy_and_gaps(kernels)
    busy = busy_us / 1e6
    wall = max(wall_seconds, busy)
    per_step = {label: round(value / steps, 7) for label, value in sorted(seconds.items(), key=lambda kv: -kv[1])}
    shares = {label: round(value / wall, 4) for label, value in seconds.items()}
    shares["idle"] = round(1 - busy / wall, 4) if wall else 0.0
    # Kernels and copies that ran at once (offload's copy streams beside the compute): their time beyond the union.
    overlapped = (sum(stop - start for start, stop, _ in kernels) - busy_us) / 1e6
    result = {"steps": steps, "step_seconds": round(wall / steps, 7) if steps else None,
              "kernel_seconds_per_step": per_step, "overlapped_seconds_per_step": round(overlapped / max(steps, 1), 7),
              "shares": shares, "idle_gaps": _idle_gaps(gaps, max(steps, 1)),
              "top_kernels": [{"kind": label, "name": name, "seconds_per_step": round(value / max(steps, 1), 7)}
                              for (label, name), value in sorted(by_name.items(), key=lambda kv: -kv[1])[:TOP_KERNELS]]}
    if host:
        result["host_in_gaps"] = _host_in_gaps(sorted(host), gaps, max(steps, 1))
    if launches:
        result["idle_by_launch"] = _idle_by_launch(ops, launches, max(steps, 1))
        result.update(_phases(ops, labels, transfers, phase_of_launches(trace["traceEvents"]), wall - busy, steps))
    return result


def _phases(ops: list[tuple[float, float, int | None]], labels: list[str], transfers: set[int], launched: dict,
            idle: float, steps: int) -> dict:
    """The GPU time of each phase of the step (`phase_of_launches`; "transfers": the host-device copies), seconds
    per step, with the GPU's `idle` seconds ("unknown": operations whose launch the trace does not hold); the
    operations a step of each phase; each phase's seconds a step by kind of kernel."""
    seconds = dict.fromkeys(("forward", "recompute", "backward", "optimizer", "transfers"), 0.0)
    count, kinds = dict.fromkeys(seconds, 0), {}
    for index, ((start, stop, correlation), label) in enumerate(zip(ops, labels)):
        phase = "transfers" if index in transfers else launched.get(correlation, "unknown")
        seconds[phase] = seconds.get(phase, 0.0) + (stop - start) / 1e6
        count[phase] = count.get(phase, 0) + 1
        by_kind = kinds.setdefault(phase, {})
        by_kind[label] = by_kind.get(label, 0.0) + (stop - start) / 1e6
    seconds["idle"] = idle
    steps = max(steps, 1)
    return {"phases": {phase: round(value / steps, 7) for phase, value in seconds.items()},
            "phase_operations_per_step": {phase: round(n / steps, 1) for phase, n in count.items()},
            "phase_kinds": {phase: {label: round(value / steps, 7) for label, value in
                                    sorted(by_kind.items(), key=lambda kv: -kv[1])} for phase, by_kind in kinds.items()}}


class KernelProfile(TrainerCallback):
    """Trainer callback: the kernels of steps `start_step` to `stop_step` (default: the end of training), with the
    host's operations where `host`. `result` holds `breakdown_from_trace`'s dictionary once the profile ends; None if
    no step was profiled. `path`: also written there as JSON, with the profiler's tables of the top operations by GPU
    time and by host time beside it (`.txt`) and the whole trace, gzipped (`.trace.json.gz`: every kernel, copy and
    host event of the profiled steps, for questions the summary does not answer)."""

    def __init__(self, start_step: int, stop_step: int | None = None, host: bool = False, path: str | None = None):
        self.start_step, self.stop_step, self.host, self.path, self.result = start_step, stop_step, host, path, None
        self._profiler, self._started, self._steps = None, None, 0

    def on_step_begin(self, args, state, control, **kwargs):
        if state.global_step == self.start_step and self._profiler is None and self.result is None:
            from torch.profiler import ProfilerActivity, profile

            activities = [ProfilerActivity.CUDA] if torch.cuda.is_available() else []
            if self.host or not activities:
                activities.append(ProfilerActivity.CPU)
            synchronize()
            self._profiler = profile(activities=activities)
            self._profiler.__enter__()
            self._started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        if self._profiler is not None:
            self._steps += 1
            if self.stop_step is not None and state.global_step >= self.stop_step:
                self._finish()

    def on_train_end(self, args, state, control, **kwargs):
        self._finish()

    def _finish(self) -> None:
        if self._profiler is None:
            return
        synchronize()
        wall = time.perf_counter() - self._started
        self._profiler.__exit__(None, None, None)
        with tempfile.TemporaryDirectory() as folder:
            trace_path = os.path.join(folder, "trace.json")
            self._profiler.export_chrome_trace(trace_path)
            with open(trace_path) as f:
                trace = json.load(f)
            if self.path:
                with open(trace_path, "rb") as f, gzip.open(os.path.splitext(self.path)[0] + ".trace.json.gz",
                                                            "wb") as out:
                    shutil.copyfileobj(f, out)
        self.result = breakdown_from_trace(trace, wall, max(self._steps, 1))
        if self.path:
            with open(self.path, "w") as f:
                json.dump(self.result, f, indent=1)
            averages = self._profiler.key_averages()
            with open(os.path.splitext(self.path)[0] + ".txt", "w") as f:
                f.write(averages.table(sort_by="self_device_time_total", row_limit=25) + "\n"
                        + averages.table(sort_by="self_cpu_time_total", row_limit=40))
        self._profiler = None


def main(argv=None) -> None:
    """Break a written profile (`KernelProfile`'s `path`) down again from the trace beside it, with today's code; the
    phases printed, the whole result written with --output."""
    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument("profile", help="a profile's JSON; its trace is the .trace.json.gz beside it")
    parser.add_argument("--output", help="where to write the recomputed breakdown (JSON)")
    args = parser.parse_args(argv)
    stem = os.path.splitext(args.profile)[0]
    with open(args.profile) as f:
        written = json.load(f)
    with gzip.open(stem + ".trace.json.gz") as f:
        trace = json.load(f)
    result = breakdown_from_trace(trace, written["step_seconds"] * written["steps"], written["steps"])
    print(json.dumps({key: result.get(key) for key in ("step_seconds", "phases", "phase_operations_per_step",
                                                        "phase_kinds")}))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
