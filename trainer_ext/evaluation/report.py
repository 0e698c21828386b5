"""The evaluation report: results.json (written and read here) and its Markdown rendering, results.md.

    report = {"data": {...}, "device", "dtype", "args", "results": [record per model and depth],
              "cache_mode_cost": [...], "adaptive_depth": [...], "plots": [...]}

A result record is {"model", "checkpoint", "kind": "recurrent"|"transformer", "num_steps", "layers", "ce",
"perplexity", "top1", "top5", "tokens", "tokens_per_s_batch_<B>", ...}. `markdown_table` lays records out with
metrics as rows and one column per model / depth, the layout of the comparison reports too.
"""

import json
import math
import os

from trainer_ext.files import write_text

RESULTS_JSON = "results.json"
RESULTS_MD = "results.md"
ROWS = (("CE", "ce", "{:.4f}"), ("perplexity", "perplexity", "{:.2f}"), ("top-1", "top1", "{:.2%}"),
        ("top-5", "top5", "{:.2%}"))
SPEED_PREFIX = "tokens_per_s_batch_"


def column_name(record: dict) -> str:
    if record["kind"] == "recurrent":
        return f"{record['model']} / n={record['num_steps']}"
    return f"{record['model']} / {record['layers']} layers"


def markdown_table(results: list[dict]) -> str:
    """Metrics as rows, one column per model / depth (the layout of the comparison reports)."""
    if not results:
        raise ValueError("markdown_table: no results.")
    speed_batches = sorted({int(key.removeprefix(SPEED_PREFIX)) for record in results for key in record
                            if key.startswith(SPEED_PREFIX)})
    rows = list(ROWS) + [(f"tokens/s (batch {b})", f"{SPEED_PREFIX}{b}", "{:.1f}") for b in speed_batches]
    lines = ["| metric | " + " | ".join(column_name(r) for r in results) + " |",
             "|---|" + "---:|" * len(results)]
    for title, key, fmt in rows:
        cells = [_format(r.get(key), fmt) for r in results]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _table(header: list[str], rows) -> str:
    """A Markdown table: the first column left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    lines += ["| " + " | ".join(cells) + " |" for cells in rows]
    return "\n".join(lines) + "\n"


def cache_cost_table(costs: list[dict]) -> str:
    return _table(["model / depth", "decoded tokens", "full forward CE", "per_step CE", "shared CE", "shared - per_step"],
                  ([f"{c['model']} / n={c['num_steps']}", str(c["tokens"]), f"{c['full_forward']['ce']:.4f}",
                    f"{c['per_step']['ce']:.4f}", f"{c['shared']['ce']:.4f}", f"{c['shared_ce_increase']:+.4f}"]
                   for c in costs))


def adaptive_depth_table(rows: list[dict]) -> str:
    """Quality and tokens/s of full forward passes (no cache); decoding: greedy, `shared` KV cache, tokens/s at
    batch 1 and at the larger speed batch (its own prompt per row). Reports from before the timed evaluation and the
    larger batch leave those cells blank."""
    return _table(["model / threshold", "max steps", "mean steps used", "CE", "CE at max steps", "difference",
                   "forward speed-up", "decode tok/s", "at max steps", "speed-up", "speed-up, larger batch"],
                  ([f"{r['model']} / {r['exit_threshold']:g}", str(r["num_steps"]), f"{r['mean_steps_used']:.2f}",
                    f"{r['ce']:.4f}", f"{r['ce_fixed_depth']:.4f}", f"{r['ce_increase']:+.4f}",
                    _format(r.get("eval_speedup"), "{:.2f}x"),
                    f"{r['decode_tokens_per_s']:.1f}", f"{r['decode_tokens_per_s_fixed_depth']:.1f}",
                    f"{r['decode_speedup']:.2f}x",
                    f"{r['decode_speedup_batch']:.2f}x (batch {r['decode_batch']})" if "decode_batch" in r else "-"]
                   for r in rows))


def _format(value, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return fmt.format(value)


def render_report(report: dict) -> str:
    """results.md: the data it was measured on, the metrics table and the KV cache comparison."""
    data = report["data"]
    text = (f"# Evaluation\n\nHeld-out split `{data['split']}` of `{data['data_dir']}`: {data['samples']} samples. "
            "CE in nats per token; tokens/s: greedy generation with the KV cache. Predicting every token from its "
            f"frequency alone gives CE {data['frequency_only_ce']:.4f} on these tokens.\n\n")
    text += markdown_table(report["results"])
    if report["cache_mode_cost"]:
        text += ("\n## KV cache modes\n\nTeacher-forced decoding, one token at a time after a prefilled prefix. "
                 "`per_step` is exact (equals the full forward); `shared` keeps one cache per core layer.\n\n")
        text += cache_cost_table(report["cache_mode_cost"])
    if report.get("adaptive_depth"):  # reports written before the option have no such key
        text += ("\n## Adaptive depth\n\nEach token stops iterating once its exit criterion is met (`state`: its "
                 "state changed by less than the threshold, relative, in one step; `gate`: the learned exit gate's "
                 "cumulative exit probability reached the threshold), at most `max steps`; CE (full forward passes) "
                 "against the fixed depth `max steps`. Forward speed-up: tokens/s of full forward passes without a "
                 "cache (a warm-up batch, then the median of timed passes) against the fixed depth. Decoding: "
                 "batch 1, greedy, with the `shared` KV cache, in which a token that has exited skips its remaining "
                 "steps but the last (which writes its cache entry); tokens/s with exits against the fixed depth "
                 "`max steps`.\n\n")
        text += adaptive_depth_table(report["adaptive_depth"])
    return text


def write_report(report: dict, output_dir: str) -> list[str]:
    """results.json and results.md in `output_dir` (each written atomically); returns their paths."""
    os.makedirs(output_dir, exist_ok=True)
    paths = [os.path.join(output_dir, RESULTS_JSON), os.path.join(output_dir, RESULTS_MD)]
    write_text(paths[0], json.dumps(report, indent=2) + "\n")
    write_text(paths[1], render_report(report))
    return paths


def read_report(path: str) -> dict:
    """A results.json written by `write_report`."""
    with open(path, encoding="utf-8") as f:
        return json.load(f)
