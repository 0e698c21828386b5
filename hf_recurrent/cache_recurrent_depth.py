"""The KV cache layout of the recurrent-depth model, for dynamic and static caches.

One cache layer ("slot") per prelude layer, per coda layer and per core layer, the core's repeated once per step in
`kv_cache_mode="per_step"` (one set written by the last step in `"shared"` mode):

    slot = prelude layers | coda layers | core layers at step 1 | core layers at step 2 | ...

transformers builds caches with one slot per unique layer (`config.num_hidden_layers`). A `DynamicCache` is grown
here to the depth of the call; a static cache is allocated up front, so it must be built with the slots of the
deepest call it serves (`static_cache`, or `generate(..., cache_implementation="static")`, which sizes it for the
call's `num_steps`).

Shipped next to the weights with the modeling file (`trust_remote_code` loads it as a flat module).
"""

import torch
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticCache, StaticLayer

try:
    from .configuration_recurrent_depth import RecurrentDepthConfig
except ImportError:  # loaded as a flat module by `trust_remote_code`
    from configuration_recurrent_depth import RecurrentDepthConfig


def cache_slot(config: RecurrentDepthConfig, section: str, index: int, step: int = 0) -> int:
    """The slot of layer `index` of `section` ("prelude", "core", "coda") at core step `step` (0-based)."""
    if section == "prelude":
        return index
    if section == "coda":
        return config.n_prelude_layers + index
    per_step = config.kv_cache_mode == "per_step"
    return config.n_prelude_layers + config.n_coda_layers + (step if per_step else 0) * config.n_core_layers + index


def core_slots(config: RecurrentDepthConfig, num_steps: int) -> list[range]:
    """Per core step (0-based), the slots of the core layers in order: `cache_slot` for a whole call at once."""
    first = config.n_prelude_layers + config.n_coda_layers
    width, stride = config.n_core_layers, config.n_core_layers if config.kv_cache_mode == "per_step" else 0
    return [range(first + step * stride, first + step * stride + width) for step in range(num_steps)]


def num_cache_slots(config: RecurrentDepthConfig, num_steps: int) -> int:
    """How many slots a call at depth `num_steps` uses."""
    return cache_slot(config, "core", config.n_core_layers - 1, num_steps - 1) + 1


def static_cache(config: RecurrentDepthConfig, max_cache_len: int, num_steps: int | None = None,
                 **kwargs) -> StaticCache:
    """A `StaticCache` with the slots of depth `num_steps` (default `config.default_num_steps`), holding
    `max_cache_len` tokens (prompt + new tokens); `kwargs` go to `StaticCache` (e.g. `offloading`). It also serves
    any shallower depth."""
    num_steps = config.default_num_steps if num_steps is None else int(num_steps)
    cache = StaticCache(config=config, max_cache_len=max_cache_len, **kwargs)
    add_static_slots(cache, num_cache_slots(config, num_steps))
    return cache


def add_static_slots(cache: StaticCache, num_slots: int) -> None:
    """Grow a static cache (still empty) to `num_slots` slots of its own length."""
    max_cache_len = cache.layers[0].max_cache_len
    while len(cache.layers) < num_slots:
        cache.layers.append(StaticLayer(max_cache_len=max_cache_len))


def grow_static_cache(cache: Cache, config: RecurrentDepthConfig, num_steps: int | None) -> None:
    """A static cache that `generate` built (one slot per unique layer) gets the slots of depth `num_steps`
    (default `config.default_num_steps`); other caches are left as they are."""
    if is_static(cache):
        add_static_slots(cache, num_cache_slots(config, num_steps or config.default_num_steps))


def is_static(cache: Cache) -> bool:
    return all(isinstance(layer, StaticLayer) for layer in cache.layers) and len(cache.layers) > 0


def cache_for_call(cache: Cache | None, config: RecurrentDepthConfig, num_steps: int, use_cache: bool) -> Cache | None:
    """The cache a forward call at depth `num_steps` reads and writes: None unless `use_cache`, else `cache` (or a
    new `DynamicCache`) with the slots of that depth."""
    if not use_cache:
        return None
    cache = DynamicCache(config=config) if cache is None else cache
    ensure_cache_slots(cache, config, num_steps)
    return cache


def ensure_cache_slots(cache: Cache, config: RecurrentDepthConfig, num_steps: int) -> None:
    """A `DynamicCache` gets the slots of depth `num_steps` added; a static cache must already have them."""
    needed = num_cache_slots(config, num_steps)
    if isinstance(cache, DynamicCache):
        while len(cache.layers) < needed:
            cache.layers.append(DynamicLayer())
    elif not is_static(cache):
        raise unsupported_cache(f"a {type(cache).__name__}")
    elif len(cache.layers) < needed:
        raise ValueError(
            f"This static cache has {len(cache.layers)} slots, but num_steps={num_steps} in "
            f"kv_cache_mode={config.kv_cache_mode!r} needs {needed} ({config.n_prelude_layers} prelude + "
            f"{config.n_coda_layers} coda + {config.n_core_layers} core layers x "
            f"{num_steps if config.kv_cache_mode == 'per_step' else 1}). Build it for the deepest call it serves: "
            f"hf_recurrent.static_cache(config, max_cache_len, num_steps={num_steps}), or let generate build it "
            "(cache_implementation=\"static\")."
        )


def unsupported_cache(what: str) -> ValueError:
    return ValueError(
        f"RecurrentDepth models take a DynamicCache or a static cache (StaticCache, cache_implementation=\"static\"), "
        f"not {what}. Leave cache_implementation unset (or \"dynamic\" / \"static\") and pass no cache, a "
        "DynamicCache or hf_recurrent.static_cache(config, max_cache_len, num_steps)."
    )


def attend_cache(cache: Cache, slot: int, key: torch.Tensor, value: torch.Tensor, read_only: bool,
                 rows: torch.Tensor | None = None):
    """Keys and values to attend over: the slot's past plus this call's, which are stored in the slot unless
    `read_only` (earlier steps in `shared` cache mode, whose keys the last step's replace). `rows` (read-only calls
    on a dynamic slot): the slot's batch rows that this call's rows are, None for all (a step run on part of the
    batch, `adaptive_depth`).

    A static slot receives read-only keys at the call's positions without advancing its length: the last step
    overwrites them, and masks cover the slot's whole length either way. No host sync, so a compiled decode step
    can be captured as one CUDA graph.
    """
    layer = cache.layers[slot]
    if not read_only:
        return cache.update(key, value, slot)
    if isinstance(layer, StaticLayer):
        if not layer.is_initialized:
            layer.lazy_initialization(key, value)
        positions = torch.arange(key.shape[-2], device=layer.keys.device) + layer.cumulative_length
        layer.keys.index_copy_(2, positions, key)
        layer.values.index_copy_(2, positions, value)
        return layer.keys, layer.values
    if layer.is_initialized and layer.keys.numel() > 0:
        keys, values = layer.keys, layer.values
        if rows is not None:
            keys, values = keys.index_select(0, rows), values.index_select(0, rows)
        return torch.cat([keys, key], dim=-2), torch.cat([values, value], dim=-2)
    return key, value


__all__ = ["cache_slot", "core_slots", "num_cache_slots", "static_cache"]
