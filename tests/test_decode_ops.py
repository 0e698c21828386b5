"""The ops one eager decode step issues (batch-1 decoding on a GPU is bound by the host issuing them), counted on the
CPU in bf16 with `benchmarks.count_ops` against the Llama peer of the same unrolled layers, and the shortcuts that
keep the count down equal to Llama's arithmetic bit for bit."""

from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaAttention, LlamaRotaryEmbedding

from benchmarks.count_ops import decode_step_ops, models
from hf_recurrent import RecurrentDepthForCausalLM, presets
from hf_recurrent.init_recurrent_depth import host_reads_positions, rotary_phases
from hf_recurrent.modeling_recurrent_depth import RecurrentDepthAttention

NUM_STEPS = 12


@pytest.fixture(scope="module")
def counts():
    ours, llama = models("debug", NUM_STEPS, torch.bfloat16)
    prompt = torch.randint(3, ours.config.vocab_size, (1, 8), generator=torch.Generator().manual_seed(0))
    return ours.config, decode_step_ops(ours, prompt, num_steps=NUM_STEPS), decode_step_ops(llama, prompt)


def test_a_decode_step_adds_only_its_extra_norms_and_injection_to_llamas_ops(counts):
    config, ours, llama = counts
    ours, llama = ours["forward"], llama["forward"]
    calls = config.n_prelude_layers + NUM_STEPS * config.n_core_layers + config.n_coda_layers
    # Rotary on queries and keys at once: 5 ops per layer call, plus the phases once per forward.
    assert ours["rotary"] <= 5 * calls + 12
    # Our norms cost what Llama's do, each: 4 per layer call (sandwich) and the prelude, state and final norms.
    norms = 4 * calls + 1 + NUM_STEPS + 1
    assert ours["norm"] / norms <= llama["norm"] / (2 * calls + 1)
    # Anything else (masks, positions, s_0, cache, rotary phases) is no more per token than Llama's: no per-call
    # work repeated at every core step.
    rest = sum(ours.values()) - ours["norm"] - ours.get("injection", 0)
    assert rest <= sum(llama.values()) - llama["norm"]
    assert ours.get("injection", 0) <= 3 * NUM_STEPS  # concat, adapter product, its reshape


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_with_both_rotaries_at_once_equals_llamas_bit_for_bit(dtype):
    config = presets.get("debug")
    llama_config = LlamaConfig(hidden_size=config.hidden_size, num_attention_heads=config.num_attention_heads,
                               num_key_value_heads=config.num_key_value_heads, intermediate_size=176,
                               max_position_embeddings=config.max_position_embeddings)
    llama_config._attn_implementation = config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    ours, llama = RecurrentDepthAttention(config, 0).to(dtype), LlamaAttention(llama_config, 0).to(dtype)
    llama.load_state_dict(ours.state_dict())
    x = torch.randn(2, 7, config.hidden_size, generator=torch.Generator().manual_seed(1)).to(dtype)
    cos, sin = LlamaRotaryEmbedding(llama_config)(x, torch.arange(7)[None] + 5)
    with torch.no_grad():
        got = ours(x, rotary_phases(cos, sin), None)
        want, _ = llama(x, (cos, sin), None)
    assert torch.equal(got, want)


def test_positions_on_an_accelerator_are_read_back_only_without_autograd():
    on_gpu = SimpleNamespace(device=torch.device("cuda"))
    with torch.no_grad():  # decoding: s_0 from the table, not ~76 ops of the hash per step
        assert host_reads_positions(on_gpu)
    assert not host_reads_positions(on_gpu)  # a training step does not wait for the device
    assert host_reads_positions(torch.zeros(1, 3, dtype=torch.long))


def test_the_decode_benchmark_times_every_eager_row_before_compiling():
    """A time budget that runs out leaves compiled and exit rows out, never the default path's: every eager row
    (ours, then Llama's, by depth and batch) comes first."""
    from benchmarks.bench_decode import measurements, parse_args

    args = parse_args(["--device", "cpu", "--exit_thresholds", "0.5"])
    order = [(path, kind, steps, batch) for path, kind, _, steps, batch, _ in measurements(args, "shared")]
    eager = [(p, k, s, b) for s in (12, 4) for b in (1, 8) for p, k in (("eager", "recurrent"), ("eager", "llama"))]
    compiled = [("static+compile", kind, s, b) for _, kind, s, b in eager]
    assert order[:16] == eager + compiled
    assert all("exit" in path for path, *_ in order[16:]) and len(order) > 16


def test_the_decode_benchmark_runs_with_torchs_attention_kernels_or_without_cudnns_and_reports_the_first_call(
        tmp_path, monkeypatch):
    import json

    from benchmarks import bench_decode

    seen, real = [], bench_decode.time_generate

    def timed(*args, **kwargs):  # records whether SDPA may pick cuDNN's attention at each measurement
        seen.append(torch.backends.cuda.cudnn_sdp_enabled())
        return real(*args, **kwargs)

    monkeypatch.setattr(bench_decode, "time_generate", timed)
    for sdpa in ("torch", "no_cudnn"):
        out = tmp_path / f"{sdpa}.json"
        bench_decode.main(["--preset", "debug", "--device", "cpu", "--depths", "2", "--batch_sizes", "1",
                           "--prompt_len", "4", "--new_tokens", "3", "--paths", "eager", "--no_llama", "--warmup",
                           "1", "--repeats", "3", "--sdpa", sdpa, "--output", str(out)])
        report = json.loads(out.read_text())
        assert report["sdpa"] == sdpa and all(r["first_call_tokens_per_s"] > 0 for r in report["results"])
    assert seen == [True, False] and torch.backends.cuda.cudnn_sdp_enabled()


def test_the_decode_benchmark_times_a_trained_checkpoint_on_held_out_prompts(tmp_path, tiny_data_dir):
    import json

    from benchmarks import bench_decode
    from trainer_ext.data.shards import ShardedTokenDataset

    config = presets.get("debug", vocab_size=384)
    RecurrentDepthForCausalLM(config).save_pretrained(tmp_path / "model")
    args = bench_decode.parse_args(["--checkpoint", str(tmp_path / "model"), "--data_dir", tiny_data_dir,
                                    "--prompt_len", "6"])
    heldout = ShardedTokenDataset(tiny_data_dir, split="eval")
    expected = torch.stack([heldout[i]["input_ids"][:6] for i in range(2)])
    assert torch.equal(bench_decode.prompt_ids(args, 2, 384), expected)  # the held-out samples' first tokens
    out = tmp_path / "decode.json"
    bench_decode.main(["--checkpoint", str(tmp_path / "model"), "--data_dir", tiny_data_dir, "--device", "cpu",
                       "--depths", "2", "--batch_sizes", "2", "--prompt_len", "6", "--new_tokens", "3", "--paths",
                       "eager", "--no_llama", "--warmup", "0", "--repeats", "3", "--output", str(out)])
    report = json.loads(out.read_text())
    assert report["checkpoint"] == str(tmp_path / "model") and report["results"][0]["tokens_per_s"] > 0
    with pytest.raises(ValueError, match="held-out samples of 64 tokens"):  # the samples hold 32 tokens
        bench_decode.prompt_ids(bench_decode.parse_args(["--data_dir", tiny_data_dir, "--prompt_len", "64"]), 2, 384)
    with pytest.raises(SystemExit):  # refused before any model is built
        bench_decode.parse_args(["--checkpoint", str(tmp_path / "missing")])
