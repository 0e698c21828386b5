"""What differs between the transformers lines this package supports (5.17 and the newest 5.x), named once."""

from transformers import TrainingArguments

# TrainingArguments' activation checkpointing flag: transformers >= 5.24 renamed `gradient_checkpointing`.
CHECKPOINTING_FLAG = (
    "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)
