"""Two trainings of one preset compared step by step: the ratio of their tokens/s over the steps both logged.

    python3 -m benchmarks.step_ratio BASELINE_DIR CHANGED_DIR [--skip 5]

Each directory is a `benchmarks.bench_train` output (one `<preset>/log_history.json` per preset) or a run's own
directory. A recurrent preset samples its depth per step from a seed, so two runs of it take the same depths step by
step: the per-step ratio compares like with like, where medians over different depth samples would not. Steps up to
``--skip`` (the warm-up and compilation) are left out, and so is any step whose depth differs between the runs.
Prints, per preset, the median ratio (changed over baseline) with its range and the number of steps compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics


def step_speeds(log_history: list[dict]) -> dict[int, tuple[float, float | None]]:
    """Step -> (tokens/s, sampled depth) of every logged training step."""
    return {row["step"]: (row["tokens_per_second"], row.get("depth"))
            for row in log_history if "tokens_per_second" in row and "step" in row}


def compare(baseline: list[dict], changed: list[dict], skip: int) -> dict:
    """Median, lowest and highest per-step ratio of ``changed``'s tokens/s to ``baseline``'s over the steps after
    ``skip`` that both logged at the same depth."""
    before, after = step_speeds(baseline), step_speeds(changed)
    steps = sorted(s for s in before.keys() & after.keys() if s > skip and before[s][1] == after[s][1])
    if not steps:
        raise ValueError(f"the runs share no logged step after step {skip} at the same depth")
    ratios = [after[s][0] / before[s][0] for s in steps]
    return {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios), "steps": len(steps)}


def _read(path: str) -> list[dict]:
    with open(path) as f:
        return json.load(f)


def _histories(directory: str) -> dict[str, list[dict]]:
    """Preset (or the directory's name) -> log history, from a bench_train output or a run directory."""
    own = os.path.join(directory, "log_history.json")
    if os.path.isfile(own):
        return {os.path.basename(os.path.normpath(directory)): _read(own)}
    found = {name: os.path.join(directory, name, "log_history.json") for name in sorted(os.listdir(directory))}
    histories = {name: _read(path) for name, path in found.items() if os.path.isfile(path)}
    if not histories:
        raise SystemExit(f"error: {directory} holds no log_history.json (a bench_train output or a run's directory)")
    return histories


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("baseline")
    parser.add_argument("changed")
    parser.add_argument("--skip", type=int, default=5, help="Steps left out at the start (default 5).")
    args = parser.parse_args(argv)
    baseline, changed = _histories(args.baseline), _histories(args.changed)
    pairs = [(name, baseline[name], changed[name]) for name in sorted(baseline.keys() & changed.keys())]
    if not pairs and len(baseline) == len(changed) == 1:  # two run directories of different names
        pairs = [("run", *baseline.values(), *changed.values())]
    if not pairs:
        raise SystemExit(f"error: {args.baseline} and {args.changed} share no preset")
    for name, before, after in pairs:
        result = compare(before, after, args.skip)
        print(f"{name}: {result['median']:.3f} ({result['low']:.3f}-{result['high']:.3f}) over {result['steps']} steps")


if __name__ == "__main__":
    main()
