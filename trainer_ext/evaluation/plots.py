"""PNG plots of evaluation results: quality and speed against depth, learning curves over token cycles.

matplotlib is imported inside the functions (it is only needed when a plot is drawn), and only its
object-oriented `Figure` API is used: no pyplot, no GUI backend, no global figure state.

Inputs are the plain dicts that the evaluation report (`report.py`) and the comparison pipeline write to JSON:

    depth results      {"model", "kind": "recurrent"|"transformer", "num_steps", "layers", "ce", "top1", "top5",
                        "tokens_per_s_batch_<B>", ...}
    learning records   {"model", "cycle", "tokens_seen", "ce", ...}
"""

from __future__ import annotations

import os
import re
from collections import defaultdict

from trainer_ext.files import atomic_open

SPEED_KEY = re.compile(r"^tokens_per_s_batch_(\d+)$")


def plot_depth_curves(results: list[dict], output_dir: str) -> list[str]:
    """`quality_vs_depth.png` (CE, top-1, top-5) and `speed_vs_depth.png` (tokens/s per batch size).

    The x axis is the unrolled depth in layers (prelude + n x core + coda), so a recurrent model at several
    depths and a Transformer baseline share one axis; a baseline is one marker plus a dashed reference line.
    """
    if not results:
        raise ValueError("plot_depth_curves: no results to plot.")
    for record in results:
        _require(record, ("model", "layers", "ce", "top1", "top5"), "depth result")
    os.makedirs(output_dir, exist_ok=True)
    series = _group(results, "layers")
    paths = []

    figure, axes = _figure(3)
    for ax, key in zip(axes, ("ce", "top1", "top5")):
        _draw(ax, series, "layers", key, _LABELS[key])
    paths.append(_save(figure, os.path.join(output_dir, "quality_vs_depth.png")))

    batches = sorted({int(m.group(1)) for r in results for k in r if (m := SPEED_KEY.match(k))})
    if batches:
        figure, axes = _figure(len(batches))
        for ax, batch in zip(axes, batches):
            _draw(ax, series, "layers", f"tokens_per_s_batch_{batch}", f"tokens/s (batch {batch})")
        paths.append(_save(figure, os.path.join(output_dir, "speed_vs_depth.png")))
    return paths


def plot_learning_curves(
    records: list[dict], path: str, x: str = "tokens_seen", metrics: tuple[str, ...] = ("ce", "top1")
) -> str:
    """One panel per metric (those present in the records), one line per model, against `x` (tokens_seen, cycle or
    train_flops). Records missing a metric are skipped for that panel only; returns `path`."""
    if not records:
        raise ValueError("plot_learning_curves: no records to plot.")
    for record in records:
        _require(record, ("model", x), "learning-curve record")
    present = [m for m in metrics if any(record.get(m) is not None for record in records)]
    if not present:
        raise ValueError(f"plot_learning_curves: no record has any of the metrics {list(metrics)}.")
    series = _group(records, x)
    figure, axes = _figure(len(present))
    for ax, metric in zip(axes, present):
        _draw(ax, series, x, metric, _LABELS.get(metric, metric))
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    return _save(figure, path)


_LABELS = {
    "ce": "cross-entropy (nats/token)",
    "perplexity": "perplexity",
    "top1": "top-1 accuracy",
    "top5": "top-5 accuracy",
    "tokens_seen": "training tokens",
    "train_flops": "training FLOPs",
    "cycle": "cycle",
    "layers": "unrolled depth (layers)",
}


def _require(record: dict, keys, what: str) -> None:
    missing = [k for k in keys if k not in record]
    if missing:
        raise ValueError(f"{what} {record!r} lacks the fields {missing}.")


def _group(records: list[dict], x: str) -> dict[str, list[dict]]:
    """Records per model, sorted along the x axis."""
    groups = defaultdict(list)
    for record in records:
        groups[str(record["model"])].append(record)
    return {model: sorted(rows, key=lambda r: r[x]) for model, rows in groups.items()}


def _figure(panels: int):
    from matplotlib.figure import Figure

    figure = Figure(figsize=(5.0 * panels, 3.8), layout="constrained")
    return figure, [figure.add_subplot(1, panels, i + 1) for i in range(panels)]


def _draw(ax, series: dict[str, list[dict]], x: str, key: str, ylabel: str) -> None:
    for index, (model, rows) in enumerate(series.items()):
        color = f"C{index}"
        rows = [r for r in rows if r.get(key) is not None]
        if not rows:
            continue
        xs = [r[x] for r in rows]
        ys = [r[key] for r in rows]
        if len(rows) == 1 and rows[0].get("kind") == "transformer":
            # A fixed-depth model is one point; the dashed line makes it a reference for every depth.
            ax.axhline(ys[0], color=color, linestyle="--", linewidth=1, alpha=0.7)
            ax.plot(xs, ys, marker="s", linestyle="none", color=color, label=model)
        else:
            ax.plot(xs, ys, marker="o", color=color, label=model)
            for row, x_value, y_value in zip(rows, xs, ys):
                if row.get("num_steps") is not None and x == "layers":
                    ax.annotate(f"n={row['num_steps']}", (x_value, y_value), textcoords="offset points",
                                xytext=(0, 6), ha="center", fontsize="x-small", color=color)
    ax.margins(y=0.15)  # room for the n= labels above the points
    if x == "tokens_seen":  # 200K, 400K, ... instead of 200000 run together
        from matplotlib.ticker import FuncFormatter, MaxNLocator

        ax.xaxis.set_major_locator(MaxNLocator(nbins=6))
        ax.xaxis.set_major_formatter(FuncFormatter(lambda value, _: _short_count(value)))
    ax.set_xlabel(_LABELS.get(x, x))
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")


def _short_count(value: float) -> str:
    for scale, suffix in ((1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(value) >= scale:
            return f"{value / scale:g}{suffix}"
    return f"{value:g}"


def _save(figure, path: str) -> str:
    """Write via a temporary file and rename, so an interrupted run never leaves a truncated PNG."""
    with atomic_open(path, "wb") as f:
        figure.savefig(f, format="png", dpi=120)
    return path
