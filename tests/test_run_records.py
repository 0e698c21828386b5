"""A training run's logged peak as a calibration record (benchmarks/run_records.py), and the fit holding above it."""

import json
import os
from dataclasses import replace

import pytest

from benchmarks.run_records import main
from trainer_ext.memory.estimator import CALIBRATION_FILE, ModelShape, fit_calibration, record_time_features, \
    time_features
from trainer_ext.memory.probes import probe_recomputed, read_probes, steady_step_seconds, timed_depths
from trainer_ext.memory.plan import plan_for_preset

PROBES = os.path.join(os.path.dirname(__file__), os.pardir, "results", "memory-probes", "probes.jsonl")


def _log_entries(peaks, tokens_per_second):
    return [{"loss": "5.0", "step": step + 1, "peak_reserved_gib": f"{peak:.4g}",
             "peak_allocated_gib": f"{peak - 1:.4g}", "tokens_per_second": f"{tps:.4g}"}
            for step, (peak, tps) in enumerate(zip(peaks, tokens_per_second))]


def _record(tmp_path, log_path, *extra):
    output = tmp_path / "runs.jsonl"
    assert main(["--preset", "recurrent-3.3b", "--vocab_size", "99520", "--distill_topk", "64", "--calibration",
                 CALIBRATION_FILE, "--log", str(log_path), "--output", str(output), *extra]) == 0
    return [json.loads(line) for line in output.read_text().splitlines()]


def test_a_run_record_carries_the_runs_plan_and_its_largest_logged_peak(tmp_path):
    # A log without a plan file beside it: a run from before plan files recorded their placements (keep or recompute,
    # which the record must be told), under a 22 GiB cap (where the plan recomputes some layers).
    plan = plan_for_preset("recurrent-3.3b", 2048, 22.0, None, distill_topk=64, vocab_size=99520,
                           placements="recompute")
    entries = _log_entries([18.4, 22.68, 22.5], [6017.0, 13890.0, 14000.0])
    history = tmp_path / "log_history.json"
    history.write_text(json.dumps(entries + [{"train_runtime": "31.0", "step": 3}]))
    console = tmp_path / "console.log"  # the trainer's console lines: one Python dict per line
    console.write_text("Memory plan: ...\n" + "\n".join(repr(e) for e in entries) + "\n")
    batch = plan.per_device_train_batch_size
    with pytest.raises(SystemExit, match="--memory_placements"):  # a log alone does not say which placements
        _record(tmp_path, history, "--batch_size", str(batch), "--cap_gib", "22")
    keep_or_recompute = ("--memory_placements", "recompute")
    (record,) = _record(tmp_path, history, "--batch_size", str(batch), "--cap_gib", "22", *keep_or_recompute)
    assert record["batch_size"] == batch and record["recompute_set"] == plan.recompute.to_dict()
    assert record["distill_topk"] == 64 and record["config"]["vocab_size"] == 99520 and record["status"] == "ok"
    assert record["peak_reserved_bytes"] == int((22.68 + 0.005) * 2**30)  # the largest, rounded up
    assert record["step_seconds"] == [round(batch * 2048 / tps, 5) for tps in (6017.0, 13890.0, 14000.0)]
    assert ModelShape.from_record(record).vocab_size == 99520 and probe_recomputed(record) >= 1
    again = _record(tmp_path, console, "--cap_gib", "22", *keep_or_recompute)[-1]
    assert {k: v for k, v in again.items() if k != "log"} == {k: v for k, v in record.items() if k != "log"}
    # A run whose plan file records its placements (the default's, with selective recomputation) gets that plan.
    selective = plan_for_preset("recurrent-3.3b", 2048, 22.0, None, distill_topk=64, vocab_size=99520)
    assert selective.recompute != plan.recompute and selective.placements == "selective"
    run = tmp_path / "run"
    run.mkdir()
    (run / "memory_plan.json").write_text(json.dumps({"placements": "selective", "vocab_size": 99520}))
    (run / "log_history.json").write_text(history.read_text())
    recorded = _record(tmp_path, run / "log_history.json", "--cap_gib", "22")[-1]
    assert recorded["recompute_set"] == selective.recompute.to_dict()


def test_a_run_is_timed_at_the_depths_it_sampled(tmp_path):
    """A record keeps each timed step's sampled depth; the fit times it at their mean (each step's features at its
    depth, fewer graph-building core steps below the backprop depth), a probe at its config's mean depth."""
    entries = [{**e, "depth": f"{d}.0"} for e, d in zip(_log_entries([20.0] * 5, [9000.0, 8000.0, 16000.0, 12000.0,
                                                                                     10000.0]), (12, 15, 2, 9, 12))]
    history = tmp_path / "log_history.json"
    history.write_text(json.dumps(entries))
    (record,) = _record(tmp_path, history, "--memory_placements", "recompute")
    assert record["depths"] == [12, 15, 2, 9, 12] and timed_depths(record) == [2, 9, 12]  # compiled: two warm-up steps
    assert steady_step_seconds(record) == pytest.approx(sum(record["step_seconds"][2:]) / 3)  # the mean, not median
    shape = ModelShape.from_record(record)
    assert (shape.num_steps, shape.graph_steps) == (12, 4)
    record["recompute_set"] = {"prelude": [0], "core_steps": [0, 1, 2, 3], "coda": []}  # every graph step recomputed
    assert (probe_recomputed(record, 2), probe_recomputed(record)) == (1 + 2 * 2, 1 + 2 * 4)  # two core layers
    at = lambda depth, graph_steps: time_features(replace(shape, num_steps=depth, graph_steps=graph_steps),
                                                  record["batch_size"], 2048, probe_recomputed(record, graph_steps))
    expected = (at(2, 2) + at(9, 4) + at(12, 4)) / 3
    assert record_time_features(shape, record) == pytest.approx(expected)
    probe = {**record, "depths": None}  # a probe: every step at the mean depth, the median of its steps
    assert record_time_features(shape, probe) == pytest.approx(
        time_features(shape, record["batch_size"], 2048, probe_recomputed(record)))
    assert steady_step_seconds(probe) == pytest.approx(sorted(record["step_seconds"][2:])[1])


def test_a_run_planned_with_another_calibration_is_refused(tmp_path):
    history = tmp_path / "log_history.json"
    history.write_text(json.dumps(_log_entries([20.0, 20.0], [1000.0, 1000.0])))
    with pytest.raises(SystemExit, match="--calibration .* plans batch .* --batch_size 64"):
        _record(tmp_path, history, "--batch_size", "64", "--memory_placements", "recompute")
    history.write_text(json.dumps(_log_entries([20.0], [1000.0])))
    with pytest.raises(SystemExit, match="2 steps"):
        _record(tmp_path, history, "--memory_placements", "recompute")
    history.write_text(json.dumps([{"loss": "5.0", "step": 1}]))
    with pytest.raises(SystemExit, match="no peak_reserved_gib"):
        _record(tmp_path, history, "--memory_placements", "recompute")


def test_the_fit_bounds_a_training_run_above_its_probes(tmp_path):
    """A run that peaks 0.3 GiB above what the fit without it predicts for its plan: with its record in the fit, its
    plan is predicted at or above the run's peak (the plans hold in training, not only on probes)."""
    probes = read_probes(PROBES)
    probes = [p for p in probes if p.get("source") != "training run"]
    without = fit_calibration(probes, leave_one_out=False)
    plan = plan_for_preset("recurrent-3.3b", 2048, 24.0, None, distill_topk=64, vocab_size=99520,
                           placements="recompute")
    history = tmp_path / "log_history.json"
    history.write_text(json.dumps(_log_entries([1.0, 1.0, 1.0], [1000.0, 1000.0, 1000.0])))
    (record,) = _record(tmp_path, history, "--memory_placements", "recompute")  # the fit's placements
    shape = ModelShape.from_record(record)
    args = (shape, record["batch_size"], 2048, probe_recomputed(record), 64, True)
    record["peak_reserved_bytes"] = int(without.peak_bytes(*args) + 0.3 * 2**30)
    assert record["batch_size"] == plan.per_device_train_batch_size
    with_run = fit_calibration(probes + [record], leave_one_out=False)
    assert with_run.peak_bytes(*args) >= record["peak_reserved_bytes"] - 1  # at it, within the LP's tolerance
    assert without.peak_bytes(*args) < record["peak_reserved_bytes"]


def test_the_runs_vocabulary_comes_from_its_plan_file(tmp_path):
    """A run on other data trains a head of its tokenizer's size: the record takes it from memory_plan.json beside
    the log, refuses a --vocab_size that disagrees, and asks for one where no plan file says it."""
    plan = plan_for_preset("recurrent-3.3b", 2048, 24.0, None, vocab_size=59296)
    assert plan.to_dict()["vocab_size"] == 59328  # padded to a multiple of 64
    run = tmp_path / "run"
    run.mkdir()
    history = run / "log_history.json"
    history.write_text(json.dumps(_log_entries([20.0, 20.0], [1000.0, 1000.0])))
    output = tmp_path / "runs.jsonl"
    base = ["--preset", "recurrent-3.3b", "--calibration", CALIBRATION_FILE, "--log", str(history),
            "--output", str(output)]
    with pytest.raises(SystemExit, match="give --vocab_size"):
        main(base)
    (run / "memory_plan.json").write_text(json.dumps(plan.to_dict()))
    with pytest.raises(SystemExit, match="says 59328"):
        main(base + ["--vocab_size", "65536"])
    assert main(base + ["--batch_size", str(plan.per_device_train_batch_size)]) == 0
    record = json.loads(output.read_text())
    assert record["vocab_size"] == record["config"]["vocab_size"] == 59328
    assert ModelShape.from_record(record).vocab_size == 59328


def test_the_runs_momentum_is_checked_against_its_plan_file(tmp_path):
    """A run trained with momentum other than the default's (full momentum for recurrent-3.3b, as before the default
    changed) holds another optimizer state: its record takes --optimizer_momentum_rank_fraction, and a plan file whose
    optimizer state disagrees with the one given (or the default's) is refused."""
    full = plan_for_preset("recurrent-3.3b", 2048, 24.0, None, vocab_size=59296, rank_fraction=1.0)
    default = plan_for_preset("recurrent-3.3b", 2048, 24.0, None, vocab_size=59296)
    assert full.fixed_gib["optimizer_state"] > default.fixed_gib["optimizer_state"] + 5  # full momentum's 6 GiB
    run = tmp_path / "run"
    run.mkdir()
    history = run / "log_history.json"
    history.write_text(json.dumps(_log_entries([21.0, 21.2], [15000.0, 15500.0])))
    (run / "memory_plan.json").write_text(json.dumps(full.to_dict()))
    output = tmp_path / "runs.jsonl"
    base = ["--preset", "recurrent-3.3b", "--calibration", CALIBRATION_FILE, "--log", str(history),
            "--output", str(output)]
    with pytest.raises(SystemExit, match=r"optimizer state \(.* GiB, its memory_plan.json\).*give the fraction"):
        main(base)
    assert main(base + ["--optimizer_momentum_rank_fraction", "1", "--batch_size",
                        str(full.per_device_train_batch_size)]) == 0
    record = json.loads(output.read_text())
    assert record["batch_size"] == full.per_device_train_batch_size
    assert record["optimizer_state_bytes"] / 2**30 == pytest.approx(full.fixed_gib["optimizer_state"], abs=1e-3)
