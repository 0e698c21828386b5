import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, LlamaForCausalLM

import hf_recurrent
from hf_recurrent import DepthSampler, RecurrentDepthConfig, RecurrentDepthForCausalLM, flops_per_token, presets
from hf_recurrent.modeling_recurrent_depth import CACHE_FIELD
from trainer_ext.compat import set_checkpointing


def tiny(**overrides) -> RecurrentDepthForCausalLM:
    torch.manual_seed(0)
    config = presets.get("debug", **overrides)
    return RecurrentDepthForCausalLM(config).eval()


def tokens(batch=2, seq=12, seed=1):
    return torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(seed))


def test_auto_classes_registered():
    config = AutoConfig.for_model("recurrent_depth", hidden_size=64, num_attention_heads=4, intermediate_size=128)
    assert isinstance(config, RecurrentDepthConfig)
    assert isinstance(AutoModelForCausalLM.from_config(config), RecurrentDepthForCausalLM)
    assert type(AutoModel.from_config(config)).__name__ == "RecurrentDepthModel"


@pytest.mark.parametrize(
    "overrides, field",
    [
        (dict(hidden_size=66), "num_attention_heads"),
        (dict(mean_recurrence=0), "mean_recurrence"),
        (dict(mean_recurrence=4, backprop_depth=5), "backprop_depth"),
        (dict(kv_cache_mode="paged"), "kv_cache_mode"),
        (dict(injection="mul"), "injection"),
        (dict(state_init="uniform"), "state_init"),
        (dict(depth_distribution="gamma"), "depth_distribution"),
        (dict(num_key_value_heads=3), "num_key_value_heads"),
        (dict(block_norm="post"), "block_norm"),
    ],
)
def test_invalid_config_names_the_field(overrides, field):
    with pytest.raises(ValueError, match=field):
        presets.get("debug", **overrides)


@pytest.mark.parametrize("peer,recurrent", [("transformer-debug", "debug"), ("transformer-125m", "recurrent-125m"),
                                            ("transformer-3.3b", "recurrent-3.3b")])
def test_compute_matched_baselines_train_at_the_recurrent_models_flops_per_token(peer, recurrent):
    """The -compute peer: the widths of the parameter-matched one, and the layers that give the recurrent model's
    training FLOPs per token at its mean depth, to within half a layer."""
    from hf_recurrent.cost import flops_per_token

    matched, same_params, target = presets.get(f"{peer}-compute"), presets.get(peer), presets.get(recurrent)
    assert (matched.hidden_size, matched.intermediate_size) == (same_params.hidden_size, same_params.intermediate_size)
    assert matched.num_hidden_layers > same_params.num_hidden_layers
    per_layer = flops_per_token(same_params) / same_params.num_hidden_layers  # an upper bound: the head counted too
    assert abs(flops_per_token(matched) - flops_per_token(target)) <= per_layer / 2
    assert presets.get(f"{peer}-compute", vocab_size=1000).vocab_size == 1024  # the data's vocabulary, padded


def test_unknown_preset_lists_the_choices():
    with pytest.raises(ValueError, match="recurrent-3.3b"):
        presets.get("recurrent-42b")


def test_num_steps_must_be_positive():
    model = tiny()
    with pytest.raises(ValueError, match="num_steps"):
        model(tokens(), num_steps=0)


def test_output_depends_on_depth_and_state_stays_bounded():
    model = tiny()
    x = tokens()
    with torch.no_grad():
        logits = {n: model(x, num_steps=n, use_cache=False).logits for n in (1, 4, 64)}
        hidden = model.model(x, num_steps=64, use_cache=False).last_hidden_state
    assert not torch.allclose(logits[1], logits[4])
    assert not torch.allclose(logits[4], logits[64])
    assert torch.isfinite(logits[64]).all()
    # RMS of the final hidden state stays at the norm's scale at any depth.
    rms = hidden.pow(2).mean(-1).sqrt()
    assert rms.max() < 10


def test_state_init_is_reproducible_and_seeded():
    x = tokens()
    a, b = tiny(), tiny()
    with torch.no_grad():
        assert torch.equal(a(x, use_cache=False).logits, b(x, use_cache=False).logits)
    c = tiny(state_init_seed=7)
    c.load_state_dict(a.state_dict())
    with torch.no_grad():
        assert not torch.allclose(a(x, use_cache=False).logits, c(x, use_cache=False).logits)


@pytest.mark.parametrize("injection", ["concat", "add"])
def test_truncated_backprop_runs_early_steps_without_grad(injection):
    model = tiny(injection=injection).train()
    seen = []
    model.model.core[0].register_forward_hook(lambda *_: seen.append(torch.is_grad_enabled()))
    out = model(tokens(), labels=tokens(), num_steps=6, backprop_depth=2)
    assert seen == [False] * 4 + [True] * 2
    out.loss.backward()
    for name, param in model.model.core.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    assert model.model.embed_tokens.weight.grad.abs().sum() > 0


def test_backprop_depth_equal_to_depth_matches_full_backprop():
    x = tokens()
    grads = []
    for k in (None, 3):
        model = tiny().train()
        model(x, labels=x, num_steps=3, backprop_depth=k).loss.backward()
        grads.append(model.model.core[0].mlp.up_proj.weight.grad.clone())
    torch.testing.assert_close(grads[0], grads[1])


def test_gradient_checkpointing_gives_same_gradients():
    x = tokens()
    grads = []
    for checkpointing in (False, True):
        model = tiny().train()
        if checkpointing:
            set_checkpointing(model, True)  # by either line's method name
        model(x, labels=x, num_steps=3).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
    for name in grads[0]:
        torch.testing.assert_close(grads[0][name], grads[1][name], msg=name)


def test_sandwich_blocks_normalise_every_layer_and_pre_norm_blocks_do_not():
    x = tokens()
    for block_norm, bounded in (("sandwich", True), ("pre", False)):
        model = tiny(block_norm=block_norm)
        outputs = []
        hooks = [layer.register_forward_hook(lambda _m, _i, out: outputs.append(out)) for layer in model.model.prelude]
        with torch.no_grad():
            model(x, num_steps=2, use_cache=False)
        for hook in hooks:
            hook.remove()
        # Norm weights start at one, so a normalised output has unit RMS per token.
        rms = outputs[0].pow(2).mean(-1).sqrt()
        assert torch.allclose(rms, torch.ones_like(rms), atol=1e-3) == bounded, block_norm


def test_recurrent_presets_use_sandwich_blocks_and_old_configs_load_as_pre_norm(tmp_path):
    assert presets.get("recurrent-125m").block_norm == "sandwich"
    model = tiny()
    model.save_pretrained(tmp_path)
    with open(tmp_path / "config.json") as f:
        saved = json.load(f)
    assert saved["block_norm"] == "sandwich"
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x, num_steps=3).logits, model(x, num_steps=3).logits)
    # A checkpoint written before the field existed has pre-norm blocks.
    del saved["block_norm"]
    assert RecurrentDepthConfig(**saved).block_norm == "pre"


def test_qk_norm_makes_attention_independent_of_the_query_and_key_scale_and_is_off_by_default(tmp_path):
    assert presets.get("recurrent-7b").qk_norm is False and RecurrentDepthConfig().qk_norm is False
    assert not any("q_norm" in key or "k_norm" in key for key in tiny().state_dict())  # old checkpoints match
    x = tokens()
    for qk_norm in (True, False):
        model = tiny(qk_norm=qk_norm)
        with torch.no_grad():
            before = model(x, num_steps=3, use_cache=False).logits
            for module in model.modules():
                if type(module).__name__ == "RecurrentDepthAttention":
                    module.q_proj.weight.mul_(30.0)
                    module.k_proj.weight.mul_(30.0)
            after = model(x, num_steps=3, use_cache=False).logits
        assert torch.allclose(before, after, atol=1e-4) == qk_norm, qk_norm
    model = tiny(qk_norm=True)
    layers = len(model.model.prelude) + len(model.model.core) + len(model.model.coda)
    norms = [key for key in model.state_dict() if key.endswith(("q_norm.weight", "k_norm.weight"))]
    assert len(norms) == 2 * layers
    model.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.config.qk_norm is True
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x, num_steps=3).logits, model(x, num_steps=3).logits)
        full = model(x, num_steps=4, use_cache=False).logits  # the cache stays exact with normalised keys
        prefix = model(x[:, :7], num_steps=4, use_cache=True)
        step = model(x[:, 7:], num_steps=4, **{CACHE_FIELD: getattr(prefix, CACHE_FIELD)})
    torch.testing.assert_close(step.logits, full[:, 7:], atol=1e-5, rtol=1e-4)
    # Named by our check, or first by the strict config base of newer transformers (its own error class).
    with pytest.raises(Exception, match="qk_norm"):
        RecurrentDepthConfig(qk_norm="yes")


@pytest.mark.parametrize("num_steps", [1, 4, 8])
def test_per_step_cache_generation_equals_uncached(num_steps):
    model = tiny(kv_cache_mode="per_step")
    x = tokens(batch=1, seq=6)
    kwargs = dict(num_steps=num_steps, max_new_tokens=8, do_sample=False, pad_token_id=0)
    cached = model.generate(x, use_cache=True, **kwargs)
    uncached = model.generate(x, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


def test_per_step_cache_logits_match_full_forward():
    model = tiny(kv_cache_mode="per_step")
    x = tokens(batch=1, seq=10)
    with torch.no_grad():
        full = model(x, num_steps=4, use_cache=False).logits
        prefix = model(x[:, :7], num_steps=4, use_cache=True)
        step = model(x[:, 7:], num_steps=4, **{CACHE_FIELD: getattr(prefix, CACHE_FIELD)})
    torch.testing.assert_close(step.logits, full[:, 7:], atol=1e-5, rtol=1e-4)


def _cache_elements(cache) -> int:
    return sum(layer.keys.numel() + layer.values.numel() for layer in cache.layers if layer.is_initialized)


def test_shared_cache_equals_per_step_at_depth_one_and_does_not_grow():
    x = tokens(batch=1, seq=6)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    shared, per_step = tiny(kv_cache_mode="shared"), tiny(kv_cache_mode="per_step")
    assert torch.equal(shared.generate(x, num_steps=1, **kwargs), per_step.generate(x, num_steps=1, **kwargs))
    sizes = {}
    with torch.no_grad():
        for n in (1, 4, 16):
            sizes[("shared", n)] = _cache_elements(getattr(shared(x, num_steps=n, use_cache=True), CACHE_FIELD))
            sizes[("per_step", n)] = _cache_elements(getattr(per_step(x, num_steps=n, use_cache=True), CACHE_FIELD))
    assert sizes[("shared", 1)] == sizes[("shared", 4)] == sizes[("shared", 16)]
    assert sizes[("per_step", 16)] > sizes[("per_step", 4)] > sizes[("per_step", 1)]
    # Shared mode is an approximation but still a sensible decoder at depth > 1.
    out = shared.generate(x, num_steps=4, **kwargs)
    assert out.shape == (1, 12)


@pytest.mark.parametrize("attn", ["eager", "sdpa"])
def test_left_padding_matches_unpadded(attn):
    model = tiny()
    model.config._attn_implementation = attn
    short, long = tokens(1, 5, seed=3), tokens(1, 9, seed=4)
    batch = torch.zeros(2, 9, dtype=torch.long)
    batch[0, 4:], batch[1] = short[0], long[0]
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[0, :4] = 0
    with torch.no_grad():
        padded = model(batch, attention_mask=mask, num_steps=3, use_cache=False).logits
        alone = model(short, num_steps=3, use_cache=False).logits
        alone_long = model(long, num_steps=3, use_cache=False).logits
    torch.testing.assert_close(padded[0, 4:], alone[0], atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(padded[1], alone_long[0], atol=1e-5, rtol=1e-4)


def test_left_padded_batch_generation_matches_single():
    model = tiny()
    short, long = tokens(1, 4, seed=5), tokens(1, 7, seed=6)
    batch = torch.zeros(2, 7, dtype=torch.long)
    batch[0, 3:], batch[1] = short[0], long[0]
    mask = torch.ones_like(batch)
    mask[0, :3] = 0
    kwargs = dict(num_steps=3, max_new_tokens=5, do_sample=False, pad_token_id=0)
    both = model.generate(batch, attention_mask=mask, **kwargs)
    assert torch.equal(both[0, 3:], model.generate(short, **kwargs)[0])
    assert torch.equal(both[1], model.generate(long, **kwargs)[0])


def test_hf_conventions():
    model = tiny()
    assert model.supports_gradient_checkpointing
    assert set(model._no_split_modules) == {"RecurrentDepthDecoderLayer"}
    assert model._supports_sdpa
    assert model.get_input_embeddings() is model.model.embed_tokens
    assert model.get_output_embeddings() is model.lm_head
    with torch.no_grad():
        last = model(tokens(), logits_to_keep=1, use_cache=False).logits
        full = model(tokens(), use_cache=False).logits
    assert last.shape[1] == 1
    torch.testing.assert_close(last[:, 0], full[:, -1])


def test_weight_tying_is_optional():
    assert tiny().lm_head.weight is not tiny().model.embed_tokens.weight
    tied = tiny(tie_word_embeddings=True)
    assert tied.lm_head.weight is tied.model.embed_tokens.weight


def test_save_writes_safetensors_code_and_auto_map(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path)
    files = set(os.listdir(tmp_path))
    assert {"model.safetensors", "config.json", "modeling_recurrent_depth.py", "configuration_recurrent_depth.py",
            "cache_recurrent_depth.py", "adaptive_depth.py", "init_recurrent_depth.py",
            "loading_recurrent_depth.py"} <= files
    auto_map = json.loads((tmp_path / "config.json").read_text())["auto_map"]
    assert auto_map["AutoModelForCausalLM"].endswith("RecurrentDepthForCausalLM")
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    x = tokens()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x, num_steps=5).logits, model(x, num_steps=5).logits)


def test_remote_code_loads_without_the_package(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path)
    x = tokens(1, 8)
    with torch.no_grad():
        expected = model(x, num_steps=3, use_cache=False).logits
    torch.save({"x": x, "expected": expected}, tmp_path / "io.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["hf_recurrent"] = None  # the package must not be importable
        import torch
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True)
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        io = torch.load({str(tmp_path / 'io.pt')!r})
        with torch.no_grad():
            got = model(io["x"], num_steps=3, use_cache=False).logits
        torch.testing.assert_close(got, io["expected"])
        out = model.generate(io["x"], num_steps=2, max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert out.shape == (1, 11)
        print("REMOTE_OK")
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=300)
    assert "REMOTE_OK" in result.stdout, result.stderr[-3000:]


def test_compiled_state_dict_prefix_is_stripped(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    save_file({f"_orig_mod.{k}": v for k, v in state.items()}, tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for name, tensor in model.state_dict().items():
        torch.testing.assert_close(reloaded.state_dict()[name], tensor, msg=name)


def test_presets_sizes_and_baseline_peers():
    def count(config):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        return sum(p.numel() for p in model.parameters()), model

    unique, model = count(presets.get("recurrent-3.3b"))
    core = sum(p.numel() for p in model.model.core.parameters()) + model.model.adapter.weight.numel()
    unrolled = unique + (model.config.mean_recurrence - 1) * core
    assert 3.1e9 < unique < 3.6e9 and 6.5e9 < unrolled < 8e9
    assert 6.5e9 < count(presets.get("recurrent-7b"))[0] < 7.5e9
    for baseline, peer in (("transformer-125m", "recurrent-125m"), ("transformer-3.3b", "recurrent-3.3b")):
        base_count, base_model = count(presets.get(baseline))
        assert isinstance(base_model, LlamaForCausalLM)
        assert abs(base_count - count(presets.get(peer))[0]) / base_count < 0.02
    assert presets.get("debug", vocab_size=1000).vocab_size == 1024
    assert presets.get("transformer-125m", vocab_size=32001).vocab_size == 32064


def test_flops_per_token_matches_hand_count():
    config = presets.get("debug", injection="concat")  # H=64, I=176, 4 heads x 16, 2 kv heads, V=512
    H, I, V, T, q, kv = 64, 176, 512, 128, 64, 32
    layer = 2 * H * (2 * q + 2 * kv) + 2 * 3 * H * I + 2 * 2 * q * (T + 1) / 2
    step = 2 * layer + 2 * 2 * H * H  # two core layers + adapter
    unique = 2 * layer + 2 * H * V  # prelude + coda + head
    assert flops_per_token(config, num_steps=6, backprop_depth=2, seq_len=T) == 3 * (unique + 2 * step) + 4 * step
    assert flops_per_token(config, num_steps=6, seq_len=T, training=False) == unique + 6 * step
    # More depth costs more; a baseline counts every layer once.
    assert flops_per_token(config, num_steps=8, seq_len=T) > flops_per_token(config, num_steps=4, seq_len=T)
    base = presets.get("transformer-debug")
    assert flops_per_token(base, seq_len=T) == 3 * (4 * layer + 2 * H * V)


def test_depth_sampler_is_reproducible_with_the_configured_mean():
    config = presets.get("recurrent-125m")
    a, b = DepthSampler(config, seed=3), DepthSampler(config, seed=3)
    draws = [a(step) for step in range(2000)]
    assert draws[:50] == [b(step) for step in range(50)]
    assert min(draws) >= 1 and max(draws) <= 4 * config.mean_recurrence
    assert abs(sum(draws) / len(draws) - config.mean_recurrence) < 0.5
    assert len(set(draws)) > 5
    assert DepthSampler(presets.get("debug", depth_distribution="fixed"))(11) == 4


def test_cache_argument_name_matches_installed_transformers():
    import transformers
    major, minor = (int(v) for v in transformers.__version__.split(".")[:2])
    assert CACHE_FIELD == ("cache" if (major, minor) >= (5, 24) else "past_key_values")
    assert hf_recurrent.RecurrentDepthConfig.model_type == "recurrent_depth"


def test_resaving_a_compiled_checkpoint_writes_clean_keys(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path / "a")
    assert not any(k.startswith("_orig_mod") for k in load_file(tmp_path / "a" / "model.safetensors"))
    state = load_file(tmp_path / "a" / "model.safetensors")
    save_file({f"_orig_mod.{k}": v for k, v in state.items()}, tmp_path / "a" / "model.safetensors",
              metadata={"format": "pt"})
    AutoModelForCausalLM.from_pretrained(tmp_path / "a").save_pretrained(tmp_path / "b")
    assert set(load_file(tmp_path / "b" / "model.safetensors")) == set(state)


# -- the decode step's shortcuts give Llama's arithmetic bit for bit


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_rotary_shortcuts_equal_llamas_bit_for_bit(dtype):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from hf_recurrent.modeling_recurrent_depth import RecurrentDepthRMSNorm, rotary_phases

    x = (torch.randn(3, 5, 64, generator=torch.Generator().manual_seed(0)) * 3).to(dtype)
    ours, llama = RecurrentDepthRMSNorm(64), LlamaRMSNorm(64)
    with torch.no_grad():
        ours.weight.normal_()
        llama.weight.copy_(ours.weight)
        ours.to(dtype), llama.to(dtype)
        want = llama(x)
        assert torch.equal(ours(x), want)  # eager without autograd: torch.rms_norm
    assert torch.equal(ours(x), want)  # a training step: the ops themselves
    model = tiny()
    q, k = (torch.randn(3, 5, heads, 16, generator=torch.Generator().manual_seed(heads)).to(dtype) for heads in (4, 2))
    cos, sin = model.model.rotary_emb(x, torch.arange(5)[None] + 7)
    expected = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    cos4, sin4 = rotary_phases(cos, sin)
    for got, want in zip([(t * cos4 + t.roll(8, -1) * sin4).transpose(1, 2) for t in (q, k)], expected):
        assert torch.equal(got, want)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the fused rms_norm kernel is CUDA's")
def test_the_fused_cuda_norm_of_decoding_rounds_as_the_training_norm():
    """On CUDA, eager without autograd the norm is one fused kernel: its sum of squares runs in another order than
    the ops' (mean), so a bf16 output may differ from the training path's by one unit in the last place, no more."""
    from hf_recurrent.modeling_recurrent_depth import RecurrentDepthRMSNorm

    norm = RecurrentDepthRMSNorm(4096).cuda().to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.normal_()
    x = (torch.randn(8, 128, 4096, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 3)
    x = x.to(torch.bfloat16)
    with torch.no_grad():
        fused = norm(x)
        with torch.autocast("cuda", dtype=torch.bfloat16):  # autocast runs rms_norm in fp32: cast back, as the ops do
            autocast = norm(x)
    ops = norm(x).detach()
    assert fused.dtype == autocast.dtype == ops.dtype == torch.bfloat16
    for got in (fused, autocast):
        largest = torch.maximum(got.float().abs(), ops.float().abs())
        ulp = torch.finfo(torch.bfloat16).eps * largest.clamp(min=torch.finfo(torch.bfloat16).tiny)
        assert ((got.float() - ops.float()).abs() <= ulp * 2).all()  # the weight's product rounds once more


def test_initial_states_come_from_a_table_built_once_and_equal_the_hash(monkeypatch):
    from hf_recurrent import init_recurrent_depth

    model = tiny()
    config, states = model.config, model.model.initial_states
    positions = torch.tensor([[0, 5, 63], [1, 2, 200]])
    direct = init_recurrent_depth.initial_state(config, positions, torch.float32)
    assert torch.equal(states(config, positions, torch.float32, 200), direct)
    assert states.table.shape == (201, config.hidden_size)
    assert torch.equal(states(config, positions, torch.float32, None), direct)  # largest position unknown: hashed
    far = torch.tensor([[config.max_position_embeddings + 3]])  # beyond the table's cap: hashed
    assert torch.equal(states(config, far, torch.float32, int(far.max())),
                       init_recurrent_depth.initial_state(config, far, torch.float32))
    assert states.table.shape[0] <= config.max_position_embeddings
    hashes, original = [], init_recurrent_depth._hash_to_unit

    def counted(*args):
        hashes.append(args[0].shape)
        return original(*args)

    monkeypatch.setattr(init_recurrent_depth, "_hash_to_unit", counted)
    model.model.initial_states = init_recurrent_depth.InitialStates()
    out = model.generate(tokens(1, 10), num_steps=3, max_new_tokens=20, do_sample=False, pad_token_id=0)
    assert len(hashes) == 2  # one table (two draws per element) serves the prefill and every decode step
    model.model.initial_states = init_recurrent_depth.InitialStates()
    assert torch.equal(out, model.generate(tokens(1, 10), num_steps=3, max_new_tokens=20, do_sample=False,
                                           pad_token_id=0, use_cache=False))


def test_a_training_forward_without_positions_never_looks_for_packed_sequences(monkeypatch):
    """transformers' search for packed sequences reads the device back (on a GPU the host then waits for the whole
    step before it): it runs only on positions the caller gives, and those still mask each packed sequence apart."""
    import transformers.masking_utils as masking

    searched = []
    find = masking.find_packed_sequence_indices
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda ids: searched.append(ids) or find(ids))
    model = tiny().train()
    ids = tokens(batch=1, seq=12)
    model(input_ids=ids, use_cache=False, num_steps=2)
    assert searched == []
    # Two sequences of 6 packed in one row, each at positions 0-5: the second one's logits are its own alone.
    model.eval()
    packed = model(input_ids=ids, position_ids=torch.arange(6).repeat(2)[None], use_cache=False, num_steps=2).logits
    assert len(searched) == 1
    alone = model(input_ids=ids[:, 6:], use_cache=False, num_steps=2).logits
    torch.testing.assert_close(packed[:, 6:], alone, rtol=1e-4, atol=1e-4)
