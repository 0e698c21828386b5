"""FSDP2 worker for tests/test_fsdp_optimizer.py: the debug model (with dimensions the process counts do not divide),
sharded by `fully_shard` over gloo (CPU) or whole on one process, trained with the low-memory optimizer inside
backward on a fixed global batch, each process taking its slice.

    CUDA_VISIBLE_DEVICES= python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/fsdp_optimizer_worker.py --out OUT --momentum none full subspace --steps 4

`--trainer_path` takes the order and the code of RecurrentTrainer under accelerate: the optimizer is built on the whole
model, the sharded parameters are swapped into its groups afterwards (as `accelerator.prepare` does), then
`bind_optimizer` moves it onto them; the loss is the trainer's (`decoder_hidden`, then the chunked loss).

Rank 0 writes OUT/losses-<momentum>.json (the global batch's loss and the gradient norm of each step) and
OUT/weights-<momentum>.pt (the whole weights at the end); several --momentum modes run one after the other in the
same processes. `--stop_after K` saves a distributed checkpoint after step K to OUT/checkpoint and stops
(a run killed there); `--resume DIR` loads one and trains the remaining steps; `--full_state`: the checkpoint is
gathered on rank 0 instead. `--placement mixed`: activation checkpointing on before the sharding and, after it, the
layers placed as a memory plan places them (`PLACEMENT`: recomputed, recomputed selectively, kept), as the Trainer and
`RecomputeCallback` do; the losses and weights are those of keeping everything, and each step's entry counts the calls
of the prelude layer's MLP (recomputed: 2).
"""

import argparse
import functools
import json
import os
import sys

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from fsdp_worker import shard  # noqa: E402
from launcher import leave_without_teardown  # noqa: E402
from hf_recurrent import presets  # noqa: E402
from hf_recurrent.modeling_recurrent_depth import RecurrentDepthForCausalLM  # noqa: E402
from trainer_ext.compat import set_checkpointing  # noqa: E402
from trainer_ext.distill.losses import chunked_lm_loss  # noqa: E402
from trainer_ext.memory.recompute import Applications, RecomputeSet  # noqa: E402
from trainer_ext.optim.optimizer import create_optimizer  # noqa: E402
from trainer_ext.training.distributed import bind_optimizer, decoder_hidden  # noqa: E402

GLOBAL_BATCH, SEQ_LEN = 8, 16
MOMENTUM = {"none": {}, "full": {"momentum": 0.9},
            "subspace": {"momentum": 0.9, "momentum_rank_fraction": 0.25, "projection_interval": 2}}
# The prelude layer recomputed, core step 0 recomputed selectively, core step 1 and the coda layer kept.
PLACEMENT = RecomputeSet(prelude=(0,), selective_recompute=Applications(core_steps=(0,)))


def model_config():
    # 91 MLP rows: shards of 46/45 rows on 2 processes, 23/23/23/22 on 4 (the vocabulary is padded to 448)
    return presets.get("debug", intermediate_size=91, vocab_size=387)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--momentum", nargs="+", choices=sorted(MOMENTUM), default=["none"],
                        help="one run per mode, one after the other in the same processes")
    parser.add_argument("--stop_after", type=int, default=None)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--trainer_path", action="store_true")
    parser.add_argument("--full_state", action="store_true", help="checkpoints gathered on rank 0, not sharded")
    parser.add_argument("--placement", choices=("keep", "mixed"), default="keep")
    args = parser.parse_args(argv)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        dist.init_process_group("gloo")
    for momentum in args.momentum:
        run(args, momentum, world, int(os.environ.get("RANK", "0")))
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
        leave_without_teardown()


def run(args, momentum: str, world: int, rank: int) -> None:
    """Train one model with `momentum`; rank 0 writes OUT/losses-<momentum>.json and OUT/weights-<momentum>.pt."""
    torch.manual_seed(0)
    model = RecurrentDepthForCausalLM(model_config()).float()
    make_optimizer = functools.partial(create_optimizer, lr=3e-3, weight_decay=0.01, compile=False,
                                       **MOMENTUM[momentum])
    optimizer = make_optimizer(model) if args.trainer_path else None
    if args.placement == "mixed":
        set_checkpointing(model, True)
    if world > 1:
        from torch.distributed.device_mesh import init_device_mesh

        whole = dict(model.named_parameters())
        shard(model, init_device_mesh("cpu", (world,)))
        if optimizer is not None:  # what accelerate's prepare does to an optimizer built before the sharding
            sharded = {id(whole[name]): p for name, p in model.named_parameters()}
            for group in optimizer.param_groups:
                group["params"] = [sharded[id(p)] for p in group["params"]]
    calls = []
    if args.placement == "mixed":
        PLACEMENT.apply(model)
        model.model.prelude[0].mlp.register_forward_hook(lambda *_: calls.append(1))  # inside the checkpoint
    if optimizer is None:
        optimizer = make_optimizer(model)
    else:
        bind_optimizer(model, optimizer)
    start = 0
    if args.resume:
        start = load(model, optimizer, args.resume, args.full_state)
    data = torch.randint(0, 387, (args.steps, GLOBAL_BATCH, SEQ_LEN), generator=torch.Generator().manual_seed(1))
    per_rank = GLOBAL_BATCH // world
    history = []
    for step in range(start, args.steps):
        batch = data[step, rank * per_rank:(rank + 1) * per_rank]
        if args.trainer_path:
            hidden = decoder_hidden(model, model, batch, None, {"num_steps": 2})
            targets = torch.cat([batch[:, 1:], torch.full_like(batch[:, :1], -100)], dim=1)
            loss = chunked_lm_loss(hidden, model.lm_head.weight, targets).loss
        else:
            loss = model(input_ids=batch, labels=batch, num_steps=2).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        loss = loss.detach()
        if world > 1:
            dist.all_reduce(loss)
            loss /= world
        history.append({"step": step + 1, "loss": loss.item(), "grad_norm": optimizer.last_grad_norm,
                        "prelude_calls": len(calls)})
        calls.clear()
        if args.stop_after == step + 1:
            save(model, optimizer, os.path.join(args.out, "checkpoint"), step + 1, args.full_state)
            break
    weights = {name: (p.full_tensor() if world > 1 else p).detach().clone() for name, p in model.named_parameters()}
    if rank == 0:
        with open(os.path.join(args.out, f"losses-{momentum}.json"), "w") as f:
            json.dump(history, f)
        torch.save(weights, os.path.join(args.out, f"weights-{momentum}.pt"))


def save(model, optimizer, path: str, step: int, full: bool) -> None:
    """A distributed checkpoint (each process writes its shards), or with `full` the gathered state written by rank 0
    (accelerate's FULL_STATE_DICT, the Trainer's checkpoints under trainer_ext/configs/accelerate_fsdp2_*.yaml)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    model_state, optimizer_state = get_state_dict(model, optimizer, options=options)
    state = {"model": model_state, "optimizer": optimizer_state, "step": torch.tensor(step)}
    if not full:
        dcp.save(state, checkpoint_id=path)
    elif dist.get_rank() == 0:
        os.makedirs(path, exist_ok=True)
        torch.save(state, os.path.join(path, "state.pt"))


def load(model, optimizer, path: str, full: bool) -> int:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
        set_state_dict,
    )

    optimizer.init_state()  # the tensors a distributed checkpoint fills in place
    if full:  # read on rank 0, broadcast to the shards
        state = torch.load(os.path.join(path, "state.pt"), weights_only=True) if dist.get_rank() == 0 else \
            {"model": {}, "optimizer": {}, "step": torch.tensor(0)}
        step = torch.tensor(int(state["step"]))
        dist.broadcast(step, 0)
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)
        set_model_state_dict(model, state["model"], options=options)  # as accelerate's FSDP2 loading: one by one
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=options)
        return int(step)
    model_state, optimizer_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optimizer": optimizer_state, "step": torch.tensor(0)}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return int(state["step"])


if __name__ == "__main__":
    main()
