"""Where a recurrent-depth model starts: the weights' initialisation, each token's position, the state s_0.

- `ScaledEmbedding`: token embeddings times `config.embedding_scale` (about sqrt(C) under the scaled init).
- `init_scaled` is `init_scheme="scaled"` for one module (`init_scheme="normal"` is transformers' default init).
- `positions_from_mask`: the positions of a call's tokens, which skip left padding and continue after the cache;
  `rotary_phases`: Llama's rotary phases of those positions as the attention layers take them.
- `initial_state`: s_0 under `state_init`, a function of those positions only; `InitialStates` reads it from a
  table once positions repeat (decoding), instead of hashing again.

Together a token gets the same rotary phases and the same initial state in a full forward pass, in a cached decode
step and in a left-padded batch.

Shipped next to the weights with the modeling file (`trust_remote_code` loads it as a flat module).
"""

import math

import torch
from torch import nn
from transformers import initialization as init

try:
    from .configuration_recurrent_depth import RecurrentDepthConfig
except ImportError:  # loaded as a flat module by `trust_remote_code`
    from configuration_recurrent_depth import RecurrentDepthConfig


class ScaledEmbedding(nn.Embedding):
    """Token embeddings multiplied by `config.embedding_scale` (1.0 leaves them as stored)."""

    def __init__(self, num_embeddings: int, embedding_dim: int, padding_idx: int | None, scale: float):
        super().__init__(num_embeddings, embedding_dim, padding_idx)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        embedded = super().forward(input_ids)
        return embedded if self.scale == 1.0 else embedded * self.scale


def init_scaled(module: nn.Linear | nn.Embedding, config: RecurrentDepthConfig) -> None:
    """`init_scheme="scaled"`: each layer's output has about the same RMS as its input at any width, and the
    projections that write into the residual stream (marked `writes_residual`) shrink with the unrolled depth, so
    the stack starts near identity."""
    std = math.sqrt(2 / (5 * config.hidden_size))
    if getattr(module, "writes_residual", False):
        unrolled = config.n_prelude_layers + config.n_coda_layers + config.n_core_layers * config.mean_recurrence
        std /= math.sqrt(2 * unrolled)
    init.trunc_normal_(module.weight, std=std, a=-3 * std, b=3 * std)
    if isinstance(module, nn.Embedding) and module.padding_idx is not None:
        if not getattr(module.weight, "_is_hf_initialized", False):
            init.zeros_(module.weight[module.padding_idx])
    elif getattr(module, "bias", None) is not None:
        init.zeros_(module.bias)


def positions_from_mask(attention_mask: torch.Tensor | None, inputs_embeds: torch.Tensor,
                        past_seen: int | torch.Tensor) -> torch.Tensor:
    """Positions (B or 1, T) that skip left padding, so a padded sequence sees the same rotary phases (and initial
    state) as unpadded. `past_seen` is a tensor for a static cache: added, not passed to `arange`, so no host sync."""
    seq = inputs_embeds.shape[1]
    if attention_mask is None or attention_mask.dim() != 2:
        return (torch.arange(seq, device=inputs_embeds.device) + past_seen).unsqueeze(0)
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.clamp(min=0)[:, -seq:]


def call_positions(attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, inputs_embeds: torch.Tensor,
                   past_seen: int | torch.Tensor) -> tuple[torch.Tensor, int | None]:
    """The call's positions (given, or `positions_from_mask`) and the largest of them where the host may know it
    (what `InitialStates` needs), else None.

    Given positions on an accelerator are read back (one host sync) only without autograd: `generate` passes its
    positions at every step and waits for the device once per step anyway, and the read lets s_0 come from the
    table (one gather) instead of the hash (~76 ops per decode step). A training step does not wait for the device.
    The causal mask gets the caller's positions, not these: transformers searches positions for packed sequences by
    reading the device back (a host wait every training forward), and positions made here hold one sequence a row.
    """
    if torch.compiler.is_compiling():  # a compiled step computes s_0: no table state in the graph
        return (position_ids if position_ids is not None else
                positions_from_mask(attention_mask, inputs_embeds, past_seen)), None
    if position_ids is not None:
        if not host_reads_positions(position_ids):
            return position_ids, None
        low, high = torch.stack(torch.aminmax(position_ids)).tolist()
        return position_ids, high if low >= 0 else None
    position_ids = positions_from_mask(attention_mask, inputs_embeds, past_seen)
    if not isinstance(past_seen, int):
        return position_ids, None
    two_d = attention_mask is not None and attention_mask.dim() == 2
    return position_ids, (attention_mask.shape[-1] if two_d else past_seen + inputs_embeds.shape[1]) - 1


def host_reads_positions(position_ids: torch.Tensor) -> bool:
    """Whether `call_positions` reads given positions back to the host: on the CPU always, on an accelerator only
    without autograd (why: `call_positions`)."""
    return position_ids.device.type == "cpu" or not torch.is_grad_enabled()


def rotary_phases(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Llama's rotary (cos, sin) (B, T, hd) as the attention layers take them, once per call: (B, T, 1, hd), the
    first half of sin negated. Then rotate_half(x) * sin == x.roll(hd / 2) * sin_signed exactly (a negation is exact),
    which is Llama's rotary in 4 ops instead of 8."""
    half = sin.shape[-1] // 2
    return cos.unsqueeze(2), torch.cat([-sin[..., :half], sin[..., half:]], dim=-1).unsqueeze(2)


def initial_state(config: RecurrentDepthConfig, position_ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The state before the first step, shape (B, T, C), at positions `position_ids` (B, T).

    `normal` is a hash of (seed, position, channel) mapped to a Gaussian, not a draw from a global generator:
    it depends on the position only, not on the batch, the padding or what the cache holds.
    """
    batch, seq = position_ids.shape
    size = config.hidden_size
    if config.state_init == "zeros" or config.state_init_std == 0:
        return torch.zeros(batch, seq, size, dtype=dtype, device=position_ids.device)
    channels = torch.arange(size, device=position_ids.device)
    counter = (position_ids.long()[..., None] * size + channels) * 2  # (B, T, C), two draws per element
    uniforms = [_hash_to_unit(counter + k, config.state_init_seed) for k in (0, 1)]
    radius = torch.sqrt(-2.0 * torch.log(uniforms[0]))
    normal = radius * torch.cos(2 * torch.pi * uniforms[1])  # Box-Muller
    return (normal * config.state_init_std).to(dtype)


def _hash_to_unit(counter: torch.Tensor, seed: int) -> torch.Tensor:
    """A 31-bit integer hash (xorshift-multiply rounds, exact in int64) mapped to (0, 1)."""
    mask = (1 << 31) - 1
    x = (counter + seed * 0x9E3779B1) & mask
    for _ in range(3):
        x = ((x >> 15) ^ x) * 0x2C1B3C6D & mask
        x = ((x >> 12) ^ x) * 0x297A2D39 & mask
    x = (x >> 15) ^ x
    return (x.double() + 0.5) / (mask + 1)


class InitialStates:
    """`initial_state` of one model, read from a table of s_0 for positions [0, length) where the call's largest
    position is known on the host (`max_position`; None computes s_0 afresh): a decode step then does one gather
    instead of the hash's ~80 small ops. The table is built by `initial_state` itself, so the values are the same,
    and grows by doubling up to `config.max_position_embeddings` positions (beyond them s_0 is computed)."""

    def __init__(self):
        self.table, self.key = None, None

    def __call__(self, config: RecurrentDepthConfig, position_ids: torch.Tensor, dtype: torch.dtype,
                 max_position: int | None) -> torch.Tensor:
        limit = config.max_position_embeddings
        if (max_position is None or max_position >= limit or config.state_init == "zeros"
                or config.state_init_std == 0):
            return initial_state(config, position_ids, dtype)
        key = (config.hidden_size, config.state_init_seed, config.state_init_std, dtype, position_ids.device)
        if key != self.key or max_position >= self.table.shape[0]:
            length = min(limit, max(max_position + 1, 64, 2 * self.table.shape[0] if key == self.key else 0))
            positions = torch.arange(length, device=position_ids.device)[None]
            self.table, self.key = initial_state(config, positions, dtype)[0], key  # (length, C)
        return self.table[position_ids]  # (B, T, C)
