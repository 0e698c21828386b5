"""The same-data comparison over several seeds: held-out CE per model and depth, mean, standard deviation and spread
over the runs, and the paired differences the depth and comparison claims rest on.

    python -m benchmarks.compare_seeds outputs/compare-seed0 outputs/compare-seed1 outputs/compare-seed2 \
        [--cycle 3] [--output seeds.md]

Each argument is one run's `--output_dir` of `hf-recurrent-compare` (its results.jsonl), the runs differing only in
--seed. The table is taken at --cycle (default: the last cycle every run finished). Paired differences subtract
within a run (same seed: the same data order and initial weights): the recurrent model at each depth against each
baseline, and each evaluated depth against each shallower one.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys


def read_runs(run_dirs: list[str]) -> list[list[dict]]:
    runs = []
    for run_dir in run_dirs:
        path = os.path.join(run_dir, "results.jsonl")
        if not os.path.isfile(path):
            raise SystemExit(f"{path} not found: pass the --output_dir of a finished hf-recurrent-compare run.")
        with open(path) as f:
            runs.append([json.loads(line) for line in f if line.strip()])
    return runs


def summarize(runs: list[list[dict]], cycle: int | None = None) -> tuple[int, dict, dict]:
    """(the cycle, {model: [CE per run]}, {difference: [per run]}) at `cycle` (None: the last one all runs have)."""
    common = set.intersection(*({r["cycle"] for r in run} for run in runs))
    if not common:
        raise SystemExit("The runs share no finished cycle.")
    cycle = max(common) if cycle is None else cycle
    if cycle not in common:
        raise SystemExit(f"--cycle {cycle} is not finished in every run; finished in all: {sorted(common)}.")
    per_run = [{r["model"]: r["ce"] for r in run if r["cycle"] == cycle} for run in runs]
    models = [m for m in per_run[0] if all(m in ce for ce in per_run)]
    ce = {m: [run[m] for run in per_run] for m in models}
    records = [r for r in runs[0] if r["cycle"] == cycle]
    recurrent = sorted((r for r in records if r["kind"] == "recurrent"), key=lambda r: r["num_steps"])
    baselines = [r["model"] for r in records if r["kind"] != "recurrent"]
    differences = {}
    for r in recurrent:
        for baseline in baselines:
            differences[f"{r['model']} minus {baseline}"] = [a - b for a, b in zip(ce[r["model"]], ce[baseline])]
    for i, deeper in enumerate(recurrent):  # every depth against each shallower one (n = 12 minus n = 4, ...)
        for shallower in recurrent[:i]:
            differences[f"{deeper['model']} minus {shallower['model']}"] = [
                a - b for a, b in zip(ce[deeper["model"]], ce[shallower["model"]])]
    return cycle, ce, differences


def _stats(values: list[float]) -> str:
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):+.4f} | {sd:.4f} | {max(values) - min(values):.4f}"


def render(run_dirs: list[str], cycle: int, ce: dict, differences: dict) -> str:
    runs = ", ".join(run_dirs)
    lines = [f"# Same-data comparison over {len(run_dirs)} runs, cycle {cycle}", "", f"Runs: {runs}.", "",
             "| model | CE per run | mean | standard deviation | spread (max - min) |", "|---|---|---:|---:|---:|"]
    lines += [f"| {m} | {', '.join(f'{v:.4f}' for v in values)} | {_stats(values).lstrip('+')} |"
              for m, values in ce.items()]
    lines += ["", "Paired differences (within a run: the same data order and initial weights; negative: the first is "
              "lower):", "", "| difference | per run | mean | standard deviation | spread |", "|---|---|---:|---:|---:|"]
    lines += [f"| {name} | {', '.join(f'{v:+.4f}' for v in values)} | {_stats(values)} |"
              for name, values in differences.items()]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dirs", nargs="+", help="The --output_dir of each run (one per seed).")
    parser.add_argument("--cycle", type=int, default=None, help="Default: the last cycle every run finished.")
    parser.add_argument("--output", default=None, help="Also write the Markdown here.")
    args = parser.parse_args(argv)
    cycle, ce, differences = summarize(read_runs(args.run_dirs), args.cycle)
    text = render(args.run_dirs, cycle, ce, differences)
    if args.output:
        with open(args.output, "w") as f:
            f.write(text)
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
