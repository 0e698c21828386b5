"""Configuration of the recurrent-depth causal LM.

Shape: embedding -> prelude layers -> core block (``n_core_layers`` layers) applied ``num_steps`` times ->
coda layers -> final norm -> LM head. ``num_steps`` is chosen at run time; the config's ``num_steps`` (when set) or
else ``mean_recurrence`` is its default.
"""

from huggingface_hub.dataclasses import strict
from transformers.configuration_utils import PreTrainedConfig

INJECTION_MODES = ("concat", "add")
STATE_INITS = ("zeros", "normal")
KV_CACHE_MODES = ("per_step", "shared")
EXIT_CRITERIA = ("state", "gate")  # adaptive depth (adaptive_depth.py); "gate" needs exit_gate=True
DEPTH_DISTRIBUTIONS = ("fixed", "poisson_lognormal")
BLOCK_NORMS = ("pre", "sandwich")
INIT_SCHEMES = ("normal", "scaled")


def _check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"RecurrentDepthConfig.{name}={value!r} is not allowed; choose one of {list(allowed)}.")


def _check_positive(name: str, value) -> None:
    if not isinstance(value, int) or value < 1:
        raise ValueError(f"RecurrentDepthConfig.{name}={value!r} must be an integer >= 1.")


@strict
class RecurrentDepthConfig(PreTrainedConfig):
    r"""
    Args:
        n_prelude_layers / n_core_layers / n_coda_layers: layers before, inside and after the recurrent block.
        mean_recurrence: the centre of the training depth distribution, and the depth a call without `num_steps` runs
            unless the config's `num_steps` is set.
        num_steps: the default depth at inference, without touching training: what `forward` and `generate` run when
            the call passes no `num_steps` (None: `mean_recurrence`). `from_pretrained(path, num_steps=n)` sets it
            (as lm-evaluation-harness's `model_args` do); `mean_recurrence=n` there would also move the training
            distribution, the scaled init and the `backprop_depth <= mean_recurrence` bound.
        backprop_depth: during training only the last `backprop_depth` steps carry gradients (None: all).
        depth_distribution: `fixed` (always `mean_recurrence`) or `poisson_lognormal` (Huginn's sampler).
        depth_warmup_steps: a depth curriculum: the mean training depth grows linearly from 1 to `mean_recurrence`
            over this many optimizer steps (0: no curriculum).
        depth_sigma: log-normal spread of the training depth; `max_recurrence` caps a sampled depth.
        injection: how the prelude output re-enters every step: `concat` (concat + linear adapter) or `add`.
        state_init: initial state, `zeros` or `normal` (std `state_init_std`, a fixed function of position and
            channel seeded by `state_init_seed`, so a forward pass is reproducible and cache-exact).
        block_norm: `pre` (Llama: x + f(norm(x))) or `sandwich` (Huginn: the residual stream is normalised
            after every attention and MLP, x = norm(x + f(norm(x))), which keeps a deep unrolled core stable).
        qk_norm: RMS-normalise each head's queries and keys before the rotary embedding (as OLMo 2 and Qwen 3),
            which bounds the attention logits whatever the projections' scale. Off by default: the presets train
            without it, and it has not been measured here yet (results/training-control says what was).
        init_scheme: `normal` (transformers' default: every weight N(0, `initializer_range`)) or `scaled` (std
            sqrt(2 / (5 * hidden_size)) whatever the width, attention and MLP output projections further divided by
            sqrt(2 * unrolled layers at `mean_recurrence`), as Huginn and "Spike No More": the first step's gradient
            norm then stays of order 1 at every width, where `normal` grows with it).
        embedding_scale: the token embeddings are multiplied by this in the forward pass. None: sqrt(hidden_size)
            with `init_scheme="scaled"` (embeddings of RMS about 0.6, not 0.01, so the first norm does not amplify
            their gradients 100x), 1.0 otherwise.
        kv_cache_mode: `per_step` (one cache slot per step and core layer, exact) or `shared` (one slot per core
            layer written by the last step; memory independent of depth, an approximation for n > 1).
        exit_threshold: adaptive per-token depth at inference (`adaptive_depth`): a token stops iterating once its
            state changes by less than this, relative, in one step (None: a fixed depth, the default; 0 never exits).
            A `forward` / `generate` keyword overrides it. `exit_criterion`: `state` (that relative change) or
            `gate` (the learned exit gate's cumulative exit probability reaches the threshold, in (0, 1]).
        exit_gate: a learned exit gate (Ouro's): Linear(hidden_size, 1) on the state after each core step, exit
            probability sigmoid(gate(s_i)); trained by the expected loss over depths (trainer_ext/training/exit_gate.py)
            and read by `exit_criterion="gate"`. Off by default: no parameters added, older checkpoints load as saved.
    """

    model_type = "recurrent_depth"
    keys_to_ignore_at_inference = ["past_key_values", "cache"]
    # Tensor parallelism as Llama's plan, for the layers of all three sections (the small `adapter` is replicated).
    base_model_tp_plan = {
        f"{section}.*.{projection}": style
        for section in ("prelude", "core", "coda")
        for projection, style in (
            ("self_attn.q_proj", "colwise"),
            ("self_attn.k_proj", "colwise"),
            ("self_attn.v_proj", "colwise"),
            ("self_attn.o_proj", "rowwise"),
            ("mlp.gate_proj", "colwise"),
            ("mlp.up_proj", "colwise"),
            ("mlp.down_proj", "rowwise"),
        )
    }

    vocab_size: int = 32000
    hidden_size: int = 1024
    intermediate_size: int = 2816
    num_attention_heads: int = 16
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    hidden_act: str = "silu"
    n_prelude_layers: int = 2
    n_core_layers: int = 4
    n_coda_layers: int = 2
    num_hidden_layers: int | None = None
    mean_recurrence: int = 12
    num_steps: int | None = None
    backprop_depth: int | None = None
    depth_distribution: str = "poisson_lognormal"
    depth_sigma: float = 0.5
    depth_warmup_steps: int = 0
    max_recurrence: int | None = None
    injection: str = "concat"
    state_init: str = "normal"
    state_init_std: float = 1.0
    state_init_seed: int = 0
    kv_cache_mode: str = "per_step"
    exit_threshold: float | int | None = None
    exit_criterion: str = "state"
    exit_gate: bool = False
    block_norm: str = "pre"
    qk_norm: bool = False
    init_scheme: str = "normal"
    embedding_scale: float | None = None
    max_position_embeddings: int = 4096
    initializer_range: float = 0.02
    rms_norm_eps: float = 1e-6
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    tie_word_embeddings: bool = False
    rope_parameters: dict | None = None
    attention_bias: bool = False
    attention_dropout: float | int = 0.0
    mlp_bias: bool = False

    def __post_init__(self, **kwargs):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        self._validate_recurrent_fields()
        if self.embedding_scale is None:
            self.embedding_scale = self.hidden_size**0.5 if self.init_scheme == "scaled" else 1.0
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        # Unique layers: what a cache built from this config has slots for (extra per-step slots are added
        # by the model at run time).
        self.num_hidden_layers = self.n_prelude_layers + self.n_core_layers + self.n_coda_layers
        super().__post_init__(**kwargs)

    @property
    def default_num_steps(self) -> int:
        """The depth a call that passes no `num_steps` runs."""
        return self.mean_recurrence if self.num_steps is None else self.num_steps

    def _validate_recurrent_fields(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                     "n_core_layers", "mean_recurrence"):
            _check_positive(name, getattr(self, name))
        for name in ("n_prelude_layers", "n_coda_layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0:
                raise ValueError(f"RecurrentDepthConfig.{name}={value!r} must be an integer >= 0.")
        if self.head_dim is None and self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"RecurrentDepthConfig.num_attention_heads={self.num_attention_heads} must divide "
                f"hidden_size={self.hidden_size} (or set head_dim explicitly)."
            )
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"RecurrentDepthConfig.num_key_value_heads={self.num_key_value_heads} must divide "
                f"num_attention_heads={self.num_attention_heads}."
            )
        if self.num_steps is not None:
            _check_positive("num_steps", self.num_steps)
        if self.backprop_depth is not None:
            _check_positive("backprop_depth", self.backprop_depth)
            if self.backprop_depth > self.mean_recurrence:
                raise ValueError(
                    f"RecurrentDepthConfig.backprop_depth={self.backprop_depth} must be <= "
                    f"mean_recurrence={self.mean_recurrence} (or None for full backpropagation)."
                )
        if self.max_recurrence is not None:
            _check_positive("max_recurrence", self.max_recurrence)
            if self.max_recurrence < self.mean_recurrence:
                raise ValueError(
                    f"RecurrentDepthConfig.max_recurrence={self.max_recurrence} must be >= "
                    f"mean_recurrence={self.mean_recurrence}."
                )
        if not isinstance(self.depth_warmup_steps, int) or self.depth_warmup_steps < 0:
            raise ValueError(f"RecurrentDepthConfig.depth_warmup_steps={self.depth_warmup_steps!r} must be an integer >= 0.")
        if not self.depth_sigma >= 0:
            raise ValueError(f"RecurrentDepthConfig.depth_sigma={self.depth_sigma!r} must be >= 0.")
        if not self.state_init_std >= 0:
            raise ValueError(f"RecurrentDepthConfig.state_init_std={self.state_init_std!r} must be >= 0.")
        _check_choice("injection", self.injection, INJECTION_MODES)
        _check_choice("state_init", self.state_init, STATE_INITS)
        _check_choice("kv_cache_mode", self.kv_cache_mode, KV_CACHE_MODES)
        _check_choice("exit_criterion", self.exit_criterion, EXIT_CRITERIA)
        if self.exit_threshold is not None and not self.exit_threshold >= 0:
            raise ValueError(f"RecurrentDepthConfig.exit_threshold={self.exit_threshold!r} must be >= 0 (or None).")
        if not isinstance(self.exit_gate, bool):
            raise ValueError(f"RecurrentDepthConfig.exit_gate={self.exit_gate!r} must be true or false.")
        if self.exit_criterion == "gate" and not self.exit_gate:
            raise ValueError("RecurrentDepthConfig.exit_criterion='gate' needs a learned exit gate: set exit_gate=True "
                             "(and train it) or use exit_criterion='state'.")
        if self.exit_criterion == "gate" and self.exit_threshold is not None and not 0 < self.exit_threshold <= 1:
            raise ValueError(f"RecurrentDepthConfig.exit_threshold={self.exit_threshold!r} must be in (0, 1] with "
                             "exit_criterion='gate' (a cumulative exit probability), or None.")
        _check_choice("depth_distribution", self.depth_distribution, DEPTH_DISTRIBUTIONS)
        _check_choice("block_norm", self.block_norm, BLOCK_NORMS)
        if not isinstance(self.qk_norm, bool):
            raise ValueError(f"RecurrentDepthConfig.qk_norm={self.qk_norm!r} must be true or false.")
        _check_choice("init_scheme", self.init_scheme, INIT_SCHEMES)
        if self.embedding_scale is not None and not self.embedding_scale > 0:
            raise ValueError(f"RecurrentDepthConfig.embedding_scale={self.embedding_scale!r} must be > 0 (or None).")


def is_recurrent(config) -> bool:
    """Whether `config` is a recurrent-depth model's (a Transformer baseline's is not)."""
    return getattr(config, "model_type", None) == RecurrentDepthConfig.model_type


__all__ = ["RecurrentDepthConfig", "is_recurrent"]
