"""The arguments of a same-data comparison, parsed from one command line into typed dataclasses:

    CompareArguments        the comparison itself: cycles, the models (a recurrent one, a baseline, optionally a
                            second baseline), evaluation, per-model learning rates, the per-cycle teacher cache,
                            the baseline's Hub repo
    CompareDataArguments    the data stream, as `trainer_ext.data.prepare` reads it
    TrainingOptions         the options the trainings share: `ModelArguments`, `DataArguments` and
                            `RecurrentTrainingArguments` of `trainer_ext.training` (any of their flags), with
                            the comparison's defaults; `--output_dir`, `--seed`, the batch size and the Hub options
                            are theirs, used by the comparison as a whole

Options the pipeline sets for every cycle and model (CYCLE_FIELDS) are refused with the comparison option to use
instead.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
from dataclasses import dataclass, field

from transformers import HfArgumentParser

from hf_recurrent import presets
from trainer_ext.data.json_records import ON_BAD_LINES
from trainer_ext.data.prepare import PrepareDataArguments
from trainer_ext.distill.teacher import QUANTIZATIONS
from trainer_ext.run.model_setup import parse_overrides
from trainer_ext.training.arguments import (
    COMMAND_LINE_DEFAULTS,
    DataArguments,
    ModelArguments,
    RecurrentTrainingArguments,
)

logger = logging.getLogger(__name__)

# Training defaults of the comparison (the command line overrides them): hf-recurrent-pretrain's (seed 0, no reporting
# integrations, data loading in the main process, a cosine schedule, ...), and its own: the cycles of a model are one
# training, so the schedule spans every planned cycle and warms up once, over RUN_WARMUP_STEPS where --warmup_steps
# is left unset (hf-recurrent-pretrain's rule would give a 125M model 2,000); no mid-cycle evaluation (the pipeline
# evaluates after each cycle); a resumable checkpoint now and then; one progress display (the pipeline's) instead
# of the Trainer's.
COMPARE_TRAINING_DEFAULTS = {
    **COMMAND_LINE_DEFAULTS,
    "output_dir": os.path.join("outputs", "compare"),
    "eval_strategy": "no",
    "save_steps": 1000,
    "save_total_limit": 1,
    "logging_steps": 50,
    "disable_tqdm": True,
    # Both models train on the same batches: no memory plan choosing a batch size per model.
    "memory_plan": "none",
}
RUN_WARMUP_STEPS = 30
# Schedules whose rate at a step does not depend on the schedule's length: only their runs may be extended by more
# cycles than they were started with (with warm-up steps counted, not a fraction of the length).
LENGTH_FREE_SCHEDULES = ("constant", "constant_with_warmup", "inverse_sqrt")
# Set per cycle and model by the pipeline; setting them would break the cycle bookkeeping.
CYCLE_FIELDS = {
    "max_steps": "--cycle_tokens",
    "num_train_epochs": "--cycle_tokens",
    "data_dir": "the data options (--files / --dataset / --seq_len ...)",
    "preset": "--recurrent_preset / --baseline_preset",
    "config_overrides": "--recurrent_config_overrides / --baseline_config_overrides",
    "model_name_or_path": "nothing: each cycle continues from the previous cycle's final weights",
    "resume_from_checkpoint": "nothing: an interrupted cycle resumes by itself",
    "overwrite_output_dir": "--overwrite (an interrupted cycle without a checkpoint restarts by itself)",
    "save_final": "nothing: the next cycle starts from the final weights",
    "save_only_model": "nothing: the next cycle resumes the optimizer state of the previous one's last checkpoint",
    "teacher_cache_dir": "--teacher_cache_model (a cache built for each cycle's shards)",
    "hub_strategy": "--push_to_hub (the pipeline pushes once per cycle)",
}
# Options that neither change data, models nor results: a rerun that differs only in these continues the run
# (--trust_remote_code included: a run stopped because a teacher needs its own code continues once it is given;
# --on_bad_lines only decides whether bad JSON lines are refused, the data written is the same).
NON_IDENTITY_ARGS = ("output_dir", "num_cycles", "overwrite", "push_to_hub", "hub_model_id", "hub_baseline_model_id",
                     "hub_private_repo", "hub_token", "map_batch_size", "cache_dir", "trust_remote_code",
                     "on_bad_lines")
# Training options that shape the whole run (steps per cycle, data order): recorded with the comparison's own,
# where state files have always held them.
RUN_TRAINING_ARGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "seed")
# Options added after state files were first written: part of a run's identity only when set, so a run started
# before they existed still continues.
OPTIONAL_IDENTITY_ARGS = ("recurrent_learning_rate", "baseline_learning_rate", "teacher_cache_model",
                          "teacher_cache_topk", "teacher_cache_quantization", "compute_baseline_preset")


@dataclass
class CompareArguments:
    num_cycles: int = field(
        default=5, metadata={"help": "Cycles to run; the learning-rate schedule spans those of the run's first start "
                                     "(a later start may run fewer, and more only with a schedule whose rate does not "
                                     "depend on its length, e.g. constant_with_warmup)."})
    cycle_tokens: int = field(
        default=200_000_000, metadata={"help": "Training tokens per cycle and model (rounded down to whole steps)."})
    recurrent_preset: str = field(
        default="debug", metadata={"help": "The recurrent-depth model (e.g. recurrent-125m)."})
    baseline_preset: str = field(
        default="transformer-debug", metadata={"help": "The Transformer baseline (a transformer-* preset): of equal "
                                                       "unique parameters, or with -compute (transformer-125m-compute) "
                                                       "of equal training FLOPs per token at the recurrent model's "
                                                       "mean depth (as --recurrent_config_overrides sets it)."})
    compute_baseline_preset: str | None = field(
        default=None, metadata={"help": "A second Transformer baseline trained on the same data, so that one "
                                        "comparison reports both views: e.g. transformer-125m-compute beside "
                                        "transformer-125m. It takes --baseline_learning_rate and no config overrides "
                                        "(a -compute preset's layers are derived as for --baseline_preset)."})
    recurrent_config_overrides: str | None = field(
        default=None, metadata={"help": "Config fields of the recurrent model, e.g. 'mean_recurrence=8'."})
    baseline_config_overrides: str | None = field(default=None, metadata={"help": "Config fields of the baseline."})
    recurrent_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the recurrent model only (default: --learning_rate). The "
                                        "recurrent presets need a lower one than their Transformer peers."})
    baseline_learning_rate: float | None = field(
        default=None, metadata={"help": "Learning rate of the baseline only (default: --learning_rate)."})
    teacher_cache_model: str | None = field(
        default=None, metadata={"help": "Distil every model from this teacher through a top-k cache built for each "
                                        "cycle's shards and deleted with them (needs --tokenizer of the teacher)."})
    teacher_cache_topk: int | None = field(default=None, metadata={"help": "Token ids per position (default 64)."})
    teacher_cache_quantization: str | None = field(
        default=None, metadata={"help": "8bit or 4bit: load the cached teacher quantized (CUDA; default: bf16)."})
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
    hub_baseline_model_id: str | None = field(
        default=None, metadata={"help": "Hub repo of the baseline (default: <hub_model_id>-baseline)."})
    overwrite: bool = field(
        default=False, metadata={"help": "Discard a run made in --output_dir with other settings and start again."})

    def __post_init__(self):
        for name in ("num_cycles", "cycle_tokens", "eval_batch_size", "eval_max_batches", "teacher_cache_topk"):
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
        for name, recurrent in (("recurrent_preset", True), ("baseline_preset", False),
                                ("compute_baseline_preset", False)):
            preset = getattr(self, name)
            if preset is None:  # only the second baseline is optional
                continue
            if preset not in presets.NAMES:
                raise ValueError(f"--{name}={preset!r} is not a preset; choose one of {list(presets.NAMES)}.")
            if presets.is_recurrent(presets.get(preset)) != recurrent:
                kind = "a recurrent-depth" if recurrent else "a Transformer (transformer-*)"
                raise ValueError(f"--{name}={preset!r} is not {kind} preset.")
        if self.compute_baseline_preset == self.baseline_preset:
            raise ValueError(f"--compute_baseline_preset={self.compute_baseline_preset!r} is the baseline itself; give "
                             "another preset (e.g. the -compute one) or leave it unset.")
        if self.eval_dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"--eval_dtype={self.eval_dtype!r}: choose one of ['auto', 'bfloat16', 'float32'].")


@dataclass
class CompareDataArguments:
    """The data stream, as `trainer_ext.data.prepare` reads it (see PrepareDataArguments for each option)."""

    files: list[str] | None = field(default=None, metadata={"help": "Local text/JSONL/parquet files or globs."})
    dataset: str | None = field(default=None, metadata={"help": "A datasets hub name (streamed)."})
    dataset_config: str | None = field(default=None, metadata={"help": "Config (subset) of --dataset."})
    split: str = field(default="train", metadata={"help": "Split of --dataset."})
    text_column: str = field(default="text", metadata={"help": "Column holding document text."})
    text_sample_by: str = field(default="document", metadata={"help": "document, paragraph or line (.txt files)."})
    on_bad_lines: str = field(default="skip", metadata={
        "help": "A JSON line that holds no document: 'skip' (left out, counted, named) or 'error' (refused, naming the "
                "file and line, before any work)."})
    max_documents: int | None = field(default=None, metadata={"help": "Read at most this many documents."})
    tokenizer: str | None = field(
        default=None, metadata={"help": "Tokenizer path or hub id; default: a BPE trained once, before cycle 1."})
    vocab_size: int = field(default=8192, metadata={"help": "Vocabulary of the trained BPE."})
    tokenizer_train_documents: int = field(default=100_000, metadata={"help": "Documents the BPE is trained on."})
    seq_len: int = field(default=256, metadata={"help": "Context length of training and evaluation samples."})
    eval_tokens: int = field(
        default=1_000_000, metadata={"help": "Size of the held-out set: the first tokens of the stream."})
    shard_size: int = field(default=32768, metadata={"help": "Samples per shard file."})
    map_batch_size: int = field(default=1000, metadata={"help": "Documents per tokenization batch."})
    cache_dir: str | None = field(default=None, metadata={"help": "datasets cache dir."})

    def __post_init__(self):
        if self.on_bad_lines not in ON_BAD_LINES:
            raise ValueError(f"--on_bad_lines must be one of {list(ON_BAD_LINES)}, got '{self.on_bad_lines}'.")
        if self.eval_tokens < self.seq_len + 1:
            raise ValueError(f"--eval_tokens={self.eval_tokens} is less than one sample (seq_len + 1 = "
                             f"{self.seq_len + 1} tokens); raise it.")

    def prepare_args(self, output_dir: str, **extra) -> PrepareDataArguments:
        """The preparation of one piece of the stream into `output_dir` (`extra`: where it starts, how long)."""
        source = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name != "eval_tokens"}
        return PrepareDataArguments(output_dir=output_dir, disable_tqdm=True, **{**source, **extra})


@dataclass
class TrainingOptions:
    """What the trainings share, before the pipeline sets the CYCLE_FIELDS of each model and cycle."""

    model: ModelArguments
    data: DataArguments
    training: RecurrentTrainingArguments


def changed_options(options: TrainingOptions) -> list[tuple[str, object]]:
    """(option, value) of every training option that differs from the comparison's default, in field order."""
    defaults = (ModelArguments(), DataArguments(), RecurrentTrainingArguments(**COMPARE_TRAINING_DEFAULTS))
    current = (options.model, options.data, options.training)
    return [(name, value) for part, default in zip(current, defaults)
            for name, value in _as_dict(part).items() if value != _as_dict(default).get(name)]


def check_training_options(options: TrainingOptions) -> None:
    """Refuse the options the pipeline sets for every cycle and model, naming the comparison option to use."""
    for name, _ in changed_options(options):
        if name in CYCLE_FIELDS:
            raise ValueError(f"--{name} is set by the comparison for every cycle; use {CYCLE_FIELDS[name]} instead.")


def schedule_depends_on_length(training: RecurrentTrainingArguments) -> bool:
    """Whether the learning rate at a step depends on the schedule's length (cosine, linear, warmup_stable_decay, a
    warm-up given as a fraction), so that a run planned over N cycles cannot continue past them."""
    warmup = training.warmup_steps
    return (getattr(training.lr_scheduler_type, "value", training.lr_scheduler_type) not in LENGTH_FREE_SCHEDULES
            or (warmup is not None and 0 < warmup < 1))


def model_option(args: CompareArguments, model: str, name: str):
    """`model`'s preset, config_overrides or learning_rate (--<model>_<name>); the second baseline has no config
    overrides of its own and takes the baseline's learning rate."""
    if model == "compute_baseline" and name != "preset":
        return args.baseline_learning_rate if name == "learning_rate" else None
    return getattr(args, f"{model}_{name}")


def model_config_overrides(args: CompareArguments, model: str, seq_len: int) -> str | None:
    """`model`'s --config_overrides. A baseline of equal compute (a -compute preset) takes the layers that match the
    training FLOPs per token of the recurrent model as `args` override it (its depths, its widths) at `seq_len`,
    unless its config overrides set num_hidden_layers themselves."""
    given, preset = model_option(args, model, "config_overrides"), model_option(args, model, "preset")
    if model == "recurrent" or not preset.endswith("-compute") or "num_hidden_layers" in parse_overrides(given):
        return given
    recurrent = presets.get(args.recurrent_preset, **parse_overrides(args.recurrent_config_overrides))
    layers = presets.compute_matched_layers(recurrent, seq_len=seq_len)
    logger.info("Baseline %s: %d layers, the training FLOPs per token of %s at mean depth %d (gradients through %s "
                "steps) at seq %d.", preset, layers, args.recurrent_preset, recurrent.mean_recurrence,
                recurrent.backprop_depth or "all", seq_len)
    return ",".join(filter(None, [given, f"num_hidden_layers={layers}"]))


def _as_dict(arguments) -> dict:
    return arguments.to_dict() if hasattr(arguments, "to_dict") else dataclasses.asdict(arguments)


def parse_args(argv: list[str] | None = None) -> tuple[CompareArguments, CompareDataArguments, TrainingOptions]:
    """The comparison's arguments from a command line (default: sys.argv)."""
    # No abbreviations: a training option must never be taken for a prefix of one of the comparison's.
    parser = HfArgumentParser((CompareArguments, CompareDataArguments, ModelArguments, DataArguments,
                               RecurrentTrainingArguments), allow_abbrev=False)
    parser.set_defaults(**COMPARE_TRAINING_DEFAULTS)
    argv = sys.argv[1:] if argv is None else list(argv)
    args, data_args, model_args, train_data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    return args, data_args, TrainingOptions(model_args, train_data_args, training_args)
