"""What differs between the transformers lines this package supports (5.17 and the newest 5.x), named once."""

import torch
from transformers import TrainingArguments

# TrainingArguments' activation checkpointing flag: transformers >= 5.24 renamed `gradient_checkpointing`.
CHECKPOINTING_FLAG = (
    "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)


def set_checkpointing(model, enabled: bool) -> None:
    """Activation checkpointing of every layer of `model` (non-reentrant) on or off, by this line's method:
    transformers >= 5.24 renamed `gradient_checkpointing_enable` / `_disable` to `activation_checkpointing_*`."""
    renamed = hasattr(model, "activation_checkpointing_enable")
    if not enabled:
        (model.activation_checkpointing_disable if renamed else model.gradient_checkpointing_disable)()
    elif renamed:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})


def align_tf32_settings() -> None:
    """Make torch's legacy fp32-matmul setting agree with the new one that TrainingArguments' `tf32` sets.

    With torch >= 2.9 transformers sets only `torch.backends.fp32_precision` ("tf32" or "ieee"), so the legacy
    `float32_matmul_precision` stays "highest" and every later read of `torch.backends.cuda.matmul.allow_tf32`
    raises ("mix of the legacy and new APIs"); Inductor's max-autotune reads it while lowering each matrix product,
    so `--torch_compile_mode max-autotune-no-cudagraphs` failed on its first compiled layer. Setting the legacy
    precision from the new one makes both say the same (and sets the CUDA matmul's own precision alike)."""
    precision = getattr(torch.backends, "fp32_precision", None)
    if precision in ("tf32", "ieee"):
        torch.set_float32_matmul_precision("high" if precision == "tf32" else "highest")
