"""Pretrain a recurrent-depth model (or its Transformer baseline) with RecurrentTrainer.

    hf-recurrent-pretrain                        # debug preset, embedded corpus, CPU, a few minutes
    python -m scripts.run_pretrain --preset recurrent-3.3b --data_dir outputs/data/ja --bf16 \
        --per_device_train_batch_size 1 --max_steps 1000 --output_dir outputs/r3b
    accelerate launch --config_file trainer_ext/configs/accelerate_single_24gb.yaml scripts/run_pretrain.py ...

Without --data_dir the embedded corpus is prepared first (scripts/prepare_data.py). The final checkpoint
(safetensors, config with auto_map, modeling code, tokenizer) goes to `<output_dir>/final` and loads with
`AutoModelForCausalLM.from_pretrained(...)` where this package is installed (`import hf_recurrent`), or with
`trust_remote_code=True` anywhere else.

The output directory follows transformers' run_clm.py: a non-empty --output_dir resumes from its last complete
checkpoint (incomplete ones, from a save interrupted by a kill, are passed over), one without a complete checkpoint
is refused, and --overwrite_output_dir starts afresh there. A run already at --max_steps is not resumed (nothing
would train): raise --max_steps to continue it. Every argument is checked before data preparation writes anything.
"""

import dataclasses
import difflib
import json
import logging
import math
import os
import shutil
import sys
from dataclasses import dataclass, field

import torch
from transformers import AutoModelForCausalLM, HfArgumentParser, PretrainedConfig, set_seed

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hf_recurrent  # noqa: F401  (registers the model with the Auto classes)
from hf_recurrent import presets
from scripts import prepare_data
from trainer_ext.files import write_json
from trainer_ext.training.checkpoints import (
    FINAL_DIR,
    check_checkpoint,
    check_model_dir,
    is_staging_dir,
    last_complete_checkpoint,
    list_checkpoints,
    load_tokenizer,
    missing_files,
    read_trainer_state,
)
from trainer_ext.data.shards import ShardedTokenDataset, read_manifest, tokenizer_hash
from trainer_ext.devices import resolve_dtype
from trainer_ext.hub.push import HubPushCallback, ModelCardCallback, tokens_per_optimizer_step
from trainer_ext.training.lr_finder import read_sweep_choice
from trainer_ext.hub.model_card import ModelCardInfo, write_model_card
from trainer_ext.distill.cache import TeacherCacheDataset, read_teacher_manifest
from trainer_ext.distill.teacher import TEACHER_TOKENIZER_FIX, load_frozen_teacher
from trainer_ext.training.trainer import RecurrentTrainer, RecurrentTrainingArguments

logger = logging.getLogger("run_pretrain")

DEFAULT_DATA_DIR = os.path.join("outputs", "data", "kjv")


@dataclass
class ModelArguments:
    preset: str = field(default="debug", metadata={"help": f"One of {list(presets.NAMES)}."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Start from this checkpoint instead of a fresh preset."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "Comma-separated config fields, e.g. 'mean_recurrence=8,injection=add'."})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 on CUDA, fp32 on CPU), bfloat16 or float32."})
    attn_implementation: str = field(default="sdpa", metadata={"help": "eager, sdpa or flash_attention_2."})
    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Online teacher: any causal LM sharing the student's tokenizer."})
    teacher_device: str | None = field(
        default=None, metadata={"help": "Where the teacher runs, e.g. cuda:1 (default: the training device)."})
    teacher_quantization: str = field(
        default="none", metadata={"help": "none, 8bit or 4bit (bitsandbytes, CUDA only) to fit a larger teacher."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run the Python code a --model_name_or_path / --teacher_model_name_or_path "
                                         "repository ships (auto_map). Off by default: a hub id's code runs on this "
                                         "machine. Not needed for this package's recurrent-depth checkpoints."})

    def __post_init__(self):
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"--dtype={self.dtype!r} is not allowed; choose one of ['auto', 'bfloat16', 'float32'].")


@dataclass
class DataArguments:
    data_dir: str | None = field(
        default=None, metadata={"help": f"Prepared shards (prepare_data). Default: the embedded corpus in "
                                         f"{DEFAULT_DATA_DIR}, prepared on first use."})
    max_eval_samples: int | None = field(default=256, metadata={"help": "Evaluate on at most this many samples."})
    teacher_cache_dir: str | None = field(
        default=None, metadata={"help": "Offline teacher top-k cache (cache_teacher.py) aligned with --data_dir."})
    save_final: bool = field(default=True, metadata={"help": "Save the final model to <output_dir>/final."})


@dataclass
class ScheduleArguments:
    learning_rate_from: str | None = field(
        default=None, metadata={"help": "lr_sweep.json of hf-recurrent-find-lr (or its folder): take its learning_rate "
                                        "unless --learning_rate is given."})


# What a bare `hf-recurrent-pretrain` runs: the debug preset on the embedded corpus, a few minutes on a CPU.
# Models of LARGE_MODEL_PARAMS or more get LARGE_MODEL_DEFAULTS instead of the schedule flags below, unless the
# command line sets them: a 3e-3 learning rate with 30 warm-up steps diverges at the billion scale.
LARGE_MODEL_PARAMS = 50e6
LARGE_MODEL_DEFAULTS = {"learning_rate": 3e-4, "warmup_steps": 2000, "max_steps": -1, "num_train_epochs": 1.0}
DEFAULT_ARGS = [
    "--output_dir", os.path.join("outputs", "run_pretrain"),
    "--max_steps", "240",
    "--per_device_train_batch_size", "8",
    "--per_device_eval_batch_size", "16",
    "--learning_rate", "3e-3",
    "--lr_scheduler_type", "cosine",
    "--warmup_steps", "30",
    "--logging_steps", "20",
    "--eval_strategy", "steps",
    "--eval_steps", "120",
    "--save_steps", "120",
    "--save_total_limit", "2",
    "--report_to", "none",
    "--dataloader_num_workers", "0",
    "--seed", "0",
] + ([] if torch.cuda.is_available() else ["--dataloader_pin_memory", "false"])


def parse_args(argv=None):
    parser = HfArgumentParser((ModelArguments, DataArguments, RecurrentTrainingArguments, ScheduleArguments))
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")):
        parsed = parser.parse_yaml_file(argv[0]) if argv[0].endswith("ml") else parser.parse_json_file(argv[0])
        model_args, data_args, training_args, schedule_args = parsed
        apply_progress_default(training_args, _config_file_keys(argv[0]))
    else:
        # Defaults first, so anything on the command line wins (argparse keeps the last value).
        model_args, data_args, training_args, schedule_args = parser.parse_args_into_dataclasses(
            args=DEFAULT_ARGS + argv)
        training_args.explicit_flags = {arg.split("=")[0].lstrip("-").replace("-", "_") for arg in argv
                                        if arg.startswith("--")}
        apply_progress_default(training_args, training_args.explicit_flags)
    apply_learning_rate_file(training_args, schedule_args.learning_rate_from)
    return model_args, data_args, training_args


def apply_progress_default(training_args, explicit) -> bool:
    """Turn the Trainer's progress bar off when stderr is not a terminal, unless --disable_tqdm was given.

    In a log file every bar refresh is one more carriage-return line (thousands per run); the Trainer's log lines
    (loss, learning rate every --logging_steps) still say how far it got. Returns whether it changed."""
    if "disable_tqdm" in explicit or training_args.disable_tqdm or sys.stderr.isatty():
        return False
    training_args.disable_tqdm = True
    return True


def _config_file_keys(path: str) -> set:
    with open(path, encoding="utf-8") as f:
        if path.endswith("ml"):
            import yaml

            return set(yaml.safe_load(f) or {})
        return set(json.load(f))


def apply_learning_rate_file(training_args, path: str | None) -> dict:
    """learning_rate of a find_lr sweep, where the command line left it unset; returns what
    was taken. What it sets counts as set by the user: the large-model defaults leave a measured rate alone."""
    if not path:
        return {}
    choice = read_sweep_choice(path)
    explicit = getattr(training_args, "explicit_flags", set())
    taken = {key: value for key, value in choice.items() if key not in explicit}
    for key, value in taken.items():
        setattr(training_args, key, value)
    training_args.explicit_flags = explicit | set(taken)
    kept = sorted(choice.keys() - taken.keys())
    logger.info("From %s: %s%s", path, taken, f"; kept from the command line: {kept}" if kept else "")
    return taken


def apply_large_model_defaults(training_args, num_params: int) -> dict:
    """The schedule defaults for a large model, where the command line left them unset; returns what changed."""
    if num_params < LARGE_MODEL_PARAMS:
        return {}
    explicit = getattr(training_args, "explicit_flags", set())
    changed = {k: v for k, v in LARGE_MODEL_DEFAULTS.items() if k not in explicit}
    if "max_steps" in explicit:
        changed.pop("num_train_epochs", None)
    for key, value in changed.items():
        setattr(training_args, key, value)
    return changed


# -- the output directory: resume, refuse or start afresh (transformers' run_clm.py rule)


def _incomplete_note(output_dir: str) -> str:
    incomplete = [path for path in list_checkpoints(output_dir) if missing_files(path)]
    if not incomplete:
        return ""
    names = ", ".join(f"{os.path.basename(path)} (missing {', '.join(missing_files(path))})" for path in incomplete)
    return f"; incomplete, from a save interrupted by a kill: {names}"


def resolve_checkpoint(training_args) -> str | None:
    """The checkpoint to resume from, or None to start afresh; reads the output directory, writes nothing.

    An explicit `--resume_from_checkpoint PATH` must be complete; `--resume_from_checkpoint true` takes the last
    complete checkpoint in --output_dir. Without it, a non-empty --output_dir resumes from its last complete
    checkpoint, and one without any is refused; `--overwrite_output_dir` starts afresh (see `clear_output_dir`).
    """
    output_dir = training_args.output_dir
    resume = training_args.resume_from_checkpoint
    overwrite = training_args.overwrite_output_dir
    if os.path.exists(output_dir) and not os.path.isdir(output_dir):
        raise ValueError(f"--output_dir {output_dir} is a file, not a folder; choose another --output_dir.")
    if resume is not None and overwrite:
        raise ValueError(f"--overwrite_output_dir starts afresh (deleting the checkpoints in {output_dir}) and "
                         f"--resume_from_checkpoint {resume} continues a run; pass one of them.")
    if resume is not None:
        if resume.strip().lower() != "true":
            return check_checkpoint(resume)
        last = last_complete_checkpoint(output_dir)
        if last is None:
            raise ValueError(
                f"--resume_from_checkpoint true: --output_dir {output_dir} holds no complete checkpoint to resume "
                f"from{_incomplete_note(output_dir)}. Leave --resume_from_checkpoint out to start afresh (with "
                "--overwrite_output_dir if the folder is not empty), or pass a checkpoint folder.")
        logger.info("Resuming from %s, the last complete checkpoint in %s.", last, output_dir)
        return last
    entries = sorted(name for name in os.listdir(output_dir) if not is_staging_dir(name)) \
        if os.path.isdir(output_dir) else []
    if overwrite or not entries:
        return None
    last = last_complete_checkpoint(output_dir)
    if last is None:
        shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
        raise ValueError(
            f"--output_dir {output_dir} is not empty ({shown}) and holds no complete checkpoint to resume "
            f"from{_incomplete_note(output_dir)}. Pass --overwrite_output_dir to train afresh there (its "
            "checkpoints and final/ are deleted), or choose another --output_dir.")
    logger.info("Resuming from %s, the last complete checkpoint in %s (--overwrite_output_dir starts afresh "
                "instead).", last, output_dir)
    return last


def check_steps_left(checkpoint: str, training_args) -> None:
    """Refuse to continue a run found in --output_dir that is already at or past --max_steps.

    Resuming it would train nothing and rewrite final/ from its last checkpoint, under a command that meant to
    train a new run; the user asked for something else and must say which."""
    max_steps = training_args.max_steps
    if max_steps is None or max_steps <= 0:  # an epoch budget: the Trainer decides from the data's length
        return
    step = read_trainer_state(checkpoint).get("global_step", 0)
    if step < max_steps:
        return
    output_dir = training_args.output_dir
    finished = os.path.isdir(os.path.join(output_dir, FINAL_DIR))
    raise ValueError(
        f"--output_dir {output_dir} holds a {'finished' if finished else 'previous'} run at step {step} "
        f"({os.path.basename(checkpoint)}{', final/' if finished else ''}); with --max_steps {max_steps} there is "
        "nothing left to train. Pass a larger --max_steps to continue that run, --overwrite_output_dir to train "
        "afresh there (its checkpoints and final/ are deleted), or choose another --output_dir.")


def clear_output_dir(output_dir: str) -> list[str]:
    """Delete what a previous run left in `output_dir` that a new one must not mix with: its checkpoints (a later
    automatic resume would pick the old run's highest step), saves under way and final/. Returns what went."""
    if not os.path.isdir(output_dir):
        return []
    doomed = list_checkpoints(output_dir) + [os.path.join(output_dir, name) for name in os.listdir(output_dir)
                                             if is_staging_dir(name)]
    final_dir = os.path.join(output_dir, FINAL_DIR)
    if os.path.isdir(final_dir):
        doomed.append(final_dir)
    for path in doomed:
        shutil.rmtree(path)
    return doomed


# -- model configuration

# Fields every config has (transformers_version, id2label, ...): accepted as overrides, left out of error messages.
_BASE_CONFIG_FIELDS = {f.name for f in dataclasses.fields(PretrainedConfig)}


def parse_overrides(text: str | None) -> dict:
    if not text:
        return {}
    overrides = {}
    for item in text.split(","):
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--config_overrides item {item!r} must look like field=value.")
        try:
            overrides[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            overrides[key.strip()] = value.strip()
    return overrides


def check_overrides(overrides: dict, preset: str, model_name_or_path: str | None = None) -> dict:
    """`overrides` if every key is a field of the preset's config class, else ValueError suggesting the close match.

    The config classes accept unknown keys and store them, so a typo (`injecton=add`) would train with the
    default and write the typo into config.json."""
    if not overrides:
        return overrides
    if model_name_or_path:
        raise ValueError(f"--config_overrides applies to a fresh --preset; with --model_name_or_path "
                         f"{model_name_or_path} the checkpoint's config.json is used as it is (edit a copy of it).")
    config_class = type(presets.get(preset))
    fields = [f.name for f in dataclasses.fields(config_class)]
    # The base class's bookkeeping fields are accepted but not listed: the message names what shapes the model.
    own = [name for name in fields if name not in _BASE_CONFIG_FIELDS]
    for key in overrides:
        if key not in fields:
            close = difflib.get_close_matches(key, fields, n=1)
            hint = f"did you mean {close[0]!r}? " if close else ""
            raise ValueError(f"--config_overrides: {key!r} is not a field of {config_class.__name__} (preset "
                             f"{preset!r}); {hint}Its fields: {', '.join(own)}.")
    return overrides


def resolve_vocab_size(overrides: dict, tokenizer_size: int) -> int:
    """The vocabulary size the model gets: the data tokenizer's size, or `vocab_size` of --config_overrides if
    that is at least as large (e.g. a teacher's padded vocabulary); both are padded to a multiple of 64.

    A smaller one is refused: the data holds ids up to the tokenizer's size - 1."""
    if "vocab_size" not in overrides:
        return tokenizer_size
    requested = overrides["vocab_size"]
    if not isinstance(requested, int) or isinstance(requested, bool) or requested < tokenizer_size:
        raise ValueError(f"--config_overrides vocab_size={requested!r}: the vocabulary comes from the data's "
                         f"tokenizer ({tokenizer_size} tokens, padded to a multiple of 64); an override must be an "
                         f"integer >= {tokenizer_size}, or leave it out.")
    return requested


def check_depth_arguments(training_args, config) -> None:
    """Training depths against the model config, known only once the config is built; before any training."""
    if not presets.is_recurrent(config):
        return
    depth = training_args.backprop_depth
    if depth is not None and depth > config.mean_recurrence:
        raise ValueError(f"--backprop_depth={depth} is larger than the model's mean_recurrence "
                         f"({config.mean_recurrence}): it must be in [1, {config.mean_recurrence}] (gradients "
                         "through the last k of the sampled steps), or unset for the config's default.")


def ensure_data(data_dir: str | None) -> str:
    if data_dir is not None:
        read_manifest(data_dir)  # a clear error naming the file and the fix, before anything else loads
        return data_dir
    if not os.path.exists(os.path.join(DEFAULT_DATA_DIR, "manifest.json")):
        logger.info("Preparing the embedded corpus in %s", DEFAULT_DATA_DIR)
        prepare_data.main(["--output_dir", DEFAULT_DATA_DIR])
    return DEFAULT_DATA_DIR


def build_config(model_args: ModelArguments, tokenizer, tokenizer_size: int | None = None):
    """The config of a fresh --preset model (None with --model_name_or_path, whose checkpoint has one)."""
    if model_args.model_name_or_path:
        return None
    overrides = check_overrides(parse_overrides(model_args.config_overrides), model_args.preset)
    vocab_size = resolve_vocab_size(overrides, len(tokenizer) if tokenizer_size is None else tokenizer_size)
    overrides = {key: value for key, value in overrides.items() if key != "vocab_size"}
    config = presets.get(model_args.preset, vocab_size=vocab_size, **overrides)
    config.pad_token_id = tokenizer.pad_token_id
    config.bos_token_id = tokenizer.bos_token_id
    config.eos_token_id = tokenizer.eos_token_id
    return config


def build_model(model_args: ModelArguments, vocab_size: int, tokenizer, device: torch.device, config=None):
    """The model to train: --model_name_or_path loaded, or a fresh --preset model (`config`, else built here for a
    tokenizer of `vocab_size` tokens)."""
    dtype = resolve_dtype(model_args.dtype, device)
    if model_args.model_name_or_path:
        check_model_dir(model_args.model_name_or_path, "--model_name_or_path")
        return AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path, dtype=dtype, attn_implementation=model_args.attn_implementation,
            trust_remote_code=model_args.trust_remote_code)
    if config is None:
        config = build_config(model_args, tokenizer, vocab_size)
    with device:  # initialise where it trains: a 7B model's init on the CPU takes minutes
        return AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                attn_implementation=model_args.attn_implementation)


def load_data_tokenizer(data_dir: str):
    """The tokenizer prepare_data saved with the shards; an error naming --data_dir when its files are missing."""
    return load_tokenizer(
        data_dir, "--data_dir", "prepare_data saves the tokenizer beside the shards: copy the files of the tokenizer "
        "the data was prepared with into it (tokenizer.save_pretrained(data_dir)), or prepare the data again.")


def load_teacher(name_or_path: str, student_tokenizer, device: torch.device, quantization: str = "none",
                 trust_remote_code: bool = False):
    """A frozen teacher in eval mode (bf16 on CUDA), checked to share the student's tokenizer before loading."""
    teacher_tokenizer = load_tokenizer(
        name_or_path, "--teacher_model_name_or_path", TEACHER_TOKENIZER_FIX, trust_remote_code=trust_remote_code)
    if tokenizer_hash(teacher_tokenizer) != tokenizer_hash(student_tokenizer):
        raise ValueError(
            f"Teacher {name_or_path!r} uses a different tokenizer (hash {tokenizer_hash(teacher_tokenizer)}) than the "
            f"student's data (hash {tokenizer_hash(student_tokenizer)}); distillation needs one shared vocabulary.")
    return load_frozen_teacher(name_or_path, device, resolve_dtype("auto", device), quantization,
                               trust_remote_code=trust_remote_code)


def main(argv=None, callbacks=None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    model_args, data_args, training_args = parse_args(argv)
    # Everything that can be checked from the arguments alone, before data preparation writes anything.
    check_overrides(parse_overrides(model_args.config_overrides), model_args.preset, model_args.model_name_or_path)
    for option, path in (("--model_name_or_path", model_args.model_name_or_path),
                         ("--teacher_model_name_or_path", model_args.teacher_model_name_or_path)):
        if path:  # a run folder or truncated weights, found now rather than after the student is built
            check_model_dir(path, option)
    checkpoint = resolve_checkpoint(training_args)
    found_in_output_dir = checkpoint is not None and training_args.resume_from_checkpoint is None
    set_seed(training_args.seed)

    data_dir = ensure_data(data_args.data_dir)
    tokenizer = load_data_tokenizer(data_dir)
    config = build_config(model_args, tokenizer)
    if config is not None:  # before the model is initialised (minutes at 7B)
        check_depth_arguments(training_args, config)
    model = build_model(model_args, len(tokenizer), tokenizer, training_args.device, config=config)
    if config is None:
        check_depth_arguments(training_args, model.config)
    train_set = ShardedTokenDataset(data_dir, "train", expected_tokenizer_hash=tokenizer_hash(tokenizer),
                                    model_vocab_size=model.config.vocab_size)
    eval_set = ShardedTokenDataset(data_dir, "eval", expected_tokenizer_hash=tokenizer_hash(tokenizer),
                                   model_vocab_size=model.config.vocab_size)
    teacher_name = model_args.teacher_model_name_or_path
    if data_args.teacher_cache_dir:
        if teacher_name:
            raise ValueError("Pass either --teacher_model_name_or_path (online) or --teacher_cache_dir (offline).")
        train_set = TeacherCacheDataset(train_set, data_args.teacher_cache_dir)  # validates before training
        teacher_name = read_teacher_manifest(data_args.teacher_cache_dir)["teacher"]["name_or_path"]
    if data_args.max_eval_samples is not None and len(eval_set) > data_args.max_eval_samples:
        eval_set = torch.utils.data.Subset(eval_set, range(data_args.max_eval_samples))
    params = sum(p.numel() for p in model.parameters())
    changed = apply_large_model_defaults(training_args, params)
    if changed:
        logger.info("Defaults for a model of %.0fM parameters (set them to override): %s", params / 1e6, changed)
    if found_in_output_dir:
        check_steps_left(checkpoint, training_args)
    logger.info("Model %s: %.2fM unique parameters, %d train samples of %d tokens",
                model_args.model_name_or_path or model_args.preset, params / 1e6, len(train_set), train_set.seq_len)

    teacher = None
    if model_args.teacher_model_name_or_path:
        teacher_device = torch.device(model_args.teacher_device) if model_args.teacher_device else training_args.device
        teacher = load_teacher(model_args.teacher_model_name_or_path, tokenizer, teacher_device,
                               model_args.teacher_quantization, model_args.trust_remote_code)
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
                               callbacks=[card_callback, *(callbacks or [])])
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


def cli(argv=None) -> int:
    """Console entry point: exit code 0 after a successful run (a failure raises, which exits non-zero)."""
    main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
