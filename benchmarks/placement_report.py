"""What the placement probes measured against what the placement program predicted.

    python3 -m benchmarks.placement_report offload.jsonl selective.jsonl [--output placements.md] [--repredict]

Offload (`memory_probe --offload_probes`): per preset, compilation and batch, each offloaded placement's step time
over the same batch fully recomputed in the same process (`recompute_reference`), measured and predicted: the copies
overlap compute as the program assumes where the two ratios agree (issue bar: within 10%); ratios, not seconds, so a
card other than the calibration's can judge the overlap. Selective (`--selective_probes`): the pairs' terms as
`--fit` would store them (`estimator.fit_selective`, against the committed calibration), and offload's device window
likewise (`calibrate.fit_offload`, from the offloaded probes with memory figures). Probes that did not run are listed
with their status and error. The predictions are those each record carries (the calibration of its day);
`--repredict` makes them again with the committed calibration (after a refit), against the records' peaks as the step
holds them now (`calibrate.as_measured_now`).
"""

import argparse
import statistics
import sys

from trainer_ext.memory.calibrate import as_measured_now, fit_offload
from trainer_ext.memory.estimator import GIB, fit_selective, load_calibration
from trainer_ext.memory.probes import read_probes, steady_step_seconds


def repredicted(records: list[dict]) -> list[dict]:
    """The records, those carrying a prediction with it made again by the committed calibration."""
    from benchmarks.memory_probe import predicted_figures

    return [{**r, **predicted_figures(r)} if r.get("predicted_step_seconds") else r for r in records]


def offload_rows(records: list[dict]) -> list[dict]:
    """One row per offloaded probe that ran beside its reference: measured and predicted ratio to it, and peaks."""
    def key(r):
        return r["preset"], bool(r.get("compile")), r["batch_size"], r["seq_len"]

    ran = [r for r in records if r.get("status") == "ok" and r.get("predicted_step_seconds") and r.get("step_seconds")]
    references = {key(r): r for r in ran if r.get("recompute") == "recompute_reference"}
    rows = []
    for r in ran:
        reference = references.get(key(r))
        if reference is None or r is reference:
            continue
        measured = steady_step_seconds(r) / steady_step_seconds(reference)
        predicted = r["predicted_step_seconds"] / reference["predicted_step_seconds"]
        rows.append({"preset": r["preset"], "compile": bool(r.get("compile")), "batch_size": r["batch_size"],
                     "placement": r["recompute"], "measured_ratio": round(measured, 4),
                     "predicted_ratio": round(predicted, 4), "ratio_error": round(predicted / measured - 1, 4),
                     "measured_peak_gib": round(r["peak_reserved_bytes"] / GIB, 3) if r.get("peak_reserved_bytes")
                     else None, "predicted_peak_gib": r.get("predicted_peak_gib")})
    return rows


def failed_rows(records: list[dict]) -> list[dict]:
    """The probes that did not run (out of memory, an error, skipped for time), with the reason each record gives."""
    return [{"preset": r.get("preset", "?"), "compile": bool(r.get("compile")), "batch_size": r.get("batch_size"),
             "placement": r.get("recompute", "?"), "status": r.get("status"),
             "error": " ".join(str(r.get("error") or "").split())[:160]}
            for r in records if r.get("status") != "ok"]


def render(rows: list[dict], selective: dict | None, failed: list[dict] = (), offload: dict | None = None) -> str:
    lines = ["# Placement probes against the program's predictions", "",
             "| preset | compiled | batch | placement | step / recomputed, measured | predicted | error | peak GiB, "
             "measured | predicted |", "|---|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        peak = f"{r['measured_peak_gib']:.2f}" if r["measured_peak_gib"] is not None else "-"
        lines.append(f"| {r['preset']} | {'yes' if r['compile'] else 'no'} | {r['batch_size']} | {r['placement']} | "
                     f"{r['measured_ratio']:.3f} | {r['predicted_ratio']:.3f} | {r['ratio_error']:+.1%} | {peak} | "
                     f"{r['predicted_peak_gib']:.2f} |")
    if rows:
        errors = [abs(r["ratio_error"]) for r in rows]
        lines += ["", f"Step-time ratio error: median {statistics.median(errors):.1%}, largest {max(errors):.1%} "
                      f"over {len(rows)} offloaded probes."]
    if failed:
        lines += ["", f"{len(failed)} probe(s) did not run:", "", "| preset | compiled | batch | placement | status | "
                  "reason |", "|---|---|---:|---|---|---|"]
        lines += [f"| {r['preset']} | {'yes' if r['compile'] else 'no'} | {r['batch_size']} | {r['placement']} | "
                  f"{r['status']} | {r['error'].replace('|', '/')} |" for r in failed]
    lines += ["", "Selective recomputation, the terms `--fit` would store: " + (
        f"{selective['saved_multiple']:.3f} x the analytic saved bytes, {selective['time_fraction']:.3f} of a "
        f"recompute's time, from {selective['pairs']} pair(s)." if selective else "no pairs in these files.")]
    lines += ["", "Offload's device window, as `--fit` would store it: " + (
        f"{offload['window_applications']:.3f} layer applications' kept bytes, from {offload['probes']} probe(s)."
        if offload else "no offloaded probes with memory figures in these files.")]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("probes", nargs="+", help="Probe files (JSON lines) of --offload_probes / --selective_probes.")
    parser.add_argument("--output", default=None, help="Also write the Markdown here.")
    parser.add_argument("--repredict", action="store_true", help="Predict with the committed calibration instead of "
                        "taking the predictions the records carry.")
    args = parser.parse_args(argv)
    try:
        records = [r for path in args.probes for r in read_probes(path)]
    except ValueError as error:
        raise SystemExit(str(error)) from error
    fitted = [as_measured_now(r) for r in records]  # as --fit reads them
    if args.repredict:
        records = repredicted(fitted)
    calibration = load_calibration()
    text = render(offload_rows(records), fit_selective(fitted, calibration), failed_rows(records),
                  fit_offload(fitted, calibration))
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
