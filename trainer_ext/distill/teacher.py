"""Loading a frozen teacher for distillation, online (run_pretrain) or into a top-k cache (cache_teacher).

A teacher too large for the card in bf16 (a 32B model needs 64 GB) loads quantized through bitsandbytes (the `gpu`
extra): 8-bit halves that, 4-bit (NF4, bf16 compute) brings a 32B teacher to about 18 GB.
"""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

import hf_recurrent  # noqa: F401  (registers our model type: recurrent-depth teachers need no remote code)
from trainer_ext.checkpoints import check_model_dir

QUANTIZATIONS = ("none", "8bit", "4bit")
# The fix named when a teacher folder has no loadable tokenizer (run_pretrain's online teacher, cache_teacher).
TEACHER_TOKENIZER_FIX = ("Save the tokenizer the teacher was trained with next to it "
                         "(tokenizer.save_pretrained(teacher_dir)); it must be the data's tokenizer.")


def load_frozen_teacher(name_or_path: str, device: torch.device, dtype: torch.dtype, quantization: str = "none",
                        revision: str | None = None, option: str = "--teacher_quantization",
                        trust_remote_code: bool = False, path_option: str = "--teacher_model_name_or_path"):
    """The teacher in eval mode without gradients, on `device`; `option` and `path_option` name the quantization
    and path flags in error messages.

    `trust_remote_code` runs the code a hub repository ships; off by default (transformers' convention). Our own
    recurrent-depth checkpoints load without it: `import hf_recurrent` registers the model type."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"{option}={quantization!r} is not allowed; choose one of {list(QUANTIZATIONS)}.")
    check_model_dir(name_or_path, path_option)
    kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code, "revision": revision}
    if quantization == "none":
        model = AutoModelForCausalLM.from_pretrained(name_or_path, **kwargs).to(device)
    else:
        if device.type != "cuda":
            raise ValueError(f"{option} {quantization} needs a CUDA device (got {device}).")
        from transformers import BitsAndBytesConfig  # needs the `bitsandbytes` package (extra: gpu)

        kwargs["quantization_config"] = BitsAndBytesConfig(load_in_8bit=quantization == "8bit",
                                                           load_in_4bit=quantization == "4bit",
                                                           bnb_4bit_compute_dtype=torch.bfloat16)
        model = AutoModelForCausalLM.from_pretrained(name_or_path, device_map={"": device}, **kwargs)
    return model.eval().requires_grad_(False)
