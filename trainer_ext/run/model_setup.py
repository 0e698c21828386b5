"""What a training command builds from `ModelArguments`: the config (with checked `--config_overrides`), the model
(fresh from a preset or loaded from a checkpoint), the data's tokenizer and a frozen online teacher."""

import dataclasses
import difflib
import json
import os

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from hf_recurrent import presets  # importing hf_recurrent registers the model with the Auto classes
from trainer_ext.data.shards import tokenizer_hash
from trainer_ext.devices import resolve_dtype
from trainer_ext.distill.teacher import TEACHER_TOKENIZER_FIX, load_frozen_teacher
from trainer_ext.training.arguments import ModelArguments
from trainer_ext.checkpoints import check_model_dir, load_tokenizer

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


def config_before_data(model_args: ModelArguments):
    """The model's config as far as it is known before the data is prepared, for the checks that need it: the
    preset with its --config_overrides (the vocabulary comes from the data's tokenizer later), or the config.json of
    a local --model_name_or_path; None for a hub id (read once the model is downloaded). Reads, writes nothing."""
    path = model_args.model_name_or_path
    if path:
        if not os.path.isfile(os.path.join(path, "config.json")):
            return None
        return AutoConfig.from_pretrained(path, trust_remote_code=model_args.trust_remote_code)
    overrides = check_overrides(parse_overrides(model_args.config_overrides), model_args.preset)
    return presets.get(model_args.preset, **{key: value for key, value in overrides.items() if key != "vocab_size"})


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


def meta_model(model_args: ModelArguments, tokenizer):
    """The model on the meta device (no memory, no initialisation): its size and vocabulary."""
    if model_args.model_name_or_path:
        config = AutoConfig.from_pretrained(model_args.model_name_or_path,
                                            trust_remote_code=model_args.trust_remote_code)
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(config, trust_remote_code=model_args.trust_remote_code)
    return build_model(model_args, len(tokenizer), tokenizer, torch.device("meta"))


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


def load_teacher(name_or_path: str, student_tokenizer, device: torch.device, quantization: str = "none",
                 trust_remote_code: bool = False):
    """A frozen teacher in eval mode (bf16 on CUDA), checked to share the student's tokenizer before loading."""
    check_teacher_tokenizer(name_or_path, student_tokenizer, trust_remote_code)
    return load_frozen_teacher(name_or_path, device, resolve_dtype("auto", device), quantization,
                               trust_remote_code=trust_remote_code)


def load_teacher_for(model_args: ModelArguments, student_tokenizer, training_device: torch.device):
    """The online teacher of `model_args` (None without --teacher_model_name_or_path), on --teacher_device or the
    training device."""
    if not model_args.teacher_model_name_or_path:
        return None
    device = torch.device(model_args.teacher_device) if model_args.teacher_device else training_device
    return load_teacher(model_args.teacher_model_name_or_path, student_tokenizer, device,
                        model_args.teacher_quantization, model_args.trust_remote_code)
