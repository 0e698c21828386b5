"""Device profiles: the datasheet cards shipped, a profile measured once and cached or given as a file, and the
calibration's step times scaled to a profile's matmul rate (`hf-recurrent-plan-memory --device_profile`)."""

import json
import re

import pytest
import torch

from trainer_ext.memory import device_profile as profiles
from trainer_ext.memory.device_profile import (
    SPEC_PROFILES,
    DeviceProfile,
    for_device,
    measured_profile,
    reference_matmul_flops,
    resolve_device_profile,
)
from trainer_ext.memory.estimator import load_calibration
from trainer_ext.memory.plan import plan_for_preset

H200_MATMUL_FLOPS = 665.1e12  # the committed calibration's device, measured (BENCHMARKS.md)


def test_the_shipped_cards_carry_their_datasheet_figures():
    rtx3090, rtx4090 = SPEC_PROFILES["rtx3090"], SPEC_PROFILES["rtx4090"]
    assert (rtx3090.matmul_flops, rtx4090.matmul_flops) == (71e12, 165.2e12)  # dense bf16, fp32 accumulation
    for card in (rtx3090, rtx4090):
        assert card.memory_gib == 24.0 and card.source == "datasheet"
        assert card.host_device_bytes_per_second == pytest.approx(31.5e9, rel=1e-3)  # PCIe 4.0 x16, each way
    assert resolve_device_profile("RTX3090") is rtx3090 and resolve_device_profile(None) is None


def test_a_profile_scales_the_step_times_by_the_matmul_rates_and_keeps_the_memory_terms():
    calibration = load_calibration()
    assert calibration.info["device_name"] == "NVIDIA H200"
    assert reference_matmul_flops(calibration) == H200_MATMUL_FLOPS
    scaled, factor = for_device(calibration, SPEC_PROFILES["rtx3090"])
    assert factor == pytest.approx(H200_MATMUL_FLOPS / 71e12)
    for name, fit in calibration.families.items():
        assert scaled.families[name].time_coefficients == pytest.approx([c * factor for c in fit.time_coefficients])
        if fit.compiled_time_coefficients is not None:
            assert scaled.families[name].compiled_time_coefficients == pytest.approx(
                [c * factor for c in fit.compiled_time_coefficients])
        assert scaled.families[name].memory_coefficients == fit.memory_coefficients
    # The training's default placements (keep / recompute / selective): their costs scale with the matmul rate alone.
    h200 = plan_for_preset("recurrent-7b", 2048, None)
    rtx3090 = plan_for_preset("recurrent-7b", 2048, None, device_profile=SPEC_PROFILES["rtx3090"],
                              placements="selective")
    # The same card size gives the same plan (the memory model is the calibration's), at a 3090's speed.
    assert rtx3090.cap_gib == h200.cap_gib == 24.0
    assert rtx3090.per_device_train_batch_size == h200.per_device_train_batch_size
    assert rtx3090.recompute == h200.recompute
    assert rtx3090.predicted_peak_gib == pytest.approx(h200.predicted_peak_gib)
    assert rtx3090.predicted_tokens_per_second == pytest.approx(h200.predicted_tokens_per_second / factor)
    assert rtx3090.to_dict()["device_profile"]["step_time_scale"] == round(factor, 4)
    assert h200.to_dict()["device_profile"] is None


@pytest.mark.parametrize("preset", ["recurrent-7b", "recurrent-3.3b"])
def test_cli_prints_the_plan_a_3090_would_get_with_its_tokens_per_second(preset, capsys):
    from trainer_ext.cli.plan_memory import main

    assert main(["--device_profile", "rtx3090", "--preset", preset]) == 0
    out = capsys.readouterr().out
    assert f"{preset}, 2048 tokens per sequence, cap 24 GiB:" in out and "--per_device_train_batch_size" in out
    (line,) = [line for line in out.splitlines() if "tokens/s" in line]
    assert "speed on NVIDIA GeForce RTX 3090 (datasheet: 71.0 TFLOP/s bf16, 31.5 GB/s host-device, 24 GiB)" in line
    assert "the step times of NVIDIA H200 x 9.37" in line
    # With the training's default placements (keep / recompute / selective) the plans differ in the step-time scale
    # only.
    assert main(["--device_profile", "rtx3090", "--preset", preset, "--memory_placements", "selective", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert main(["--preset", preset, "--json"]) == 0
    h200 = json.loads(capsys.readouterr().out)
    assert plan["predicted_tokens_per_second"] == pytest.approx(h200["predicted_tokens_per_second"] / 9.3676, rel=1e-3)
    assert main(["--device_profile", "rtx3090", "--preset", preset, "--cap_gib", "22", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["cap_gib"] == 22  # --cap_gib wins over the card's memory


@pytest.mark.parametrize("preset", ["recurrent-7b", "recurrent-3.3b"])
def test_a_cards_plan_offloads_by_default_where_its_balance_favours_it_and_names_the_flags_training_needs(preset,
                                                                                                        capsys):
    """Planned for a 3090 (compute about as slow as its copies) the flagless command offloads and prints the flags that
    make training do the same; for a 4090's 7b (copies slower than its compute) and the calibration's card, offload
    offered, it does not, and names no placements; --memory_placements given wins."""
    from trainer_ext.cli.plan_memory import main

    host = ["--memory_host_gib", "16"]  # the default bound is half of this machine's RAM
    assert main(["--device_profile", "rtx3090", "--preset", preset, *host, "--json"]) == 0
    rtx3090 = json.loads(capsys.readouterr().out)
    assert rtx3090["placements"] == "all" and 0 < rtx3090["host_gib"] <= 16
    assert any(rtx3090["placement"]["offload"].values())
    assert main(["--device_profile", "rtx3090", "--preset", preset, *host, "--memory_placements", "selective",
                 "--json"]) == 0
    selective = json.loads(capsys.readouterr().out)
    assert selective["host_gib"] == 0 and rtx3090["predicted_tokens_per_second"] > selective[
        "predicted_tokens_per_second"]
    assert main(["--device_profile", "rtx3090", "--preset", preset, *host]) == 0
    last = capsys.readouterr().out.splitlines()[-1]
    assert "add --memory_cap_gib 24 --memory_placements all --memory_host_gib 16 for exactly this plan, offload " \
           "included: training offloads only when asked" in last
    for flags in (["--device_profile", "rtx4090", "--preset", "recurrent-7b"],
                  ["--preset", preset, "--memory_placements", "all"]):  # the calibration's H200: offload never pays
        assert main([*flags, *host, "--json"]) == 0
        plan = json.loads(capsys.readouterr().out)
        assert plan["host_gib"] == 0 and not any(plan["placement"]["offload"].values())
        assert main([*flags, *host]) == 0
        assert "add --memory_cap_gib 24 for exactly this plan)." in capsys.readouterr().out.splitlines()[-1]


@pytest.mark.parametrize("value, message", [
    ("rtx2080", r"--device_profile 'rtx2080' is neither a known card \(rtx3090, rtx4090\), 'measure'"),
    ("measure", r"--device_profile measure needs a CUDA device; .*pick a spec profile \(rtx3090, rtx4090\)"),
    ("bad.json", r"--device_profile bad.json is not a device profile \('matmul_flops'\).*--device_profile measure"),
])
def test_cli_device_profile_errors_name_the_flag_and_the_fix(value, message, capsys, tmp_path, monkeypatch):
    from trainer_ext.cli.plan_memory import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    (tmp_path / "bad.json").write_text(json.dumps({"name": "card"}))
    assert main(["--preset", "recurrent-7b", "--device_profile", value]) == 2
    assert re.search(message, capsys.readouterr().err)


def _fake_card(monkeypatch, name="NVIDIA GeForce RTX 3090", flops=65e12):
    """A CUDA card seen by the profile code only; returns the list its measurements are counted in."""
    measured = []

    def measure(device="cuda"):
        measured.append(device)
        return DeviceProfile(name, flops, 24e9, 25e9, 23.69, "measured 2026-12-05")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(profiles, "measure_profile", measure)
    return measured


def test_a_profile_is_measured_once_then_read_from_its_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    measured = _fake_card(monkeypatch)
    profile, path = measured_profile()
    assert path == str(tmp_path / "cache" / "hf-recurrent" / "device_profile_nvidia_geforce_rtx_3090.json")
    assert profile.host_device_bytes_per_second == 24e9  # the slower direction
    assert resolve_device_profile("measure") == profile and len(measured) == 1  # the second time from the cache
    # Next to a calibration of the user's own, where one is given; a profile file is taken as given.
    mine = tmp_path / "mine" / "my_card.json"
    mine.parent.mkdir()
    _, beside = measured_profile(str(mine))
    assert beside == str(mine.parent / "device_profile_nvidia_geforce_rtx_3090.json") and len(measured) == 2
    assert resolve_device_profile(beside) == profile


def test_a_calibration_of_another_card_scales_by_that_cards_measured_profile(tmp_path, monkeypatch):
    calibration = load_calibration()
    calibration.info["device_name"] = "NVIDIA GeForce RTX 3090"
    mine = tmp_path / "my_card.json"
    with pytest.raises(ValueError, match=r"measured on NVIDIA GeForce RTX 3090, whose matmul rate is not known. "
                                         r"Measure it on that card \(--device_profile measure"):
        reference_matmul_flops(calibration, str(mine))
    _fake_card(monkeypatch, flops=65e12)
    measured_profile(str(mine))  # measured on the card the calibration came from: written next to it
    assert reference_matmul_flops(calibration, str(mine)) == 65e12
    assert for_device(calibration, SPEC_PROFILES["rtx4090"], str(mine))[1] == pytest.approx(65 / 165.2)
    calibration.info["matmul_flops"] = 70e12  # a calibration that records its device's rate uses it
    assert reference_matmul_flops(calibration, str(mine)) == 70e12


def test_the_matmul_rate_is_measured_as_the_peer_benchmark_measures_its_peak():
    flops = profiles.measure_matmul_flops("cpu", size=64, samples=2, per_sample=1, warmup_seconds=0.0)
    assert flops > 0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="measures a CUDA device")
def test_a_measured_profile_of_this_card_is_plausible():
    profile = profiles.measure_profile()
    assert 1e12 < profile.matmul_flops < 5e15 and 1e9 < profile.host_device_bytes_per_second < 1e12
    assert profile.name == torch.cuda.get_device_name() and profile.source.startswith("measured")


def test_a_training_plan_with_every_placement_is_made_for_the_card_it_runs_on(tmp_path, monkeypatch, caplog):
    """On a 3090, `--memory_placements all` prices offload at the 3090's compute and link (its profile measured once),
    as `hf-recurrent-plan-memory --device_profile rtx3090` prints; keep / recompute / selective (the default) need
    no profile."""
    from hf_recurrent import presets
    from trainer_ext.memory.device_profile import training_profile
    from trainer_ext.memory.plan import MemoryPlanCallback, apply_memory_plan
    from trainer_ext.training.arguments import RecurrentTrainingArguments

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    calibration = load_calibration()
    spec = SPEC_PROFILES["rtx3090"]

    def args(**kwargs):
        return RecurrentTrainingArguments(output_dir=str(tmp_path), memory_plan="auto", torch_compile=True,
                                          memory_cap_gib=24, memory_host_gib=16, **kwargs)

    with pytest.raises(ValueError, match="--memory_device_profile 'rtx9090' is neither a known card"):
        args(memory_device_profile="rtx9090")
    every, default = args(memory_placements="all"), args()  # set up on the CPU before CUDA is faked
    measured = _fake_card(monkeypatch, flops=spec.matmul_flops)
    assert training_profile(None, "recompute", calibration) is None and measured == []
    assert training_profile(None, default.memory_placements, calibration) is None and measured == []
    assert training_profile("rtx3090", "recompute", calibration) is spec
    profile = training_profile(None, "all", calibration)
    assert profile.name == "NVIDIA GeForce RTX 3090" and len(measured) == 1
    plan = next(c for c in apply_memory_plan(every, presets.get("recurrent-7b"), 2048, 2)
                if isinstance(c, MemoryPlanCallback)).plan
    assert plan.device_profile["name"] == "NVIDIA GeForce RTX 3090" and len(measured) == 1  # from the cache now
    assert plan.host_gib > 0 and plan.recompute.offload.prelude  # offload where a 3090's balance favours it
    assert "tokens/s on NVIDIA GeForce RTX 3090; offload uses" in plan.describe()  # the training log's line
    kept = next(c for c in apply_memory_plan(default, presets.get("recurrent-7b"), 2048, 2)
                if isinstance(c, MemoryPlanCallback)).plan
    assert kept.device_profile is None and kept.host_gib == 0
    # The calibration's own card needs no profile; a measurement that fails leaves the plan at its speed, logged.
    _fake_card(monkeypatch, name=calibration.info["device_name"])
    assert training_profile(None, "all", calibration) is None
    _fake_card(monkeypatch, name="Another card")
    monkeypatch.setattr(profiles, "measure_profile", lambda device="cuda": (_ for _ in ()).throw(
        RuntimeError("pinned memory could not be allocated")))
    with caplog.at_level("WARNING"):
        assert training_profile(None, "all", calibration) is None
    assert "could not be measured (pinned memory could not be allocated)" in caplog.text
