"""Same-data comparison: a recurrent-depth model against a Transformer baseline, trained in token cycles.

    # debug presets on the embedded corpus, three small cycles (CPU, minutes):
    python -m scripts.compare --cycle_tokens 200_000 --seq_len 128 --eval_tokens 20_000 --num_cycles 3
    python -m scripts.compare --recurrent_preset recurrent-125m --baseline_preset transformer-125m \
        --dataset uonlp/CulturaX --dataset_config ja --tokenizer llm-jp/llm-jp-3-1.8b --seq_len 2048 \
        --cycle_tokens 200_000_000 --num_cycles 5 --per_device_train_batch_size 8 \
        --learning_rate 3e-4 --bf16 --output_dir outputs/compare-125m \
        --push_to_hub --hub_model_id me/recurrent-125m-ja

Every cycle takes the next `--cycle_tokens` training tokens of one data stream (the embedded corpus, `--files`
or `--dataset`, read as prepare_data reads them) and, in this order:

    prepare          shards of the cycle's tokens (scripts/prepare_data.py with --skip_documents / --skip_tokens
                     / --eval_from), starting where the previous cycle's stream ended
    train_recurrent  run_pretrain: cycle 1 from `--recurrent_preset`, later cycles from the previous final weights
    train_baseline   the same for `--baseline_preset` (a LlamaForCausalLM): same tokenizer, data, order and seed
    evaluate         both models on one fixed held-out set (the recurrent one at each of `--eval_depths`),
                     appended to results.jsonl / results.md / learning_curves.png; model cards rewritten
    cleanup          the cycle's shards and intermediate Trainer checkpoints are deleted (final weights stay)

The held-out set is the first `--eval_tokens` tokens of the stream, prepared once before cycle 1 (which also
trains the tokenizer, unless `--tokenizer` is given); no cycle trains on it, every cycle and model is evaluated
on exactly it. Cycle k trains for `cycle_tokens // (batch x grad accum x seq_len)` optimizer steps on exactly
the samples those steps consume, so no prepared sample is left unused and no token of the stream is skipped.
Each preparation records where its piece of the stream ends (prepare_data's `stream_end`) in the state file,
and the next cycle skips to that position by whole documents without tokenizing them: a cycle reads the text
before it but tokenizes only its own, and writes nothing proportional to the corpus besides its shards.
Optimizer state starts fresh in each cycle (weights continue), hence the default `constant_with_warmup`
schedule with a short warmup per cycle; any run_pretrain / TrainingArguments option not listed here
(`--learning_rate`, `--warmup_steps`, `--bf16`, `--optimizer`, `--teacher_model_name_or_path`, ...) is passed
through to both trainings unchanged, except that `--recurrent_learning_rate` / `--baseline_learning_rate` set one
model's learning rate (each architecture at its own best rate; the recurrent presets need a lower one).

Resuming: progress lives in `<output_dir>/compare_state.json` (written atomically). Killed at any point, the
same command continues where it stopped: finished stages are not redone, an interrupted training resumes from
its last Trainer checkpoint (`--save_steps`) or restarts its cycle, and shards are deleted only after both
models were evaluated on them. A different command against the same output directory raises ValueError unless
`--overwrite` (which discards the old run); `--num_cycles` and the hub options may change between runs, so a
finished run can be extended by more cycles.

`--push_to_hub --hub_model_id me/name` pushes each cycle's final checkpoints (recurrent to `me/name`, baseline
to `me/name-baseline` or `--hub_baseline_model_id`) with their model cards, in the background while the next
cycle trains; commits are named after the cycle ("cycle 2: 400M tokens"). The run waits for them at the end;
pushes that did not finish are retried by the next start of the same command. The token comes from `HF_TOKEN`
or the stored login and is never written to the state file, a card or a log.

Distillation applies to both models. Online: `--teacher_model_name_or_path` is passed through. Offline, for a
teacher too large to run beside the student: `--teacher_cache_model TEACHER` adds a stage after `prepare` that
caches the teacher's top-k log-probs over the cycle's shards (scripts/cache_teacher.py, resumable), trains both
models from that cache and deletes it with the shards; the data must then use the teacher's tokenizer
(`--tokenizer TEACHER`). Not covered: launching across several processes (the pipeline runs its trainings in this
one process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import importlib.util
import json
import logging
import os
import shutil
import sys
from dataclasses import dataclass, field

if __package__ in (None, ""):  # run as a file: make the repository importable, without this folder shadowing
    _HERE = os.path.dirname(os.path.abspath(__file__))  # the `evaluate` package (scripts/evaluate_checkpoints.py)
    sys.path = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]
    sys.path.insert(0, os.path.dirname(_HERE))

import torch
from tqdm.auto import tqdm
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import HfArgumentParser, TrainerCallback

import hf_recurrent  # noqa: F401  (registers the model with the Auto classes)
from hf_recurrent import presets
from scripts import run_pretrain
from scripts.cache_teacher import CacheTeacherArguments, cache_teacher
from scripts.evaluate_checkpoints import load_checkpoint, markdown_table, unrolled_layers
from scripts.prepare_data import PrepareDataArguments, prepare
from trainer_ext.files import write_text
from trainer_ext.training.checkpoints import checkpoint_step, last_complete_checkpoint
from trainer_ext.comparison.state import CYCLE_STAGES, STATE_NAME, CompareState
from trainer_ext.data.shards import ShardedTokenDataset
from trainer_ext.devices import resolve_device, resolve_dtype
from trainer_ext.evaluation.metrics import evaluate_model, learning_warnings, unigram_cross_entropy
from trainer_ext.hub.push import BackgroundPusher, cycle_commit_message
from trainer_ext.hub.model_card import ModelCardInfo, format_count, write_model_card
from trainer_ext.distill.teacher import QUANTIZATIONS

logger = logging.getLogger("compare")

MODELS = ("recurrent", "baseline")
# Training defaults of the comparison, placed before the pass-through arguments (which override them): weights
# continue across cycles but optimizer state does not, so a constant rate after a short per-cycle warmup; no
# mid-cycle evaluation (the pipeline evaluates after each cycle); a resumable checkpoint now and then; one
# progress display (the pipeline's) instead of the Trainer's.
TRAIN_DEFAULTS = [
    "--lr_scheduler_type", "constant_with_warmup",
    "--warmup_steps", "30",
    "--eval_strategy", "no",
    "--save_steps", "1000",
    "--save_total_limit", "1",
    "--logging_steps", "50",
    "--disable_tqdm", "true",
]
# Set per cycle and model by the pipeline; passing them through would break the cycle bookkeeping.
CONTROLLED_TRAIN_ARGS = {
    "--output_dir": "--output_dir (of the whole comparison)",
    "--data_dir": "the data options (--files / --dataset / --seq_len ...)",
    "--max_steps": "--cycle_tokens",
    "--num_train_epochs": "--cycle_tokens",
    "--preset": "--recurrent_preset / --baseline_preset",
    "--model_name_or_path": "nothing: each cycle continues from the previous cycle's final weights",
    "--resume_from_checkpoint": "nothing: an interrupted cycle resumes by itself",
    "--overwrite_output_dir": "--overwrite (an interrupted cycle without a checkpoint restarts by itself)",
    "--config_overrides": "--recurrent_config_overrides / --baseline_config_overrides",
    "--save_final": "nothing: the next cycle starts from the final weights",
    "--teacher_cache_dir": "--teacher_cache_model (a cache built for each cycle's shards)",
    "--hub_strategy": "--push_to_hub (the pipeline pushes once per cycle)",
}
# Arguments that neither change data, models nor results: a rerun that differs only in these continues the run.
NON_IDENTITY_ARGS = ("output_dir", "num_cycles", "overwrite", "push_to_hub", "hub_model_id", "hub_baseline_model_id",
                     "hub_private_repo", "num_proc", "map_batch_size", "cache_dir")
# Arguments added after state files were first written: part of a run's identity only when set, so a run started
# before they existed still continues.
OPTIONAL_IDENTITY_ARGS = ("recurrent_learning_rate", "baseline_learning_rate", "teacher_cache_model",
                          "teacher_cache_topk", "teacher_cache_quantization")


@dataclass
class CompareArguments:
    output_dir: str = field(default=os.path.join("outputs", "compare"),
                            metadata={"help": "Data, checkpoints, results and the state file of the run."})
    num_cycles: int = field(default=5, metadata={"help": "Cycles to run (may be raised later to extend a run)."})
    cycle_tokens: int = field(
        default=200_000_000, metadata={"help": "Training tokens per cycle and model (rounded down to whole steps)."})
    recurrent_preset: str = field(
        default="debug", metadata={"help": "The recurrent-depth model (e.g. recurrent-125m)."})
    baseline_preset: str = field(
        default="transformer-debug", metadata={"help": "The Transformer baseline (a transformer-* preset)."})
    recurrent_config_overrides: str | None = field(
        default=None, metadata={"help": "Config fields of the recurrent model, e.g. 'mean_recurrence=8'."})
    baseline_config_overrides: str | None = field(default=None, metadata={"help": "Config fields of the baseline."})
    recurrent_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the recurrent model only (default: --learning_rate). The "
                                        "recurrent presets need a lower one than their Transformer peers."})
    baseline_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the baseline only (default: --learning_rate)."})
    teacher_cache_model: str | None = field(
        default=None, metadata={"help": "Distil both models from this teacher through a top-k cache built for each "
                                        "cycle's shards and deleted with them (needs --tokenizer of the teacher)."})
    teacher_cache_topk: int | None = field(
        default=None, metadata={"help": "Token ids per position in the teacher cache (default 64)."})
    teacher_cache_quantization: str | None = field(
        default=None, metadata={"help": "8bit or 4bit: load the cached teacher quantized (CUDA; default: bf16)."})
    per_device_train_batch_size: int = field(default=8, metadata={"help": "Samples per step (both models)."})
    gradient_accumulation_steps: int = field(default=1, metadata={"help": "Micro-batches per optimizer step."})
    seed: int = field(default=0, metadata={"help": "Seed of both trainings (init, data order, depth sampling)."})
    eval_depths: list[int] = field(
        default_factory=lambda: [1, 3, 6, 12, 24],
        metadata={"help": "Recurrence steps at which the recurrent model is evaluated."})
    max_depth_factor: float = field(
        default=3.0, metadata={"help": "Evaluate depths up to this multiple of mean_recurrence only (deeper is "
                                       "untested territory and costs time linearly)."})
    eval_batch_size: int = field(default=8, metadata={"help": "Samples per evaluation forward pass."})
    eval_max_batches: int | None = field(default=None, metadata={"help": "Evaluate on at most this many batches."})
    device: str = field(default="auto", metadata={"help": "Evaluation device: auto, cpu, cuda, cuda:1, ..."})
    eval_dtype: str = field(default="auto", metadata={"help": "auto (bf16 on CUDA, fp32 on CPU), bfloat16, float32."})
    push_to_hub: bool = field(default=False, metadata={"help": "Push each cycle's checkpoints to the Hub."})
    hub_model_id: str | None = field(default=None, metadata={"help": "Hub repo of the recurrent model."})
    hub_baseline_model_id: str | None = field(
        default=None, metadata={"help": "Hub repo of the baseline (default: <hub_model_id>-baseline)."})
    hub_private_repo: bool | None = field(default=None, metadata={"help": "Create the repos private."})
    overwrite: bool = field(
        default=False, metadata={"help": "Discard a run made in --output_dir with other settings and start again."})

    def __post_init__(self):
        for name in ("num_cycles", "cycle_tokens", "per_device_train_batch_size", "gradient_accumulation_steps",
                     "eval_batch_size", "eval_max_batches", "teacher_cache_topk"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be >= 1, got {value}.")
        if not self.eval_depths or any(d < 1 for d in self.eval_depths):
            raise ValueError(f"--eval_depths {self.eval_depths}: give one or more integers >= 1.")
        for name in ("recurrent_learning_rate", "baseline_learning_rate"):
            value = getattr(self, name)
            if value is not None and not value > 0:
                raise ValueError(f"--{name} must be > 0, got {value}.")
        for name in ("teacher_cache_topk", "teacher_cache_quantization"):
            if getattr(self, name) is not None and self.teacher_cache_model is None:
                raise ValueError(f"--{name} needs --teacher_cache_model (the teacher to cache).")
        if self.teacher_cache_quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"--teacher_cache_quantization={self.teacher_cache_quantization!r} is not allowed; "
                             f"choose one of {list(QUANTIZATIONS)}.")
        if self.max_depth_factor <= 0:
            raise ValueError(f"--max_depth_factor must be > 0, got {self.max_depth_factor}.")
        for name, recurrent in (("recurrent_preset", True), ("baseline_preset", False)):
            preset = getattr(self, name)
            if preset not in presets.NAMES:
                raise ValueError(f"--{name}={preset!r} is not a preset; choose one of {list(presets.NAMES)}.")
            if presets.is_recurrent(presets.get(preset)) != recurrent:
                kind = "a recurrent-depth" if recurrent else "a Transformer (transformer-*)"
                raise ValueError(f"--{name}={preset!r} is not {kind} preset.")
        if self.push_to_hub and not self.hub_model_id:
            raise ValueError("--push_to_hub needs --hub_model_id (the recurrent model's repo, e.g. me/r125m).")
        if self.eval_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"--eval_dtype={self.eval_dtype!r}: choose one of ['auto', 'bfloat16', 'float32'].")

    @property
    def baseline_repo_id(self) -> str | None:
        if self.hub_baseline_model_id:
            return self.hub_baseline_model_id
        return f"{self.hub_model_id}-baseline" if self.hub_model_id else None


@dataclass
class CompareDataArguments:
    """The data stream, as prepare_data reads it (see scripts/prepare_data.py for each option)."""

    files: list[str] | None = field(default=None, metadata={"help": "Local text/JSONL/parquet files or globs."})
    dataset: str | None = field(default=None, metadata={"help": "A datasets hub name (streamed)."})
    dataset_config: str | None = field(default=None, metadata={"help": "Config (subset) of --dataset."})
    split: str = field(default="train", metadata={"help": "Split of --dataset."})
    text_column: str = field(default="text", metadata={"help": "Column holding document text."})
    text_sample_by: str = field(default="document", metadata={"help": "document, paragraph or line (.txt files)."})
    max_documents: int | None = field(default=None, metadata={"help": "Read at most this many documents."})
    tokenizer: str | None = field(
        default=None, metadata={"help": "Tokenizer path or hub id; default: a BPE trained once, before cycle 1."})
    vocab_size: int = field(default=8192, metadata={"help": "Vocabulary of the trained BPE."})
    tokenizer_train_documents: int = field(default=100_000, metadata={"help": "Documents the BPE is trained on."})
    seq_len: int = field(default=256, metadata={"help": "Context length of training and evaluation samples."})
    eval_tokens: int = field(
        default=1_000_000, metadata={"help": "Size of the held-out set: the first tokens of the stream."})
    shard_size: int = field(default=32768, metadata={"help": "Samples per shard file."})
    num_proc: int = field(default=1, metadata={"help": "No effect (the tokenizer runs in parallel threads)."})
    map_batch_size: int = field(default=1000, metadata={"help": "Documents per tokenization batch."})
    cache_dir: str | None = field(default=None, metadata={"help": "datasets cache dir."})

    def __post_init__(self):
        if self.eval_tokens < self.seq_len + 1:
            raise ValueError(f"--eval_tokens={self.eval_tokens} is less than one sample (seq_len + 1 = "
                             f"{self.seq_len + 1} tokens); raise it.")

    def prepare_args(self, output_dir: str, **extra) -> PrepareDataArguments:
        source = {k: getattr(self, k) for k in ("files", "dataset", "dataset_config", "split", "text_column",
                                                "text_sample_by", "max_documents", "tokenizer", "vocab_size",
                                                "tokenizer_train_documents", "seq_len", "shard_size", "num_proc",
                                                "map_batch_size", "cache_dir")}
        return PrepareDataArguments(output_dir=output_dir, disable_tqdm=True, **{**source, **extra})


def parse_args(argv: list[str] | None = None) -> tuple[CompareArguments, CompareDataArguments, list[str]]:
    """The comparison's own arguments, and the rest, passed through to both run_pretrain trainings."""
    # No abbreviations: a pass-through option must never be taken for a prefix of one of ours.
    parser = HfArgumentParser((CompareArguments, CompareDataArguments), allow_abbrev=False)
    argv = sys.argv[1:] if argv is None else list(argv)
    args, data_args, passthrough = parser.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)
    for item in passthrough:
        name = item.split("=", 1)[0]
        if name in CONTROLLED_TRAIN_ARGS:
            raise ValueError(f"{name} is set by the comparison for every cycle; use {CONTROLLED_TRAIN_ARGS[name]} "
                             "instead.")
    return args, data_args, passthrough


# ----------------------------------------------------------------------------- progress


class RunProgress:
    """One bar for the whole run: one unit per stage, advanced per optimizer step inside trainings so tqdm's ETA
    follows the real work; the postfix says where the run is (cycle, model, step, tokens)."""

    def __init__(self, total: int, done: int):
        self.bar = tqdm(total=total, initial=min(done, total), desc="compare", unit="stage", dynamic_ncols=True,
                        disable=False, bar_format="{l_bar}{bar}| {percentage:3.0f}% [{elapsed}<{remaining}{postfix}]")
        self.stage_start = self.bar.n

    def begin(self, cycle: int | str, model: str, stage: str) -> None:
        self.stage_start = float(round(self.bar.n))
        self.bar.set_postfix_str(f"cycle={cycle}, model={model}, stage={stage}")

    def training_step(self, cycle: int, model: str, step: int, max_steps: int, tokens: int) -> None:
        self._advance_to(self.stage_start + min(step / max(max_steps, 1), 0.999))
        self.bar.set_postfix_str(f"cycle={cycle}, model={model}, step={step}/{max_steps}, "
                                 f"tokens={format_count(tokens)}")

    def end(self) -> None:
        self._advance_to(self.stage_start + 1)

    def _advance_to(self, value: float) -> None:
        if value > self.bar.n:
            self.bar.update(value - self.bar.n)

    def close(self) -> None:
        self.bar.close()


class _StepProgress(TrainerCallback):
    def __init__(self, progress: RunProgress, cycle: int, model: str, tokens_before: int, tokens_per_step: int):
        self.progress, self.cycle, self.model = progress, cycle, model
        self.tokens_before, self.tokens_per_step = tokens_before, tokens_per_step

    def on_step_end(self, args, state, control, **kwargs):
        self.progress.training_step(self.cycle, self.model, state.global_step, state.max_steps,
                                    self.tokens_before + state.global_step * self.tokens_per_step)


@contextlib.contextmanager
def _inner_bars_off():
    """Silence the progress bars of the work inside a stage (tokenizing, loading and saving weights), so the
    run's bar is the only one. Each library's own switch, restored afterwards."""
    import datasets
    import huggingface_hub.utils as hub_utils
    from transformers.utils import logging as transformers_logging

    switches = []
    if not datasets.are_progress_bars_disabled():
        datasets.disable_progress_bars()
        switches.append(datasets.enable_progress_bars)
    if transformers_logging.is_progress_bar_enabled():
        transformers_logging.disable_progress_bar()
        switches.append(transformers_logging.enable_progress_bar)
    if not hub_utils.are_progress_bars_disabled():
        hub_utils.disable_progress_bars()
        switches.append(hub_utils.enable_progress_bars)
    try:
        yield
    finally:
        for enable in switches:
            enable()


# ----------------------------------------------------------------------------- results


def _label(record: dict) -> str:
    return f"{record['preset']} n={record['num_steps']}" if record["kind"] == "recurrent" else record["preset"]


def render_results(records: list[dict]) -> str:
    """results.md: CE and top-1 per cycle and model, then the full metric table of every cycle."""
    cycles = sorted({r["cycle"] for r in records})
    labels = list(dict.fromkeys(r["model"] for r in sorted(records, key=lambda r: (r["arch"] != "recurrent",
                                                                                     r["num_steps"] or 0))))
    text = ["# Same-data comparison", "",
            "Held-out cross-entropy (nats/token, lower is better) after each cycle; both models saw the same tokens "
            "in the same order."]
    frequency_only = next((r["frequency_only_ce"] for r in records if "frequency_only_ce" in r), None)
    if frequency_only is not None:  # records written before it was recorded lack it
        text[-1] += (f" Predicting every token from its frequency alone gives CE {frequency_only:.4f} on the held-out "
                     "set.")
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
    for cycle in cycles:
        rows = [r for r in records if r["cycle"] == cycle]
        text += [f"## Cycle {cycle}: {format_count(rows[0]['tokens_seen'])} tokens", "",
                 markdown_table([{**r, "model": r["preset"]} for r in rows])]
    return "\n".join(text)


def write_results(output_dir: str, records: list[dict]) -> list[str]:
    """results.jsonl (one line per cycle, model and depth), results.md and learning_curves.png, each rewritten
    whole through a temporary file: the state file is the record, these are views of it."""
    if not records:
        return []
    paths = [os.path.join(output_dir, "results.jsonl"), os.path.join(output_dir, "results.md")]
    write_text(paths[0], "".join(json.dumps(r, sort_keys=True) + "\n" for r in records))
    write_text(paths[1], render_results(records))
    if importlib.util.find_spec("matplotlib") is None:
        logger.warning("matplotlib is not installed: no learning-curve plot (pip install matplotlib).")
    else:
        from trainer_ext.evaluation.plots import plot_learning_curves

        paths.append(plot_learning_curves(records, os.path.join(output_dir, "learning_curves.png")))
    return paths


# ----------------------------------------------------------------------------- hub


class CyclePushes:
    """Background pushes of each cycle's final checkpoints, one pusher (and repo) per model. What finished is
    written to the state by `sync()`, called from the main thread between stages."""

    def __init__(self, args: CompareArguments, state: CompareState):
        self.state = state
        self.repos = {"recurrent": args.hub_model_id, "baseline": args.baseline_repo_id}
        self.private = args.hub_private_repo
        self.pushers: dict[str, BackgroundPusher] = {}
        self.jobs: dict[str, list[tuple[int, str]]] = {model: [] for model in MODELS}  # (cycle, commit message)
        self.recorded: dict[str, int] = {model: 0 for model in MODELS}

    def submit(self, cycle: int, model: str, final_dir: str, tokens_seen: int) -> None:
        if model not in self.pushers:
            self.pushers[model] = BackgroundPusher(self.repos[model], private=self.private)
        message = cycle_commit_message(cycle, tokens_seen)
        self.jobs[model].append((cycle, message))
        self.pushers[model].submit(final_dir, message)

    @property
    def pending(self) -> int:
        return sum(pusher.pending for pusher in self.pushers.values())

    def sync(self) -> None:
        for model, pusher in self.pushers.items():
            commits, errors = list(pusher.commits), list(pusher.errors)  # both grow in submission order
            failed = {e.commit_message for e in errors}
            finished = self.jobs[model][:len(commits) + len(errors)]
            successes = iter(commits)
            for index, (cycle, message) in enumerate(finished):
                if message in failed:
                    continue
                commit = next(successes)
                if index >= self.recorded[model]:
                    self.state.mark_pushed(cycle, model, repo_id=self.repos[model], commit=commit.oid)
            self.recorded[model] = len(finished)

    def wait(self) -> list[str]:
        """Block until every push finished; the failures, one line each."""
        if self.pending:
            logger.info("Waiting for %d checkpoint push(es) to finish.", self.pending)
        for pusher in self.pushers.values():
            pusher.close()
        self.sync()
        return [f"{f.local_dir} ({f.commit_message}): {f.error}" for p in self.pushers.values() for f in p.errors]


# ----------------------------------------------------------------------------- the run


class ComparisonRun:
    def __init__(self, args: CompareArguments, data_args: CompareDataArguments, passthrough: list[str]):
        self.args, self.data_args, self.passthrough = args, data_args, passthrough
        self.out = args.output_dir
        self.sample_len = data_args.seq_len + 1
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ValueError("scripts/compare.py runs its trainings in one process; start it with `python -m "
                             "scripts.compare`, not through accelerate launch / torchrun.")
        self.global_batch = args.per_device_train_batch_size * args.gradient_accumulation_steps
        self.tokens_per_step = self.global_batch * data_args.seq_len
        self.steps_per_cycle = args.cycle_tokens // self.tokens_per_step
        if self.steps_per_cycle < 1:
            raise ValueError(
                f"--cycle_tokens={args.cycle_tokens} is less than one optimizer step of {self.tokens_per_step} tokens "
                f"(batch {self.global_batch} x seq_len {data_args.seq_len}); raise it or lower the batch / seq_len.")
        self.tokens_per_cycle = self.steps_per_cycle * self.tokens_per_step
        # Stream tokens per cycle: whole samples, exactly what the cycle's steps consume.
        self.stream_per_cycle = self.steps_per_cycle * self.global_batch * self.sample_len
        self.eval_samples = data_args.eval_tokens // self.sample_len
        self.depths = self._eval_depths()
        if args.teacher_cache_model is not None and data_args.tokenizer is None:
            raise ValueError("--teacher_cache_model needs --tokenizer: teacher and data must share one tokenizer, and "
                             "one trained by the comparison cannot match the teacher's (pass --tokenizer "
                             f"{args.teacher_cache_model}).")
        if args.teacher_cache_model is not None and _option_value(passthrough, "--teacher_model_name_or_path"):
            raise ValueError("Pass either --teacher_model_name_or_path (online teacher) or --teacher_cache_model "
                             "(a cache per cycle), not both.")
        self._check_train_args()
        self.state: CompareState | None = None
        self.pushes: CyclePushes | None = None
        self.progress: RunProgress | None = None

    # -- paths

    def heldout_dir(self) -> str:
        return os.path.join(self.out, "data", "heldout")

    def data_dir(self, cycle: int) -> str:
        return os.path.join(self.out, "data", f"cycle-{cycle:03d}")

    def teacher_cache_dir(self, cycle: int) -> str:
        return os.path.join(self.out, "data", f"cycle-{cycle:03d}-teacher")

    def stages_per_cycle(self) -> tuple[str, ...]:
        return tuple(s for s in CYCLE_STAGES if s != "cache_teacher" or self.args.teacher_cache_model is not None)

    def train_dir(self, model: str, cycle: int) -> str:
        return os.path.join(self.out, model, f"cycle-{cycle:03d}")

    # -- checks before any work

    def _eval_depths(self) -> list[int]:
        overrides = run_pretrain.parse_overrides(self.args.recurrent_config_overrides)
        mean = presets.get(self.args.recurrent_preset, **overrides).mean_recurrence
        limit = self.args.max_depth_factor * mean
        depths = sorted({d for d in self.args.eval_depths if d <= limit})
        dropped = sorted(set(self.args.eval_depths) - set(depths))
        if dropped:
            logger.info("Evaluation depths %s exceed %g x mean_recurrence (%d) and are skipped.", dropped,
                        self.args.max_depth_factor, mean)
        if not depths:
            raise ValueError(f"--eval_depths {self.args.eval_depths}: none is within --max_depth_factor "
                             f"{self.args.max_depth_factor:g} x mean_recurrence ({mean}); give smaller depths.")
        return depths

    def _check_train_args(self) -> None:
        # Parse what cycle 1 would run now, so a typo fails in seconds instead of after data preparation.
        for model in MODELS:
            argv = self.train_argv(model, 1, previous_final=None)
            try:
                run_pretrain.parse_args(argv)
            except SystemExit as err:  # argparse exits on malformed values
                raise ValueError(f"The training arguments {self.passthrough} are not valid for run_pretrain "
                                 f"(see the message above).") from err

    def identity(self) -> dict:
        compare = {k: v for k, v in dataclasses.asdict(self.args).items()
                   if k not in NON_IDENTITY_ARGS and not (k in OPTIONAL_IDENTITY_ARGS and v is None)}
        data = {k: v for k, v in dataclasses.asdict(self.data_args).items() if k not in NON_IDENTITY_ARGS}
        return {"compare": compare, "data": data, "train_args": list(self.passthrough)}

    def _remove_outputs(self) -> None:
        """What an earlier run in this directory wrote (only our own files and folders)."""
        for name in ("data", *MODELS):
            shutil.rmtree(os.path.join(self.out, name), ignore_errors=True)
        for name in ("results.jsonl", "results.md", "learning_curves.png"):
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.out, name))

    # -- stages

    def prepare_heldout(self) -> None:
        manifest = prepare(self.data_args.prepare_args(
            self.heldout_dir(), eval_only=True, max_tokens=self.eval_samples * self.sample_len))
        num_samples = manifest["splits"]["eval"]["num_samples"]
        if num_samples < self.eval_samples:
            raise ValueError(f"The data stream holds only {num_samples} samples of {self.sample_len} tokens, fewer "
                             f"than the held-out set's {self.eval_samples} (--eval_tokens); add data or lower it.")
        self.state.mark_heldout(dir=self.heldout_dir(), num_samples=num_samples,
                                stream_tokens=num_samples * self.sample_len,
                                stream_end=manifest.get("stream_end"),
                                tokenizer_hash=manifest["tokenizer_hash"],
                                shards=[s["sha256"] for s in manifest["splits"]["eval"]["shards"]])

    def tokens_before(self, cycle: int) -> int:
        """Stream tokens before cycle `cycle`'s: the held-out set's and those of the earlier cycles."""
        return self.state.heldout["stream_tokens"] + (cycle - 1) * self.stream_per_cycle

    def cycle_start(self, cycle: int) -> dict:
        """Where cycle `cycle`'s tokens begin in the stream, as prepare_data's skip arguments: the end of the
        previous piece (the held-out set before cycle 1), skipped by whole documents without tokenizing them.
        A piece recorded without its end (by a version before stream positions) is skipped by its token count
        instead, which tokenizes everything before it once; its successor records the position again."""
        previous = self.state.heldout if cycle == 1 else self.state.stage(cycle - 1, "prepare")
        end = previous.get("stream_end")
        if end is None:
            return {"skip_documents": 0, "skip_tokens": self.tokens_before(cycle)}
        return {"skip_documents": end["documents"], "skip_tokens": end["tokens"]}

    def prepare_cycle(self, cycle: int) -> None:
        skip = self.tokens_before(cycle)
        start = self.cycle_start(cycle)
        manifest = prepare(self.data_args.prepare_args(
            self.data_dir(cycle), tokenizer=None, eval_from=self.heldout_dir(), max_tokens=self.stream_per_cycle,
            **start))
        got = manifest["splits"]["train"]["num_samples"]
        needed = self.steps_per_cycle * self.global_batch
        if got < needed:
            raise ValueError(
                f"The data stream ends after {skip + got * self.sample_len:,} tokens: cycle {cycle} needs "
                f"{needed * self.sample_len:,} tokens after the {skip:,} used before it but got "
                f"{got * self.sample_len:,}. Add data (--files / --dataset), or lower --cycle_tokens or "
                "--num_cycles.")
        self.state.mark_done(cycle, "prepare", dir=self.data_dir(cycle), skip_tokens=skip, start=start,
                             stream_end=manifest.get("stream_end"), train_samples=got,
                             eval_shards=[s["sha256"] for s in manifest["splits"]["eval"]["shards"]])

    def train_argv(self, model: str, cycle: int, previous_final: str | None) -> list[str]:
        args, output_dir = self.args, self.train_dir(model, cycle)
        argv = TRAIN_DEFAULTS + list(self.passthrough) + [
            "--output_dir", output_dir,
            "--data_dir", self.data_dir(cycle),
            "--max_steps", str(self.steps_per_cycle),
            "--per_device_train_batch_size", str(args.per_device_train_batch_size),
            "--gradient_accumulation_steps", str(args.gradient_accumulation_steps),
            "--seed", str(args.seed),
        ]
        if args.teacher_cache_model is not None:
            argv += ["--teacher_cache_dir", self.teacher_cache_dir(cycle)]
        learning_rate = getattr(args, f"{model}_learning_rate")
        if learning_rate is not None:  # after the pass-through arguments, so it wins over their --learning_rate
            argv += ["--learning_rate", repr(learning_rate)]
        if previous_final is None:
            argv += ["--preset", getattr(args, f"{model}_preset")]
            overrides = getattr(args, f"{model}_config_overrides")
            if overrides:
                argv += ["--config_overrides", overrides]
        else:
            argv += ["--model_name_or_path", previous_final]
        checkpoint = last_complete_checkpoint(output_dir)
        if checkpoint is not None:
            logger.info("Resuming the interrupted training of %s, cycle %d, from %s.", model, cycle, checkpoint)
            argv += ["--resume_from_checkpoint", checkpoint]
        else:  # the cycle's folder is the pipeline's own: whatever an interrupted start left there, start afresh
            argv += ["--overwrite_output_dir", "true"]
        return argv

    def cache_teacher(self, cycle: int) -> None:
        options = {"topk": self.args.teacher_cache_topk, "quantization": self.args.teacher_cache_quantization}
        manifest = cache_teacher(CacheTeacherArguments(
            teacher_model_name_or_path=self.args.teacher_cache_model, data_dir=self.data_dir(cycle),
            output_dir=self.teacher_cache_dir(cycle), splits=["train"], device=self.args.device,
            **{k: v for k, v in options.items() if v is not None}))
        self.state.mark_done(cycle, "cache_teacher", dir=self.teacher_cache_dir(cycle), topk=manifest["topk"],
                             teacher=manifest["teacher"])

    def train(self, model: str, cycle: int) -> None:
        previous = self.state.stage(cycle - 1, f"train_{model}")["final_dir"] if cycle > 1 else None
        if previous is not None and not os.path.isfile(os.path.join(previous, "config.json")):
            raise ValueError(f"{previous}: the final checkpoint of cycle {cycle - 1} is missing, so cycle {cycle} "
                             "cannot continue from it; restore it, or start again with --overwrite.")
        tokens_before = (cycle - 1) * self.tokens_per_cycle
        callback = _StepProgress(self.progress, cycle, model, tokens_before, self.tokens_per_step)
        resumed = last_complete_checkpoint(self.train_dir(model, cycle))  # the one train_argv resumes from
        metrics = run_pretrain.main(self.train_argv(model, cycle, previous), callbacks=[callback])
        final_dir = os.path.join(self.train_dir(model, cycle), "final")
        with open(os.path.join(self.train_dir(model, cycle), "log_history.json"), encoding="utf-8") as f:
            log_history = json.load(f)
        train_loss = whole_run_train_loss(log_history, checkpoint_step(resumed) if resumed else None,
                                          metrics.get("train_loss"))
        self.state.mark_done(cycle, f"train_{model}", final_dir=final_dir, base=previous,
                             tokens_seen=cycle * self.tokens_per_cycle, steps=self.steps_per_cycle,
                             train_loss=train_loss)

    def evaluate(self, cycle: int) -> None:
        device = resolve_device(self.args.device)
        dtype = resolve_dtype(self.args.eval_dtype, device)
        tokens_seen = cycle * self.tokens_per_cycle
        records = []
        unigram_ce = None
        for model_name in MODELS:
            final_dir = self.state.stage(cycle, f"train_{model_name}")["final_dir"]
            preset = getattr(self.args, f"{model_name}_preset")
            model = load_checkpoint(final_dir, dtype, device)
            heldout = ShardedTokenDataset(self.heldout_dir(), "eval",
                                          expected_tokenizer_hash=self.state.heldout["tokenizer_hash"],
                                          model_vocab_size=model.config.vocab_size)
            if unigram_ce is None:  # over the samples evaluate_model reads
                evaluated = len(heldout) if self.args.eval_max_batches is None else min(
                    len(heldout), self.args.eval_max_batches * self.args.eval_batch_size)
                unigram_ce = unigram_cross_entropy(torch.utils.data.Subset(heldout, range(evaluated)))
            recurrent = presets.is_recurrent(model.config)
            for depth in self.depths if recurrent else [None]:
                self.progress.bar.set_postfix_str(f"cycle={cycle}, model={model_name}, stage=evaluate"
                                                  + (f" n={depth}" if depth else ""))
                metrics = evaluate_model(model, heldout, num_steps=depth, batch_size=self.args.eval_batch_size,
                                         max_batches=self.args.eval_max_batches, progress=False)
                record = {"cycle": cycle, "tokens_seen": tokens_seen, "arch": model_name, "preset": preset,
                          "kind": "recurrent" if recurrent else "transformer", "num_steps": depth,
                          "layers": unrolled_layers(model.config, depth), "checkpoint": final_dir,
                          "frequency_only_ce": unigram_ce, **metrics}
                record["model"] = _label(record)
                records.append(record)
            ce_by_depth = {r["num_steps"]: r["ce"] for r in records if r["arch"] == model_name}
            for warning in learning_warnings(f"cycle {cycle}, {preset}", ce_by_depth, unigram_ce):
                logger.warning(warning)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        for model_name in MODELS:
            self.write_card(cycle, model_name, records)
        self.state.mark_done(cycle, "evaluate", results=records)
        write_results(self.out, self.all_records())

    def write_card(self, cycle: int, model_name: str, records: list[dict]) -> None:
        """The model card of a cycle's final checkpoint, with its held-out results (rewritten before a push, so
        it names the repo pushed to)."""
        results = {}
        for r in records:
            if r["arch"] == model_name:
                results[r["num_steps"] or f"{r['layers']} layers"] = {
                    "cross-entropy": r["ce"], "perplexity": r["perplexity"], "top-1": r["top1"], "top-5": r["top5"]}
        other = self.args.baseline_preset if model_name == "recurrent" else self.args.recurrent_preset
        repo = self.args.hub_model_id if model_name == "recurrent" else self.args.baseline_repo_id
        info = ModelCardInfo(
            repo_id=repo, preset=getattr(self.args, f"{model_name}_preset"), teacher=self.teacher(),
            tokens_seen=cycle * self.tokens_per_cycle, eval_results=results,
            training_data=f"{self._source_text()}, cycle {cycle}: {cycle * self.tokens_per_cycle:,} tokens in "
                          f"cycles of {self.tokens_per_cycle:,}",
            training_details={"Comparison": f"same-data comparison with `{other}` (same tokenizer, data, order and "
                                            "seed); evaluated on a fixed held-out set of "
                                            f"{self.state.heldout['num_samples'] * self.data_args.seq_len:,} tokens"})
        write_model_card(self.state.stage(cycle, f"train_{model_name}")["final_dir"], None, info)

    def teacher(self) -> str | None:
        """The teacher both models are distilled from (a per-cycle cache or an online teacher), if any."""
        if self.args.teacher_cache_model is not None:
            return self.args.teacher_cache_model
        return _option_value(self.passthrough, "--teacher_model_name_or_path")

    def _source_text(self) -> str:
        if self.data_args.dataset:
            return f"`{self.data_args.dataset}`" + (f" ({self.data_args.dataset_config})"
                                                    if self.data_args.dataset_config else "")
        if self.data_args.files:
            return f"local files {self.data_args.files}"
        return "the embedded corpus"

    def cleanup(self, cycle: int) -> None:
        shutil.rmtree(self.data_dir(cycle), ignore_errors=True)
        shutil.rmtree(self.teacher_cache_dir(cycle), ignore_errors=True)
        for model in MODELS:  # resume checkpoints of a finished cycle; the final weights stay
            for checkpoint in glob.glob(os.path.join(self.train_dir(model, cycle), "checkpoint-*")):
                shutil.rmtree(checkpoint, ignore_errors=True)
        self.state.mark_done(cycle, "cleanup")

    def all_records(self) -> list[dict]:
        return [r for c in self.state.completed_cycles() for r in self.state.stage(c, "evaluate")["results"]]

    # -- driver

    def submit_pushes(self, cycle: int) -> None:
        for model in MODELS:
            if not self.state.is_pushed(cycle, model):
                self.write_card(cycle, model, self.state.stage(cycle, "evaluate")["results"])
                stage = self.state.stage(cycle, f"train_{model}")
                self.pushes.submit(cycle, model, stage["final_dir"], stage["tokens_seen"])

    def _stage(self, cycle: int | str, model: str, name: str, work, *work_args) -> None:
        self.progress.begin(cycle, model, name)
        with _inner_bars_off():
            work(*work_args)
        self.progress.end()
        if self.pushes is not None:
            self.pushes.sync()

    def run(self) -> dict:
        args = self.args
        os.makedirs(self.out, exist_ok=True)
        self.state = CompareState.open(os.path.join(self.out, STATE_NAME), self.identity(), args.overwrite,
                                       remove_outputs=self._remove_outputs)
        self.pushes = CyclePushes(args, self.state) if args.push_to_hub else None
        total = 1 + len(self.stages_per_cycle()) * args.num_cycles
        with logging_redirect_tqdm():
            self.progress = RunProgress(total, self.state.stages_done())
            try:
                if self.pushes is not None:  # cycles evaluated by an earlier start whose push did not finish
                    for cycle in self.state.completed_cycles():
                        if cycle <= args.num_cycles:
                            self.submit_pushes(cycle)
                if self.state.heldout is None:
                    self._stage("-", "-", "heldout", self.prepare_heldout)
                for cycle in range(1, args.num_cycles + 1):
                    self._run_cycle(cycle)
            except Exception:
                if self.pushes is not None:  # record the uploads that finish; the next start retries the rest
                    self.pushes.wait()
                raise
            finally:
                self.progress.close()
        failures = self.pushes.wait() if self.pushes is not None else []
        records = self.all_records()
        paths = write_results(self.out, records)
        if failures:
            raise RuntimeError("Pushes failed (the checkpoints are intact; the same command retries them):\n"
                               + "\n".join(failures))
        logger.info("Comparison of %d cycles in %s", len(self.state.completed_cycles()), self.out)
        return {"output_dir": self.out, "results": records, "files": paths,
                "state": os.path.join(self.out, STATE_NAME)}

    def _run_cycle(self, cycle: int) -> None:
        state = self.state
        if not state.is_done(cycle, "prepare"):
            self._stage(cycle, "-", "prepare", self.prepare_cycle, cycle)
        if "cache_teacher" in self.stages_per_cycle() and not state.is_done(cycle, "cache_teacher"):
            self._stage(cycle, "-", "cache_teacher", self.cache_teacher, cycle)
        for model in MODELS:
            if not state.is_done(cycle, f"train_{model}"):
                self._stage(cycle, model, f"train_{model}", self.train, model, cycle)
        if not state.is_done(cycle, "evaluate"):
            self._stage(cycle, "both", "evaluate", self.evaluate, cycle)
            if self.pushes is not None:
                self.submit_pushes(cycle)  # uploads while the next cycle trains
        if not state.is_done(cycle, "cleanup"):
            self._stage(cycle, "-", "cleanup", self.cleanup, cycle)


def whole_run_train_loss(log_history: list[dict], resumed_step: int | None, trainer_loss: float | None):
    """The mean training loss of a whole cycle, also when it was resumed after a kill.

    After a resume the Trainer's `train_loss` does not cover the cycle: transformers 5.24 averages the steps run
    after the resume, 5.17 divides their sum by all steps. The log history (carried over by the resume) holds `loss`
    entries, each the mean since the previous one: weighted by the steps they cover, they give the whole cycle's
    mean. Steps after the last log entry were never logged and cannot count. Without a resume the Trainer's
    figure is right and is kept."""
    if not resumed_step or trainer_loss is None:
        return trainer_loss
    logged = sorted((entry["step"], entry["loss"]) for entry in log_history if "loss" in entry and "step" in entry)
    if not logged:
        return trainer_loss
    weighted, previous = 0.0, 0
    for step, loss in logged:
        weighted += loss * (step - previous)
        previous = step
    return weighted / previous


def _option_value(argv: list[str], option: str) -> str | None:
    """The last value given to `option` in `argv` (`--option value` or `--option=value`), as argparse keeps it."""
    value = None
    for index, arg in enumerate(argv):
        if arg == option and index + 1 < len(argv):
            value = argv[index + 1]
        elif arg.startswith(option + "="):
            value = arg.split("=", 1)[1]
    return value


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    args, data_args, passthrough = parse_args(argv)
    return ComparisonRun(args, data_args, passthrough).run()


def cli(argv=None) -> int:
    """Console entry point: exit code 0 after a successful run (a failure raises, which exits non-zero)."""
    main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
