"""The training benchmark's summary of a run (benchmarks/bench_train.py), from a synthetic log history."""

import json

from benchmarks import bench_train
from benchmarks.bench_train import rise_over_running_min, summarize


def test_the_summary_measures_spikes_of_the_training_and_the_held_out_curves(tmp_path):
    # Training losses with one hard stretch of batches; a held-out curve that rises once after step 20.
    losses = [6.0, 5.0, 4.0, 4.5, 3.5, 5.5, 3.4, 3.3]
    history = [{"step": i + 1, "loss": loss, "tokens_per_second": 100.0 + i, "mfu": 0.5, "peak_reserved_gib": 1.0,
                "depth": float(i)} for i, loss in enumerate(losses)]
    history += [{"step": s, "eval_loss": e} for s, e in ((10, 5.0), (20, 4.0), (30, 4.6), (40, 3.9))]
    (tmp_path / "log_history.json").write_text(json.dumps(history))
    row = summarize("debug", str(tmp_path), warmup=2, spike_from=2)
    assert row["depth_mean"] == 4.5  # the depths of the steps after the warm-up: 2..7
    assert row["loss_rise_over_min"] == rise_over_running_min(losses, 2) == 2.0  # 5.5 over the 3.5 before it
    assert row["eval_rise_over_min"] == 0.6 and row["eval_loss"] == 3.9  # 4.6 over 4.0
    # Counted at the steps after the warm-up only (against the minimum of all before): the evaluation at step 30,
    # the warm-up's last, is not; nor is a training loss at the warm-up's last step.
    assert summarize("debug", str(tmp_path), warmup=2, spike_from=20)["eval_rise_over_min"] == 0.6
    assert summarize("debug", str(tmp_path), warmup=2, spike_from=30)["eval_rise_over_min"] == 0.0
    assert summarize("debug", str(tmp_path), warmup=2, spike_from=6)["loss_rise_over_min"] == 0.0


def test_the_summary_of_windowed_logs_leaves_out_the_warm_up_by_steps(tmp_path):
    # A log line every 3 steps (--log_every 3): the first with a speed at step 3 (compile warm-up before it), then
    # windows ending at 6, 9, 12. A warm-up of 3 steps leaves out the first line only, whatever the window.
    history = [{"step": s, "loss": 5.0, "tokens_per_second": tps, "mfu": tps / 1000, "depth": depth}
               for s, tps, depth in ((3, 10.0, 1.0), (6, 100.0, 4.0), (9, 300.0, 6.0), (12, 200.0, 8.0))]
    (tmp_path / "log_history.json").write_text(json.dumps([{"step": 1, "loss": 6.0}, *history]))
    row = summarize("debug", str(tmp_path), warmup=3)
    assert row["tokens_per_second"] == 200.0 and row["mfu"] == 0.2 and row["depth_mean"] == 6.0
    every_step = [{"step": s, "loss": 5.0, "tokens_per_second": float(s), "depth": 1.0} for s in range(3, 13)]
    (tmp_path / "log_history.json").write_text(json.dumps(every_step))
    assert summarize("debug", str(tmp_path), warmup=3)["tokens_per_second"] == 9.0  # steps 6-12, as logs[3:] was
    # A log line every 20 steps over 14 (a profiled run): no speed to report, said as the row's error
    (tmp_path / "log_history.json").write_text(json.dumps([{"step": 14, "train_runtime": 9.0}]))
    assert "no log line with a speed" in summarize("debug", str(tmp_path), warmup=3)["error"]


def test_the_capped_runner_runs_a_module_as_main_with_its_arguments_and_exit_code(tmp_path, monkeypatch):
    import sys

    import pytest

    from benchmarks import capped

    (tmp_path / "echo_args.py").write_text(
        "import sys, pathlib\npathlib.Path(sys.argv[1]).write_text(' '.join(sys.argv[2:]))\nsys.exit(3)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    out = tmp_path / "args.txt"
    with pytest.raises(SystemExit) as exited:
        capped.main(["24", "echo_args", str(out), "--preset", "debug"])
    assert exited.value.code == 3 and out.read_text() == "--preset debug"
    with pytest.raises(SystemExit, match="CAP_GIB must be a number of GiB"):
        capped.main(["lots", "echo_args"])


def test_the_spike_null_tells_a_burst_of_the_model_from_the_order_of_the_batches(tmp_path):
    import random

    from benchmarks import spike_null

    # A falling trend with batch noise (sd 0.6, as on the GPU runs' Python sources): with and without a
    # burst of the model's own, 1.5 nats over steps 150-161.
    noise = random.Random(0)
    trend = [8.0 - 4.0 * min(step, 300) / 300 for step in range(300)]
    stable = [level + noise.gauss(0, 0.6) for level in trend]
    spiked = [loss + (1.5 if 150 <= step < 162 else 0.0) for step, loss in enumerate(stable)]
    calm = spike_null.spike_null(stable, start=100, window=10, draws=300)
    spike = spike_null.spike_null(spiked, start=100, window=10, draws=300)
    # The observed figure is the training benchmark's own measure.
    assert calm["observed"] == rise_over_running_min(stable, 100, window=10)
    # Batch noise alone lifts the 10-step mean over its running minimum by more than 0.5 nats in a typical order,
    # and this order is an ordinary one; the burst lies beyond every random order.
    assert calm["null_median"] > 0.5 and calm["share_of_null_at_or_above_observed"] > 0.05
    assert spike["observed"] > spike["null_p99"] and spike["share_of_null_at_or_above_observed"] == 0.0
    assert 0.5 < calm["per_step_sd_after_start"] < 0.7
    # The command line reads Trainer log histories (evaluation entries left out) and prints a row per window.
    history = [{"step": i + 1, "loss": loss} for i, loss in enumerate(spiked)] + [{"step": 300, "eval_loss": 3.0}]
    (tmp_path / "log_history.json").write_text(json.dumps(history))
    (row,) = spike_null.main([str(tmp_path / "log_history.json"), "--spike_from", "100", "--draws", "100"])
    assert row["observed"] == spike["observed"] and row["window"] == 10


def test_two_runs_are_compared_step_by_step_at_the_depths_both_sampled(tmp_path, capsys):
    import pytest

    from benchmarks.step_ratio import compare, main

    depths = [4, 2, 6, 4, 8, 3, 5, 4]
    baseline = [{"step": i + 1, "tokens_per_second": 1000.0 / d, "depth": d} for i, d in enumerate(depths)]
    changed = [dict(row, tokens_per_second=row["tokens_per_second"] * (1.1 if row["step"] % 2 else 1.2))
               for row in baseline]
    changed[6]["depth"] = 9  # step 7 sampled another depth: not comparable
    changed.append({"step": 8, "eval_loss": 3.0})  # rows without a speed are not steps
    result = compare(baseline, changed, skip=2)
    assert result["steps"] == 5  # steps 3-8 but 7
    assert result["median"] == pytest.approx(1.2) and result["low"] == pytest.approx(1.1)
    assert result["high"] == pytest.approx(1.2)
    with pytest.raises(ValueError, match="share no logged step"):
        compare(baseline, changed, skip=8)
    for name, history in (("before", baseline), ("after", changed)):  # bench_train outputs: <dir>/<preset>/
        (tmp_path / name / "recurrent-3.3b").mkdir(parents=True)
        (tmp_path / name / "recurrent-3.3b" / "log_history.json").write_text(json.dumps(history))
    main([str(tmp_path / "before"), str(tmp_path / "after"), "--skip", "2"])
    assert capsys.readouterr().out.strip() == "recurrent-3.3b: 1.200 (1.100-1.200) over 5 steps"
    with pytest.raises(SystemExit, match="no log_history.json"):
        main([str(tmp_path), str(tmp_path / "after")])


def test_a_run_logged_every_few_steps_is_compared_over_its_windows(tmp_path, capsys):
    """Every step logged against a line every 2 steps: each window's tokens over the seconds its steps took."""
    import pytest

    from benchmarks.step_ratio import compare

    speeds = {2: 90.0, 3: 100.0, 4: 300.0, 5: 200.0, 6: 200.0, 7: 50.0, 8: 50.0}
    depths = {2: 5, 3: 4, 4: 8, 5: 6, 6: 6, 7: 9, 8: 9}
    baseline = [{"step": s, "tokens_per_second": v, "depth": depths[s]} for s, v in speeds.items()]
    # steps 5-6 at 220 tokens/s (1.1x); 7-8 at 60 (1.2x) but sampled another mean depth: left out
    changed = [{"step": s, "tokens_per_second": v, "depth": d}
               for s, v, d in ((2, 80.0, 5.0), (4, 150.0, 6.0), (6, 220.0, 6.0), (8, 60.0, 8.0))]
    result = compare(baseline, changed, skip=4)
    assert result == pytest.approx({"median": 1.1, "low": 1.1, "high": 1.1, "steps": 2, "windows": 1})
    # steps 3-4 of the baseline: 2 tokens' worth over 1/100 + 1/300 s = 150 tokens/s, as the changed line's
    assert compare(baseline, changed, skip=2) == pytest.approx({"median": 1.05, "low": 1.0, "high": 1.1, "steps": 4,
                                                                "windows": 2})


def test_each_runs_output_is_kept_in_a_log_beside_its_row(tmp_path, capsys):
    """A run that fails (here on an optimizer the arguments refuse) leaves its whole output in train_PRESET.log, written
    line by line as it comes (what a run stopped by a time limit leaves too), and still passed through."""
    rows = bench_train.main(["--data_dir", str(tmp_path), "--presets", "debug", "--steps", "2",
                             "--output_dir", str(tmp_path / "out"), "--extra", "--optimizer", "sgd"])
    assert rows == [{"preset": "debug", "error": "exit code 1"}]
    log = (tmp_path / "out" / "train_debug.log").read_text()
    assert "--optimizer='sgd' is not allowed" in log and "Traceback" in log
    assert log.strip().splitlines()[-1] in capsys.readouterr().out


def test_a_run_with_a_deadline_stops_after_the_first_step_past_it_and_still_writes_its_log_history(
        tiny_data_dir, tmp_path, capsys):
    # The peer benchmark gives each run of ours a deadline inside its share (its evaluation and exit after it), so
    # that a slow start (a fresh machine's first compile) costs steps, not the run's figures.
    out = tmp_path / "debug"
    run_args = bench_train.run_arguments("debug", tiny_data_dir, str(out), steps=50, warmup=1, cap_gib=24)
    bench_train.child(None, [*run_args, "--use_cpu", "true"], deadline=0.0)
    history = json.loads((out / "log_history.json").read_text())
    assert [e["step"] for e in history if "loss" in e] == [1] and any("eval_loss" in e for e in history)
    assert bench_train.summarize("debug", str(out), 0)["last_step"] == 1
    assert "step 1: the benchmark's deadline has passed; training stops" in capsys.readouterr().out
