"""From arguments to a run in one pass: `TrainingJob.resolve` takes the parsed model, data and training arguments,
takes every decision they allow once (the config overrides against the preset, the model's config, the model and
teacher folders, the teacher cache, the learning rate of a sweep file, the checkpoint a run resumes) and checks each
as it is taken, before any work; `pretrain`, `find_lr` and the comparison's cycles then use the job, and nothing is
parsed or checked again. `TrainingJob.prepare_data` is the first work: the shards (the embedded corpus prepared on
first use) and their tokenizer, with the decisions that need them.

`parse_args_with_defaults` reads a command line (or one .json/.yaml file) into the argument dataclasses.
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass

from transformers import AutoConfig, HfArgumentParser, PretrainedConfig

from hf_recurrent import presets
from trainer_ext.checkpoints import check_model_dir, check_resume_files
from trainer_ext.data.prepare import DEFAULT_OUTPUT_DIR, PrepareDataArguments, prepare
from trainer_ext.data.shards import read_manifest
from trainer_ext.distill.cache import check_cache_divergence, read_teacher_manifest
from trainer_ext.files import one_process_writes
from trainer_ext.lr_search.sweep_file import read_sweep_choice
from trainer_ext.run.model_setup import (
    check_depth_arguments,
    check_overrides,
    check_teacher_tokenizer,
    load_data_tokenizer,
    parse_overrides,
    resolve_vocab_size,
)
from trainer_ext.training.arguments import (
    COMMAND_LINE_DEFAULTS,
    DataArguments,
    ModelArguments,
    RecurrentTrainingArguments,
)
from trainer_ext.training.depth_supervision import EXIT_GATE_WITH_A_TEACHER
from trainer_ext.training.distributed import check_processes_coordinated
from trainer_ext.training.output_dir import check_steps_left, resolve_checkpoint

logger = logging.getLogger(__name__)

# Where a run without --data_dir finds the embedded corpus (prepared there on first use).
DEFAULT_DATA_DIR = DEFAULT_OUTPUT_DIR


def parse_args_with_defaults(dataclass_types: tuple, argv=None, command_line_defaults=COMMAND_LINE_DEFAULTS):
    """The dataclasses of a command line, with `command_line_defaults` ({field: value}) in place of the dataclasses'
    own defaults, or of a single .json/.yaml file argument (the dataclasses' own defaults)."""
    parser = HfArgumentParser(dataclass_types)
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        return parser.parse_yaml_file(argv[0]) if argv[0].endswith("ml") else parser.parse_json_file(argv[0])
    parser.set_defaults(**command_line_defaults)
    return parser.parse_args_into_dataclasses(args=argv)


@dataclass
class JobData:
    """The prepared shards a job trains on: their folder, manifest and tokenizer."""

    data_dir: str
    manifest: dict
    tokenizer: object


@dataclass
class TrainingJob:
    """Every decision of a training run that its arguments allow, taken and checked once (`resolve`)."""

    model_args: ModelArguments
    data_args: DataArguments
    training_args: RecurrentTrainingArguments
    overrides: dict  # --config_overrides, parsed and checked against the preset's config class
    # The model's config as known before the data: the preset with its overrides (the vocabulary comes from the
    # data's tokenizer, `model_config`), or a local checkpoint's config.json; None for a hub id (read once downloaded).
    config: PretrainedConfig | None
    teacher_cache: dict | None  # the manifest of --teacher_cache_dir (read once it exists)
    swept_learning_rate: float | None  # the rate --learning_rate_from's sweep chose
    checkpoint: str | None  # the checkpoint the run resumes (None: it starts afresh)
    checkpoint_found: bool  # found in --output_dir (not named by --resume_from_checkpoint)
    teacher_tokenizer_checked: bool  # against the data's tokenizer, which may exist only once the data is prepared

    @classmethod
    def resolve(cls, model_args: ModelArguments, data_args: DataArguments, training_args: RecurrentTrainingArguments,
                pretraining: bool = True) -> TrainingJob:
        """The job of these arguments, each decision checked as it is taken (ValueError naming the argument and the
        fix); writes nothing. `pretraining`: also the sweep file and the output folder (resume, refuse, or start
        afresh; see `output_dir.resolve_checkpoint`), down to the files of the checkpoint a resume would read; the
        threshold test keeps its own folder and schedule."""
        check_processes_coordinated(training_args.distributed_state)
        overrides = check_overrides(parse_overrides(model_args.config_overrides), model_args.preset,
                                    model_args.model_name_or_path)
        config = _config_before_data(model_args, overrides)
        if config is not None:  # else a hub id: checked once its config is downloaded
            check_depth_arguments(training_args, config)
        for option, path in (("--model_name_or_path", model_args.model_name_or_path),
                             ("--teacher_model_name_or_path", model_args.teacher_model_name_or_path)):
            if path:  # a run folder or truncated weights, found now rather than after the student is built
                check_model_dir(path, option)
        if data_args.teacher_cache_dir and model_args.teacher_model_name_or_path:
            raise ValueError("Pass either --teacher_model_name_or_path (online) or --teacher_cache_dir (offline).")
        if data_args.teacher_cache_dir and not training_args.dataloader_num_workers \
                and training_args.device.type == "cuda":
            # A cached sample is decoded on the host (1-2 ms at k = 64): while a GPU computes, worker processes decode
            # ahead of the steps (in the training process each step waited for its batch's decoding; BENCHMARKS.md,
            # "Decoding the cache"); on a CPU they would only share its cores with the training.
            training_args.dataloader_num_workers = data_args.teacher_cache_workers
            training_args.dataloader_persistent_workers = data_args.teacher_cache_workers > 0
        distilling = data_args.teacher_cache_dir or model_args.teacher_model_name_or_path
        if distilling and config is not None and getattr(config, "exit_gate", False):
            raise ValueError(EXIT_GATE_WITH_A_TEACHER)
        job = cls(model_args, data_args, training_args, overrides, config, teacher_cache=None,
                  swept_learning_rate=None, checkpoint=None, checkpoint_found=False, teacher_tokenizer_checked=False)
        cache_dir = data_args.teacher_cache_dir
        if cache_dir and os.path.exists(cache_dir):  # else built later (the comparison's per cycle): read then
            job.teacher_cache = read_teacher_manifest(cache_dir)
            check_cache_divergence(job.teacher_cache, cache_dir, training_args.distill_divergence)
        teacher = model_args.teacher_model_name_or_path
        if teacher and os.path.isdir(teacher):  # a hub id's tokenizer is downloaded once the data is prepared
            data_dir = data_args.data_dir
            prepared = data_dir and os.path.isfile(os.path.join(data_dir, "manifest.json"))
            data_tokenizer = load_data_tokenizer(data_dir) if prepared else None
            check_teacher_tokenizer(teacher, data_tokenizer, model_args.trust_remote_code)
            job.teacher_tokenizer_checked = data_tokenizer is not None
        if pretraining:
            if training_args.learning_rate_from:
                job.swept_learning_rate = read_sweep_choice(training_args.learning_rate_from)["learning_rate"]
            job.checkpoint = resolve_checkpoint(training_args)
            job.checkpoint_found = job.checkpoint is not None and training_args.resume_from_checkpoint is None
            if job.checkpoint is not None:
                check_resume_files(job.checkpoint)
                if job.checkpoint_found and training_args.max_steps is not None:
                    check_steps_left(job.checkpoint, training_args)  # else once the schedule is known
        return job

    def prepare_data(self) -> JobData:
        """The shards of --data_dir once their manifest reads (a clear error naming the file and the fix), or the
        embedded corpus in DEFAULT_DATA_DIR (prepared on first use); with their tokenizer. What needed them and
        could not be decided before is decided here: the online teacher's tokenizer against the data's (a hub id's
        downloaded now), the teacher cache's manifest."""
        data_dir = self.data_args.data_dir
        if data_dir is None:
            data_dir = DEFAULT_DATA_DIR
            # Under torchrun / accelerate launch one process prepares while the others wait, then read: two
            # processes writing the same shard files would break each other's.
            with one_process_writes(f"the embedded corpus in {DEFAULT_DATA_DIR}") as writes:
                if writes and not os.path.exists(os.path.join(DEFAULT_DATA_DIR, "manifest.json")):
                    logger.info("Preparing the embedded corpus in %s", DEFAULT_DATA_DIR)
                    prepare(PrepareDataArguments(output_dir=DEFAULT_DATA_DIR))
        manifest = read_manifest(data_dir)
        tokenizer = load_data_tokenizer(data_dir)
        teacher = self.model_args.teacher_model_name_or_path
        if teacher and not self.teacher_tokenizer_checked:
            check_teacher_tokenizer(teacher, tokenizer, self.model_args.trust_remote_code)
            self.teacher_tokenizer_checked = True
        if self.data_args.teacher_cache_dir and self.teacher_cache is None:
            self.teacher_cache = read_teacher_manifest(self.data_args.teacher_cache_dir)
            check_cache_divergence(self.teacher_cache, self.data_args.teacher_cache_dir,
                                   self.training_args.distill_divergence)
        return JobData(data_dir, manifest, tokenizer)

    def model_config(self, data: JobData) -> PretrainedConfig | None:
        """The config of a fresh --preset model with the data's vocabulary and special tokens, its context at least
        the data's samples (None with --model_name_or_path, whose checkpoint has one)."""
        seq_len, tokenizer = data.manifest["seq_len"], data.tokenizer
        if self.model_args.model_name_or_path:
            context = getattr(self.config, "max_position_embeddings", None)  # None: a hub id, not read yet
            if context is not None and context < seq_len:
                logger.warning("%s was made for %d positions and --data_dir %s has samples of %d: rotary positions "
                               "beyond it were never trained; its config keeps %d.", self.model_args.model_name_or_path,
                               context, data.data_dir, seq_len, context)
            return None
        vocab_size = resolve_vocab_size(self.overrides, len(tokenizer))
        config = presets.get(self.model_args.preset, vocab_size=vocab_size, **_shape_overrides(self.overrides))
        config.pad_token_id = tokenizer.pad_token_id
        config.bos_token_id = tokenizer.bos_token_id
        config.eos_token_id = tokenizer.eos_token_id
        if config.max_position_embeddings < seq_len:
            if "max_position_embeddings" in self.overrides:
                raise ValueError(f"--config_overrides max_position_embeddings={config.max_position_embeddings} is "
                                 f"shorter than the samples of --data_dir {data.data_dir} ({seq_len} tokens); give at "
                                 f"least {seq_len}, or prepare the data with a shorter --seq_len.")
            logger.info("The model's context (max_position_embeddings) is the data's %d tokens, beyond preset %s's %d.",
                        seq_len, self.model_args.preset, config.max_position_embeddings)
            config.max_position_embeddings = seq_len
        return config

    @property
    def distill_topk(self) -> int:
        """The teacher cache's k (0 without one)."""
        return self.teacher_cache["topk"] if self.teacher_cache else 0

    @property
    def teacher_name(self) -> str | None:
        """The teacher distilled from: the online one, or the one the cache was built with."""
        if self.teacher_cache:
            return self.teacher_cache["teacher"]["name_or_path"]
        return self.model_args.teacher_model_name_or_path


def _shape_overrides(overrides: dict) -> dict:
    """The overrides that shape the model; the vocabulary is decided with the data's tokenizer."""
    return {key: value for key, value in overrides.items() if key != "vocab_size"}


def _config_before_data(model_args: ModelArguments, overrides: dict) -> PretrainedConfig | None:
    """The preset with its checked overrides, or the config.json of a local --model_name_or_path; None for a hub id.
    Reads, writes nothing."""
    path = model_args.model_name_or_path
    if path:
        if not os.path.isfile(os.path.join(path, "config.json")):
            return None
        return AutoConfig.from_pretrained(path, trust_remote_code=model_args.trust_remote_code)
    return presets.get(model_args.preset, **_shape_overrides(overrides))
