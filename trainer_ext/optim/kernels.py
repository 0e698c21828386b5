"""The update math of `LowMemoryAdafactor` (trainer_ext/optim/optimizer.py) as plain torch functions.

Hyperparameters and step counts are device tensors, so that each function can be compiled with
``torch.compile(fullgraph=True)`` and run without host syncs, and a learning-rate change never recompiles.
Stochastic rounding to bf16 takes its random bits from a counter-based integer hash of (seed, parameter index,
chunk, step, element): the same bits eager or compiled, on CPU or GPU, and a resumed run reproduces them
without saving any generator state.
"""

from __future__ import annotations

import functools
import inspect
import math
from collections.abc import Callable
from typing import NamedTuple

import torch

# Layout of the per-group device tensor of hyperparameters. Passing them as one tensor (not Python
# floats) means a learning-rate change never recompiles the compiled update.
LR, WEIGHT_DECAY, BETA1, BETA2, BETA2_DECAY, EPS, CLIP, RESIDUAL = range(8)


def hyper_values(group: dict) -> tuple[float, ...]:
    """A parameter group's hyperparameters in the layout above (no momentum / beta2 decay: 0)."""
    return (group["lr"], group["weight_decay"], group["momentum"] or 0.0, group["beta2"],
            group["beta2_decay"] or 0.0, group["eps"], group["clip_threshold"], group["subspace_residual"])


def validate_group(group: dict, check_params: bool = True) -> None:
    """Raise ValueError naming the first hyperparameter (or parameter) of ``group`` LowMemoryAdafactor cannot use."""

    def check(name: str, ok: bool, allowed: str) -> None:
        if not ok:
            raise ValueError(f"{name} must be {allowed}, got {group[name]!r}")

    check("lr", group["lr"] >= 0.0, ">= 0")
    check("weight_decay", group["weight_decay"] >= 0.0, ">= 0")
    check("momentum", group["momentum"] is None or 0.0 <= group["momentum"] < 1.0, "None or in [0, 1)")
    check("momentum_rank_fraction", group["momentum_rank_fraction"] is None
          or 0.0 < group["momentum_rank_fraction"] < 1.0, "None (full momentum) or in (0, 1)")
    check("projection_interval", isinstance(group["projection_interval"], int) and group["projection_interval"] >= 1,
          "an integer >= 1")
    check("beta2_decay", group["beta2_decay"] is None or group["beta2_decay"] > 0.0, "None or > 0")
    if group["beta2_decay"] is None:
        check("beta2", 0.0 <= group["beta2"] < 1.0, "in [0, 1) (or in (0, 1] with beta2_decay)")
    else:
        check("beta2", 0.0 < group["beta2"] <= 1.0, "in (0, 1] with beta2_decay")
    check("eps", group["eps"] > 0.0, "> 0")
    check("clip_threshold", group["clip_threshold"] > 0.0, "> 0")
    check("subspace_residual", 0.0 <= group["subspace_residual"] <= 1.0, "in [0, 1]")
    for p in group["params"] if check_params else ():
        if p.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"parameters must be torch.bfloat16 or torch.float32, got {p.dtype}")
        if not p.is_contiguous():
            raise ValueError("parameters must be contiguous (the update works on views of the weight)")


# Salts that give weights, momentum, subspace bases and the shards of a sharded weight independent random streams.
WEIGHT_SALT, MOMENTUM_SALT, _PROJECTOR_SALT, SHARD_SALT = 0x1B873593, 0x68E31DA4, 0x2545F491, 0x3C6EF372


# ----------------------------------------------------------------------------- random bits and rounding


def mix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer hash (Chris Wellons' "lowbias32") on int32 tensors.

    Multiplication wraps modulo 2**32; right shifts are masked so that they are logical, not arithmetic.
    """
    x = x ^ ((x >> 16) & 0xFFFF)
    x = x * 0x7FEB352D
    x = x ^ ((x >> 15) & 0x1FFFF)
    x = x * -0x7B935975  # 0x846CA68B as a signed int32
    return x ^ ((x >> 16) & 0xFFFF)


def _random_bits(shape: torch.Size, key: torch.Tensor, step: torch.Tensor, salt: int) -> torch.Tensor:
    """Pseudo-random int32 per element, a pure function of (key, step, salt, element index)."""
    stream = mix32(key ^ mix32(step.to(torch.int32) ^ salt))
    index = torch.arange(math.prod(shape), dtype=torch.int32, device=key.device).view(shape)
    return mix32(mix32(index) ^ stream)


def round_to_bf16_stochastic(x: torch.Tensor, random_bits: torch.Tensor) -> torch.Tensor:
    """Round fp32 ``x`` to bf16, up or down with probability proportional to the distance.

    bf16 is the top 16 bits of fp32. Adding a uniform 16-bit integer to the low half of the fp32 bit
    pattern carries into the top half with probability (low half) / 2**16, then truncation keeps the top
    half. This is unbiased, E[round(x)] = x, so updates far smaller than a bf16 step still move weights
    on average (plain rounding to nearest would drop them). Works for negative values too: the bit
    pattern is sign-magnitude, so the magnitude is what rounds. ``x`` must be finite.
    """
    bits = x.view(torch.int32) + (random_bits & 0xFFFF)
    return (bits & -65536).view(torch.float32).to(torch.bfloat16)


def _store_where(target: torch.Tensor, value: torch.Tensor, ok: torch.Tensor, key: torch.Tensor,
                 step: torch.Tensor, salt: int) -> None:
    """Write fp32 ``value`` into ``target`` (in its own dtype) where ``ok``, else leave it unchanged."""
    if target.dtype == torch.bfloat16:
        value = round_to_bf16_stochastic(value, _random_bits(value.shape, key, step, salt))
    target.copy_(torch.where(ok, value, target))


# ----------------------------------------------------------------------------- the update math
# Plain torch functions on tensors only (hyperparameters and step counts are device tensors), so that
# each can be compiled with fullgraph=True and run without host syncs. ``ok`` is a 0-d bool tensor that
# is False when the tensor's gradient is not finite; every state and weight write goes through
# torch.where(ok, ...), so a skipped update is decided on the device.


def _beta2_and_bias_correction(t: torch.Tensor, hyper: torch.Tensor, beta2_decay: bool):
    """beta2 for step ``t`` and the factor that removes the bias of the second-moment average.

    Constant beta2: the average is biased towards zero by (1 - beta2**t), Adam-style correction. With
    Adafactor's schedule beta2_t = 1 - t**-decay (capped at beta2), beta2_1 = 0 makes the average's
    weights sum to one at every step, so it is unbiased as it stands.
    """
    if beta2_decay:
        beta2 = torch.minimum(hyper[BETA2], 1.0 - t.pow(-hyper[BETA2_DECAY]))
        return beta2, torch.ones_like(t)
    return hyper[BETA2], 1.0 - hyper[BETA2].pow(t)


def _record(step: torch.Tensor, grad_sq: torch.Tensor, totals: torch.Tensor) -> torch.Tensor:
    """Advance the step if the gradient is finite; add to the step's grad-norm and skip totals."""
    ok = torch.isfinite(grad_sq)
    step.add_(ok.to(step.dtype))
    totals[0] += grad_sq
    totals[1] += (~ok).to(totals.dtype)
    return ok


def _momentum_bias_correction(step: torch.Tensor, hyper: torch.Tensor) -> torch.Tensor:
    """1 - beta1**t, the denominator that removes the bias of the first moment (Adam's)."""
    return 1.0 - hyper[BETA1].pow(torch.clamp(step, min=1.0))


def _clip_scale(update_sq: torch.Tensor, numel: int, hyper: torch.Tensor) -> torch.Tensor:
    """Adafactor's update clipping: divide by max(1, RMS(update) / clip_threshold)."""
    return 1.0 / torch.clamp(torch.sqrt(update_sq / numel) / hyper[CLIP], min=1.0)


def _apply_update(param: torch.Tensor, update: torch.Tensor, momentum: torch.Tensor | None,
                  ok: torch.Tensor, step: torch.Tensor, key: torch.Tensor, hyper: torch.Tensor,
                  projector: torch.Tensor | None = None) -> None:
    """Momentum (optional), decoupled weight decay, and the in-place weight write.

    With a ``projector`` P (C, r) of orthonormal columns, ``momentum`` (..., R, r) is the first moment of the
    update's part in the subspace P spans, u P; that part of the update is replaced by its bias-corrected momentum
    and the rest, u - u P P^T, passes through scaled by ``hyper[RESIDUAL]`` (subspace momentum, see
    LowMemoryAdafactor).
    """
    if momentum is not None:
        # ``step`` already counts this update (when ok), so the first one divides by 1 - beta1.
        beta1 = hyper[BETA1]
        projected = update if projector is None else update @ projector
        averaged = beta1 * momentum.float() + (1.0 - beta1) * projected
        _store_where(momentum, averaged, ok, key, step, MOMENTUM_SALT)
        corrected = averaged / _momentum_bias_correction(step, hyper)
        if projector is None:
            update = corrected
        else:  # rho u + (m_hat - rho u P) P^T
            residual = hyper[RESIDUAL]
            update = residual * update + (corrected - residual * projected) @ projector.T
    lr = hyper[LR]
    new_param = param.float() * (1.0 - lr * hyper[WEIGHT_DECAY]) - lr * update
    _store_where(param, new_param, ok, key, step, WEIGHT_SALT)


def _grad_stats(grad: torch.Tensor, row_mean: torch.Tensor, col_sum: torch.Tensor, grad_sq: torch.Tensor,
                hyper: torch.Tensor) -> None:
    """For a chunk (k, r, C): write the row means of grad**2 + eps into ``row_mean`` (k, r), add its
    column sums to ``col_sum`` (k, C) and the sum of grad**2 to ``grad_sq`` (in place, so that a chunk
    is one call with no eager glue)."""
    squared = grad.float().square()
    squared_eps = squared + hyper[EPS]
    row_mean.copy_(squared_eps.mean(-1))
    col_sum.add_(squared_eps.sum(-2))
    grad_sq.add_(squared.sum())


def _update_factors(row: torch.Tensor, col: torch.Tensor, row_mean: torch.Tensor, col_sum: torch.Tensor,
                    grad_sq: torch.Tensor, step: torch.Tensor, totals: torch.Tensor, hyper: torch.Tensor,
                    beta2_decay: bool, row_totals: torch.Tensor | None = None, rows: int | None = None):
    """Update the row (B, R) and column (B, C) averages; return ok and the factors of 1/sqrt(v_hat).

    v_hat[i, j] = row[i] * col[j] / mean(row) / bias_correction, the rank-1 estimate of Adafactor.
    A shard of rows (trainer_ext/optim/shards.py) passes the whole weight's number of rows and ``row_totals``, the
    sums of ``row`` and ``row_mean`` over all of its rows, from which mean(row) follows.
    """
    rows = row.shape[-1] if rows is None else rows
    beta2, bias_correction = _beta2_and_bias_correction(step + 1.0, hyper, beta2_decay)
    new_row = beta2 * row + (1.0 - beta2) * row_mean
    new_col = beta2 * col + (1.0 - beta2) * col_sum / rows
    ok = _record(step, grad_sq, totals)
    row.copy_(torch.where(ok, new_row, row))
    col.copy_(torch.where(ok, new_col, col))
    if row_totals is None:
        row_average = new_row.mean(-1, keepdim=True)
    else:
        row_average = (beta2 * row_totals[0] + (1.0 - beta2) * row_totals[1]) / rows
    row_factor = torch.rsqrt(new_row / (row_average * bias_correction))
    return ok, row_factor, torch.rsqrt(new_col)


def _factored_update_sq(grad: torch.Tensor, row_factor: torch.Tensor, col_factor: torch.Tensor,
                        update_sq: torch.Tensor) -> None:
    update = grad.float() * row_factor.unsqueeze(-1) * col_factor.unsqueeze(-2)
    update_sq.add_(update.square().sum())


def _factored_apply(param, grad, momentum, row_factor, col_factor, update_sq, numel: int, ok, step, key,
                    hyper, projector=None) -> None:
    scale = _clip_scale(update_sq, numel, hyper)
    update = grad.float() * row_factor.unsqueeze(-1) * (col_factor.unsqueeze(-2) * scale)
    _apply_update(param, update, momentum, ok, step, key, hyper, projector)


class _Kernels(NamedTuple):
    grad_stats: Callable
    update_factors: Callable
    update_sq: Callable
    apply: Callable


EAGER_KERNELS = _Kernels(_grad_stats, _update_factors, _factored_update_sq, _factored_apply)
_WHOLE = ((slice(None), slice(None)),)


def factored_update(param, grad, row, col, momentum, step, keys, hyper, totals, projector=None, *,
                     chunks, kernels: _Kernels, beta2_decay: bool, shard=None) -> None:
    """One tensor's factored update. param, grad: (B, R, C); row: (B, R); col: (B, C); momentum: (B, R, C), or
    (B, R, r) in the subspace of ``projector`` (C, r).

    ``chunks`` index (B, R) and cover it; three passes over them, because the column statistics and the
    update RMS each need the whole tensor before anything can be written. ``shard``: a `shards.RowShard` when
    the tensors hold a block of rows (B = 1) of a sharded weight; the sums that span rows are then taken over
    every shard.
    """
    row_mean = torch.empty_like(row)
    col_sum = torch.zeros_like(col)
    grad_sq = torch.zeros((), dtype=torch.float32, device=row.device)
    for rows in chunks:
        kernels.grad_stats(grad[rows], row_mean[rows], col_sum[rows[0]], grad_sq, hyper)
    row_totals = None
    if shard is not None:
        row_totals = torch.stack([row.sum(), row_mean.sum()])
        shard.sum_(col_sum, grad_sq, row_totals)
    ok, row_factor, col_factor = kernels.update_factors(
        row, col, row_mean, col_sum, grad_sq, step, totals, hyper, beta2_decay, row_totals,
        None if shard is None else shard.rows,
    )
    update_sq = torch.zeros_like(grad_sq)
    for rows in chunks:
        kernels.update_sq(grad[rows], row_factor[rows], col_factor[rows[0]], update_sq)
    if shard is not None:
        shard.sum_(update_sq)
    numel = grad.numel() if shard is None else shard.numel
    for i, rows in enumerate(chunks):
        kernels.apply(param[rows], grad[rows], None if momentum is None else momentum[rows], row_factor[rows],
                      col_factor[rows[0]], update_sq, numel, ok, step, keys[i], hyper, projector)


def _factored_update_whole(param, grad, row, col, momentum, step, keys, hyper, totals, projector=None, *,
                           beta2_decay):
    """The whole tensor as one chunk: compiled as a single graph, so it fuses into a few kernels."""
    factored_update(param, grad, row, col, momentum, step, keys, hyper, totals, projector,
                     chunks=_WHOLE, kernels=EAGER_KERNELS, beta2_decay=beta2_decay)


def range_finder(grad: torch.Tensor, chunks, rank: int, key: torch.Tensor, refresh: int, shard=None) -> torch.Tensor:
    """An orthonormal basis (C, rank) of the dominant right singular subspace of ``grad`` (B, R, C).

    One step of randomized subspace iteration: Y = G^T (G Omega) with a pseudo-random Omega (C, rank) drawn from
    the counter hash of (key, refresh), then QR. Row chunks keep the fp32 temporaries small. Not finite (a
    non-finite gradient): the caller keeps its previous basis. A ``shard`` of rows sums Y over the shards, so every
    process gets the same basis.
    """
    columns = grad.shape[-1]
    bits = _random_bits(torch.Size((columns, rank)), key, torch.tensor(refresh, device=key.device), _PROJECTOR_SALT)
    omega = (bits & 0xFFFF).float() / 32768.0 - 1.0
    basis = torch.zeros(columns, rank, dtype=torch.float32, device=grad.device)
    for rows in chunks:
        block = grad[rows].float().reshape(-1, columns)
        basis += block.T @ (block @ omega)
    if shard is not None:
        shard.sum_(basis)
    return torch.linalg.qr(basis).Q


def unfactored_update(param, grad, second_moment, momentum, step, keys, hyper, totals, *,
                      beta2_decay: bool, shard=None) -> None:
    """Tensors with ndim < 2 (biases, norm scales): a full fp32 second moment; they are small. A ``shard`` (a block
    of a sharded vector) sums the squared gradient and the squared update over every shard."""
    grad32 = grad.float()
    grad_sq = grad32.square()
    beta2, bias_correction = _beta2_and_bias_correction(step + 1.0, hyper, beta2_decay)
    new_second_moment = beta2 * second_moment + (1.0 - beta2) * (grad_sq + hyper[EPS])
    grad_sq_sum = grad_sq.sum()
    if shard is not None:
        shard.sum_(grad_sq_sum)
    ok = _record(step, grad_sq_sum, totals)
    second_moment.copy_(torch.where(ok, new_second_moment, second_moment))
    update = grad32 * torch.rsqrt(new_second_moment / bias_correction)
    update_sq = update.square().sum()
    if shard is not None:
        shard.sum_(update_sq)
    update = update * _clip_scale(update_sq, update.numel() if shard is None else shard.numel, hyper)
    _apply_update(param, update, momentum, ok, step, keys[0], hyper)


# dynamic=True lets one graph serve many tensor shapes, but dynamo still specialises sizes of 1, equal
# sizes and zero view offsets, so a model's tensors need a handful of graphs per function. Dynamo's
# default limit (8) would be close, and with fullgraph=True hitting it is an error, not a fallback.
_RECOMPILE_LIMIT = 64


def _compile_update(fn: Callable) -> Callable:
    options = dict(fullgraph=True, dynamic=True)
    if "recompile_limit" in inspect.signature(torch.compile).parameters:
        return torch.compile(fn, recompile_limit=_RECOMPILE_LIMIT, **options)
    # Older torch has only the global limit: raise it (never lower it). A per-call config.patch would
    # cost more than the update of a small tensor.
    dynamo_config = torch._dynamo.config
    dynamo_config.recompile_limit = max(dynamo_config.recompile_limit, _RECOMPILE_LIMIT)
    return torch.compile(fn, **options)


@functools.cache
def compiled_kernels() -> tuple[_Kernels, Callable, Callable]:
    """Compiled kernels, built on first use."""
    kernels = _Kernels(*(_compile_update(fn) for fn in EAGER_KERNELS))
    return kernels, _compile_update(_factored_update_whole), _compile_update(unfactored_update)


@functools.lru_cache(maxsize=256)
def row_chunks(num_slices: int, rows: int, cols: int, max_numel: int) -> tuple[tuple[slice, slice], ...]:
    """Index pairs (slices of B, slices of R) for a (B, R, C) tensor, each chunk <= max_numel elements
    (at least one row). Whole (R, C) slices are grouped when they are small."""
    slice_numel = max(rows * cols, 1)
    if slice_numel <= max_numel:
        per_chunk = max_numel // slice_numel
        return tuple((slice(b, min(b + per_chunk, num_slices)), slice(None))
                     for b in range(0, num_slices, per_chunk))
    per_chunk = max(max_numel // max(cols, 1), 1)
    return tuple((slice(b, b + 1), slice(r, min(r + per_chunk, rows)))
                 for b in range(num_slices) for r in range(0, rows, per_chunk))


def to_device(values: list, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Small host list to a device tensor without a device sync (pinned memory, non_blocking)."""
    host = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.to(device)
