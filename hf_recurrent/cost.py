"""The one FLOP counter, shared by the trainer's MFU, the benchmarks and the comparison pipeline.

Conventions: a multiply-add is 2 FLOPs; backward costs twice the forward; causal attention over a sequence
of length T attends to (T + 1) / 2 keys per query on average; recomputation from gradient checkpointing is
not counted (MFU counts useful work). Steps run under `no_grad` (truncated backprop) count forward only.
"""


def _layer_forward_flops(config, seq_len: int) -> float:
    hidden = config.hidden_size
    head_dim = getattr(config, "head_dim", None) or hidden // config.num_attention_heads
    q_dim = config.num_attention_heads * head_dim
    kv_dim = config.num_key_value_heads * head_dim
    projections = 2 * hidden * (2 * q_dim + 2 * kv_dim)  # q, k, v, o
    mlp = 2 * 3 * hidden * config.intermediate_size  # gate, up, down
    attention = 2 * 2 * q_dim * (seq_len + 1) / 2  # scores and weighted values
    return projections + mlp + attention


def flops_per_token(config, num_steps: int | None = None, backprop_depth: int | None = None,
                    seq_len: int = 2048, training: bool = True) -> float:
    """FLOPs per token of one training step (forward + backward), or of inference if `training` is False.

    Works for a `RecurrentDepthConfig` (depth `num_steps`, default `mean_recurrence`; gradients through the last
    `backprop_depth` steps, default the config's, None = all) and for a plain Transformer config.
    """
    layer = _layer_forward_flops(config, seq_len)
    head = 2 * config.hidden_size * config.vocab_size
    grad_factor = 3 if training else 1
    if getattr(config, "model_type", None) != "recurrent_depth":
        return grad_factor * (config.num_hidden_layers * layer + head)

    n = config.mean_recurrence if num_steps is None else num_steps
    k = config.backprop_depth if backprop_depth is None else backprop_depth
    k = n if k is None else min(k, n)
    adapter = 2 * 2 * config.hidden_size * config.hidden_size if config.injection == "concat" else 0
    step = config.n_core_layers * layer + adapter
    unique = (config.n_prelude_layers + config.n_coda_layers) * layer + head
    if not training:
        return unique + n * step
    return 3 * (unique + k * step) + (n - k) * step
