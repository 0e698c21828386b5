"""What is live at a step's peak (benchmarks/peak_memory.py): the replay of an allocator trace."""

import pytest
import torch

from benchmarks.peak_memory import GIB, peak_composition, site

MIB = 2**20
LOSS = [{"filename": "/site-packages/trainer_ext/distill/losses.py", "line": 251, "name": "_forward_and_grads"}]
LAYER = [{"filename": "/tmp/torchinductor_root/ab/cab.py", "line": 90, "name": "call"},
         {"filename": "/repo/hf_recurrent/modeling_recurrent_depth.py", "line": 300, "name": "forward"}]


def _event(action, addr, size, frames=()):
    return {"action": action, "addr": addr, "size": size, "frames": list(frames)}


def test_the_peak_is_the_largest_sum_and_its_live_blocks_are_summed_by_site():
    events = [
        _event("alloc", 1, 100 * MIB, LAYER), _event("alloc", 2, 100 * MIB, LAYER),
        _event("segment_alloc", 9, 512 * MIB),  # the allocator's own events move nothing
        _event("alloc", 3, 300 * MIB, LOSS),  # the peak: 500 MiB on top of what was there
        _event("free_requested", 3, 300 * MIB, LOSS), _event("free_completed", 3, 300 * MIB, LOSS),
        _event("free_requested", 7, 50 * MIB),  # a block allocated before the trace
        _event("alloc", 4, 200 * MIB, LAYER),  # 450 MiB: below the peak
    ]
    result = peak_composition(events, before=1024 * MIB)
    assert result["peak_allocated_gib"] == pytest.approx((1024 + 500) * MIB / GIB, abs=1e-3)
    assert result["peak_event"] == 3
    assert result["held_from_before_gib"] == pytest.approx(1.0)  # nothing of it freed before the peak
    sites = {s["site"]: (s["gib"], s["blocks"]) for s in result["sites"]}
    assert sites == {"trainer_ext/distill/losses.py:251 _forward_and_grads": (pytest.approx(300 / 1024, abs=1e-4), 1),
                     "hf_recurrent/modeling_recurrent_depth.py:300 forward <- cab.py:call":
                         (pytest.approx(200 / 1024, abs=1e-4), 2)}
    assert [s["gib"] for s in result["sites"]] == sorted((s["gib"] for s in result["sites"]), reverse=True)


def test_freeing_what_was_there_before_lowers_the_baseline_and_sites_beyond_the_top_are_one_line():
    events = [_event("free_requested", 7, 512 * MIB)] + [
        _event("alloc", i, (i + 1) * 100 * MIB, [{"filename": f"/x/mod{i}.py", "line": i, "name": "f"}])
        for i in range(5)]
    result = peak_composition(events, before=1024 * MIB, top=2)
    assert result["held_from_before_gib"] == pytest.approx(0.5)
    assert result["peak_allocated_gib"] == pytest.approx((512 + 1500) * MIB / GIB, abs=1e-3)
    assert [s["site"] for s in result["sites"]] == ["mod4.py:4 f", "mod3.py:3 f", "3 other sites"]
    assert result["sites"][-1]["blocks"] == 3 and result["sites"][-1]["gib"] == pytest.approx(600 / 1024, abs=1e-4)
    # A trace that only frees never rises above where it started
    assert peak_composition([_event("free_requested", 1, MIB)], before=MIB)["sites"] == []
    assert site([]) == "unknown"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_the_recorded_peak_is_the_allocators():
    from benchmarks.peak_memory import PeakSnapshot

    class State:
        global_step = 0

    held = torch.empty(64 * MIB, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    snapshot = PeakSnapshot(step=0)
    snapshot.on_step_begin(None, State, None)
    temporary = torch.empty(128 * MIB, dtype=torch.uint8, device="cuda")
    del temporary
    State.global_step = 1
    snapshot.on_step_end(None, State, None)
    assert snapshot.result["peak_allocated_gib"] == pytest.approx(torch.cuda.max_memory_allocated() / GIB, abs=1e-3)
    assert snapshot.result["sites"][0]["gib"] == pytest.approx(128 / 1024, abs=1e-3)
    assert "test_peak_memory.py" in snapshot.result["sites"][0]["site"]
    del held
