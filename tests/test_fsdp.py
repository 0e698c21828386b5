"""FSDP2 on CPU: two gloo processes (tests/fsdp_worker.py) train the debug preset sharded and must match one
process training on the whole batch; the gathered full state dict must load with `from_pretrained`."""

import json
import os
import types

import pytest
import torch
from transformers import AutoModelForCausalLM

import fsdp_worker
from launcher import launch
from trainer_ext.training.distributed import (
    check_optimizer_supports,
    check_processes_coordinated,
    pretrained_class,
    saved_as_pretrained_class,
    sharding_backend,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAIN_STEPS = 3
WORKER_TIMEOUT_S = 180  # a normal run takes ~15 s on 2 cores; a hung collective must not hang the suite


@pytest.fixture(scope="module")
def fsdp_run(tmp_path_factory):
    """Runs the 2-process FSDP2 worker once; returns (output_dir, report)."""
    out = tmp_path_factory.mktemp("fsdp")
    proc = launch(os.path.join(REPO, "tests", "fsdp_worker.py"), 2, "--output_dir", out, "--train_steps", TRAIN_STEPS,
                  timeout=WORKER_TIMEOUT_S)
    assert proc.returncode == 0, f"FSDP worker failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}"
    with open(out / "report.json") as f:
        return out, json.load(f)


@pytest.fixture(scope="module")
def reference():
    """One process, the whole global batch, the same steps: (per-step losses, trained model)."""
    model = fsdp_worker.build_model()
    optimizer = fsdp_worker.make_optimizer(model)
    batch = fsdp_worker.global_batch(model.config.vocab_size)
    losses = [fsdp_worker.train_step(model, optimizer, batch).item() for _ in range(TRAIN_STEPS)]
    return losses, model.eval()


def test_model_is_really_sharded(fsdp_run):
    _, report = fsdp_run
    assert report["world_size"] == 2
    # 4 decoder layers (1 prelude, 2 core, 1 coda) plus the root.
    assert report["fsdp_units"] == 5
    assert report["all_params_dtensor"]
    assert report["local_numel"] < report["full_numel"]
    assert report["local_numel"] >= report["full_numel"] // 2  # even split, padding at most
    assert report["sharded_class"].startswith("torch.") and report["sharded_class"].endswith(
        "FSDPRecurrentDepthForCausalLM")


def test_sharded_losses_match_single_process(fsdp_run, reference):
    _, report = fsdp_run
    losses, _ = reference
    assert len(report["losses"]) == TRAIN_STEPS
    assert report["losses"][-1] < report["losses"][0]  # it trains
    # Same arithmetic up to reduction order: averaged shard gradients equal the whole-batch gradient.
    torch.testing.assert_close(torch.tensor(report["losses"]), torch.tensor(losses), rtol=1e-5, atol=0)


def test_full_state_dict_checkpoint_loads_and_matches(fsdp_run, reference):
    out, report = fsdp_run
    _, trained = reference
    final = out / "final"
    # Saved under the model's own class: auto_map names the modeling file, and no torch FSDP source is copied.
    with open(final / "config.json") as f:
        config = json.load(f)
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_recurrent_depth.RecurrentDepthForCausalLM"
    assert config["architectures"] == ["RecurrentDepthForCausalLM"]
    assert not [name for name in os.listdir(final) if name.startswith("_fsdp")]
    assert report["class_after_save"] == "FSDPRecurrentDepthForCausalLM"  # restored after saving
    assert report["state_dict_keys"] == len(trained.state_dict())

    loaded = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    loaded_state = loaded.state_dict()
    for name, tensor in trained.state_dict().items():
        # Adam divides by sqrt(v): a near-zero gradient's rounding can move one element by ~1e-6. A misplaced
        # shard or a stale step would be off by the update size (lr = 1e-3) or the init scale (0.02).
        torch.testing.assert_close(loaded_state[name], tensor, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")
    ids = fsdp_worker.probe_ids(trained.config.vocab_size)
    with torch.no_grad():
        expected = trained(ids, num_steps=fsdp_worker.DEPTH, use_cache=False).logits
        got = loaded(ids, num_steps=fsdp_worker.DEPTH, use_cache=False).logits
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_low_memory_optimizer_accepted_on_dtensor_parameters(fsdp_run):
    _, report = fsdp_run
    assert report["sharding_backend"] == "FSDP"
    assert report["low_memory_error"] is None  # it updates FSDP2's shards (tests/test_fsdp_optimizer.py)
    assert report["hf_error"] is None


def _accelerator(**state):
    defaults = {"fsdp_plugin": None, "deepspeed_plugin": None, "num_processes": 1, "distributed_type": "NO"}
    return types.SimpleNamespace(state=types.SimpleNamespace(**{**defaults, **state}))


def test_optimizer_guard_reads_the_accelerator_before_sharding():
    # The Trainer builds the optimizer before accelerate shards the model: parameters are still plain tensors.
    model = torch.nn.Linear(4, 4)
    assert sharding_backend(model) is None
    check_optimizer_supports(model, "low_memory")
    check_optimizer_supports(model, "low_memory", _accelerator())
    fsdp = _accelerator(fsdp_plugin=object())
    assert sharding_backend(model, fsdp) == "FSDP"
    check_optimizer_supports(model, "low_memory", fsdp)
    deepspeed = _accelerator(deepspeed_plugin=object())
    assert sharding_backend(model, deepspeed) == "DeepSpeed"
    with pytest.raises(ValueError, match="does not run under DeepSpeed.*FSDP2.*--optimizer hf --optim adamw_torch"):
        check_optimizer_supports(model, "low_memory", deepspeed)
    check_optimizer_supports(model, "hf", deepspeed)


def test_uncoordinated_processes_are_refused(monkeypatch):
    # What `accelerate launch` with an FSDP config gives on a machine without accelerators: WORLD_SIZE=2, yet
    # accelerate's distributed_type is NO and every process trains alone.
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="WORLD_SIZE=2.*--use_cpu true"):
        check_processes_coordinated(_accelerator())
    check_processes_coordinated(_accelerator(num_processes=2, distributed_type="MULTI_CPU"))
    monkeypatch.setenv("WORLD_SIZE", "1")
    check_processes_coordinated(_accelerator())


def test_pretrained_class_of_an_unsharded_model_is_its_class():
    model = fsdp_worker.build_model()
    assert pretrained_class(model) is type(model)
    with saved_as_pretrained_class(model) as same:
        assert same is model and type(model).__name__ == "RecurrentDepthForCausalLM"
