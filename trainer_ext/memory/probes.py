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


def probe_recomputed(record: dict) -> int:
    """Layer applications a probe recomputed: one per prelude / coda layer, the core layers per core step."""
    chosen = record["recompute_set"]
    core_layers = record["config"].get("n_core_layers", 0)  # none in a plain Transformer's record
    return len(chosen["prelude"]) + len(chosen["coda"]) + core_layers * len(chosen["core_steps"])


def steady_step_seconds(record: dict) -> float:
    """Median step time after the warm-up (compilation included): the first step, two when compiled."""
    return statistics.median(record["step_seconds"][2 if record.get("compile") else 1:] or record["step_seconds"])
