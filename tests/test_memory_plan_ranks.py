"""The memory planner on several processes: one rank of plain data parallelism (DDP's gradient buckets on top of one
card) or of FSDP2 (weights and optimizer state sharded, gathered and reduce-scattered buffers added), how the layout
is read from the training arguments and the launcher's environment, and the command line's --num_processes /
--sharding. One process plans as before."""

import json
import types

import pytest
import torch

from hf_recurrent import presets
from hf_recurrent.cost import parameter_counts
from trainer_ext.compat import CHECKPOINTING_FLAG
from trainer_ext.memory.estimator import GIB
from trainer_ext.memory.plan import MemoryPlanCallback, apply_memory_plan, plan_for_preset, training_shape
from trainer_ext.memory.processes import ProcessLayout, fsdp_units, layout_of, shard_state_bytes
from trainer_ext.memory.recompute import RecomputeCallback, RecomputeSet
from trainer_ext.training.arguments import RecurrentTrainingArguments
from trainer_ext.optim.state import low_memory_state, optimizer_state_bytes

LAUNCH_ENV = ("ACCELERATE_USE_FSDP", "FSDP_VERSION", "FSDP_ACTIVATION_CHECKPOINTING", "FSDP_RESHARD_AFTER_FORWARD",
              "FSDP_OFFLOAD_PARAMS", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_MIXED_PRECISION")


@pytest.fixture(autouse=True)
def no_launcher_environment(monkeypatch):
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)


def test_one_process_plans_as_before():
    shape = training_shape(presets.get("recurrent-3.3b"))
    assert (shape.num_processes, shape.sharding, shape.process_terms) == (1, None, ())
    assert shape.fixed_bytes == shape.weight_bytes + shape.optimizer_state_bytes
    plan = plan_for_preset("recurrent-3.3b", 2048, 24)
    assert plan == plan_for_preset("recurrent-3.3b", 2048, 24, num_processes=1, sharding=None)
    saved = plan.to_dict()
    assert (saved["num_processes"], saved["sharding"]) == (1, None)
    assert set(saved["per_rank_fixed_gib"]) == {"weights", "optimizer_state"}
    assert "processes" not in plan.describe()


@pytest.mark.parametrize("preset", ["debug", "recurrent-7b", "transformer-125m"])
def test_one_shard_holds_the_optimizers_own_state_and_the_units_cover_the_model(preset):
    config = presets.get(preset)
    layers, root = fsdp_units(config)
    numel = [torch.Size(s).numel() for s in [s for layer in layers for s in layer] + root]
    assert sum(numel) == parameter_counts(config).unique and len(layers) >= 2
    for state in (low_memory_state(None, None), low_memory_state(0.9, None), low_memory_state(0.9, 1 / 16)):
        shapes = [s for layer in layers for s in layer] + root
        assert sum(shard_state_bytes(state, s, 1) for s in shapes) == optimizer_state_bytes(config, state)


def _shape(preset, processes=1, sharding=None, **kwargs):
    return training_shape(presets.get(preset), num_processes=processes, sharding=sharding, **kwargs)


def test_fsdp2_shards_weights_and_state_over_the_ranks_and_adds_its_buffers():
    one, two, four = (_shape("recurrent-7b", n, "fsdp2" if n > 1 else None) for n in (1, 2, 4))
    assert two.weight_bytes * 2 == one.weight_bytes == four.weight_bytes * 4  # every dim 0 divides by 2 and 4
    # Rows of statistics and momentum are sharded, column statistics and subspace bases replicated (as the
    # optimizer keeps them): the sharded part halves from 2 to 4 ranks as it did from 1 to 2.
    assert one.optimizer_state_bytes - two.optimizer_state_bytes == 2 * (
        two.optimizer_state_bytes - four.optimizer_state_bytes) > 0
    full_momentum = [_shape("recurrent-3.3b", n, "fsdp2" if n > 1 else None, rank_fraction=1.0) for n in (1, 2)]
    assert full_momentum[1].optimizer_state_bytes == pytest.approx(full_momentum[0].optimizer_state_bytes / 2,
                                                                   rel=1e-3)
    layers, root = fsdp_units(presets.get("recurrent-7b"))
    layer, root_numel = max(sum(torch.Size(s).numel() for s in unit) for unit in layers), \
        sum(torch.Size(s).numel() for s in root)
    assert root_numel == 2 * 65536 * 4096 + 4096 * 8192 + 3 * 4096  # embeddings, head, adapter, norms
    assert dict(two.process_terms) == {"fsdp_gathered_layers": 2 * layer * 2, "fsdp_root_parameters": root_numel * 2,
                                       "fsdp_root_gradients": root_numel * 2,
                                       "fsdp_reduce_scatter": layer * 2 + layer // 2 * 2}
    # Accelerate's mixed precision keeps fp32 master shards: twice the weights, momentum in fp32 too.
    upcast = _shape("recurrent-7b", 2, "fsdp2", sharded_weight_bytes=4)
    assert upcast.weight_bytes == 2 * two.weight_bytes and upcast.optimizer_state_bytes > two.optimizer_state_bytes


def test_fsdp2_on_two_cards_plans_a_batch_at_least_one_cards():
    one = plan_for_preset("recurrent-7b", 2048, 24)
    two = plan_for_preset("recurrent-7b", 2048, 24, num_processes=2, sharding="fsdp2", mixed_precision="no")
    assert two.per_device_train_batch_size >= one.per_device_train_batch_size
    assert two.predicted_peak_gib <= 24 - 1.4 and (two.num_processes, two.sharding) == (2, "fsdp2")
    assert two.fixed_gib["weights"] == pytest.approx(one.fixed_gib["weights"] / 2, abs=1e-3)
    assert two.fixed_gib["optimizer_state"] < one.fixed_gib["optimizer_state"]
    saved = two.to_dict()
    assert saved["num_processes"] == 2 and saved["sharding"] == "fsdp2"
    assert {"fsdp_gathered_layers", "fsdp_root_parameters", "fsdp_reduce_scatter"} <= set(saved["per_rank_fixed_gib"])
    assert "on each of 2 processes (fsdp2)" in two.describe()


def test_data_parallel_adds_the_whole_gradient_in_buckets_and_plans_no_faster_than_one_card():
    one, ddp = _shape("recurrent-3.3b"), _shape("recurrent-3.3b", 2, "ddp")
    params = parameter_counts(presets.get("recurrent-3.3b")).unique
    assert dict(ddp.process_terms) == {"ddp_gradient_buckets": 2 * params}
    assert (ddp.weight_bytes, ddp.optimizer_state_bytes) == (one.weight_bytes, one.optimizer_state_bytes)
    assert ddp.fixed_bytes == one.fixed_bytes + 2 * one.params
    assert _shape("recurrent-3.3b", 2) == ddp  # several processes without a sharding are data parallel
    # 26 GiB: on 24 the 3.3B model's rank, 6.3 GiB of buckets on top, leaves no batch within the margin.
    single = plan_for_preset("recurrent-3.3b", 2048, 26)
    plan = plan_for_preset("recurrent-3.3b", 2048, 26, num_processes=2, sharding="ddp")
    assert plan.predicted_tokens_per_second <= single.predicted_tokens_per_second  # less room for activations
    assert plan.fixed_gib["ddp_gradient_buckets"] == pytest.approx(2 * one.params / GIB, abs=1e-3)
    # recurrent-7b replicated on each card does not fit 24 GiB: the error names what each rank holds.
    with pytest.raises(ValueError, match=r"On 2 processes \(ddp\) each rank holds \d+\.\d+ GiB.*FSDP2"):
        plan_for_preset("recurrent-7b", 2048, 24, num_processes=2, sharding="ddp")


@pytest.mark.parametrize("kwargs, message", [
    ({"num_processes": 2, "sharding": "zero3"}, r"--sharding='zero3' is not known; choose ddp .*fsdp2"),
    ({"num_processes": 2, "sharding": "fsdp"}, r"--sharding='fsdp' is not known"),
    ({"num_processes": 1, "sharding": "ddp"}, r"--sharding=ddp needs --num_processes 2 or more"),
    ({"num_processes": 0}, r"--num_processes=0 is not allowed"),
    ({"num_processes": 2, "sharding": "fsdp2", "mixed_precision": "fp4"}, r"--mixed_precision='fp4' is not known"),
])
def test_unknown_layouts_are_refused_naming_the_allowed_values(kwargs, message):
    with pytest.raises(ValueError, match=message):
        plan_for_preset("recurrent-3.3b", 2048, 24, **kwargs)


def test_cli_plans_one_rank_of_several(capsys):
    from trainer_ext.cli.plan_memory import main

    assert main(["--preset", "recurrent-7b", "--num_processes", "2", "--sharding", "fsdp2", "--mixed_precision", "no",
                 "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert (plan["num_processes"], plan["sharding"]) == (2, "fsdp2") and plan["per_device_train_batch_size"] >= 1
    assert main(["--preset", "recurrent-7b", "--num_processes", "2", "--sharding", "fsdp2"]) == 0
    out = capsys.readouterr().out  # the default: mixed_precision no, as in accelerate_fsdp2_<N>x24gb.yaml
    assert "on each of 2 processes (fsdp2)" in out and "fp32 master shards" not in out
    assert main(["--preset", "recurrent-7b", "--num_processes", "2", "--sharding", "fsdp2", "--mixed_precision",
                 "bf16"]) == 0
    out = capsys.readouterr().out
    assert "on each of 2 processes (fsdp2)" in out and "fp32 master shards" in out
    assert "accelerate launch --config_file" in out and "--num_processes 2" in out
    assert main(["--preset", "recurrent-3.3b", "--num_processes", "2", "--sharding", "zero3"]) == 2
    assert "--sharding='zero3' is not known" in capsys.readouterr().err


def test_the_layout_is_read_from_the_arguments_and_the_launchers_environment(monkeypatch):
    args = types.SimpleNamespace(world_size=2, deepspeed=None, fsdp_plugin_args=None, mixed_precision="no")
    assert layout_of(args) == ProcessLayout(2, "ddp")
    assert layout_of(types.SimpleNamespace(world_size=1)) == ProcessLayout(1, None)
    # transformers' --fsdp / --fsdp_config (fsdp_plugin_args) with accelerate's mixed precision: fp32 master shards
    fsdp = types.SimpleNamespace(world_size=4, deepspeed=None, mixed_precision="bf16",
                                 fsdp_plugin_args={"fsdp_version": 2, "reshard_after_forward": True,
                                                   "activation_checkpointing": True})
    assert layout_of(fsdp) == ProcessLayout(4, "fsdp2", 4, True)
    fsdp.fsdp_plugin_args = {"fsdp_version": 1}
    assert "FSDP version 1" in layout_of(fsdp).not_planned
    # accelerate launch --config_file accelerate_fsdp2_2x24gb.yaml sets the environment instead
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    assert "FSDP version 1" in layout_of(args).not_planned  # accelerate's default version
    monkeypatch.setenv("FSDP_VERSION", "2")
    assert layout_of(args) == ProcessLayout(2, "fsdp2")
    monkeypatch.setenv("FSDP_RESHARD_AFTER_FORWARD", "false")
    assert "reshard_after_forward" in layout_of(args).not_planned
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    assert "DeepSpeed" in layout_of(args).not_planned


def _auto_args(tmp_path, **kwargs):
    args = RecurrentTrainingArguments(output_dir=str(tmp_path), memory_plan="auto", torch_compile=True, **kwargs)
    assert args.world_size == 1  # its device is set up on the CPU before CUDA is faked
    return args


def fake_24gb_cuda_on(monkeypatch, world_size, gib=24):
    """A 24 GiB card (or one of `gib`) seen by the planner only, on each of `world_size` processes."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _: types.SimpleNamespace(total_memory=gib * GIB))
    monkeypatch.setattr(RecurrentTrainingArguments, "world_size", property(lambda self: world_size))


def _plan(callbacks):
    return next(c for c in callbacks if isinstance(c, MemoryPlanCallback)).plan


def test_training_plans_one_rank_of_data_parallel_and_of_fsdp2(tmp_path, monkeypatch, caplog):
    config = presets.get("recurrent-3.3b")
    single_args, ddp_args, fsdp_args, override = (_auto_args(tmp_path) for _ in range(4))
    # 26 GiB: on 24 a data-parallel rank of the 3.3B model (6.3 GiB of buckets on top) has no batch within the margin
    fake_24gb_cuda_on(monkeypatch, 1, gib=26)
    single = _plan(apply_memory_plan(single_args, config, 2048, 2))
    assert single.sharding is None
    fake_24gb_cuda_on(monkeypatch, 2, gib=26)
    with caplog.at_level("INFO", logger="trainer_ext.memory.plan"):
        ddp = _plan(apply_memory_plan(ddp_args, config, 2048, 2))
    assert (ddp.num_processes, ddp.sharding) == (2, "ddp")
    assert ddp_args.per_device_train_batch_size == ddp.per_device_train_batch_size
    assert ddp.predicted_tokens_per_second <= single.predicted_tokens_per_second  # each rank holds the buckets too
    assert any("on each of 2 processes (ddp)" in r.getMessage() and "ddp_gradient_buckets" in r.getMessage()
               for r in caplog.records)
    monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
    monkeypatch.setenv("FSDP_VERSION", "2")
    callbacks = apply_memory_plan(fsdp_args, config, 2048, 2)
    fsdp = _plan(callbacks)
    assert (fsdp.num_processes, fsdp.sharding) == (2, "fsdp2")
    assert fsdp.predicted_tokens_per_second >= single.predicted_tokens_per_second  # each rank holds half the state
    assert any(isinstance(c, RecomputeCallback) for c in callbacks) and not fsdp.recompute.empty
    # Explicit arguments replace what the launch says.
    assert _plan(apply_memory_plan(override, config, 2048, 2, num_processes=4)).num_processes == 4


def test_fsdps_own_checkpointing_is_planned_as_every_layer_recomputed(tmp_path, monkeypatch):
    # transformers refuses its checkpointing flag next to FSDP's: the plan keeps the flag as given.
    args = _auto_args(tmp_path, fsdp=True, fsdp_config={"version": 2, "activation_checkpointing": True},
                      **{CHECKPOINTING_FLAG: False})
    fake_24gb_cuda_on(monkeypatch, 2)
    callbacks = apply_memory_plan(args, presets.get("recurrent-3.3b"), 2048, 2)
    plan = _plan(callbacks)
    assert plan.sharding == "fsdp2" and getattr(args, CHECKPOINTING_FLAG) is False
    shape = training_shape(presets.get("recurrent-3.3b"), num_processes=2, sharding="fsdp2")
    assert plan.recompute == RecomputeSet.named("all", shape, shape.graph_steps)
    assert not any(isinstance(c, RecomputeCallback) for c in callbacks)


@pytest.mark.parametrize("env, reason", [({"ACCELERATE_USE_DEEPSPEED": "true"}, "DeepSpeed"),
                                         ({"ACCELERATE_USE_FSDP": "true"}, "FSDP version 1")])
def test_deepspeed_and_fsdp1_are_not_planned_and_say_why(tmp_path, monkeypatch, caplog, env, reason):
    args = _auto_args(tmp_path, per_device_train_batch_size=3)
    fake_24gb_cuda_on(monkeypatch, 2)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with caplog.at_level("WARNING", logger="trainer_ext.memory.plan"):
        assert apply_memory_plan(args, presets.get("recurrent-3.3b"), 2048, 2) == []
    assert args.per_device_train_batch_size == 3
    assert any("not applied" in r.getMessage() and reason in r.getMessage() for r in caplog.records)


def test_allocator_settings_other_than_the_calibrations_are_said_and_their_records_not_fitted(tmp_path, monkeypatch,
                                                                                               caplog):
    from trainer_ext.devices import allocator_settings
    from trainer_ext.memory.probes import usable_probes

    for name in ("PYTORCH_ALLOC_CONF", "PYTORCH_CUDA_ALLOC_CONF"):
        monkeypatch.delenv(name, raising=False)
    config, default_args, expandable_args = presets.get("recurrent-3.3b"), _auto_args(tmp_path), _auto_args(tmp_path)
    fake_24gb_cuda_on(monkeypatch, 1)
    with caplog.at_level("INFO", logger="trainer_ext.memory.plan"):
        apply_memory_plan(default_args, config, 2048, 2)
    assert allocator_settings() == "" and not any("allocator" in r.getMessage() for r in caplog.records)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    caplog.clear()
    with caplog.at_level("INFO", logger="trainer_ext.memory.plan"):
        apply_memory_plan(expandable_args, config, 2048, 2)
    assert any("allocator's defaults, not 'expandable_segments:True'" in r.getMessage() for r in caplog.records)
    record = {"status": "ok", "peak_reserved_bytes": 10 * GIB, "step_seconds": [1.0, 1.0], "recompute_set": {}}
    settings = ["", "max_split_size_mb:512", "expandable_segments:False", "expandable_segments: True"]
    assert [bool(usable_probes([{**record, "allocator": s}])) for s in settings] == [True, True, True, False]
