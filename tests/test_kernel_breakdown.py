"""The step breakdown by kernel kind (benchmarks/kernel_breakdown.py) and the plan verification that reports it."""

import gzip
import json
import os
import re

import pytest

from benchmarks.kernel_breakdown import breakdown_from_trace, category, main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_a_trace_is_summed_by_kind_and_the_gpu_idle_time_is_what_no_kernel_covers():
    kernels = [  # (name, start us, duration us); the attention kernel overlaps the first product
        ("sm90_xmma_gemm_bf16bf16_bf16f32", 0, 400), ("flash_fwd_kernel", 300, 200), ("_ce_kernel", 600, 100),
        ("_apply_kernel", 800, 50), ("triton_per_fused_mul_rsqrt_0", 900, 20),
        ("void at::native::vectorized_elementwise_kernel", 950, 10)]
    events = [{"cat": "kernel", "name": name, "ts": ts, "dur": dur} for name, ts, dur in kernels]
    events += [{"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 980, "dur": 10},
               {"cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 5000}]  # host events are not GPU time
    result = breakdown_from_trace({"traceEvents": events}, wall_seconds=2000e-6, steps=2)
    per_step = result["kernel_seconds_per_step"]
    assert per_step["matmul"] == pytest.approx(200e-6) and per_step["attention"] == pytest.approx(100e-6)
    assert per_step["loss_kernels"] == pytest.approx(50e-6) and per_step["optimizer_kernels"] == pytest.approx(25e-6)
    assert per_step["compiled_elementwise"] == pytest.approx(10e-6) and per_step["other"] == pytest.approx(5e-6)
    assert per_step["copies"] == pytest.approx(5e-6)
    busy = 500 + 100 + 50 + 20 + 10 + 10  # the union: 0-500, 600-700, 800-850, 900-920, 950-960, 980-990
    assert result["shares"]["idle"] == pytest.approx(1 - busy / 2000)
    assert result["step_seconds"] == pytest.approx(1000e-6)
    assert result["overlapped_seconds_per_step"] == pytest.approx(50e-6)  # 300-400 us ran twice: 100 us in 2 steps
    # Gaps of 50 us or more, by the kernels around them (the kernel that ended last before each: attention, not the
    # product it overlaps)
    gaps = {g["between"]: g for g in result["idle_gaps"]}
    assert set(gaps) == {"attention -> loss_kernels", "loss_kernels -> optimizer_kernels",
                         "optimizer_kernels -> compiled_elementwise"}
    assert gaps["attention -> loss_kernels"]["seconds_per_step"] == pytest.approx(50e-6)
    assert gaps["attention -> loss_kernels"]["per_step"] == pytest.approx(0.5)
    assert gaps["attention -> loss_kernels"]["longest"] == {"micros": 100.0, "before": "flash_fwd_kernel",
                                                            "after": "_ce_kernel"}
    assert [g["between"] for g in result["idle_gaps"]][-1] == "optimizer_kernels -> compiled_elementwise"
    # The kernels outside the products that take the most time, by name, longest first
    top = result["top_kernels"]
    assert [(k["kind"], k["name"]) for k in top[:3]] == [("attention", "flash_fwd_kernel"),
                                                         ("loss_kernels", "_ce_kernel"),
                                                         ("optimizer_kernels", "_apply_kernel")]
    assert top[0]["seconds_per_step"] == pytest.approx(100e-6) and "matmul" not in {k["kind"] for k in top}


def test_the_host_events_overlapping_the_long_gaps_are_summed_by_name():
    """What the host ran while the GPU idled: only gaps of HOST_GAP_US or more, only the stretch inside each gap."""
    kernels = [("gemm_a", 0, 100), ("gemm_b", 1100, 100), ("gemm_c", 1300, 100), ("gemm_d", 3400, 100)]
    events = [{"cat": "kernel", "name": name, "ts": ts, "dur": dur} for name, ts, dur in kernels]
    events += [  # gaps: 100-1100 (1000 us), 1200-1300 (100 us: too short), 1400-3400 (2000 us)
        {"cat": "user_annotation", "name": "next batch", "ts": 50, "dur": 550},  # 500 us inside the first gap
        {"cat": "cpu_op", "name": "aten::copy_", "ts": 900, "dur": 1400},  # 200 + 900 us in both gaps
        {"cat": "cpu_op", "name": "aten::add", "ts": 1210, "dur": 80},  # only in the short gap: not counted
        {"cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 2500, "dur": 2000}]  # 900 us
    result = breakdown_from_trace({"traceEvents": events}, wall_seconds=3500e-6, steps=1)
    host = {h["name"]: h["seconds_per_step"] for h in result["host_in_gaps"]}
    assert host == pytest.approx({"aten::copy_": 1100e-6, "cudaStreamSynchronize": 900e-6, "next batch": 500e-6})
    assert [h["name"] for h in result["host_in_gaps"]] == ["aten::copy_", "cudaStreamSynchronize", "next batch"]
    assert "host_in_gaps" not in breakdown_from_trace({"traceEvents": events[:4]}, 3500e-6, 1)


def test_the_idle_time_is_split_by_whether_the_host_launched_late():
    """Gap before an operation launched after the GPU ran dry: the host's; before one queued earlier: the device's."""
    ops = [("gemm_a", 0, 100, 1), ("gemm_b", 103, 100, 2), ("Memset (Device)", 300, 10, 3),
           ("_apply_kernel", 312, 8, 4)]
    events = [{"cat": "gpu_memset" if name.startswith("Memset") else "kernel", "name": name, "ts": ts, "dur": dur,
               "args": {"correlation": c}} for name, ts, dur, c in ops]
    # launches: b queued during a (3 us gap: the device's), the memset launched at 280 after b ended at 203 (97 us:
    # the host's), the apply queued at 290 (2 us: the device's)
    events += [{"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 5, "args": {"correlation": c}}
               for ts, c in ((-10, 1), (50, 2), (280, 3), (290, 4))]
    split = breakdown_from_trace({"traceEvents": events}, wall_seconds=320e-6, steps=2)["idle_by_launch"]
    assert split["host_late_seconds_per_step"] == pytest.approx(97e-6 / 2)
    assert split["queued_seconds_per_step"] == pytest.approx(5e-6 / 2)
    assert split["operations_per_step"] == 2.0
    assert "idle_by_launch" not in breakdown_from_trace({"traceEvents": events[:4]}, 320e-6, 2)


def test_the_gpu_time_is_split_by_the_part_of_the_step_that_launched_it(tmp_path):
    """Forward on the training's thread; on autograd's thread backward, a compiled forward run again (recompute) and
    what a gradient's accumulation launched (the in-backward update); copies between host and device apart."""
    ops = [  # (category, name, start us, duration us, correlation)
        ("kernel", "gemm_fwd", 0, 100, 1), ("kernel", "triton_recomputed", 100, 40, 3),
        ("kernel", "gemm_bwd", 140, 200, 2), ("kernel", "_apply_kernel", 340, 30, 4),
        ("kernel", "triton_compiled_fwd", 400, 20, 5), ("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 420, 10, 6),
        ("gpu_memset", "Memset (Device)", 430, 5, 8), ("kernel", "no_launch_recorded", 450, 10, 7)]
    events = [{"cat": cat, "name": name, "ts": ts, "dur": dur, "args": {"correlation": c}}
              for cat, name, ts, dur, c in ops]
    host = [  # (thread, name, start, duration): thread 2 is autograd's (it runs autograd::engine functions)
        (2, "autograd::engine::evaluate_function: CompiledFunctionBackward", 5, 40),
        (2, "CompiledFunctionBackward", 6, 30), (2, "CompiledFunction", 10, 10),  # the recompute inside backward
        (2, "autograd::engine::evaluate_function: torch::autograd::AccumulateGrad", 50, 10),
        (1, "Torch-Compiled Region: 0/0", 60, 10), (1, "CompiledFunction", 61, 8)]
    events += [{"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "tid": tid} for tid, name, ts, dur in host]
    launches = ((1, -10, 1), (2, 12, 3), (2, 30, 2), (2, 55, 4), (1, 65, 5), (1, 66, 6), (2, 70, 8))
    events += [{"cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 1, "tid": tid,
                "args": {"correlation": c}} for tid, ts, c in launches]
    result = breakdown_from_trace({"traceEvents": events}, wall_seconds=1000e-6, steps=2)
    phases = result["phases"]
    assert phases == pytest.approx({"forward": 120e-6 / 2, "recompute": 40e-6 / 2, "backward": 205e-6 / 2,
                                    "optimizer": 30e-6 / 2, "transfers": 10e-6 / 2, "unknown": 10e-6 / 2,
                                    "idle": (1000 - 415) * 1e-6 / 2})  # busy: 0-370, 400-435, 450-460
    assert result["phase_operations_per_step"] == {"forward": 1.0, "recompute": 0.5, "backward": 1.0,
                                                   "optimizer": 0.5, "transfers": 0.5, "unknown": 0.5}
    kinds = result["phase_kinds"]
    assert kinds["backward"] == pytest.approx({"matmul": 100e-6, "copies": 2.5e-6})  # the product and the memset
    assert kinds["forward"] == pytest.approx({"matmul": 50e-6, "compiled_elementwise": 10e-6})
    assert kinds["optimizer"] == pytest.approx({"optimizer_kernels": 15e-6})
    assert "phases" not in breakdown_from_trace({"traceEvents": events[:len(ops)]}, 1000e-6, 2)
    # A written profile broken down again from the trace beside it (its wall time from the profile)
    (tmp_path / "profile.json").write_text(json.dumps({"step_seconds": 500e-6, "steps": 2}))
    with gzip.open(tmp_path / "profile.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)
    main([str(tmp_path / "profile.json"), "--output", str(tmp_path / "again.json")])
    assert json.loads((tmp_path / "again.json").read_text())["phases"] == pytest.approx(phases)


def test_a_profile_of_some_steps_is_written_with_its_tables(tmp_path):
    """KernelProfile from start_step to stop_step, host operations included, written as JSON, tables and the trace."""
    import torch
    from types import SimpleNamespace

    from benchmarks.kernel_breakdown import KernelProfile

    path = tmp_path / "profile.json"
    profile = KernelProfile(start_step=1, stop_step=3, host=True, path=str(path))
    x = torch.randn(64, 64)
    for step in range(5):
        state = SimpleNamespace(global_step=step)
        profile.on_step_begin(None, state, None)
        x = torch.tanh(x @ x)
        profile.on_step_end(None, SimpleNamespace(global_step=step + 1), None)
    profile.on_train_end(None, state, None)
    assert profile.result["steps"] == 2  # steps 2 and 3 (global_step 1 -> 3), not the ones after
    assert json.loads(path.read_text()) == profile.result
    assert "aten::mm" in (tmp_path / "profile.txt").read_text()
    with gzip.open(tmp_path / "profile.trace.json.gz") as f:
        names = {event.get("name") for event in json.load(f)["traceEvents"]}
    assert "aten::mm" in names and "aten::tanh" in names


def test_every_triton_kernel_of_ours_has_its_kind():
    """A kernel added to the loss or the optimizer without a pattern would be counted as `other`."""
    expected = {"trainer_ext/distill/ce_triton.py": "loss_kernels", "trainer_ext/distill/kd_triton.py": "loss_kernels",
                "trainer_ext/optim/triton_kernels.py": "optimizer_kernels"}
    for path, kind in expected.items():
        with open(os.path.join(REPO, path)) as f:
            names = re.findall(r"^def (_\w+_kernel)\(", f.read(), flags=re.M)
        assert names, path
        assert {name: category(name) for name in names} == {name: kind for name in names}


def test_verify_plans_a_cached_teacher_at_each_vocabulary_and_length_and_breaks_the_steps_down(tmp_path, capsys):
    """memory_probe --verify --only_distill_probes on CPU (a dry run of the GPU path): one plan per vocabulary and
    sequence length, trained with the cache's top-k at that head, each with its breakdown and FLOPs ratio."""
    from benchmarks.memory_probe import main

    output = tmp_path / "verify.jsonl"
    # Under 1.7 GiB (0.3 after the margin) no batch fits seq 65,536 (batch 1 is predicted at about 0.6 GiB): one
    # "no plan" row per vocabulary naming the fix, said while planning, and the shapes with a plan are still trained.
    assert main(["--verify", "--presets", "debug", "--device", "cpu", "--cap_gib", "1.7", "--only_distill_probes",
                 "--vocab_sizes", "512", "1024", "--seq_lens", "32", "65536", "64", "--breakdown", "--max_batch_size",
                 "2", "--steps", "3", "--compile_steps", "3", "--output", str(output)]) == 0
    lines = capsys.readouterr().out.splitlines()
    rows = [json.loads(line) for line in lines if line.startswith('{"preset": "debug", "vocab')]
    no_plan, rows = rows[:2], rows[2:]
    assert [(r["vocab_size"], r["seq_len"], r["status"]) for r in no_plan] == [(512, 65536, "no plan"),
                                                                               (1024, 65536, "no plan")]
    assert all("Raise the cap" in r["error"] for r in no_plan)
    assert [(r["vocab_size"], r["seq_len"]) for r in rows] == [(512, 32), (512, 64), (1024, 32), (1024, 64)]
    assert all(r["status"] == "ok" and r["distill_topk"] == 64 and r["flops_ratio"] >= 1 for r in rows)
    assert all(r["kernel_breakdown"]["steps"] >= 1 for r in rows)
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert [r["config"]["vocab_size"] for r in records] == [512, 512, 1024, 1024]
