import gc
import json
import math
import pathlib
import random
import shutil
import statistics
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback

from hf_recurrent import presets
from trainer_ext.cli import find_lr
from trainer_ext.data.shards import ShardedTokenDataset
from trainer_ext.lr_search import finder as lr_finder, trials as lr_trials
from trainer_ext.training.arguments import RecurrentTrainingArguments, resolve_schedule_defaults
from trainer_ext.lr_search.finder import SweepArguments, pick_learning_rate, resolve_sweep_defaults, summarize_trial
from trainer_ext.run.pretrain import parse_pretrain_args, parse_pretrain_job, pretrain

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
    assert "| lr | initial loss | final loss | vs others | largest rise | spikes | grad-norm ratio | stable |" in report
    assert "| 0.001 |" in report and "| 1000 |" in report
    assert "--learning_rate_from" in report
    assert (sweep_dir / "lr_sweep.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(sweep_dir.glob(".*.tmp")) and not list(sweep_dir.glob("checkpoint-*"))


def test_run_pretrain_takes_the_rate_from_the_sweep_unless_set_on_the_command_line(sweep_dir, tiny_data_dir, tmp_path):
    chosen = json.loads((sweep_dir / "lr_sweep.json").read_text())["learning_rate"]
    sweep_file = str(sweep_dir / "lr_sweep.json")
    def resolved(argv, num_params):  # the job reads the sweep file once; the defaults take its rate
        job = parse_pretrain_job([*argv, "--output_dir", str(tmp_path / "unused"), "--use_cpu", "true"])
        return job.training_args, resolve_schedule_defaults(job.training_args, num_params, job.swept_learning_rate)

    args, _ = resolved(["--learning_rate_from", sweep_file], 1_000_000)
    assert args.learning_rate == chosen and args.warmup_steps == 30  # the rate only; the warm-up stays
    # It wins over the large-model defaults (3e-4, 2000 warm-up steps), which still set the rest.
    args, applied = resolved(["--learning_rate_from", sweep_file], 3_000_000_000)
    assert "learning_rate" not in applied
    assert args.learning_rate == chosen and args.warmup_steps == 2000 and args.max_steps == -1
    # A flag on the command line wins over the file; the folder holding lr_sweep.json works as well.
    args, _ = resolved(["--learning_rate_from", str(sweep_dir), "--learning_rate", "1e-4"], 1_000_000)
    assert args.learning_rate == 1e-4 and args.warmup_steps == 30

    # A short training run logs the rate from the file (constant schedule, no warm-up given explicitly).
    pretrain(parse_pretrain_job([
        "--data_dir", tiny_data_dir, "--output_dir", str(tmp_path / "run"), "--max_steps", "2",
        "--learning_rate_from", sweep_file, "--warmup_steps", "0", "--lr_scheduler_type", "constant",
        "--logging_steps", "1", "--eval_strategy", "no", "--save_strategy", "no", "--save_final", "false",
        "--disable_tqdm", "true", "--use_cpu", "true"]))
    logs = [e for e in json.loads((tmp_path / "run" / "log_history.json").read_text()) if "loss" in e]
    assert [e["learning_rate"] for e in logs] == [pytest.approx(chosen)] * 2


@pytest.mark.parametrize("content, message", [
    (None, "not found"),
    ("{not json", "not valid JSON"),
    ('{"format_version": 2, "trials": []}', "missing fields \\['learning_rate'\\]"),
    # Version 1 judged rates on raw batch losses: its pick is not taken.
    ('{"format_version": 1, "learning_rate": 0.001}', "format_version 1"),
    ('{"format_version": 2, "learning_rate": null}', "smaller --learning_rates"),
    ('{"format_version": 2, "learning_rate": -1}', "not a positive number"),
])
def test_a_missing_or_malformed_sweep_file_is_named_with_the_fix(tmp_path, content, message):
    path = tmp_path / "lr_sweep.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=message) as raised:
        parse_pretrain_job(["--learning_rate_from", str(path), "--use_cpu", "true"])
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
        parse_pretrain_job(["--learning_rate_from", str(tmp_path / "lr_sweep.json"), "--use_cpu", "true"])


def test_sweep_start_trains_first_and_every_trial_starts_from_its_weights_on_later_samples(
        tiny_data_dir, tmp_path, sweep_dir):
    code = find_lr.main(["--data_dir", tiny_data_dir, "--output_dir", str(tmp_path), "--learning_rates", "1e-3",
                         "3e-3", "--sweep_start_steps", "12", *SWEEP])
    assert code == 0
    result = json.loads((tmp_path / "lr_sweep.json").read_text())
    start = tmp_path / "sweep_start"
    assert result["sweep_start"] == str(start) and result["sweep"]["sweep_start_steps"] == 12
    assert (start / "config.json").is_file() and (start / "model.safetensors").is_file()
    report = (tmp_path / "lr_sweep.md").read_text()
    assert f"each from the weights of 12 steps warming up to the smallest rate ({start})" in report
    assert "| grad-norm ratio | held-out loss | stable |" in report and "above the start's" in report
    first_losses = {trial["curve"]["loss"][0] for trial in result["trials"]}
    assert len(first_losses) == 1  # every trial starts from the same saved weights and samples
    # From the init (the module's sweep, same rates and batches) the first loss is about ln(vocab); 12 steps of
    # training up to 1e-3 lower it.
    fresh = json.loads((sweep_dir / "lr_sweep.json").read_text())["trials"][0]["curve"]["loss"][0]
    assert first_losses.pop() < fresh - 0.2
    # The start and every trial end with an evaluation on the same held-out samples, which judges the trials.
    start_held_out = result["start_held_out_loss"]
    assert math.isfinite(start_held_out) and start_held_out < fresh
    for trial in result["trials"]:
        assert math.isfinite(trial["held_out_loss"])
        assert trial["held_out_rise"] == pytest.approx(trial["held_out_loss"] - start_held_out)
        assert trial["stable"] == (trial["unstable_reasons"] == [])
        assert not any("first step" in reason or "did not fall" in reason for reason in trial["unstable_reasons"])


def test_a_sweep_start_without_held_out_samples_is_refused_before_training(tmp_path):
    from trainer_ext.data.prepare import PrepareDataArguments, prepare

    data = tmp_path / "no-eval"
    prepare(PrepareDataArguments(output_dir=str(data), max_documents=40, vocab_size=300, seq_len=32, eval_samples=0))
    with pytest.raises(ValueError, match="--sweep_start_steps=12 judges the trials on the data's held-out .* split 'eval' has no samples.*--eval_samples"):
        find_lr.main(["--data_dir", str(data), "--output_dir", str(tmp_path / "out"), "--learning_rates", "1e-3",
                      "--sweep_start_steps", "12", *SWEEP])
    assert not (tmp_path / "out" / "sweep_start").exists()


def test_a_sweep_start_that_fails_names_the_flag_and_runs_no_trial(tiny_data_dir, tmp_path, monkeypatch):
    from trainer_ext.run import find_lr as find_lr_module

    calls = []

    def stopped(make_model, args, train_dataset, trainer_kwargs, save_to=None, eval_dataset=None):
        calls.append((args.max_steps, args.warmup_steps, args.learning_rate, save_to))
        return {"curve": {}, "error": "RuntimeError: non-finite gradients in 20 consecutive steps"}

    monkeypatch.setattr(find_lr_module, "run_trial", stopped)
    with pytest.raises(ValueError, match="--sweep_start_steps=12") as raised:  # a console script exits 1 on it
        find_lr.main(["--data_dir", tiny_data_dir, "--output_dir", str(tmp_path), "--learning_rates", "3e-3", "1e-3",
                      "--sweep_start_steps", "12", *SWEEP])
    assert calls == [(12, 12, 1e-3, str(tmp_path / "sweep_start"))]  # warms up to the smallest rate, then stops
    assert "non-finite gradients" in str(raised.value) and "lower --learning_rates" in str(raised.value)
    assert not (tmp_path / "lr_sweep.json").exists()


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
    result = lr_trials.run_sweep(make_model, args, ShardedTokenDataset(tiny_data_dir, "train"), sweep,
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

def _summary(losses, grad_norms=None, error=None, warmup=4, reference=None):
    grad_norms = [1.0] * len(losses) if grad_norms is None else grad_norms
    return summarize_trial(losses, grad_norms, planned_steps=len(losses) if error is None else 40,
                           warmup_steps=warmup, spike_nats=0.5, max_grad_norm_growth=10.0, error=error,
                           reference=reference)


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
    assert lr_finder.lasting_rise(noisy, warmup_steps=4, spike_nats=0.3)["spikes"] == 2  # raw steps
    assert _summary(noisy)["spikes"] == 0 and _summary(noisy)["stable"]  # judged on 9-step medians
    for step in range(20, 30):  # a rise that lasts
        losses[step] = losses[19] + 1.2
    summary = _summary(losses)
    assert summary["spikes"] > 0 and not summary["stable"] and not summary["diverged"]
    assert summary["unstable_reasons"] == [f"{summary['spikes']} spikes"]


def test_a_trial_from_trained_weights_is_judged_on_its_held_out_loss_not_on_its_own_fall():
    rng = random.Random(0)
    flat = [4.5 + rng.uniform(-0.4, 0.4) for _ in range(30)]  # a trained model: batches move it, it hardly falls
    flat[0] = 3.5  # an easy first batch
    alone = _summary(flat)
    assert alone["diverged"] and "loss did not fall after warm-up" in alone["unstable_reasons"]
    kept = summarize_trial(flat, [1.0] * 30, planned_steps=30, warmup_steps=8, spike_nats=0.5,
                           max_grad_norm_growth=10.0, held_out=(4.2, 4.15))
    assert kept["stable"] and not kept["diverged"] and kept["held_out_rise"] == pytest.approx(-0.05)
    broken = summarize_trial(flat, [1.0] * 30, planned_steps=30, warmup_steps=8, spike_nats=0.5,
                             max_grad_norm_growth=10.0, held_out=(4.2, 4.9))
    assert broken["diverged"] and broken["unstable_reasons"] == ["held-out loss +0.70 nats against the start's"]
    spiky = list(flat)
    spiky[12:20] = [6.5] * 8  # a stretch of hard batches, as one trial alone cannot tell from a break
    alone = summarize_trial(spiky, [1.0] * 30, planned_steps=30, warmup_steps=8, spike_nats=0.5,
                            max_grad_norm_growth=10.0, held_out=(4.2, 4.15))
    assert alone["spikes"] > 0 and alone["stable"]  # the held-out loss judges it
    paired = summarize_trial(spiky, [1.0] * 30, planned_steps=30, warmup_steps=8, spike_nats=0.5,
                             max_grad_norm_growth=10.0, held_out=(4.2, 4.15), reference=flat, smaller=[flat])
    assert paired["spikes"] > 0 and not paired["stable"]  # against the other rates on the same batches it counts
    unmeasured = summarize_trial(flat[:12], [1.0] * 12, planned_steps=30, warmup_steps=8, spike_nats=0.5,
                                 max_grad_norm_growth=10.0, error="RuntimeError: stop", held_out=(4.2, None))
    assert unmeasured["diverged"] and unmeasured["held_out_loss"] is None
    assert "held-out loss not measured (the trial stopped) against the start's" in unmeasured["unstable_reasons"]


def test_a_trial_releases_its_tensors_even_where_its_model_is_still_referenced(tiny_data_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tiny_data_dir)
    kept = []

    def make_model():
        torch.manual_seed(0)
        kept.append(AutoModelForCausalLM.from_config(presets.get("debug", vocab_size=len(tokenizer))))
        return kept[-1]

    args = lr_trials.trial_arguments(
        RecurrentTrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=8, report_to="none", seed=0,
                                   dataloader_pin_memory=False, use_cpu=True),
        1e-3, SweepArguments(learning_rates=[1e-3], sweep_steps=6, sweep_warmup_steps=2))
    eval_set = torch.utils.data.Subset(ShardedTokenDataset(tiny_data_dir, "eval"), range(8))
    outcome = lr_trials.run_trial(make_model, args, ShardedTokenDataset(tiny_data_dir, "train"),
                                  {"processing_class": tokenizer}, eval_dataset=eval_set)
    assert outcome["error"] is None and len(outcome["curve"]["loss"]) == 6
    assert 0 < outcome["held_out_loss"] < math.log(len(tokenizer)) + 1
    # Peaks are CUDA's: none on a CPU, and the progress line then names no memory.
    assert outcome["peak_reserved_gib"] is None and outcome["train_peak_reserved_gib"] is None
    assert lr_trials.memory_note(outcome) == ""
    assert lr_trials.memory_note({"peak_reserved_gib": 23.014, "train_peak_reserved_gib": 20.9}) == (
        ", peak 23.01 GiB reserved (20.90 in training)")
    (model,) = kept  # a reference the trial does not know of: its weights, gradients and hooks are gone anyway
    assert all(p.numel() == 0 and p.grad is None for p in model.parameters())
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())


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
    with pytest.raises(ValueError, match="--sweep_start_steps"):
        SweepArguments(sweep_start_steps=-1)
    assert SweepArguments(learning_rates=[3e-3, 1e-3, 3e-3]).learning_rates == [1e-3, 3e-3]
    small = SweepArguments(sweep_steps=40)
    changed = resolve_sweep_defaults(small, num_params=1_000_000)
    assert "sweep_steps" not in changed and small.sweep_steps == 40
    assert small.learning_rates == lr_finder.SMALL_MODEL_SWEEP["learning_rates"]
    large = SweepArguments()
    assert resolve_sweep_defaults(large, num_params=3_000_000_000) == {}
    assert large.learning_rates == list(lr_finder.DEFAULT_LEARNING_RATES) and large.sweep_steps == 60
    assert large.sweep_start_steps == 100 and small.sweep_start_steps == 0  # large models: trials from trained weights


# ----------------------------------------------------------------------------- judged against the other trials

# A GPU sweep of recurrent-3.3b at batch 1 x 2048 (60 steps per rate, 10 warm-up), judged by the old rule (raw
# batch losses, trailing means): it picked no rate. Its larger rates were skipped after 1e-3 was judged diverged.
GPU_SWEEP = pathlib.Path(__file__).parent / "data" / "lr_sweep_recurrent-3.3b_batch1.json"


def _replay(recorded):
    sweep = SweepArguments(**recorded["sweep"])
    ran = [trial for trial in recorded["trials"] if not trial["skipped"]]
    trials, reference = lr_finder.judge_trials(ran, sweep)
    return sweep, {trial["learning_rate"]: trial for trial in trials}, reference


def test_replaying_the_gpu_batch_1_curves_judges_the_rates_not_the_batches():
    recorded = json.loads(GPU_SWEEP.read_text())
    assert recorded["learning_rate"] is None and recorded["trials"][0]["spikes"] == 10  # the old verdict on 1e-4
    sweep, trials, reference = _replay(recorded)
    assert sorted(trials) == [1e-4, 2e-4, 5e-4, 1e-3] and all(trial["paired"] for trial in trials.values())
    assert len(reference) == 60

    # (a) Outlier steps are not lasting rises: 1e-4 drew losses of 9.7, 15.6 and 13.1 at steps 14-16 (the others
    # 7.6-9.8); 1e-3 one of 13.4 at warm-up step 4, above the first loss.
    assert trials[1e-4]["curve"]["loss"][14] > 15 and trials[1e-3]["curve"]["loss"][3] > 13
    assert trials[1e-4]["spikes"] == 0 and trials[1e-4]["largest_rise"] < sweep.spike_nats
    assert not trials[1e-3]["diverged"] and trials[1e-3]["spikes"] == 0
    # One more outlier (5 nats at step 40) in any trial changes neither its verdict nor its largest rise much.
    for rate in trials:
        bumped = json.loads(GPU_SWEEP.read_text())
        trial = next(t for t in bumped["trials"] if t["learning_rate"] == rate)
        trial["curve"]["loss"][39] += 5.0
        again = _replay(bumped)[1][rate]
        assert again["stable"] == trials[rate]["stable"] and again["spikes"] == 0
        assert again["largest_rise"] == pytest.approx(trials[rate]["largest_rise"], abs=0.1)

    # (b) After step 30 the four curves move together (each correlates > 0.9 with the per-step median): the
    # batch drawn, not the rate, moves one step's loss. Curves that agree get the same verdict.
    for trial in trials.values():
        assert statistics.correlation(trial["curve"]["loss"][30:], reference[30:]) > 0.9
    assert {trial["stable"] for trial in trials.values()} == {True}

    # (c) The pick: at least 1e-4, below the smallest rate with a lasting rise (none here, up to the largest rate
    # run, 1e-3), and the largest rate with every smaller one stable, over the margin.
    pick = pick_learning_rate(list(trials.values()), sweep.margin)
    rising = [rate for rate, trial in trials.items() if trial["spikes"]]
    assert pick["learning_rate"] >= 1e-4 and pick["learning_rate"] < min(rising, default=math.inf)
    assert pick["largest_stable_learning_rate"] == max(trials)
    assert pick["learning_rate"] == pytest.approx(max(trials) / sweep.margin)
    # Per-step judgement still ranks the rates: the smaller ones ended ahead of the larger ones on the same batches.
    behind = [trials[rate]["final_vs_reference"] for rate in sorted(trials)]
    assert behind == sorted(behind) and behind[0] < 0 < behind[-1]


def _synthetic_trials(levels, difficulty, seed=0):
    """Trials whose loss at each step is their own level plus the batch's shared difficulty, as at batch 1, plus
    0.2 nats (RMS) of their own: the same batch is not equally hard for every model."""
    rng = random.Random(1000 + seed)
    return [{"learning_rate": rate, "skipped": False, "error": None,
             "curve": {"step": list(range(1, len(level) + 1)),
                       "loss": [lv + d + (rng.gauss(0.0, 0.2) if step else 0.0)
                                for step, (lv, d) in enumerate(zip(level, difficulty))],
                       "grad_norm": [1.0] * len(level)}}
            for rate, level in levels.items()]


def _difficulty(steps=60, seed=0):
    """Batch-to-batch movement of 0.6 nats (RMS), shared by every trial (the same batches in the same order),
    growing from none over the first 10 steps: an untrained model's loss is about ln V on any batch."""
    rng = random.Random(seed)
    return [rng.gauss(0.0, 0.6) * min(1.0, step / 10) for step in range(steps)]


def _level(steps=60, speed=1.0, floor=7.0):
    return [floor + 4.0 * math.exp(-speed * step / 12) for step in range(steps)]


def _judge(levels, difficulty, warmup=10, seed=0):
    sweep = SweepArguments(learning_rates=list(levels), sweep_steps=len(difficulty), sweep_warmup_steps=warmup)
    trials, reference = lr_finder.judge_trials(_synthetic_trials(levels, difficulty, seed), sweep)
    return {trial["learning_rate"]: trial for trial in trials}, reference


def test_a_rate_whose_loss_rises_steadily_above_the_others_is_unstable():
    difficulty = _difficulty()
    diverging = _level(speed=1.5)
    for step in range(25, 60):  # from step 25 on its loss climbs 0.04 nats a step while the others still fall
        diverging[step] = diverging[24] + 0.04 * (step - 24)
    levels = {1e-4: _level(speed=0.8), 3e-4: _level(speed=1.0), 1e-3: _level(speed=1.2), 3e-3: diverging}
    trials, reference = _judge(levels, difficulty)
    assert reference is not None
    assert [trials[rate]["stable"] for rate in sorted(trials)] == [True, True, True, False]
    assert trials[3e-3]["spikes"] > 0 and trials[3e-3]["largest_rise"] > 1.0
    pick = pick_learning_rate(list(trials.values()), margin=2)
    assert pick["first_unstable_learning_rate"] == 3e-3 and pick["learning_rate"] == pytest.approx(5e-4)


def test_shared_hard_batches_make_no_rate_unstable_but_would_on_its_own():
    difficulty = _difficulty(seed=1)
    for step in range(40, 47):  # seven hard batches in a row, 1.5 nats harder for every rate
        difficulty[step] += 1.5
    levels = {1e-4: _level(speed=0.8), 3e-4: _level(speed=1.0), 1e-3: _level(speed=1.2)}
    trials, _ = _judge(levels, difficulty)
    assert all(trial["stable"] and trial["spikes"] == 0 for trial in trials.values())
    # Judged alone (fewer than three comparable trials), the same curve shows a lasting rise: the batches.
    alone, reference = _judge({1e-4: levels[1e-4], 3e-4: levels[3e-4]}, difficulty)
    assert reference is None and not alone[1e-4]["paired"]
    assert alone[1e-4]["spikes"] > 0 and not alone[1e-4]["stable"]


def test_a_small_rate_that_falls_more_slowly_than_the_others_is_not_unstable():
    difficulty = _difficulty(seed=2)
    slow = [11.0 - 0.025 * step for step in range(60)]  # after warm-up it falls 1.25 nats, the others 1.7-2.2
    levels = {1e-5: slow, 1e-4: _level(speed=0.6), 3e-4: _level(speed=0.8), 1e-3: _level(speed=1.0)}
    trials, _ = _judge(levels, difficulty)
    assert trials[1e-5]["final_vs_reference"] > 0.5  # it ends well behind the others ...
    assert trials[1e-5]["stable"] and trials[1e-5]["spikes"] == 0  # ... but its own loss keeps falling
    assert all(trial["stable"] for trial in trials.values())


def test_divergence_is_judged_per_trial_so_larger_rates_can_be_skipped_before_they_run():
    difficulty = _difficulty(seed=3)
    level = _level()
    losses = [lv + d for lv, d in zip(level, difficulty)]
    collapsed = losses[:30] + [loss + 5.0 for loss in losses[30:]]  # back above the first loss from step 30
    alone = _summary(collapsed, warmup=10)
    reference = [lv + d for lv, d in zip(_level(speed=1.2), difficulty)]
    paired = _summary(collapsed, warmup=10, reference=reference)
    assert alone["diverged"] and paired["diverged"] and not paired["stable"]
    assert "loss rose over 0.5 nats above the first step's" in paired["unstable_reasons"]
    # The summary written for the sweep records how it was judged.
    sweep = SweepArguments(learning_rates=[1e-4], sweep_steps=60, sweep_warmup_steps=10)
    judged, _ = lr_finder.judge_trials([{"learning_rate": 1e-4, "skipped": True, "stable": False,
                                         "unstable_reasons": ["skipped: 5e-05 diverged"]}], sweep)
    assert judged[0]["skipped"] and "paired" not in judged[0]


@pytest.mark.parametrize("plan", ["auto", "none"])
def test_the_trials_train_with_the_memory_plan_pretraining_would_apply(tiny_data_dir, tmp_path, monkeypatch, plan):
    from trainer_ext.run import find_lr as find_lr_module
    from trainer_ext.memory.plan import MemoryPlanCallback, apply_memory_plan

    argv = ["--data_dir", tiny_data_dir, "--output_dir", str(tmp_path), "--learning_rates", "1e-3", "--use_cpu",
            "true", "--memory_plan", plan, "--memory_cap_gib", "0.5", "--memory_margin_gib", "0.1"]
    job, sweep_args = find_lr_module.parse_find_lr_job(argv)
    _, _, pretrain_args = parse_pretrain_args(argv[:4] + argv[6:])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # seen by the planner only
    seen = {}

    def capture(make_model, args, train_set, sweep, trainer_kwargs, info, **resumable):
        seen.update(args=args, callbacks=trainer_kwargs["callbacks"], info=info, seq_len=train_set.seq_len)
        return {"learning_rate": None}

    monkeypatch.setattr(find_lr_module, "find_learning_rate", capture)
    find_lr_module.find_lr(job, sweep_args)
    # pretraining's own plan for the same arguments, model (the default preset, fp32 on the CPU) and data
    config = presets.get("debug", vocab_size=len(AutoTokenizer.from_pretrained(tiny_data_dir)))
    pretrain_callbacks = apply_memory_plan(pretrain_args, config, seen["seq_len"], 4)
    batch = seen["args"].per_device_train_batch_size
    assert batch == pretrain_args.per_device_train_batch_size == seen["info"]["per_device_train_batch_size"]
    if plan == "none":
        assert seen["callbacks"] == [] == pretrain_callbacks and seen["info"]["memory_plan"] is None and batch == 8
    else:
        chosen = next(c.plan for c in seen["callbacks"] if isinstance(c, MemoryPlanCallback))
        assert chosen.per_device_train_batch_size == batch != 8 and chosen.predicted_peak_gib <= 0.5 - 0.1
        assert seen["info"]["memory_plan"] == chosen.describe()


def test_a_sweep_stopped_midway_resumes_with_its_start_and_finished_trials(tiny_data_dir, tmp_path, monkeypatch):
    from trainer_ext.run import find_lr as find_lr_module

    real_trial, real_start = lr_trials.run_trial, find_lr_module.train_sweep_start
    calls = {"trials": 0, "starts": 0}

    def stop_at_second_trial(*args, **kwargs):
        calls["trials"] += 1
        if calls["trials"] == 2:
            raise KeyboardInterrupt  # a crash, a lost machine, Ctrl-C
        return real_trial(*args, **kwargs)

    def counted_start(*args, **kwargs):
        calls["starts"] += 1
        return real_start(*args, **kwargs)

    monkeypatch.setattr(find_lr_module, "train_sweep_start", counted_start)
    monkeypatch.setattr(lr_trials, "run_trial", stop_at_second_trial)
    argv = ["--data_dir", tiny_data_dir, "--output_dir", str(tmp_path), "--learning_rates", "1e-3", "2e-3",
            "--sweep_start_steps", "8", *SWEEP, "--sweep_steps", "8"]  # short trials: this test runs five
    with pytest.raises(KeyboardInterrupt):
        find_lr.main(argv)
    progress = json.loads((tmp_path / "lr_sweep.progress.json").read_text())
    assert [trial["learning_rate"] for trial in progress["trials"]] == [1e-3] and calls["starts"] == 1
    assert math.isfinite(progress["start_held_out_loss"]) and not (tmp_path / "lr_sweep.json").exists()

    calls["trials"] = -100  # no more stops
    assert find_lr.main(argv) == 0
    assert calls == {"trials": -99, "starts": 1}  # the start and the first trial are not run again
    result = json.loads((tmp_path / "lr_sweep.json").read_text())
    assert [trial["learning_rate"] for trial in result["trials"]] == [1e-3, 2e-3]
    assert result["trials"][0]["curve"] == progress["trials"][0]["curve"]
    assert result["start_held_out_loss"] == progress["start_held_out_loss"]
    assert not (tmp_path / "lr_sweep.progress.json").exists()  # removed once the sweep's files are written

    # Stopped again, then its start's weights removed: the start is trained anew and every trial runs from it.
    calls.update(trials=0, starts=0)
    with pytest.raises(KeyboardInterrupt):
        find_lr.main(argv)
    shutil.rmtree(tmp_path / "sweep_start")
    calls["trials"] = -100
    assert find_lr.main(argv) == 0 and calls == {"trials": -98, "starts": 2}


def test_a_sweep_left_with_other_settings_is_refused_naming_them(tiny_data_dir, tmp_path):
    from trainer_ext.lr_search.sweep_file import write_progress

    write_progress(str(tmp_path), {"seed": 0, "sweep": {"learning_rates": [5e-4]}}, None, [])
    with pytest.raises(ValueError, match=r"part of a sweep with other settings \(differs in: .*learning_rates"):
        find_lr.main(["--data_dir", tiny_data_dir, "--output_dir", str(tmp_path), "--learning_rates", "1e-3", *SWEEP])
    assert find_lr.main(["--data_dir", tiny_data_dir, "--output_dir", str(tmp_path), "--learning_rates", "1e-3",
                         "--overwrite_output_dir", "true", *SWEEP]) in (0, 1)
    assert (tmp_path / "lr_sweep.json").exists() and not (tmp_path / "lr_sweep.progress.json").exists()
