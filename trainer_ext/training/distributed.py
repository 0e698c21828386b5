"""Guards and fixes for training on several processes (FSDP2, DeepSpeed, plain data parallel).

* `check_optimizer_supports`: DeepSpeed owns gradients and the optimizer step, so the low-memory optimizer, which
  updates each parameter in place inside backward, is refused there up front. Under FSDP2 it updates the shards
  (trainer_ext/optim/shards.py).
* `bind_optimizer`: what the launch did to the model, the in-backward optimizer follows before the first backward.
* `decoder_hidden`: the training forward through what the launch wrapped (DDP, FSDP2's root).
* `check_processes_coordinated`: a launcher can start several processes that never form a group (accelerate
  turns FSDP/DeepSpeed on for accelerators only; without one each process trains alone on the same data and
  writes the same output directory). That is refused instead of wasting the run.
* `pretrained_class`: FSDP2 swaps the model's class for a generated `FSDP<Name>` subclass defined inside torch.
  `save_pretrained` writes the class's module into `config.auto_map` and copies that module's source, so a
  checkpoint saved from the sharded model would point at torch's FSDP code instead of the modeling file.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from trainer_ext.optim.optimizer import LowMemoryAdafactor

LOW_MEMORY_OPTIMIZER = "low_memory"
SAFE_CHOICE = "--optimizer hf --optim adamw_torch (or --optim adafactor)"

__all__ = [
    "LOW_MEMORY_OPTIMIZER",
    "check_optimizer_supports",
    "bind_optimizer",
    "check_processes_coordinated",
    "decoder_hidden",
    "is_fsdp_module",
    "pretrained_class",
    "saved_as_pretrained_class",
    "sharding_backend",
]


def _has_dtensor_parameters(model: nn.Module) -> bool:
    if not torch.distributed.is_available():  # builds without distributed support have no DTensor
        return False
    from torch.distributed.tensor import DTensor

    return any(isinstance(param, DTensor) for param in model.parameters())


def _state(accelerator):
    """`AcceleratorState` of an `Accelerator`, or the state itself, or None."""
    return getattr(accelerator, "state", accelerator)


def sharding_backend(model: nn.Module, accelerator=None) -> str | None:
    """"FSDP" or "DeepSpeed" when the model is (or is about to be) sharded, else None.

    `accelerator`: an `accelerate.Accelerator` (or its `AcceleratorState`). It matters because the HF Trainer
    creates the optimizer *before* `accelerator.prepare` shards the model under FSDP2 and DeepSpeed: at that
    moment the parameters are still plain tensors and only the accelerator knows what is coming.
    """
    state = _state(accelerator)
    if state is not None and getattr(state, "deepspeed_plugin", None) is not None:
        return "DeepSpeed"
    if state is not None and getattr(state, "fsdp_plugin", None) is not None:
        return "FSDP"
    if _has_dtensor_parameters(model):
        return "FSDP"
    return None


def check_optimizer_supports(model: nn.Module, optimizer_name: str, accelerator=None) -> None:
    """Raise ValueError if `optimizer_name` cannot train `model` under the sharding in use."""
    if optimizer_name != LOW_MEMORY_OPTIMIZER:
        return
    if sharding_backend(model, accelerator) != "DeepSpeed":
        return
    raise ValueError(
        f"--optimizer {LOW_MEMORY_OPTIMIZER} does not run under DeepSpeed, which owns the gradients and the optimizer "
        f"step: use FSDP2 (trainer_ext/configs/accelerate_fsdp2_*.yaml) with it, or pass {SAFE_CHOICE} under DeepSpeed "
        "(RecurrentTrainingArguments.optimizer / .optim)."
    )


def is_fsdp_module(model: nn.Module) -> bool:
    """Whether `fully_shard` (FSDP2) wrapped `model` itself."""
    if not torch.distributed.is_available():
        return False
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def bind_optimizer(wrapped_model: nn.Module, optimizer) -> None:
    """Make the in-backward low-memory optimizer follow what the launch did to the model; idempotent. Before the
    first backward and before a resumed optimizer state loads.

    * DDP (`wrapped_model` a DistributedDataParallel): each update runs in a communication hook after its bucket's
      all-reduce, on the gradient averaged over the processes; from the process's own gradient (the
      post-accumulate-grad hooks) the replicas would train apart.
    * FSDP2: accelerate swapped the sharded parameters into the optimizer's groups after the optimizer was built
      (the HF Trainer builds it first); its hooks and positions move to them and its state is created on the
      shards, so that a distributed checkpoint has tensors to load into.
    """
    if not isinstance(optimizer, LowMemoryAdafactor):
        return
    optimizer.rebind_parameters()
    if (isinstance(wrapped_model, DistributedDataParallel) and optimizer.in_backward
            and not getattr(wrapped_model, "_updates_after_all_reduce", False)):
        optimizer.update_after_all_reduce(wrapped_model)
        wrapped_model._updates_after_all_reduce = True


def check_processes_coordinated(accelerator) -> None:
    """Raise ValueError if the launcher started several processes but the accelerator runs each one alone.

    `accelerator`: an `Accelerator`, its `AcceleratorState`, or the `PartialState` of `TrainingArguments`
    (`training_args.distributed_state`), which `pretrain` and `find_lr` check before any work."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    state = _state(accelerator)
    num_processes = getattr(state, "num_processes", 1)
    if world_size > 1 and num_processes == 1:
        raise ValueError(
            f"The launcher started WORLD_SIZE={world_size} processes, but accelerate runs each one alone "
            f"(distributed_type={getattr(state, 'distributed_type', None)}): they would all train the same model on "
            "the same data and overwrite one output directory. FSDP and DeepSpeed need accelerators; on a machine "
            "without them launch one process, or pass --use_cpu true for CPU data parallelism over gloo."
        )


def pretrained_class(model: nn.Module) -> type:
    """The model's own class, under the `FSDP<Name>` subclass that FSDP2's `fully_shard` swaps in."""
    if not torch.distributed.is_available():
        return type(model)
    from torch.distributed.fsdp import FSDPModule

    return next(cls for cls in type(model).__mro__ if not issubclass(cls, FSDPModule))


@contextlib.contextmanager
def saved_as_pretrained_class(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block the model shows its own class, so `save_pretrained` records `auto_map` and copies the
    modeling code of the model, not of torch's FSDP wrapper. Only for saving: FSDP's hooks are untouched, but
    FSDPModule methods (unshard, reshard) are hidden until the block ends."""
    sharded_class = type(model)
    model.__class__ = pretrained_class(model)
    try:
        yield model
    finally:
        model.__class__ = sharded_class


def end_process_group() -> None:
    """Destroy the default process group of a launch (torchrun / accelerate launch), if there is one, at the end of a
    command: left to the interpreter's exit, a gloo group's threads can abort the process ("terminate called without
    an active exception", exit code -6) after a successful run. The finished run's objects are collected first: a
    trainer and its wrapped model form reference cycles, and DDP's reducer in them holds the group, which would
    otherwise outlive its destruction here and be torn down with the interpreter."""
    import gc

    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        gc.collect()
        dist.barrier()  # no process tears its end down while another still talks to it
        dist.destroy_process_group()


def decoder_hidden(model, unwrapped, input_ids, attention_mask, depth: dict) -> torch.Tensor:
    """The decoder's last hidden state, (B, T, C). Under DDP and FSDP2 from a forward through the wrapped root:
    only that readies DDP's gradient all-reduce and FSDP2's gathering of the root's own parameters (embeddings, the
    LM head, the final norm; the root keeps them gathered after its forward, for the loss that reads the LM head);
    the decoder called directly would leave each process training on its own gradient, or the root's parameters
    sharded. The LM head then runs on no position (the chunked loss applies it); the hidden state is taken from the
    decoder's output on its way."""
    if not (isinstance(model, DistributedDataParallel) or is_fsdp_module(unwrapped)):
        return unwrapped.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
                               **depth).last_hidden_state
    caught = {}
    handle = unwrapped.model.register_forward_hook(lambda module, args, output: caught.update(hidden=output[0]))
    try:
        model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False,
              logits_to_keep=torch.zeros(0, dtype=torch.long, device=input_ids.device), **depth)
    finally:
        handle.remove()
    return caught["hidden"]
