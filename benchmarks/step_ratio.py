"""Two trainings of one preset compared step by step: the ratio of their tokens/s over the steps both logged.

    python3 -m benchmarks.step_ratio BASELINE_DIR CHANGED_DIR [--skip 5]

Each directory is a `benchmarks.bench_train` output (one `<preset>/log_history.json` per preset) or a run's own
directory. A recurrent preset samples its depth per step from a seed, so two runs of it take the same depths step by
step: the per-step ratio compares like with like, where medians over different depth samples would not. Steps up to
``--skip`` (the warm-up and compilation) are left out, and so is any step whose depth differs between the runs.
Runs logged every k steps (`bench_train --log_every`) are compared over windows instead: between consecutive steps
both logged, each run's tokens over the seconds its log lines give those steps (a line's tokens/s holds for every step
since the line before it), at the same mean depth.
Prints, per preset, the median ratio (changed over baseline) with its range and the number of steps compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics


def step_speeds(log_history: list[dict]) -> dict[int, tuple[float, float | None]]:
    """Step -> (tokens/s, sampled depth) of every logged training step (a windowed line's: its window's)."""
    return {row["step"]: (row["tokens_per_second"], row.get("depth"))
            for row in log_history if "tokens_per_second" in row and "step" in row}


def _window(speeds: dict[int, tuple[float, float | None]], start: int, end: int) -> tuple[float, float | None]:
    """Tokens/s and mean depth over steps start+1..end, each step taking its log line's figures (the line at or
    after it): the steps over the seconds a token, as the tokens of a step are the same at every step."""
    lines = sorted(speeds)
    steps = [(step, next(line for line in lines if line >= step)) for step in range(start + 1, end + 1)]
    depths = [speeds[line][1] for _, line in steps]
    depth = None if None in depths else sum(depths) / len(depths)
    return len(steps) / sum(1 / speeds[line][0] for _, line in steps), depth


def compare(baseline: list[dict], changed: list[dict], skip: int) -> dict:
    """Median, lowest and highest ratio of ``changed``'s tokens/s to ``baseline``'s per window between consecutive
    steps both logged (a step where both log every step) after ``skip``, at the same depth; with the steps
    compared."""
    before, after = step_speeds(baseline), step_speeds(changed)
    ends = sorted(before.keys() & after.keys())
    ratios, steps = [], 0
    for start, end in zip(ends, ends[1:]):
        if start < skip:
            continue
        (old, old_depth), (new, new_depth) = _window(before, start, end), _window(after, start, end)
        if old_depth == new_depth:
            ratios.append(new / old)
            steps += end - start
    if not ratios:
        raise ValueError(f"the runs share no logged step after step {skip} at the same depth")
    return {"median": statistics.median(ratios), "low": min(ratios), "high": max(ratios), "steps": steps,
            "windows": len(ratios)}


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
        windows = f" in {result['windows']} windows" if result["windows"] != result["steps"] else ""
        print(f"{name}: {result['median']:.3f} ({result['low']:.3f}-{result['high']:.3f}) over {result['steps']} steps"
              f"{windows}")


if __name__ == "__main__":
    main()
