"""The width-independent initialisation (`init_scheme="scaled"`, scaled embeddings) and the depth curriculum."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_recurrent import DepthSampler, RecurrentDepthConfig, RecurrentDepthForCausalLM, presets


def first_step_grad_norm(init_scheme: str, hidden: int, seed: int = 0) -> float:
    """Gradient norm of one backward at init on random tokens (fp32, CPU): the width-stability check."""
    heads = hidden // 64
    config = presets.get("debug", init_scheme=init_scheme, hidden_size=hidden, intermediate_size=hidden * 8 // 3,
                         num_attention_heads=heads, num_key_value_heads=heads)
    torch.manual_seed(seed)
    model = RecurrentDepthForCausalLM(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 65), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids[:, :-1], labels=ids[:, 1:], shift_labels=ids[:, 1:].contiguous()).loss.backward()
    return math.sqrt(sum(p.grad.float().pow(2).sum().item() for p in model.parameters() if p.grad is not None))


def test_scaled_init_keeps_the_first_gradient_norm_small_as_width_grows():
    scaled = {hidden: first_step_grad_norm("scaled", hidden) for hidden in (128, 1024)}
    normal = {hidden: first_step_grad_norm("normal", hidden) for hidden in (128, 1024)}
    assert max(scaled.values()) < 10
    # Both grow like sqrt(width) through the LM head's and embeddings' fan-in; transformers' N(0, 0.02) faster
    # (it explodes from width 2048 on: BENCHMARKS.md, "Initialisation").
    assert scaled[1024] / scaled[128] < 3.2
    assert normal[1024] / normal[128] > scaled[1024] / scaled[128] + 0.8
    assert normal[1024] > 1.4 * scaled[1024]


def test_scaled_init_statistics_follow_the_formula():
    config = presets.get("debug", hidden_size=256, intermediate_size=704)
    assert config.init_scheme == "scaled" and config.embedding_scale == pytest.approx(16.0)
    torch.manual_seed(0)
    model = RecurrentDepthForCausalLM(config)
    std = math.sqrt(2 / (5 * 256))
    unrolled = config.n_prelude_layers + config.n_coda_layers + config.n_core_layers * config.mean_recurrence
    layer = model.model.core[0]
    for weight, expected in [(layer.self_attn.q_proj.weight, std), (layer.mlp.up_proj.weight, std),
                             (model.model.embed_tokens.weight, std), (model.lm_head.weight, std),
                             (layer.self_attn.o_proj.weight, std / math.sqrt(2 * unrolled)),
                             (layer.mlp.down_proj.weight, std / math.sqrt(2 * unrolled))]:
        assert weight.std().item() == pytest.approx(expected, rel=0.1)
        assert weight.abs().max().item() <= 3 * expected * 1.0001  # truncated at 3 sigma
    assert torch.all(layer.input_layernorm.weight == 1)
    ids = torch.tensor([[5, 7, 9]])
    torch.testing.assert_close(model.get_input_embeddings()(ids), model.model.embed_tokens.weight[ids] * 16.0)


def test_configs_without_the_new_fields_keep_the_old_init_and_forward(tmp_path):
    config = presets.get("debug")
    model = RecurrentDepthForCausalLM(config).eval()
    model.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        saved = json.load(f)
    assert saved["init_scheme"] == "scaled" and saved["embedding_scale"] == pytest.approx(8.0)
    ids = torch.randint(3, 500, (2, 10), generator=torch.Generator().manual_seed(1))
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(ids, num_steps=3).logits, model(ids, num_steps=3).logits)
    # A checkpoint written before the fields existed: transformers' init and unscaled embeddings.
    for key in ("init_scheme", "embedding_scale", "depth_warmup_steps"):
        del saved[key]
    old = RecurrentDepthConfig(**saved)
    assert (old.init_scheme, old.embedding_scale, old.depth_warmup_steps) == ("normal", 1.0, 0)
    old_model = RecurrentDepthForCausalLM(old)
    torch.testing.assert_close(old_model.get_input_embeddings()(ids), old_model.model.embed_tokens.weight[ids])
    assert old_model.model.core[0].self_attn.o_proj.weight.std().item() == pytest.approx(0.02, rel=0.1)


@pytest.mark.parametrize("overrides, field", [(dict(init_scheme="xavier"), "init_scheme"),
                                              (dict(embedding_scale=0.0), "embedding_scale"),
                                              (dict(depth_warmup_steps=-1), "depth_warmup_steps")])
def test_invalid_init_fields_name_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        presets.get("debug", **overrides)


def test_depth_curriculum_ramps_the_mean_then_matches_the_plain_sampler():
    plain = DepthSampler(presets.get("recurrent-125m"), seed=2)
    ramp = DepthSampler(presets.get("recurrent-125m", depth_warmup_steps=400), seed=2)
    assert ramp(0) == 1 and ramp.mean_at(200) == pytest.approx(4.5)
    early = [ramp(step) for step in range(100)]
    assert sum(early) / len(early) < 0.6 * sum(plain(step) for step in range(100)) / 100
    # After the curriculum a draw is the plain sampler's draw at that step (resume stays exact).
    assert [ramp(step) for step in range(400, 460)] == [plain(step) for step in range(400, 460)]
    fixed = DepthSampler(presets.get("recurrent-125m", depth_distribution="fixed", depth_warmup_steps=8))
    assert [fixed(step) for step in range(0, 10, 2)] == [1, 3, 4, 6, 8]  # round half to even
