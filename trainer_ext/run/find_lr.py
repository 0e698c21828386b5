"""The learning-rate sweep of a production run as one library call: `find_lr(job, sweep_args)` takes the job of
pretrain's model, data and training arguments (`TrainingJob`; the trials use its optimizer, precision, batch size
and checkpointing, so they fit the same memory) plus the sweep's own (`lr_search.finder.SweepArguments`), and writes
lr_sweep.json / .md / .png into --output_dir. The schedule, evaluation and saving arguments of a training run are
replaced by each trial's (`lr_search.trials.trial_arguments`). With `--memory_plan auto` (the default on CUDA) the
trials take the batch size and recompute set that pretraining's plan chooses for the same arguments, so the rate is
tested at the batch the run will train with. A sweep stopped midway resumes from lr_sweep.progress.json (the start's
weights and held-out loss, the finished trials) when run again with the same settings."""

import copy
import dataclasses
import logging
import os

from torch.utils.data import Subset
from transformers import set_seed

from hf_recurrent.cost import tokens_per_optimizer_step
from trainer_ext.data.shards import ShardedTokenDataset, tokenizer_hash
from trainer_ext.devices import resolve_dtype
from trainer_ext.distill.cache import TeacherCacheDataset
from trainer_ext.lr_search.finder import SweepArguments, resolve_sweep_defaults
from trainer_ext.lr_search.sweep_file import read_progress, remove_progress, write_progress
from trainer_ext.lr_search.trials import find_learning_rate, memory_note, run_trial, trial_arguments
from trainer_ext.memory.plan import MemoryPlanCallback, apply_memory_plan
from trainer_ext.run.job import TrainingJob, parse_args_with_defaults
from trainer_ext.run.model_setup import build_model, load_teacher_for, meta_model
from trainer_ext.training.arguments import (
    COMMAND_LINE_DEFAULTS,
    DataArguments,
    ModelArguments,
    RecurrentTrainingArguments,
)

logger = logging.getLogger(__name__)

FIND_LR_DEFAULTS = {**COMMAND_LINE_DEFAULTS, "output_dir": os.path.join("outputs", "find_lr")}
START_DIR = "sweep_start"  # under --output_dir: the weights every trial starts from with --sweep_start_steps
# Schedule fields of a training run that the trials replace; given anyway, they are named in the log.
REPLACED_WHEN_SET = ("learning_rate", "learning_rate_from", "warmup_steps", "max_steps", "num_train_epochs")


def parse_find_lr_job(argv=None) -> tuple[TrainingJob, SweepArguments]:
    """(job, sweep_args) of a find-lr command line (sys.argv without `argv`): parsed, then the job resolved and
    checked as a training's, without the schedule and output-folder decisions the trials replace."""
    model_args, data_args, training_args, sweep_args = parse_args_with_defaults(
        (ModelArguments, DataArguments, RecurrentTrainingArguments, SweepArguments), argv, FIND_LR_DEFAULTS)
    return TrainingJob.resolve(model_args, data_args, training_args, pretraining=False), sweep_args


def find_lr(job: TrainingJob, sweep_args: SweepArguments) -> dict:
    """Run the sweep, write its files; returns the lr_sweep.json record (`learning_rate` None: no stable rate).

    Fills the sweep fields left None (`lr_search.finder.resolve_sweep_defaults`, from the model's size), in place."""
    model_args, data_args, training_args = job.model_args, job.data_args, job.training_args
    replaced = [name for name in REPLACED_WHEN_SET if getattr(training_args, name) is not None]
    if replaced:
        logger.info("Replaced by each trial's schedule (see --sweep_steps, --learning_rates): %s", replaced)

    data = job.prepare_data()
    data_dir, tokenizer = data.data_dir, data.tokenizer
    fresh_config = job.model_config(data)  # built (and its choices logged) once; each trial's model gets a copy
    shape = meta_model(model_args, copy.deepcopy(fresh_config))
    num_params = sum(p.numel() for p in shape.parameters())
    config = shape.config
    del shape
    applied = resolve_sweep_defaults(sweep_args, num_params)
    if applied:
        logger.info("Sweep defaults for a model of %.1fM parameters (set them to override): %s",
                    num_params / 1e6, applied)

    train_set = ShardedTokenDataset(data_dir, "train", expected_tokenizer_hash=tokenizer_hash(tokenizer),
                                    model_vocab_size=config.vocab_size)
    eval_set = None
    if sweep_args.sweep_start_steps:  # trials from trained weights are judged on held-out samples
        try:
            eval_set = ShardedTokenDataset(data_dir, "eval", expected_tokenizer_hash=tokenizer_hash(tokenizer),
                                           model_vocab_size=config.vocab_size)
        except ValueError as exc:
            raise ValueError(f"--sweep_start_steps={sweep_args.sweep_start_steps} judges the trials on the data's "
                             f"held-out samples (or set --sweep_start_steps 0): {exc}") from exc
        eval_set = Subset(eval_set, range(min(sweep_args.sweep_eval_samples, len(eval_set))))
    # The plan pretraining would apply (batch size, recompute set, compile), carried by every trial's trainer.
    plan_callbacks = apply_memory_plan(
        training_args, config, train_set.seq_len, resolve_dtype(model_args.dtype, training_args.device).itemsize,
        distill_topk=job.distill_topk, online_teacher=bool(model_args.teacher_model_name_or_path))
    trainer_kwargs = {"processing_class": tokenizer, "callbacks": plan_callbacks}
    if data_args.teacher_cache_dir:  # the trials then train on the distillation loss, as the run will
        train_set = TeacherCacheDataset(train_set, data_args.teacher_cache_dir)
    start_dir = os.path.join(training_args.output_dir, START_DIR) if sweep_args.sweep_start_steps else None
    info = {
        "model": model_args.model_name_or_path or model_args.preset,
        "preset": None if model_args.model_name_or_path else model_args.preset,
        "config_overrides": model_args.config_overrides,
        "num_parameters": num_params,
        "data_dir": data_dir,
        "seq_len": train_set.seq_len,
        "per_device_train_batch_size": training_args.per_device_train_batch_size,
        "memory_plan": next((c.plan.describe() for c in plan_callbacks if isinstance(c, MemoryPlanCallback)), None),
        "world_size": training_args.world_size,
        "tokens_per_step": tokens_per_optimizer_step(training_args, train_set.seq_len),
        "dtype": str(resolve_dtype(model_args.dtype, training_args.device)).removeprefix("torch."),
        "device": str(training_args.device),
        "optimizer": training_args.optimizer,
        "seed": training_args.seed,
        "sweep_start": start_dir,
    }
    # A sweep stopped midway resumes from its progress file: the start's weights and the trials it finished.
    settings = {**{k: v for k, v in info.items() if k != "device"}, "sweep": dataclasses.asdict(sweep_args)}
    progress = None if training_args.overwrite_output_dir else read_progress(training_args.output_dir, settings)
    teacher = load_teacher_for(model_args, training_args.device)  # loaded once, shared by every trial
    if teacher is not None:
        trainer_kwargs.update(teacher=teacher, teacher_vocab_limit=len(tokenizer))
    main_process = training_args.process_index == 0
    start, trial_set, resumable = model_args, train_set, {"start_held_out": None}

    def save_progress(trials):
        if main_process:
            write_progress(training_args.output_dir, settings, resumable["start_held_out"], trials)

    def make_model():
        set_seed(training_args.seed)  # the seed pretrain builds its model with: every trial, the same init
        return build_model(start, training_args.device, copy.deepcopy(fresh_config))

    if sweep_args.sweep_start_steps:  # from then on every trial loads the start's weights
        start_held_out = progress["start_held_out_loss"] if progress else None
        if start_held_out is not None and os.path.isfile(os.path.join(start_dir, "config.json")):
            logger.info("Sweep start: the weights an earlier run trained (%s; held-out loss %.3f)", start_dir,
                        start_held_out)
        else:  # trials of an earlier start (its weights gone) do not judge rates from this one
            start_held_out = train_sweep_start(make_model, training_args, train_set, eval_set, sweep_args,
                                               trainer_kwargs, start_dir)
            progress = None
        resumable.update(eval_dataset=eval_set, start_held_out=start_held_out)
        save_progress(progress["trials"] if progress else [])
        trial_set = samples_after_start(train_set, training_args, sweep_args)
        start = dataclasses.replace(model_args, model_name_or_path=start_dir)
    resumable.update(finished=progress["trials"] if progress else [], on_trial=save_progress)
    logger.info("Sweeping %s on %s (%.1fM parameters), %d steps per rate: %s", info["model"], training_args.device,
                num_params / 1e6, sweep_args.sweep_steps, [f"{rate:g}" for rate in sweep_args.learning_rates])
    result = find_learning_rate(make_model, training_args, trial_set, sweep_args, trainer_kwargs, info, **resumable)
    if main_process:
        remove_progress(training_args.output_dir)
    if result["learning_rate"] is not None:
        logger.info("Chosen learning rate %.3g (largest stable %g / margin %g): train with --learning_rate_from %s",
                    result["learning_rate"], result["largest_stable_learning_rate"], sweep_args.margin,
                    os.path.join(training_args.output_dir, "lr_sweep.json"))
    return result


def train_sweep_start(make_model, training_args, train_set, eval_set, sweep_args: SweepArguments,
                      trainer_kwargs: dict, start_dir: str) -> float:
    """Train `sweep_start_steps` steps warming up linearly to the smallest rate (as a run's warm-up would), save the
    weights to `start_dir`; returns their loss on `eval_set`. ValueError naming the fix where that training stops."""
    steps, rate = sweep_args.sweep_start_steps, min(sweep_args.learning_rates)
    args = dataclasses.replace(trial_arguments(training_args, rate, sweep_args), max_steps=steps, warmup_steps=steps)
    logger.info("Sweep start: %d steps warming up to lr %g, saved to %s", steps, rate, start_dir)
    outcome = run_trial(make_model, args, train_set, dict(trainer_kwargs), save_to=start_dir, eval_dataset=eval_set)
    if outcome["error"] is not None:
        raise ValueError(f"--sweep_start_steps={steps}: training up to the smallest rate {rate:g} stopped "
                         f"({outcome['error']}); lower --learning_rates or --sweep_start_steps.")
    logger.info("Sweep start: held-out loss %.3f on %d samples%s", outcome["held_out_loss"], len(eval_set),
                memory_note(outcome))
    return outcome["held_out_loss"]


def samples_after_start(train_set, training_args, sweep_args: SweepArguments):
    """The samples after those the start trained on, or all of them where too few would be left for a trial."""
    per_step = training_args.per_device_train_batch_size * training_args.world_size
    used = sweep_args.sweep_start_steps * per_step
    if len(train_set) - used >= sweep_args.sweep_steps * per_step:
        return Subset(train_set, range(used, len(train_set)))
    return train_set
