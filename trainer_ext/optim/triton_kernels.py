"""The factored update of `LowMemoryAdafactor` for one CUDA matrix as Triton kernels (the ``fused`` path), and the
update of a vector (norm scales, biases: ndim < 2) as one kernel of one program.

Same math and the same random bits as the torch functions in kernels.py. Three passes over the tensor,
each one kernel that reads the bf16 gradient once and keeps every fp32 value in registers:
    1. statistics: row and column sums of g**2 (per tile)
    2. update RMS: sum of u**2, u = g * row_factor * col_factor
    3. apply: clip scale, momentum, weight decay, stochastic rounding, the in-place write of weight (and full
       momentum); with subspace momentum rho u + D P^T, D = corrected - rho projected, momentum of the subspace
and between passes 1 and 2 two small kernels: the scalars (finite?, step count, bias corrections; one program) and
the row and column factors (state committed where finite). So a (R, C) bf16 matrix costs about 10 bytes per element
of memory traffic (14 with full momentum), where the compiled torch functions moved about 70 and made an fp32 copy
of the gradient, and its host time is five kernel launches and a sum: no compiled torch function runs per tensor,
whose call alone took longer than the update of a small matrix (measured: BENCHMARKS.md).
Subspace momentum adds two GEMMs of the gradient's dtype through cuBLAS, the projection u P (R, r) and the
back-projection D P^T in row blocks that the apply pass adds, and a kernel for the subspace's momentum; the bf16
operands round P and D to 8 bits, where the torch path multiplies in fp32 (tf32 on a GPU).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from trainer_ext.optim.kernels import (
    BETA1,
    BETA2,
    BETA2_DECAY,
    CLIP,
    EPS,
    LR,
    MOMENTUM_SALT,
    WEIGHT_DECAY,
    WEIGHT_SALT,
)

# Tiles (rows, columns) of one program: of the update-RMS pass (and its warps), and of the apply pass (its rows with
# full momentum apart). `benchmarks/kernel_resources.py` reports each kernel's registers and spills: the apply pass
# spills at 32 x 256 (300-1,440 bytes per thread) and not at 16 x 128, which measured 7-16% less GPU time per tensor;
# 8 x 128 measured 4% less again with subspace momentum, 4% more with full momentum (BENCHMARKS.md).
# The subspace back-projection is materialised in blocks of at most _BACK_NUMEL elements (32 MiB in bf16).
_TILE_ROWS, _TILE_COLS, _TILE_WARPS = 32, 256, 4
_APPLY_ROWS, _APPLY_ROWS_FULL_MOMENTUM, _APPLY_COLS = 8, 16, 128
# The statistics pass: a program sums a strip of up to _STATS_STRIP tiles of _STATS_ROWS x _STATS_COLS down the rows,
# keeping the column sums in registers until the strip ends (one tile a program measured 1.3 TB/s on an H100, the
# update-RMS pass's same read 2.9: BENCHMARKS.md); shorter strips where fewer than _STATS_PROGRAMS programs would
# cover the matrix.
_STATS_ROWS, _STATS_COLS, _STATS_WARPS, _STATS_STRIP, _STATS_PROGRAMS = 32, 256, 4, 8, 512
_BACK_NUMEL = 2**24
# The factor update: rows per program and pass 1's row sums read per iteration (few: the row factor's consumers
# each reduce the row programs' sums, at most 64 for 65,536 rows), columns per program and pass 1's column sums read
# per iteration; the subspace momentum's tile (rows, basis vectors).
_FACTOR_ROWS, _FACTOR_ROW_BLOCK, _FACTOR_COLS, _FACTOR_COL_BLOCK = 1024, 4, 64, 32
_MOMENTUM_ROWS, _MOMENTUM_RANKS = 32, 64
# Vectors (ndim < 2) up to _VECTOR_NUMEL elements are updated by one program, _VECTOR_BLOCK elements at a time: the
# presets' largest is 4,096 (a norm scale); one launch where the compiled torch function took about 230 us of host
# time per vector (BENCHMARKS.md).
_VECTOR_BLOCK, _VECTOR_NUMEL = 512, 2**16


@triton.jit
def _mix32(x):
    """kernels.mix32 on int32 (shifts masked to be logical, multiplications wrap)."""
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * -0x7B935975
    return x ^ ((x >> 16) & 0xFFFF)


@triton.jit
def _round_bf16_stochastic(x, index, key, step_int, salt):
    """kernels.round_to_bf16_stochastic with kernels._random_bits of (key, step, salt, index)."""
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
def _stats_kernel(grad, row_part, col_part, sq_part, R, C, BR: tl.constexpr, BC: tl.constexpr,
                  ITERATIONS: tl.constexpr):
    """Per strip of ITERATIONS tiles down the rows: sums of g**2 over its columns (row_part[pid_c, rows], each tile's),
    over its rows (col_part[pid_s, cols], summed in registers and reduced across the tile's rows once), all."""
    pid_s, pid_c = tl.program_id(0), tl.program_id(1)
    cols = pid_c * BC + tl.arange(0, BC)
    columns = tl.zeros((BR, BC), dtype=tl.float32)
    i = 0
    while i < ITERATIONS:  # a while loop (not range): see _scalar_kernel
        rows, cols, mask, offsets = _tile(pid_s * ITERATIONS + i, pid_c, R, C, BR, BC)
        g = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32)
        squared = g * g
        tl.store(row_part + pid_c * R + rows, tl.sum(squared, axis=1), mask=rows < R)
        columns += squared
        i += 1
    column_sums = tl.sum(columns, axis=0)
    tl.store(col_part + pid_s * C + cols, column_sums, mask=cols < C)
    tl.store(sq_part + pid_s * tl.num_programs(1) + pid_c, tl.sum(column_sums, axis=0))


@triton.jit
def _pow(base, exponent, INTERPRETED: tl.constexpr):
    """fp32 base ** exponent as the torch path computes it: libdevice's powf on a GPU (what torch.compile's kernels
    call), and under the interpreter through fp64 exp and log, rounded as the CPU's powf. The bias corrections take
    1 - beta ** t, which keeps only a few bits of an approximate power."""
    if INTERPRETED:
        return tl.exp(exponent.to(tl.float64) * tl.log(base.to(tl.float64))).to(tl.float32)
    return libdevice.pow(base, exponent)


@triton.jit
def _step_scalars(total, step_ptr, hyper, BETA2_DECAY: tl.constexpr, INTERPRETED: tl.constexpr):
    """From the gradient's sum of squares: ok (finite), beta2 of this step, the second moment's bias correction
    (kernels._beta2_and_bias_correction) and the step count after it (kernels._record)."""
    ok = (total - total) == 0.0  # false for inf and nan
    t = tl.load(step_ptr) + 1.0
    beta2 = tl.load(hyper + 3)
    if BETA2_DECAY:
        beta2 = tl.minimum(beta2, 1.0 - _pow(t, -tl.load(hyper + 4), INTERPRETED))
        correction = beta2 * 0.0 + 1.0
    else:
        correction = 1.0 - _pow(beta2, t, INTERPRETED)
    step = t - 1.0 + ok.to(tl.float32)
    return ok, beta2, correction, step


@triton.jit
def _commit_step(step_ptr, step, totals, total, ok):
    """The step count and the grad-norm / skip totals, as kernels._record leaves them."""
    tl.store(step_ptr, step)
    tl.store(totals, tl.load(totals) + total)
    tl.store(totals + 1, tl.load(totals + 1) + 1.0 - ok.to(tl.float32))


@triton.jit
def _scalar_kernel(sq_part, num_parts, step_ptr, totals, hyper, scalars, BETA2_DECAY: tl.constexpr,
                   B: tl.constexpr, INTERPRETED: tl.constexpr):
    """One program: the gradient's sum of squares from pass 1's tile sums; ok (finite), the step count and the
    grad-norm / skip totals as kernels._record has them; scalars = [ok, 1 - beta1**step, beta2 of this
    step, the second moment's bias correction] (kernels._beta2_and_bias_correction)."""
    acc = tl.zeros((B,), dtype=tl.float32)
    start = 0
    while start < num_parts:  # a while loop (not range) also runs under Triton's interpreter with numpy 2
        offsets = start + tl.arange(0, B)
        acc += tl.load(sq_part + offsets, mask=offsets < num_parts, other=0.0)
        start += B
    total = tl.sum(acc, axis=0)
    ok, beta2, correction, step = _step_scalars(total, step_ptr, hyper, BETA2_DECAY, INTERPRETED)
    _commit_step(step_ptr, step, totals, total, ok)
    tl.store(scalars, ok.to(tl.float32))
    tl.store(scalars + 1, 1.0 - _pow(tl.load(hyper + 2), tl.maximum(step, 1.0), INTERPRETED))
    tl.store(scalars + 2, beta2)
    tl.store(scalars + 3, correction)


@triton.jit
def _sum_tiles(parts, stride, num_tiles, index, bound, FB: tl.constexpr, FN: tl.constexpr):
    """Sum over pass 1's tiles of ``parts`` (num_tiles, stride) at ``index`` (FN entries, those below ``bound``),
    FB tiles per iteration."""
    acc = tl.zeros((FB, FN), dtype=tl.float32)
    tile = 0
    while tile < num_tiles:
        tiles = tile + tl.arange(0, FB)
        acc += tl.load(parts + tiles[:, None] * stride + index[None, :],
                       mask=(tiles[:, None] < num_tiles) & (index[None, :] < bound), other=0.0)
        tile += FB
    return tl.sum(acc, axis=0)


@triton.jit
def _factor_kernel(row, col, row_part, col_part, row_raw, row_sums, col_factor, scalars, hyper, R, C, tiles_r,
                   tiles_c, row_programs, FR: tl.constexpr, FBR: tl.constexpr, FC: tl.constexpr, FBC: tl.constexpr):
    """The row and column averages of g**2 (committed where ok) and their inverse square roots. Programs below
    ``row_programs`` take FR rows (and write their rows' sum of the new average, for its mean), the rest FC columns.
    kernels._update_factors's row factor, rsqrt(new_row / (mean * correction)), is _row_factor's."""
    pid = tl.program_id(0)
    ok = tl.load(scalars) != 0
    beta2 = tl.load(scalars + 2)
    eps = tl.load(hyper + 5)
    if pid < row_programs:
        rows = pid * FR + tl.arange(0, FR)
        old_row = tl.load(row + rows, mask=rows < R, other=0.0)
        new_row = beta2 * old_row + (1.0 - beta2) * (_sum_tiles(row_part, R, tiles_c, rows, R, FBR, FR) / C + eps)
        tl.store(row + rows, tl.where(ok, new_row, old_row), mask=rows < R)
        tl.store(row_raw + rows, 1.0 / tl.sqrt(new_row), mask=rows < R)
        tl.store(row_sums + pid, tl.sum(tl.where(rows < R, new_row, 0.0), axis=0))
    else:
        cols = (pid - row_programs) * FC + tl.arange(0, FC)
        old_col = tl.load(col + cols, mask=cols < C, other=0.0)
        col_sum = _sum_tiles(col_part, C, tiles_r, cols, C, FBC, FC) + R * eps
        new_col = beta2 * old_col + (1.0 - beta2) * col_sum / R
        tl.store(col + cols, tl.where(ok, new_col, old_col), mask=cols < C)
        tl.store(col_factor + cols, 1.0 / tl.sqrt(new_col), mask=cols < C)


@triton.jit
def _row_factor(row_raw, row_sums, row_programs, rows, R, scalars, P: tl.constexpr):
    """The row factor of ``rows``: rsqrt(new_row) * sqrt(mean(new_row) * correction)."""
    sums = tl.load(row_sums + tl.arange(0, P), mask=tl.arange(0, P) < row_programs, other=0.0)
    scale = tl.sqrt(tl.sum(sums, axis=0) / R * tl.load(scalars + 3))
    return tl.load(row_raw + rows, mask=rows < R, other=0.0) * scale


@triton.jit
def _clip_scale(update_sq, numel, hyper):
    """kernels._clip_scale."""
    return 1.0 / tl.maximum(tl.sqrt(tl.load(update_sq) / numel) / tl.load(hyper + 6), 1.0)


@triton.jit
def _update_sq_kernel(grad, row_raw, row_sums, row_programs, col_factor, scalars, usq_part, R, C,
                      BR: tl.constexpr, BC: tl.constexpr, P: tl.constexpr):
    """Per tile: the sum of u**2 with u = g * row_factor * col_factor (before clipping)."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows, cols, mask, offsets = _tile(pid_r, pid_c, R, C, BR, BC)
    g = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32)
    rf = _row_factor(row_raw, row_sums, row_programs, rows, R, scalars, P)
    cf = tl.load(col_factor + cols, mask=cols < C, other=0.0)
    u = g * rf[:, None] * cf[None, :]
    tl.store(usq_part + pid_r * tl.num_programs(1) + pid_c, tl.sum(tl.sum(u * u, axis=1), axis=0))


@triton.jit
def _momentum_update(momentum, offsets, mask, update, ok, index, key, step_int, beta1, MOMENTUM_BF16: tl.constexpr):
    """m <- beta1 m + (1 - beta1) u, stored where ok (stochastically rounded by element ``index`` in bf16); returns
    the new m, which divided by 1 - beta1**t replaces u (kernels._apply_update)."""
    old = tl.load(momentum + offsets, mask=mask, other=0.0)
    averaged = beta1 * old.to(tl.float32) + (1.0 - beta1) * update
    stored = averaged
    if MOMENTUM_BF16:
        stored = _round_bf16_stochastic(averaged, index, key, step_int, 0x68E31DA4)
    tl.store(momentum + offsets, tl.where(ok, stored, old.to(tl.float32)).to(old.dtype), mask=mask)
    return averaged


@triton.jit
def _momentum_kernel(projected, row_raw, row_sums, row_programs, momentum, update_sq, numel, scalars, step_ptr,
                     keys, chunk, hyper, row_start, rows_in_chunk, R, rank, BR: tl.constexpr, BK: tl.constexpr,
                     P: tl.constexpr, MOMENTUM_BF16: tl.constexpr):
    """Subspace momentum of one chunk of rows, in place of ``projected`` = g @ (col_factor * P) (rows_in_chunk, r):
    u P = row_factor * projected * clip scale, m <- beta1 m + (1 - beta1) u P (stored where ok, stochastically
    rounded with the chunk's key), then D = m / (1 - beta1**t) - rho u P, the back-projection's operand (rho: the
    residual scale)."""
    pid_r, pid_k = tl.program_id(0), tl.program_id(1)
    local, ranks, mask, offsets = _tile(pid_r, pid_k, rows_in_chunk, rank, BR, BK)
    rf = _row_factor(row_raw, row_sums, row_programs, row_start + local, R, scalars, P)
    ok = tl.load(scalars) != 0
    value = tl.load(projected + offsets, mask=mask, other=0.0).to(tl.float32)
    value = value * (rf[:, None] * _clip_scale(update_sq, numel, hyper))
    averaged = _momentum_update(momentum + row_start * rank, offsets, mask, value, ok, offsets, tl.load(keys + chunk),
                                tl.load(step_ptr).to(tl.int32), tl.load(hyper + 2), MOMENTUM_BF16)
    back = averaged / tl.load(scalars + 1) - tl.load(hyper + 7) * value
    tl.store(projected + offsets, back.to(projected.dtype.element_ty), mask=mask)


@triton.jit
def _write_param(param, offsets, mask, update, ok, index, key, step_int, lr, decay, PARAM_BF16: tl.constexpr):
    """w <- w (1 - lr decay) - lr u, stored where ok (stochastically rounded by element ``index`` in bf16)."""
    old_param = tl.load(param + offsets, mask=mask, other=0.0)
    new_param = old_param.to(tl.float32) * (1.0 - lr * decay) - lr * update
    if PARAM_BF16:
        new_param = _round_bf16_stochastic(new_param, index, key, step_int, 0x1B873593)
    tl.store(param + offsets, tl.where(ok, new_param, old_param.to(tl.float32)).to(old_param.dtype), mask=mask)


@triton.jit
def _apply_kernel(param, grad, momentum, back, row_raw, row_sums, row_programs, col_factor, update_sq, numel,
                  scalars, step_ptr, keys, rows_per_chunk, hyper, row_start, row_end, R, C, BR: tl.constexpr,
                  BC: tl.constexpr, P: tl.constexpr, FULL_MOMENTUM: tl.constexpr, SUBSPACE: tl.constexpr,
                  PARAM_BF16: tl.constexpr, MOMENTUM_BF16: tl.constexpr):
    """Rows [row_start, row_end): the clipped update, momentum (full, or the residual scale and the subspace
    correction ``back`` = D P^T of these rows), decay and the weight write."""
    pid_r, pid_c = tl.program_id(0), tl.program_id(1)
    rows = row_start + pid_r * BR + tl.arange(0, BR)
    cols = pid_c * BC + tl.arange(0, BC)
    mask = (rows[:, None] < row_end) & (cols[None, :] < C)
    offsets = rows[:, None] * C + cols[None, :]
    ok = tl.load(scalars) != 0
    step = tl.load(step_ptr)
    step_int = step.to(tl.int32)
    lr, decay = tl.load(hyper + 0), tl.load(hyper + 1)
    g = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32)
    rf = _row_factor(row_raw, row_sums, row_programs, rows, R, scalars, P)
    cf = tl.load(col_factor + cols, mask=cols < C, other=0.0)
    update = g * rf[:, None] * (cf[None, :] * _clip_scale(update_sq, numel, hyper))
    # The hash of a chunk of the torch path: its own key, element indices counted from its first row.
    chunk = rows // rows_per_chunk
    key = tl.load(keys + chunk, mask=rows < row_end, other=0)[:, None]
    index = (rows - chunk * rows_per_chunk)[:, None] * C + cols[None, :]
    if FULL_MOMENTUM:
        update = _momentum_update(momentum, offsets, mask, update, ok, index, key, step_int, tl.load(hyper + 2),
                                  MOMENTUM_BF16) / tl.load(scalars + 1)
    if SUBSPACE:
        correction = tl.load(back + offsets - row_start * C, mask=mask, other=0.0).to(tl.float32)
        update = update * tl.load(hyper + 7) + correction
    _write_param(param, offsets, mask, update, ok, index, key, step_int, lr, decay, PARAM_BF16)


@triton.jit
def _vector_kernel(param, grad, second_moment, momentum, step_ptr, keys, totals, hyper, n, BLOCK: tl.constexpr,
                   BETA2_DECAY: tl.constexpr, HAS_MOMENTUM: tl.constexpr, PARAM_BF16: tl.constexpr,
                   MOMENTUM_BF16: tl.constexpr, INTERPRETED: tl.constexpr):
    """A vector's whole update in one program, as kernels.unfactored_update, in three passes of BLOCK
    elements: the sum of g**2 (ok, step, totals and bias corrections as _scalar_kernel); the update's sum of squares
    under the new second moment; the second moment's write (where ok), the clipped update, momentum, decay and the
    weight write (as _apply_kernel, element indices from 0 under the tensor's one key)."""
    lanes = tl.arange(0, BLOCK)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    start = 0
    while start < n:
        g = tl.load(grad + start + lanes, mask=start + lanes < n, other=0.0).to(tl.float32)
        acc += g * g
        start += BLOCK
    total = tl.sum(acc, axis=0)
    ok, beta2, correction, step = _step_scalars(total, step_ptr, hyper, BETA2_DECAY, INTERPRETED)
    eps = tl.load(hyper + 5)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    start = 0
    while start < n:
        offsets = start + lanes
        mask = offsets < n
        g = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32)
        new = beta2 * tl.load(second_moment + offsets, mask=mask, other=1.0) + (1.0 - beta2) * (g * g + eps)
        u = g / tl.sqrt(new / correction)
        acc += tl.where(mask, u * u, 0.0)
        start += BLOCK
    clip = 1.0 / tl.maximum(tl.sqrt(tl.sum(acc, axis=0) / n) / tl.load(hyper + 6), 1.0)
    lr, decay, beta1 = tl.load(hyper + 0), tl.load(hyper + 1), tl.load(hyper + 2)
    momentum_correction = 1.0 - _pow(beta1, tl.maximum(step, 1.0), INTERPRETED)
    key, step_int = tl.load(keys), step.to(tl.int32)
    start = 0
    while start < n:
        offsets = start + lanes
        mask = offsets < n
        g = tl.load(grad + offsets, mask=mask, other=0.0).to(tl.float32)
        # The new second moment again, as pass 2 computed it (it is written here: no pass reads what another wrote).
        old_moment = tl.load(second_moment + offsets, mask=mask, other=1.0)
        new = beta2 * old_moment + (1.0 - beta2) * (g * g + eps)
        tl.store(second_moment + offsets, tl.where(ok, new, old_moment), mask=mask)
        update = g / tl.sqrt(new / correction) * clip
        if HAS_MOMENTUM:
            update = _momentum_update(momentum, offsets, mask, update, ok, offsets, key, step_int, beta1,
                                      MOMENTUM_BF16) / momentum_correction
        _write_param(param, offsets, mask, update, ok, offsets, key, step_int, lr, decay, PARAM_BF16)
        start += BLOCK
    _commit_step(step_ptr, step, totals, total, ok)


assert (WEIGHT_SALT, MOMENTUM_SALT) == (0x1B873593, 0x68E31DA4)  # spelled out in the kernels
assert (LR, WEIGHT_DECAY, BETA1, BETA2, BETA2_DECAY, EPS, CLIP) == tuple(range(7))  # hyper offsets in the kernels


def _on_device(param: torch.Tensor) -> bool:
    return param.is_cuda or (param.device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1")


def supports_vector(param: torch.Tensor) -> bool:
    """Whether the one-program vector kernel takes this tensor (ndim < 2, bf16 or fp32, at most _VECTOR_NUMEL
    elements: norm scales and biases)."""
    return _on_device(param) and param.ndim < 2 and param.dtype in (torch.bfloat16, torch.float32) \
        and param.numel() <= _VECTOR_NUMEL


def fused_vector_update(param, grad, second_moment, momentum, step, keys, hyper, totals, *,
                        beta2_decay: bool) -> None:
    """One vector's update (kernels.unfactored_update's arguments): one kernel launch."""
    _vector_kernel[(1,)](param, grad.contiguous(), second_moment, param if momentum is None else momentum, step,
                         keys, totals, hyper, param.numel(), BLOCK=_VECTOR_BLOCK, BETA2_DECAY=beta2_decay,
                         HAS_MOMENTUM=momentum is not None, PARAM_BF16=param.dtype == torch.bfloat16,
                         MOMENTUM_BF16=momentum is not None and momentum.dtype == torch.bfloat16,
                         INTERPRETED=not param.is_cuda)


def supports(param: torch.Tensor) -> bool:
    """Whether the fused kernels take this tensor: a matrix of bf16 or fp32 with int32 element indices, on CUDA
    (or on the CPU under Triton's interpreter, TRITON_INTERPRET=1, which the CPU tests use)."""
    return _on_device(param) and param.ndim == 2 and param.dtype in (torch.bfloat16, torch.float32) \
        and param.numel() < 2**31


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) in plain Python: `triton.cdiv` called from the host costs about 15 us (a constexpr function)."""
    return -(-a // b)


@functools.lru_cache(maxsize=None)
def _layout(R: int, C: int):
    """The update-RMS pass's launch grid, the statistics pass's (and its tiles a program), the row factor's
    programs and their power-of-two bound, and the sizes of the temporaries (each padded to 16 bytes) of an (R, C)
    matrix's update: computed once per shape."""
    grid = (_cdiv(R, _TILE_ROWS), _cdiv(C, _TILE_COLS))
    tiles_r, tiles_c = _cdiv(R, _STATS_ROWS), _cdiv(C, _STATS_COLS)
    strip = 1
    while strip < _STATS_STRIP and _cdiv(tiles_r, 2 * strip) * tiles_c >= _STATS_PROGRAMS:
        strip *= 2
    stats_grid = (_cdiv(tiles_r, strip), tiles_c)
    row_programs = _cdiv(R, _FACTOR_ROWS)
    sizes = (stats_grid[1] * R, stats_grid[0] * C, stats_grid[0] * stats_grid[1], 4, R, row_programs, C,
             grid[0] * grid[1])
    return grid, stats_grid, strip, row_programs, max(16, 1 << (row_programs - 1).bit_length()), sizes, \
        tuple(-(-n // 4) * 4 for n in sizes)


def fused_factored_update(param, grad, row, col, momentum, step, keys, hyper, totals, projector=None, *,
                          rows_per_chunk: int, beta2_decay: bool) -> None:
    """One matrix's update: param, grad (R, C); row (1, R); col (1, C); momentum (R, C), or (R, r) in the
    subspace of ``projector`` (C, r), or None. ``keys`` are the torch path's per-chunk keys of ``rows_per_chunk``
    rows each, so the stochastic rounding draws the same bits. Five Triton kernels and a sum (with subspace momentum
    two GEMMs and a kernel more per chunk of rows): a few hundred microseconds of host time, which the update of a
    small matrix is bound by."""
    grad = grad.contiguous()
    R, C = param.shape
    grid, stats_grid, strip, row_programs, P, sizes, padded = _layout(R, C)
    # All fp32 temporaries in one allocation; the kernels are given their sizes, and only the update-RMS partials
    # (summed by torch) and, with subspace momentum, the column factor are cut to them.
    row_part, col_part, sq_part, scalars, row_raw, row_sums, col_factor, usq_part = torch.empty(
        sum(padded), dtype=torch.float32, device=param.device).split_with_sizes(padded)
    _stats_kernel[stats_grid](grad, row_part, col_part, sq_part, R, C, BR=_STATS_ROWS, BC=_STATS_COLS,
                              ITERATIONS=strip, num_warps=_STATS_WARPS)
    _scalar_kernel[(1,)](sq_part, sizes[2], step, totals, hyper, scalars, BETA2_DECAY=beta2_decay, B=1024,
                         INTERPRETED=not param.is_cuda)
    _factor_kernel[(row_programs + _cdiv(C, _FACTOR_COLS),)](
        row, col, row_part, col_part, row_raw, row_sums, col_factor, scalars, hyper, R, C, *stats_grid,
        row_programs, FR=_FACTOR_ROWS, FBR=_FACTOR_ROW_BLOCK, FC=_FACTOR_COLS, FBC=_FACTOR_COL_BLOCK)
    factors = (row_raw, row_sums, row_programs)
    _update_sq_kernel[grid](grad, *factors, col_factor, scalars, usq_part, R, C, BR=_TILE_ROWS, BC=_TILE_COLS, P=P,
                            num_warps=_TILE_WARPS)
    update_sq = usq_part[:sizes[-1]].sum()
    full_momentum = momentum is not None and projector is None

    def apply(row_start: int, row_end: int, back=None) -> None:
        rows = _APPLY_ROWS_FULL_MOMENTUM if full_momentum else _APPLY_ROWS
        _apply_kernel[(_cdiv(row_end - row_start, rows), _cdiv(C, _APPLY_COLS))](
            param, grad, momentum if full_momentum else param, param if back is None else back, *factors,
            col_factor, update_sq, param.numel(), scalars, step, keys, rows_per_chunk, hyper, row_start, row_end, R,
            C, BR=rows, BC=_APPLY_COLS, P=P, FULL_MOMENTUM=full_momentum, SUBSPACE=back is not None,
            PARAM_BF16=param.dtype == torch.bfloat16,
            MOMENTUM_BF16=full_momentum and momentum.dtype == torch.bfloat16, num_warps=4)

    if projector is None:
        return apply(0, R)
    # Subspace momentum: the projection u P and the back-projection D P^T are GEMMs in the gradient's dtype (bf16
    # operands, fp32 accumulation), per chunk of rows; the back-projection in blocks of at most _BACK_NUMEL
    # elements, each added by the apply kernel.
    rank = projector.shape[-1]
    scaled_basis = torch.mul(col_factor[:C, None], projector, out=grad.new_empty(projector.shape))  # cast in-kernel
    basis_t = projector.t().to(grad.dtype)
    block = max(1, _BACK_NUMEL // C)
    for i, start in enumerate(range(0, R, rows_per_chunk)):
        end = min(start + rows_per_chunk, R)
        correction = grad[start:end] @ scaled_basis
        _momentum_kernel[(_cdiv(end - start, _MOMENTUM_ROWS), _cdiv(rank, _MOMENTUM_RANKS))](
            correction, *factors, momentum, update_sq, param.numel(), scalars, step, keys, i, hyper, start,
            end - start, R, rank, BR=_MOMENTUM_ROWS, BK=_MOMENTUM_RANKS, P=P,
            MOMENTUM_BF16=momentum.dtype == torch.bfloat16)
        for block_start in range(start, end, block):
            block_end = min(block_start + block, end)
            apply(block_start, block_end, correction[block_start - start:block_end - start] @ basis_t)
