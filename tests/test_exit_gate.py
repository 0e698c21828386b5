"""A learned exit gate (`exit_gate=True`, exit_criterion="gate"): its exits equal the masked reference through the
compacted paths, it is refused on a model without one, Ouro's expected loss over depths has the hand-computed value
and trains the gate, the config round-trips, and a model without the gate trains exactly as before."""

import functools
import math
import os

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoTokenizer

from hf_recurrent import RecurrentDepthConfig, RecurrentDepthForCausalLM, adaptive_depth, cost, flops_per_token, presets
from trainer_ext.data.shards import ShardedTokenDataset
from trainer_ext.distill.losses import chunked_lm_loss
from trainer_ext.training.arguments import TARGETS, RecurrentTrainingArguments
from trainer_ext.training.depth_supervision import ExitGateLoss
from trainer_ext.training.exit_gate import exit_distribution, expected_exit_loss, token_ce
from trainer_ext.training.trainer import RecurrentTrainer

from test_exits import decode, left_padded

CLOSE = dict(atol=1e-5, rtol=1e-5)


def gated(seed=0, **overrides) -> RecurrentDepthForCausalLM:
    """The debug model with a gate whose exits differ from token to token (a trained gate's would; a fresh one is
    zero: lambda = 1/2 everywhere)."""
    torch.manual_seed(seed)
    model = RecurrentDepthForCausalLM(presets.get("debug", exit_gate=True, **overrides)).eval()
    with torch.no_grad():
        model.model.exit_gate.weight.normal_(std=0.4)
        model.model.exit_gate.bias.fill_(-1.5)
    return model


@pytest.mark.parametrize("mode", ["shared", "per_step"])
def test_gate_exits_in_a_left_padded_batch_equal_the_masked_reference(mode, monkeypatch):
    model = gated(kv_cache_mode=mode)
    ids, mask = left_padded((14, 11, 14, 6), seq=14)
    runs = []
    monkeypatch.setattr(adaptive_depth, "BLOCK_LENGTH_MULTIPLE", 1)  # cuts right after the last iterating token
    for compact, skip in ((True, True), (False, False)):  # compacted blocks; every step masked on the whole batch
        monkeypatch.setattr(adaptive_depth, "COMPACT_EXITED_STEPS", compact)
        monkeypatch.setattr(adaptive_depth, "SKIP_EXITED_STEPS", skip)
        with torch.no_grad():
            runs.append(decode(model, ids, mask, 8, threshold=0.8, criterion="gate"))
    (logits, used, cache), (ref_logits, ref_used, ref_cache) = runs
    assert torch.equal(used, ref_used) and len(used[mask.bool()].unique()) > 2
    torch.testing.assert_close(logits, ref_logits, **CLOSE)
    for a, b in zip(cache.layers, ref_cache.layers, strict=True):
        torch.testing.assert_close(a.keys, b.keys, **CLOSE)
        torch.testing.assert_close(a.values, b.values, **CLOSE)


def test_a_token_exits_at_the_first_step_its_cumulative_exit_probability_reaches_the_threshold():
    model = gated()
    ids, threshold = torch.randint(3, 500, (2, 9), generator=torch.Generator().manual_seed(2)), 0.8
    with torch.no_grad():
        out = model(ids, num_steps=12, use_cache=False, output_hidden_states=True)
        exited = model(ids, num_steps=12, use_cache=False, exit_threshold=threshold, exit_criterion="gate")
        states = torch.stack(out.hidden_states[2:14])  # (12, B, T, C): after each step (1 prelude layer)
        cdf = 1 - torch.cumprod(1 - torch.sigmoid(model.model.exit_gate(states).squeeze(-1)), dim=0)
    expected = ((cdf >= threshold).int().argmax(0) + 1).where((cdf >= threshold).any(0), torch.tensor(12))
    assert torch.equal(exited.num_steps_used, expected) and len(expected.unique()) > 2
    # Full forward, batched generate (compacted, dynamic cache) and a static cache (masked) agree.
    greedy = dict(num_steps=12, exit_threshold=threshold, exit_criterion="gate", max_new_tokens=5, do_sample=False,
                  pad_token_id=0)
    dynamic = model.generate(ids[:1, :6], **greedy)
    assert torch.equal(dynamic, model.generate(ids[:1, :6], cache_implementation="static", **greedy))
    assert torch.equal(dynamic, model.generate(ids[:1, :6], use_cache=False, **greedy))


def test_the_gate_criterion_is_refused_without_a_gate_naming_exit_gate():
    torch.manual_seed(0)
    model = RecurrentDepthForCausalLM(presets.get("debug")).eval()
    assert not hasattr(model.model, "exit_gate")  # old configs: no new parameters
    with pytest.raises(ValueError, match=r"exit_criterion='gate'.*exit_gate.*exit_gate=True"):
        model(torch.tensor([[5, 6]]), exit_threshold=0.5, exit_criterion="gate")
    with pytest.raises(ValueError, match=r"exit_gate=True"):
        RecurrentDepthConfig(exit_criterion="gate")
    with pytest.raises(ValueError, match=r"exit_threshold=1.5 .*\(0, 1\]"):
        gated()(torch.tensor([[5, 6]]), exit_threshold=1.5, exit_criterion="gate")


def test_config_and_gate_round_trip_through_save_and_load(tmp_path):
    model = gated()
    model.save_pretrained(tmp_path)
    loaded = RecurrentDepthForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.exit_gate is True
    assert torch.equal(loaded.model.exit_gate.weight, model.model.exit_gate.weight)
    ids = torch.tensor([[5, 6, 7, 8]])
    with torch.no_grad():
        a, b = (m(ids, num_steps=6, exit_threshold=0.7, exit_criterion="gate") for m in (model, loaded))
    assert torch.equal(a.num_steps_used, b.num_steps_used) and torch.equal(a.logits, b.logits)
    fresh = RecurrentDepthForCausalLM(presets.get("debug", exit_gate=True))
    assert not fresh.model.exit_gate.weight.any() and not fresh.model.exit_gate.bias.any()  # lambda = 1/2


def test_expected_loss_matches_a_hand_computed_value_and_its_gradient_reaches_the_gate():
    lambdas = torch.tensor([[[0.2, 0.9]], [[0.5, 0.1]], [[0.7, 0.3]]])  # (K=3, B=1, T=2)
    ce = torch.tensor([[[3.0, 2.0]], [[2.0, 1.0]], [[1.0, 4.0]]])
    # token 0: p = 0.2, 0.8 * 0.5, 0.8 * 0.5 (the last takes the rest); token 1: 0.9, 0.1 * 0.1, 0.1 * 0.9
    p0, p1 = [0.2, 0.4, 0.4], [0.9, 0.01, 0.09]
    assert torch.allclose(exit_distribution(lambdas)[:, 0], torch.tensor([p0, p1]).T)
    expected = (sum(p * c for p, c in zip(p0, [3, 2, 1])) + sum(p * c for p, c in zip(p1, [2, 1, 4]))) / 2
    entropy = (-sum(p * math.log(p) for p in p0) - sum(p * math.log(p) for p in p1)) / 2
    loss, got_expected, got_entropy = expected_exit_loss(lambdas, ce, torch.ones(1, 2, dtype=torch.bool), 0.05)
    assert got_expected.item() == pytest.approx(expected) and got_entropy.item() == pytest.approx(entropy)
    assert loss.item() == pytest.approx(expected - 0.05 * entropy)
    keep = torch.tensor([[True, False]])  # an ignored position counts in neither term
    assert expected_exit_loss(lambdas, ce, keep, 0.0)[0].item() == pytest.approx(sum(
        p * c for p, c in zip(p0, [3, 2, 1])))

    torch.manual_seed(0)
    hidden, weight = torch.randn(2, 5, 8), torch.randn(11, 8)
    labels = torch.randint(0, 11, (2, 5))
    labels[0, 0] = -100
    reference = F.cross_entropy((hidden @ weight.T).flatten(0, 1), labels.flatten(), reduction="none").view(2, 5)
    torch.testing.assert_close(token_ce(hidden, weight, labels, chunk_size=3), reference)

    # Through the model: the trainer's loss gives the gate (initialised at zero) a non-zero gradient.
    model = RecurrentDepthForCausalLM(presets.get("debug", exit_gate=True)).train()
    objective, ids = ExitGateLoss(1, 0.05), torch.randint(3, 500, (2, 8))
    with objective.capture(model.model, {"num_steps": 4}) as captured:
        hidden = model.model(ids, num_steps=4, use_cache=False).last_hidden_state
    assert captured.steps == [1, 2, 3, 4]
    lm_loss = functools.partial(chunked_lm_loss, lm_head_weight=model.lm_head.weight, labels=ids)  # as the trainer's
    out = objective.loss(model.model, hidden, captured, lm_loss)
    assert torch.isfinite(out.loss)
    out.loss.backward()
    assert model.model.exit_gate.weight.grad.abs().sum() > 0 and model.model.exit_gate.bias.grad.abs() > 0
    assert model.model.core[0].mlp.up_proj.weight.grad.abs().sum() > 0
    logs = objective.logs()
    assert sorted(k for k in logs if k.startswith("ce_depth_")) == [f"ce_depth_{i}" for i in range(1, 5)]
    assert 1 <= logs["exit_gate_mean_step"] <= 4 and logs["exit_gate_entropy"] == pytest.approx(math.log(4), abs=0.2)


def test_the_gate_trains_on_every_step_it_is_read_at_the_model_on_the_steps_with_gradients():
    """With gradients through the last 2 of 6 steps, the gate's objective still covers all 6 (inference reads the gate
    after each): its value and the gate's gradient equal the expected loss over the 6 steps' CE (each from a forward
    at that depth) and gates; the model's gradient comes from the last two; the 4 extra readouts count as FLOPs."""
    model = gated().train()
    ids = torch.randint(3, 500, (2, 8))
    objective, depth = ExitGateLoss(1, 0.05), {"num_steps": 6, "backprop_depth": 2}
    with objective.capture(model.model, depth) as captured:
        hidden = model.model(ids, use_cache=False, **depth).last_hidden_state
    assert captured.steps == [1, 2, 3, 4, 5, 6] and captured.gate_only == [1, 2, 3, 4]
    lm_loss = functools.partial(chunked_lm_loss, lm_head_weight=model.lm_head.weight, labels=ids)
    out = objective.loss(model.model, hidden, captured, lm_loss)
    out.loss.backward()
    gate = [model.model.exit_gate.weight, model.model.exit_gate.bias]

    with torch.no_grad():
        ce = torch.stack([token_ce(model.model(ids, num_steps=n, use_cache=False).last_hidden_state,
                                   model.lm_head.weight, ids) for n in range(1, 7)])
        states = model.model(ids, num_steps=6, use_cache=False, output_hidden_states=True).hidden_states
    first = 1 + model.config.n_prelude_layers  # the state after step 1
    lambdas = torch.stack([torch.sigmoid(model.model.exit_gate(s).squeeze(-1)) for s in states[first:first + 6]])
    reference = expected_exit_loss(lambdas, ce, torch.ones_like(ids, dtype=torch.bool), 0.05)[0]
    torch.testing.assert_close(out.loss, reference, **CLOSE)
    for got, want in zip([p.grad for p in gate], torch.autograd.grad(reference, gate)):
        torch.testing.assert_close(got, want, **CLOSE)
    assert model.model.core[0].mlp.up_proj.weight.grad.abs().sum() > 0
    assert sorted(objective.logs()) == sorted([f"ce_depth_{i}" for i in range(1, 7)]
                                              + ["exit_gate_entropy", "exit_gate_mean_step"])

    readouts = objective.flops_kwargs(model.config, depth)
    assert readouts["readout_only_depths"] == 4
    readout = model.config.n_coda_layers * cost._layer_forward_flops(model.config, 8) + 2 * model.config.hidden_size \
        * model.config.vocab_size
    assert flops_per_token(model.config, 6, 2, seq_len=8, **readouts) == pytest.approx(
        flops_per_token(model.config, 6, 2, seq_len=8, supervised_depths=readouts["supervised_depths"]) + 4 * readout)


def make_trainer(data_dir, out_dir, exit_gate: bool, **overrides):
    tokenizer = AutoTokenizer.from_pretrained(data_dir)
    torch.manual_seed(0)
    model = RecurrentDepthForCausalLM(presets.get("debug", vocab_size=len(tokenizer), exit_gate=exit_gate))
    args = dict(output_dir=str(out_dir), max_steps=3, per_device_train_batch_size=4, learning_rate=3e-3,
                logging_steps=1, report_to="none", seed=0, dataloader_pin_memory=False, disable_tqdm=True,
                use_cpu=True, save_strategy="no", stability_guard=False)
    args.update(overrides)
    return RecurrentTrainer(model=model, args=RecurrentTrainingArguments(**args),
                            train_dataset=ShardedTokenDataset(data_dir, "train"), processing_class=tokenizer)


def test_without_the_gate_training_is_the_plain_loss_and_with_it_the_gate_learns(tiny_data_dir, tmp_path):
    plain = make_trainer(tiny_data_dir, tmp_path / "plain", exit_gate=False)
    assert plain.depth_supervision is None  # exactly today's path: the chunked loss at the sampled depth
    dataset = ShardedTokenDataset(tiny_data_dir, "train")
    inputs = {key: torch.stack([dataset[i][key] for i in range(4)]) for key in ("input_ids", TARGETS)}
    model = plain.model.train()
    depth = plain.current_depth(True)
    loss = plain.compute_loss(model, inputs)
    hidden = model.model(input_ids=inputs["input_ids"], use_cache=False, **depth).last_hidden_state
    assert torch.equal(loss, chunked_lm_loss(hidden, model.lm_head.weight, inputs[TARGETS]).loss)
    plain.train()
    plain_losses = [e["loss"] for e in plain.state.log_history if "loss" in e]

    # The same run with the argument of the gate's objective set: no gate, nothing changes.
    again = make_trainer(tiny_data_dir, tmp_path / "again", exit_gate=False, exit_gate_entropy_weight=0.3)
    again.train()
    assert [e["loss"] for e in again.state.log_history if "loss" in e] == plain_losses

    gate = make_trainer(tiny_data_dir, tmp_path / "gate", exit_gate=True)
    assert isinstance(gate.depth_supervision, ExitGateLoss)
    gate.train()
    logs = [e for e in gate.state.log_history if "loss" in e]
    assert len(logs) == 3 and all("exit_gate_mean_step" in e and math.isfinite(e["loss"]) for e in logs)
    assert gate.model.model.exit_gate.weight.abs().sum() > 0  # moved from its zero init
    with pytest.raises(ValueError, match=r"--exit_gate_entropy_weight=-1"):
        RecurrentTrainingArguments(output_dir=str(tmp_path), exit_gate_entropy_weight=-1)


def test_hf_recurrent_evaluate_exits_by_the_gate_and_refuses_a_checkpoint_without_one_before_any_work(
        tiny_data_dir, tmp_path):
    """hf-recurrent-evaluate --exit_criterion gate: the adaptive rows exit by the checkpoint's gate (the same steps
    as the model's own forward at that threshold); a checkpoint without a gate, or a threshold outside (0, 1], is
    refused naming the flag before anything is evaluated."""
    from trainer_ext.cli import evaluate_checkpoints as evaluate_script
    from trainer_ext.evaluation.checkpoints import evaluate_checkpoints

    tokenizer = AutoTokenizer.from_pretrained(tiny_data_dir)
    with_gate, without = tmp_path / "gate" / "final", tmp_path / "plain" / "final"
    gated(vocab_size=len(tokenizer)).save_pretrained(with_gate)
    RecurrentDepthForCausalLM(presets.get("debug", vocab_size=len(tokenizer))).save_pretrained(without)
    for path in (with_gate, without):
        tokenizer.save_pretrained(path)
    common = ["--data_dir", tiny_data_dir, "--depths", "6", "--max_samples", "2", "--speed_batch_size", "1",
              "--prompt_len", "4", "--new_tokens", "2", "--speed_repeats", "1", "--cache_cost_samples", "0",
              "--plots", "false", "--exit_criterion", "gate", "--output_dir", str(tmp_path / "eval")]
    report = evaluate_checkpoints(evaluate_script.parse_args(["--checkpoints", str(with_gate), *common,
                                                              "--exit_thresholds", "0.5", "1"]))
    half, full = report["adaptive_depth"]
    assert half["exit_criterion"] == "gate" and 1 <= half["mean_steps_used"] < full["mean_steps_used"] <= 6
    with pytest.raises(ValueError, match=r"--exit_criterion gate: .*plain/final has no learned exit gate"):
        evaluate_checkpoints(evaluate_script.parse_args(["--checkpoints", str(with_gate), str(without), *common,
                                                         "--exit_thresholds", "0.5", "--output_dir",
                                                         str(tmp_path / "x")]))
    assert not (tmp_path / "x").exists()
    with pytest.raises(ValueError, match=r"--exit_thresholds \[2.0\]: with --exit_criterion gate"):
        evaluate_script.parse_args(["--checkpoints", str(with_gate), *common, "--exit_thresholds", "2"])


def test_an_exit_gate_with_a_teacher_is_refused_naming_the_flags_before_anything_is_written(tiny_data_dir, tmp_path,
                                                                                            monkeypatch):
    """The gate's expected loss does not combine with distillation yet: hf-recurrent-pretrain refuses the pair when
    the job is resolved, not at the first loss after the model was built."""
    from trainer_ext.cli import run_pretrain

    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match=r"exit_gate=true .*--teacher_model_name_or_path / --teacher_cache_dir"):
        run_pretrain.main(["--data_dir", tiny_data_dir, "--output_dir", str(tmp_path / "out"), "--max_steps", "2",
                           "--config_overrides", "exit_gate=true", "--teacher_cache_dir", str(tmp_path / "cache")])
    assert os.listdir(tmp_path) == []
