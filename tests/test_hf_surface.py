"""The Hugging Face surface: optional outputs against a hand-written unroll, tuple outputs, the tensor-parallel plan,
the cache contract, and the depth reaching `forward` from every entry point (forward / generate keyword,
`GenerationConfig`, generation_config.json, `from_pretrained` keyword, remote code)."""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM, GenerationConfig
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import hf_recurrent  # noqa: F401  (registers the Auto classes)
from hf_recurrent import RecurrentDepthForCausalLM, presets
from hf_recurrent.modeling_recurrent_depth import CACHE_FIELD, initial_state


def tiny(attn: str = "sdpa", **overrides) -> RecurrentDepthForCausalLM:
    torch.manual_seed(0)
    model = RecurrentDepthForCausalLM(presets.get("debug", **overrides)).eval()
    model.config._attn_implementation = attn
    return model


def tokens(batch=2, seq=7, seed=1):
    return torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(seed))


GREEDY = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)


# -- hidden states and attentions against a manual unroll


def rms_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    if isinstance(norm, nn.Identity):
        return x
    return norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + norm.variance_epsilon))


def manual_layer(layer, x, cos, sin):
    """One decoder layer written out: causal softmax attention (rotary, GQA) and SwiGLU, with the block's norms."""
    attn, mlp = layer.self_attn, layer.mlp
    batch, seq, _ = x.shape
    h = rms_norm(layer.input_layernorm, x)
    q = attn.q_proj(h).view(batch, seq, -1, attn.head_dim).transpose(1, 2)
    k = attn.k_proj(h).view(batch, seq, -1, attn.head_dim).transpose(1, 2)
    v = attn.v_proj(h).view(batch, seq, -1, attn.head_dim).transpose(1, 2)
    q, k = apply_rotary_pos_emb(q, k, cos, sin)
    k, v = (t.repeat_interleave(attn.num_key_value_groups, dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / attn.head_dim**0.5
    future = torch.ones(seq, seq, dtype=torch.bool).triu(1)
    weights = scores.masked_fill(future, float("-inf")).softmax(-1)  # (B, nh, T, T)
    x = rms_norm(layer.attention_residual_norm, x + attn.o_proj((weights @ v).transpose(1, 2).reshape(batch, seq, -1)))
    h = rms_norm(layer.post_attention_layernorm, x)
    x = rms_norm(layer.mlp_residual_norm, x + mlp.down_proj(nn.functional.silu(mlp.gate_proj(h)) * mlp.up_proj(h)))
    return x, weights


def manual_unroll(model, input_ids, num_steps):
    """The documented layouts, computed by hand: (hidden states, attention weights, logits)."""
    inner, config = model.model, model.config
    positions = torch.arange(input_ids.shape[1])[None]
    embedded = nn.functional.embedding(input_ids, inner.embed_tokens.weight) * config.embedding_scale
    cos, sin = inner.rotary_emb(embedded, positions)
    hidden_states, attentions = [embedded], []

    def run(layer, x):
        x, weights = manual_layer(layer, x, cos, sin)
        attentions.append(weights)
        return x

    x = embedded
    for layer in inner.prelude:
        x = run(layer, x)
        hidden_states.append(x)
    e = rms_norm(inner.prelude_norm, x)
    state = initial_state(config, positions.expand(input_ids.shape[0], -1), e.dtype)
    for _ in range(num_steps):
        x = inner.adapter(torch.cat([state, e], -1)) if config.injection == "concat" else state + e
        for layer in inner.core:
            x = run(layer, x)
        state = rms_norm(inner.state_norm, x)
        hidden_states.append(state)
    x = state
    for layer in inner.coda:
        x = run(layer, x)
        hidden_states.append(x)
    final = rms_norm(inner.norm, x)
    hidden_states[-1] = final
    return hidden_states, attentions, model.lm_head(final)


@pytest.mark.parametrize(
    "overrides",
    [{}, dict(n_prelude_layers=0, n_coda_layers=0, block_norm="pre", injection="add", kv_cache_mode="shared")],
    ids=["debug", "no-prelude-no-coda"],
)
@pytest.mark.parametrize("num_steps", [1, 3])
def test_hidden_states_and_attentions_follow_the_documented_layout(overrides, num_steps):
    model = tiny("eager", **overrides)
    config = model.config
    x = tokens()
    with torch.no_grad():
        out = model(x, num_steps=num_steps, output_hidden_states=True, output_attentions=True)
        hidden, attentions, logits = manual_unroll(model, x, num_steps)
    p, k, c = config.n_prelude_layers, config.n_core_layers, config.n_coda_layers
    assert len(out.hidden_states) == 1 + p + num_steps + c
    assert len(out.attentions) == p + num_steps * k + c
    for i, (got, expected) in enumerate(zip(out.hidden_states, hidden)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=f"hidden state {i}")
    for i, (got, expected) in enumerate(zip(out.attentions, attentions)):
        assert got.shape == (2, config.num_attention_heads, 7, 7)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4, msg=f"attention {i}")
    torch.testing.assert_close(out.logits, logits, atol=1e-5, rtol=1e-4)
    assert torch.equal(out.hidden_states[-1], model.model(x, num_steps=num_steps).last_hidden_state)


def test_optional_outputs_are_off_by_default_and_follow_the_config():
    model = tiny("eager")
    x = tokens()
    with torch.no_grad():
        plain = model(x, num_steps=2)
        assert plain.hidden_states is None and plain.attentions is None
        model.config.output_hidden_states = True
        model.config.output_attentions = True
        from_config = model(x, num_steps=2)
    assert len(from_config.hidden_states) == 1 + 1 + 2 + 1 and len(from_config.attentions) == 1 + 2 * 2 + 1
    torch.testing.assert_close(from_config.logits, plain.logits)


def test_attentions_with_sdpa_are_an_empty_tuple_with_a_warning_naming_eager(caplog):
    """Llama's convention (transformers' test mixins expect it): no error, an empty tuple, a warning."""
    from hf_recurrent.modeling_recurrent_depth import logger

    model = tiny("sdpa")
    logger.warning_once.cache_clear()  # once per process: this test must see it
    with torch.no_grad(), caplog.at_level("WARNING"):
        out = model(tokens(), num_steps=2, output_attentions=True)
        plain = model(tokens(), num_steps=2)
    assert out.attentions == () and plain.attentions is None
    torch.testing.assert_close(out.logits, plain.logits)
    assert '`sdpa` attention does not support `output_attentions=True`' in caplog.text
    assert 'attn_implementation="eager"' in caplog.text
    generated = model.generate(tokens(), output_attentions=True, return_dict_in_generate=True, **GREEDY)
    assert all(step == () for step in generated.attentions)
    # Hidden states need no particular attention implementation, and match eager's.
    with torch.no_grad():
        sdpa = model(tokens(), num_steps=2, output_hidden_states=True).hidden_states
        model.set_attn_implementation("eager")
        eager = model(tokens(), num_steps=2, output_hidden_states=True, output_attentions=True).hidden_states
    for a, b in zip(sdpa, eager):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_generate_returns_hidden_states_and_attentions_per_token():
    model = tiny("eager")
    x = tokens(1, 5)
    out = model.generate(x, num_steps=3, output_hidden_states=True, output_attentions=True,
                         return_dict_in_generate=True, **GREEDY)
    assert len(out.hidden_states) == len(out.attentions) == GREEDY["max_new_tokens"]
    for position, (hidden, attentions) in enumerate(zip(out.hidden_states, out.attentions)):
        assert len(hidden) == 1 + 1 + 3 + 1 and len(attentions) == 1 + 3 * 2 + 1
        seen = 5 + position  # keys attended: prompt plus the tokens generated so far
        assert attentions[0].shape[-1] == seen and hidden[-1].shape[-1] == model.config.hidden_size
    # The prefill's hidden states are a full forward's.
    with torch.no_grad():
        full = model(x, num_steps=3, output_hidden_states=True).hidden_states
    for a, b in zip(out.hidden_states[0], full):
        torch.testing.assert_close(a, b)


# -- tuples, tensor-parallel plan, cache contract


def test_return_dict_false_gives_tuples_in_hf_order():
    model = tiny()
    x = tokens()
    with torch.no_grad():
        full = model(x, labels=x, num_steps=2, output_hidden_states=True)
        loss, logits, cache, hidden_states = model(x, labels=x, num_steps=2, output_hidden_states=True,
                                                   return_dict=False)
        assert torch.equal(loss, full.loss) and torch.equal(logits, full.logits)
        assert type(cache) is type(getattr(full, CACHE_FIELD)) and len(hidden_states) == len(full.hidden_states)
        no_labels = model(x, num_steps=2, use_cache=False, return_dict=False)
        assert len(no_labels) == 1 and torch.equal(no_labels[0], full.logits)
        base = model.model(x, num_steps=2, use_cache=False, return_dict=False)
        assert len(base) == 1 and torch.equal(model.lm_head(base[0]), full.logits)
        # The config's return_dict is the default, as in transformers' models; generate still works.
        model.config.return_dict = False
        assert isinstance(model(x, num_steps=2, use_cache=False), tuple)
    assert model.generate(x, num_steps=2, **GREEDY).shape == (2, 7 + GREEDY["max_new_tokens"])


def test_tensor_parallel_plan_covers_every_projection_and_nothing_else():
    model = tiny()
    plan = model.tp_plan
    assert plan["lm_head"] == "colwise_gather_output"
    projections = {name for name, module in model.named_modules()
                   if isinstance(module, nn.Linear) and name != "lm_head" and not name.endswith("adapter")}
    assert len(projections) == 7 * 4  # q, k, v, o, gate, up, down in each of the 4 layers
    styles = {"q_proj": "colwise", "k_proj": "colwise", "v_proj": "colwise", "o_proj": "rowwise",
              "gate_proj": "colwise", "up_proj": "colwise", "down_proj": "rowwise"}
    used = set()
    for name in projections:
        rule = re.sub(r"\.\d+\.", ".*.", name)  # transformers matches plan rules with the layer index as `*`
        assert plan.get(rule) == styles[name.rsplit(".", 1)[-1]], name
        used.add(rule)
    module_rules = {rule for rule in plan if rule not in ("lm_head", "model.embed_tokens")}
    assert module_rules == used  # no rule that matches nothing


TP_WORKER = """
import json, sys, torch
from transformers import AutoModelForCausalLM
from transformers.distributed import DistributedConfig

import hf_recurrent  # registers the model

torch.distributed.init_process_group("gloo")
rank = torch.distributed.get_rank()
path, out = sys.argv[1], sys.argv[2]
model = AutoModelForCausalLM.from_pretrained(path, distributed_config=DistributedConfig(tp_plan="auto")).eval()
io = torch.load(path + "/io.pt")
with torch.no_grad():
    logits = model(io["x"], num_steps=3).logits
generated = model.generate(io["x"], num_steps=3, max_new_tokens=4, do_sample=False, pad_token_id=0)
shard = lambda weight: list((weight.to_local() if hasattr(weight, "to_local") else weight).shape)
core = model.model.core[0]
report = {"q_proj": shard(core.self_attn.q_proj.weight), "o_proj": shard(core.self_attn.o_proj.weight),
          "up_proj": shard(core.mlp.up_proj.weight), "down_proj": shard(core.mlp.down_proj.weight),
          "logits_diff": (logits - io["logits"]).abs().max().item(),
          "generated_equal": torch.equal(generated, io["generated"])}
json.dump(report, open(f"{out}/rank{rank}.json", "w"))
torch.distributed.barrier()  # neither rank tears gloo down while the other may still use it
torch.distributed.destroy_process_group()
"""


def test_tensor_parallel_on_two_cpu_processes_matches_one(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path)
    x = tokens()
    with torch.no_grad():
        logits = model(x, num_steps=3).logits
    generated = model.generate(x, num_steps=3, max_new_tokens=4, do_sample=False, pad_token_id=0)
    torch.save({"x": x, "logits": logits, "generated": generated}, tmp_path / "io.pt")
    (tmp_path / "worker.py").write_text(TP_WORKER)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(tmp_path / "worker.py"), str(tmp_path), str(tmp_path)]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and both ranks
        output, _ = proc.communicate()
        pytest.fail(f"tensor-parallel worker timed out:\n{output[-4000:]}")
    assert proc.returncode == 0, output[-4000:]
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank{rank}.json").read_text())
        # colwise halves the output rows, rowwise the input columns (H=64, 4 heads x 16, I=176)
        assert report["q_proj"] == [32, 64] and report["o_proj"] == [64, 32]
        assert report["up_proj"] == [88, 64] and report["down_proj"] == [64, 88]
        assert report["logits_diff"] < 1e-5 and report["generated_equal"], report


def test_per_step_cache_stays_exact_with_optional_outputs():
    model = tiny("eager", kv_cache_mode="per_step")
    x = tokens(1, 6)
    kwargs = dict(num_steps=3, output_hidden_states=True, output_attentions=True, **GREEDY)
    cached = model.generate(x, use_cache=True, return_dict_in_generate=True, output_logits=True, **kwargs)
    uncached = model.generate(x, use_cache=False, return_dict_in_generate=True, output_logits=True, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
    assert len(cached.attentions[-1]) == len(uncached.attentions[-1]) == 1 + 3 * 2 + 1
    assert cached.attentions[-1][0].shape[-1] == uncached.attentions[-1][0].shape[-1] == 6 + 5  # all keys seen
    for a, b in zip(cached.logits, uncached.logits):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# -- depth from every entry point


def generated_logits(model, input_ids, **kwargs) -> torch.Tensor:
    out = model.generate(input_ids, return_dict_in_generate=True, output_logits=True, **GREEDY, **kwargs)
    return torch.stack(out.logits)


def test_generation_config_num_steps_reaches_forward():
    model = tiny()
    x = tokens(1, 5)
    keyword = generated_logits(model, x, num_steps=2)
    from_config = generated_logits(model, x, generation_config=GenerationConfig(num_steps=2))
    assert torch.equal(from_config, keyword)
    default = generated_logits(model, x)
    assert model.config.default_num_steps == 4 and not torch.allclose(default, keyword)
    assert torch.equal(default, generated_logits(model, x, num_steps=4))
    # The first step's logits are a forward pass at that depth; a keyword wins over a passed config.
    with torch.no_grad():
        torch.testing.assert_close(keyword[0], model(x, num_steps=2).logits[:, -1])
    both = generated_logits(model, x, num_steps=3, generation_config=GenerationConfig(num_steps=2))
    assert torch.equal(both, generated_logits(model, x, num_steps=3))


@pytest.mark.parametrize("how", ["model.generation_config", "GenerationConfig.save_pretrained"])
def test_generation_config_json_num_steps_is_honoured(tmp_path, how):
    model = tiny()
    if how == "model.generation_config":
        model.generation_config.num_steps = 2
        model.save_pretrained(tmp_path)
    else:  # written next to an existing checkpoint
        model.save_pretrained(tmp_path)
        GenerationConfig(num_steps=2, pad_token_id=0).save_pretrained(tmp_path)
    assert '"num_steps": 2' in (tmp_path / "generation_config.json").read_text()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert reloaded.generation_config.num_steps == 2
    x = tokens(1, 5)
    expected = generated_logits(model, x, num_steps=2)
    assert not torch.allclose(expected, generated_logits(model, x, num_steps=4))
    # Across save and load the weights are equal but the kernels may round differently: compare closely.
    torch.testing.assert_close(generated_logits(reloaded, x), expected)
    torch.testing.assert_close(generated_logits(reloaded, x, generation_config=GenerationConfig()), expected)
    # The checkpoint's generation config does not swallow the generate keyword.
    torch.testing.assert_close(generated_logits(reloaded, x, num_steps=3), generated_logits(model, x, num_steps=3))
    # forward itself is not affected by the generation config: it runs the model config's default.
    with torch.no_grad():
        torch.testing.assert_close(reloaded(x).logits, model(x, num_steps=4).logits)


def test_from_pretrained_num_steps_sets_the_default_depth_only(tmp_path):
    model = tiny()
    model.save_pretrained(tmp_path / "a")
    x = tokens()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "a", num_steps=2).eval()
    assert reloaded.config.num_steps == 2 and reloaded.config.default_num_steps == 2
    # Training is untouched: the depth distribution, the backprop bound and the init use mean_recurrence.
    assert reloaded.config.mean_recurrence == model.config.mean_recurrence == 4
    with torch.no_grad():
        expected = model(x, num_steps=2).logits
        assert not torch.allclose(expected, model(x).logits)
        torch.testing.assert_close(reloaded(x).logits, expected)
        torch.testing.assert_close(reloaded(x, num_steps=3).logits, model(x, num_steps=3).logits)
    torch.testing.assert_close(generated_logits(reloaded, x[:1]), generated_logits(model, x[:1], num_steps=2))
    # Saved with the checkpoint, so the default survives a round trip.
    reloaded.save_pretrained(tmp_path / "b")
    assert AutoModelForCausalLM.from_pretrained(tmp_path / "b").config.num_steps == 2
    # mean_recurrence also sets the default (and the training centre), as a config override.
    by_mean = AutoModelForCausalLM.from_pretrained(tmp_path / "a", mean_recurrence=2).eval()
    with torch.no_grad():
        torch.testing.assert_close(by_mean(x).logits, expected)
    with pytest.raises(ValueError, match="num_steps"):
        reloaded.config.num_steps = 0
        reloaded(x)


def test_remote_code_takes_the_depth_from_from_pretrained_and_generation_config(tmp_path):
    """What lm-evaluation-harness does with model_args="pretrained=CKPT,trust_remote_code=True,num_steps=2"."""
    model = tiny()
    model.save_pretrained(tmp_path)
    x = tokens(1, 5)
    with torch.no_grad():
        expected = model(x, num_steps=2).logits
    torch.save({"x": x, "expected": expected, "generated": generated_logits(model, x, num_steps=3)},
               tmp_path / "io.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["hf_recurrent"] = None  # the package must not be importable
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig
        model = AutoModelForCausalLM.from_pretrained({str(tmp_path)!r}, trust_remote_code=True, num_steps=2).eval()
        assert type(model).__module__.startswith("transformers_modules"), type(model).__module__
        io = torch.load({str(tmp_path / 'io.pt')!r})
        with torch.no_grad():
            torch.testing.assert_close(model(io["x"]).logits, io["expected"])
        out = model.generate(io["x"], generation_config=GenerationConfig(num_steps=3, max_new_tokens=6,
                             do_sample=False, pad_token_id=0), return_dict_in_generate=True, output_logits=True)
        torch.testing.assert_close(torch.stack(out.logits), io["generated"])
        # The sibling modules shipped with the modeling code: the static cache slots, adaptive depth.
        static = model.generate(io["x"], num_steps=3, max_new_tokens=6, do_sample=False, pad_token_id=0,
                                cache_implementation="static", return_dict_in_generate=True, output_logits=True)
        torch.testing.assert_close(torch.stack(static.logits), io["generated"], atol=1e-5, rtol=1e-4)
        with torch.no_grad():
            exited = model(io["x"], num_steps=3, exit_threshold=1e9)
        assert bool((exited.num_steps_used == 1).all())
        print("REMOTE_OK")
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_MODULES_CACHE": str(tmp_path / "modules")}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env,
                            cwd=tmp_path, timeout=300)
    assert "REMOTE_OK" in result.stdout, result.stderr[-3000:]
