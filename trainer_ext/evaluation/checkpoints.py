"""Evaluating saved checkpoints on held-out shards: CE, perplexity, top-1/top-5 and generation speed per depth.

    report = evaluate_checkpoints(EvaluateArguments(checkpoints=["outputs/r3b/final", "outputs/t3b/final"],
                                                    labels=["ours", "baseline"], data_dir="outputs/data/ja"))

A recurrent-depth checkpoint is evaluated at every `depths` value, a fixed-depth baseline (e.g.
LlamaForCausalLM) at its one depth. For recurrent checkpoints it also measures what decoding with the `shared`
KV cache costs against the exact `per_step` cache (`cache_cost_samples=0` skips it), and with `exit_thresholds`
what adaptive depth saves: mean core steps per token against the deepest of `depths`, the CE it costs there, the
tokens/s of the evaluation's forward passes, and greedy decoding tokens/s with exits at batch 1 and
`speed_batch_size` against the same fixed depth, with the `shared` cache (the mode in which a token that has exited
skips its remaining steps). Writes the report (`trainer_ext.evaluation.report`) and, when matplotlib is installed,
quality_vs_depth.png and speed_vs_depth.png to `output_dir`.
"""

import importlib.util
import logging
import os
import time
from dataclasses import asdict, dataclass, field

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from hf_recurrent.adaptive_depth import EXIT_CRITERIA
from hf_recurrent.cost import unrolled_layers
from hf_recurrent.presets import is_recurrent
from trainer_ext.checkpoints import check_model_dir
from trainer_ext.data.shards import ShardedTokenDataset, tokenizer_hash
from trainer_ext.devices import resolve_device, resolve_dtype
from trainer_ext.evaluation.generation import cache_mode_cost, forward_speed, generation_speed, kv_cache_mode
from trainer_ext.evaluation.metrics import evaluate_model, learning_warnings, unigram_cross_entropy
from trainer_ext.evaluation.plots import plot_depth_curves
from trainer_ext.evaluation.report import write_report

logger = logging.getLogger(__name__)

DTYPES = ("auto", "bfloat16", "float32")
FORWARD_SPEED_BATCHES = 4  # batches of --batch_size per timed pass of the forward with and without exits


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
    exit_thresholds: list[float] | None = field(
        default=None, metadata={"help": "Adaptive depth (hf_recurrent.adaptive_depth) thresholds for recurrent models: "
                                      "each is evaluated at the deepest --depths value as the step cap, reporting "
                                      "mean core steps per token, the CE difference to that fixed depth and "
                                      "batch-1 decoding tokens/s with the shared KV cache against that fixed depth."})
    exit_criterion: str = field(
        default="state", metadata={"help": "How --exit_thresholds decide (hf_recurrent.adaptive_depth): state (the "
                                           "state's relative change) or gate (a learned exit gate's cumulative exit "
                                           "probability; the checkpoints need exit_gate=true)."})
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
        if self.exit_thresholds is not None and any(not t >= 0 for t in self.exit_thresholds):
            raise ValueError(f"--exit_thresholds {self.exit_thresholds}: give numbers >= 0.")
        if self.exit_criterion not in EXIT_CRITERIA:
            raise ValueError(f"--exit_criterion={self.exit_criterion!r} is not allowed; choose one of "
                             f"{list(EXIT_CRITERIA)}.")
        if self.exit_criterion == "gate" and any(not 0 < t <= 1 for t in self.exit_thresholds or ()):
            raise ValueError(f"--exit_thresholds {self.exit_thresholds}: with --exit_criterion gate give cumulative "
                             "exit probabilities in (0, 1].")
        if self.dtype not in DTYPES:
            raise ValueError(f"--dtype={self.dtype!r} is not allowed; choose one of {list(DTYPES)}.")
        for name in ("batch_size", "speed_batch_size", "prompt_len", "new_tokens", "speed_repeats",
                     "cache_cost_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name}={getattr(self, name)} must be >= 1.")


def default_label(checkpoint: str) -> str:
    """The checkpoint's folder name; for run_pretrain's `<run>/final` the run's name."""
    path = os.path.normpath(os.path.abspath(checkpoint))
    name = os.path.basename(path)
    return os.path.basename(os.path.dirname(path)) if name == "final" else name


def load_checkpoint(path: str, dtype: torch.dtype, device: torch.device):
    """A saved causal LM (our recurrent model or any Auto-loadable baseline), on `device`, in eval mode."""
    check_model_dir(path, "--checkpoints")
    if not os.path.isfile(os.path.join(path, "config.json")):
        raise ValueError(f"{path}: no config.json; pass a directory written by save_pretrained (e.g. <run>/final).")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to(device).eval()


def _eval_data(args: EvaluateArguments, checkpoint: str, model):
    """The held-out split, checked against the checkpoint's tokenizer (when it has one) and vocabulary."""
    has_tokenizer = os.path.isfile(os.path.join(checkpoint, "tokenizer.json"))
    dataset = ShardedTokenDataset(
        args.data_dir, args.split, expected_tokenizer_hash=tokenizer_hash(checkpoint) if has_tokenizer else None,
        model_vocab_size=model.config.vocab_size)
    if args.max_samples is not None and len(dataset) > args.max_samples:
        dataset = torch.utils.data.Subset(dataset, range(args.max_samples))
    return dataset


def _speed_prompts(dataset, prompt_len: int, rows: int, split: str) -> torch.Tensor:
    """(rows, prompt_len): real text prompts, the same for every model and depth; row 0 (the first `prompt_len`
    tokens of the first sample) times decoding at batch 1, all rows the batched decoding with exits, one held-out
    prompt per row so that rows exit apart: the first window of each sample, then the next window of each, and so on,
    as far as `rows` needs (a small split still gives a batch of distinct texts); ValueError naming the fix where the
    split holds fewer windows."""
    lengths = [dataset[i]["input_ids"].numel() // prompt_len for i in range(len(dataset))]
    windows = [(w, i) for w in range(max(lengths, default=0)) for i in range(len(dataset)) if w < lengths[i]]
    if len(windows) < rows:
        if rows == 1:  # the speed measurement's one prompt, within one held-out sample
            raise ValueError(f"--prompt_len={prompt_len} is longer than every sample of the --split {split} split; "
                             "lower --prompt_len.")
        raise ValueError(f"--speed_batch_size={rows} with --prompt_len={prompt_len} needs {rows} held-out prompts; "
                         f"--split {split} holds {len(windows)} windows of {prompt_len} tokens. Lower "
                         "--speed_batch_size or --prompt_len.")
    return torch.stack([dataset[i]["input_ids"][w * prompt_len: (w + 1) * prompt_len] for w, i in windows[:rows]])


def evaluate_checkpoint(args: EvaluateArguments, checkpoint: str, label: str, device, dtype,
                        prompts: torch.Tensor, unigram_ce: float | None = None) -> tuple[list, list, list]:
    """Result records (one per depth), KV cache comparisons and adaptive depth records for one checkpoint;
    `unigram_ce` (the held-out tokens' frequency-only CE) is what a model that learned nothing from the context
    would score; `prompts` the held-out prompts of the speed measurements (`_speed_prompts`)."""
    model = load_checkpoint(checkpoint, dtype, device)
    dataset = _eval_data(args, checkpoint, model)
    recurrent = is_recurrent(model.config)
    batch_sizes = sorted({1, args.speed_batch_size})
    prompt = prompts[0]
    records, costs = [], []
    for num_steps in list(args.depths) if recurrent else [None]:
        where = f"at depth {num_steps}" if recurrent else "(fixed depth)"
        logger.info("%s: evaluating %s", label, where)
        quality = evaluate_model(model, dataset, num_steps=num_steps, batch_size=args.batch_size)
        # Minutes per model and depth on a large model, with no bar of its own: say what runs and what it took.
        logger.info("%s: generation speed %s: %d new tokens after a %d-token prompt, batch sizes %s, %d timed "
                    "calls each (plus one warm-up)", label, where, args.new_tokens, args.prompt_len, batch_sizes,
                    args.speed_repeats)
        start = time.perf_counter()
        speed = generation_speed(model, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                 batch_sizes=batch_sizes, num_steps=num_steps, prompt_ids=prompt,
                                 repeats=args.speed_repeats)
        logger.info("%s: generation speed %s took %.1fs: %s", label, where, time.perf_counter() - start,
                    ", ".join(f"{s:.1f} tokens/s at batch {b}" for b, s in speed.items()))
        records.append({
            "model": label,
            "checkpoint": checkpoint,
            "kind": "recurrent" if recurrent else "transformer",
            "num_steps": num_steps,
            "layers": unrolled_layers(model.config, num_steps),
            **quality,
            **{f"tokens_per_s_batch_{b}": s for b, s in speed.items()},
        })
    for warning in learning_warnings(label, {r["num_steps"]: r["ce"] for r in records}, unigram_ce):
        logger.warning(warning)
    if recurrent and args.cache_cost_samples > 0:
        seq_len = dataset[0]["input_ids"].shape[0]
        prefix_len = max(seq_len - args.cache_cost_tokens, 0)
        for num_steps in args.cache_cost_depths or [model.config.mean_recurrence]:
            logger.info("%s: KV cache modes at depth %d: %d samples, %d tokens decoded one at a time per mode",
                        label, num_steps, min(args.cache_cost_samples, len(dataset)), seq_len - prefix_len)
            cost = cache_mode_cost(model, dataset, num_steps=num_steps, max_samples=args.cache_cost_samples,
                                   prefix_len=prefix_len, batch_size=args.batch_size)
            costs.append({"model": label, "checkpoint": checkpoint, **cost})
    adaptive = [] if not (recurrent and args.exit_thresholds) else \
        adaptive_depth_records(args, model, dataset, records, {args.speed_batch_size: prompts, 1: prompt})
    for record in adaptive:
        record.update(model=label, checkpoint=checkpoint)
    del model
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return records, costs, adaptive


def adaptive_depth_records(args: EvaluateArguments, model, dataset, records: list[dict],
                           prompts: dict[int, torch.Tensor]) -> list[dict]:
    """Per exit threshold, at the deepest evaluated depth n_max as the cap: mean core steps per token and CE, against
    the fixed-depth CE at n_max (from `records`); tokens/s of full forward passes without a cache (`forward_speed`:
    the first `FORWARD_SPEED_BATCHES` batches of --batch_size, a warm-up batch, the median of --speed_repeats passes)
    against n_max fixed; greedy decoding with the `shared` KV cache at batch 1 and at --speed_batch_size (`prompts` by
    batch size: held-out prompts, rows that differ exit apart), tokens/s against n_max fixed."""
    n_max, batch = max(args.depths), args.speed_batch_size
    fixed = next(r for r in records if r["num_steps"] == n_max)

    def forward_rate(**exits) -> float:
        return forward_speed(model, dataset, num_steps=n_max, batch_size=args.batch_size,
                             batches=FORWARD_SPEED_BATCHES, repeats=args.speed_repeats, **exits)

    def decode_speeds(**exits) -> dict[int, float]:
        with kv_cache_mode(model, "shared"):
            return {size: generation_speed(model, prompt_len=args.prompt_len, new_tokens=args.new_tokens,
                                           batch_sizes=[size], num_steps=n_max, prompt_ids=ids,
                                           repeats=args.speed_repeats, **exits)[size] for size, ids in prompts.items()}

    fixed_rate, fixed_speed = forward_rate(), decode_speeds()
    rows = []
    for threshold in args.exit_thresholds:
        logger.info("adaptive depth: exit threshold %g, at most %d steps", threshold, n_max)
        exits = dict(exit_threshold=threshold, exit_criterion=args.exit_criterion)
        quality = evaluate_model(model, dataset, num_steps=n_max, batch_size=args.batch_size, **exits)
        rate, speed = forward_rate(**exits), decode_speeds(**exits)
        rows.append({"num_steps": n_max, "exit_threshold": threshold, "exit_criterion": args.exit_criterion,
                     "mean_steps_used": quality["mean_steps_used"],
                     "ce": quality["ce"], "top1": quality["top1"], "ce_fixed_depth": fixed["ce"],
                     "ce_increase": quality["ce"] - fixed["ce"], "tokens": quality["tokens"],
                     "forward_tokens_per_s": rate, "forward_tokens_per_s_fixed_depth": fixed_rate,
                     "eval_speedup": rate / fixed_rate,
                     "decode_tokens_per_s": speed[1], "decode_tokens_per_s_fixed_depth": fixed_speed[1],
                     "decode_speedup": speed[1] / fixed_speed[1], "decode_batch": batch,
                     "decode_tokens_per_s_batch": speed[batch],
                     "decode_speedup_batch": speed[batch] / fixed_speed[batch]})
    return rows


def evaluate_checkpoints(args: EvaluateArguments) -> dict:
    """Evaluate every checkpoint of `args`, write the report (and plots) to `args.output_dir`, return the report."""
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    labels = args.labels or [default_label(c) for c in args.checkpoints]
    if len(set(labels)) != len(labels):
        raise ValueError(f"--labels: the names {labels} repeat; give each checkpoint its own label with --labels.")

    if args.exit_thresholds and args.exit_criterion == "gate":  # before any work: which checkpoints have a gate
        for checkpoint in args.checkpoints:
            check_model_dir(checkpoint, "--checkpoints")
            config = AutoConfig.from_pretrained(checkpoint)
            if is_recurrent(config) and not getattr(config, "exit_gate", False):
                raise ValueError(f"--exit_criterion gate: {checkpoint} has no learned exit gate (its config has "
                                 "exit_gate false); train one with --config_overrides exit_gate=true, or evaluate it "
                                 "with --exit_criterion state.")
    heldout = ShardedTokenDataset(args.data_dir, args.split)
    num_samples = len(heldout) if args.max_samples is None else min(len(heldout), args.max_samples)
    heldout = torch.utils.data.Subset(heldout, range(num_samples))
    prompts = _speed_prompts(heldout, args.prompt_len, args.speed_batch_size if args.exit_thresholds else 1,
                             args.split)  # before any work
    unigram_ce = unigram_cross_entropy(heldout)
    results, costs, adaptive = [], [], []
    for checkpoint, label in zip(args.checkpoints, labels):
        records, checkpoint_costs, checkpoint_adaptive = evaluate_checkpoint(args, checkpoint, label, device, dtype,
                                                                             prompts, unigram_ce)
        results += records
        costs += checkpoint_costs
        adaptive += checkpoint_adaptive
    report = {
        "data": {"data_dir": args.data_dir, "split": args.split, "samples": num_samples,
                 "frequency_only_ce": unigram_ce},
        "device": str(device),
        "dtype": str(dtype).removeprefix("torch."),
        "args": asdict(args),
        "results": results,
        "cache_mode_cost": costs,
        "adaptive_depth": adaptive,
        "plots": [],
    }
    if args.plots and importlib.util.find_spec("matplotlib") is None:
        logger.warning("matplotlib is not installed: no plots (pip install matplotlib, or pass --plots false).")
    elif args.plots:
        report["plots"] = plot_depth_curves(results, args.output_dir)
    written = write_report(report, args.output_dir)
    logger.info("Results written to %s", ", ".join(written + list(report["plots"])))
    return report
