"""How much of a training curve's "spike" the order of its batches explains: the largest rise of the smoothed
training loss over its running minimum (benchmarks.bench_train's measure), observed, against the same measure over
the same per-step losses with their deviations from the trend put in random orders.

With shuffled batches a stable model's per-step deviations from its trend come from the batches drawn, in a random
order: the observed rise is then one draw of this null distribution. A burst of the model itself (a rise over a
stretch of steps, whatever the batches) lies in its far tail. The trend is the centred running median of 51 steps:
a rise that lasts longer than about half of that is part of the trend, kept in every order, and not told apart here
(the held-out curve shows those).

    python -m benchmarks.spike_null results/training-control/run8/log_history_recurrent-7b_defaults_seed1.json \
        --spike_from 100
"""

import argparse
import json
import random
import statistics

from benchmarks.bench_train import first_after, rise_over_running_min


def running_median(values: list[float], window: int) -> list[float]:
    half = window // 2
    return [statistics.median(values[max(0, i - half):i + half + 1]) for i in range(len(values))]


def spike_null(losses: list[float], start: int, window: int = 10, trend_window: int = 51, draws: int = 2000,
               seed: int = 0) -> dict:
    """The observed rise (`window`-step mean over its running minimum from index `start` on) and its quantiles
    over `draws` orders of the deviations from the trend after `start` (the warm-up's steps stay where they are)."""
    trend = running_median(losses, trend_window)
    deviations = [loss - level for loss, level in zip(losses[start:], trend[start:])]
    generator = random.Random(seed)
    null = []
    for _ in range(draws):
        generator.shuffle(deviations)
        shuffled = losses[:start] + [level + d for level, d in zip(trend[start:], deviations)]
        null.append(rise_over_running_min(shuffled, start, window))
    null.sort()
    observed = rise_over_running_min(losses, start, window)
    return {
        "window": window, "observed": observed,
        "null_median": round(null[len(null) // 2], 4), "null_p90": round(null[int(0.9 * len(null))], 4),
        "null_p99": round(null[int(0.99 * len(null))], 4),
        "share_of_null_at_or_above_observed": round(sum(v >= observed for v in null) / len(null), 4),
        "per_step_sd_after_start": round(statistics.pstdev(deviations), 4),
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("log_histories", nargs="+", help="Trainer log_history.json files (training loss every step).")
    parser.add_argument("--spike_from", type=int, default=100, help="The warm-up's last step.")
    parser.add_argument("--windows", type=int, nargs="+", default=[10])
    parser.add_argument("--draws", type=int, default=2000)
    args = parser.parse_args(argv)
    rows = []
    for path in args.log_histories:
        with open(path) as f:
            logs = [e for e in json.load(f) if "loss" in e and "eval_loss" not in e]
        losses = [e["loss"] for e in logs]
        for window in args.windows:
            row = {"log_history": path, **spike_null(losses, first_after(logs, args.spike_from), window,
                                                     draws=args.draws)}
            print(json.dumps(row))
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
