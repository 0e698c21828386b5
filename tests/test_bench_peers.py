"""The peer benchmark's arithmetic and reporting (benchmarks/bench_peers.py), from synthetic run records."""

import importlib.util
import json
import pathlib

import pytest

PATH = pathlib.Path(__file__).resolve().parent.parent / "benchmarks" / "bench_peers.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_peers", PATH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_mfu_ratio_is_like_for_like_against_the_measured_peak_and_the_table_says_so(bench):
    records = [
        {"run": "peak", "peak_flops": 800e12},
        {"run": "peer-a", "label": "GaLore", "batch_size": 4, "tokens_per_second": 10_000.0,
         "flops_per_token": 41e9, "flops_per_token_6n": 40e9, "peak_reserved_gib": 18.5},
        # ours: the trainer's FLOPs per token, as _ours derives them from its MFU logged against 780e12
        {"run": "recurrent-3.3b", "tokens_per_second": 8_000.0, "mfu_logged": 0.6, "trainer_peak_flops": 780e12,
         "flops_per_token": 0.6 * 780e12 / 8_000.0},
        {"run": "recurrent-7b", "error": "OOM, exit code 1 (log: x)"},
        {"run": "peer-b", "skipped": "skipped: bitsandbytes not installed (pip install bitsandbytes)"},
    ]
    bench.add_mfu(records, 800e12)
    peer, ours = records[1], records[2]
    assert peer["mfu"] == pytest.approx(41e9 * 10_000 / 800e12, abs=1e-4)  # 0.5125
    assert peer["mfu_6n"] == pytest.approx(0.5, abs=1e-4)
    assert ours["mfu"] == pytest.approx(0.6 * 780 / 800, abs=1e-4) and "mfu_6n" not in ours  # 0.585
    summary = bench.summarize_ratios(records, ["recurrent-3.3b", "recurrent-7b"])
    assert summary["recurrent-3.3b"] == {"ratio": round(0.585 / 0.5125, 3), "ratio_vs_mfu_6n": 1.17,
                                         "meets_bar": False}  # 1.141 < 1.2
    assert summary["recurrent-7b"] == {"ratio": None, "why": "no MFU for recurrent-7b"}
    # as main() adds it after the precompiles: seconds, or why there are none
    summary["precompiled"] = {"recurrent-3.3b": 50.5, "recurrent-7b": "exit code 1"}
    text = bench.table(records, summary)
    assert "compiled during peer A's first step (untimed): recurrent-3.3b 50.5 s, recurrent-7b exit code 1" in text
    assert "| recurrent-7b: recurrent-7b | - | OOM, exit code 1 (log: x) |" in text
    assert "| peer-a: GaLore | 4 | 10,000 | 18.5 | 51.2% | 50.0% | - |" in text
    assert "recurrent-3.3b / peer-a MFU: 1.141x like for like, 1.170x against its 6N MFU; the bar: >= 1.2x (not met)" \
        in text
    assert "pip install bitsandbytes" in text
    # no peer A: no ratio, and why
    assert bench.summarize_ratios(records[2:], ["recurrent-3.3b"])["recurrent-3.3b"]["why"] == "no MFU for peer-a"


def test_a_missing_optional_package_is_a_skip_naming_its_install(bench, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "liger_kernel" else real(name))
    assert bench.missing_package(["json", "liger_kernel"]) == \
        "skipped: liger-kernel==0.8.5 not installed (pip install liger-kernel==0.8.5)"
    assert bench.missing_package(["json"]) is None


def test_a_peer_with_only_warm_up_steps_reports_no_speed(bench, tmp_path):
    """GaLore's first step is its SVD of every projection: a run cut off before the warm-up is over must not report
    that step's time as its speed (it would make any ratio against it meaningless)."""
    import json
    import time

    for steps, expect_speed in ((2, False), (5, True)):
        out = tmp_path / f"peer-{steps}.json"
        bench.peer_child("peer-b", "cpu", None, 1, 16, steps, 3, time.time() + 600, str(out))
        record = json.loads(out.read_text())
        assert record["steps"] == steps
        assert ("tokens_per_second" in record) == expect_speed
        assert ("only 2 step(s) of which 3 are warm-up" in record.get("error", "")) == (not expect_speed)


def test_a_peer_started_aside_is_collected_with_its_record(bench, tmp_path):
    """The path a machine with several GPUs takes for peer A (started on its own GPU, collected at the end)."""
    import argparse

    args = argparse.Namespace(output_dir=str(tmp_path), device="cpu", cap_gib=None, peer_batch_size=1, steps=4,
                              warmup=2)
    process = bench._start_peer("peer-b", args, 16, 300)
    record = bench._collect("peer-b", args, process, 300)
    assert record["run"] == "peer-b" and record["steps"] == 4 and record["tokens_per_second"] > 0
    stuck = bench._start("import time; time.sleep(60)", str(tmp_path / "stuck.log"))
    assert bench._collect("stuck", args, stuck, 1)["error"] == "timeout after 1 s (raise --max_seconds)"


def test_a_call_without_our_presets_prints_no_ratio_for_them(bench, tmp_path, capsys):
    # `--runs peak peer-b` measures the peer alone: no "n/a" ratio lines for presets that did not run.
    records = bench.main(["--device", "cpu", "--runs", "peak", "--steps", "4", "--max_seconds", "120",
                          "--output_dir", str(tmp_path)])
    summary = records[-1]
    assert summary["run"] == "summary" and not any(key.startswith("recurrent") or key == "debug" for key in summary)
    out = capsys.readouterr().out
    assert "/ peer-a" not in out
    # The peak is measured at the call's start and again at its end, and MFU is against the larger: a fresh machine's
    # card measured 670.5 TFLOP/s in a call's first seconds and 695.2 ten minutes later.
    assert [r["run"] for r in records] == ["peak", "peak-end", "summary"]
    peaks = {r["run"]: r["peak_flops"] for r in records[:2]}
    assert dict(summary["peaks_measured"]) == peaks and summary["peak_flops"] == max(peaks.values())
    assert f"MFU against {max(peaks.values()) / 1e12:.1f} TFLOP/s (peak " in out
    assert json.loads((tmp_path / "peak-end.json").read_text())["run"] == "peak-end"


def test_peer_as_first_step_has_a_budget_of_its_own_so_one_call_measures_every_run(bench):
    """GaLore's SVD took 242-247 s on H200s; with it inside peer A's share, a 540 s call gave peer A 2 steps and no
    figure. Its own budget on top of the share leaves every run of the default call the time it needs."""
    runs = ["peak", "peer-a", "recurrent-3.3b", "recurrent-7b", "peer-b"]
    # seconds each run took on an H200: peer A's start, SVD step and 11 steps; ours start, compile and 12 steps
    needed = {"peak": 15, "peer-a": 20 + 247 + 11 * 0.84, "recurrent-3.3b": 60, "recurrent-7b": 60, "peer-b": 45}
    first_step = {"peer-a": bench.PEER_A_FIRST_STEP_SECONDS}
    left = 540.0
    for index, run in enumerate(runs):
        timeout = bench.run_timeout(runs, index, left, first_step)
        assert timeout >= needed[run] + (10 if run.startswith("peer") else 0), run  # peers stop 10 s before it
        left -= needed[run]
    assert left > 0
    # Shares alone (the SVD inside peer A's share) leave it far less than its first step.
    assert bench.run_timeout(runs, 1, 525.0, {}) < 247
    # A run that finishes early leaves its time to the runs after it; none is left with a negative budget.
    assert bench.run_timeout(runs, 2, 100.0, first_step) == pytest.approx(100 * 0.28 / 0.70)  # 3.3b of 3.3b, 7b, B
    assert bench.run_timeout(runs, 1, 100.0, first_step) == bench.PEER_A_FIRST_STEP_SECONDS
    # A shorter call still measures the peak: with a budget of its own it is not left under the 20 s a run needs.
    assert bench.run_timeout(runs, 0, 470.0, first_step) < 20
    with_peak = {**first_step, "peak": bench.PEAK_SECONDS}
    assert bench.run_timeout(runs, 0, 470.0, with_peak) >= max(20, needed["peak"])


def test_the_first_step_is_recorded_apart_and_the_peak_is_the_profiles_matmul_rate(bench, tmp_path):
    import json
    import time

    out = tmp_path / "peer.json"
    bench.peer_child("peer-b", "cpu", None, 1, 16, 5, 3, time.time() + 600, str(out))
    record = json.loads(out.read_text())
    assert record["first_step_seconds"] > 0 and "tokens_per_second" in record
    bench.peak_child("cpu", 64, str(tmp_path / "peak.json"), samples=2, per_sample=1)
    peak = json.loads((tmp_path / "peak.json").read_text())
    assert peak["run"] == "peak" and peak["peak_flops"] > 0 and peak["matmul_size"] == 64


def test_a_dry_run_reserves_no_first_step_budget_for_a_peer_that_is_skipped(bench, tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None if name == "galore_torch" else real(name))
    seen = []
    monkeypatch.setattr(bench, "run_timeout", lambda runs, index, left, first_step: seen.append(first_step) or 60.0)
    records = bench.main(["--device", "cpu", "--runs", "peer-a", "--steps", "4", "--max_seconds", "120",
                          "--peer_a_first_step_seconds", "300", "--output_dir", str(tmp_path)])
    assert records[0]["skipped"] == "skipped: galore-torch not installed (pip install galore-torch)"
    assert seen == [{}]


def test_a_run_of_ours_stopped_after_its_log_history_keeps_its_figures_and_a_stale_one_does_not(bench, tmp_path,
                                                                                                 monkeypatch):
    # A fresh machine's first compile made recurrent-3.3b's run outlast its share on its way out, after it had
    # trained and written its log history: its figures are kept, marked. A log history older than the run is not its.
    import argparse
    import os
    import time

    args = argparse.Namespace(output_dir=str(tmp_path), data_dir=str(tmp_path / "data"), steps=12, warmup=2,
                              cap_gib=24.0, log_every=4, trainer_peak_flops=780e12, device="cuda")
    history = [{"loss": 9.0 - step / 10, "tokens_per_second": 17000.0 + step, "mfu": 0.70, "depth": 8.0,
                "peak_reserved_gib": 22.2, "step": step} for step in (4, 8, 12)]
    out_dir = tmp_path / "recurrent-3.3b"
    out_dir.mkdir()

    def stopped_on_its_way_out():
        (out_dir / "log_history.json").write_text(json.dumps(history))
        return "timeout after 74 s (raise --max_seconds)"

    codes = []
    monkeypatch.setattr(bench, "_run", lambda code, timeout, log_path: codes.append(code) or stopped_on_its_way_out())
    started = time.time()
    record = bench._ours("recurrent-3.3b", args, 74.0)
    assert record["tokens_per_second"] == 17010.0 and record["peak_reserved_gib"] == 22.2
    assert record["stopped"] == "timeout after 74 s (raise --max_seconds), after its log history was written"
    assert "error" not in record and record["flops_per_token"] == pytest.approx(0.70 * 780e12 / 17010.0)
    # The child stops training after the first step past its share less the time its evaluation and exit take.
    deadline = float(codes[0].split("deadline=")[1].rstrip(")"))
    assert started + 74.0 - bench.OURS_EXIT_SECONDS <= deadline <= time.time() + 74.0 - bench.OURS_EXIT_SECONDS
    assert "time_boxed" not in record  # it ran its 12 steps
    args.steps = 21
    assert bench._ours("recurrent-3.3b", args, 74.0)["time_boxed"] is True

    os.utime(out_dir / "log_history.json", (0, 0))  # an earlier run's, left in the output folder
    monkeypatch.setattr(bench, "_run", lambda code, timeout, log_path: "timeout after 74 s (raise --max_seconds)")
    assert bench._ours("recurrent-3.3b", args, 74.0) == {"run": "recurrent-3.3b", "label": "recurrent-3.3b, defaults",
                                                         "error": "timeout after 74 s (raise --max_seconds)"}


def test_a_precompile_stops_when_peer_as_first_step_is_done_and_the_next_is_not_started(bench, tmp_path, monkeypatch):
    """Our presets compile while peer A's first step runs, never beside a timed step: the running precompile is
    ended as soon as peer A's log shows its first step, and the presets after it are not started."""
    import subprocess
    import sys
    import threading
    import time
    from types import SimpleNamespace

    started = []

    def start(code, log_path, gpu=None):  # a precompile that would train far longer than the peer's first step
        started.append(log_path)
        return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)

    monkeypatch.setattr(bench, "_start", start)
    peer_log = tmp_path / "peer-a.log"
    peer_log.write_text("loading\n")
    threading.Timer(1.0, lambda: peer_log.write_text("loading\nstep 1: 1.00 s\n")).start()
    args = SimpleNamespace(output_dir=str(tmp_path), data_dir=None, warmup=3, log_every=4, cap_gib=24.0,
                           trainer_peak_flops=1e12, device="cpu")
    begin = time.time()
    done = bench.precompile(["recurrent-3.3b", "recurrent-7b"], args, str(peer_log), time.time() + 30)
    assert time.time() - begin < 10  # stopped at the line, not at `until` or the sleep's end
    assert done["recurrent-3.3b"].startswith("stopped after") and done["recurrent-7b"].startswith("not run")
    assert len(started) == 1 and bench.first_step_done(str(peer_log))


def test_a_precompile_that_finishes_is_timed_and_needs_a_card_for_two_capped_processes(bench, tmp_path, monkeypatch):
    import subprocess
    import sys
    from types import SimpleNamespace

    codes = []

    def start(code, log_path, gpu=None):
        codes.append(code)
        return subprocess.Popen([sys.executable, "-c", "pass"], start_new_session=True)

    monkeypatch.setattr(bench, "_start", start)
    args = SimpleNamespace(output_dir=str(tmp_path), data_dir="data", warmup=3, log_every=4, cap_gib=24.0,
                           trainer_peak_flops=780e12, device="cuda")
    done = bench.precompile(["recurrent-3.3b"], args, str(tmp_path / "missing.log"), float("inf"))
    assert isinstance(done["recurrent-3.3b"], float) and not bench.first_step_done(str(tmp_path / "missing.log"))
    # the same training as the timed run (the defaults under the cap, bf16), a few steps, no deadline
    assert f"'--max_steps', '{bench.PRECOMPILE_STEPS}'" in codes[0] and "'--memory_cap_gib', '24.0'" in codes[0]
    assert "'--bf16', 'true'" in codes[0] and "deadline=None" in codes[0]
    assert bench.can_precompile(80 * 2**30, 24.0) and not bench.can_precompile(24 * 2**30, 24.0)
