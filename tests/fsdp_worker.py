"""FSDP2 worker for tests/test_fsdp.py: trains the debug preset for a few steps on CPU (gloo), sharded over the
launched processes, then gathers a full state dict and saves it with `save_pretrained`.

    CUDA_VISIBLE_DEVICES= python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/fsdp_worker.py --output_dir OUT

Rank 0 writes OUT/report.json (per-step global losses, sharding facts, the optimizer guard's answer) and the
checkpoint OUT/final. The helpers below (model, batch, step) are shared with the single-process reference run
in the test, so both sides do the same arithmetic.
"""

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from transformers import AutoModelForCausalLM  # noqa: E402

import hf_recurrent  # noqa: E402,F401  (registers the model with the Auto classes)
from hf_recurrent import presets  # noqa: E402
from launcher import leave_without_teardown  # noqa: E402
from trainer_ext.training.distributed import check_optimizer_supports, saved_as_pretrained_class, sharding_backend  # noqa: E402

SEED = 0
DEPTH = 3  # fixed recurrence, so every rank and the reference run the same graph
BATCH_SIZE = 4  # global batch, split evenly across ranks
SEQ_LEN = 16
LEARNING_RATE = 1e-3
DECODER_LAYER = "RecurrentDepthDecoderLayer"


def build_model() -> torch.nn.Module:
    torch.manual_seed(SEED)
    config = presets.get("debug")
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation="sdpa")
    return model.train()


def global_batch(vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED + 1)
    return torch.randint(0, vocab_size, (BATCH_SIZE, SEQ_LEN), generator=generator)  # (B, T)


def probe_ids(vocab_size: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(SEED + 2)
    return torch.randint(0, vocab_size, (2, SEQ_LEN), generator=generator)


def make_optimizer(model: torch.nn.Module) -> torch.optim.Optimizer:
    # foreach=False: the same per-tensor kernels on DTensor shards and on whole tensors.
    return torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, weight_decay=0.1, foreach=False)


def train_step(model, optimizer, input_ids: torch.Tensor) -> torch.Tensor:
    """One step on `input_ids`; returns the mean next-token loss of this batch (detached)."""
    loss = model(input_ids=input_ids, labels=input_ids, num_steps=DEPTH, use_cache=False).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def shard(model: torch.nn.Module, mesh) -> int:
    """FSDP2: each decoder layer is its own unit (prelude, core, coda alike), then the root; returns the units."""
    from torch.distributed.fsdp import fully_shard

    layers = [m for m in model.modules() if type(m).__name__ == DECODER_LAYER]
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return len(layers) + 1


def _guard_answer(model, optimizer_name: str) -> str | None:
    try:
        check_optimizer_supports(model, optimizer_name)
    except ValueError as error:
        return str(error)
    return None


def _write_json(path: str, payload: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(payload, f, indent=1)
    os.replace(tmp, path)


def run(output_dir: str, train_steps: int) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    rank, world = dist.get_rank(), dist.get_world_size()
    if BATCH_SIZE % world:
        raise ValueError(f"--nproc_per_node={world} must divide the global batch of {BATCH_SIZE}.")
    model = build_model()
    batch = global_batch(model.config.vocab_size).chunk(world)[rank]
    units = shard(model, init_device_mesh("cpu", (world,)))
    params = list(model.parameters())
    report = {
        "world_size": world,
        "fsdp_units": units,
        "sharded_class": f"{type(model).__module__}.{type(model).__name__}",
        "sharding_backend": sharding_backend(model),
        "all_params_dtensor": all(isinstance(p, DTensor) for p in params),
        # Proof of sharding: this rank holds fewer elements than the model has.
        "local_numel": sum(p.to_local().numel() for p in params if isinstance(p, DTensor)),
        "full_numel": sum(p.numel() for p in params),
        "low_memory_error": _guard_answer(model, "low_memory"),
        "hf_error": _guard_answer(model, "hf"),
        "losses": [],
    }
    optimizer = make_optimizer(model)
    for _ in range(train_steps):
        loss = train_step(model, optimizer, batch)
        # Every rank has the same number of tokens, so the mean of rank means is the global-batch mean.
        dist.all_reduce(loss, op=dist.ReduceOp.SUM)
        report["losses"].append(loss.item() / world)

    # Collective: every rank takes part; rank 0 receives the whole tensors on the CPU.
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full_state = get_model_state_dict(model, options=options)
    if rank == 0:
        report["state_dict_keys"] = len(full_state)
        with saved_as_pretrained_class(model):
            model.save_pretrained(os.path.join(output_dir, "final"), state_dict=full_state)
        report["class_after_save"] = type(model).__name__
        _write_json(os.path.join(output_dir, "report.json"), report)
    dist.barrier()


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--train_steps", type=int, default=3)
    args = parser.parse_args(argv)
    dist.init_process_group("gloo")
    try:
        run(args.output_dir, args.train_steps)
    finally:
        dist.destroy_process_group()
    leave_without_teardown()  # everything is written: rank 0's report came before the last barrier


if __name__ == "__main__":
    main()
