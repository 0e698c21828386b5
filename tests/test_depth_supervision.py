"""Deep supervision over depth (`--depth_supervision K`): the loss on several depths of each training step."""

import math

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_recurrent import flops_per_token, presets
from hf_recurrent.cost import _layer_forward_flops
from trainer_ext.data.shards import ShardedTokenDataset
from trainer_ext.distill.losses import chunked_lm_loss
from trainer_ext.training.arguments import TARGETS, RecurrentTrainingArguments
from trainer_ext.training.depth_supervision import supervised_steps
from trainer_ext.training.trainer import RecurrentTrainer

NUM_STEPS, BACKPROP_DEPTH = 7, 5  # steps 3-7 build a graph


def make_trainer(data_dir, out_dir, preset="debug", depth=NUM_STEPS, **overrides):
    tokenizer = AutoTokenizer.from_pretrained(data_dir)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(presets.get(preset, vocab_size=len(tokenizer)))
    args = dict(output_dir=str(out_dir), max_steps=3, per_device_train_batch_size=4, learning_rate=3e-3,
                logging_steps=1, report_to="none", seed=0, dataloader_pin_memory=False, disable_tqdm=True,
                use_cpu=True, save_strategy="no", stability_guard=False, backprop_depth=BACKPROP_DEPTH)
    args.update(overrides)
    trainer = RecurrentTrainer(model=model, args=RecurrentTrainingArguments(**args),
                               train_dataset=ShardedTokenDataset(data_dir, "train"), processing_class=tokenizer)
    if trainer.depth_sampler is not None:
        trainer.depth_sampler = lambda step: depth  # a fixed depth, so that the reference runs the same one
    return trainer


def batch(data_dir, size=4):
    dataset = ShardedTokenDataset(data_dir, "train")
    return {key: torch.stack([dataset[i][key] for i in range(size)]) for key in ("input_ids", TARGETS)}


def depth_loss(model, inputs, num_steps, backprop_depth):
    """The plain CE of the model run to depth `num_steps`, from full logits: the state after step i of a deeper
    run is the final state of a run at depth i (the same initial state and weights), and a run at depth i with
    gradients through its last `backprop_depth` steps truncates where the deeper run does."""
    logits = model(input_ids=inputs["input_ids"], num_steps=num_steps, backprop_depth=backprop_depth).logits
    return F.cross_entropy(logits.flatten(0, 1), inputs[TARGETS].flatten())


def test_supervised_steps_are_evenly_spaced_among_the_graph_steps_with_the_last_included():
    assert supervised_steps(8, 8, 4) == [2, 4, 6, 8]
    assert supervised_steps(12, 6, 3) == [8, 10, 12]
    assert supervised_steps(7, 5, 2) == [4, 7]
    assert supervised_steps(2, 2, 4) == [1, 2]  # a short sampled depth: every graph-building step
    assert supervised_steps(9, 1, 3) == [9]
    for n in range(1, 20):
        for g in range(1, n + 1):
            for k in range(1, 6):
                steps = supervised_steps(n, g, k)
                assert steps[-1] == n and len(steps) == min(k, g) and steps[0] > n - g
                assert steps == sorted(set(steps))


def test_without_the_option_the_loss_is_the_plain_loss_at_the_last_depth(tiny_data_dir, tmp_path):
    trainer = make_trainer(tiny_data_dir, tmp_path)
    assert trainer.args.depth_supervision == 1 and trainer.depth_supervision is None
    model, inputs = trainer.model.train(), batch(tiny_data_dir)
    loss = trainer.compute_loss(model, inputs)
    hidden = model.model(input_ids=inputs["input_ids"], num_steps=NUM_STEPS,
                         backprop_depth=BACKPROP_DEPTH).last_hidden_state
    expected = chunked_lm_loss(hidden, model.lm_head.weight, inputs[TARGETS]).loss
    assert torch.equal(loss, expected)
    assert torch.allclose(loss, depth_loss(model, inputs, NUM_STEPS, BACKPROP_DEPTH), atol=1e-5)


@pytest.mark.parametrize("count, weighting", [(3, "uniform"), (2, "linear"), (9, "uniform")])
def test_the_loss_and_its_gradients_are_the_weighted_mean_over_the_supervised_depths(tiny_data_dir, tmp_path,
                                                                                     count, weighting):
    trainer = make_trainer(tiny_data_dir, tmp_path, depth_supervision=count, depth_supervision_weights=weighting)
    model, inputs = trainer.model.train(), batch(tiny_data_dir)
    steps = supervised_steps(NUM_STEPS, BACKPROP_DEPTH, count)
    first_graph_step = NUM_STEPS - BACKPROP_DEPTH + 1
    assert steps == {3: [3, 5, 7], 2: [4, 7], 9: [3, 4, 5, 6, 7]}[count]

    loss = trainer.compute_loss(model, inputs)
    loss.backward()
    got = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)

    weights = [float(s) if weighting == "linear" else 1.0 for s in steps]
    terms = [depth_loss(model, inputs, s, s - first_graph_step + 1) for s in steps]
    expected = sum(w * t for w, t in zip(weights, terms)) / sum(weights)
    assert torch.allclose(loss, expected, atol=1e-5)
    expected.backward()
    for name, p in model.named_parameters():
        assert torch.allclose(got[name], p.grad, atol=1e-5, rtol=1e-4), name

    # Every supervised depth reaches the core: each term alone gives the core a gradient of its own.
    core = [p for name, p in model.named_parameters() if ".core." in name]
    for s in steps:
        model.zero_grad(set_to_none=True)
        depth_loss(model, inputs, s, s - first_graph_step + 1).backward()
        assert all(p.grad is not None for p in core) and sum(p.grad.abs().sum() for p in core) > 0


def test_training_logs_the_ce_of_each_depth_and_counts_the_extra_readouts(tiny_data_dir, tmp_path):
    trainer = make_trainer(tiny_data_dir, tmp_path, depth_supervision=3)
    inputs = batch(tiny_data_dir)
    trainer.model.train()
    trainer.compute_loss(trainer.model, inputs)
    config, seq_len = trainer.model.config, inputs["input_ids"].shape[1]
    plain = flops_per_token(config, NUM_STEPS, BACKPROP_DEPTH, seq_len=seq_len)
    supervised = flops_per_token(config, NUM_STEPS, BACKPROP_DEPTH, seq_len=seq_len, supervised_depths=3)
    assert trainer.floating_point_ops(inputs) == pytest.approx(inputs["input_ids"].numel() * supervised)
    # Two more readouts (depths 3 and 5): coda and head, forward and backward.
    readout = config.n_coda_layers * _layer_forward_flops(config, seq_len) + 2 * config.hidden_size * config.vocab_size
    assert supervised - plain == pytest.approx(3 * 2 * readout)
    # At most one readout per graph-building step.
    assert flops_per_token(config, NUM_STEPS, BACKPROP_DEPTH, seq_len=seq_len, supervised_depths=50) == \
        flops_per_token(config, NUM_STEPS, BACKPROP_DEPTH, seq_len=seq_len, supervised_depths=BACKPROP_DEPTH)

    trainer = make_trainer(tiny_data_dir, tmp_path, depth_supervision=3)  # a fresh logging window
    trainer.train()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 3
    for entry in logs:
        assert sorted(k for k in entry if k.startswith("ce_depth_")) == ["ce_depth_3", "ce_depth_5", "ce_depth_7"]
        assert entry["ce_depth_7"] == entry["ce"] and all(math.isfinite(entry[f"ce_depth_{s}"]) for s in (3, 5))
    assert trainer.state.total_flos == pytest.approx(3 * 4 * seq_len * supervised, rel=1e-6)


def test_bad_values_name_the_flag_and_the_fix(tiny_data_dir, tmp_path):
    with pytest.raises(ValueError, match=r"--depth_supervision=0 .*integer >= 1"):
        RecurrentTrainingArguments(output_dir=str(tmp_path), depth_supervision=0)
    with pytest.raises(ValueError, match=r"--depth_supervision_weights='cubic' .*uniform"):
        RecurrentTrainingArguments(output_dir=str(tmp_path), depth_supervision_weights="cubic")
    with pytest.raises(ValueError, match=r"--depth_supervision 2 needs a recurrent-depth model.*Leave "
                                         r"--depth_supervision at 1"):
        make_trainer(tiny_data_dir, tmp_path, preset="transformer-debug", depth_supervision=2, backprop_depth=None)


def test_compiled_layers_give_the_same_supervised_loss(tiny_data_dir, tmp_path):
    """The coda's call arguments are taken by a hook on each coda layer, which runs inside the layer's compiled
    call under --torch_compile."""
    inputs = batch(tiny_data_dir)
    eager = make_trainer(tiny_data_dir, tmp_path / "eager", depth_supervision=3)
    compiled = make_trainer(tiny_data_dir, tmp_path / "compiled", depth_supervision=3, torch_compile=True,
                            torch_compile_backend="eager")
    assert all(layer._compiled_call_impl is not None for layer in compiled.model.model.coda)
    losses = [trainer.compute_loss(trainer.model.train(), inputs) for trainer in (eager, compiled)]
    assert torch.allclose(*losses, atol=1e-6)
    assert eager.depth_supervision.logs() == compiled.depth_supervision.logs()


def test_the_ablations_base_overrides_come_first_and_an_arms_own_keys_win():
    """benchmarks/depth_ablation.py --config_overrides: every arm's config is the base's, then the arm's."""
    from types import SimpleNamespace

    from benchmarks.depth_ablation import arm_overrides

    args = SimpleNamespace(config_overrides="mean_recurrence=8,backprop_depth=4", steps=240)
    assert arm_overrides("scaled_init", args) == "mean_recurrence=8,backprop_depth=4"
    assert arm_overrides("mean_16_k8", args) == "mean_recurrence=16,backprop_depth=8"
    assert arm_overrides("curriculum", args) == "mean_recurrence=8,backprop_depth=4,depth_warmup_steps=120"
    assert arm_overrides("full_backprop", SimpleNamespace(config_overrides="", steps=10)) == "backprop_depth=null"
