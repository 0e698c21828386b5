"""The factored update of `LowMemoryAdafactor` for one CUDA matrix as three Triton kernels (the ``fused`` path).

Same math and the same random bits as the torch functions in optimizer_kernels.py, but each pass over the
tensor is one kernel that reads the bf16 gradient once and keeps every fp32 value in registers:
    1. statistics: row and column sums of g**2 (per tile, reduced by the small factor update)
    2. update RMS: sum of u**2, u = g * row_factor * col_factor
    3. apply: clip scale, momentum, weight decay, stochastic rounding, the in-place write of weight (and full
       momentum); with subspace momentum u + D P^T, D = (corrected - projected) momentum of the subspace
So a (R, C) bf16 matrix costs about 10 bytes per element of memory traffic (14 with full momentum), where the
compiled torch functions moved about 70 and made an fp32 copy of the gradient (measured: BENCHMARKS.md).
Subspace momentum adds two GEMMs of the gradient's dtype through cuBLAS: the projection u P (R, r) and the
back-projection D P^T, in row blocks that the apply pass adds; their bf16 operands round P and D to 8 bits, where
the torch path multiplies in fp32 (tf32 on a GPU).
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

# Tiles (rows, columns) of one program: of the statistics and update-RMS passes, and of the apply pass.
# `benchmarks/kernel_resources.py` reports each kernel's registers and spills: the apply pass spills at 32 x 256
# (300-1,440 bytes per thread) and not at 16 x 128, which measured 7-16% less GPU time per tensor (BENCHMARKS.md). The subspace
# back-projection is materialised in blocks of at most _BACK_NUMEL elements (32 MiB in bf16).
_TILE_ROWS, _TILE_COLS = 32, 256
_APPLY_ROWS, _APPLY_COLS = 16, 128
_BACK_NUMEL = 2**24


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
def _apply_kernel(param, grad, momentum, back, row_factor, col_factor, update_sq, numel, scalars, step_ptr, keys,
                  rows_per_chunk, hyper, row_start, row_end, C, BR: tl.constexpr, BC: tl.constexpr,
                  FULL_MOMENTUM: tl.constexpr, SUBSPACE: tl.constexpr, PARAM_BF16: tl.constexpr,
                  MOMENTUM_BF16: tl.constexpr):
    """Rows [row_start, row_end): the clipped update, momentum (full, or the subspace correction ``back`` = D P^T of
    these rows), decay and the weight write."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = row_start + pid_r * BR + tl.arange(0, BR)
    cols = pid_c * BC + tl.arange(0, BC)
    mask = (rows[:, None] < row_end) & (cols[None, :] < C)
    offsets = rows[:, None] * C + cols[None, :]
    ok = tl.load(scalars) != 0
    step = tl.load(step_ptr)
    step_int = step.to(tl.int32)
    lr, decay = tl.load(hyper + 0), tl.load(hyper + 1)
    rms = tl.sqrt(tl.load(update_sq) / numel)
    scale = 1.0 / tl.maximum(rms / tl.load(hyper + 6), 1.0)
    g = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32)
    rf = tl.load(row_factor + rows, mask=rows < row_end, other=0.0)
    cf = tl.load(col_factor + cols, mask=cols < C, other=0.0)
    update = g * rf[:, None] * (cf[None, :] * scale)
    # The hash of a chunk of the torch path: its own key, element indices counted from its first row.
    chunk = rows // rows_per_chunk
    key = tl.load(keys + chunk, mask=rows < row_end, other=0)[:, None]
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
        update += tl.load(back + offsets - row_start * C, mask=mask, other=0.0).to(tl.float32)
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


def _subspace_correction(grad, scaled_basis, row_factor, momentum, update_sq, numel: int, scalars, step, key,
                         hyper):
    """Subspace momentum of one chunk of rows: u P = row_factor * (g @ (col_factor * P)) as one GEMM in the
    gradient's dtype, store m (R, r), return D = corrected - projected in that dtype (the back-projection's operand)."""
    projected = (grad @ scaled_basis).float() * (row_factor[:, None] * clip_scale(update_sq, numel, hyper))
    beta1 = hyper[BETA1]
    averaged = beta1 * momentum.float() + (1.0 - beta1) * projected
    store_where(momentum, averaged, scalars[0] != 0, key, step, MOMENTUM_SALT)
    return (averaged / scalars[1] - projected).to(grad.dtype)


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
    usq_part = torch.empty(grid[0] * grid[1], **f32)
    _update_sq_kernel[grid](grad, row_factor, col_factor, usq_part, R, C, BR=_TILE_ROWS, BC=_TILE_COLS)
    update_sq = usq_part.sum()
    full_momentum = momentum is not None and projector is None

    def apply(row_start: int, row_end: int, back=None) -> None:
        _apply_kernel[(triton.cdiv(row_end - row_start, _APPLY_ROWS), triton.cdiv(C, _APPLY_COLS))](
            param, grad, momentum if full_momentum else param, param if back is None else back, row_factor,
            col_factor, update_sq, param.numel(), scalars, step, keys, rows_per_chunk, hyper, row_start, row_end, C,
            BR=_APPLY_ROWS, BC=_APPLY_COLS, FULL_MOMENTUM=full_momentum, SUBSPACE=back is not None,
            PARAM_BF16=param.dtype == torch.bfloat16,
            MOMENTUM_BF16=full_momentum and momentum.dtype == torch.bfloat16, num_warps=4)

    if projector is None:
        return apply(0, R)
    # Subspace momentum: the projection u P and the back-projection D P^T are GEMMs in the gradient's dtype (bf16
    # operands, fp32 accumulation), per chunk of rows; the back-projection in blocks of at most _BACK_NUMEL
    # elements, each added by the apply kernel.
    scaled_basis = (col_factor[:, None] * projector).to(grad.dtype)
    basis_t = projector.t().to(grad.dtype)
    block = max(1, _BACK_NUMEL // C)
    for i, start in enumerate(range(0, R, rows_per_chunk)):
        end = min(start + rows_per_chunk, R)
        correction = subspace_correction(grad[start:end], scaled_basis, row_factor[start:end], momentum[start:end],
                                         update_sq, param.numel(), scalars, step, keys[i], hyper)
        for block_start in range(start, end, block):
            block_end = min(block_start + block, end)
            apply(block_start, block_end, correction[block_start - start:block_end - start] @ basis_t)
