"""Evaluate checkpoints on held-out shards: CE, perplexity, top-1/top-5 and generation speed per depth.

    python -m scripts.evaluate_checkpoints --checkpoints outputs/r3b/final outputs/t3b/final --labels ours baseline \
        --data_dir outputs/data/ja --max_samples 256 --output_dir outputs/eval

A recurrent-depth checkpoint is evaluated at every `--depths` value, a fixed-depth baseline (e.g.
LlamaForCausalLM) at its one depth. For recurrent checkpoints the script also measures what decoding with the
`shared` KV cache costs against the exact `per_step` cache (`--cache_cost_samples 0` skips it). Writes to
`--output_dir`: results.json, results.md (metrics as rows, model / depth as columns) and, when matplotlib is
installed, quality_vs_depth.png and speed_vs_depth.png.
"""

import importlib.util
import json
import logging
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field

if __package__ in (None, ""):  # run as a file: this file's folder would shadow the `evaluate` package
    _HERE = os.path.dirname(os.path.abspath(__file__))
    sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    sys.path.insert(0, os.path.dirname(_HERE))

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser

import hf_recurrent  # noqa: F401  (registers the model with the Auto classes)
from hf_recurrent.presets import is_recurrent
from trainer_ext.files import write_text
from trainer_ext.training.checkpoints import check_model_dir
from trainer_ext.data.shards import ShardedTokenDataset, tokenizer_hash
from trainer_ext.devices import resolve_device, resolve_dtype
from trainer_ext.evaluation.metrics import (
    cache_mode_cost,
    evaluate_model,
    generation_speed,
    learning_warnings,
    unigram_cross_entropy,
)

logger = logging.getLogger("evaluate")

ROWS = (("CE", "ce", "{:.4f}"), ("perplexity", "perplexity", "{:.2f}"), ("top-1", "top1", "{:.2%}"),
        ("top-5", "top5", "{:.2%}"))


@dataclass
class EvaluateArguments:
    checkpoints: list[str] = field(metadata={"help": "Checkpoint directories (from_pretrained), one or more."})
    data_dir: str = field(metadata={"help": "Prepared shards (prepare_data); the --split split is evaluated."})
    labels: list[str] | None = field(
        default=None, metadata={"help": "A name per checkpoint for tables and plots (default: folder names)."})
    split: str = field(default="eval", metadata={"help": "Shard split to evaluate."})
    max_samples: int | None = field(default=256, metadata={"help": "Evaluate on at most this many samples."})
    depths: list[int] = field(
        default_factory=lambda: [1, 3, 6, 12, 24], metadata={"help": "Recurrence steps for recurrent models."})
    batch_size: int = field(default=8, metadata={"help": "Samples per forward pass."})
    speed_batch_size: int = field(default=8, metadata={"help": "The larger batch of the tokens/s measurement."})
    prompt_len: int = field(default=32, metadata={"help": "Prompt tokens for the speed measurement."})
    new_tokens: int = field(default=64, metadata={"help": "Generated tokens for the speed measurement."})
    speed_repeats: int = field(default=3, metadata={"help": "Timed generate calls per figure (the median counts)."})
    cache_cost_samples: int = field(
        default=8, metadata={"help": "Samples for the shared-vs-per_step KV cache comparison (0: skip)."})
    cache_cost_tokens: int = field(
        default=64, metadata={"help": "Tokens decoded one at a time per sample in that comparison (the rest of "
                                      "the sample is prefilled)."})
    cache_cost_depths: list[int] | None = field(
        default=None, metadata={"help": "Depths of that comparison (default: each model's mean_recurrence)."})
    output_dir: str = field(default=os.path.join("outputs", "evaluate"), metadata={"help": "Where results go."})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 on CUDA, fp32 on CPU), bfloat16 or float32."})
    device: str = field(default="auto", metadata={"help": "auto (cuda if available), cpu, cuda, cuda:1, ..."})
    plots: bool = field(default=True, metadata={"help": "Draw PNG plots (needs matplotlib)."})

    def __post_init__(self):
        if not self.checkpoints:
            raise ValueError("--checkpoints: give at least one checkpoint directory.")
        if self.labels is not None and len(self.labels) != len(self.checkpoints):
            raise ValueError(f"--labels: {len(self.labels)} labels for {len(self.checkpoints)} checkpoints; "
                             "give one per checkpoint or none.")
        if not self.depths or any(d < 1 for d in self.depths):
            raise ValueError(f"--depths {self.depths}: give one or more integers >= 1.")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"--dtype={self.dtype!r} is not allowed; choose one of ['auto', 'bfloat16', 'float32'].")
        for name in ("batch_size", "speed_batch_size", "prompt_len", "new_tokens", "speed_repeats", "cache_cost_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}={getattr(self, name)} must be >= 1.")


def parse_args(argv=None) -> EvaluateArguments:
    parser = HfArgumentParser(EvaluateArguments)
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        loader = parser.parse_yaml_file if argv[0].endswith("ml") else parser.parse_json_file
        return loader(argv[0])[0]
    return parser.parse_args_into_dataclasses(args=argv)[0]


def default_label(checkpoint: str) -> str:
    """The checkpoint's folder name; for run_pretrain's `<run>/final` the run's name."""
    path = os.path.normpath(os.path.abspath(checkpoint))
    name = os.path.basename(path)
    return os.path.basename(os.path.dirname(path)) if name == "final" else name


def load_checkpoint(path: str, dtype: torch.dtype, device: torch.device):
    check_model_dir(path, "--checkpoints")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path}: no config.json; pass a directory written by save_pretrained (e.g. <run>/final).")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def load_eval_data(args: EvaluateArguments, checkpoint: str, model):
    """The held-out split, checked against the checkpoint's tokenizer (when it has one) and vocabulary."""
    has_tokenizer = os.path.isfile(os.path.join(checkpoint, "tokenizer.json"))
    dataset = ShardedTokenDataset(
        args.data_dir, args.split, expected_tokenizer_hash=tokenizer_hash(checkpoint) if has_tokenizer else None,
        model_vocab_size=model.config.vocab_size)
    if args.max_samples is not None and len(dataset) > args.max_samples:
        dataset = torch.utils.data.Subset(dataset, range(args.max_samples))
    return dataset


def unrolled_layers(config, num_steps: int | None) -> int:
    if is_recurrent(config):
        return config.n_prelude_layers + num_steps * config.n_core_layers + config.n_coda_layers
    return config.num_hidden_layers


def speed_prompt(dataset, prompt_len: int) -> torch.Tensor:
    """The first held-out tokens: a real text prompt, the same for every model and depth."""
    ids, index = [], 0
    while sum(x.numel() for x in ids) < prompt_len and index < len(dataset):
        ids.append(dataset[index]["input_ids"])
        index += 1
    prompt = torch.cat(ids)
    if prompt.numel() < prompt_len:
        raise ValueError(f"--prompt_len={prompt_len} exceeds the {prompt.numel()} tokens of the --split split.")
    return prompt[:prompt_len]


def evaluate_checkpoint(args: EvaluateArguments, checkpoint: str, label: str, device, dtype,
                        unigram_ce: float | None = None) -> tuple[list, list]:
    """Result records (one per depth) and KV cache comparisons for one checkpoint; `unigram_ce` (the held-out
    tokens' frequency-only CE) is what a model that learned nothing from the context would score."""
    model = load_checkpoint(checkpoint, dtype, device)
    dataset = load_eval_data(args, checkpoint, model)
    recurrent = is_recurrent(model.config)
    depths = list(args.depths) if recurrent else [None]
    batch_sizes = sorted({1, args.speed_batch_size})
    prompt = speed_prompt(dataset, args.prompt_len)
    records, costs = [], []
    for depth in depths:
        logger.info("%s: evaluating %s", label, f"at depth {depth}" if recurrent else "(fixed depth)")
        quality = evaluate_model(model, dataset, num_steps=depth, batch_size=args.batch_size)
        # Minutes per model and depth on a large model, with no bar of its own: say what runs and what it took.
        where = f"at depth {depth}" if recurrent else "(fixed depth)"
        logger.info("%s: generation speed %s: %d new tokens after a %d-token prompt, batch sizes %s, %d timed "
                    "calls each (plus one warm-up)", label, where, args.new_tokens, args.prompt_len, batch_sizes,
                    args.speed_repeats)
        start = time.perf_counter()
        speed = generation_speed(model, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                 batch_sizes=batch_sizes, num_steps=depth, prompt_ids=prompt,
                                 repeats=args.speed_repeats)
        logger.info("%s: generation speed %s took %.1fs: %s", label, where, time.perf_counter() - start,
                    ", ".join(f"{s:.1f} tokens/s at batch {b}" for b, s in speed.items()))
        records.append({
            "model": label,
            "checkpoint": checkpoint,
            "kind": "recurrent" if recurrent else "transformer",
            "num_steps": depth,
            "layers": unrolled_layers(model.config, depth),
            **quality,
            **{f"tokens_per_s_batch_{b}": s for b, s in speed.items()},
        })
    for warning in learning_warnings(label, {r["num_steps"]: r["ce"] for r in records}, unigram_ce):
        logger.warning(warning)
    if recurrent and args.cache_cost_samples > 0:
        seq_len = dataset[0]["input_ids"].shape[0]
        prefix_len = max(seq_len - args.cache_cost_tokens, 0)
        for depth in args.cache_cost_depths or [model.config.mean_recurrence]:
            logger.info("%s: KV cache modes at depth %d: %d samples, %d tokens decoded one at a time per mode",
                        label, depth, min(args.cache_cost_samples, len(dataset)), seq_len - prefix_len)
            cost = cache_mode_cost(model, dataset, num_steps=depth, max_samples=args.cache_cost_samples,
                                   prefix_len=prefix_len, batch_size=args.batch_size)
            costs.append({"model": label, "checkpoint": checkpoint, **cost})
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return records, costs


def column_name(record: dict) -> str:
    if record["kind"] == "recurrent":
        return f"{record['model']} / n={record['num_steps']}"
    return f"{record['model']} / {record['layers']} layers"


def markdown_table(results: list[dict]) -> str:
    """Metrics as rows, one column per model / depth (the layout of the comparison reports)."""
    if not results:
        raise ValueError("markdown_table: no results.")
    speed_batches = sorted({int(k.rsplit("_", 1)[1]) for r in results for k in r if k.startswith("tokens_per_s_batch_")})
    rows = list(ROWS) + [(f"tokens/s (batch {b})", f"tokens_per_s_batch_{b}", "{:.1f}") for b in speed_batches]
    lines = ["| metric | " + " | ".join(column_name(r) for r in results) + " |",
             "|---|" + "---:|" * len(results)]
    for title, key, fmt in rows:
        cells = [_format(r.get(key), fmt) for r in results]
        lines.append(f"| {title} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def cache_cost_table(costs: list[dict]) -> str:
    lines = ["| model / depth | decoded tokens | full forward CE | per_step CE | shared CE | shared - per_step |",
             "|---|---:|---:|---:|---:|---:|"]
    for cost in costs:
        lines.append(
            f"| {cost['model']} / n={cost['num_steps']} | {cost['tokens']} | {cost['full_forward']['ce']:.4f} | "
            f"{cost['per_step']['ce']:.4f} | {cost['shared']['ce']:.4f} | {cost['shared_ce_increase']:+.4f} |")
    return "\n".join(lines) + "\n"


def _format(value, fmt: str) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return fmt.format(value)


def render_report(report: dict) -> str:
    data = report["data"]
    text = (f"# Evaluation\n\nHeld-out split `{data['split']}` of `{data['data_dir']}`: {data['samples']} samples. "
            "CE in nats per token; tokens/s: greedy generation with the KV cache.")
    if data.get("frequency_only_ce") is not None:  # reports written before it was recorded lack it
        text += (f" Predicting every token from its frequency alone gives CE {data['frequency_only_ce']:.4f} on these "
                 "tokens.")
    text += "\n\n"
    text += markdown_table(report["results"])
    if report["cache_mode_cost"]:
        text += ("\n## KV cache modes\n\nTeacher-forced decoding, one token at a time after a prefilled prefix. "
                 "`per_step` is exact (equals the full forward); `shared` keeps one cache per core layer.\n\n")
        text += cache_cost_table(report["cache_mode_cost"])
    return text


def read_report(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def main(argv=None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args = parse_args(argv)
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    labels = args.labels or [default_label(c) for c in args.checkpoints]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--labels: the names {labels} repeat; give each checkpoint its own label with --labels.")

    heldout = ShardedTokenDataset(args.data_dir, args.split)
    num_samples = len(heldout) if args.max_samples is None else min(len(heldout), args.max_samples)
    unigram_ce = unigram_cross_entropy(torch.utils.data.Subset(heldout, range(num_samples)))
    results, costs = [], []
    for checkpoint, label in zip(args.checkpoints, labels):
        records, checkpoint_costs = evaluate_checkpoint(args, checkpoint, label, device, dtype, unigram_ce)
        results += records
        costs += checkpoint_costs
    report = {
        "data": {"data_dir": args.data_dir, "split": args.split, "samples": num_samples,
                 "frequency_only_ce": unigram_ce},
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "args": asdict(args),
        "results": results,
        "cache_mode_cost": costs,
        "plots": [],
    }

    os.makedirs(args.output_dir, exist_ok=True)
    if args.plots and importlib.util.find_spec("matplotlib") is None:
        logger.warning("matplotlib is not installed: no plots (pip install 'hf-recurrent[plots]').")
    elif args.plots:
        from trainer_ext.evaluation.plots import plot_depth_curves

        report["plots"] = plot_depth_curves(results, args.output_dir)
    written = [os.path.join(args.output_dir, "results.json"), os.path.join(args.output_dir, "results.md")]
    write_text(written[0], json.dumps(report, indent=2) + "\n")
    write_text(written[1], render_report(report))
    print(render_report(report))
    logger.info("Results written to %s", ", ".join(written + list(report["plots"])))
    return report


def cli(argv=None) -> int:
    """Console entry point: exit code 0 after a successful run (a failure raises, which exits non-zero)."""
    main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
