"""Adaptive per-token depth: off and zero thresholds change nothing, a huge threshold stops every token after one step,
cached decoding with early exit equals a full forward with the same exits, the steps left once every token has exited
are skipped where that is exact (same outputs and cache as the masked steps, fewer core passes), and the evaluation
reports it. Steps run on part of a batch: tests/test_exits.py."""

from unittest import mock

import pytest
import torch

from hf_recurrent import RecurrentDepthConfig, RecurrentDepthForCausalLM, adaptive_depth, presets
from hf_recurrent.modeling_recurrent_depth import CACHE_FIELD
from trainer_ext.cli import evaluate_checkpoints as evaluate_script
from trainer_ext.evaluation.checkpoints import evaluate_checkpoints
from trainer_ext.evaluation.report import read_report


def tiny(**overrides) -> RecurrentDepthForCausalLM:
    torch.manual_seed(0)
    return RecurrentDepthForCausalLM(presets.get("debug", **overrides)).eval()


def tokens(batch=2, seq=9, seed=1):
    return torch.randint(3, 500, (batch, seq), generator=torch.Generator().manual_seed(seed))


# A threshold at which the debug model's tokens exit after different numbers of steps (5 to 12 at n = 12).
MIXED = 0.3


def test_threshold_zero_is_the_fixed_depth_and_off_reports_nothing():
    model = tiny()
    x = tokens()
    with torch.no_grad():
        fixed = model(x, num_steps=5, use_cache=False, output_hidden_states=True)
        zero = model(x, num_steps=5, use_cache=False, output_hidden_states=True, exit_threshold=0)
    assert fixed.num_steps_used is None
    assert torch.equal(zero.logits, fixed.logits)
    assert all(torch.equal(a, b) for a, b in zip(zero.hidden_states, fixed.hidden_states))
    assert zero.num_steps_used.shape == (2, 9) and bool((zero.num_steps_used == 5).all())


def test_huge_threshold_stops_every_token_after_one_step():
    model = tiny()
    x = tokens()
    with torch.no_grad():
        exited = model(x, num_steps=6, use_cache=False, exit_threshold=1e9)
        one_step = model(x, num_steps=1, use_cache=False)
    assert bool((exited.num_steps_used == 1).all())
    torch.testing.assert_close(exited.logits, one_step.logits)


def test_steps_used_count_the_steps_until_the_state_converged():
    model = tiny()
    x = tokens()
    with torch.no_grad():
        out = model(x, num_steps=12, use_cache=False, exit_threshold=MIXED, output_hidden_states=True)
        fixed = model(x, num_steps=12, use_cache=False, output_hidden_states=True)
    used = out.num_steps_used
    assert used.min() >= 1 and used.max() <= 12 and len(used.unique()) > 1
    # The state stays frozen once a token exits: the recorded states stop changing after its step.
    p = model.config.n_prelude_layers
    states = torch.stack(out.hidden_states[1 + p:1 + p + 12])  # (12, B, T, C)
    for b, t in ((0, 0), (1, 4)):
        k = int(used[b, t])
        assert all(torch.equal(states[k - 1, b, t], states[j, b, t]) for j in range(k, 12))
        # The step it exited after changed its state by less than the threshold.
        if k > 1:
            prev, cur = states[k - 2, b, t], states[k - 1, b, t]
            assert ((cur - prev).norm() / cur.norm()) < MIXED
    # The first step of every token is the fixed-depth model's first step.
    torch.testing.assert_close(states[0], fixed.hidden_states[1 + p])


@pytest.mark.parametrize("mode", ["per_step", "shared"])
def test_cached_decoding_with_early_exit_equals_a_full_forward(mode):
    model = tiny(kv_cache_mode=mode)
    x = tokens(1, 12)
    with torch.no_grad():
        full = model(x, num_steps=12, use_cache=False, exit_threshold=MIXED)
        prefix = model(x[:, :8], num_steps=12, use_cache=True, exit_threshold=MIXED)
        cache = getattr(prefix, CACHE_FIELD)
        steps = [model(x[:, i:i + 1], num_steps=12, exit_threshold=MIXED, **{CACHE_FIELD: cache}) for i in range(8, 12)]
    used = torch.cat([prefix.num_steps_used] + [s.num_steps_used for s in steps], dim=1)
    assert torch.equal(used, full.num_steps_used) and len(used.unique()) > 1
    if mode == "per_step":  # exact; the shared cache is an approximation at n > 1 with or without exits
        torch.testing.assert_close(torch.cat([s.logits for s in steps], dim=1), full.logits[:, 8:],
                                   atol=1e-5, rtol=1e-4)


def test_generate_with_early_exit_cached_equals_uncached_and_config_default():
    model = tiny(kv_cache_mode="per_step")
    x = tokens(1, 6)
    kwargs = dict(num_steps=12, max_new_tokens=6, do_sample=False, pad_token_id=0)
    cached = model.generate(x, exit_threshold=MIXED, **kwargs)
    assert torch.equal(cached, model.generate(x, exit_threshold=MIXED, use_cache=False, **kwargs))
    assert torch.equal(cached, model.generate(x, exit_threshold=MIXED, cache_implementation="static", **kwargs))
    model.config.exit_threshold = MIXED  # the config's threshold is the default of every call
    assert torch.equal(cached, model.generate(x, **kwargs))


class CoreCalls:
    """Counts the calls of `model`'s core layers inside a `with` block."""

    def __init__(self, model):
        self.layers, self.calls = model.model.core, 0

    def __enter__(self):
        self.handles = [layer.register_forward_pre_hook(self.count) for layer in self.layers]
        return self

    def count(self, *_):
        self.calls += 1

    def __exit__(self, *_):
        for handle in self.handles:
            handle.remove()


def skipped_and_masked(model, monkeypatch, call):
    """`call()` under `no_grad` with the exited steps skipped, then with every step masked: [(result, core calls)].
    Steps are not compacted here (exact: whole steps left out); tests/test_exits.py compares compacted steps."""
    runs = []
    monkeypatch.setattr(adaptive_depth, "COMPACT_EXITED_STEPS", False)
    for skip in (True, False):
        monkeypatch.setattr(adaptive_depth, "SKIP_EXITED_STEPS", skip)
        with CoreCalls(model) as counter, torch.no_grad():
            result = call()
        runs.append((result, counter.calls))
    return runs


def decode(model, x, prefix_len, num_steps=12, threshold=MIXED):
    """Prefill `x[:, :prefix_len]`, then feed the rest one token at a time: (decode logits, steps used, cache)."""
    out = model(x[:, :prefix_len], num_steps=num_steps, use_cache=True, exit_threshold=threshold)
    cache, used, logits = getattr(out, CACHE_FIELD), [out.num_steps_used], []
    for i in range(prefix_len, x.shape[1]):
        out = model(x[:, i:i + 1], num_steps=num_steps, exit_threshold=threshold, **{CACHE_FIELD: cache})
        logits.append(out.logits)
        used.append(out.num_steps_used)
    return torch.cat(logits, dim=1), torch.cat(used, dim=1), cache


@pytest.mark.parametrize("mode", ["shared", "per_step"])
def test_decoding_skips_exited_steps_in_shared_mode_only_and_exactly(mode, monkeypatch):
    model = tiny(kv_cache_mode=mode)
    x, n, k = tokens(1, 12), 12, model.config.n_core_layers
    (skipped, skipped_calls), (masked, masked_calls) = skipped_and_masked(model, monkeypatch,
                                                                          lambda: decode(model, x, 8))
    assert torch.equal(skipped[0], masked[0]) and torch.equal(skipped[1], masked[1])
    for a, b in zip(skipped[2].layers, masked[2].layers, strict=True):
        assert torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
    prefill, decoded = skipped[1][0, :8], skipped[1][0, 8:]
    assert prefill.max() == n and decoded.max() < n - 1  # one prefill token runs all n steps: nothing skipped there
    assert masked_calls == 5 * n * k
    if mode == "shared":  # a decode token that exits after j steps: j passes, then the last (cache-writing) one
        assert skipped_calls == k * (n + sum(int(j) + 1 for j in decoded))
    else:
        assert skipped_calls == masked_calls


@pytest.mark.parametrize("threshold", [MIXED, 0.5, 1e9])
def test_uncached_forward_stops_once_every_token_has_exited(threshold, monkeypatch):
    model = tiny()
    x, n = tokens(), 12
    (skipped, skipped_calls), (masked, masked_calls) = skipped_and_masked(model, monkeypatch, lambda: model(
        x, num_steps=n, use_cache=False, exit_threshold=threshold, output_hidden_states=True))
    assert torch.equal(skipped.logits, masked.logits) and torch.equal(skipped.num_steps_used, masked.num_steps_used)
    # Skipped steps record the frozen state: the documented 1 + P + n + C entries, equal to the masked ones.
    config = model.config
    assert len(skipped.hidden_states) == 1 + config.n_prelude_layers + n + config.n_coda_layers
    assert all(torch.equal(a, b) for a, b in zip(skipped.hidden_states, masked.hidden_states, strict=True))
    # All n steps run while any token of the batch still iterates (MIXED: one does until the last step).
    used = int(skipped.num_steps_used.max())
    assert skipped_calls == used * config.n_core_layers and masked_calls == n * config.n_core_layers
    assert (used == n) == (threshold == MIXED)


@pytest.mark.parametrize("static", [False, True])
def test_generate_in_shared_mode_skips_exited_steps_with_the_same_tokens(static, monkeypatch):
    model = tiny(kv_cache_mode="shared")
    kwargs = dict(num_steps=12, max_new_tokens=6, do_sample=False, pad_token_id=0, exit_threshold=MIXED,
                  return_dict_in_generate=True, output_logits=True)
    if static:  # read-only steps write a static slot in place: skipping them must leave the same cache
        kwargs["cache_implementation"] = "static"
    (skipped, skipped_calls), (masked, masked_calls) = skipped_and_masked(model, monkeypatch, lambda: model.generate(
        tokens(1, 6), **kwargs))
    assert torch.equal(skipped.sequences, masked.sequences)
    assert all(torch.equal(a, b) for a, b in zip(skipped.logits, masked.logits, strict=True))
    assert skipped_calls < masked_calls


def test_steps_are_skipped_only_without_autograd_attentions_compile_or_a_per_step_cache():
    depth_exit = adaptive_depth.DepthExit(1e9, (1, 1), torch.device("cpu"), cache_mode="shared")
    with torch.no_grad():
        assert not isinstance(depth_exit.steps(4, None, None), range)
        assert isinstance(depth_exit.steps(4, None, []), range)  # attention weights of every step were asked for
        with mock.patch("torch.compiler.is_compiling", return_value=True):
            assert isinstance(depth_exit.steps(4, None, None), range)
        depth_exit.cache_mode = "per_step"
        assert isinstance(depth_exit.steps(4, None, None), range)
    depth_exit.cache_mode = None
    assert isinstance(depth_exit.steps(4, None, None), range)  # autograd on: training


def test_invalid_exit_settings_name_the_argument():
    model = tiny()
    with pytest.raises(ValueError, match="exit_threshold=-1"):
        model(tokens(), exit_threshold=-1)
    with pytest.raises(ValueError, match="exit_criterion='kl'"):
        model(tokens(), exit_threshold=0.1, exit_criterion="kl")
    with pytest.raises(ValueError, match="exit_criterion"):
        RecurrentDepthConfig(exit_criterion="kl")


def test_batched_exit_prompts_are_distinct_windows_checked_before_any_work(tiny_data_dir, tmp_path):
    from trainer_ext.evaluation.checkpoints import _speed_prompts

    samples = [{"input_ids": torch.arange(start, start + 10)} for start in (0, 100)]
    # first the first window of every sample, then the next window of each: 2 samples of 10 give 4 windows of 4
    rows = _speed_prompts(samples, prompt_len=4, rows=3, split="eval")
    assert rows.tolist() == [[0, 1, 2, 3], [100, 101, 102, 103], [4, 5, 6, 7]]
    assert _speed_prompts(samples, 4, 4, "eval")[3].tolist() == [104, 105, 106, 107]
    with pytest.raises(ValueError, match="--speed_batch_size=5 with --prompt_len=4 needs 5 held-out prompts; "
                                         "--split eval holds 4 windows"):
        _speed_prompts(samples, 4, 5, "eval")
    with pytest.raises(ValueError, match="--prompt_len=11 is longer than every sample of the --split eval split"):
        _speed_prompts(samples, 11, 1, "eval")
    # through the command: refused before a checkpoint is read (this one does not exist)
    with pytest.raises(ValueError, match="--speed_batch_size=64 with --prompt_len=8"):
        evaluate_checkpoints(evaluate_script.parse_args([
            "--checkpoints", str(tmp_path / "missing"), "--data_dir", tiny_data_dir, "--max_samples", "4",
            "--speed_batch_size", "64", "--prompt_len", "8", "--exit_thresholds", "0.1", "--output_dir",
            str(tmp_path / "eval")]))
    assert not (tmp_path / "eval").exists()


def test_evaluate_reports_steps_used_and_ce_difference(tiny_data_dir, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_data_dir)
    torch.manual_seed(0)
    checkpoint = tmp_path / "ours" / "final"
    RecurrentDepthForCausalLM(presets.get("debug", vocab_size=len(tokenizer))).save_pretrained(checkpoint)
    tokenizer.save_pretrained(checkpoint)
    out = tmp_path / "eval"
    evaluate_checkpoints(evaluate_script.parse_args([
        "--checkpoints", str(checkpoint), "--data_dir", tiny_data_dir, "--depths", "1", "6", "--max_samples", "4",
        "--speed_batch_size", "3", "--prompt_len", "4", "--new_tokens", "2", "--speed_repeats", "1",
        "--cache_cost_samples", "0", "--exit_thresholds", "0", "1e9", "--output_dir", str(out), "--plots", "false"]))
    report = read_report(str(out / "results.json"))
    zero, huge = report["adaptive_depth"]
    fixed = {r["num_steps"]: r["ce"] for r in report["results"]}
    assert zero["num_steps"] == huge["num_steps"] == 6 and zero["model"] == "ours"
    assert zero["mean_steps_used"] == 6 and abs(zero["ce_increase"]) < 1e-6 and zero["ce_fixed_depth"] == fixed[6]
    assert huge["mean_steps_used"] == 1 and huge["ce"] == pytest.approx(fixed[1], abs=1e-5)
    for row in (zero, huge):  # batch-1 decoding with the shared cache, against the fixed depth 6
        assert row["decode_tokens_per_s"] > 0 and row["decode_tokens_per_s_fixed_depth"] > 0
        assert row["decode_speedup"] == pytest.approx(row["decode_tokens_per_s"] / row["decode_tokens_per_s_fixed_depth"])
        # the evaluation's forward passes timed against depth 6 fixed; decoding 3 held-out prompts at once
        rate, fixed_rate = row["forward_tokens_per_s"], row["forward_tokens_per_s_fixed_depth"]
        assert rate > 0 and row["eval_speedup"] == pytest.approx(rate / fixed_rate)
        assert row["decode_batch"] == 3 and row["decode_tokens_per_s_batch"] > 0 and row["decode_speedup_batch"] > 0
    assert zero["decode_tokens_per_s_fixed_depth"] == huge["decode_tokens_per_s_fixed_depth"]
    assert zero["forward_tokens_per_s_fixed_depth"] == huge["forward_tokens_per_s_fixed_depth"]
    table = (out / "results.md").read_text()
    assert "## Adaptive depth" in table and "| ours / 1e+09 | 6 | 1.00 |" in table and "(batch 3) |" in table
    with pytest.raises(ValueError, match="--exit_thresholds"):
        evaluate_script.parse_args(["--checkpoints", str(checkpoint), "--data_dir", tiny_data_dir,
                                    "--exit_thresholds", "-1"])
