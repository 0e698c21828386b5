"""What differs between the transformers lines this package supports (5.17 and the newest 5.x), named once."""

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
