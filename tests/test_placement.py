"""Placements per layer application (trainer_ext/memory/placement.py, recompute.py): keep / recompute / selective /
offload written and read (old plan files too), carried out in the model with the loss and gradients of keeping
everything, chosen by the program where the card's balance favours them, and host memory bounded."""

import bisect
import contextlib
import dataclasses
import json
import os
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_recurrent import presets
from test_memory_plan import SYNTHETIC, fake_24gb_cuda, loss_and_grads
from test_offload import CountingCompiler
from trainer_ext.compat import set_checkpointing
from trainer_ext.memory import placement as placements
from trainer_ext.memory.device_profile import SPEC_PROFILES
from trainer_ext.memory.estimator import GIB, Calibration
from trainer_ext.memory.offload import OffloadActivations
from trainer_ext.memory.placement import OFFLOAD_SECONDS_PER_APPLICATION, Program, host_bytes_for
from trainer_ext.memory.plan import MemoryPlanCallback, apply_memory_plan, plan_for_preset, plan_memory, \
    training_shape
from trainer_ext.memory.recompute import Applications, RecomputeCallback, RecomputeSet
from trainer_ext.training.arguments import RecurrentTrainingArguments

MIX = RecomputeSet(prelude=(0,), core_steps=(0,), selective_recompute=Applications(core_steps=(1,)),
                   offload=Applications(core_steps=(2,), coda=(0,)))


def test_a_placement_survives_its_round_trip_and_old_files_still_read():
    assert RecomputeSet.from_dict(json.loads(json.dumps(MIX.to_dict()))) == MIX
    assert [MIX.placement(*where) for where in (("prelude", 0), ("core_steps", 0), ("core_steps", 1),
                                                 ("core_steps", 2), ("coda", 0), ("core_steps", 3))] == [
        "recompute", "recompute", "selective", "offload", "offload", "keep"]
    assert MIX.describe() == ("recompute prelude 0, core steps 0; recompute selectively core steps 1; "
                              "offload core steps 2, coda 0")
    # A plan file or probe record of the recompute lists only (and the probes' all-selective form) reads as before,
    # and a set of recomputed applications only writes the same keys as before.
    old = {"prelude": [1, 2], "core_steps": [0], "coda": []}
    assert RecomputeSet.from_dict(old) == RecomputeSet((1, 2), (0,), ())
    assert RecomputeSet.from_dict(old).to_dict() == old
    probes = RecomputeSet.from_dict({**old, "selective": True})
    assert probes.placement("prelude", 1) == "selective" and probes.to_dict() == {**old, "selective": True}
    assert RecomputeSet().empty and not RecomputeSet(offload=Applications(coda=(0,))).empty
    with pytest.raises(ValueError, match="core_steps 2 is placed twice"):
        RecomputeSet(core_steps=(2,), offload=Applications(core_steps=(2,)))
    with pytest.raises(ValueError, match="must map"):
        RecomputeSet.from_dict({"prelude": 3})


def test_a_mix_of_placements_gives_the_loss_and_gradients_of_keeping_everything(monkeypatch):
    torch.manual_seed(0)
    config = presets.get("debug", depth_distribution="fixed")
    config.backprop_depth = 3
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    contexts = []
    original = OffloadActivations.__init__

    def record(self, *args, **kwargs):
        original(self, *args, **kwargs)
        contexts.append(self)

    monkeypatch.setattr(OffloadActivations, "__init__", record)
    reference_loss, reference, _ = loss_and_grads(model, ids, None)
    assert not contexts
    for forward in range(2):  # a second forward gets a context of its own
        loss, grads, _ = loss_and_grads(model, ids, MIX, offload_min_bytes=0)
        assert torch.equal(loss, reference_loss) and grads.keys() == reference.keys()
        for name in grads:
            torch.testing.assert_close(grads[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)
        context = contexts[-1]
        assert len(contexts) == forward + 1
        # Core step 2's two core layers and coda layer 0 saved their tensors through the hooks; all came back.
        assert context.offloaded > 10 and context.host_bytes == 0 and not context._stored and not context._fetched
    functions = model.model.recompute_core_steps
    assert sorted(functions) == [0, 1, 2] and functions[2] is model.model.coda[0]._gradient_checkpointing_func
    # A set without offload removes the per-forward renewal: no more contexts.
    loss_and_grads(model, ids, RecomputeSet(core_steps=(0, 1, 2)))
    assert len(contexts) == 2 and model.model._offload_renewal is None


def test_offloaded_layers_hold_no_more_host_memory_than_the_bound():
    torch.manual_seed(0)
    config = presets.get("debug", depth_distribution="fixed")
    model = AutoModelForCausalLM.from_config(config).train()
    set_checkpointing(model, True)
    everything = RecomputeSet(offload=Applications(prelude=(0,), core_steps=tuple(range(4)), coda=(0,)))
    ids = torch.randint(0, config.vocab_size, (2, 16))
    for bound in (None, 20_000):
        everything.apply(model, max_host_bytes=bound, offload_min_bytes=0)
        output = model(ids, labels=ids, num_steps=4)
        context = model.model.coda[0]._gradient_checkpointing_func.context
        held = context.host_bytes
        assert held > 0 and (bound is None and held > 20_000 or bound is not None and held <= bound)
        output.loss.backward()
        assert context.host_bytes == 0


@pytest.mark.parametrize("spent_by", ["the bound", "a refused pin"])
def test_past_the_host_memory_the_forwards_later_offloaded_layers_are_recomputed(spent_by, caplog, monkeypatch):
    """A forward whose host memory is spent (its bound reached, or pinning refused as WSL2 may) recomputes its later
    offloaded applications instead of keeping their tensors on the device: the loss and gradients of keeping
    everything, those applications' matrix products run again (offload alone runs none again), no tensor of them
    held, and one warning over two steps."""
    from test_offload import CountMatmuls
    from trainer_ext.memory.offload import _is_parameter

    torch.manual_seed(0)
    config = presets.get("debug", depth_distribution="fixed")
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    reference_loss, reference, kept_products = loss_and_grads(model, ids, None)
    everything = RecomputeSet(offload=Applications(prelude=(0,), core_steps=tuple(range(4)), coda=(0,)))
    assert loss_and_grads(model, ids, everything, offload_min_bytes=0)[2] == kept_products  # offload: none again
    bound = 20_000
    if spent_by == "a refused pin":  # refused once 20,000 bytes are pinned, under no bound of its own
        buffer, sizes = OffloadActivations._host_buffer, []

        def refusing(tensor, pinned):
            if sum(sizes) + tensor.numel() * tensor.element_size() > bound:
                raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
            sizes.append(tensor.numel() * tensor.element_size())
            return buffer(tensor, pinned)

        monkeypatch.setattr(OffloadActivations, "_host_buffer", staticmethod(refusing))
    set_checkpointing(model, True)
    everything.apply(model, max_host_bytes=None if spent_by == "a refused pin" else bound, offload_min_bytes=0)
    forward = model.model.coda[0]._gradient_checkpointing_func
    with caplog.at_level("WARNING", logger="trainer_ext.memory.offload"):
        for step in range(2):
            model.zero_grad(set_to_none=True)
            if spent_by == "a refused pin":
                sizes.clear()  # the allocator's cached pinned blocks serve the next step
            with CountMatmuls() as products:
                output = model(ids, labels=ids, num_steps=4)
                context = forward.context
                assert context.exhausted and 0 < context.host_bytes <= bound
                kept = {bisect.bisect_right(context._starts, key) - 1 for key, (kind, *held) in context._stored.items()
                        if kind == "kept" and not _is_parameter(held[0])}  # applications with activations kept
                assert len(kept) == 1  # those of the application in which the host memory ran out, no more
                output.loss.backward()
            assert context.host_bytes == 0 and products.count > kept_products
            assert torch.equal(output.loss.detach(), reference_loss)
            for name, parameter in model.named_parameters():
                torch.testing.assert_close(parameter.grad, reference[name], rtol=1e-5, atol=1e-6, msg=name)
    recomputed = [r for r in caplog.records if "recomputed instead" in r.getMessage()]
    assert len(recomputed) == 1 and "--memory_host_gib" in recomputed[0].getMessage()


def _with_bandwidth(rate: float) -> Calibration:
    """The synthetic calibration on a card whose copies run at `rate` bytes/s each way."""
    profile = {"device_to_host_bytes_per_second": rate, "host_to_device_bytes_per_second": rate}
    return Calibration(SYNTHETIC.families, info={"device_profile": profile})


def _offloaded(plan) -> int:
    return sum(len(plan.placement["offload"][name]) for name in plan.placement["offload"])


def test_the_program_offloads_where_copies_are_free_and_never_over_a_slow_link():
    shape = training_shape(presets.get("recurrent-3.3b"))
    kwargs = dict(batch_sizes=range(1, 9), memory_host_gib=1000, placements="all")
    free = plan_memory(shape, 2048, 24, _with_bandwidth(1e18), **kwargs)
    slow = plan_memory(shape, 2048, 24, _with_bandwidth(1e3), **kwargs)
    unknown = plan_memory(shape, 2048, 24, SYNTHETIC, **kwargs)  # no bandwidth: not offered
    assert _offloaded(free) > 0 and free.host_gib > 0
    assert _offloaded(slow) == _offloaded(unknown) == 0 and slow.host_gib == 0
    assert free.predicted_tokens_per_second > slow.predicted_tokens_per_second
    # Free copies cost only the hooks' launches; the plan's figures are its placement's.
    program = Program(shape, _with_bandwidth(1e18), free.per_device_train_batch_size, 2048, compiled=True,
                      choices="all")
    assert program.offload_seconds == pytest.approx(OFFLOAD_SECONDS_PER_APPLICATION)
    peak, seconds, host = program.evaluate(free.recompute)
    assert (peak / GIB, seconds, host / GIB) == pytest.approx(
        (free.predicted_peak_gib, free.predicted_step_seconds, free.host_gib))
    assert free.predicted_peak_gib <= 24 - 1.4 + 1e-6


@pytest.mark.parametrize("host_gib", [0, 16, 40])
def test_memory_host_gib_bounds_the_host_memory_of_the_plan(host_gib):
    shape = training_shape(presets.get("recurrent-3.3b"))
    plan = plan_memory(shape, 2048, 24, _with_bandwidth(1e18), batch_sizes=range(1, 9), memory_host_gib=host_gib,
                       placements="all")
    assert plan.host_gib <= host_gib + 1e-9 and plan.host_cap_gib == host_gib
    assert (_offloaded(plan) > 0) == (host_gib > 0)
    # Processes of one host share the bound.
    two = training_shape(presets.get("recurrent-3.3b"), num_processes=2, sharding="fsdp2")
    shared = plan_memory(two, 2048, 24, _with_bandwidth(1e18), batch_sizes=range(1, 9), memory_host_gib=host_gib,
                         placements="all")
    assert shared.host_cap_gib == host_gib / 2 and shared.host_gib <= host_gib / 2 + 1e-9


def test_the_default_host_bound_is_a_fraction_of_the_machines_memory(monkeypatch):
    monkeypatch.setattr(placements, "machine_ram_bytes", lambda: 64 * GIB)
    assert host_bytes_for() == 32 * GIB and host_bytes_for(num_processes=4) == 8 * GIB
    assert host_bytes_for(6) == 6 * GIB and host_bytes_for(2.0, num_processes=2) == 1 * GIB


def test_the_h200_calibration_never_offloads_and_a_3090_offloads_where_its_balance_favours_it():
    # On the H200 a layer's copies over PCIe 5.0 take several times its compute (compute is ~10x a 3090's, the link
    # 2x): the stall costs more than recomputing, so even unbounded host memory buys no offload.
    every = dict(memory_host_gib=1000, placements="all")
    for preset in ("recurrent-7b", "recurrent-3.3b"):
        h200 = plan_for_preset(preset, 2048, None, **every)
        assert _offloaded(h200) == 0 and h200.host_gib == 0
    rtx3090 = plan_for_preset("recurrent-7b", 2048, None, device_profile=SPEC_PROFILES["rtx3090"], **every)
    shape = training_shape(presets.get("recurrent-7b"))
    from trainer_ext.memory.estimator import load_calibration
    from trainer_ext.memory.device_profile import for_device

    for calibration, hidden in ((load_calibration(), False), (for_device(load_calibration(),
                                                                            SPEC_PROFILES["rtx3090"])[0], True)):
        program = Program(shape, calibration, 4, 2048, compiled=True, choices="all")
        per_application = program.offload_seconds
        assert (per_application == pytest.approx(program.offload_fixed_seconds)) == hidden
        assert (per_application < program.seconds["recompute"]) == hidden
    # On a 3090 a 7b layer's forward (~4 us a token) hides its copies out (~4 us at 31.5 GB/s) and back (backward
    # is twice as long): offload is cheaper than recomputing, and with host memory for it the plan is faster.
    without = plan_for_preset("recurrent-7b", 2048, None, device_profile=SPEC_PROFILES["rtx3090"], memory_host_gib=0,
                              placements="all")
    assert _offloaded(rtx3090) > 0 and 0 < rtx3090.host_gib <= 1000
    assert rtx3090.predicted_tokens_per_second > without.predicted_tokens_per_second
    assert rtx3090.predicted_peak_gib <= 24 - 1.4 + 1e-6


def test_cli_prints_each_placement_and_the_host_memory(capsys):
    from trainer_ext.cli.plan_memory import main

    argv = ["--preset", "recurrent-7b", "--device_profile", "rtx3090", "--memory_host_gib", "32",
            "--memory_placements", "all"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    for kind in ("keep", "recompute", "selective", "offload"):
        assert re.search(rf"^    {kind}: +\S", out, re.MULTILINE), kind
    assert re.search(r"offload uses \d+\.\d\d GiB of pinned host memory \(bound 32\.00 GiB", out)
    assert "--memory_placements all --memory_host_gib 32 for exactly this plan" in out
    assert main([*argv, "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert set(plan["placement"]) == {"keep", "recompute", "selective", "offload"}
    assert plan["placement"]["offload"]["prelude"] and 0 < plan["host_gib"] <= 32 and plan["host_cap_gib"] == 32
    assert RecomputeSet.from_dict(plan["recompute"]).offload  # what training applies


@pytest.mark.parametrize("value", ["-1", "nan", "lots"])
def test_bad_host_memory_is_refused_naming_the_flag(value, capsys, tmp_path):
    from trainer_ext.cli.plan_memory import main

    with pytest.raises(SystemExit) if value == "lots" else contextlib.nullcontext():  # argparse: not a number
        assert main(["--preset", "recurrent-7b", "--memory_host_gib", value]) == 2
    assert "--memory_host_gib" in capsys.readouterr().err
    if value != "lots":
        with pytest.raises(ValueError, match=rf"--memory_host_gib={value}.* >= 0"):
            RecurrentTrainingArguments(output_dir=str(tmp_path), memory_host_gib=float(value))


def test_training_passes_its_host_bound_to_the_plan_and_the_offload_hooks(tmp_path, monkeypatch):
    args = RecurrentTrainingArguments(output_dir=str(tmp_path), memory_plan="auto", torch_compile=True,
                                      memory_host_gib=3, memory_placements="all")
    fake_24gb_cuda(monkeypatch, args)
    callbacks = apply_memory_plan(args, presets.get("recurrent-3.3b"), 2048, 2)
    plan = next(c for c in callbacks if isinstance(c, MemoryPlanCallback)).plan
    placed = next(c for c in callbacks if isinstance(c, RecomputeCallback))
    assert plan.host_cap_gib == 3 and placed.max_host_bytes == 3 * GIB and placed.recompute == plan.recompute


def test_a_training_with_the_defaults_applies_its_plans_selective_applications(tmp_path, monkeypatch):
    args = RecurrentTrainingArguments(output_dir=str(tmp_path), memory_plan="auto", torch_compile=True)
    fake_24gb_cuda(monkeypatch, args)
    callbacks = apply_memory_plan(args, presets.get("recurrent-3.3b"), 2048, 2)
    plan = next(c for c in callbacks if isinstance(c, MemoryPlanCallback)).plan
    placed = next(c for c in callbacks if isinstance(c, RecomputeCallback)).recompute
    assert plan.placements == args.memory_placements == "selective" and placed == plan.recompute
    assert placed.selective_recompute and not placed.offload
    assert args.per_device_train_batch_size == plan.per_device_train_batch_size


def test_by_default_the_plan_may_recompute_selectively_and_only_asked_for_all_it_offloads(tmp_path, capsys):
    """Selective recomputation is calibrated by GPU probe pairs and chosen by default; offload would pin many GiB of
    host memory on a consumer card and training chooses it only with `all`, even where the program predicts it faster
    (a 3090 with host memory for it); `recompute` leaves selective out. Planning for a card (a device profile) offers
    offload unless told otherwise."""
    from trainer_ext.cli.plan_memory import main

    assert RecurrentTrainingArguments(output_dir=str(tmp_path)).memory_placements == "selective"
    profile = dict(device_profile=SPEC_PROFILES["rtx3090"], memory_host_gib=32)
    default = plan_for_preset("recurrent-3.3b", 2048, None, placements="selective", **profile)
    only_recompute = plan_for_preset("recurrent-3.3b", 2048, None, placements="recompute", **profile)
    every = plan_for_preset("recurrent-3.3b", 2048, None, placements="all", **profile)
    assert _offloaded(default) == 0 and any(default.placement["selective"].values())
    assert not any(only_recompute.placement["selective"].values()) and _offloaded(only_recompute) == 0
    assert default.predicted_tokens_per_second > only_recompute.predicted_tokens_per_second
    assert _offloaded(every) > 0 and every.predicted_tokens_per_second > default.predicted_tokens_per_second
    assert plan_for_preset("recurrent-3.3b", 2048, None, **profile).placement == every.placement
    # The flags that give exactly a plan name its placements where they are not the default's.
    assert "--memory_placements" not in default.exact_flags
    assert "--memory_placements recompute" in only_recompute.exact_flags
    assert "--memory_placements all --memory_host_gib 32" in every.exact_flags
    with pytest.raises(SystemExit):  # argparse names the flag and its choices
        main(["--preset", "recurrent-7b", "--memory_placements", "some"])
    assert "--memory_placements" in capsys.readouterr().err
    with pytest.raises(ValueError, match=r"--memory_placements='some'.*\['recompute', 'selective', 'all'\]"):
        RecurrentTrainingArguments(output_dir=str(tmp_path), memory_placements="some")


@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile is unavailable here")
def test_compiled_layers_placed_selective_run_no_product_again_and_give_the_same_gradients():
    """Under torch.compile the selective policy applies inside the compiled region: the forward's matrix products run
    once, with the loss and gradients of keeping everything, whether transformers checkpoints a layer's `__call__`
    (5.17: from outside the compiled layer, where the policy alone saw none of its ops and the whole forward ran
    again, 0.95 of a recompute's time on the GPU) or its `forward` (later 5.x: inside it)."""
    from trainer_ext.training.trainer import compile_decoder_layers

    torch.manual_seed(0)
    config = presets.get("debug", depth_distribution="fixed")
    model = AutoModelForCausalLM.from_config(config).train()
    ids = torch.randint(0, config.vocab_size, (2, 16))
    reference_loss, reference, _ = loss_and_grads(model, ids, None)
    every = RecomputeSet.named("all", config, min(config.backprop_depth or 4, 4))  # depth 4 below
    counted = {}
    for name, placement in (("keep", RecomputeSet()), ("recompute", every),
                            ("selective", dataclasses.replace(every, selective=True))):
        torch._dynamo.reset()
        compiler = CountingCompiler()
        compile_decoder_layers(model, backend=compiler.backend)
        loss, grads, _ = loss_and_grads(model, ids, placement, count_products=False)
        counted[name] = dict(compiler.run)
        torch.testing.assert_close(loss, reference_loss, rtol=1e-5, atol=1e-6)
        for key in reference:
            torch.testing.assert_close(grads[key], reference[key], rtol=1e-4, atol=1e-5, msg=f"{name}: {key}")
    assert counted["keep"]["forward"] > 0
    # a full recompute runs the products again, in the forward graph (5.17) or in the backward one (later)
    assert sum(counted["recompute"].values()) > sum(counted["keep"].values())
    assert counted["selective"]["forward"] == counted["keep"]["forward"]  # no product ran again


def test_the_committed_calibration_bounds_every_offloaded_probe():
    """Offload's window is fitted to the offloaded probes (the two applications on their way to or from the host and
    the allocator's cache of two streams): the committed calibration predicts none of them under its measured peak,
    and a refit of the same records gives the same window."""
    from trainer_ext.memory.calibrate import as_measured_now, fit_offload, offloaded
    from trainer_ext.memory.estimator import ModelShape, load_calibration
    from trainer_ext.memory.probes import read_probes
    from trainer_ext.memory.placement import OFFLOAD_WINDOW_APPLICATIONS, Program
    from trainer_ext.memory.recompute import RecomputeSet

    calibration = load_calibration()
    records = [as_measured_now(r) for r in read_probes(os.path.join(  # as the fit reads them
        os.path.dirname(__file__), os.pardir, "results", "memory-probes", "probes.jsonl"))]
    probes = [r for r in records if offloaded(r)]
    assert len(probes) >= 12 and {r["preset"] for r in probes} == {"recurrent-3.3b", "recurrent-7b"}
    window = calibration.info["offload"]["window_applications"]
    assert window >= OFFLOAD_WINDOW_APPLICATIONS
    without = dict(calibration.info)
    without.pop("offload")
    assert fit_offload(records, type(calibration)(calibration.families, without)) == calibration.info["offload"]
    for r in probes:
        program = Program(ModelShape.from_record(r), calibration, r["batch_size"], r["seq_len"], True, 0, "all")
        assert program.window_bytes == window * program.keep_bytes
        assert program.peak_bytes(RecomputeSet.from_dict(r["recompute_set"])) >= r["peak_reserved_bytes"]
    assert fit_offload([r for r in records if not offloaded(r)], calibration) is None


def test_offloads_fixed_time_is_the_least_squares_of_the_probes_ratios_to_their_references():
    """Each offloaded probe's step over its reference's (the nearest in the file of its card, preset, batch and
    length: three sets of probes of the same shapes are committed), measured, against the program's prediction with f
    seconds per offloaded application: probes made to measure what f = 3 ms predicts against their own references give
    back 3 ms, and not against the last set's; the committed calibration's own value is the fit of the committed
    records."""
    from trainer_ext.memory.calibrate import as_measured_now, fit_offload, offloaded, reference_of
    from trainer_ext.memory.estimator import ModelShape, load_calibration
    from trainer_ext.memory.probes import read_probes, steady_step_seconds
    from trainer_ext.memory.recompute import RecomputeSet

    calibration = load_calibration()
    records = [as_measured_now(r) for r in read_probes(os.path.join(
        os.path.dirname(__file__), os.pardir, "results", "memory-probes", "probes.jsonl"))]
    fitted = calibration.info["offload"]
    assert fitted["timed_probes"] == 36 and 0.0 <= fitted["seconds_per_application"] < 0.01
    bare = type(calibration)(calibration.families, {k: v for k, v in calibration.info.items() if k != "offload"})
    assert fit_offload(records, bare) == fitted
    references = {}  # the last of each shape in the file: the last set's
    for r in records:
        if r.get("recompute") == "recompute_reference":
            references[(r["preset"], r["batch_size"])] = r
    assert len({id(reference_of(records, i)) for i, r in enumerate(records) if offloaded(r)}) == 18  # every set's

    def made_against(pick):
        made = []
        for index, r in enumerate(records):
            if offloaded(r):
                program = Program(ModelShape.from_record(r), bare, r["batch_size"], r["seq_len"], True, 0, "all")
                _, seconds, host = program.evaluate(RecomputeSet.from_dict(r["recompute_set"]))
                reference = pick(index, r)
                predicted_reference = program.evaluate(RecomputeSet.from_dict(reference["recompute_set"]))[1]
                offloaded_seconds = seconds + host / program.keep_bytes * (0.003 - program.offload_fixed_seconds)
                ratio = offloaded_seconds / predicted_reference
                r = {**r, "step_seconds": [steady_step_seconds(reference) * ratio] * 3}
            made.append(r)
        return fit_offload(made, bare)["seconds_per_application"]

    assert made_against(lambda index, r: reference_of(records, index)) == pytest.approx(0.003, abs=1e-6)
    assert made_against(lambda index, r: references[(r["preset"], r["batch_size"])]) != pytest.approx(0.003, abs=1e-4)
    assert "seconds_per_application" not in fit_offload([r for r in records if r.get("recompute") !=
                                                          "recompute_reference"], bare)  # no references, no time


def test_the_placement_report_gives_the_window_the_fit_would_store(tmp_path, capsys):
    from benchmarks.placement_report import main as report
    from trainer_ext.memory.calibrate import offloaded
    from trainer_ext.memory.estimator import load_calibration
    from trainer_ext.memory.probes import read_probes

    records = read_probes(os.path.join(os.path.dirname(__file__), os.pardir, "results", "memory-probes",
                                       "probes.jsonl"))
    probes = tmp_path / "offload.jsonl"
    probes.write_text("".join(json.dumps(r) + "\n" for r in records if offloaded(r)))
    assert report([str(probes)]) == 0
    window = load_calibration().info["offload"]
    assert (f"Offload's device window, as `--fit` would store it: {window['window_applications']:.3f} layer "
            f"applications' kept bytes, from {window['probes']} probe(s).") in capsys.readouterr().out
    # After a refit, the H100's offload probes with their references against the committed calibration's predictions
    from benchmarks.memory_probe import predicted_figures
    from benchmarks.placement_report import offload_rows, repredicted
    from trainer_ext.memory.calibrate import as_measured_now

    run = os.path.join(os.path.dirname(__file__), os.pardir, "results", "gpu-2026-12-06b", "h100", "offload-3",
                       "probes.jsonl")
    assert report([run, "--repredict"]) == 0
    written, again = read_probes(run), repredicted([as_measured_now(r) for r in read_probes(run)])
    assert [r.get("predicted_step_seconds") for r in again] == [
        predicted_figures(r)["predicted_step_seconds"] if r.get("predicted_step_seconds") else None for r in written]
    rows = offload_rows(again)
    out = capsys.readouterr().out
    assert len(rows) == 12 and all(f"| {row['measured_ratio']:.3f} | {row['predicted_ratio']:.3f} |" in out
                                   for row in rows)
