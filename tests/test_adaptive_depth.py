"""Adaptive per-token depth: off and zero thresholds change nothing, a huge threshold stops every token after one step,
cached decoding with early exit equals a full forward with the same exits, and the evaluation reports it."""

import pytest
import torch

from hf_recurrent import RecurrentDepthConfig, RecurrentDepthForCausalLM, presets
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


def test_invalid_exit_settings_name_the_argument():
    model = tiny()
    with pytest.raises(ValueError, match="exit_threshold=-1"):
        model(tokens(), exit_threshold=-1)
    with pytest.raises(ValueError, match="exit_criterion='kl'"):
        model(tokens(), exit_threshold=0.1, exit_criterion="kl")
    with pytest.raises(ValueError, match="exit_criterion"):
        RecurrentDepthConfig(exit_criterion="kl")


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
        "--speed_batch_size", "1", "--prompt_len", "4", "--new_tokens", "2", "--speed_repeats", "1",
        "--cache_cost_samples", "0", "--exit_thresholds", "0", "1e9", "--output_dir", str(out), "--plots", "false"]))
    report = read_report(str(out / "results.json"))
    zero, huge = report["adaptive_depth"]
    fixed = {r["num_steps"]: r["ce"] for r in report["results"]}
    assert zero["num_steps"] == huge["num_steps"] == 6 and zero["model"] == "ours"
    assert zero["mean_steps_used"] == 6 and abs(zero["ce_increase"]) < 1e-6 and zero["ce_fixed_depth"] == fixed[6]
    assert huge["mean_steps_used"] == 1 and huge["ce"] == pytest.approx(fixed[1], abs=1e-5)
    table = (out / "results.md").read_text()
    assert "## Adaptive depth" in table and "| ours / 1e+09 | 6 | 1.00 |" in table
    with pytest.raises(ValueError, match="--exit_thresholds"):
        evaluate_script.parse_args(["--checkpoints", str(checkpoint), "--data_dir", tiny_data_dir,
                                    "--exit_thresholds", "-1"])
