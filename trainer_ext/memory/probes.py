"""Probe records: the JSON lines `benchmarks.memory_probe` (and `benchmarks.run_records`) write, one measured training
step configuration each, and which of them the calibration's fit can use."""

import json
import os
import statistics

PROBE_COMMAND = ("python3 -m benchmarks.memory_probe --presets recurrent-125m recurrent-1b recurrent-3.3b "
                 "recurrent-7b transformer-125m --output probes.jsonl --max_seconds 450")


def read_probes(path: str) -> list[dict]:
    """The probe records of a JSON-lines file, or ValueError naming the file."""
    if not os.path.isfile(path):
        raise ValueError(f"Probe file {path} not found; measure probes with `{PROBE_COMMAND}`.")
    records = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if line.strip():
                try:
                    records.append(json.loads(line))
                except json.JSONDecodeError as error:
                    raise ValueError(f"{path} line {number} is not JSON ({error}).") from error
    return records


def default_allocator(settings: str) -> bool:
    """Whether allocator `settings` (`trainer_ext.devices.allocator_settings`) keep the blocks the fit measured."""
    return "expandable_segments:true" not in settings.replace(" ", "").lower()


def measured(record: dict) -> bool:
    """Whether a probe record ran (status ok) with memory figures (a CUDA probe) and a step after its warm-up."""
    return (record.get("status") == "ok" and bool(record.get("peak_reserved_bytes"))
            and len(record.get("step_seconds", ())) >= 2)


def usable_probes(records: list[dict]) -> list[dict]:
    """`measured` records of placements the features carry (keep and recompute: selective recomputation is priced
    apart, by `fit_selective`, and offload has no terms yet), under the allocator's default settings
    (`trainer_ext.devices.allocator_settings`: expandable segments hold other peaks)."""
    def fitted(placement: dict) -> bool:
        return not (placement.get("selective") or placement.get("selective_recompute") or placement.get("offload"))

    return [r for r in records if measured(r) and fitted(r.get("recompute_set", {}))
            and default_allocator(r.get("allocator", ""))]


# The `outer_norms` of a record that `calibrate.as_measured_now` adjusted (measured with the norms outside the decoder
# layers eager).
ADJUSTED_OUTER_NORMS = "eager (adjusted)"


# The `head_grad` of records measured since the loss sums a bf16 head's gradient in bf16 (`chunked_lm_loss`).
HEAD_GRAD_IN_WEIGHT_DTYPE = "summed in the weight's dtype"


def head_copies(record: dict) -> int:
    """How many bf16 V x H tensors more than the step holds now a record's peak held for the head's gradient: records
    without `head_grad` summed it in an fp32 accumulator (2 bytes an entry more: one), and those also without
    `outer_norms` (or adjusted for them, `ADJUSTED_OUTER_NORMS`) held its bf16 cast beside the accumulator (two)."""
    if record.get("head_grad") == HEAD_GRAD_IN_WEIGHT_DTYPE:
        return 0
    return 2 if record.get("outer_norms") in (None, ADJUSTED_OUTER_NORMS) else 1


def probe_recomputed(record: dict, graph_steps: int | None = None) -> int:
    """Layer applications a probe recomputed: one per prelude / coda layer, the core layers per core step (of its
    first `graph_steps` graph-building core steps where given: a sampled depth below the backprop depth builds
    fewer)."""
    chosen = record["recompute_set"]
    core_layers = record["config"].get("n_core_layers", 0)  # none in a plain Transformer's record
    steps = [s for s in chosen["core_steps"] if graph_steps is None or s < graph_steps]
    return len(chosen["prelude"]) + len(chosen["coda"]) + core_layers * len(steps)


def _warm_up(record: dict) -> int:
    """The steps a record's time leaves out (compilation included): the first, two when compiled; none where it has
    no more."""
    skip = 2 if record.get("compile") else 1
    return skip if len(record["step_seconds"]) > skip else 0


def steady_step_seconds(record: dict) -> float:
    """The step time after the warm-up: the median of a probe's steps (every step at its config's mean depth), the mean
    of a training run's (`timed_depths`: each step's sampled depth, whose mean step time is the mean depth's)."""
    timed = record["step_seconds"][_warm_up(record):]
    return statistics.mean(timed) if timed_depths(record) else statistics.median(timed)


def timed_depths(record: dict) -> list[int] | None:
    """The depths a training run's record sampled at the steps `steady_step_seconds` times (`depths`, one per entry of
    `step_seconds`), or None: a probe runs its config's mean depth at every step."""
    depths = record.get("depths")
    return [int(d) for d in depths[_warm_up(record):]] if depths else None
