import gc
import json
import math
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from hf_recurrent import presets
from trainer_ext.cli import find_lr
from trainer_ext.data.shards import ShardedTokenDataset
from trainer_ext.training import lr_finder
from trainer_ext.training.arguments import RecurrentTrainingArguments, resolve_schedule_defaults
from trainer_ext.training.lr_finder import SweepArguments, pick_learning_rate, resolve_sweep_defaults, summarize_trial
from trainer_ext.training.pretrain import check_pretrain_arguments, parse_pretrain_args, pretrain

SWEEP = ["--sweep_steps", "16", "--sweep_warmup_steps", "4", "--per_device_train_batch_size", "8",
         "--use_cpu", "true"]


@pytest.fixture(scope="module")
def sweep_dir(tiny_data_dir, tmp_path_factory):
    """One end-to-end sweep through the CLI: a small, a moderate and an absurd learning rate."""
    out = tmp_path_factory.mktemp("sweep")
    code = find_lr.main(["--data_dir", tiny_data_dir, "--output_dir", str(out),
                         "--learning_rates", "1e3", "1e-3", "3e-3", *SWEEP])
    assert code == 0
    return out


def test_sweep_marks_an_absurd_rate_unstable_and_picks_the_largest_stable_over_the_margin(sweep_dir):
    result = json.loads((sweep_dir / "lr_sweep.json").read_text())
    trials = {trial["learning_rate"]: trial for trial in result["trials"]}
    assert [trial["learning_rate"] for trial in result["trials"]] == [1e-3, 3e-3, 1e3]  # ascending
    assert trials[1e-3]["stable"] and trials[1e-3]["unstable_reasons"] == []
    absurd = trials[1e3]
    assert not absurd["stable"] and absurd["unstable_reasons"]
    assert absurd["skipped"] or absurd["diverged"] or absurd["spikes"] > 0
    largest = 3e-3 if trials[3e-3]["stable"] else 1e-3
    assert result["largest_stable_learning_rate"] == largest
    assert result["first_unstable_learning_rate"] == (1e3 if largest == 3e-3 else 3e-3)
    assert result["learning_rate"] == pytest.approx(largest / 2)
    assert result["sweep"]["sweep_warmup_steps"] == 4 and result["sweep"]["margin"] == 2.0
    assert result["model"] == "debug" and result["seq_len"] == 32 and result["per_device_train_batch_size"] == 8
    ran = [trial for trial in result["trials"] if not trial["skipped"]]
    for trial in ran:
        curve = trial["curve"]
        assert curve["step"] == list(range(1, len(curve["loss"]) + 1))
        assert len(curve["grad_norm"]) == len(curve["loss"])
    stable = trials[1e-3]
    assert len(stable["curve"]["loss"]) == 16 and all(math.isfinite(g) for g in stable["curve"]["grad_norm"])
    assert stable["final_loss"] < stable["initial_loss"] < stable["start_loss"]
    # Constant after a linear warm-up: the rate reaches its value at the end of warm-up and stays there.
    assert stable["curve"]["learning_rate"][4:] == [1e-3] * 12 and stable["curve"]["learning_rate"][0] == 0
    # Every trial starts from the same initial weights and batches: the first loss (before any update) agrees.
    assert len({trial["curve"]["loss"][0] for trial in ran}) == 1


def test_sweep_writes_a_table_and_a_plot(sweep_dir):
    report = (sweep_dir / "lr_sweep.md").read_text()
    assert "| lr | initial loss | final loss | spikes | grad-norm ratio | stable |" in report
    assert "| 0.001 |" in report and "| 1000 |" in report
    assert "--learning_rate_from" in report
    assert (sweep_dir / "lr_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(sweep_dir.glob(".*.tmp")) and not list(sweep_dir.glob("checkpoint-*"))


def test_run_pretrain_takes_the_rate_from_the_sweep_unless_set_on_the_command_line(sweep_dir, tiny_data_dir, tmp_path):
    chosen = json.loads((sweep_dir / "lr_sweep.json").read_text())["learning_rate"]
    sweep_file = str(sweep_dir / "lr_sweep.json")
    _, _, args = parse_pretrain_args(["--learning_rate_from", sweep_file, "--use_cpu", "true"])
    resolve_schedule_defaults(args, num_params=1_000_000)
    assert args.learning_rate == chosen and args.warmup_steps == 30  # the rate only; the warm-up stays
    # It wins over the large-model defaults (3e-4, 2000 warm-up steps), which still set the rest.
    _, _, args = parse_pretrain_args(["--learning_rate_from", sweep_file, "--use_cpu", "true"])
    assert "learning_rate" not in resolve_schedule_defaults(args, num_params=3_000_000_000)
    assert args.learning_rate == chosen and args.warmup_steps == 2000 and args.max_steps == -1
    # A flag on the command line wins over the file; the folder holding lr_sweep.json works as well.
    _, _, args = parse_pretrain_args(["--learning_rate_from", str(sweep_dir), "--learning_rate", "1e-4",
                                      "--use_cpu", "true"])
    resolve_schedule_defaults(args, num_params=1_000_000)
    assert args.learning_rate == 1e-4 and args.warmup_steps == 30

    # A short training run logs the rate from the file (constant schedule, no warm-up given explicitly).
    pretrain(*parse_pretrain_args([
        "--data_dir", tiny_data_dir, "--output_dir", str(tmp_path / "run"), "--max_steps", "2",
        "--learning_rate_from", sweep_file, "--warmup_steps", "0", "--lr_scheduler_type", "constant",
        "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "no", "--save_final", "false",
        "--disable_tqdm", "true", "--use_cpu", "true"]))
    logs = [e for e in json.loads((tmp_path / "run" / "log_history.json").read_text()) if "loss" in e]
    assert [e["learning_rate"] for e in logs] == [pytest.approx(chosen)] * 2


@pytest.mark.parametrize("content, message", [
    (None, "not found"),
    ("{not json", "not valid JSON"),
    ('{"format_version": 1, "trials": []}', "missing fields \\['learning_rate'\\]"),
    ('{"format_version": 2, "learning_rate": 0.001}', "format_version 2"),
    ('{"format_version": 1, "learning_rate": null}', "smaller --learning_rates"),
    ('{"format_version": 1, "learning_rate": -1}', "not a positive number"),
])
def test_a_missing_or_malformed_sweep_file_is_named_with_the_fix(tmp_path, content, message):
    path = tmp_path / "lr_sweep.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as raised:
        check_pretrain_arguments(*parse_pretrain_args(["--learning_rate_from", str(path), "--use_cpu", "true"]))
    assert str(path) in str(raised.value)
    if content is None:
        assert "hf-recurrent-find-lr" in str(raised.value)


def test_no_stable_rate_exits_non_zero_and_says_to_try_smaller_rates(tiny_data_dir, tmp_path, capsys):
    code = find_lr.main(["--data_dir", tiny_data_dir, "--output_dir", str(tmp_path),
                         "--learning_rates", "1e3", "1e4", *SWEEP])
    assert code != 0
    assert "--learning_rates" in capsys.readouterr().err
    result = json.loads((tmp_path / "lr_sweep.json").read_text())
    assert result["learning_rate"] is None and result["largest_stable_learning_rate"] is None
    first, second = result["trials"]
    assert not first["stable"] and not second["stable"]
    assert second["skipped"] == first["diverged"]  # larger rates are skipped only after a divergence
    with pytest.raises(ValueError, match="no stable learning rate"):
        check_pretrain_arguments(*parse_pretrain_args(["--learning_rate_from", str(tmp_path / "lr_sweep.json"),
                                                       "--use_cpu", "true"]))


class _FailAbove(TrainerCallback):
    """Stops trials above a rate the way the optimizer's non-finite stop does: a RuntimeError mid-training."""

    def __init__(self, rate):
        self.rate = rate

    def on_step_end(self, args, state, control, **kwargs):
        if args.learning_rate > self.rate and state.global_step == 3:
            raise RuntimeError("non-finite gradients in 20 consecutive steps")


def test_a_trial_that_raises_is_unstable_larger_rates_are_skipped_and_models_are_freed(tiny_data_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_data_dir)
    models = []

    def make_model():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(presets.get("debug", vocab_size=len(tokenizer)))
        models.append(weakref.ref(model))
        return model

    args = RecurrentTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, report_to="none",
                                      seed=0, dataloader_pin_memory=False, use_cpu=True)
    sweep = SweepArguments(learning_rates=[4e-3, 1e-3, 2e-3], sweep_steps=10, sweep_warmup_steps=2)
    result = lr_finder.run_sweep(make_model, args, ShardedTokenDataset(tiny_data_dir, "train"), sweep,
                                 trainer_kwargs={"processing_class": tokenizer, "callbacks": [_FailAbove(1.5e-3)]})
    low, failed, skipped = result["trials"]
    assert low["stable"] and low["steps_run"] == 10
    assert not failed["stable"] and failed["diverged"] and failed["steps_run"] == 2  # step 3 raised before its log
    assert failed["error"] == "RuntimeError: non-finite gradients in 20 consecutive steps"
    assert skipped == {"learning_rate": 4e-3, "skipped": True, "stable": False,
                       "unstable_reasons": ["skipped: 0.002 diverged"]}
    assert result["largest_stable_learning_rate"] == 1e-3 and result["learning_rate"] == 5e-4
    gc.collect()
    assert len(models) == 2 and all(ref() is None for ref in models)  # nothing of a trial outlives it


# ----------------------------------------------------------------------------- pure functions, synthetic curves

def _summary(losses, grad_norms=None, error=None, warmup=4):
    grad_norms = [1.0] * len(losses) if grad_norms is None else grad_norms
    return summarize_trial(losses, grad_norms, planned_steps=len(losses) if error is None else 40,
                           warmup_steps=warmup, spike_nats=0.5, max_grad_norm_growth=10.0, error=error)


def test_summary_of_a_smooth_curve_is_stable():
    losses = [6.0 - 0.05 * i for i in range(44)]
    summary = _summary(losses)
    assert summary["stable"] and not summary["diverged"] and summary["spikes"] == 0
    assert summary["initial_loss"] == pytest.approx(6.0 - 0.05 * 8.5)  # steps 4..13: the first 10 after warm-up
    assert summary["final_loss"] == pytest.approx(6.0 - 0.05 * 38.5)  # the last 10
    assert summary["loss_trend"] == pytest.approx(-0.05 * 30)
    assert summary["grad_norm_ratio"] == 1.0


def test_summary_counts_spikes_above_the_running_minimum_after_warm_up_only():
    losses = [6.0 - 0.05 * i for i in range(40)]
    losses[3] = 6.45  # during warm-up: not a spike (nor above the first loss + 0.5)
    noisy = list(losses)
    noisy[20], noisy[21] = noisy[19] + 0.8, noisy[19] + 0.4  # a two-step blip: noise at a small batch
    assert lr_finder.count_spikes(noisy, warmup_steps=4, spike_nats=0.3) == 2  # raw steps
    assert _summary(noisy)["spikes"] == 0 and _summary(noisy)["stable"]  # judged on 9-step means
    for step in range(20, 30):  # a rise that lasts
        losses[step] = losses[19] + 1.2
    summary = _summary(losses)
    assert summary["spikes"] > 0 and not summary["stable"] and not summary["diverged"]
    assert summary["unstable_reasons"] == [f"{summary['spikes']} spikes"]


def test_summary_flags_divergence_blow_up_and_early_stops():
    nan_curve = [6.0 - 0.05 * i for i in range(40)]
    nan_curve[30] = math.nan
    summary = _summary(nan_curve)
    assert summary["diverged"] and not summary["stable"] and summary["nonfinite_losses"] == 1
    rising = [5.0 + 0.01 * i for i in range(40)]  # no spike, but no progress after warm-up
    summary = _summary(rising)
    assert summary["diverged"] and not summary["stable"] and summary["spikes"] == 0
    assert "loss did not fall after warm-up" in summary["unstable_reasons"]
    falling = [6.0 - 0.05 * i for i in range(40)]
    blow_up = [1.0] * 10 + [float(2 ** (i / 3)) for i in range(30)]  # the grad norm grows ~1000x
    summary = _summary(falling, blow_up)
    assert not summary["stable"] and not summary["diverged"] and summary["grad_norm_ratio"] > 10
    summary = _summary(falling, [1.0, math.inf] + [1.0] * 38)  # an overflow during warm-up
    assert summary["diverged"] and summary["unstable_reasons"] == ["1 non-finite grad norms"]
    summary = _summary(falling[:12], error="RuntimeError: stop")  # stopped after 12 of 40 steps
    assert not summary["stable"] and summary["diverged"] and summary["steps_run"] == 12
    assert summary["unstable_reasons"][:2] == ["stopped by an error", "ran 12 of 40 steps"]
    json.dumps(_summary(nan_curve), allow_nan=False)  # non-finite numbers are stored as null


def test_pick_is_the_largest_rate_with_every_smaller_one_stable_over_the_margin():
    def trials(*flags):
        return [{"learning_rate": rate, "stable": flag} for rate, flag in zip((1e-4, 3e-4, 1e-3, 3e-3), flags)]

    pick = pick_learning_rate(trials(True, True, False, True), margin=2)  # 3e-3 stable above an unstable rate
    assert pick["learning_rate"] == pytest.approx(1.5e-4) and pick["largest_stable_learning_rate"] == 3e-4
    assert pick["first_unstable_learning_rate"] == 1e-3 and pick["stable_above_first_unstable"] == [3e-3]
    pick = pick_learning_rate(list(reversed(trials(True, True, True, True))), margin=4)  # order does not matter
    assert pick["learning_rate"] == pytest.approx(3e-3 / 4) and pick["first_unstable_learning_rate"] is None
    assert pick_learning_rate(trials(False, True, True, True), margin=2)["learning_rate"] is None


def test_sweep_arguments_are_checked_and_small_models_get_a_quick_sweep():
    with pytest.raises(ValueError, match="--learning_rates"):
        SweepArguments(learning_rates=[1e-3, -1.0])
    with pytest.raises(ValueError, match="--sweep_warmup_steps"):
        SweepArguments(sweep_steps=10, sweep_warmup_steps=8)
    with pytest.raises(ValueError, match="--margin"):
        SweepArguments(margin=0.5)
    with pytest.raises(ValueError, match="--spike_nats"):
        SweepArguments(spike_nats=0)
    assert SweepArguments(learning_rates=[3e-3, 1e-3, 3e-3]).learning_rates == [1e-3, 3e-3]
    small = SweepArguments(sweep_steps=40)
    changed = resolve_sweep_defaults(small, num_params=1_000_000)
    assert "sweep_steps" not in changed and small.sweep_steps == 40
    assert small.learning_rates == lr_finder.SMALL_MODEL_SWEEP["learning_rates"]
    large = SweepArguments()
    assert resolve_sweep_defaults(large, num_params=3_000_000_000) == {}
    assert large.learning_rates == list(lr_finder.DEFAULT_LEARNING_RATES) and large.sweep_steps == 60
