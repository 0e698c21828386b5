"""The factored update of `LowMemoryAdafactor` for one CUDA matrix as three Triton kernels (the ``fused`` path).

Same math and the same random bits as the torch functions in optimizer_kernels.py, but each pass over the
tensor is one kernel that reads the bf16 gradient once and keeps every fp32 value in registers:
    1. statistics: row and column sums of g**2 (per tile, reduced by the small factor update)
    2. update RMS: sum of u**2, u = g * row_factor * col_factor; with subspace momentum also u P (R, r), the
       projection onto the momentum's basis, as tensor-core dots inside the same pass
    3. apply: clip scale, momentum, weight decay, stochastic rounding, the in-place write of weight (and full
       momentum); with subspace momentum u + D P^T, D = (corrected - projected) momentum of the subspace
So a (R, C) bf16 matrix costs about 10 bytes per element of memory traffic (14 with full momentum), where the
compiled torch functions moved about 70 and made an fp32 copy of the gradient (measured: BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from trainer_ext.training.optimizer_kernels import (
    BETA1,
    CLIP,
    EPS,
    LR,
    MOMENTUM_SALT,
    WEIGHT_DECAY,
    WEIGHT_SALT,
    clip_scale,
    compile_update,
    momentum_bias_correction,
    store_where,
    update_factors,
)

# Tiles (rows, columns) of one program: of the statistics and update-RMS passes, and of the apply pass without
# subspace momentum. The projection pass loops over all columns of its rows for each block of at most
# _MAX_RANK_BLOCK basis vectors; the subspace apply re-reads its rows of D and columns of P from L2 for every tile, so
# its tiles are larger. The subspace dots take fp32 operands (tf32 on the tensor cores, as torch's matmuls in
# training): bf16 operands and larger tiles (64-row projection blocks, rank blocks of 64) measured slower on an H200
# (BENCHMARKS.md). `benchmarks/kernel_resources.py` reports each kernel's registers and spills at other tiles.
_TILE_ROWS, _TILE_COLS = 32, 256
_APPLY_ROWS, _APPLY_COLS = 32, 256
_PROJECT_ROWS, _PROJECT_COLS, _MAX_RANK_BLOCK, _PROJECT_WARPS = 32, 64, 128, 4
_SUBSPACE_ROWS, _SUBSPACE_COLS, _SUBSPACE_RANK_BLOCK = 64, 128, 32


@triton.jit
def _mix32(x):
    """optimizer_kernels.mix32 on int32 (shifts masked to be logical, multiplications wrap)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * -0x7B935975
    return x ^ ((x >> 16) & 0xFFFF)


@triton.jit
def _round_bf16_stochastic(x, index, key, step_int, salt):
    """optimizer_kernels.round_to_bf16_stochastic with optimizer_kernels._random_bits of (key, step, salt, index)."""
    stream = _mix32(key ^ _mix32(step_int ^ salt))
    bits = _mix32(_mix32(index) ^ stream)
    rounded = (x.to(tl.int32, bitcast=True) + (bits & 0xFFFF)) & -65536
    return rounded.to(tl.float32, bitcast=True)


@triton.jit
def _tile(pid_r, pid_c, R, C, BR: tl.constexpr, BC: tl.constexpr):
    rows = pid_r * BR + tl.arange(0, BR)
    cols = pid_c * BC + tl.arange(0, BC)
    mask = (rows[:, None] < R) & (cols[None, :] < C)
    return rows, cols, mask, rows[:, None] * C + cols[None, :]


@triton.jit
def _stats_kernel(grad, row_part, col_part, sq_part, R, C, BR: tl.constexpr, BC: tl.constexpr):
    """Per tile: sums of g**2 over its columns (row_part[pid_c, rows]), over its rows (col_part[pid_r, cols]), all."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows, cols, mask, offsets = _tile(pid_r, pid_c, R, C, BR, BC)
    g = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32)
    squared = g * g
    tl.store(row_part + pid_c * R + rows, tl.sum(squared, axis=1), mask=rows < R)
    tl.store(col_part + pid_r * C + cols, tl.sum(squared, axis=0), mask=cols < C)
    tl.store(sq_part + pid_r * tl.num_programs(1) + pid_c, tl.sum(tl.sum(squared, axis=1), axis=0))


@triton.jit
def _update_sq_kernel(grad, row_factor, col_factor, usq_part, R, C, BR: tl.constexpr, BC: tl.constexpr):
    """Per tile: the sum of u**2 with u = g * row_factor * col_factor (before clipping)."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows, cols, mask, offsets = _tile(pid_r, pid_c, R, C, BR, BC)
    g = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32)
    rf = tl.load(row_factor + rows, mask=rows < R, other=0.0)
    cf = tl.load(col_factor + cols, mask=cols < C, other=0.0)
    u = g * rf[:, None] * cf[None, :]
    tl.store(usq_part + pid_r * tl.num_programs(1) + pid_c, tl.sum(tl.sum(u * u, axis=1), axis=0))


@triton.jit
def _project_kernel(grad, row_factor, col_factor, projector, projected, usq_part, R, C, rank,
                    BR: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr):
    """Rows ``pid_r`` x rank block ``pid_k``: u P over all columns (u before clipping), and the rows' sum of u**2."""
    pid_r, pid_k = tl.program_id(0), tl.program_id(1)
    rows = pid_r * BR + tl.arange(0, BR)
    ranks = pid_k * BK + tl.arange(0, BK)
    rf = tl.load(row_factor + rows, mask=rows < R, other=0.0)
    acc = tl.zeros((BR, BK), dtype=tl.float32)
    u_sq = tl.zeros((BR, BC), dtype=tl.float32)
    start = 0
    while start < C:  # a while loop (not range) also runs under Triton's interpreter with numpy 2
        cols = start + tl.arange(0, BC)
        mask = (rows[:, None] < R) & (cols[None, :] < C)
        g = tl.load(grad + rows[:, None] * C + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        cf = tl.load(col_factor + cols, mask=cols < C, other=0.0)
        u = g * rf[:, None] * cf[None, :]
        u_sq += u * u
        basis = tl.load(projector + cols[:, None] * rank + ranks[None, :],
                        mask=(cols[:, None] < C) & (ranks[None, :] < rank), other=0.0)
        acc = tl.dot(u, basis, acc)
        start += BC
    tl.store(projected + rows[:, None] * rank + ranks[None, :], acc,
             mask=(rows[:, None] < R) & (ranks[None, :] < rank))
    if pid_k == 0:
        tl.store(usq_part + pid_r, tl.sum(tl.sum(u_sq, axis=1), axis=0))


@triton.jit
def _apply_kernel(param, grad, momentum, row_factor, col_factor, update_sq, numel, scalars, step_ptr, keys,
                  rows_per_chunk, hyper, correction, projector, R, C, rank,
                  BR: tl.constexpr, BC: tl.constexpr, BK: tl.constexpr, FULL_MOMENTUM: tl.constexpr,
                  SUBSPACE: tl.constexpr, PARAM_BF16: tl.constexpr, MOMENTUM_BF16: tl.constexpr):
    """The clipped update, momentum (full, or the subspace correction D P^T), decay and the weight write."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows, cols, mask, offsets = _tile(pid_r, pid_c, R, C, BR, BC)
    ok = tl.load(scalars) != 0
    step = tl.load(step_ptr)
    step_int = step.to(tl.int32)
    lr, decay = tl.load(hyper + 0), tl.load(hyper + 1)
    rms = tl.sqrt(tl.load(update_sq) / numel)
    scale = 1.0 / tl.maximum(rms / tl.load(hyper + 6), 1.0)
    g = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32)
    rf = tl.load(row_factor + rows, mask=rows < R, other=0.0)
    cf = tl.load(col_factor + cols, mask=cols < C, other=0.0)
    update = g * rf[:, None] * (cf[None, :] * scale)
    # The hash of a chunk of the torch path: its own key, element indices counted from its first row.
    chunk = rows // rows_per_chunk
    key = tl.load(keys + chunk, mask=rows < R, other=0)[:, None]
    index = (rows - chunk * rows_per_chunk)[:, None] * C + cols[None, :]
    if FULL_MOMENTUM:
        beta1 = tl.load(hyper + 2)
        old = tl.load(momentum + offsets, mask=mask, other=0.0)
        averaged = beta1 * old.to(tl.float32) + (1.0 - beta1) * update
        stored = averaged
        if MOMENTUM_BF16:
            stored = _round_bf16_stochastic(averaged, index, key, step_int, 0x68E31DA4)
        tl.store(momentum + offsets, tl.where(ok, stored, old.to(tl.float32)).to(old.dtype), mask=mask)
        update = averaged / tl.load(scalars + 1)
    if SUBSPACE:
        start = 0
        while start < rank:
            ranks = start + tl.arange(0, BK)
            d = tl.load(correction + rows[:, None] * rank + ranks[None, :],
                        mask=(rows[:, None] < R) & (ranks[None, :] < rank), other=0.0)
            basis = tl.load(projector + cols[:, None] * rank + ranks[None, :],
                            mask=(cols[:, None] < C) & (ranks[None, :] < rank), other=0.0)
            update = tl.dot(d, tl.trans(basis), update)
            start += BK
    old_param = tl.load(param + offsets, mask=mask, other=0.0)
    new_param = old_param.to(tl.float32) * (1.0 - lr * decay) - lr * update
    if PARAM_BF16:
        new_param = _round_bf16_stochastic(new_param, index, key, step_int, 0x1B873593)
    tl.store(param + offsets, tl.where(ok, new_param, old_param.to(tl.float32)).to(old_param.dtype), mask=mask)


assert (WEIGHT_SALT, MOMENTUM_SALT) == (0x1B873593, 0x68E31DA4)  # spelled out in _apply_kernel
assert (LR, WEIGHT_DECAY, BETA1, CLIP) == (0, 1, 2, 6)  # hyper offsets read by _apply_kernel


def _factors(row, col, row_part, col_part, sq_part, step, totals, hyper, beta2_decay: bool):
    """Reduce pass 1's tile sums to optimizer_kernels._grad_stats's outputs, then update the factors."""
    squared_sum = sq_part.sum()
    row_mean = row_part.sum(0, keepdim=True) / col.shape[-1] + hyper[EPS]
    col_sum = col_part.sum(0, keepdim=True) + row.shape[-1] * hyper[EPS]
    ok, row_factor, col_factor = update_factors(row, col, row_mean, col_sum, squared_sum, step, totals, hyper,
                                                 beta2_decay)
    # What _apply_kernel reads: ok, and the momentum's bias correction as optimizer_kernels._apply_update has it.
    scalars = torch.stack([ok.float(), momentum_bias_correction(step, hyper)])
    return scalars, row_factor, col_factor


def _subspace_correction(momentum, projected, update_sq, numel: int, scalars, step, key, hyper):
    """Subspace momentum of one chunk of rows: store m (R, r), return D = corrected - projected."""
    projected = projected * clip_scale(update_sq, numel, hyper)
    beta1 = hyper[BETA1]
    averaged = beta1 * momentum.float() + (1.0 - beta1) * projected
    store_where(momentum, averaged, scalars[0] != 0, key, step, MOMENTUM_SALT)
    return averaged / scalars[1] - projected


@functools.cache
def _compiled():
    return compile_update(_factors), compile_update(_subspace_correction)


def supports(param: torch.Tensor) -> bool:
    """Whether the fused kernels take this tensor: a matrix of bf16 or fp32 with int32 element indices, on CUDA
    (or on the CPU under Triton's interpreter, TRITON_INTERPRET=1, which the CPU tests use)."""
    on_device = param.is_cuda or (param.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")
    return on_device and param.ndim == 2 and param.dtype in (torch.bfloat16, torch.float32) and param.numel() < 2**31


def fused_factored_update(param, grad, row, col, momentum, step, keys, hyper, totals, projector=None, *,
                          rows_per_chunk: int, beta2_decay: bool) -> None:
    """One matrix's update: param, grad (R, C); row (1, R); col (1, C); momentum (R, C), or (R, r) in the
    subspace of ``projector`` (C, r), or None. ``keys`` are the torch path's per-chunk keys of ``rows_per_chunk``
    rows each, so the stochastic rounding draws the same bits. The small glue between the kernels is compiled on
    CUDA and eager on the CPU (Triton's interpreter)."""
    factors, subspace_correction = _compiled() if param.is_cuda else (_factors, _subspace_correction)
    grad = grad.contiguous()
    R, C = param.shape
    grid = (triton.cdiv(R, _TILE_ROWS), triton.cdiv(C, _TILE_COLS))
    f32 = dict(dtype=torch.float32, device=param.device)
    row_part = torch.empty(grid[1], R, **f32)
    col_part = torch.empty(grid[0], C, **f32)
    sq_part = torch.empty(grid[0] * grid[1], **f32)
    _stats_kernel[grid](grad, row_part, col_part, sq_part, R, C, BR=_TILE_ROWS, BC=_TILE_COLS)
    scalars, row_factor, col_factor = factors(row, col, row_part, col_part, sq_part, step, totals, hyper,
                                              beta2_decay)
    row_factor, col_factor = row_factor.reshape(R), col_factor.reshape(C)
    rank = 1
    correction = None
    if projector is not None:
        rank = projector.shape[-1]
        block = min(_MAX_RANK_BLOCK, max(16, triton.next_power_of_2(rank)))
        projected = torch.empty(R, rank, **f32)
        usq_part = torch.empty(triton.cdiv(R, _PROJECT_ROWS), **f32)
        _project_kernel[(usq_part.numel(), triton.cdiv(rank, block))](
            grad, row_factor, col_factor, projector, projected, usq_part, R, C, rank,
            BR=_PROJECT_ROWS, BC=_PROJECT_COLS, BK=block, num_warps=_PROJECT_WARPS)
        update_sq = usq_part.sum()
        correction = torch.empty_like(projected)
        for i, start in enumerate(range(0, R, rows_per_chunk)):
            rows = slice(start, start + rows_per_chunk)
            correction[rows] = subspace_correction(momentum[rows], projected[rows], update_sq, param.numel(),
                                                   scalars, step, keys[i], hyper)
    else:
        usq_part = torch.empty(grid[0] * grid[1], **f32)
        _update_sq_kernel[grid](grad, row_factor, col_factor, usq_part, R, C, BR=_TILE_ROWS, BC=_TILE_COLS)
        update_sq = usq_part.sum()
    full_momentum = momentum is not None and projector is None
    apply_rows, apply_cols, warps = (_SUBSPACE_ROWS, _SUBSPACE_COLS, 8) if projector is not None \
        else (_APPLY_ROWS, _APPLY_COLS, 4)
    _apply_kernel[(triton.cdiv(R, apply_rows), triton.cdiv(C, apply_cols))](
        param, grad, momentum if full_momentum else param, row_factor, col_factor, update_sq, param.numel(),
        scalars, step, keys, rows_per_chunk, hyper, correction if correction is not None else row_factor,
        projector if projector is not None else row_factor, R, C, rank,
        BR=apply_rows, BC=apply_cols, BK=_SUBSPACE_RANK_BLOCK, FULL_MOMENTUM=full_momentum,
        SUBSPACE=projector is not None, PARAM_BF16=param.dtype == torch.bfloat16,
        MOMENTUM_BF16=full_momentum and momentum.dtype == torch.bfloat16, num_warps=warps)
