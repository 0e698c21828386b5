"""Plain cross-entropy of one chunk of logits and its gradient, as one Triton kernel (the ``fused`` loss path on CUDA).

One program per position reads its row of logits twice in the logits' own dtype (an online max and sum of
exponentials, then softmax minus the target's one-hot) and writes the gradient over it, in place, computing in
fp32 registers. The torch path (`losses._ce_and_grad`) first casts a bf16 chunk to an fp32 copy and then moves it
about ten times through about fifteen kernels; here a chunk is one launch and three passes of the logits' dtype,
and no fp32 chunk is built. The results are the same as the torch path's on the same logits: the logits of a bf16
head are bf16 either way (the torch path casts the bf16 product to fp32), and the torch path casts its fp32
gradient to bf16 before the head's matmuls, which is the rounding done here at the store.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

# Logits per iteration of a program (a 65,536-entry vocabulary is eight of them) and its warps. The vocabulary is a
# compile-time constant (one per run), so the loops over it are static.
_BLOCK, _WARPS = 8192, 16


@triton.jit
def online_lse_update(running_max, total, x):
    """One block `x` into a running (max, sum of exp(x - max)) pair: the log-sum-exp of a row in one pass."""
    new_max = tl.maximum(running_max, tl.max(x, axis=0))
    return new_max, total * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), axis=0)


@triton.jit
def _ce_kernel(logits_ptr, row_stride, targets_ptr, scale_ptr, loss_ptr, ignore_index,
               VOCAB: tl.constexpr, HAS_GRAD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * row_stride
    target = tl.load(targets_ptr + row)
    keep = target != ignore_index
    running_max = float("-inf")
    total = 0.0
    for start in range(0, VOCAB, BLOCK):
        offsets = start + tl.arange(0, BLOCK)
        x = tl.load(base + offsets, mask=offsets < VOCAB, other=float("-inf")).to(tl.float32)
        running_max, total = online_lse_update(running_max, total, x)
    lse = running_max + tl.log(total)
    target_logit = tl.load(base + tl.where(keep, target, 0)).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(keep, lse - target_logit, 0.0))
    if HAS_GRAD:
        scale = tl.where(keep, tl.load(scale_ptr).to(tl.float32), 0.0)
        for start in range(0, VOCAB, BLOCK):
            offsets = start + tl.arange(0, BLOCK)
            in_row = offsets < VOCAB
            x = tl.load(base + offsets, mask=in_row, other=0.0).to(tl.float32)
            grad = tl.exp(x - lse) - tl.where(offsets == target, 1.0, 0.0)
            tl.store(base + offsets, (grad * scale).to(logits_ptr.dtype.element_ty), mask=in_row)


def check_rows(logits: torch.Tensor, what: str) -> None:
    """ValueError unless `logits` (C, V) is contiguous along the vocabulary, as the kernels index it."""
    if logits.stride(1) != 1:
        raise ValueError(f"{what} needs logits contiguous along the vocabulary, got strides {logits.stride()}")


def ce_and_grad(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor | None,
                ignore_index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Summed CE over the kept positions of `logits` (C, V) and, when `scale` (a 0-d tensor) is given, its gradient
    wrt the logits times `scale` (0 at positions whose target is `ignore_index`), written over `logits`."""
    rows, vocab = logits.shape
    check_rows(logits, "ce_and_grad")
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    block = min(_BLOCK, triton.next_power_of_2(vocab))
    _ce_kernel[(rows,)](logits, logits.stride(0), targets, losses if scale is None else scale, losses, ignore_index,
                        VOCAB=vocab, HAS_GRAD=scale is not None, BLOCK=block, num_warps=_WARPS)
    return losses.sum(), (None if scale is None else logits)
