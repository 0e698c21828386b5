"""What a model costs: FLOPs per token, parameter counts, unrolled layers, tokens per optimizer step.

The one cost accountant, shared by the trainer's MFU, the model card, the evaluation reports, the benchmarks and
the comparison pipeline. Every function takes a `RecurrentDepthConfig` or a plain Transformer config (or a model,
for the parameter counts).

FLOP conventions: a multiply-add is 2 FLOPs; backward costs twice the forward; causal attention over a sequence
of length T attends to (T + 1) / 2 keys per query on average; recomputation from gradient checkpointing is
not counted (MFU counts useful work). Steps run under `no_grad` (truncated backprop) count forward only.
"""

import copy
from dataclasses import dataclass

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig

from .configuration_recurrent_depth import is_recurrent


def unrolled_layers(config, num_steps: int | None = None) -> int:
    """Layers a forward pass runs: prelude + num_steps x core + coda (default depth: the config's), or a
    Transformer's `num_hidden_layers`."""
    if not is_recurrent(config):
        return config.num_hidden_layers
    num_steps = config.default_num_steps if num_steps is None else num_steps
    return config.n_prelude_layers + num_steps * config.n_core_layers + config.n_coda_layers


def _layer_forward_flops(config, seq_len: int) -> float:
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_dim = config.num_attention_heads * head_dim
    kv_dim = config.num_key_value_heads * head_dim
    projections = 2 * hidden * (2 * q_dim + 2 * kv_dim)  # q, k, v, o
    mlp = 2 * 3 * hidden * config.intermediate_size  # gate, up, down
    attention = 2 * 2 * q_dim * (seq_len + 1) / 2  # scores and weighted values
    return projections + mlp + attention


def graph_steps(config, num_steps: int | None = None, backprop_depth: int | None = None) -> int:
    """Core steps that build a graph at depth `num_steps` (default `mean_recurrence`): the last `backprop_depth`
    (default the config's; None = all), at most `num_steps`."""
    num_steps = config.mean_recurrence if num_steps is None else num_steps
    backprop_depth = config.backprop_depth if backprop_depth is None else backprop_depth
    return num_steps if backprop_depth is None else min(backprop_depth, num_steps)


def flops_per_token(config, num_steps: int | None = None, backprop_depth: int | None = None,
                    seq_len: int = 2048, training: bool = True, supervised_depths: int = 1,
                    readout_only_depths: int = 0) -> float:
    """FLOPs per token of one training step (forward + backward), or of inference if `training` is False.

    For a recurrent config: depth `num_steps` (default `mean_recurrence`), gradients through the last
    `backprop_depth` steps (default the config's; None = all). A plain Transformer config has neither.
    `supervised_depths` (training, deep supervision over depth): the loss is taken at that many depths, at most the
    graph-building steps; each depth but the last runs the coda, the final norm (not counted) and the LM head once
    more, forward and backward. `readout_only_depths`: depths read out once more without gradients (the coda and
    the LM head forward only: an exit gate's steps that the loss does not train the model at).
    """
    layer = _layer_forward_flops(config, seq_len)
    head = 2 * config.hidden_size * config.vocab_size
    grad_factor = 3 if training else 1
    if not is_recurrent(config):
        return grad_factor * (config.num_hidden_layers * layer + head)

    num_steps = config.mean_recurrence if num_steps is None else num_steps
    backprop_depth = graph_steps(config, num_steps, backprop_depth)
    adapter = 2 * 2 * config.hidden_size * config.hidden_size if config.injection == "concat" else 0
    step = config.n_core_layers * layer + adapter
    unique = (config.n_prelude_layers + config.n_coda_layers) * layer + head
    if not training:
        return unique + num_steps * step
    extra_readouts = min(max(supervised_depths, 1), backprop_depth) - 1
    readout = config.n_coda_layers * layer + head
    return (3 * (unique + backprop_depth * step + extra_readouts * readout) + (num_steps - backprop_depth) * step
            + readout_only_depths * readout)


@dataclass(frozen=True)
class ParameterCounts:
    unique: int  # every stored parameter once
    per_step: int  # parameters applied once per recurrent step (core block and input adapter); 0 for a Transformer

    def unrolled(self, num_steps: int) -> int:
        """Parameters a plain Transformer would need to run the same layers `num_steps` times."""
        return self.unique + max(num_steps - 1, 0) * self.per_step


_COUNTS: dict[str, ParameterCounts] = {}  # by config JSON: a callback renders a model card at every save


def parameter_counts(model_or_config) -> ParameterCounts:
    """Counts from the config's architecture (a model's config is used, so sharded or offloaded models count
    right too). The model is built on the meta device: exact for any size, in a fraction of a second."""
    config = getattr(model_or_config, "config", model_or_config)
    if not isinstance(config, PretrainedConfig):
        raise ValueError(f"Expected a model or a transformers config, got {type(model_or_config).__name__}.")
    key = config.to_json_string(use_diff=False)
    if key not in _COUNTS:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
        unique, per_step = 0, 0
        for name, parameter in model.named_parameters():  # shared (tied) tensors are listed once
            unique += parameter.numel()
            if ".core." in f".{name}" or ".adapter." in f".{name}":
                per_step += parameter.numel()
        _COUNTS[key] = ParameterCounts(unique, per_step)
    return _COUNTS[key]


def tokens_per_optimizer_step(args, seq_len: int) -> int:
    """Training tokens consumed by one optimizer step of a Trainer with these `TrainingArguments`."""
    return args.per_device_train_batch_size * args.gradient_accumulation_steps * args.world_size * seq_len
