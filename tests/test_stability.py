"""The stability guard: its decisions on synthetic streams, and RecurrentTrainer carrying them out on the debug
preset (a loss spike or a gradient-norm blow-up injected at a chosen step through a hook on the base model)."""

import json
import logging
import math

import pytest
import torch
from safetensors.torch import load_file
from transformers import TrainerCallback

from test_trainer import FailInStep, StopAt, losses, make_trainer
from trainer_ext.training.stability import GRAD_NORM_BLOWUP, LOSS_SPIKE, ROLLBACK, StabilityGuard, UnstableTrainingError
from trainer_ext.training.arguments import RecurrentTrainingArguments
from trainer_ext.training.stability_mixin import INTERVENTIONS_FILE

# ----------------------------------------------------------------------------- the guard on its own


def warmed_up_guard(**settings) -> StabilityGuard:
    guard = StabilityGuard(**{"warmup_steps": 3, **settings})
    for step, (loss, norm) in enumerate([(5.0, 2.0), (5.1, 2.2), (4.9, 1.8)], start=1):
        assert guard.check_loss(step, loss) is None
        assert guard.check_grad_norm(step, norm) is None
    return guard


def test_running_means_are_bias_corrected_from_the_first_value():
    guard = StabilityGuard()
    guard.check_loss(1, 7.0)
    guard.check_grad_norm(1, 3.0)
    assert guard.loss_mean == pytest.approx(7.0) and guard.typical_grad_norm == pytest.approx(3.0)


def test_a_loss_spike_is_acted_on_after_warm_up_only():
    guard = StabilityGuard(warmup_steps=3, loss_spike=1.0)
    assert guard.check_loss(1, 5.0) is None and guard.check_loss(2, 5.0) is None
    assert guard.check_loss(3, 50.0) is None  # still warming up: a high early loss is no evidence yet
    guard = warmed_up_guard(loss_spike=1.0, loss_spike_sigmas=0)  # the fixed limit alone
    mean = guard.loss_mean
    assert guard.check_loss(4, mean + 0.9) is None  # within the limit: trained on, enters the mean
    mean = guard.loss_mean
    spike = guard.check_loss(5, mean + 1.5)
    assert spike.kind == LOSS_SPIKE and spike.step == 5 and spike.running == pytest.approx(mean)
    assert spike.action == "update skipped" and "1.50 nats above" in spike.describe()
    assert guard.loss_mean == mean  # a skipped loss never enters the mean
    assert guard.skipped_steps == 1 and guard.interventions == [spike]


def test_the_spike_limit_widens_with_the_loss_noise_of_small_batches():
    noisy, fixed = StabilityGuard(warmup_steps=10), StabilityGuard(warmup_steps=10, loss_spike_sigmas=0)
    for step in range(1, 41):  # a flat loss with +-0.6 nats of step-to-step noise, as at batch 1
        for guard in (noisy, fixed):
            assert guard.check_loss(step, 7.0 + (0.6 if step % 2 else -0.6)) is None
    assert noisy.loss_limit == pytest.approx(2.5 * 0.6, rel=0.15)
    assert noisy.check_loss(41, noisy.loss_mean + 1.2) is None  # ordinary noise here: trained on
    spike = noisy.check_loss(42, noisy.loss_mean + 3.0)
    assert spike.kind == LOSS_SPIKE and spike.limit == pytest.approx(noisy.loss_limit)
    assert f"limit +{spike.limit:g} nats" in spike.describe()
    assert fixed.loss_limit == 1.0 and fixed.check_loss(41, fixed.loss_mean + 1.2).kind == LOSS_SPIKE


def test_a_non_finite_loss_is_skipped_at_any_time_and_reported_as_such():
    guard = StabilityGuard(warmup_steps=20)
    for step, loss in ((1, float("nan")), (2, float("inf"))):
        skip = guard.check_loss(step, loss)
        assert skip.kind == LOSS_SPIKE and (skip.value == loss or math.isnan(loss) and math.isnan(skip.value))
        assert "not finite" in skip.describe()
    assert guard.loss_mean is None and guard.skipped_steps == 2


def test_consecutive_skipped_steps_stop_training_and_a_good_step_resets_the_count():
    guard = warmed_up_guard(max_consecutive_skips=3)
    nan = float("nan")
    guard.check_loss(4, nan)
    guard.check_loss(5, nan)
    assert guard.check_loss(6, 5.0) is None  # a good step between
    guard.check_loss(7, nan)
    guard.check_loss(8, nan)
    assert not guard.should_stop and guard.consecutive_skips == 2
    # Gradient accumulation: several bad micro-batches of one step count as one skipped step.
    guard.check_loss(9, nan)
    guard.check_loss(9, nan)
    assert guard.should_stop and guard.consecutive_skips == 3 and guard.skipped_steps == 5


def test_a_healthy_micro_batch_does_not_hide_a_run_of_skipped_steps():
    guard = warmed_up_guard(max_consecutive_skips=2)
    guard.check_loss(4, 5.0)  # first micro-batch of step 4 is fine, the second is not
    guard.check_loss(4, float("nan"))
    guard.check_loss(5, 5.0)
    guard.check_loss(5, float("nan"))
    assert guard.should_stop


def test_a_grad_norm_blowup_lowers_the_lr_for_the_cooldown_then_ramps_it_back():
    guard = warmed_up_guard(grad_norm_factor=10.0, lr_factor=0.5, cooldown_steps=2)
    typical = guard.typical_grad_norm
    assert guard.check_grad_norm(4, 9 * typical) is None
    blowup = guard.check_grad_norm(5, 1000 * typical)
    assert blowup.kind == GRAD_NORM_BLOWUP and blowup.step == 5 and "x0.5" in blowup.action
    assert "x its running typical value" in blowup.describe()
    assert [guard.lr_scale(step) for step in range(4, 10)] == [1.0, 1.0, 0.5, 0.5, 0.75, 1.0]
    assert guard.typical_grad_norm < 10 * typical  # entered clipped: one outlier barely moves it


def test_a_blowup_during_the_cooldown_restarts_it_without_compounding():
    guard = warmed_up_guard(lr_factor=0.5, cooldown_steps=3)
    guard.check_grad_norm(4, 1e6)
    assert guard.lr_scale(5) == guard.lr_scale(6) == 0.5
    guard.check_grad_norm(6, float("inf"))  # not finite: a blow-up too
    assert [guard.lr_scale(step) for step in range(7, 13)] == [0.5, 0.5, 0.5, pytest.approx(2 / 3),
                                                                pytest.approx(5 / 6), 1.0]


def test_a_lasting_change_of_grad_norm_level_is_followed():
    guard = warmed_up_guard(grad_norm_factor=10.0)
    blowups = [guard.check_grad_norm(step, 200.0) is not None for step in range(4, 60)]
    assert blowups[0] and not any(blowups[-10:])  # the LR is not held down for ever


def test_a_step_without_gradients_is_no_observation():
    guard = warmed_up_guard()
    count = guard.state_dict()["log_grad_norm_ema"][1]
    assert guard.check_grad_norm(4, 0.0) is None and guard.state_dict()["log_grad_norm_ema"][1] == count


def test_state_round_trips_through_json_and_decides_the_same():
    guard = warmed_up_guard(cooldown_steps=2)
    guard.check_loss(4, float("nan"))
    guard.check_grad_norm(5, 1e6)
    restored = StabilityGuard(warmup_steps=3, cooldown_steps=2)
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert (restored.loss_mean, restored.typical_grad_norm, restored.skipped_steps, restored.consecutive_skips) == (
        guard.loss_mean, guard.typical_grad_norm, guard.skipped_steps, guard.consecutive_skips)
    for g in (guard, restored):
        assert g.check_loss(6, g.loss_mean + 2).kind == LOSS_SPIKE
    assert [restored.lr_scale(s) for s in range(5, 10)] == [guard.lr_scale(s) for s in range(5, 10)]
    assert restored.interventions[1:] == guard.interventions[1:] and math.isnan(restored.interventions[0].value)


def skip_run(guard, steps):
    for step in steps:
        guard.check_loss(step, float("nan"))


def test_rollback_target_is_older_than_the_last_applied_update_and_outside_abandoned_stretches():
    guard = warmed_up_guard(max_consecutive_skips=3, max_rollbacks=3)
    skip_run(guard, [8, 9, 10])  # the live weights are step 7's: checkpoints 8 and 10 hold them as well
    assert guard.should_stop and guard.rollback_target(10, [2, 4, 6, 7, 8, 10]) == 6
    assert guard.rollback_target(10, [8, 10]) is None  # nothing older than the trouble
    rollback = guard.roll_back(10, 6, "run/checkpoint-6", None)
    assert rollback.kind == ROLLBACK and not guard.should_stop and guard.rollbacks == [[6, 10]]
    assert "3 steps in a row were skipped" in rollback.describe() and "run/checkpoint-6 restored" in rollback.describe()
    assert "learning rate x0.5 from step 11 on (rollback 1 of at most 3)" in rollback.describe()
    assert [guard.lr_scale(s) for s in (10, 11, 50)] == [1.0, 0.5, 0.5]
    # Trouble again at once: nothing was applied since, so checkpoint-6 holds the live weights: go further back.
    skip_run(guard, [11, 12, 13])
    assert guard.rollback_target(13, [2, 4, 6, 12]) == 4
    guard.roll_back(13, 4, "run/checkpoint-4", None)
    assert guard.lr_scale(14) == 0.25
    # Later trouble after good steps: checkpoints of the abandoned stretches (4, 13] stay out.
    for step in range(14, 30):
        assert guard.check_loss(step, 5.0) is None
    skip_run(guard, [30, 31, 32])
    assert guard.rollback_target(32, [2, 4, 8, 12, 20, 28]) == 28
    assert guard.rollback_target(32, [2, 4, 8, 12]) == 4
    guard.roll_back(32, 28, "run/checkpoint-28", None)
    skip_run(guard, [33, 34, 35])
    assert guard.rollback_target(35, [2, 4, 28]) is None  # max_rollbacks used up


def test_a_rollback_takes_back_the_checkpoints_statistics_and_survives_a_resume():
    guard = warmed_up_guard(max_consecutive_skips=2)
    saved = json.loads(json.dumps(guard.state_dict()))
    for step in range(4, 14):  # a drift the running mean follows
        assert guard.check_loss(step, 5.8) is None
    skip_run(guard, [14, 15])
    assert guard.loss_mean > 5.3
    guard.roll_back(15, 3, "checkpoint-3", saved)
    assert guard.loss_mean == pytest.approx(5.0, abs=0.01)  # the mean of the healthy steps 1-3
    restored = StabilityGuard(warmup_steps=3, max_consecutive_skips=2)
    restored.load_state_dict(json.loads(json.dumps(guard.state_dict())))
    assert restored.rollbacks == [[3, 15]] and restored.lr_scale(16) == guard.lr_scale(16) == 0.5
    assert restored.interventions[-1] == guard.interventions[-1]
    legacy = {k: v for k, v in saved.items() if k != "rollbacks"}  # a checkpoint from before rollbacks
    restored.load_state_dict(legacy)
    assert restored.rollbacks == [] and restored.lr_scale(16) == 1.0


@pytest.mark.parametrize("name, value, allowed", [
    ("warmup_steps", 0, "integer >= 1"), ("loss_spike", 0.0, "> 0"), ("loss_spike", float("nan"), "> 0"),
    ("loss_spike_sigmas", -1.0, ">= 0"), ("grad_norm_factor", 1.0, "> 1"), ("lr_factor", 1.0, "in \\(0, 1\\)"), ("cooldown_steps", 2.5, "integer"),
    ("max_consecutive_skips", 0, "integer >= 1"), ("max_rollbacks", -1, "integer >= 0"),
])
def test_bad_settings_are_refused_by_name(tmp_path, name, value, allowed):
    with pytest.raises(ValueError, match=f"^{name}=.*{allowed}"):
        StabilityGuard(**{name: value})
    with pytest.raises(ValueError, match=f"--stability_{name}=.*{allowed}"):
        RecurrentTrainingArguments(output_dir=str(tmp_path), **{f"stability_{name}": value})


# ----------------------------------------------------------------------------- in RecurrentTrainer


def inject(trainer, faults: dict, micro_batch: int | None = None):
    """Apply `faults[step](last_hidden_state)` in the training forward of those steps (1-based, as logged);
    with `micro_batch`, only in that micro-batch (1-based) of the step."""
    seen = {}

    def hook(module, args, output):
        if not module.training:
            return None
        step = trainer.state.global_step + 1
        seen[step] = seen.get(step, 0) + 1
        if step in faults and micro_batch in (None, seen[step]):
            output.last_hidden_state = faults[step](output.last_hidden_state)
        return output

    trainer.model.model.register_forward_hook(hook)


def amplify_gradient(hidden):
    hidden.register_hook(lambda grad: grad * 1e4)  # same loss, a gradient norm thousands of times larger
    return hidden


SPIKE, NAN = (lambda hidden: hidden * 1000), (lambda hidden: hidden * float("nan"))


class Snapshots(TrainerCallback):
    """Weights and optimizer state after each step (0: before the first)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.at = {}

    def take(self, step):
        optimizer = getattr(self.trainer.optimizer, "optimizer", self.trainer.optimizer)
        params = list(self.trainer.model.parameters())
        state = {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in optimizer.state[p].items()}
                 for i, p in enumerate(params) if p in optimizer.state}
        self.at[step] = ({k: v.clone() for k, v in self.trainer.model.state_dict().items()}, state)

    def on_train_begin(self, args, state, control, **kwargs):
        self.take(0)

    def on_step_end(self, args, state, control, **kwargs):
        self.take(state.global_step)

    def same(self, a, b, what=(0, 1)) -> bool:
        def equal(x, y):
            if isinstance(x, dict):
                return x.keys() == y.keys() and all(equal(x[k], y[k]) for k in x)
            return torch.equal(x, y) if torch.is_tensor(x) else x == y

        return all(equal(self.at[a][i], self.at[b][i]) for i in what)


def logs_by_step(trainer):
    return {entry["step"]: entry for entry in trainer.state.log_history if "loss" in entry}


def test_loss_spike_and_nan_loss_skip_the_update_and_are_logged(tiny_data_dir, tmp_path, caplog):
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=6, save_strategy="no", stability_warmup_steps=2)
    inject(trainer, {3: SPIKE, 5: NAN})
    snapshots = Snapshots(trainer)
    trainer.add_callback(snapshots)
    with caplog.at_level(logging.WARNING, logger="trainer_ext.training.trainer"):
        trainer.train()
    for step in (3, 5):  # weights and optimizer state bit-identical across the skipped step
        assert snapshots.same(step - 1, step)
    for step in (1, 2, 4, 6):  # the other steps train, the one right after a skip included
        assert not snapshots.same(step - 1, step, what=(0,)) and not snapshots.same(step - 1, step, what=(1,))
    logs = logs_by_step(trainer)
    assert logs[3]["loss"] > logs[2]["loss"] + 100  # the spike is logged as it was
    assert math.isnan(logs[5]["loss"])  # a non-finite loss is logged as NaN, never as 0.0
    assert all(math.isfinite(logs[step]["loss"]) for step in (1, 2, 4, 6))
    assert [logs[step]["stability/skipped_steps"] for step in range(1, 7)] == [0, 0, 1, 1, 2, 2]
    assert [(i.step, i.kind) for i in trainer.stability.interventions] == [(3, LOSS_SPIKE), (5, LOSS_SPIKE)]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("step 3: loss" in m and "nats above its running mean" in m and "update skipped" in m
               for m in warnings)
    assert any("step 5: loss nan is not finite" in m for m in warnings)
    written = json.loads((tmp_path / INTERVENTIONS_FILE).read_text())
    assert written["skipped_steps"] == 2 and [i["step"] for i in written["interventions"]] == [3, 5]
    assert math.isnan(written["interventions"][1]["value"])


def test_the_guard_decides_inside_backward_at_the_first_update_and_outside_it_with_a_stock_optimizer(
        tiny_data_dir, tmp_path, monkeypatch):
    # In one process with the in-backward optimizer the loss is read once backward's first operations are queued (no
    # wait for the GPU before backward), still before any weight changes; a stock optimizer's guard reads it before.
    from trainer_ext.optim.optimizer import LowMemoryAdafactor

    events = []
    check_loss, update = StabilityGuard.check_loss, LowMemoryAdafactor._update

    def recorded_check(guard, step, value):
        events.append(("decide", step, torch._C._current_graph_task_id() != -1))
        return check_loss(guard, step, value)

    def recorded_update(optimizer, *args, **kwargs):
        events.append(("update",))
        return update(optimizer, *args, **kwargs)

    monkeypatch.setattr(StabilityGuard, "check_loss", recorded_check)
    monkeypatch.setattr(LowMemoryAdafactor, "_update", recorded_update)
    trainer = make_trainer(tiny_data_dir, tmp_path / "in_backward", max_steps=4, save_strategy="no",
                           stability_warmup_steps=2)
    inject(trainer, {3: SPIKE})
    trainer.train()
    decisions = [i for i, event in enumerate(events) if event[0] == "decide"]
    assert [events[i] for i in decisions] == [("decide", step, True) for step in (1, 2, 3, 4)]
    updates = [sum(1 for e in events[i + 1:j] if e[0] == "update") for i, j in zip(decisions, decisions[1:] + [None])]
    assert decisions[0] == 0 and updates[2] == 0 and updates[0] == updates[1] == updates[3] > 0  # step 3 skipped
    assert trainer.stability.skipped_steps == 1

    events.clear()
    stock = make_trainer(tiny_data_dir, tmp_path / "stock", max_steps=2, save_strategy="no", optimizer="hf",
                         optim="adamw_torch")
    stock.train()
    assert events == [("decide", 1, False), ("decide", 2, False)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_cuda_loss_on_its_way_to_the_host_reads_back_after_later_work_is_queued():
    from trainer_ext.devices import to_host_later

    loss = torch.randn(4096, 4096, device="cuda").square().mean()
    read = to_host_later(loss)
    later = torch.randn(4096, 4096, device="cuda")
    later.copy_(later @ later)  # queued after the copy: the read does not wait for it
    assert read().is_pinned() and read().item() == loss.item()


def test_the_trainers_nan_filter_is_off_inside_guarded_steps_only(tiny_data_dir, tmp_path):
    # The guard's stand-ins make the Trainer's filter (two waits for the GPU per step) redundant inside steps; it is
    # back for evaluation and after training, also after a failed step, and untouched without the guard.
    from transformers import TrainerCallback

    seen = []

    class Watch(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            seen.append(args.logging_nan_inf_filter)

        def on_evaluate(self, args, state, control, **kwargs):
            seen.append(("eval", args.logging_nan_inf_filter))

    trainer = make_trainer(tiny_data_dir, tmp_path / "guarded", max_steps=4, save_strategy="no",
                           eval_strategy="steps", eval_steps=2)
    inject(trainer, {3: NAN})
    trainer.add_callback(Watch())
    trainer.train()
    assert seen == [False, False, ("eval", True), False, False, ("eval", True)]
    assert trainer.args.logging_nan_inf_filter is True
    assert math.isfinite(logs_by_step(trainer)[4]["loss"])

    failing = make_trainer(tiny_data_dir, tmp_path / "failing", max_steps=2, save_strategy="no")
    failing.add_callback(FailInStep())
    with pytest.raises(RuntimeError, match="boom"):
        failing.train()
    assert failing.args.logging_nan_inf_filter is True
    seen.clear()
    unguarded = make_trainer(tiny_data_dir, tmp_path / "unguarded", max_steps=2, save_strategy="no",
                             stability_guard=False)
    unguarded.add_callback(Watch())
    unguarded.train()
    assert seen == [True, True]


def test_skip_with_the_stock_optimizer_and_gradient_accumulation(tiny_data_dir, tmp_path):
    # The spike is in the second micro-batch: what the first one accumulated must not be applied either.
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=4, save_strategy="no", optimizer="hf",
                           optim="adamw_torch", per_device_train_batch_size=2, gradient_accumulation_steps=2,
                           stability_warmup_steps=2)
    inject(trainer, {3: SPIKE}, micro_batch=2)
    snapshots = Snapshots(trainer)
    trainer.add_callback(snapshots)
    trainer.train()
    assert isinstance(trainer.optimizer.optimizer, torch.optim.AdamW)
    assert snapshots.same(2, 3)  # AdamW's moments and step counts too
    assert not snapshots.same(3, 4, what=(0,)) and not snapshots.same(3, 4, what=(1,))
    assert [(i.step, i.kind) for i in trainer.stability.interventions] == [(3, LOSS_SPIKE)]
    assert trainer.stability.skipped_steps == 1


class RecordLrScale(TrainerCallback):
    """The learning rate the update used (read after backward, where the in-backward update ran) over the
    scheduler's rate for that step."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.scales = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        used = self.trainer.optimizer.param_groups[0]["lr"]
        self.scales.append(used / self.trainer.lr_scheduler.get_last_lr()[0])


def test_grad_norm_blowup_lowers_the_lr_then_restores_it(tiny_data_dir, tmp_path, caplog):
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=8, save_strategy="no", stability_warmup_steps=2,
                           stability_cooldown_steps=2)
    inject(trainer, {4: amplify_gradient})
    recorder = RecordLrScale(trainer)
    trainer.add_callback(recorder)
    with caplog.at_level(logging.WARNING, logger="trainer_ext.training.trainer"):
        trainer.train()
    # Step 4's norm is read at step 5: 2 steps at half the rate, one step of the ramp, then the full rate.
    assert recorder.scales == pytest.approx([1, 1, 1, 1, 0.5, 0.5, 0.75, 1])
    logs = logs_by_step(trainer)
    assert [logs[step]["stability/lr_scale"] for step in range(1, 9)] == pytest.approx(recorder.scales)
    # The schedule itself is untouched: the logged rates are the scheduler's, and the groups end on them.
    assert [logs[step]["learning_rate"] for step in range(1, 9)] == pytest.approx(
        [3e-3 * (8 - step + 1) / 8 for step in range(1, 9)])
    assert trainer.optimizer.param_groups[0]["lr"] == trainer.lr_scheduler.get_last_lr()[0]
    [blowup] = trainer.stability.interventions
    assert blowup.kind == GRAD_NORM_BLOWUP and blowup.step == 4 and blowup.value > 10 * blowup.running
    assert logs[4]["grad_norm"] == pytest.approx(blowup.value)  # the norm the guard saw is the logged one
    assert trainer.stability.skipped_steps == 0 and all(math.isfinite(logs[s]["loss"]) for s in logs)
    assert any("step 4: gradient norm" in r.getMessage() and "learning rate x0.5" in r.getMessage()
               for r in caplog.records)


def test_persistent_skips_stop_training_with_the_fix_and_keep_the_checkpoint(tiny_data_dir, tmp_path):
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=8, save_steps=2, stability_max_consecutive_skips=3)
    inject(trainer, {step: NAN for step in range(3, 9)})
    snapshots = Snapshots(trainer)
    trainer.add_callback(snapshots)
    with pytest.raises(UnstableTrainingError) as raised:
        trainer.train()
    message = str(raised.value)
    assert "at step 5" in message and "last 3 steps were all skipped" in message and "not finite" in message
    assert "--learning_rate" in message and "learning-rate threshold test" in message
    assert str(tmp_path / "checkpoint-4") in message and "is intact" in message
    assert max(snapshots.at) == 4 and snapshots.same(2, 4)  # nothing was applied after step 2
    saved = load_file(tmp_path / "checkpoint-4" / "model.safetensors")
    weights = snapshots.at[2][0]
    assert saved.keys() == weights.keys() and all(torch.equal(saved[k], weights[k]) for k in saved)
    assert all(torch.equal(p, weights[k]) for k, p in trainer.model.state_dict().items())
    written = json.loads((tmp_path / INTERVENTIONS_FILE).read_text())
    assert [i["step"] for i in written["interventions"]] == [3, 4, 5]


def test_persistent_trouble_rolls_back_to_an_older_checkpoint_at_a_lower_rate(tiny_data_dir, tmp_path, caplog):
    # Checkpoints at 2, 4, 6; steps 5-7 are all skipped: the weights are step 4's, and so are checkpoint-4's and
    # checkpoint-6's. The guard rolls back to checkpoint-2 at step 7, and training goes on at half the rate.
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=10, save_steps=2, stability_max_consecutive_skips=3)
    inject(trainer, {step: NAN for step in range(5, 8)})
    snapshots = Snapshots(trainer)
    trainer.add_callback(snapshots)
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert trainer.state.global_step == 10
    assert snapshots.same(4, 6) and snapshots.same(2, 7)  # after step 7: checkpoint-2's weights and optimizer state
    saved = load_file(tmp_path / "checkpoint-2" / "model.safetensors")
    assert all(torch.equal(saved[k], snapshots.at[7][0][k]) for k in saved)
    assert not snapshots.same(7, 8)  # step 8 trains again
    logs = logs_by_step(trainer)
    assert [logs[s]["stability/lr_scale"] for s in (6, 8, 10)] == [1.0, 0.5, 0.5]
    assert all(math.isfinite(logs[s]["loss"]) for s in (8, 9, 10))
    written = json.loads((tmp_path / INTERVENTIONS_FILE).read_text())["interventions"]
    assert [(i["step"], i["kind"]) for i in written] == [(5, LOSS_SPIKE), (6, LOSS_SPIKE), (7, LOSS_SPIKE),
                                                         (7, ROLLBACK)]
    assert str(tmp_path / "checkpoint-2") in written[-1]["action"]
    assert any("step 7: 3 steps in a row were skipped" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("at_warmup_end", [True, False])
def test_a_checkpoint_where_the_warm_up_ends_is_the_rollback_before_the_first_regular_save(
        tiny_data_dir, tmp_path, at_warmup_end):
    # The measured failure: a run that breaks a few steps after its warm-up, long before --save_steps. With the
    # warm-up's checkpoint (the default) the guard rolls back to it and trains on at half the rate; without, it stops.
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=10, warmup_steps=3, save_steps=100,
                           stability_max_consecutive_skips=3, stability_checkpoint_after_warmup=at_warmup_end)
    inject(trainer, {step: NAN for step in range(5, 8)})
    snapshots = Snapshots(trainer)
    trainer.add_callback(snapshots)
    if not at_warmup_end:
        with pytest.raises(UnstableTrainingError, match="no checkpoint had been saved yet"):
            trainer.train()
        assert not list(tmp_path.glob("checkpoint-*"))
        return
    trainer.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-10", "checkpoint-3"]
    assert trainer.state.global_step == 10 and snapshots.same(3, 7)  # step 7 restored checkpoint-3's state
    assert not snapshots.same(3, 4) and not snapshots.same(7, 8)  # step 4's update was undone; step 8 trains
    written = json.loads((tmp_path / INTERVENTIONS_FILE).read_text())["interventions"]
    assert written[-1]["kind"] == ROLLBACK and str(tmp_path / "checkpoint-3") in written[-1]["action"]
    assert logs_by_step(trainer)[8]["stability/lr_scale"] == 0.5


def test_the_warm_up_checkpoint_needs_saving_on(tiny_data_dir, tmp_path):
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=4, warmup_steps=2, save_strategy="no")
    trainer.train()
    assert not list(tmp_path.glob("checkpoint-*"))


def test_trouble_that_outlasts_the_rollbacks_stops_training_and_says_so(tiny_data_dir, tmp_path):
    trainer = make_trainer(tiny_data_dir, tmp_path, max_steps=12, save_steps=2, stability_max_consecutive_skips=3,
                           stability_max_rollbacks=1)
    inject(trainer, {step: NAN for step in range(5, 13)})
    with pytest.raises(UnstableTrainingError) as raised:
        trainer.train()
    message = str(raised.value)
    assert "at step 10 after 1 rollback(s)" in message and "--stability_max_rollbacks" in message
    written = json.loads((tmp_path / INTERVENTIONS_FILE).read_text())
    assert [i["kind"] for i in written["interventions"]].count(ROLLBACK) == 1


def test_the_guard_leaves_a_healthy_run_unchanged(tiny_data_dir, tmp_path):
    runs = {}
    for name, settings in {"off": {"stability_guard": False}, "default": {},
                           "acting_from_step_2": {"stability_warmup_steps": 1}}.items():
        trainer = make_trainer(tiny_data_dir, tmp_path / name, max_steps=6, save_strategy="no", **settings)
        trainer.train()
        runs[name] = trainer
    off = runs["off"]
    assert off.stability is None and not (tmp_path / "off" / INTERVENTIONS_FILE).exists()
    assert not any(key.startswith("stability/") for entry in off.state.log_history for key in entry)
    weights = off.model.state_dict()
    for name in ("default", "acting_from_step_2"):
        trainer = runs[name]
        assert losses(trainer) == losses(off)  # bit-identical, as with no guard (the code before it)
        assert all(torch.equal(p, weights[k]) for k, p in trainer.model.state_dict().items())
        assert trainer.stability.interventions == []
        assert all(entry["stability/lr_scale"] == 1.0 and entry["stability/skipped_steps"] == 0
                   for entry in trainer.state.log_history if "loss" in entry)
        assert json.loads((tmp_path / name / INTERVENTIONS_FILE).read_text())["interventions"] == []


def test_resume_restores_the_guard_and_reproduces_the_uninterrupted_run(tiny_data_dir, tmp_path):
    def run(out, stop_at=None, resume=None):
        trainer = make_trainer(tiny_data_dir, out, max_steps=8, save_steps=4, stability_warmup_steps=2,
                               stability_cooldown_steps=2)
        # A blow-up at the checkpoint's own step (its norm would otherwise be read only at step 5), then a spike
        # that a guard started afresh at step 5 would still be warming up for.
        inject(trainer, {4: amplify_gradient, 6: SPIKE})
        if stop_at:
            trainer.add_callback(StopAt(stop_at))
        trainer.train(resume_from_checkpoint=resume)
        return trainer

    full = run(tmp_path / "full")
    run(tmp_path / "resumed", stop_at=4)
    resumed = run(tmp_path / "resumed", resume=str(tmp_path / "resumed" / "checkpoint-4"))
    events = [(i.step, i.kind) for i in full.stability.interventions]
    assert events == [(4, GRAD_NORM_BLOWUP), (6, LOSS_SPIKE)]
    assert [(i.step, i.kind) for i in resumed.stability.interventions] == events
    assert losses(full)[4:] == pytest.approx(losses(resumed)[-4:], rel=1e-6)
    for key in ("stability/lr_scale", "stability/skipped_steps"):
        assert [logs_by_step(full)[s][key] for s in range(5, 9)] == [logs_by_step(resumed)[s][key] for s in range(5, 9)]
