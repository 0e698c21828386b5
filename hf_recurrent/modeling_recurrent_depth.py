"""Recurrent-depth causal LM: a Llama-style Transformer whose core block is applied `num_steps` times.

    embed -> prelude -> e                                   # (B, T, C)
    s_0 = initial state (zeros or a fixed pseudo-random normal)
    s_i = norm(core(inject(s_{i-1}, e)))   for i = 1..n     # the core block is shared by all steps
    logits = lm_head(norm(coda(s_n)))

The depth n of a call is, first match wins: the `num_steps` keyword of `forward` / `generate`; a `num_steps` on the
generation config (`generate(generation_config=GenerationConfig(num_steps=n))`, or the checkpoint's
generation_config.json); the config's `num_steps` (`from_pretrained(path, num_steps=n)`); `config.mean_recurrence`.

This file holds the layers and the forward passes. Beside it, imported relatively: the configuration,
`init_recurrent_depth` (the embedding, weight init, positions, rotary phases, the initial state),
`cache_recurrent_depth` (the KV cache slots, static caches), `adaptive_depth` (per-token early exit, the output
classes) and `loading_recurrent_depth` (save / load / generate glue). They import nothing else of this package on
purpose: `save_pretrained` copies them next to the weights, so a checkpoint loads with `trust_remote_code=True` where
this package is not installed.
"""

import inspect
from collections.abc import Callable, Iterable
from contextlib import nullcontext
from functools import partial

import torch
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.generation import GenerationConfig, GenerationMixin
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaMLP,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    eager_attention_forward,
)
from transformers.utils import can_return_tuple, logging

try:
    from .adaptive_depth import (DepthExit, RecurrentDepthCausalLMOutput, RecurrentDepthModelOutput, check_exit,
                                 compile_in_segments, run_segments)
    from .cache_recurrent_depth import (attend_cache, cache_for_call, cache_slot, core_slots, grow_static_cache,
                                        is_static)
    from .configuration_recurrent_depth import RecurrentDepthConfig
    from .init_recurrent_depth import (InitialStates, ScaledEmbedding, call_positions, init_scaled,  # noqa: F401
                                       initial_state, rotary_phases)
    from .loading_recurrent_depth import forget_compiled_prefix, keep_num_steps, map_compiled_prefix, pass_num_steps
except ImportError:  # loaded as flat modules by `trust_remote_code`
    from adaptive_depth import (DepthExit, RecurrentDepthCausalLMOutput, RecurrentDepthModelOutput, check_exit,
                                compile_in_segments, run_segments)
    from cache_recurrent_depth import (attend_cache, cache_for_call, cache_slot, core_slots, grow_static_cache,
                                       is_static)
    from configuration_recurrent_depth import RecurrentDepthConfig
    from init_recurrent_depth import (InitialStates, ScaledEmbedding, call_positions, init_scaled,  # noqa: F401
                                      initial_state, rotary_phases)
    from loading_recurrent_depth import forget_compiled_prefix, keep_num_steps, map_compiled_prefix, pass_num_steps

logger = logging.get_logger(__name__)

# transformers >= 5.24 calls the cache argument and output field `cache`; 5.17 calls them `past_key_values`.
CACHE_FIELD = "cache" if "cache" in BaseModelOutputWithPast.__dataclass_fields__ else "past_key_values"


class RecurrentDepthRMSNorm(LlamaRMSNorm):
    """Llama's RMSNorm in fewer ops (a decode step runs 4 per layer call): no casts for fp32 input; eager without
    autograd `torch.rms_norm` (the same ops on a CPU, bit-equal; one fused kernel on CUDA, fp32 under autocast)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            normed = torch.rms_norm(hidden_states, hidden_states.shape[-1:], None, self.variance_epsilon)
            return self.weight * normed.to(input_dtype)
        if input_dtype != torch.float32:
            hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance.add_(self.variance_epsilon))
        return self.weight * (hidden_states if input_dtype == torch.float32 else hidden_states.to(input_dtype))


class RecurrentDepthAttention(nn.Module):
    """Llama attention (rotary, GQA) through transformers' attention dispatch.

    `position_embeddings`: the call's `rotary_phases`. `cache_slot` is the cache layer this call reads and writes;
    `read_only_cache` means: attend over what the slot holds plus the current keys/values, without writing (earlier
    steps in `shared` cache mode); `cache_rows` (read-only calls): the slot's rows that the call's batch rows are
    (a step run on part of the batch, `adaptive_depth`). When `attentions` is a list, this call's attention weights
    (B, nh, T, T_past + T) are appended to it. `attention_interface`: transformers' dispatch, which the model resolves
    once per forward (None: resolved here).
    """

    def __init__(self, config: RecurrentDepthConfig, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.head_dim = config.head_dim
        self.num_key_value_groups = config.num_attention_heads // config.num_key_value_heads
        self.scaling = self.head_dim**-0.5
        self.attention_dropout = config.attention_dropout
        self.is_causal = True
        self.qk_norm = config.qk_norm
        q_dim, kv_dim = config.num_attention_heads * self.head_dim, config.num_key_value_heads * self.head_dim
        self.q_proj = nn.Linear(config.hidden_size, q_dim, bias=config.attention_bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_dim, bias=config.attention_bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_dim, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_dim, config.hidden_size, bias=config.attention_bias)
        self.o_proj.writes_residual = True  # scaled down by the unrolled depth under init_scheme="scaled"
        # Per-head RMSNorm of queries and keys (config.qk_norm); without it no weights, so old checkpoints match.
        self.q_norm = RecurrentDepthRMSNorm(self.head_dim, eps=config.rms_norm_eps) if self.qk_norm else nn.Identity()
        self.k_norm = RecurrentDepthRMSNorm(self.head_dim, eps=config.rms_norm_eps) if self.qk_norm else nn.Identity()

    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
        attention_mask: torch.Tensor | None,
        cache: Cache | None = None,
        cache_slot: int | None = None,
        read_only_cache: bool = False,
        attentions: list | None = None,
        attention_interface: Callable | None = None,
        cache_rows: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        query = self.q_proj(hidden_states).view(hidden_shape)  # (B, T, nh, hd)
        key = self.k_proj(hidden_states).view(hidden_shape)  # (B, T, nkv, hd)
        if self.qk_norm:
            query, key = self.q_norm(query), self.k_norm(key)
        cos, sin = position_embeddings  # rotary on queries and keys at once: 5 ops per layer call instead of 8
        rotated = torch.cat([query, key], dim=2)  # (B, T, nh + nkv, hd)
        rotated = rotated * cos + rotated.roll(self.head_dim // 2, -1) * sin
        query, key = (x.transpose(1, 2) for x in rotated.split([query.shape[2], key.shape[2]], dim=2))  # (B, n, T, hd)
        value = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)

        if cache is not None:
            key, value = attend_cache(cache, cache_slot, key, value, read_only_cache, cache_rows)

        if attention_interface is None:
            attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
                self.config._attn_implementation, eager_attention_forward)
        output, weights = attention_interface(
            self, query, key, value, attention_mask, dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling, **kwargs,
        )
        if attentions is not None:
            attentions.append(weights)
        return self.o_proj(output.reshape(*input_shape, -1).contiguous())


class RecurrentDepthDecoderLayer(GradientCheckpointingLayer):
    """Llama block: x + attn(norm(x)), then + mlp(norm(x)). With `block_norm="sandwich"` the sum is normalised
    after each of the two (`attention_residual_norm`, `mlp_residual_norm`)."""

    def __init__(self, config: RecurrentDepthConfig, layer_idx: int):
        super().__init__()
        self.self_attn = RecurrentDepthAttention(config, layer_idx)
        self.mlp = LlamaMLP(config)
        self.mlp.down_proj.writes_residual = True
        self.input_layernorm = RecurrentDepthRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RecurrentDepthRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.sandwich = config.block_norm == "sandwich"
        if self.sandwich:
            self.attention_residual_norm = RecurrentDepthRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
            self.mlp_residual_norm = RecurrentDepthRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        else:  # not called: kept so that both block kinds have the same attributes
            self.attention_residual_norm = self.mlp_residual_norm = nn.Identity()

    def forward(
        self,
        hidden_states: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        cache: Cache | None = None,
        cache_slot: int | None = None,
        read_only_cache: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        hidden_states = hidden_states + self.self_attn(
            self.input_layernorm(hidden_states), position_embeddings=position_embeddings, attention_mask=attention_mask,
            cache=cache, cache_slot=cache_slot, read_only_cache=read_only_cache, **kwargs,
        )
        if self.sandwich:
            hidden_states = self.attention_residual_norm(hidden_states)
        hidden_states = hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        return self.mlp_residual_norm(hidden_states) if self.sandwich else hidden_states


class RecurrentDepthPreTrainedModel(PreTrainedModel):
    config_class = RecurrentDepthConfig
    config: RecurrentDepthConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["RecurrentDepthDecoderLayer"]
    _skip_keys_device_placement = ["past_key_values", "cache"]
    _supports_flash_attn = True
    _supports_sdpa = True
    _supports_flex_attn = True
    _supports_attention_backend = True
    # A forward at a fixed depth traces as one graph (the depth is a Python int: a new depth compiles anew).
    _can_compile_fullgraph = True

    def _init_weights(self, module):
        """`init_scheme="normal"`: transformers' init; `"scaled"`: `init_scaled` for linear and embedding layers. The
        exit gate starts at zero under both: lambda = 1/2 at every step, the same for every token."""
        if getattr(module, "is_exit_gate", False):
            init.zeros_(module.weight)
            return init.zeros_(module.bias)
        if self.config.init_scheme == "normal" or not isinstance(module, (nn.Linear, nn.Embedding)):
            return super()._init_weights(module)
        init_scaled(module, self.config)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """Also loads weights saved from a `torch.compile`d model (keys prefixed `_orig_mod.`)."""
        loaded = super().from_pretrained(*args, **map_compiled_prefix(kwargs))
        forget_compiled_prefix(loaded)
        return loaded


class RecurrentDepthModel(RecurrentDepthPreTrainedModel):
    """The recurrent-depth decoder without its LM head.

    With P prelude, K core and C coda layers at depth n, the optional outputs are, in call order:

    - `hidden_states` (`output_hidden_states=True`): 1 + P + n + C tensors (B, T, C): the embeddings (after
      `embedding_scale`), the output of each prelude layer, the state after each core step (after `state_norm`: what
      the next step and the coda read), the output of each coda layer. As in Llama the last entry is
      `last_hidden_state`, i.e. after the final norm (the last coda layer's output normed; with C = 0, s_n normed).
    - `attentions` (`output_attentions=True`, eager attention only): P + n * K tensors (B, nh, T, T_past + T), one
      per layer call: each prelude layer, each core layer at step 1, ..., each core layer at step n, each coda layer.
      With sdpa or flash attention, an empty tuple and a warning (Llama's convention).
    """

    def __init__(self, config: RecurrentDepthConfig):
        super().__init__(config)
        self.padding_idx = config.pad_token_id
        self.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size, self.padding_idx,
                                            config.embedding_scale)
        # Layer indices run prelude, core, coda; cache slots are assigned by `_cache_slot`.
        num_prelude, num_core = config.n_prelude_layers, config.n_core_layers
        self.prelude = nn.ModuleList(RecurrentDepthDecoderLayer(config, i) for i in range(num_prelude))
        self.core = nn.ModuleList(RecurrentDepthDecoderLayer(config, num_prelude + i) for i in range(num_core))
        self.coda = nn.ModuleList(RecurrentDepthDecoderLayer(config, num_prelude + num_core + i)
                                  for i in range(config.n_coda_layers))
        self.concat_injection = config.injection == "concat"
        if self.concat_injection:
            self.adapter = nn.Linear(2 * config.hidden_size, config.hidden_size, bias=False)
        self.prelude_norm = RecurrentDepthRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        # Normalising the state after every step keeps its scale independent of the depth.
        self.state_norm = RecurrentDepthRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.norm = RecurrentDepthRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if config.exit_gate:  # Ouro's learned exit: lambda_i = sigmoid(exit_gate(s_i)) (`adaptive_depth`)
            self.exit_gate = nn.Linear(config.hidden_size, 1)
            self.exit_gate.is_exit_gate = True
        self.rotary_emb = LlamaRotaryEmbedding(config=config)
        self.initial_states = InitialStates()
        self.gradient_checkpointing = False
        self.post_init()

    def get_input_embeddings(self):
        return self.embed_tokens

    def set_input_embeddings(self, value):
        self.embed_tokens = value

    def inject(self, state: torch.Tensor, embedded: torch.Tensor) -> torch.Tensor:
        if self.concat_injection:
            return self.adapter(torch.cat([state, embedded], dim=-1))
        return state + embedded

    def core_step(self, state: torch.Tensor, embedded: torch.Tensor, layer_kwargs: dict, slots: range,
                  read_only: bool) -> torch.Tensor:
        """One step s_i = norm(core(inject(s_{i-1}, e))); the core layers use cache slots `slots` (`core_slots`)."""
        hidden = self.inject(state, embedded)
        for layer, slot in zip(self.core, slots):
            hidden = layer(hidden, cache_slot=slot, read_only_cache=read_only, **layer_kwargs)
        return self.state_norm(hidden)

    def core_steps(self, steps: Iterable[int], state: torch.Tensor, embedded: torch.Tensor, layer_kwargs: dict,
                   depth_exit: DepthExit | None, record: Callable, num_steps: int, no_grad_steps: int) -> torch.Tensor:
        """The state after core `steps` (0-based, of a call at depth `num_steps`), each recorded by `record`."""
        # `recompute_core_steps` (None: each core layer's own flag decides): the steps, counted from the first one
        # that builds a graph, whose core layers are checkpointed; it sets the core layers' flag at every step. A
        # mapping also gives each such step the function its core layers run under (`_gradient_checkpointing_func`:
        # full or selective recomputation, activation offload; trainer_ext's memory plan sets it).
        recompute = getattr(self, "recompute_core_steps", None)
        slots, shared = core_slots(self.config, num_steps), self.config.kv_cache_mode == "shared"
        for step in steps:
            if recompute is not None:
                placed = step - no_grad_steps in recompute
                for layer in self.core:
                    layer.gradient_checkpointing = placed
                    if placed and isinstance(recompute, dict):
                        layer._gradient_checkpointing_func = recompute[step - no_grad_steps]
            core_step = partial(self.core_step, slots=slots[step], read_only=shared and step < num_steps - 1)
            with torch.no_grad() if step < no_grad_steps else nullcontext():
                if depth_exit is None:
                    state = core_step(state, embedded, layer_kwargs)
                else:
                    state = depth_exit.run(core_step, state, embedded, layer_kwargs)
            record(state)
        return state

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        num_steps: int | None = None,
        backprop_depth: int | None = None,
        output_attentions: bool | None = None,
        output_hidden_states: bool | None = None,
        cache: Cache | None = None,
        exit_threshold: float | None = None,
        exit_criterion: str | None = None,
        exit_check_every: int | None = None,
        **kwargs,
    ) -> RecurrentDepthModelOutput:
        """`num_steps`: depth n (default `config.default_num_steps`). `backprop_depth` k: in training, only the last
        k steps build a graph; the first n - k run under `no_grad` (default `config.backprop_depth`, None = all).
        `exit_threshold` / `exit_criterion` (default: the config's): adaptive depth, at most n steps per token, the
        steps used returned as `num_steps_used` (B, T) (`adaptive_depth`); None: every token runs n steps.
        `exit_check_every`: compiled, the core steps between two checks for all exited (`adaptive_depth`; 0: none).
        `return_dict=False` gives a tuple (None fields left out)."""
        config = self.config
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("Pass exactly one of input_ids or inputs_embeds.")
        num_steps = config.default_num_steps if num_steps is None else int(num_steps)
        if num_steps < 1:
            raise ValueError(f"num_steps={num_steps} must be >= 1.")
        exit_threshold = config.exit_threshold if exit_threshold is None else exit_threshold
        exit_criterion = exit_criterion or config.exit_criterion
        check_exit(exit_threshold, exit_criterion, config.exit_gate, exit_check_every)
        backprop_depth = config.backprop_depth if backprop_depth is None else int(backprop_depth)
        if backprop_depth is not None and backprop_depth < 1:
            raise ValueError(f"backprop_depth={backprop_depth} must be >= 1 (or None for all steps).")
        # A sampled depth may be shorter than k: then every step carries gradients.
        no_grad_steps = 0 if backprop_depth is None else max(num_steps - backprop_depth, 0)
        output_attentions = config.output_attentions if output_attentions is None else output_attentions
        output_hidden_states = config.output_hidden_states if output_hidden_states is None else output_hidden_states
        # As Llama: with an attention that computes no weights (sdpa, flash) the maps are an empty tuple, with a warning.
        attentions_unavailable = output_attentions and config._attn_implementation != "eager"
        if attentions_unavailable:
            logger.warning_once(f"`{config._attn_implementation}` attention does not support `output_attentions="
                                "True`: the attentions are an empty tuple. Load the model with attn_implementation="
                                "\"eager\" (or call model.set_attn_implementation(\"eager\")) for the maps.")
            output_attentions = False

        use_cache = config.use_cache if use_cache is None else use_cache
        # As in transformers' models, training with gradient checkpointing runs without a cache.
        cache = cache_for_call(cache if cache is not None else past_key_values, config, num_steps,
                               use_cache and not (self.gradient_checkpointing and self.training))

        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # (B, T, C)
        past_seen = cache.get_seq_length() if cache is not None else 0
        positions, max_position = call_positions(attention_mask, position_ids, inputs_embeds, past_seen)

        mask = create_causal_mask(config, inputs_embeds, attention_mask, cache, position_ids)  # see call_positions
        position_embeddings = rotary_phases(*self.rotary_emb(inputs_embeds, positions))
        # Layout of both in the class docstring; the attention layers append their weights to `attentions`.
        hidden_states = [] if output_hidden_states else None
        attentions = [] if output_attentions else None
        # transformers' attention dispatch, resolved once per call rather than per layer call
        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
                                                                    eager_attention_forward)
        layer_kwargs = dict(attention_mask=mask, position_embeddings=position_embeddings, cache=cache,
                            attentions=attentions, attention_interface=attention_interface, **kwargs)

        def record(hidden: torch.Tensor) -> None:
            if hidden_states is not None:
                hidden_states.append(hidden)

        hidden = inputs_embeds
        record(hidden)
        for i, layer in enumerate(self.prelude):
            hidden = layer(hidden, cache_slot=cache_slot(config, "prelude", i), **layer_kwargs)
            record(hidden)
        embedded = self.prelude_norm(hidden)

        state = self.initial_states(config, positions.expand(hidden.shape[0], -1), embedded.dtype, max_position)
        depth_exit = None
        if exit_threshold is not None:
            # A step may run on part of the batch without a cache or with a dynamic one (`adaptive_depth`).
            compact = ((cache is None or not is_static(cache)) and not kwargs
                       and (mask is None or isinstance(mask, torch.Tensor)))
            depth_exit = DepthExit(exit_threshold, state.shape[:2], state.device,
                                   config.kv_cache_mode if cache is not None else None, compact,
                                   self.exit_gate if exit_criterion == "gate" else None)
        run = partial(self.core_steps, embedded=embedded, layer_kwargs=layer_kwargs, depth_exit=depth_exit,
                      record=record, num_steps=num_steps, no_grad_steps=no_grad_steps)
        steps = range(num_steps) if depth_exit is None else depth_exit.steps(num_steps, hidden_states, attentions)
        if plan := depth_exit and depth_exit.segments(num_steps, attentions, exit_check_every):
            # Compiled: the first steps, then segments of equal steps with a host check before each (`adaptive_depth`)
            first, segment, count = plan
            state = run_segments(depth_exit, run, segment, count, run(first, state), hidden_states)
            steps = range(segment.stop, num_steps)
        state = run(steps, state)

        hidden = state
        for i, layer in enumerate(self.coda):
            hidden = layer(hidden, cache_slot=cache_slot(config, "coda", i), **layer_kwargs)
            record(hidden)
        hidden = self.norm(hidden)
        if hidden_states is not None:
            hidden_states[-1] = hidden  # as Llama: the last entry is after the final norm
        return RecurrentDepthModelOutput(
            last_hidden_state=hidden,
            hidden_states=tuple(hidden_states) if hidden_states is not None else None,
            attentions=() if attentions_unavailable else tuple(attentions) if attentions is not None else None,
            num_steps_used=None if depth_exit is None else depth_exit.steps_used,
            **{CACHE_FIELD: cache},
        )


class RecurrentDepthForCausalLM(RecurrentDepthPreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _tp_plan = {"lm_head": "colwise_gather_output"}

    def __init__(self, config: RecurrentDepthConfig):
        super().__init__(config)
        self.model = RecurrentDepthModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def _prepare_generation_config(self, generation_config: GenerationConfig | None, **kwargs):
        """Passes a `num_steps` set on the generation config to `forward` (why: `pass_num_steps`)."""
        generation_config, model_kwargs = super()._prepare_generation_config(generation_config, **kwargs)
        pass_num_steps(generation_config, model_kwargs)
        return generation_config, model_kwargs

    def _prepare_static_cache(self, *args, **kwargs):
        """`cache_implementation="static"`: transformers' static cache, grown to the slots of the call's depth."""
        cache = super()._prepare_static_cache(*args, **kwargs)
        grow_static_cache(cache, self.config, (kwargs.get("model_kwargs") or {}).get("num_steps"))
        return cache

    def _valid_auto_compile_criteria(self, model_kwargs: dict, generation_config: GenerationConfig) -> bool:
        """As transformers'; a compiled decode step with exits runs in segments (`compile_in_segments`)."""
        if compiles := super()._valid_auto_compile_criteria(model_kwargs, generation_config):
            compile_in_segments(generation_config, self.config, model_kwargs)
        return compiles

    def save_pretrained(self, *args, **kwargs):
        """Also keeps a `num_steps` set on `model.generation_config` across save and load (`keep_num_steps`)."""
        keep_num_steps(self.generation_config)
        return super().save_pretrained(*args, **kwargs)

    @can_return_tuple
    def forward(
        self, input_ids: torch.LongTensor | None = None, attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None, past_key_values: Cache | None = None,
        inputs_embeds: torch.FloatTensor | None = None, labels: torch.LongTensor | None = None,
        use_cache: bool | None = None, logits_to_keep: int | torch.Tensor = 0, num_steps: int | None = None,
        backprop_depth: int | None = None, output_attentions: bool | None = None,
        output_hidden_states: bool | None = None, cache: Cache | None = None, exit_threshold: float | None = None,
        exit_criterion: str | None = None, exit_check_every: int | None = None, **kwargs,
    ) -> RecurrentDepthCausalLMOutput:
        """As `RecurrentDepthModel.forward` (outputs laid out as its docstring says), plus the LM head and, given
        `labels`, the loss. `return_dict=False` gives a tuple: (loss, logits, cache, hidden_states, attentions,
        num_steps_used), each present only when computed."""
        outputs = self.model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
            cache=cache if cache is not None else past_key_values, inputs_embeds=inputs_embeds, use_cache=use_cache,
            num_steps=num_steps, backprop_depth=backprop_depth, output_attentions=output_attentions,
            output_hidden_states=output_hidden_states, exit_threshold=exit_threshold, exit_criterion=exit_criterion,
            exit_check_every=exit_check_every, return_dict=True, **kwargs,
        )
        hidden = outputs.last_hidden_state
        slice_indices = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
        logits = self.lm_head(hidden[:, slice_indices, :])
        loss = None
        if labels is not None:
            loss = self.loss_function(logits=logits, labels=labels, vocab_size=self.config.vocab_size, **kwargs)
        return RecurrentDepthCausalLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            num_steps_used=outputs.num_steps_used,
            **{CACHE_FIELD: getattr(outputs, CACHE_FIELD)},
        )


# For models registered with the Auto classes, `generate` inspects `forward`'s signature at every decode step.
RecurrentDepthForCausalLM.forward.__signature__ = inspect.signature(RecurrentDepthForCausalLM.forward)

__all__ = ["RecurrentDepthPreTrainedModel", "RecurrentDepthModel", "RecurrentDepthForCausalLM"]
