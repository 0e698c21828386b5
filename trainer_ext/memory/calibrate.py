"""The calibration from probe records, written to a file: the estimator's fit (`estimator.fit_calibration`: peaks,
step times, selective recomputation's terms) and the placement program's measured offload window (`fit_offload`).

Offload's window is the device memory an offloaded step holds beyond what the program removes: the two layer
applications `OffloadActivations` keeps on their way out in forward or fetched ahead in backward, and the allocator's
cache of blocks freed across its two streams. `memory_probe --offload_probes` measures offloaded steps; the window is
the largest number of applications' kept bytes any of them needed (an upper bound, as the peaks): on an H100 the
allocated bytes matched the two applications, the reserved ones needed up to 4.34 by the committed fit's peaks
(recurrent-7b's unique layers at batch 1, 1.3 GiB of allocator cache). With the probes' fully recomputed
references, `fit_offload` also fits offload's fixed time per application.

Records of compiled recurrent steps measured before the training compiled the norms outside its decoder layers
(`trainer_ext.training.compiling`; such records have no `outer_norms` field) held each of those norms' input in fp32
for backward: 4 bytes x tokens x hidden size for every norm call that builds a graph (the prelude's, one per core
step that builds one, the final one), all alive at the end of the forward pass, where a step peaks (at recurrent-3.3b's
cached plan, 6 of the 10 blocks of 128 MiB live at the peak, gone with the change: `benchmarks/peak_memory.py`).
`as_measured_now` takes those bytes off such a record's peak before the fit."""

import json
import math

import numpy as np

from trainer_ext.memory.estimator import CALIBRATION_FILE, DEFAULT_FIT_OBJECTIVE, Calibration, ModelShape, \
    fit_calibration
from trainer_ext.memory.probes import ADJUSTED_OUTER_NORMS, measured, read_probes, steady_step_seconds
from trainer_ext.memory.placement import Program
from trainer_ext.memory.recompute import RecomputeSet


OUTER_NORM_INPUT_BYTES = 4  # fp32, per token and hidden unit, of each eager norm call's saved input


def as_measured_now(record: dict) -> dict:
    """`record` with its peak as the training step holds it now: less the eager outer norms' fp32 inputs (module
    docstring) where it is a compiled recurrent step measured before they were compiled; else `record` itself."""
    config = record.get("config", {})
    if not (record.get("compile") and config.get("n_core_layers") and record.get("peak_reserved_bytes")
            and "outer_norms" not in record):
        return record
    norm_calls = record["graph_steps"] + 2
    saved = OUTER_NORM_INPUT_BYTES * record["batch_size"] * record["seq_len"] * config["hidden_size"] * norm_calls
    return {**record, "peak_reserved_bytes": record["peak_reserved_bytes"] - saved, "outer_norms": ADJUSTED_OUTER_NORMS}


def offloaded(record: dict) -> bool:
    """A probe that trained with some applications offloaded (`RecomputeSet.to_dict` writes `offload` only then, as
    `probes.usable_probes` reads it)."""
    return measured(record) and bool(record.get("recompute_set", {}).get("offload"))


def _pair(record: dict) -> tuple:
    return record["preset"], bool(record.get("compile")), record["batch_size"], record["seq_len"], \
        record.get("device_name")


def reference_of(records: list[dict], index: int) -> dict | None:
    """The `recompute_reference` of the offloaded probe `records[index]` (the same batch recomputed in full, in the
    same process): of those of its card, preset, batch and length, the nearest in the file, since a call's records
    are written together and another day's may pair the same way; None without one."""
    found = [(abs(i - index), i) for i, r in enumerate(records) if measured(r)
             and r.get("recompute") == "recompute_reference" and _pair(r) == _pair(records[index])]
    return records[min(found)[1]] if found else None


def fit_offload(records: list[dict], calibration: Calibration) -> dict | None:
    """The offload window (module docstring) from the offloaded probes in `records`, with `calibration`'s peaks of
    the rest of each step; None without such a probe. Where a probe's `recompute_reference` is in `records` too
    (`reference_of`), also the fixed time an offloaded application adds (the hooks' launches, the copies' and events'
    host work): the least squares over the probes of the ratio of the offloaded step to its reference, predicted
    against measured (a ratio, so that another card than the calibration's can give it)."""
    windows, rows = [], []
    for index, record in enumerate(records):
        if not offloaded(record):
            continue
        program = Program(ModelShape.from_record(record), calibration, record["batch_size"], record["seq_len"],
                          bool(record.get("compile")), record.get("distill_topk", 0), "all")
        placement = RecomputeSet.from_dict(record["recompute_set"])
        peak = program.peak_bytes(placement)
        windows.append((record["peak_reserved_bytes"] - (peak - program.window_bytes)) / program.keep_bytes)
        reference = reference_of(records, index)
        if reference is not None and program.offload_seconds is not None:
            _, seconds, host = program.evaluate(placement)
            count = host / program.keep_bytes  # offloaded applications
            reference_seconds = program.evaluate(RecomputeSet.from_dict(reference["recompute_set"]))[1]
            ratio = steady_step_seconds(record) / steady_step_seconds(reference)
            # predicted ratio with f seconds per application: (seconds + count (f - fixed)) / reference_seconds
            rows.append((count / reference_seconds,
                         (seconds - count * program.offload_fixed_seconds) / reference_seconds - ratio))
    if not windows:
        return None
    fit = {"window_applications": math.ceil(max(windows) * 1000) / 1000, "probes": len(windows)}  # rounded up
    if rows:
        slopes, offsets = np.array(rows).T
        fit["seconds_per_application"] = round(max(-float(slopes @ offsets) / float(slopes @ slopes), 0.0), 6)
        fit["timed_probes"] = len(rows)
    return fit


def write_calibration_from_probes(probes_path: str, output: str | None = None, command: str | None = None,
                                  probe_command: str | None = None, objective: str = DEFAULT_FIT_OBJECTIVE) -> str:
    """Fit the probes of `probes_path` and write the calibration to `output` (default: the package's file)."""
    records = [as_measured_now(record) for record in read_probes(probes_path)]
    calibration = fit_calibration(records, probe_command=probe_command, fit_command=command, source=probes_path,
                                  objective=objective)
    offload = fit_offload(records, calibration)
    if offload is not None:
        calibration.info["offload"] = offload
    output = output or CALIBRATION_FILE
    with open(output, "w") as f:
        json.dump(calibration.to_dict(), f, indent=1)
        f.write("\n")
    return output
