"""Memory of one process among several: what plain data parallelism adds to one card's figures, and what FSDP2
takes away and adds. The planner then plans one rank: its batch is per device.

Data parallel (`ddp`: torchrun, `accelerate launch --multi_gpu`): each rank holds the whole model and optimizer state,
as one process does. With the in-backward optimizer each update runs in a DDP communication hook after its bucket's
all-reduce, but DDP allocates all its buckets up front (`bucket_cap_mb` only groups the parameters) and they hold the
whole gradient in the parameters' dtype until the step ends. One process holds only the gradient that the update in
progress reads (inside the estimator's fitted transient: the head's V x H gradient at the start of backward, or one
layer's), so the buckets come on top, whole: trainable parameters x bytes per parameter.

FSDP2 (`fsdp2`: `fully_shard` on each decoder layer, then on the root; parameters sharded on dim 0 over N ranks): a
rank holds ceil(R / N) rows of every parameter (FSDP2 pads dim 0 to a multiple of N) and the optimizer state shaped
like them (`trainer_ext.optim.shards`: row statistics, second moments of vectors and momentum sharded; column
statistics, subspace bases and step counters replicated). Unsharded while in use, in the compute dtype:
  - the gathered decoder layers: the one running and the one prefetched;
  - the root's parameters (embeddings, LM head, norms, adapter): FSDP2 does not reshard the root after forward, so
    they stay gathered through forward and backward;
  - the root's gradients: the root's inputs (token ids) need no gradient, so its reduce-scatter waits for the end of
    backward, and the head's gradient, made first, is held all through backward;
  - a decoder layer's reduce-scatter: its unsharded gradient and the sharded result.
Accelerate's mixed precision, other than `no` (this package's `accelerate_fsdp2_<N>x24gb.yaml` set `no`), upcasts the
parameters to fp32 master weights before sharding them: the shards, their gradients and momentum (kept in the weights'
dtype) then take 4 bytes an element.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from dataclasses import dataclass

SHARDINGS = ("ddp", "fsdp2")
FP32_BYTES = 4


def resolve_sharding(num_processes: int, sharding: str | None, prefix: str = "--") -> str | None:
    """The sharding to plan (None: one process alone), or ValueError naming the allowed values. Several processes
    without a sharding are data parallel: what torchrun starts without FSDP."""
    if isinstance(num_processes, bool) or not isinstance(num_processes, int) or num_processes < 1:
        raise ValueError(f"{prefix}num_processes={num_processes!r} is not allowed; it must be an integer >= 1.")
    if sharding in (None, "none"):
        return "ddp" if num_processes > 1 else None
    if sharding not in SHARDINGS:
        raise ValueError(f"{prefix}sharding={sharding!r} is not known; choose ddp (data parallel: torchrun, "
                         "accelerate launch --multi_gpu), fsdp2 (accelerate_fsdp2_<N>x24gb.yaml) or none (one "
                         "process). DeepSpeed is not planned.")
    if sharding == "ddp" and num_processes < 2:
        raise ValueError(f"{prefix}sharding=ddp needs {prefix}num_processes 2 or more: one process trains without "
                         "the DDP wrapper (leave the sharding unset).")
    return sharding


@dataclass(frozen=True)
class ProcessLayout:
    """How a launched training spreads over processes, as the planner needs it (`layout_of` reads it)."""

    num_processes: int = 1
    sharding: str | None = None
    sharded_weight_bytes: int | None = None  # per element of an FSDP2 shard; None: the model's dtype
    fsdp_activation_checkpointing: bool = False  # FSDP's own checkpointing recomputes every decoder layer
    not_planned: str | None = None  # why no plan applies (DeepSpeed, FSDP1, ...), or None


def _flag(value) -> bool:
    return str(value).strip().lower() in ("1", "true", "yes", "on")


def layout_of(training_args) -> ProcessLayout:
    """The layout of a training from its arguments: `world_size`, FSDP from `fsdp_plugin_args` (what transformers
    5.x builds from `--fsdp` / `--fsdp_config`) or else the environment `accelerate launch --config_file` sets
    (ACCELERATE_USE_FSDP, FSDP_VERSION, ...), DeepSpeed from `--deepspeed` or ACCELERATE_USE_DEEPSPEED."""
    num = training_args.world_size
    if (getattr(training_args, "deepspeed", None) or getattr(training_args, "deepspeed_plugin", None) is not None
            or _flag(os.environ.get("ACCELERATE_USE_DEEPSPEED", "false"))):
        return ProcessLayout(num, not_planned="DeepSpeed's partitioned state is not modelled")
    plugin = getattr(training_args, "fsdp_plugin_args", None)
    if plugin:  # transformers passes these to accelerate's plugin, ahead of the environment
        version, checkpointing = int(plugin.get("fsdp_version", 2)), _flag(plugin.get("activation_checkpointing"))
        reshard, offload = _flag(plugin.get("reshard_after_forward", True)), _flag(plugin.get("cpu_offload"))
    elif _flag(os.environ.get("ACCELERATE_USE_FSDP", "false")):
        version = int(os.environ.get("FSDP_VERSION", "1"))  # accelerate's default when the variable is unset
        checkpointing = _flag(os.environ.get("FSDP_ACTIVATION_CHECKPOINTING", "false"))
        reshard = _flag(os.environ.get("FSDP_RESHARD_AFTER_FORWARD", "true"))
        offload = _flag(os.environ.get("FSDP_OFFLOAD_PARAMS", "false"))
    else:
        return ProcessLayout(num, "ddp" if num > 1 else None)
    reason = (version != 2 and f"FSDP version {version} is not modelled (FSDP2 is: fsdp_version 2)"
              or not reshard and "FSDP2 without reshard_after_forward keeps every layer gathered; not modelled"
              or offload and "FSDP's CPU offload is not modelled")
    if reason:
        return ProcessLayout(num, not_planned=reason)
    # accelerate keeps fp32 master shards under any mixed precision (its fsdp2_prepare_model upcasts them)
    upcast = getattr(training_args, "mixed_precision", "no") not in (None, "no")
    return ProcessLayout(num, "fsdp2", FP32_BYTES if upcast else None, checkpointing)


def fsdp_units(config) -> tuple[list[list[tuple[int, ...]]], list[tuple[int, ...]]]:
    """Shapes of the trainable parameters of each decoder layer (the class names in `_no_split_modules`, which
    accelerate's transformer-based wrap shards one unit each) and of the root (everything else), from a model on the
    meta device. Shared (tied) parameters are listed once."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(copy.deepcopy(config))
    layer_classes = set(getattr(model, "_no_split_modules", None) or ())
    layers, claimed = [], set()
    for module in model.modules():
        if type(module).__name__ in layer_classes:
            params = [p for p in module.parameters() if p.requires_grad and id(p) not in claimed]
            claimed |= {id(p) for p in params}
            layers.append([tuple(p.shape) for p in params])
    root = [tuple(p.shape) for p in model.parameters() if p.requires_grad and id(p) not in claimed]
    return layers, root


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


def _shard_numel(shape: tuple[int, ...], shards: int) -> int:
    return -(-shape[0] // shards) * math.prod(shape[1:]) if shape else 1


def shard_state_bytes(state, shape: tuple[int, ...], shards: int) -> int:
    """LowMemoryAdafactor's state of one rank's shard of a parameter of `shape` (`OptimizerState.tensor_bytes` of the
    whole tensor at `shards` = 1): rows sharded, columns whole; the momentum's subspace rank is the whole weight's."""
    from trainer_ext.optim.optimizer import subspace_rank

    if not _numel(shape):
        return 0
    rows = -(-shape[0] // shards)
    block = (rows, *shape[1:])
    numel = _numel(block)
    if state.factored_second_moment and len(shape) >= 2:
        second = _numel(block[:-1]) + _numel(block[:-2]) * shape[-1]  # row statistics sharded, column ones whole
    else:
        second = numel
    first = numel * state.first_moment_bytes
    if state.first_moment_bytes and state.momentum_rank_fraction is not None and len(shape) == 2:
        rank = subspace_rank(shape, state.momentum_rank_fraction)
        first = rows * rank * state.first_moment_bytes + shape[1] * rank * FP32_BYTES  # + the whole fp32 basis
    return numel * state.master_weight_bytes + first + second * state.second_moment_bytes + state.step_bytes


def per_rank_shape(shape, config, state, bytes_per_param: int, num_processes: int = 1, sharding: str | None = None,
                   sharded_weight_bytes: int | None = None):
    """`shape` (a one-process `ModelShape`) as one rank of `num_processes` sees it: its weights and optimizer state
    per rank and the named terms that several processes add (`ModelShape.process_terms`, bytes)."""
    sharding = resolve_sharding(num_processes, sharding)
    if sharding is None:
        return shape
    if sharding == "ddp":
        return dataclasses.replace(shape, num_processes=num_processes, sharding=sharding,
                                   process_terms=(("ddp_gradient_buckets", shape.params * bytes_per_param),))
    shard_bytes = sharded_weight_bytes or bytes_per_param
    if state.first_moment_bytes:  # the optimizer keeps momentum in the weights' dtype
        state = dataclasses.replace(state, first_moment_bytes=shard_bytes)
    layers, root = fsdp_units(config)
    every = [s for layer in layers for s in layer] + root
    largest = max(layers, key=lambda layer: sum(map(_numel, layer)), default=[])
    largest_numel, root_numel = sum(map(_numel, largest)), sum(map(_numel, root))
    terms = (("fsdp_gathered_layers", min(2, len(layers)) * largest_numel * bytes_per_param),
             ("fsdp_root_parameters", root_numel * bytes_per_param),
             ("fsdp_root_gradients", root_numel * bytes_per_param),
             ("fsdp_reduce_scatter", largest_numel * bytes_per_param
              + sum(_shard_numel(s, num_processes) for s in largest) * shard_bytes))
    return dataclasses.replace(
        shape, weight_bytes=sum(_shard_numel(s, num_processes) for s in every) * shard_bytes,
        optimizer_state_bytes=sum(shard_state_bytes(state, s, num_processes) for s in every),
        num_processes=num_processes, sharding=sharding, process_terms=terms)
