"""Find the learning rate for a production run: short constant-rate trials, the largest stable rate / margin.

    hf-recurrent-find-lr                         # debug preset, embedded corpus, CPU, about a minute
    hf-recurrent-find-lr --preset recurrent-3.3b --data_dir outputs/data/ja --bf16 \
        --per_device_train_batch_size 1 --output_dir outputs/r3b-lr
    hf-recurrent-pretrain --preset recurrent-3.3b ... --learning_rate_from outputs/r3b-lr/lr_sweep.json

Takes run_pretrain's model, data and training arguments (the trials use its optimizer, precision, batch size
and checkpointing, so they fit the same memory) plus the sweep's own (trainer_ext/lr_finder.py). The schedule,
evaluation and saving arguments of a training run are replaced by each trial's. Models under 50M parameters get
SMALL_MODEL_SWEEP (below) where the command line leaves the sweep's settings unset. Writes lr_sweep.json / .md /
.png into --output_dir; exits 1 when no rate was stable.
"""

import json
import logging
import os
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM, HfArgumentParser, set_seed

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from scripts import run_pretrain
from scripts.run_pretrain import DataArguments, ModelArguments
from trainer_ext.data.shards import ShardedTokenDataset, tokenizer_hash
from trainer_ext.devices import resolve_dtype
from trainer_ext.hub.push import tokens_per_optimizer_step
from trainer_ext.training.lr_finder import SweepArguments, find_learning_rate
from trainer_ext.distill.cache import TeacherCacheDataset
from trainer_ext.training.trainer import RecurrentTrainingArguments

logger = logging.getLogger("find_lr")

DEFAULT_ARGS = run_pretrain.DEFAULT_ARGS + ["--output_dir", os.path.join("outputs", "find_lr")]
# Models under run_pretrain's large-model size train at its 3e-3 default: their grid brackets that rate instead,
# and a shorter trial keeps the bare command (debug preset on a CPU) at about a minute.
SMALL_MODEL_SWEEP = {"learning_rates": [3e-3, 1e-2, 3e-2, 1e-1], "sweep_steps": 24, "sweep_warmup_steps": 6}
# A training run's arguments that every trial replaces with its own (trainer_ext.training.lr_finder.trial_arguments).
REPLACED = ("learning_rate", "max_steps", "num_train_epochs", "lr_scheduler_type", "lr_scheduler_kwargs",
            "warmup_steps", "logging_steps", "eval_strategy", "eval_steps", "save_strategy", "save_steps",
            "push_to_hub", "resume_from_checkpoint", "stability_guard")


def parse_args(argv=None):
    parser = HfArgumentParser((ModelArguments, DataArguments, RecurrentTrainingArguments, SweepArguments))
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        parsed = parser.parse_yaml_file(argv[0]) if argv[0].endswith("ml") else parser.parse_json_file(argv[0])
        explicit = set(_read_config(argv[0]))
    else:
        # Defaults first, so anything on the command line wins (argparse keeps the last value).
        parsed = parser.parse_args_into_dataclasses(args=DEFAULT_ARGS + argv)
        explicit = {arg.split("=")[0].lstrip("-").replace("-", "_") for arg in argv if arg.startswith("--")}
    model_args, data_args, training_args, sweep_args = parsed
    training_args.explicit_flags = explicit
    run_pretrain.apply_progress_default(training_args, explicit)
    return model_args, data_args, training_args, sweep_args


def _read_config(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        if path.endswith("ml"):
            import yaml

            return yaml.safe_load(f) or {}
        return json.load(f)


def apply_small_model_sweep(sweep_args: SweepArguments, num_params: int, explicit: set) -> dict:
    """SMALL_MODEL_SWEEP for models under run_pretrain.LARGE_MODEL_PARAMS, where not set; returns what changed."""
    if num_params >= run_pretrain.LARGE_MODEL_PARAMS:
        return {}
    changed = {key: value for key, value in SMALL_MODEL_SWEEP.items() if key not in explicit}
    for key, value in changed.items():
        setattr(sweep_args, key, value)
    sweep_args.__post_init__()  # validate the combination (e.g. an explicit --sweep_warmup_steps with 24 steps)
    return changed


def meta_model(model_args: ModelArguments, tokenizer):
    """The trials' model on the meta device (no memory, no initialisation): its size and vocabulary."""
    if model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path,
                                            trust_remote_code=model_args.trust_remote_code)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=model_args.trust_remote_code)
    return run_pretrain.build_model(model_args, len(tokenizer), tokenizer, torch.device("meta"))


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model_args, data_args, training_args, sweep_args = parse_args(argv)
    explicit = training_args.explicit_flags
    replaced = sorted(explicit & set(REPLACED))
    if replaced:
        logger.info("Replaced by each trial's schedule (see --sweep_steps, --learning_rates): %s", replaced)

    data_dir = run_pretrain.ensure_data(data_args.data_dir)
    tokenizer = run_pretrain.load_data_tokenizer(data_dir)
    shape = meta_model(model_args, tokenizer)
    num_params = sum(p.numel() for p in shape.parameters())
    vocab_size = shape.config.vocab_size
    del shape
    changed = apply_small_model_sweep(sweep_args, num_params, explicit)
    if changed:
        logger.info("Sweep defaults for a model of %.1fM parameters (set them to override): %s",
                    num_params / 1e6, changed)

    train_set = ShardedTokenDataset(data_dir, "train", expected_tokenizer_hash=tokenizer_hash(tokenizer),
                                    model_vocab_size=vocab_size)
    trainer_kwargs = {"processing_class": tokenizer}
    if data_args.teacher_cache_dir and model_args.teacher_model_name_or_path:
        raise ValueError("Pass either --teacher_model_name_or_path (online) or --teacher_cache_dir (offline).")
    if data_args.teacher_cache_dir:  # the trials then train on the distillation loss, as the run will
        train_set = TeacherCacheDataset(train_set, data_args.teacher_cache_dir)
    if model_args.teacher_model_name_or_path:  # loaded once, shared by every trial
        teacher_device = torch.device(model_args.teacher_device) if model_args.teacher_device else training_args.device
        trainer_kwargs["teacher"] = run_pretrain.load_teacher(
            model_args.teacher_model_name_or_path, tokenizer, teacher_device, model_args.teacher_quantization,
            model_args.trust_remote_code)
        trainer_kwargs["teacher_vocab_limit"] = len(tokenizer)

    def make_model():
        set_seed(training_args.seed)  # the seed run_pretrain builds its model with: every trial, the same init
        return run_pretrain.build_model(model_args, len(tokenizer), tokenizer, training_args.device)

    info = {
        "model": model_args.model_name_or_path or model_args.preset,
        "preset": None if model_args.model_name_or_path else model_args.preset,
        "config_overrides": model_args.config_overrides,
        "num_parameters": num_params,
        "data_dir": data_dir,
        "seq_len": train_set.seq_len,
        "per_device_train_batch_size": training_args.per_device_train_batch_size,
        "world_size": training_args.world_size,
        "tokens_per_step": tokens_per_optimizer_step(training_args, train_set.seq_len),
        "dtype": str(resolve_dtype(model_args.dtype, training_args.device)).removeprefix("torch."),
        "device": str(training_args.device),
        "optimizer": training_args.optimizer,
        "seed": training_args.seed,
    }
    logger.info("Sweeping %s on %s (%.1fM parameters), %d steps per rate: %s", info["model"], training_args.device,
                num_params / 1e6, sweep_args.sweep_steps, [f"{rate:g}" for rate in sweep_args.learning_rates])
    result = find_learning_rate(make_model, training_args, train_set, sweep_args, trainer_kwargs, info)
    if result["learning_rate"] is None:
        smaller = [f"{rate / 10:g}" for rate in sweep_args.learning_rates[:3]]
        print(f"No stable learning rate among {[f'{r:g}' for r in sweep_args.learning_rates]} (the smallest was "
              f"unstable): try smaller rates, e.g. --learning_rates {' '.join(smaller)}. Details in "
              f"{os.path.join(training_args.output_dir, 'lr_sweep.md')}.", file=sys.stderr)
        return 1
    logger.info("Chosen learning rate %.3g (largest stable %g / margin %g): train with --learning_rate_from %s",
                result["learning_rate"], result["largest_stable_learning_rate"], sweep_args.margin,
                os.path.join(training_args.output_dir, "lr_sweep.json"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
