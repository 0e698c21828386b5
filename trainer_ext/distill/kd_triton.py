"""Distillation from a cached top-k teacher over one chunk of logits, as two Triton kernels (the fused path on CUDA).

The torch path of a cached teacher (`losses._chunk_loss_sums`) casts a chunk of logits to fp32 and keeps about six
fp32 copies of it for autograd (the CE's softmax, the temperature's log-softmax, their gradients): at a 99,520-entry
vocabulary that is what made the loss take a tenth of a 7B step and overshoot the memory plan. Here the logits stay
in the head's dtype and are read three times, and the gradient is written over them in place:

1. `row_lse`: per position, the log-sum-exp of the logits over the whole head (the CE at temperature 1) and of the
   logits / T over the real vocabulary [0, limit) (the distillation's student softmax), in one pass.
2. The loss over the k + 1 buckets (the cached ids and the tail) needs only the student's logits at the k ids and
   those two numbers, so it runs in torch on (positions, k) tensors (`losses._fused_topk_loss`), autograd included;
   it gives each bucket's gradient.
3. `write_grad`: the gradient wrt a logit z_j of a kept position is

       ce_scale * (softmax(z)_j - [j = target]) + [j < limit] * dense * softmax(z / T)_j + correction_j

   where `dense` is minus the distillation weight over T times the sum of the ids' bucket gradients (every logit
   moves the student's softmax under every id) and correction_j that weight over T times the gradient of id j's
   bucket (0 off the k ids). One pass writes the first two terms over the row; the k ids get their full value from
   the logits loaded before that pass, stored after it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Logits per iteration of a program and its warps, the online log-sum-exp: as plain CE's.
from trainer_ext.distill.ce_triton import _BLOCK, _WARPS, check_rows, online_lse_update


@triton.jit
def _lse_kernel(logits_ptr, row_stride, lse_ptr, lse_t_ptr, inv_t, VOCAB: tl.constexpr, LIMIT: tl.constexpr,
                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    running_max = float("-inf")
    total = 0.0
    running_max_t = float("-inf")
    total_t = 0.0
    for start in range(0, VOCAB, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        x = tl.load(base + offsets, mask=offsets < VOCAB, other=float("-inf")).to(tl.float32)
        running_max, total = online_lse_update(running_max, total, x)
        if start < LIMIT:
            x_t = tl.where(offsets < LIMIT, x * inv_t, float("-inf"))
            running_max_t, total_t = online_lse_update(running_max_t, total_t, x_t)
    tl.store(lse_ptr + row, running_max + tl.log(total))
    tl.store(lse_t_ptr + row, running_max_t + tl.log(total_t))


@triton.jit
def _grad_kernel(logits_ptr, row_stride, targets_ptr, lse_ptr, lse_t_ptr, ce_scale_ptr, dense_ptr, ids_ptr,
                 correction_ptr, inv_t, topk, VOCAB: tl.constexpr, LIMIT: tl.constexpr, BLOCK: tl.constexpr,
                 K_BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    target = tl.load(targets_ptr + row)
    lse = tl.load(lse_ptr + row)
    lse_t = tl.load(lse_t_ptr + row)
    ce_scale = tl.load(ce_scale_ptr + row)
    dense = tl.load(dense_ptr + row)
    slots = tl.arange(0, K_BLOCK)
    in_k = slots < topk
    ids = tl.load(ids_ptr + row * topk + slots, mask=in_k, other=0)
    x_ids = tl.load(base + ids, mask=in_k, other=0.0).to(tl.float32)
    at_ids = (ce_scale * (tl.exp(x_ids - lse) - tl.where(ids == target, 1.0, 0.0))
              + dense * tl.exp(x_ids * inv_t - lse_t)
              + tl.load(correction_ptr + row * topk + slots, mask=in_k, other=0.0))
    for start in range(0, VOCAB, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        in_row = offsets < VOCAB
        x = tl.load(base + offsets, mask=in_row, other=0.0).to(tl.float32)
        grad = ce_scale * (tl.exp(x - lse) - tl.where(offsets == target, 1.0, 0.0))
        grad += tl.where(offsets < LIMIT, dense * tl.exp(x * inv_t - lse_t), 0.0)
        tl.store(base + offsets, grad.to(logits_ptr.dtype.element_ty), mask=in_row)
    tl.debug_barrier()  # the dense pass's stores land before the ids' values overwrite them
    tl.store(base + ids, at_ids.to(logits_ptr.dtype.element_ty), mask=in_k)


def row_lse(logits: torch.Tensor, temperature: float, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of `logits` (C, V): logsumexp over all V and logsumexp(logits[:, :limit] / temperature), fp32 (C,)."""
    check_rows(logits, "row_lse")
    rows, vocab = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    lse_t = torch.empty_like(lse)
    _lse_kernel[(rows,)](logits, logits.stride(0), lse, lse_t, 1.0 / temperature, VOCAB=vocab, LIMIT=limit,
                         BLOCK=min(_BLOCK, triton.next_power_of_2(vocab)), num_warps=_WARPS)
    return lse, lse_t


def write_grad(logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, lse_t: torch.Tensor,
               ce_scale: torch.Tensor, dense: torch.Tensor, ids: torch.Tensor, correction: torch.Tensor,
               temperature: float, limit: int) -> torch.Tensor:
    """Write the gradient of the module docstring over `logits` (C, V) and return it. `ce_scale` and `dense` are
    fp32 (C,) (0 at ignored positions), `ids` (C, k) distinct ids below `limit` per row, `correction` fp32 (C, k)."""
    check_rows(logits, "write_grad")
    rows, vocab = logits.shape
    ids, correction = ids.contiguous(), correction.float().contiguous()
    _grad_kernel[(rows,)](logits, logits.stride(0), targets, lse, lse_t, ce_scale, dense, ids, correction,
                          1.0 / temperature, ids.shape[1], VOCAB=vocab, LIMIT=limit,
                          BLOCK=min(_BLOCK, triton.next_power_of_2(vocab)),
                          K_BLOCK=triton.next_power_of_2(ids.shape[1]), num_warps=_WARPS)
    return logits
