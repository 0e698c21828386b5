"""The comparison's results files, views of the evaluation records in the state file (rewritten whole each time):

    results.jsonl          one line per cycle, model and depth
    results.md             CE and top-1 per cycle and model, the training compute of each model, then the full metric
                           table of every cycle
    learning_curves.png    held-out metrics against tokens seen (needs matplotlib)
    compute_curves.png     held-out CE against training FLOPs: the comparison at equal compute
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os

from trainer_ext.evaluation.report import markdown_table
from trainer_ext.files import write_text
from trainer_ext.hub.model_card import format_count

logger = logging.getLogger(__name__)

RESULT_FILES = ("results.jsonl", "results.md", "learning_curves.png", "compute_curves.png")


def record_label(record: dict) -> str:
    """How a record's model is named in tables and plots: the preset, with the depth for a recurrent model."""
    return f"{record['preset']} n={record['num_steps']}" if record["kind"] == "recurrent" else record["preset"]


def render_results(records: list[dict]) -> str:
    """results.md: CE and top-1 per cycle and model, then the full metric table of every cycle."""
    cycles = sorted({r["cycle"] for r in records})
    labels = list(dict.fromkeys(r["model"] for r in sorted(records, key=lambda r: (r["arch"] != "recurrent",
                                                                                     r["num_steps"] or 0))))
    text = ["# Same-data comparison", "",
            "Held-out cross-entropy (nats/token, lower is better) after each cycle; every model saw the same tokens "
            "in the same order."]
    frequency_only = next((r["frequency_only_ce"] for r in records if "frequency_only_ce" in r), None)
    if frequency_only is not None:  # records written before it was recorded lack it
        text[-1] += (f" Predicting every token from its frequency alone gives CE {frequency_only:.4f} on the held-out "
                     "set.")
    teacher = next((r for r in records if r.get("teacher")), None)
    if teacher is not None:  # records written before it was recorded lack it
        text[-1] += f" Both models were distilled from `{teacher['teacher']}` ({teacher['distillation']})."
    text.append("")
    for key, title, fmt in (("ce", "CE", "{:.4f}"), ("top1", "top-1", "{:.2%}")):
        text.append("| cycle | tokens seen | " + " | ".join(f"{label} {title}" for label in labels) + " |")
        text.append("|---:|---:|" + "---:|" * len(labels))
        for cycle in cycles:
            rows = {r["model"]: r for r in records if r["cycle"] == cycle}
            tokens = next(iter(rows.values()))["tokens_seen"]
            cells = [fmt.format(rows[label][key]) if label in rows else "-" for label in labels]
            text.append(f"| {cycle} | {format_count(tokens)} | " + " | ".join(cells) + " |")
        text.append("")
    text += render_compute(records, cycles)
    for cycle in cycles:
        rows = [r for r in records if r["cycle"] == cycle]
        text += [f"## Cycle {cycle}: {format_count(rows[0]['tokens_seen'])} tokens", "",
                 markdown_table([{**r, "model": r["preset"]} for r in rows])]
    return "\n".join(text)


def render_compute(records: list[dict], cycles: list[int]) -> list[str]:
    """The training compute of each model up to each cycle: what equal tokens cost (lines of results.md)."""
    arches = list(dict.fromkeys(r["arch"] for r in records if r.get("train_flops") is not None))
    if not arches:
        return []
    text = ["Training compute up to each cycle (FLOPs at the depths the steps ran; wall seconds of the trainings):",
            "", "| cycle | tokens seen | " + " | ".join(f"{arch} {what}" for arch in arches
                                                          for what in ("FLOPs", "seconds", "tokens/s")) + " |",
            "|---:|---:|" + "---:|" * 3 * len(arches)]
    for cycle in cycles:
        rows = {r["arch"]: r for r in records if r["cycle"] == cycle}
        cells = []
        for arch in arches:
            row = rows.get(arch, {})
            cells += [f"{row['train_flops']:.3g}" if row.get("train_flops") is not None else "-",
                      f"{row['train_seconds']:,.1f}" if row.get("train_seconds") is not None else "-",
                      f"{row['train_tokens_per_second']:,.0f}" if row.get("train_tokens_per_second") else "-"]
        tokens = next(iter(rows.values()))["tokens_seen"]
        text.append(f"| {cycle} | {format_count(tokens)} | " + " | ".join(cells) + " |")
    return [*text, ""]


def write_results(output_dir: str, records: list[dict]) -> list[str]:
    """Write the results files of `records` into `output_dir`; the paths written (none without records)."""
    if not records:
        return []
    paths = [os.path.join(output_dir, name) for name in RESULT_FILES[:2]]
    write_text(paths[0], "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    write_text(paths[1], render_results(records))
    if importlib.util.find_spec("matplotlib") is None:
        logger.warning("matplotlib is not installed: no learning-curve plot (pip install matplotlib).")
    else:
        from trainer_ext.evaluation.plots import plot_learning_curves

        paths.append(plot_learning_curves(records, os.path.join(output_dir, RESULT_FILES[2])))
        with_flops = [r for r in records if r.get("train_flops") is not None]
        if with_flops:
            paths.append(plot_learning_curves(with_flops, os.path.join(output_dir, RESULT_FILES[3]), x="train_flops",
                                              metrics=("ce",)))
    return paths
