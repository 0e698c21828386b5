"""Pretraining as one library call: `pretrain(model_args, data_args, training_args)` trains a recurrent-depth model
(or its Transformer baseline) with RecurrentTrainer and writes `<output_dir>/final` (safetensors, config with
auto_map, modeling code, tokenizer, model card) and `<output_dir>/log_history.json`.

`check_pretrain_arguments` runs every check the arguments alone allow, before any work (`pretrain` calls it first;
a pipeline that trains later can call it up front). `parse_pretrain_args` reads a command line or one .json/.yaml
file into the three argument dataclasses. Without `data_dir` the embedded corpus is prepared first.
"""

import gc
import logging
import math
import os
import sys

import torch
from transformers import HfArgumentParser, set_seed

from hf_recurrent.cost import tokens_per_optimizer_step
from trainer_ext.data.prepare import DEFAULT_OUTPUT_DIR, PrepareDataArguments, prepare
from trainer_ext.data.shards import ShardedTokenDataset, read_manifest, tokenizer_hash
from trainer_ext.distill.cache import TeacherCacheDataset, read_teacher_manifest
from trainer_ext.files import write_json
from trainer_ext.hub.callbacks import HubPushCallback, ModelCardCallback
from trainer_ext.hub.model_card import ModelCardInfo, write_model_card
from trainer_ext.training.arguments import (
    COMMAND_LINE_DEFAULTS,
    DataArguments,
    ModelArguments,
    RecurrentTrainingArguments,
    resolve_schedule_defaults,
)
from trainer_ext.checkpoints import FINAL_DIR, check_model_dir, check_resume_files
from trainer_ext.training.distributed import check_processes_coordinated
from trainer_ext.lr_search.sweep_file import read_sweep_choice
from trainer_ext.memory.plan import apply_memory_plan
from trainer_ext.run.model_setup import (
    build_config,
    build_model,
    check_depth_arguments,
    check_overrides,
    check_teacher_tokenizer,
    config_before_data,
    load_data_tokenizer,
    load_teacher_for,
    parse_overrides,
)
from trainer_ext.training.output_dir import check_steps_left, clear_output_dir, log_resume, resolve_checkpoint
from trainer_ext.training.trainer import RecurrentTrainer

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


def parse_pretrain_args(argv=None) -> tuple[ModelArguments, DataArguments, RecurrentTrainingArguments]:
    """(model_args, data_args, training_args) of a pretraining command line (sys.argv without `argv`)."""
    return tuple(parse_args_with_defaults((ModelArguments, DataArguments, RecurrentTrainingArguments), argv))


def check_model_arguments(model_args: ModelArguments, data_args: DataArguments,
                          training_args: RecurrentTrainingArguments) -> None:
    """The checks of what a run trains and on what, before any work; writes nothing. Shared by pretraining and the
    learning-rate threshold test.

    The processes of a launch (a group, not each one alone), the config overrides against the preset, the training
    depths against the model's config, the model and teacher folders (and the teacher's tokenizer against the
    data's, where the data is prepared), one teacher source."""
    check_processes_coordinated(training_args.distributed_state)
    check_overrides(parse_overrides(model_args.config_overrides), model_args.preset, model_args.model_name_or_path)
    config = config_before_data(model_args)
    if config is not None:  # else a hub id: checked once its config is downloaded
        check_depth_arguments(training_args, config)
    for option, path in (("--model_name_or_path", model_args.model_name_or_path),
                         ("--teacher_model_name_or_path", model_args.teacher_model_name_or_path)):
        if path:  # a run folder or truncated weights, found now rather than after the student is built
            check_model_dir(path, option)
    if data_args.teacher_cache_dir and model_args.teacher_model_name_or_path:
        raise ValueError("Pass either --teacher_model_name_or_path (online) or --teacher_cache_dir (offline).")
    teacher = model_args.teacher_model_name_or_path
    if teacher and os.path.isdir(teacher):  # a hub id's tokenizer is downloaded with the teacher
        data_dir = data_args.data_dir
        prepared = data_dir and os.path.isfile(os.path.join(data_dir, "manifest.json"))
        check_teacher_tokenizer(teacher, load_data_tokenizer(data_dir) if prepared else None,
                                model_args.trust_remote_code)


def check_pretrain_arguments(model_args: ModelArguments, data_args: DataArguments,
                             training_args: RecurrentTrainingArguments) -> None:
    """Every check the arguments allow before any work (data preparation, model initialisation); writes nothing.

    `check_model_arguments`, the learning-rate sweep file, and the output directory (resume, refuse, or start
    afresh; see `output_dir.resolve_checkpoint`), down to the files of the checkpoint a resume would read."""
    check_model_arguments(model_args, data_args, training_args)
    if training_args.learning_rate_from:
        read_sweep_choice(training_args.learning_rate_from)
    checkpoint = resolve_checkpoint(training_args)
    if checkpoint is not None:
        check_resume_files(checkpoint)
        if training_args.resume_from_checkpoint is None and training_args.max_steps is not None:
            check_steps_left(checkpoint, training_args)  # a finished run; else checked once the schedule is known


def ensure_data(data_dir: str | None) -> str:
    """`data_dir` once its manifest reads, or the embedded corpus in DEFAULT_DATA_DIR (prepared on first use)."""
    if data_dir is not None:
        read_manifest(data_dir)  # a clear error naming the file and the fix, before anything else loads
        return data_dir
    if not os.path.exists(os.path.join(DEFAULT_DATA_DIR, "manifest.json")):
        logger.info("Preparing the embedded corpus in %s", DEFAULT_DATA_DIR)
        prepare(PrepareDataArguments(output_dir=DEFAULT_DATA_DIR))
    return DEFAULT_DATA_DIR


def load_datasets(data_dir: str, data_args: DataArguments, tokenizer, model_vocab_size: int):
    """(train, eval) sets of the shards, the train set carrying the teacher cache's top-k if one is given."""
    expected = tokenizer_hash(tokenizer)
    train_set = ShardedTokenDataset(data_dir, "train", expected_tokenizer_hash=expected,
                                    model_vocab_size=model_vocab_size)
    eval_set = ShardedTokenDataset(data_dir, "eval", expected_tokenizer_hash=expected,
                                   model_vocab_size=model_vocab_size)
    if data_args.teacher_cache_dir:
        train_set = TeacherCacheDataset(train_set, data_args.teacher_cache_dir)  # validates before training
    if data_args.max_eval_samples is not None and len(eval_set) > data_args.max_eval_samples:
        eval_set = torch.utils.data.Subset(eval_set, range(data_args.max_eval_samples))
    return train_set, eval_set


def pretrain(model_args: ModelArguments, data_args: DataArguments, training_args: RecurrentTrainingArguments,
             callbacks=None) -> dict:
    """Train, evaluate and save; returns the train and eval metrics (with `eval_perplexity`).

    Fills the schedule fields left None (`resolve_schedule_defaults`, from the model's size), in place."""
    check_pretrain_arguments(model_args, data_args, training_args)
    checkpoint = resolve_checkpoint(training_args)
    log_resume(checkpoint, training_args)
    gc.collect()  # an earlier training of this process (the comparison's cycles) frees its tensors before this one's
    found_in_output_dir = checkpoint is not None and training_args.resume_from_checkpoint is None
    set_seed(training_args.seed)

    data_dir = ensure_data(data_args.data_dir)
    tokenizer = load_data_tokenizer(data_dir)
    config = build_config(model_args, tokenizer)
    model = build_model(model_args, len(tokenizer), tokenizer, training_args.device, config=config)
    if config is None:
        check_depth_arguments(training_args, model.config)
    train_set, eval_set = load_datasets(data_dir, data_args, tokenizer, model.config.vocab_size)
    teacher_name = model_args.teacher_model_name_or_path
    if data_args.teacher_cache_dir:
        teacher_name = read_teacher_manifest(data_args.teacher_cache_dir)["teacher"]["name_or_path"]
    params = sum(p.numel() for p in model.parameters())
    applied = resolve_schedule_defaults(training_args, params)
    if applied:
        logger.info("Defaults for a model of %.0fM parameters (set them to override): %s", params / 1e6, applied)
    if found_in_output_dir:
        check_steps_left(checkpoint, training_args)
    logger.info("Model %s: %.2fM unique parameters, %d train samples of %d tokens",
                model_args.model_name_or_path or model_args.preset, params / 1e6, len(train_set), train_set.seq_len)

    plan_callbacks = apply_memory_plan(
        training_args, model.config, train_set.seq_len, next(model.parameters()).element_size(),
        distill_topk=read_teacher_manifest(data_args.teacher_cache_dir)["topk"] if data_args.teacher_cache_dir else 0,
        online_teacher=bool(model_args.teacher_model_name_or_path))
    teacher = load_teacher_for(model_args, tokenizer, training_args.device)
    manifest = read_manifest(data_dir)
    card = ModelCardInfo(
        preset=None if model_args.model_name_or_path else model_args.preset,
        base_model=model_args.model_name_or_path,
        teacher=teacher_name,
        training_data=f"{', '.join(str(src) for src in manifest.get('sources', [])) or data_dir} "
                      f"({manifest.get('total_tokens', train_set.num_tokens):,} tokens prepared)",
    )
    tokens_per_step = tokens_per_optimizer_step(training_args, manifest["seq_len"])
    # Takes the push over from the Trainer (which would leave out the modeling code) when --push_to_hub is set.
    card_callback = (HubPushCallback.from_training_args(training_args, card, tokens_per_step)
                     or ModelCardCallback(card, tokens_per_step))
    trainer = RecurrentTrainer(model=model, args=training_args, train_dataset=train_set, eval_dataset=eval_set,
                               processing_class=tokenizer, teacher=teacher, teacher_vocab_limit=len(tokenizer),
                               callbacks=[card_callback, *plan_callbacks, *(callbacks or [])])
    if training_args.overwrite_output_dir and trainer.args.should_save:
        removed = clear_output_dir(training_args.output_dir)
        if removed:
            logger.warning("--overwrite_output_dir: deleted the previous run's %s",
                           ", ".join(os.path.basename(path) + "/" for path in removed))
    trainer.accelerator.wait_for_everyone()
    training_args.resume_from_checkpoint = checkpoint
    train_result = trainer.train(resume_from_checkpoint=checkpoint)
    metrics = dict(train_result.metrics)
    eval_metrics = trainer.evaluate()
    eval_metrics["eval_perplexity"] = math.exp(min(eval_metrics["eval_loss"], 50))
    metrics.update(eval_metrics)

    final_dir = os.path.join(training_args.output_dir, FINAL_DIR)
    if data_args.save_final:
        trainer.save_model(final_dir)  # every process: a collective under FSDP
    if not trainer.is_world_process_zero():
        return metrics
    write_json(os.path.join(training_args.output_dir, "log_history.json"), trainer.state.log_history)
    logger.info("Eval loss %.4f (perplexity %.2f)", eval_metrics["eval_loss"], eval_metrics["eval_perplexity"])
    if data_args.save_final:
        write_json(os.path.join(final_dir, "train_metrics.json"), metrics)
        eval_depth = training_args.eval_num_steps or getattr(model.config, "mean_recurrence", None)
        card.tokens_seen = trainer.state.global_step * tokens_per_step
        card.eval_results = {eval_depth or 1: {"cross-entropy": eval_metrics["eval_loss"],
                                                "perplexity": eval_metrics["eval_perplexity"]}}
        write_model_card(final_dir, model, card)
        if isinstance(card_callback, HubPushCallback):
            card_callback.pusher.submit(final_dir, f"final: {card.tokens_seen:,} tokens")
            card_callback.pusher.wait()
        logger.info("Checkpoint in %s", final_dir)
    return metrics
