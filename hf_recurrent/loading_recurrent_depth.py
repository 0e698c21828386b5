"""Saving, loading and `generate` glue: what the model adds to transformers' `from_pretrained`, `save_pretrained`
and generation-config handling, so that a checkpoint's weights and its depth survive a round trip.

- Weights saved from a `torch.compile`d model carry the key prefix `COMPILED_PREFIX`: `from_pretrained` maps it
  away (`map_compiled_prefix`) and keeps it from coming back on the next save (`forget_compiled_prefix`).
- A `num_steps` on a `GenerationConfig` (one passed to `generate`, or the checkpoint's generation_config.json)
  reaches `forward` (`pass_num_steps`) and is kept across save and load (`keep_num_steps`).

The model's methods call these; the reasons live here. Shipped next to the weights with the modeling file
(`trust_remote_code` loads it as a flat module).
"""

# Checkpoints saved from a `torch.compile`d model carry this key prefix; loading strips it.
COMPILED_PREFIX = r"^_orig_mod\."


def map_compiled_prefix(kwargs: dict) -> dict:
    """`from_pretrained` keyword arguments whose `key_mapping` also strips `COMPILED_PREFIX` (a caller's mapping
    is kept, applied after it)."""
    kwargs["key_mapping"] = {COMPILED_PREFIX: "", **(kwargs.get("key_mapping") or {})}
    return kwargs


def forget_compiled_prefix(loaded) -> None:
    """Drops the prefix renaming from a loaded model (or the tuple `output_loading_info=True` gives):
    transformers re-applies used renamings in reverse on save, and the prefix must not come back."""
    model = loaded[0] if isinstance(loaded, tuple) else loaded
    conversions = getattr(model, "_weight_conversions", None)
    if conversions:
        model._weight_conversions = [c for c in conversions if COMPILED_PREFIX not in c.source_patterns]


def pass_num_steps(generation_config, model_kwargs: dict) -> None:
    """Puts a `num_steps` set on the generation config into the `model_kwargs` that `generate` passes to `forward`.

    transformers keeps attributes it does not know on a `GenerationConfig` (one passed to `generate`, or the
    model's, loaded from generation_config.json) but does not forward them to the model; once the config has
    the attribute, it even absorbs a `num_steps` keyword to `generate`. Read back here, the keyword still wins over
    a passed config, which wins over the checkpoint's.
    """
    num_steps = getattr(generation_config, "num_steps", None)
    if num_steps is not None and model_kwargs.get("num_steps") is None:
        model_kwargs["num_steps"] = num_steps


def keep_num_steps(generation_config) -> None:
    """Before a save: marks a generation config with a `num_steps` so that loading reads the attribute back.

    The generation config a model builds for itself is marked `_from_model_config`, and transformers drops the
    attributes it does not know when it loads a generation_config.json so marked; unmarked (as transformers'
    Seq2SeqTrainer does once the config is edited), the file's `num_steps` is read back.
    """
    if getattr(generation_config, "num_steps", None) is not None:
        generation_config._from_model_config = False
