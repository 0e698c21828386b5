"""What a training command builds from `ModelArguments`: the `--config_overrides` (parsed and checked), the model
(fresh from a preset's config or loaded from a checkpoint), the data's tokenizer and a frozen online teacher. The
checks run once, as `trainer_ext.run.job.TrainingJob` resolves a run's arguments."""

import dataclasses
import difflib
import json

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from hf_recurrent import presets  # importing hf_recurrent registers the model with the Auto classes
from trainer_ext.checkpoints import load_tokenizer
from trainer_ext.data.shards import tokenizer_hash
from trainer_ext.devices import resolve_dtype
from trainer_ext.distill.teacher import TEACHER_TOKENIZER_FIX, load_frozen_teacher
from trainer_ext.training.arguments import ModelArguments

# Fields every config has (transformers_version, id2label, ...): accepted as overrides, left out of error messages.
_BASE_CONFIG_FIELDS = {f.name for f in dataclasses.fields(PretrainedConfig)}


def parse_overrides(text: str | None) -> dict:
    """`--config_overrides` ('field=value,...') as a dict; values are JSON where they parse, else strings."""
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


def build_model(model_args: ModelArguments, device: torch.device, config=None):
    """The model to train: --model_name_or_path loaded (checked by the job), or a fresh --preset model of `config`
    (`TrainingJob.model_config`), initialised on `device`."""
    dtype = resolve_dtype(model_args.dtype, device)
    if model_args.model_name_or_path:
        return AutoModelForCausalLM.from_pretrained(
            model_args.model_name_or_path, dtype=dtype, attn_implementation=model_args.attn_implementation,
            trust_remote_code=model_args.trust_remote_code)
    with device:  # initialise where it trains: a 7B model's init on the CPU takes minutes
        return AutoModelForCausalLM.from_config(config, dtype=dtype,
                                                attn_implementation=model_args.attn_implementation)


def meta_model(model_args: ModelArguments, config=None):
    """The model on the meta device (no memory, no initialisation): its size and vocabulary. `config` as for
    `build_model`; a checkpoint's is read from it."""
    if model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path,
                                            trust_remote_code=model_args.trust_remote_code)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=model_args.trust_remote_code)
    return build_model(model_args, torch.device("meta"), config)


def load_data_tokenizer(data_dir: str):
    """The tokenizer prepare_data saved with the shards; an error naming --data_dir when its files are missing."""
    return load_tokenizer(
        data_dir, "--data_dir", "prepare_data saves the tokenizer beside the shards: copy the files of the tokenizer "
        "the data was prepared with into it (tokenizer.save_pretrained(data_dir)), or prepare the data again.")


def check_teacher_tokenizer(name_or_path: str, student_tokenizer=None, trust_remote_code: bool = False) -> None:
    """The teacher's tokenizer loads (else an error naming the folder and the fix) and, given the data's
    `student_tokenizer`, is the same one."""
    teacher_tokenizer = load_tokenizer(
        name_or_path, "--teacher_model_name_or_path", TEACHER_TOKENIZER_FIX, trust_remote_code=trust_remote_code)
    if student_tokenizer is not None and tokenizer_hash(teacher_tokenizer) != tokenizer_hash(student_tokenizer):
        raise ValueError(
            f"Teacher {name_or_path!r} uses a different tokenizer (hash {tokenizer_hash(teacher_tokenizer)}) than the "
            f"student's data (hash {tokenizer_hash(student_tokenizer)}); distillation needs one shared vocabulary.")


def load_teacher_for(model_args: ModelArguments, training_device: torch.device):
    """The frozen online teacher of `model_args` in eval mode (None without --teacher_model_name_or_path; its
    tokenizer checked by the job), bf16 on CUDA, on --teacher_device or the training device."""
    if not model_args.teacher_model_name_or_path:
        return None
    device = torch.device(model_args.teacher_device) if model_args.teacher_device else training_device
    return load_frozen_teacher(model_args.teacher_model_name_or_path, device, resolve_dtype("auto", device),
                               model_args.teacher_quantization, trust_remote_code=model_args.trust_remote_code)
