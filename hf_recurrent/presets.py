"""Named model shapes. The vocabulary comes from the tokenizer at training time (padded to a multiple of 64).

Recurrent presets and their Transformer peers share hidden size, MLP and attention shapes; the peer has
`n_prelude + n_core + n_coda` layers, so both hold the same unique parameters up to the small adapter. The
`-compute` peers (`transformer-125m-compute`, ...) have as many layers as match the recurrent model's training FLOPs
per token at its mean depth: the baseline at equal compute.
"""

from dataclasses import dataclass

from transformers import LlamaConfig

# is_recurrent is imported from here by its callers (it lives with the config, which cost.py reads without presets).
from .configuration_recurrent_depth import RecurrentDepthConfig, is_recurrent  # noqa: F401
from .cost import flops_per_token

VOCAB_MULTIPLE = 64


@dataclass(frozen=True)
class Shape:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    n_prelude_layers: int
    n_core_layers: int
    n_coda_layers: int
    mean_recurrence: int
    backprop_depth: int | None
    vocab_size: int
    max_position_embeddings: int


_RECURRENT = {
    "debug": Shape(64, 176, 4, 2, 1, 2, 1, 4, None, 512, 512),
    "recurrent-125m": Shape(768, 3072, 12, 12, 2, 4, 2, 8, 4, 32000, 2048),
    "recurrent-1b": Shape(2048, 5632, 16, 8, 7, 4, 7, 8, 4, 32000, 4096),
    # The user's model: about 3.3B unique parameters, about 7B unrolled at n = 12.
    "recurrent-3.3b": Shape(4096, 11008, 32, 8, 7, 2, 7, 12, 4, 65536, 4096),
    # About 7B unique parameters: the memory stress case.
    "recurrent-7b": Shape(4096, 11008, 32, 8, 16, 4, 16, 4, 2, 65536, 4096),
}
# Transformer baselines: same shape as their recurrent peer, every layer unique.
_BASELINE_PEER = {"transformer-125m": "recurrent-125m", "transformer-3.3b": "recurrent-3.3b", "transformer-debug": "debug"}
# Transformer baselines of equal training compute: the peer's widths, and as many layers as give the recurrent
# model's training FLOPs per token at its mean depth (`compute_matched_layers`): the comparison at equal compute,
# beside the one at equal unique parameters.
_COMPUTE_PEER = {f"{name}-compute": peer for name, peer in _BASELINE_PEER.items()}

NAMES = tuple(_RECURRENT) + tuple(_BASELINE_PEER) + tuple(_COMPUTE_PEER)


def pad_vocab(vocab_size: int, multiple: int = VOCAB_MULTIPLE) -> int:
    return -(-vocab_size // multiple) * multiple


def get(name: str, vocab_size: int | None = None, **overrides) -> RecurrentDepthConfig | LlamaConfig:
    """Config for preset `name`; `vocab_size` (a tokenizer's size) is padded to a multiple of 64."""
    if name not in NAMES:
        raise ValueError(f"Unknown preset {name!r}; choose one of {list(NAMES)}.")
    peer = _BASELINE_PEER.get(name) or _COMPUTE_PEER.get(name)
    shape = _RECURRENT[peer or name]
    vocab = pad_vocab(vocab_size) if vocab_size is not None else shape.vocab_size
    common = dict(
        vocab_size=vocab,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_attention_heads=shape.num_attention_heads,
        num_key_value_heads=shape.num_key_value_heads,
        max_position_embeddings=shape.max_position_embeddings,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if name in _BASELINE_PEER:
        layers = shape.n_prelude_layers + shape.n_core_layers + shape.n_coda_layers
        return LlamaConfig(**{**common, "num_hidden_layers": layers, **overrides})
    if name in _COMPUTE_PEER:
        return LlamaConfig(**{**common, "num_hidden_layers": compute_matched_layers(get(peer, vocab_size)),
                              **overrides})
    return RecurrentDepthConfig(
        **{
            **common,
            "n_prelude_layers": shape.n_prelude_layers,
            "n_core_layers": shape.n_core_layers,
            "n_coda_layers": shape.n_coda_layers,
            "mean_recurrence": shape.mean_recurrence,
            "backprop_depth": shape.backprop_depth,
            # Measured on recurrent-125m (BENCHMARKS.md, "Recurrent training stability"): with pre-norm blocks the
            # unrolled core trains poorly at lr 3e-4 and diverges at 1e-3, with AdamW as with our optimizer.
            "block_norm": "sandwich",
            # Width-independent init with scaled embeddings (BENCHMARKS.md, "Initialisation"): with transformers'
            # N(0, 0.02) the first step's gradient norm grows from 5 at width 768 to 220 at 2048 and 350 at 4096.
            "init_scheme": "scaled",
            **overrides,
        }
    )


def compute_matched_layers(recurrent_config: RecurrentDepthConfig, seq_len: int = 2048) -> int:
    """Layers of a Llama of `recurrent_config`'s widths and vocabulary whose training FLOPs per token come nearest
    the recurrent model's at its mean depth (with its backprop depth and recompute of the steps before it)."""
    def llama(layers: int) -> LlamaConfig:
        return LlamaConfig(vocab_size=recurrent_config.vocab_size, hidden_size=recurrent_config.hidden_size,
                           intermediate_size=recurrent_config.intermediate_size, num_hidden_layers=layers,
                           num_attention_heads=recurrent_config.num_attention_heads,
                           num_key_value_heads=recurrent_config.num_key_value_heads)

    one, two = (flops_per_token(llama(layers), seq_len=seq_len) for layers in (1, 2))
    per_layer, head = two - one, 2 * one - two  # a Transformer's training FLOPs are linear in its layers
    target = flops_per_token(recurrent_config, seq_len=seq_len)
    return max(1, round((target - head) / per_layer))


