"""Static KV caches and compiled decoding: `generate(..., cache_implementation="static")` against the dynamic cache in
both cache modes, the slot count a static cache needs for a depth, and a compiled decode step against eager."""

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig, DynamicCache, StaticCache
from transformers.cache_utils import Cache, DynamicLayer

import hf_recurrent
from hf_recurrent import RecurrentDepthForCausalLM, presets
from hf_recurrent.modeling_recurrent_depth import CACHE_FIELD


def tiny(**overrides) -> RecurrentDepthForCausalLM:
    torch.manual_seed(0)
    return RecurrentDepthForCausalLM(presets.get("debug", **overrides)).eval()


def tokens(batch=2, seq=7, seed=1):
    return torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(seed))


GREEDY = dict(max_new_tokens=6, do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)


def compile_config(backend: str = "aot_eager") -> CompileConfig:
    """What `generate` compiles the decode step with; off-GPU it compiles only when told to."""
    config = CompileConfig(backend=backend, fullgraph=True, mode=None)
    config._compile_all_devices = True
    return config


@pytest.mark.parametrize("mode", ["per_step", "shared"])
@pytest.mark.parametrize("num_steps", [2, 5])
def test_static_cache_generation_equals_dynamic(mode, num_steps):
    model = tiny(kv_cache_mode=mode)
    x = tokens()
    mask = torch.ones_like(x)
    mask[0, :2] = 0  # a left-padded row: the static cache's 4D mask must hide the padding too
    dynamic = model.generate(x, attention_mask=mask, num_steps=num_steps, **GREEDY)
    static = model.generate(x, attention_mask=mask, num_steps=num_steps, cache_implementation="static", **GREEDY)
    assert type(getattr(static, CACHE_FIELD)) is StaticCache
    assert torch.equal(static.sequences, dynamic.sequences)
    for a, b in zip(static.logits, dynamic.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_static_cache_has_the_slots_of_the_depth_and_equals_a_full_forward():
    model = tiny(kv_cache_mode="per_step")
    config = model.config
    cache = hf_recurrent.static_cache(config, max_cache_len=16, num_steps=3)
    assert len(cache.layers) == config.n_prelude_layers + config.n_coda_layers + 3 * config.n_core_layers
    x = tokens(1, 10)
    with torch.no_grad():
        full = model(x, num_steps=3, use_cache=False).logits
        model(x[:, :7], num_steps=3, **{CACHE_FIELD: cache})
        steps = [model(x[:, i:i + 1], num_steps=3, **{CACHE_FIELD: cache}).logits for i in range(7, 10)]
        # A cache built for depth 3 serves any shallower depth too.
        shallow = hf_recurrent.static_cache(config, max_cache_len=16, num_steps=3)
        torch.testing.assert_close(model(x, num_steps=2, **{CACHE_FIELD: shallow}).logits,
                                   model(x, num_steps=2, use_cache=False).logits, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(torch.cat(steps, dim=1), full[:, 7:], atol=1e-5, rtol=1e-4)


def test_a_static_cache_too_small_for_the_depth_names_the_fix():
    model = tiny(kv_cache_mode="per_step")
    x = tokens(1, 5)
    # transformers' own StaticCache has one slot per unique layer: enough for depth 1 only.
    with torch.no_grad():
        model(x, num_steps=1, **{CACHE_FIELD: StaticCache(config=model.config, max_cache_len=16)})
    for cache, num_steps in ((StaticCache(config=model.config, max_cache_len=16), 2),
                             (hf_recurrent.static_cache(model.config, 16, num_steps=2), 3)):
        with pytest.raises(ValueError, match=rf"num_steps={num_steps}.*static_cache\(config, max_cache_len, "
                                             rf"num_steps={num_steps}\)"):
            model(x, num_steps=num_steps, **{CACHE_FIELD: cache})
    # In shared mode the slots do not depend on the depth.
    shared = tiny(kv_cache_mode="shared")
    with torch.no_grad():
        shared(x, num_steps=4, **{CACHE_FIELD: StaticCache(config=shared.config, max_cache_len=16)})


def test_other_caches_are_refused_with_the_alternatives():
    model = tiny()
    plain = Cache(layers=[DynamicLayer() for _ in range(4)])  # neither dynamic nor static
    with pytest.raises(ValueError, match="DynamicCache or a static cache"):
        model(tokens(1, 5), num_steps=2, **{CACHE_FIELD: plain})
    with torch.no_grad():
        model(tokens(1, 5), num_steps=2, **{CACHE_FIELD: DynamicCache(config=model.config)})


@pytest.mark.parametrize("mode", ["per_step", "shared"])
def test_compiled_decode_step_equals_eager(mode):
    """`generate` compiles the decode forward (fullgraph: no graph break) once for all decode steps."""
    model = tiny(kv_cache_mode=mode)
    x = tokens()
    kwargs = dict(GREEDY, max_new_tokens=8, num_steps=3, cache_implementation="static")
    eager = model.generate(x, **kwargs)
    torch._dynamo.reset()
    counters.clear()
    compiled = model.generate(x, compile_config=compile_config(), **kwargs)
    assert counters["stats"]["unique_graphs"] == 1 and not counters["graph_break"]
    assert torch.equal(compiled.sequences, eager.sequences)
    for a, b in zip(compiled.logits, eager.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_fullgraph_compiled_forward_decodes_like_eager():
    """The decode step under `torch.compile(fullgraph=True)` directly, positions derived from the static cache."""
    model = tiny()
    x = tokens(1, 6)
    step = torch.compile(model, backend="eager", fullgraph=True)
    results = {}
    for name, forward in (("eager", model), ("compiled", step)):
        cache = hf_recurrent.static_cache(model.config, max_cache_len=16, num_steps=3)
        with torch.no_grad():
            logits = model(x, num_steps=3, **{CACHE_FIELD: cache}).logits[:, -1:]
            generated = []
            for _ in range(4):
                next_token = logits.argmax(-1)
                generated.append(next_token)
                logits = forward(next_token, num_steps=3, **{CACHE_FIELD: cache}).logits
        results[name] = torch.cat(generated, dim=1)
    assert torch.equal(results["compiled"], results["eager"])
