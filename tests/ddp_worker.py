"""Data-parallel worker for tests/test_ddp.py: `pretrain` with the default (in-backward) optimizer, run as one process
or under `torch.distributed.run` (gloo, CPU), each process recording its replica's weights at the end.

    CUDA_VISIBLE_DEVICES= python -m torch.distributed.run --standalone --nproc_per_node 2 \
        tests/ddp_worker.py --data_dir DATA --output_dir OUT --per_device_train_batch_size 4 ...

Every process writes OUT/replica-<rank>.pt (its parameters); rank 0 writes OUT/log_history.json as pretrain does.
The arguments after the script are pretrain's.
"""

import os
import sys

import torch
from transformers import TrainerCallback

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from trainer_ext.run.pretrain import parse_pretrain_job, pretrain  # noqa: E402
from launcher import leave_without_teardown  # noqa: E402
from trainer_ext.training.distributed import end_process_group  # noqa: E402


class RecordReplica(TrainerCallback):
    """Saves this process's parameters when training ends, before anything else touches them."""

    def on_train_end(self, args, state, control, model=None, **kwargs):
        rank = int(os.environ.get("RANK", "0"))
        weights = {name: p.detach().cpu().clone() for name, p in model.named_parameters()}
        torch.save(weights, os.path.join(args.output_dir, f"replica-{rank}.pt"))


if __name__ == "__main__":
    pretrain(parse_pretrain_job(sys.argv[1:]), callbacks=[RecordReplica()])
    end_process_group()
    leave_without_teardown()  # every result is written and the group destroyed (launcher.py says why)
