"""Recurrent-depth causal language models for Hugging Face transformers.

Importing this package registers the model with the Auto classes. Beside the model: `presets` (named shapes),
`depth` (the training depth sampler), `cost` (FLOPs per token, parameter counts, unrolled layers) and `static_cache`
(a static KV cache with the slots of a depth, for compiled decoding).
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

from . import presets
from .cache_recurrent_depth import static_cache
from .configuration_recurrent_depth import RecurrentDepthConfig
from .depth import DepthSampler
from .cost import flops_per_token
from .modeling_recurrent_depth import (
    RecurrentDepthForCausalLM,
    RecurrentDepthModel,
    RecurrentDepthPreTrainedModel,
)

AutoConfig.register(RecurrentDepthConfig.model_type, RecurrentDepthConfig, exist_ok=True)
AutoModel.register(RecurrentDepthConfig, RecurrentDepthModel, exist_ok=True)
AutoModelForCausalLM.register(RecurrentDepthConfig, RecurrentDepthForCausalLM, exist_ok=True)
# save_pretrained then writes the modeling code and `auto_map`, so checkpoints load without this package.
RecurrentDepthConfig.register_for_auto_class()
RecurrentDepthModel.register_for_auto_class("AutoModel")
RecurrentDepthForCausalLM.register_for_auto_class("AutoModelForCausalLM")

__all__ = [
    "DepthSampler",
    "RecurrentDepthConfig",
    "RecurrentDepthForCausalLM",
    "RecurrentDepthModel",
    "RecurrentDepthPreTrainedModel",
    "flops_per_token",
    "presets",
    "static_cache",
]
