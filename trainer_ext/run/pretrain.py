"""Pretraining as one library call: `pretrain(job)` trains a recurrent-depth model (or its Transformer baseline)
with RecurrentTrainer and writes `<output_dir>/final` (safetensors, config with auto_map, modeling code, tokenizer,
model card) and `<output_dir>/log_history.json`.

`parse_pretrain_args` reads a command line or one .json/.yaml file into the three argument dataclasses;
`parse_pretrain_job` also resolves them into a `TrainingJob` (`trainer_ext.run.job`: every check the arguments
allow, before any work). Without `data_dir` the embedded corpus is prepared first.
"""

import gc
import logging
import math
import os

import torch
from transformers import set_seed

from hf_recurrent.cost import tokens_per_optimizer_step
from trainer_ext.checkpoints import FINAL_DIR
from trainer_ext.data.corpus import hub_datasets, source_text
from trainer_ext.data.shards import ShardedTokenDataset, tokenizer_hash
from trainer_ext.distill.cache import TeacherCacheDataset
from trainer_ext.files import write_json
from trainer_ext.hub.callbacks import HubPushCallback, ModelCardCallback
from trainer_ext.hub.model_card import ModelCardInfo, data_prompt, write_model_card
from trainer_ext.memory.plan import apply_memory_plan
from trainer_ext.run.job import TrainingJob, parse_args_with_defaults
from trainer_ext.run.model_setup import build_model, check_depth_arguments, load_teacher_for
from trainer_ext.training.arguments import (
    DataArguments,
    ModelArguments,
    RecurrentTrainingArguments,
    resolve_schedule_defaults,
)
from trainer_ext.training.output_dir import check_steps_left, clear_output_dir, log_resume, resume_momentum
from trainer_ext.training.trainer import RecurrentTrainer

logger = logging.getLogger(__name__)


def parse_pretrain_args(argv=None) -> tuple[ModelArguments, DataArguments, RecurrentTrainingArguments]:
    """(model_args, data_args, training_args) of a pretraining command line (sys.argv without `argv`)."""
    return tuple(parse_args_with_defaults((ModelArguments, DataArguments, RecurrentTrainingArguments), argv))


def parse_pretrain_job(argv=None) -> TrainingJob:
    """The job of a pretraining command line: parsed, then resolved and checked (`TrainingJob.resolve`)."""
    return TrainingJob.resolve(*parse_pretrain_args(argv))


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


def final_evaluation(trainer) -> dict:
    """The eval metrics of the trained weights: those the Trainer logged at the last step, where its schedule evaluated
    there (--eval_steps dividing --max_steps), else a new evaluation; evaluating the same weights twice would only
    cost the time again. With --load_best_model_at_end the weights are those of another step: evaluated anew."""
    state = trainer.state
    if not trainer.args.load_best_model_at_end:
        for entry in reversed(state.log_history):
            if entry.get("step") != state.global_step:
                break
            if "eval_loss" in entry:
                return {key: value for key, value in entry.items() if key != "step"}
    return trainer.evaluate()


def pretrain(job: TrainingJob, callbacks=None) -> dict:
    """Train, evaluate and save; returns the train and eval metrics (with `eval_perplexity`).

    Fills the schedule fields left None (`resolve_schedule_defaults`, from the model's size), in place."""
    model_args, data_args, training_args = job.model_args, job.data_args, job.training_args
    checkpoint = job.checkpoint
    log_resume(checkpoint, training_args)
    resume_momentum(checkpoint, training_args)  # before the memory plan: a resumed optimizer keeps its momentum
    gc.collect()  # an earlier training of this process (the comparison's cycles) frees its tensors before this one's
    set_seed(training_args.seed)

    data = job.prepare_data()
    tokenizer = data.tokenizer
    config = job.model_config(data)
    model = build_model(model_args, training_args.device, config)
    if config is None and job.config is None:  # a hub id: its config is known now
        check_depth_arguments(training_args, model.config)
    train_set, eval_set = load_datasets(data.data_dir, data_args, tokenizer, model.config.vocab_size)
    params = sum(p.numel() for p in model.parameters())
    steps_unknown = training_args.max_steps is None  # the job could not check a found checkpoint's steps left
    applied = resolve_schedule_defaults(training_args, params, job.swept_learning_rate)
    if applied:
        logger.info("Defaults for a model of %.0fM parameters (set them to override): %s", params / 1e6, applied)
    if job.checkpoint_found and steps_unknown:
        check_steps_left(checkpoint, training_args)
    logger.info("Model %s: %.2fM unique parameters, %d train samples of %d tokens",
                model_args.model_name_or_path or model_args.preset, params / 1e6, len(train_set), train_set.seq_len)

    plan_callbacks = apply_memory_plan(
        training_args, model.config, train_set.seq_len, next(model.parameters()).element_size(),
        distill_topk=job.distill_topk, online_teacher=bool(model_args.teacher_model_name_or_path))
    teacher = load_teacher_for(model_args, training_args.device)
    manifest = data.manifest
    card = ModelCardInfo(
        preset=None if model_args.model_name_or_path else model_args.preset,
        base_model=model_args.model_name_or_path,
        teacher=job.teacher_name,
        datasets=hub_datasets(manifest.get("sources", [])),
        training_data=f"{'; '.join(map(source_text, manifest.get('sources', []))) or data.data_dir} "
                      f"({manifest.get('total_tokens', train_set.num_tokens):,} tokens prepared)",
        example_prompt=data_prompt(data.data_dir),
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
    eval_metrics = final_evaluation(trainer)
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
