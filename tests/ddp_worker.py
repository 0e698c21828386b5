"""Data-parallel worker for tests/test_ddp.py: `pretrain` with the default (in-backward) optimizer, run as one process
or under `torch.distributed.run` (gloo, CPU), each process recording its replica's weights at the end.

    CUDA_VISIBLE_DEVICES= python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/ddp_worker.py --data_dir DATA --output_dir OUT --per_device_train_batch_size 4 ...

Every process writes OUT/replica-<rank>.pt (its parameters); rank 0 writes OUT/log_history.json as pretrain does.
The arguments after the script are pretrain's, but `--placement_mixed`: the layers placed as a memory plan places them
on a GPU (`fsdp_optimizer_worker.PLACEMENT`: recomputed, recomputed selectively, kept; `RecomputeCallback`, as
`--memory_plan auto` adds it), each process writing OUT/coda-calls-<rank>.json, the calls of the coda layer's MLP (kept:
one a step, where the default checkpointing of every layer runs it twice).
"""

import json
import os
import sys

import torch
from transformers import TrainerCallback

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer_ext.run.pretrain import parse_pretrain_job, pretrain  # noqa: E402
from launcher import leave_without_teardown  # noqa: E402
from fsdp_optimizer_worker import PLACEMENT  # noqa: E402
from trainer_ext.memory.recompute import RecomputeCallback  # noqa: E402
from trainer_ext.training.distributed import end_process_group  # noqa: E402


class RecordReplica(TrainerCallback):
    """Saves this process's parameters when training ends, before anything else touches them."""

    def on_train_end(self, args, state, control, model=None, **kwargs):
        rank = int(os.environ.get("RANK", "0"))
        weights = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
        torch.save(weights, os.path.join(args.output_dir, f"replica-{rank}.pt"))


class CountCodaCalls(TrainerCallback):
    """Counts the calls of the coda layer's MLP (inside a checkpoint, where there is one) and writes them when training
    ends."""

    def __init__(self):
        self.calls = 0

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        model.model.coda[0].mlp.register_forward_hook(self.count)

    def count(self, *_):
        self.calls += 1

    def on_train_end(self, args, state, control, **kwargs):
        with open(os.path.join(args.output_dir, f"coda-calls-{os.environ.get('RANK', '0')}.json"), "w") as f:
            json.dump(self.calls, f)


if __name__ == "__main__":
    argv, callbacks = sys.argv[1:], [RecordReplica()]
    if "--placement_mixed" in argv:
        argv.remove("--placement_mixed")
        callbacks += [RecomputeCallback(PLACEMENT), CountCodaCalls()]
    pretrain(parse_pretrain_job(argv), callbacks=callbacks)
    end_process_group()
    leave_without_teardown()  # every result is written and the group destroyed (launcher.py says why)
