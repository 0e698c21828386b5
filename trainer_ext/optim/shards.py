"""Parameters sharded by FSDP2: what a factored update needs from the other shards, and state shaped like the shard.

FSDP2 (`torch.distributed.fsdp.fully_shard`) replaces each parameter by a DTensor sharded on dim 0 (`Shard(0)`) over
a 1-D device mesh and, after the reduce-scatter, calls the sharded parameter's post-accumulate-grad hooks with its
shard of the averaged gradient. A process holds a block of rows of every weight (the last blocks can be shorter, or
empty). Row statistics of the factored second moment are then local; what spans rows is a sum over the shards, one
small all-reduce on the mesh's group each: the column sums with the sum of squared gradients (which decides the
non-finite skip, identically everywhere) and the mean of the row statistics, the update's squared norm (its RMS
clips it), and the subspace basis G^T (G Omega). Everything else is elementwise on the shard, so the sharded update
equals the unsharded one up to the order of floating-point sums.

Optimizer state of a sharded parameter is a DTensor too (rows sharded like the weight, column statistics and bases
replicated), so that `torch.distributed.checkpoint` and `get_optimizer_state_dict` save each shard once and resume
it on any number of processes.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import torch.distributed as dist

__all__ = ["RowShard", "local", "row_shard", "sharded_state", "zero_state"]


class RowShard(NamedTuple):
    """This process's block of rows of a parameter sharded on dim 0."""

    group: dist.ProcessGroup
    rank: int  # this process's position on the mesh: it keys the shard's own stochastic-rounding bits
    rows: int  # dim 0 of the whole parameter
    numel: int  # elements of the whole parameter

    def sum_(self, *tensors: torch.Tensor) -> None:
        """Sum each tensor over the shards, in place, in one all-reduce."""
        if len(tensors) == 1 and tensors[0].is_contiguous():
            dist.all_reduce(tensors[0], group=self.group)
            return
        flat = torch.cat([t.reshape(-1).float() for t in tensors])
        dist.all_reduce(flat, group=self.group)
        for tensor, part in zip(tensors, flat.split([t.numel() for t in tensors])):
            tensor.copy_(part.view(tensor.shape))


def _is_dtensor(tensor: torch.Tensor) -> bool:
    if not dist.is_available():
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def row_shard(param: torch.Tensor) -> RowShard | None:
    """The shard `param` holds, or None for a whole tensor. Raise ValueError for a layout other than FSDP2's."""
    if not _is_dtensor(param):
        return None
    from torch.distributed.tensor import Shard

    mesh, placements = param.device_mesh, tuple(param.placements)
    if mesh.ndim != 1 or placements != (Shard(0),):
        raise ValueError(
            f"LowMemoryAdafactor updates parameters sharded on dim 0 over a 1-D mesh (FSDP2's fully_shard), got "
            f"placements {placements} on a {mesh.ndim}-D mesh: use plain FSDP2 (no HSDP, tensor or sequence "
            "parallelism) with --optimizer low_memory, or a stock optimizer (--optimizer hf)."
        )
    return RowShard(mesh.get_group(), mesh.get_local_rank(), param.shape[0], param.numel())


def local(tensor: torch.Tensor) -> torch.Tensor:
    """A DTensor's local shard (a view: writes reach the DTensor), or the tensor itself."""
    return tensor.to_local() if _is_dtensor(tensor) else tensor


def sharded_state(param: torch.Tensor, local_state: torch.Tensor, shape: tuple[int, ...], rows_sharded: bool):
    """`local_state` as state of `param`: a DTensor of global `shape` sharded on dim 0 like the parameter
    (`rows_sharded`) or replicated, or `local_state` itself when the parameter is a whole tensor."""
    if not _is_dtensor(param):
        return local_state
    from torch.distributed.tensor import DTensor, Replicate, Shard

    placement = Shard(0) if rows_sharded else Replicate()
    stride = torch.empty(shape, device="meta").stride()
    return DTensor.from_local(local_state, param.device_mesh, [placement], run_check=False, shape=torch.Size(shape),
                              stride=stride)


def zero_state(param: torch.Tensor, momentum: bool, momentum_rank: int | None) -> dict:
    """The optimizer state of `param` before its first update, whole or sharded like the parameter: a step count,
    the factored (row, column) or full second moment, and momentum, full or in a rank-`momentum_rank` subspace
    with its basis (the first unit vectors until the first refresh)."""
    block = local(param)
    zeros = functools.partial(torch.zeros, dtype=torch.float32, device=block.device)
    state = {"step": zeros(())}  # the same on every process
    if param.ndim >= 2:
        state["row"] = sharded_state(param, zeros(block.shape[:-1]), param.shape[:-1], True)
        col_shape = param.shape[:-2] + param.shape[-1:]
        state["col"] = sharded_state(param, zeros(block.shape[:-2] + block.shape[-1:]), col_shape, False)
    else:
        state["second_moment"] = sharded_state(param, zeros(block.shape), param.shape, True)
    if momentum and momentum_rank is None:
        state["momentum"] = sharded_state(param, torch.zeros_like(block), param.shape, True)
    elif momentum:
        columns = param.shape[-1]
        first_moment = torch.zeros(block.shape[0], momentum_rank, dtype=block.dtype, device=block.device)
        state["momentum"] = sharded_state(param, first_moment, (param.shape[0], momentum_rank), True)
        basis = torch.eye(columns, momentum_rank, dtype=torch.float32, device=block.device)
        state["projector"] = sharded_state(param, basis, (columns, momentum_rank), False)
    return state
