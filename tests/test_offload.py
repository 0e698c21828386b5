"""Activation offload and selective recomputation (trainer_ext/memory/offload.py): the same gradients as keeping
everything, tensors really moved and brought back, and selective recomputation repeating no matrix product."""

import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from trainer_ext.memory.offload import OffloadActivations, compiled_selective_checkpoint, selective_checkpoint


class Block(torch.nn.Module):
    """A layer's kinds of work: norm, matrix products, an activation, attention, residual adds."""

    def __init__(self, width=32):
        super().__init__()
        self.norm = torch.nn.RMSNorm(width)
        self.qkv, self.out = torch.nn.Linear(width, 3 * width), torch.nn.Linear(width, width)
        self.up, self.down = torch.nn.Linear(width, 4 * width), torch.nn.Linear(4 * width, width)

    def forward(self, x):
        q, k, v = self.qkv(self.norm(x)).unflatten(-1, (3, 4, -1)).permute(2, 0, 3, 1, 4)
        x = x + self.out(torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                         .transpose(1, 2).flatten(-2))
        return x + self.down(torch.nn.functional.silu(self.up(self.norm(x))))


def grads(model, x, run):
    model.zero_grad()
    x = x.clone().requires_grad_()
    run(x).square().mean().backward()
    return [x.grad] + [p.grad.clone() for p in model.parameters()]


class Recording(OffloadActivations):
    """Remembers the storage of each saved tensor it was given."""

    def __init__(self, *args):
        super().__init__(*args)
        self.storages = {}

    def _pack(self, tensor):
        key = super()._pack(tensor)
        self.storages[key] = tensor.untyped_storage().data_ptr()
        return key


def assert_no_weight_moved(model, run, x):
    """Under offload, activations go to the host and no parameter does (the device keeps it anyway)."""
    context = Recording(1024)
    with context:
        output = run(x.clone().requires_grad_())
    weights = {p.untyped_storage().data_ptr() for p in model.parameters()}
    moved = {key for key, entry in context._stored.items() if entry[0] != "kept"}
    assert moved and not any(context.storages[key] in weights for key in moved)
    assert any(context.storages[key] in weights for key in context._stored if key not in moved)  # weights were saved
    output.sum().backward()
    assert context.host_bytes == 0


def two_blocks(device="cpu"):
    torch.manual_seed(0)
    return torch.nn.Sequential(Block(), Block()).to(device), torch.randn(2, 16, 32, device=device)


def test_offloaded_activations_give_the_same_gradients_and_come_back():
    model, x = two_blocks()
    reference = grads(model, x, model)
    context = OffloadActivations(min_bytes=1024)

    def offloaded(inputs):
        with context:
            return model(inputs)

    got = grads(model, x, offloaded)
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert context.offloaded > 4  # the blocks' large saved tensors moved
    assert context.host_bytes == 0 and not (context._stored or context._fetched or context._leaving)  # none left
    assert_no_weight_moved(model, lambda inputs: model(inputs), x)
    assert context.host_bytes == 0 and not (context._stored or context._fetched or context._leaving)  # none left

    bounded = OffloadActivations(min_bytes=1024, max_host_bytes=8192)
    with bounded:
        output = model(x.clone().requires_grad_())
    assert 0 < bounded.host_bytes <= 8192 and bounded.offloaded >= 1  # the bound holds
    left = [entry[1] for entry in bounded._stored.values() if entry[0] == "kept"]
    assert any(t.numel() * t.element_size() >= 1024 for t in left)  # what did not fit stayed on the device
    output.sum().backward()
    assert bounded.host_bytes == 0


class Refusing(OffloadActivations):
    """Pinning refused after `allowed` host buffers, as WSL2 may refuse cudaHostAlloc mid-training."""

    def __init__(self, *args, allowed=2, **kwargs):
        super().__init__(*args, **kwargs)
        self.allowed = allowed

    def _host_buffer(self, tensor, pinned):
        if self.allowed == 0:
            raise RuntimeError("CUDA error: out of memory (cudaHostAlloc)")
        self.allowed -= 1
        return super()._host_buffer(tensor, pinned)


def test_refused_pinning_keeps_the_tensors_on_the_device_lowers_the_bound_and_names_the_flag(caplog):
    from trainer_ext.memory.offload import OffloadedForward

    model, x = two_blocks()
    reference = grads(model, x, model)
    forward = OffloadedForward(min_bytes=1024)
    forward.context = Refusing(1024, allowed=2)

    def offloaded(inputs):
        return forward(model, inputs)

    with caplog.at_level("WARNING", logger="trainer_ext.memory.offload"):
        got = grads(model, x, offloaded)
    for a, b in zip(got, reference):  # the step goes on with the refused tensors kept on the device
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    refused = forward.context
    assert refused.offloaded == 2 and refused.max_host_bytes > 0 and refused.host_bytes == 0
    (record,) = [r for r in caplog.records if "refused" in r.getMessage()]
    assert "--memory_host_gib" in record.getMessage() and "--memory_placements selective" in record.getMessage()
    forward.renew()  # the next forward pins at most what this one could
    assert forward.context.max_host_bytes == refused.max_host_bytes == forward.max_host_bytes
    got = grads(model, x, offloaded)
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert forward.context.offloaded == 2  # under the lowered bound: as many as were pinned before


def test_backward_fetches_one_application_ahead_not_more():
    """Backward brings back the application before the one it is in, whole, and nothing further: the tensors kept on
    the device (small ones) are unpacked too, and fetching one tensor ahead per unpack ran far ahead of backward."""
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(*(Block() for _ in range(4)))
    x = torch.randn(2, 16, 32)
    reference = grads(blocks, x, blocks)
    ahead = []

    class Watched(OffloadActivations):
        def _unpack(self, key):
            tensor = super()._unpack(key)
            ahead.append(len(self._fetched))
            return tensor

    context = Watched(min_bytes=1024)
    moved = []  # offloaded tensors per application

    def offloaded(inputs):
        for block in blocks:
            with context:
                context.layer_boundary()  # as OffloadedForward does before each application
                inputs = block(inputs)
        ends = context._starts[1:] + [context._next_key]
        moved.extend(sum(1 for key in range(start, end) if context._stored[key][0] != "kept")
                     for start, end in zip(context._starts, ends))
        return inputs

    got = grads(blocks, x, offloaded)
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert len(moved) == 4 and min(moved) >= 4 and context.offloaded == sum(moved)
    # the rest of the application in use and the one before it at most (the plan's window of two), none at the end
    assert max(moved) < max(ahead) < 2 * max(moved) and ahead[-1] == 0
    assert context.host_bytes == 0 and not (context._stored or context._fetched or context._leaving)


def test_a_saved_view_comes_back_with_the_strides_it_was_saved_with():
    """A compiled backward checks its saved tensors' strides: a slice of a fused projection's output (not dense) that
    came back contiguous failed every compiled offload probe on the GPU."""
    context = OffloadActivations(min_bytes=0)
    wide = torch.randn(2, 16, 96)
    for saved in (wide[..., 32:64], wide.transpose(0, 1), wide):
        back = context._unpack(context._pack(saved))
        assert back.shape == saved.shape and back.stride() == saved.stride() and torch.equal(back, saved)
    assert context.offloaded == 3 and context.host_bytes == 0


class CountMatmuls(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default):
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("placement", ["recompute", "selective"])
def test_recomputation_gives_the_same_gradients_and_selective_repeats_no_matrix_product(placement):
    model, x = two_blocks()
    reference = grads(model, x, model)
    wrap = selective_checkpoint if placement == "selective" else lambda f, *a: checkpoint(f, *a, use_reentrant=False)

    def run(inputs):
        for block in model:
            inputs = wrap(block, inputs)
        return inputs

    plain, counted = CountMatmuls(), CountMatmuls()
    with plain:
        grads(model, x, model)
    with counted:
        got = grads(model, x, run)
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    if placement == "selective":
        assert counted.count == plain.count  # every product's output was saved, none computed again
    else:
        assert counted.count > plain.count  # the whole forward ran again


class CountingCompiler:
    """A torch.compile backend (AOTAutograd, graphs run as traced) counting the matrix products its forward and
    backward graphs run."""

    def __init__(self):
        from torch._dynamo.backends.common import aot_autograd

        self.run = {"forward": 0, "backward": 0}
        self.backend = aot_autograd(fw_compiler=self.counting("forward"), bw_compiler=self.counting("backward"))

    def counting(self, kind):
        def compiler(graph, inputs):
            products = sum(1 for n in graph.graph.nodes if n.op == "call_function" and "mm" in str(n.target))

            def run(args):
                self.run[kind] += products
                return graph(*args)
            run._boxed_call = True
            return run
        return compiler


@pytest.mark.skipif(not torch._dynamo.is_dynamo_supported(), reason="torch.compile is unavailable here")
def test_a_compiled_layer_checkpointed_from_outside_runs_its_products_once_only_with_the_compiled_policy():
    """transformers 5.17 calls a layer's checkpoint function around the compiled layer: the policy as a plain
    function sees none of the compiled ops (the forward runs again); compiled, it holds the checkpoint in the traced
    region and the products run once, with the same gradients."""
    if torch.cuda.is_available():  # compiling starts CUDA, which a checkpoint's forward may not do on such a machine
        torch.cuda.init()
    torch.manual_seed(0)
    block, x = Block(), torch.randn(2, 16, 32)
    reference = grads(block, x, block)
    runs = {}
    for name in ("plain", "compiled"):
        torch._dynamo.reset()
        compiler = CountingCompiler()
        block.compile(backend=compiler.backend)
        function = selective_checkpoint if name == "plain" else compiled_selective_checkpoint(backend=compiler.backend)
        got = grads(block, x, lambda inputs: function(block, inputs))
        for a, b in zip(got, reference):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
        runs[name] = compiler.run["forward"]
    assert runs == {"plain": 8, "compiled": 4}  # Block's four products, run twice / once


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: pinned host memory and a copy stream")
def test_offload_on_cuda_moves_tensors_to_pinned_host_memory_and_frees_the_device():
    model, x = two_blocks("cuda")
    reference = grads(model, x, model)
    context = OffloadActivations(min_bytes=1024)
    torch.cuda.synchronize()
    with context:
        output = model(x.clone().requires_grad_())
    stored = [entry for entry in context._stored.values() if entry[0] != "kept"]
    assert stored and all(entry[0].is_pinned() for entry in stored)
    model.zero_grad()
    output.square().mean().backward()
    got = [p.grad for p in model.parameters()]
    for a, b in zip(got, reference[1:]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the caching allocator's streams")
def test_offload_on_cuda_holds_less_than_keeping_and_reserves_no_more():
    """The saved activations leave the device (at most the two latest layers' on their way out), and the caching
    allocator reserves no more than when keeping them: blocks freed across streams (`record_stream`, blocks allocated
    on the copy stream) let it reserve 20 GiB for 1.4 GiB allocated on an H100."""
    torch.manual_seed(0)
    blocks = [torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024)).cuda()
              for _ in range(8)]
    x = torch.randn(4096, 1024, device="cuda", requires_grad=True)

    def step(offload: bool) -> tuple[int, int]:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base, context, y = torch.cuda.memory_allocated(), OffloadActivations(), x
        for block in blocks:
            if offload:
                with context:
                    context.layer_boundary()  # as OffloadedForward does before each application
                    y = block(y)
            else:
                y = block(y)
        held = torch.cuda.memory_allocated() - base
        y.square().mean().backward()
        torch.cuda.synchronize()
        return held, torch.cuda.max_memory_reserved()

    kept = [step(False) for _ in range(2)][-1]
    moved = [step(True) for _ in range(3)][-1]
    assert moved[0] < kept[0] / 2
    assert moved[1] <= kept[1] * 1.05


def test_selective_and_offload_probes_are_left_out_of_the_peak_fit():
    from benchmarks.memory_probe import selective_grid
    from trainer_ext.memory.probes import usable_probes

    specs = selective_grid("recurrent-3.3b", 2048, (True, False))
    assert specs and all(spec["recompute"] == "all" for spec in specs)
    # each selective probe beside the same batch and compilation fully recomputed
    twins = {(s["batch_size"], s["compile"], s["selective"]) for s in specs}
    assert len(twins) == len(specs) == 12 and all((b, c, not sel) in twins for b, c, sel in twins)
    ran = {"status": "ok", "peak_reserved_bytes": 2**34, "step_seconds": [1.0, 0.5]}
    full = {**ran, "recompute_set": {"prelude": [0], "core_steps": [0], "coda": [0]}}
    selective = {**ran, "recompute_set": {**full["recompute_set"], "selective": True}}
    # A plan's placements beyond keep / recompute (a verified plan of --memory_placements all) are left out too.
    placed = [{**ran, "recompute_set": {**full["recompute_set"], key: {"prelude": [1], "core_steps": [], "coda": []}}}
              for key in ("selective_recompute", "offload")]
    assert usable_probes([full, selective, *placed]) == [full]


def test_selective_probe_pairs_price_the_selective_placement_in_the_calibration():
    """A selective probe beside its fully recomputed twin (as `--selective_probes` writes them) gives the bytes a
    selective application holds beyond a recomputed one (a multiple of the analytic S) and the share of the
    recomputation's time it still costs; the fit stores both, the peak and time fits stay as without the pair, and
    the placement program prices selective recomputation with them."""
    import dataclasses
    import os

    from trainer_ext.memory.estimator import ModelShape, fit_calibration, fit_selective, load_calibration
    from trainer_ext.memory.probes import probe_recomputed, read_probes, steady_step_seconds
    from trainer_ext.memory.placement import Program, bytes_per_token
    from trainer_ext.memory.recompute import RECOMPUTE, SELECTIVE

    probes = read_probes(os.path.join(os.path.dirname(__file__), os.pardir, "results", "memory-probes",
                                      "probes.jsonl"))
    committed_pairs = fit_selective(probes, load_calibration())
    assert committed_pairs == load_calibration().info["selective"] and committed_pairs["pairs"] >= 6
    probes = [p for p in probes if not p.get("recompute_set", {}).get("selective")]  # this test's pair alone
    twin = next(p for p in probes if p["preset"] == "recurrent-3.3b" and p.get("recompute") == "all"
                and p.get("compile") and p["status"] == "ok" and not p.get("distill_topk"))
    committed = load_calibration()
    shape, applications = ModelShape.from_record(twin), probe_recomputed(twin)
    tokens, full_seconds = twin["batch_size"] * twin["seq_len"], steady_step_seconds(twin)
    predicted = [committed.step_seconds(shape, twin["batch_size"], twin["seq_len"], n, True) for n in (0, applications)]
    recompute_seconds = full_seconds * (predicted[1] - predicted[0]) / predicted[1]
    selective = {**twin, "recompute_set": {**twin["recompute_set"], "selective": True},
                 "peak_reserved_bytes": twin["peak_reserved_bytes"] + 1.2 * shape.selective_saved_bytes * applications
                 * tokens, "step_seconds": [s - 0.75 * recompute_seconds for s in twin["step_seconds"]]}
    fitted = fit_selective([selective, twin], committed)
    from benchmarks.placement_report import render

    assert "1.200 x the analytic saved bytes, 0.250 of a recompute's time, from 1 pair(s)" in render([], fitted)
    assert fitted == {"saved_multiple": pytest.approx(1.2, rel=1e-3), "time_fraction": pytest.approx(0.25, abs=1e-3),
                      "pairs": 1}
    assert fit_selective([selective], committed) is None  # no twin, no term
    assert fit_selective([selective, {**twin, "batch_size": twin["batch_size"] + 1}], committed) is None

    rest = [p for p in probes if p is not twin]  # the pair side by side, as the probe writes it
    calibration = fit_calibration([*rest, selective, twin], leave_one_out=False)
    assert calibration.info["selective"] == fitted
    assert calibration.families == fit_calibration([*rest, twin], leave_one_out=False).families
    program, analytic = (Program(shape, c, 4, 2048, True, choices="all") for c in
                         (calibration, dataclasses.replace(calibration, info={})))
    per_token = bytes_per_token(shape, calibration, True)
    assert per_token[SELECTIVE] == min(per_token["keep"], per_token[RECOMPUTE] + 1.2 * shape.selective_saved_bytes)
    assert program.memory[SELECTIVE] == pytest.approx((per_token[SELECTIVE] - per_token["keep"]) * 4 * 2048)
    assert program.seconds[SELECTIVE] == pytest.approx(fitted["time_fraction"] * program.seconds[RECOMPUTE])
    assert analytic.seconds[SELECTIVE] == pytest.approx(0.1 * analytic.seconds[RECOMPUTE])  # the analytic default
    assert analytic.memory[SELECTIVE] < program.memory[SELECTIVE] < 0  # holds more than S, less than keeping


def test_offload_probes_train_the_forced_placement_and_carry_the_programs_prediction(tmp_path, monkeypatch):
    """memory_probe --offload_probes (a CPU dry run of the GPU path): each probe trains with its offload placement
    through the hooks, beside the same batch fully recomputed, and its record holds the program's predicted peak and
    step time beside what was measured; the calibration's fit leaves the offloaded records out."""
    from benchmarks import memory_probe
    from benchmarks.memory_probe import main, offload_grid
    from trainer_ext.memory.probes import usable_probes
    from trainer_ext.memory.recompute import RecomputeSet

    specs = offload_grid("recurrent-7b", 2048, (True, False))
    names = {spec["recompute"] for spec in specs}
    assert names == {"recompute_reference", "offload_unique", "offload_all"} and len(specs) == 18
    for spec in specs:  # the reference recomputes every graph-building application, the others offload some
        placement = RecomputeSet.from_dict(spec["recompute_set"])
        assert bool(placement.offload) == (spec["recompute"] != "recompute_reference")
    output = tmp_path / "offload.jsonl"
    # The dry run trains the batch-1 probe of each placement (the grid is made here, the child runs what it is given).
    monkeypatch.setattr(memory_probe, "offload_grid",
                        lambda *args: [spec for spec in offload_grid(*args) if spec["batch_size"] == 1])
    assert main(["--presets", "debug", "--device", "cpu", "--offload_probes", "--no_compile_probes", "--seq_len",
                 "32", "--steps", "2", "--output", str(output)]) == 0
    records = [json.loads(line) for line in output.read_text().splitlines()]
    assert len(records) == 3 and all(r["status"] == "ok" and r["predicted_step_seconds"] > 0 for r in records)
    offloaded = [r for r in records if r["recompute"] != "recompute_reference"]
    assert all(r["predicted_host_gib"] > 0 for r in offloaded)
    assert {r["predicted_host_gib"] for r in records if r not in offloaded} == {0}
    # the fit takes the references (plain recompute probes) and leaves the offloaded ones out
    usable = usable_probes([{**r, "peak_reserved_bytes": 2**30} for r in records])
    assert [r["recompute"] for r in usable] == ["recompute_reference"]
    # The report sets each offloaded step against its reference, measured and predicted.
    from benchmarks.placement_report import main as report, offload_rows
    from trainer_ext.memory.probes import steady_step_seconds

    reference = next(r for r in records if r["recompute"] == "recompute_reference")
    rows = offload_rows(records)
    assert [row["placement"] for row in rows] == [r["recompute"] for r in offloaded]
    for row, r in zip(rows, offloaded):
        measured = steady_step_seconds(r) / steady_step_seconds(reference)
        predicted = r["predicted_step_seconds"] / reference["predicted_step_seconds"]
        assert (row["measured_ratio"], row["predicted_ratio"]) == (round(measured, 4), round(predicted, 4))
        assert row["ratio_error"] == round(predicted / measured - 1, 4) and row["measured_peak_gib"] is None
    assert report([str(output), "--output", str(tmp_path / "report.md")]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "| debug | no | 1 | offload_all |" in text and "no pairs in these files" in text
    assert "did not run" not in text
    # A probe that failed is named with its reason, not left out of the tables in silence
    failed = {**offloaded[0], "status": "error", "error": "RuntimeError: expected size 2048==2048,\nstride 4096==5120"}
    output.write_text("\n".join(json.dumps(r) for r in [*records, failed]) + "\n")
    assert report([str(output), "--output", str(tmp_path / "report.md")]) == 0
    text = (tmp_path / "report.md").read_text()
    assert "1 probe(s) did not run" in text
    assert (f"| debug | no | 1 | {failed['recompute']} | error | RuntimeError: expected size 2048==2048, stride "
            "4096==5120 |") in text
    with pytest.raises(SystemExit, match="not found"):
        report([str(tmp_path / "missing.jsonl")])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the compiled layers' offload path")
def test_compiled_layers_under_offload_on_cuda_give_the_same_gradients():
    model, x = two_blocks("cuda")
    reference = grads(model, x, model)
    compiled, context = torch.nn.Sequential(*(torch.compile(block) for block in model)), OffloadActivations(1024)

    def offloaded(inputs):
        with context:
            return compiled(inputs)

    got = grads(model, x, offloaded)
    for a, b in zip(got, reference):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    assert context.offloaded > 4 and context.host_bytes == 0
    assert_no_weight_moved(model, compiled, x)  # the compiled graphs' saved weights too


def test_the_trace_of_an_offloaded_step_shows_backward_one_application_ahead(tmp_path):
    """benchmarks/offload_trace.py on the real model (a CPU dry run, every application offloaded): each layer
    application starts at a boundary, backward never holds more fetched tensors than the rest of one application and
    the one before it (the per-unpack prefetch it replaced held 115 of 290 here), and none is left at the end."""
    from benchmarks.offload_trace import main

    output = tmp_path / "trace.json"
    assert main(["--preset", "debug", "--device", "cpu", "--seq_len", "32", "--steps", "2", "--placement",
                 "offload_all", "--eager", "--min_bytes", "1024", "--output", str(output)]) == 0
    trace = json.loads(output.read_text())
    summary = trace["summary"]
    assert trace["status"] == "ok" and summary["applications"] >= 4 and summary["unpacks"] == summary["saved_tensors"]
    assert 0 < summary["offloaded_tensors"] < summary["saved_tensors"]  # the small ones stay
    assert summary["largest_application"] <= summary["most_fetched_ahead"] < 2 * summary["largest_application"]
    assert summary["fetched_at_the_end"] == 0
    assert [event[0] for event in trace["events"]][:1] == ["B"] and trace["events"][-1][0] == "U"
