"""Early exits under `torch.compile` in `kv_cache_mode="shared"`: the core steps run in segments with a host check
between them, and once every token of a call has exited the segments left are not run. Logits, generated tokens,
steps used, hidden states and the cache equal the masked compiled path (one graph); per_step caches and fixed depths
stay one graph."""

from unittest import mock

import pytest
import torch
from torch._dynamo.utils import counters
from transformers import CompileConfig

import hf_recurrent
from hf_recurrent import RecurrentDepthForCausalLM, adaptive_depth, presets
from hf_recurrent.modeling_recurrent_depth import CACHE_FIELD

pytestmark = pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile is unavailable here")

EARLY = 0.5  # the debug model's tokens exit after 4 to 8 of 12 steps: most decode steps leave segments out


def tiny(**overrides) -> RecurrentDepthForCausalLM:
    torch.manual_seed(0)
    return RecurrentDepthForCausalLM(presets.get("debug", **overrides)).eval()


def left_padded(batch=3, seq=9, pads=(0, 3, 5)):
    ids = torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    for row, pad in enumerate(pads):
        ids[row, :pad], mask[row, :pad] = 0, 0
    return ids, mask


class CountingBackend:
    """Dynamo's graphs run as traced (the "eager" backend), counting the graphs and the linear layers their calls
    run."""

    def __init__(self):
        self.graphs, self.linears_run = 0, 0

    def __deepcopy__(self, memo):  # `CompileConfig.to_dict` deep-copies its backend: keep counting here
        return self

    def __call__(self, gm, inputs):
        self.graphs += 1
        linears = sum(1 for node in gm.graph.nodes if node.op == "call_function" and "linear" in str(node.target))

        def run(*args):
            self.linears_run += linears
            return gm.forward(*args)
        return run


def compiled_generate(model, ids, mask, **kwargs):
    """Greedy `generate`, static cache, a compiled decode step (fullgraph=True asked for): (output, backend)."""
    backend = CountingBackend()
    config = CompileConfig(backend=backend, fullgraph=True, mode=None)
    config._compile_all_devices = True  # off-GPU, generate compiles only when told to
    torch._dynamo.reset()
    out = model.generate(ids, attention_mask=mask, num_steps=12, max_new_tokens=6, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True, cache_implementation="static",
                         compile_config=config, **kwargs)
    return out, backend


def test_compiled_generate_leaves_out_exited_segments_with_the_masked_tokens_and_logits():
    model = tiny(kv_cache_mode="shared")
    ids, mask = left_padded()
    masked, masked_backend = compiled_generate(model, ids, mask, exit_threshold=EARLY, exit_check_every=0)
    segmented, backend = compiled_generate(model, ids, mask, exit_threshold=EARLY)
    assert masked_backend.graphs == 1  # exit_check_every=0: one graph, fullgraph as asked
    assert backend.graphs > 1  # generate's default (segments of 4): the segments and the parts around them
    assert torch.equal(segmented.sequences, masked.sequences)
    assert all(torch.equal(a, b) for a, b in zip(segmented.logits, masked.logits, strict=True))
    assert backend.linears_run < 0.8 * masked_backend.linears_run  # exited segments were left out
    eager = model.generate(ids, attention_mask=mask, num_steps=12, max_new_tokens=6, do_sample=False, pad_token_id=0,
                           exit_threshold=EARLY)
    assert torch.equal(segmented.sequences, eager)


def test_exits_with_a_per_step_cache_stay_one_graph_without_graph_breaks():
    """Every step writes its own slot: nothing to leave out, the exits stay masked (fixed depths: test_static_cache)."""
    model = tiny(kv_cache_mode="per_step")
    counters.clear()
    _, backend = compiled_generate(model, *left_padded(), exit_threshold=EARLY, exit_check_every=4)
    assert backend.graphs == 1 and not counters["graph_break"]


def decode(forward, model, ids, mask, **exits):
    """Prefill 5 tokens eagerly, then decode the rest one per row with `forward`: the per-step outputs, the cache."""
    cache = hf_recurrent.static_cache(model.config, max_cache_len=16, num_steps=12)
    exits = dict(num_steps=12, output_hidden_states=True, **exits)
    outs = []
    with torch.no_grad():
        model(ids[:, :5], attention_mask=mask[:, :5], **exits, **{CACHE_FIELD: cache})
        for i in range(5, ids.shape[1]):
            step_mask = mask[:, :i + 1].contiguous()  # a slice's strides would fail the first trace's guards
            torch._dynamo.mark_dynamic(step_mask, 1)  # one trace for the growing mask, not a second on its growth
            outs.append(forward(ids[:, i:i + 1], attention_mask=step_mask, **exits, **{CACHE_FIELD: cache}))
    return outs, cache


@pytest.mark.parametrize("criterion, threshold, every", [("state", EARLY, 4), ("gate", 0.9, 3)])
def test_compiled_decode_steps_in_segments_give_the_masked_steps_used_hidden_states_and_cache(
        criterion, threshold, every):
    # One core layer: the same paths for half the tracing (the generate test above keeps the preset's two).
    model = tiny(kv_cache_mode="shared", exit_gate=criterion == "gate", n_core_layers=1)
    ids, mask = left_padded()
    exits = dict(exit_threshold=threshold, exit_criterion=criterion)
    torch._dynamo.reset()
    masked, masked_cache = decode(torch.compile(model, backend="eager", fullgraph=True), model, ids, mask,
                                  exit_check_every=0, **exits)
    segmented, cache = decode(torch.compile(model, backend="eager"), model, ids, mask, exit_check_every=every, **exits)
    assert int(masked[0].num_steps_used.max()) < 12  # some segments were left out
    for a, b in zip(segmented, masked, strict=True):
        assert torch.equal(a.logits, b.logits) and torch.equal(a.num_steps_used, b.num_steps_used)
        assert all(torch.equal(x, y) for x, y in zip(a.hidden_states, b.hidden_states, strict=True))
    for a, b in zip(cache.layers, masked_cache.layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)


def test_segments_are_planned_only_under_compile_without_autograd_attentions_or_a_per_step_cache():
    depth_exit = adaptive_depth.DepthExit(0.5, (1, 1), torch.device("cpu"), cache_mode="shared")
    with torch.no_grad():
        assert depth_exit.segments(12, None, 4) is None  # eager: `steps` skips step by step
        with mock.patch("torch.compiler.is_compiling", return_value=True):
            # Steps 0-2 first, then two segments of 4 (the same four steps), the last step after them.
            assert depth_exit.segments(12, None, 4) == (range(3), range(7, 11), 2)
            assert depth_exit.segments(13, None, 4) == (range(4), range(8, 12), 2)
            assert depth_exit.segments(12, None, None) == depth_exit.segments(12, None, adaptive_depth.EXIT_CHECK_EVERY)
            assert depth_exit.segments(12, None, 0) is None
            assert depth_exit.segments(5, None, 4) is None  # no segment after the first steps
            assert depth_exit.segments(12, [], 4) is None  # attention weights of every step were asked for
            depth_exit.cache_mode = None  # no cache: the last step may be left out too
            assert depth_exit.segments(12, None, 4) == (range(4), range(8, 12), 2)
            depth_exit.cache_mode = "per_step"
            assert depth_exit.segments(12, None, 4) is None
    with mock.patch("torch.compiler.is_compiling", return_value=True):
        assert depth_exit.segments(12, None, 4) is None  # autograd on


def test_generate_turns_fullgraph_off_only_for_exits_in_segments():
    config = presets.get("debug", kv_cache_mode="shared")
    asked = CompileConfig(fullgraph=True)
    for model_kwargs, fullgraph, every in (({"exit_threshold": 0.5, "exit_check_every": 2}, False, 2),
                                           ({"exit_threshold": 0.5}, False, adaptive_depth.GENERATE_EXIT_CHECK_EVERY),
                                           ({"exit_threshold": 0.5, "exit_check_every": 0}, True, 0),  # masked
                                           ({}, True, None)):  # a fixed depth: one graph
        generation_config = mock.Mock(compile_config=asked)
        adaptive_depth.compile_in_segments(generation_config, config, model_kwargs)
        assert generation_config.compile_config.fullgraph is fullgraph
        assert model_kwargs.get("exit_check_every") == every
    assert asked.fullgraph and adaptive_depth.GENERATE_EXIT_CHECK_EVERY > 0  # the caller's config left as it was
    config.kv_cache_mode = "per_step"
    generation_config, model_kwargs = mock.Mock(compile_config=asked), {"exit_threshold": 0.5}
    adaptive_depth.compile_in_segments(generation_config, config, model_kwargs)
    assert generation_config.compile_config.fullgraph and "exit_check_every" not in model_kwargs


def test_an_eager_generate_is_left_its_own_exit_keywords():
    """Only a compiled decode step gets the segments' default: an eager call's keywords stay the caller's."""
    model = tiny(kv_cache_mode="shared")
    seen = []
    model.register_forward_pre_hook(lambda module, args, kwargs: seen.append(kwargs.get("exit_check_every")),
                                    with_kwargs=True)
    model.generate(left_padded()[0], num_steps=12, max_new_tokens=2, do_sample=False, pad_token_id=0,
                   exit_threshold=EARLY)
    assert len(seen) == 2 and all(every is None for every in seen)


def test_exit_check_every_must_be_a_count():
    model = tiny()
    with pytest.raises(ValueError, match="exit_check_every=-1"):
        model(torch.ones(1, 3, dtype=torch.long), exit_threshold=0.5, exit_check_every=-1)
