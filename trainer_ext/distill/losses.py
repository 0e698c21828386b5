"""One chunked LM loss for plain cross-entropy and for distillation from a teacher.

The loss takes the student's last hidden states and its LM head weight instead of logits, so a
(positions, vocab) fp32 tensor is never built for the whole batch: the positions are processed `chunk_size` at a
time (by default at most 2**27 logits, 256 MiB in bf16, in multiples of 128 positions: 2,048 positions of a
65,536-entry vocabulary). For a 100k vocabulary and 8k positions, full fp32 logits would be 3.2 GB, and autograd
would keep several tensors of that size alive until backward. Following Liger-Kernel's fused linear losses, the
gradients wrt hidden states and head weight are therefore also computed chunk by chunk in the forward pass; backward
only scales them by the incoming grad.

Per non-ignored position (labels == -100 are ignored), averaged over those positions:

    loss = (1 - alpha) * CE(student, label) + alpha * T^2 * D(p_t || p_s)

with p_t, p_s the teacher and student distributions at temperature T (softmax(logits / T)) and D:

    forward_kl   sum p_t (log p_t - log p_s)                     KL(p_t || p_s), the default
    reverse_kl   sum p_s (log p_s - log p_t)                     KL(p_s || p_t)
    jsd          beta KL(p_t || m) + (1 - beta) KL(p_s || m),    m = beta p_t + (1 - beta) p_s
                 (beta = 0.5 is the usual Jensen-Shannon divergence; 0 < beta < 1)

CE always uses temperature 1 and the student's full head, so with no teacher the loss equals
`F.cross_entropy(hidden @ W.T, labels)`. D compares distributions over the real vocabulary
[0, vocab_limit): head rows past the tokenizer size (padding) are left out of both softmaxes, since
a padding id has zero teacher probability and reverse KL would otherwise be infinite.

Teachers come in two forms:
- `OnlineTeacher`: teacher hidden states and head weight; teacher logits are computed per chunk.
- `TopKTeacher`: cached top-k ids and temperature-1 log-probs (see `teacher_topk`). D is then taken
  over k + 1 buckets: the k cached ids plus one tail bucket holding all other real ids. The student
  side is softmax(logits / T) over the real vocabulary gathered at the ids, its tail is the rest.
  The teacher's tail mass is 1 - sum(exp(logprobs)); at T != 1 the tail keeps that temperature-1
  mass (the ids inside it are unknown, so temperature cannot be applied to them) and the top-k
  mass is re-spread over the k ids in proportion to exp(logprob / T). At T = 1 this is exactly the
  cached distribution.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from trainer_ext.devices import has_triton

IGNORE_INDEX = -100
DIVERGENCES = ("forward_kl", "reverse_kl", "jsd")

# Lower bound on a tail bucket's probability (teacher and student). For a confident teacher the
# cached top-k probabilities sum to 1 within rounding, and a zero tail would make reverse KL
# infinite; 1e-6 is about the resolution of an fp32 sum of probabilities.
TAIL_FLOOR = 1e-6
# A chunk's largest logits tensor by default: 256 MiB, 2**27 logits in bf16 where the fused kernel runs (its one tensor
# of a chunk), 2**26 where the torch path makes an fp32 copy: the 2,048 / 1,024 positions of a 65,536-entry
# vocabulary. Fewer, larger chunks launch fewer kernels (a chunk is about six with the kernel, twenty without), which
# is what a small model's step waits on; 2**27 fp32 logits raised recurrent-7b's peak by 0.7 GiB (BENCHMARKS.md).
CHUNK_BYTES = 2**28
CHUNK_MULTIPLE = 128  # positions: whole GEMM tiles, and the same few block sizes for the allocator across vocabularies


def default_chunk_size(vocab_size: int, logit_bytes: int = 4) -> int:
    """Positions per chunk of the loss for a head of `vocab_size` rows: at most CHUNK_BYTES of logits of
    `logit_bytes` each (see `chunk_logit_bytes`), in whole multiples of CHUNK_MULTIPLE positions (at least one)."""
    logits = CHUNK_BYTES // logit_bytes
    return max(CHUNK_MULTIPLE, logits // max(vocab_size, 1) // CHUNK_MULTIPLE * CHUNK_MULTIPLE)


def chunk_logit_bytes(head_dtype: torch.dtype, device: torch.device, online_teacher: bool) -> int:
    """Bytes per logit of a chunk's largest tensor: the head's dtype where the fused kernels run (plain CE or a
    cached teacher), else fp32 (the torch path, which an online teacher always takes)."""
    return head_dtype.itemsize if not online_teacher and _fused_ce(head_dtype, device) else 4


@dataclass
class OnlineTeacher:
    """Teacher run alongside the student: its last hidden states and LM head weight (no bias).

    `vocab_limit` is the real tokenizer size; teacher ids >= it (head padding) get probability 0.
    Defaults to min(student vocab, teacher vocab).
    """

    hidden: torch.Tensor  # (B, T, H_t)
    lm_head_weight: torch.Tensor  # (V_t, H_t)
    vocab_limit: int | None = None

    def _log_probs(self, rows, student_logits, temperature, vocab_limit):
        hidden = self.hidden[rows].to(self.lm_head_weight.dtype)  # (C, H_t); hidden flattened to (B * T, H_t)
        teacher_logits = (hidden @ self.lm_head_weight.T)[:, :vocab_limit].float()  # (C, L)
        teacher_lp = F.log_softmax(teacher_logits.div_(temperature), dim=-1)  # in place: one less C x L
        student_lp = F.log_softmax(student_logits[:, :vocab_limit] / temperature, dim=-1)
        return teacher_lp, student_lp


@dataclass
class TopKTeacher:
    """Cached teacher: top-k ids and their temperature-1 log-probs over the full vocabulary.

    Log-probs must be finite and ids below `vocab_limit` (what `teacher_topk` produces).
    `vocab_limit` is the real tokenizer size; it defaults to the student's vocabulary size.
    """

    ids: torch.Tensor  # (B, T, k) integer
    logprobs: torch.Tensor  # (B, T, k) float
    vocab_limit: int | None = None

    def _log_probs(self, rows, student_logits, temperature, vocab_limit):
        ids = self.ids[rows].long()  # (C, k); ids and logprobs flattened to (B * T, k)
        student_full = F.log_softmax(student_logits[:, :vocab_limit] / temperature, dim=-1)
        student_lp = _append_tail(student_full.gather(1, ids))
        return self._buckets(rows, temperature), student_lp  # (C, k + 1) each

    def _buckets(self, rows, temperature):
        """The teacher's (C, k + 1) bucket log-probs at `temperature`: the top-k mass re-spread by temperature, its
        total (and so the tail) unchanged."""
        logprobs = self.logprobs[rows].float()  # (C, k)
        top_mass = torch.logsumexp(logprobs, dim=-1, keepdim=True)
        return _append_tail(top_mass + F.log_softmax(logprobs / temperature, dim=-1))


@dataclass
class LossOutput:
    loss: torch.Tensor  # scalar fp32, differentiable wrt hidden and head weight
    ce: torch.Tensor  # scalar, detached: mean cross-entropy at temperature 1
    kd: torch.Tensor  # scalar, detached: mean D at temperature T (without T^2); 0 without teacher


def teacher_topk(
    teacher_logits: torch.Tensor, k: int, vocab_limit: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k ids (int64) and temperature-1 log-probs over the real vocabulary, shape (..., k).

    Ids >= `vocab_limit` (head padding) never appear: the softmax is over the first `vocab_limit`
    logits only.
    """
    vocab_limit = teacher_logits.shape[-1] if vocab_limit is None else vocab_limit
    if not 1 <= vocab_limit <= teacher_logits.shape[-1]:
        raise ValueError(
            f"vocab_limit must be in [1, {teacher_logits.shape[-1]}] (teacher vocab), got {vocab_limit}"
        )
    if not 1 <= k <= vocab_limit:
        raise ValueError(f"k must be in [1, vocab_limit={vocab_limit}], got {k}")
    logprobs = F.log_softmax(teacher_logits[..., :vocab_limit].float(), dim=-1)
    top_logprobs, top_ids = logprobs.topk(k, dim=-1)
    return top_ids, top_logprobs


def chunked_lm_loss(
    hidden: torch.Tensor,
    lm_head_weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    teacher: OnlineTeacher | TopKTeacher | None = None,
    alpha: float = 0.5,
    temperature: float = 1.0,
    divergence: str = "forward_kl",
    jsd_beta: float = 0.5,
    chunk_size: int | None = None,
) -> LossOutput:
    """(1 - alpha) * CE + alpha * T^2 * D, from hidden (B, T, H), head weight (V, H), labels (B, T).

    Labels are already aligned (label t is the target of hidden t); -100 is ignored. Without a
    teacher this is plain CE and `alpha` is unused; with a teacher, D is computed and reported
    even at alpha = 0 (a CE-only run can still log its distance to the teacher). Supports one
    backward pass.

    Peak memory: the head's V x H gradient, summed over the chunks in the weight's dtype (`_accumulate_head_grad`),
    a gradient the size of `hidden`, and per chunk about 1 (CE) to 12 (online teacher, JSD)
    chunk_size x V fp32 temporaries. Halving chunk_size halves the latter at little speed cost
    while a chunk's matmul stays large; None takes `default_chunk_size(V)`.
    """
    if chunk_size is None:
        logit_bytes = chunk_logit_bytes(lm_head_weight.dtype, lm_head_weight.device, isinstance(teacher, OnlineTeacher))
        chunk_size = default_chunk_size(lm_head_weight.shape[0], logit_bytes)
    vocab_limit = _validate(
        hidden, lm_head_weight, labels, teacher, alpha, temperature, divergence, jsd_beta, chunk_size
    )
    if teacher is None:
        alpha = 0.0
    grad_enabled = torch.is_grad_enabled()
    options = _Options(
        alpha=float(alpha),
        temperature=float(temperature),
        divergence=divergence,
        jsd_beta=float(jsd_beta),
        chunk_size=chunk_size,
        vocab_limit=vocab_limit,
        grad_hidden=grad_enabled and hidden.requires_grad,
        grad_weight=grad_enabled and lm_head_weight.requires_grad,
    )
    loss, ce, kd = _ChunkedLMLoss.apply(hidden, lm_head_weight, labels, teacher, options)
    return LossOutput(loss=loss, ce=ce, kd=kd)


@dataclass(frozen=True)
class _Options:
    alpha: float
    temperature: float
    divergence: str
    jsd_beta: float
    chunk_size: int
    vocab_limit: int
    grad_hidden: bool
    grad_weight: bool


class _ChunkedLMLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, teacher, options):
        # Dtypes are chosen explicitly below; an enclosing autocast must not recast the matmuls.
        with torch.autocast(device_type=hidden.device.type, enabled=False):
            loss, ce, kd, grad_hidden, grad_weight = _forward_and_grads(
                hidden, weight, labels, teacher, options
            )
        ctx.grads = (grad_hidden, grad_weight)
        ctx.mark_non_differentiable(ce, kd)
        return loss, ce, kd

    @staticmethod
    def backward(ctx, grad_loss, _grad_ce, _grad_kd):
        if ctx.grads is None:
            raise RuntimeError("chunked_lm_loss supports a single backward pass (no retain_graph)")
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None
        # In place: a scaled copy of the head-weight gradient would cost another V x H tensor.
        if grad_hidden is not None:
            grad_hidden.mul_(grad_loss)
        if grad_weight is not None:
            grad_weight.mul_(grad_loss)
        return grad_hidden, grad_weight, None, None, None


def _forward_and_grads(hidden, weight, labels, teacher, options):
    hidden_flat = hidden.flatten(0, 1)  # (N, H)
    labels_flat = labels.flatten()  # (N,)
    positions = labels_flat.numel()
    device = hidden.device
    # Every position runs through the head, ignored ones included (their CE and D are 0, and so are their
    # gradients): compacting the kept positions would need their count on the host, a wait for the GPU each step.
    # Per-token mean over the kept positions; with none the loss is 0 rather than 0/0, so an empty micro-batch
    # cannot turn the whole step into NaN.
    inv_count = 1.0 / (labels_flat != IGNORE_INDEX).sum().clamp(min=1).float()
    ce_weight = (1.0 - options.alpha) * inv_count
    kd_weight = options.alpha * options.temperature**2 * inv_count
    needs_grad = options.grad_hidden or options.grad_weight

    grad_hidden = torch.empty_like(hidden_flat) if options.grad_hidden else None
    grad_weight = (
        torch.zeros(weight.shape, dtype=_head_grad_dtype(weight.dtype), device=device) if options.grad_weight else None
    )
    ce_sum = torch.zeros((), dtype=torch.float32, device=device)
    kd_sum = torch.zeros((), dtype=torch.float32, device=device)
    teacher = None if teacher is None else _flattened(teacher)

    for start in range(0, positions, options.chunk_size):
        rows = slice(start, min(start + options.chunk_size, positions))
        chunk_hidden = hidden_flat[rows].to(weight.dtype)  # (C, H), a view where the dtypes agree
        logits = chunk_hidden @ weight.T  # (C, V) in the head's dtype; the loss computes in fp32
        # The head matmuls are done by hand below, so the weight never enters a graph and its gradient accumulates
        # in place. Plain CE has its gradient wrt the logits in closed form; with a teacher, autograd runs over this
        # chunk's loss wrt its logits only.
        if teacher is None:
            ce, grad_logits = _plain_ce(logits, labels_flat[rows], ce_weight if needs_grad else None)
        elif isinstance(teacher, TopKTeacher) and _fused_ce(logits.dtype, logits.device):
            ce, kd, grad_logits = _fused_topk_loss(logits, labels_flat[rows], teacher, rows, options,
                                                   (ce_weight, kd_weight) if needs_grad else None)
            kd_sum += kd
        else:
            logits = logits.float()
            with torch.enable_grad():
                logits.requires_grad_(needs_grad)
                ce, kd = _chunk_loss_sums(logits, labels_flat[rows], teacher, rows, options)
                if needs_grad:
                    (grad_logits,) = torch.autograd.grad(ce_weight * ce + kd_weight * kd, logits)
            kd_sum += kd.detach()
        ce_sum += ce.detach()
        if needs_grad:
            grad_cast = grad_logits.to(weight.dtype)  # one cast for both matmuls (none where the kernel ran)
        if options.grad_hidden:
            grad_hidden[rows] = grad_cast @ weight  # (C, H)
        if options.grad_weight:
            _accumulate_head_grad(grad_weight, grad_logits, grad_cast, chunk_hidden)

    ce_mean = ce_sum * inv_count
    kd_mean = kd_sum * inv_count
    loss = (1.0 - options.alpha) * ce_mean + options.alpha * options.temperature**2 * kd_mean
    if grad_hidden is not None:
        grad_hidden = grad_hidden.view_as(hidden)
    if grad_weight is not None:
        grad_weight = grad_weight.to(weight.dtype)
    return loss, ce_mean, kd_mean, grad_hidden, grad_weight


def _head_grad_dtype(weight_dtype: torch.dtype) -> torch.dtype:
    """The dtype the head's gradient is summed over the chunks in: the weight's where it has fp32's exponent range
    (bf16, fp32), else fp32 (an fp16 sum would flush the small gradients of a large batch to zero)."""
    return weight_dtype if weight_dtype in (torch.bfloat16, torch.float32) else torch.float32


def _accumulate_head_grad(grad_weight, grad_logits, grad_cast, chunk_hidden):
    """grad_weight (V, H) += grad_logits.T @ chunk_hidden, in place: no V x H temporary per chunk.

    A bf16 head's gradient is summed in bf16, as a bf16 weight's gradient from autograd and Liger's fused loss are:
    each chunk's product accumulates in fp32 inside the GEMM and is added to the sum with one rounding (a relative
    2**-9 at most per chunk), where an fp32 sum held 2 more bytes per head entry from the loss, at the end of the
    forward pass where a step's activations peak, until backward had consumed it (0.5 GiB at 65,536 x 4,096). An
    fp16 head multiplies in fp32 (`_head_grad_dtype`).
    """
    if grad_weight.dtype == grad_cast.dtype:
        grad_weight.addmm_(grad_cast.T, chunk_hidden)
    else:
        grad_weight.addmm_(grad_logits.T.float(), chunk_hidden.float())


def _plain_ce(logits, targets, scale):
    """`_ce_and_grad` of a chunk of logits in the head's dtype: for a bf16 or fp32 head on CUDA one Triton kernel
    over those logits (ce_triton.py; the same results), elsewhere the torch functions below on an fp32 copy (an fp16
    gradient would flush the small ones of a large batch to zero, see `_accumulate_head_grad`)."""
    if _fused_ce(logits.dtype, logits.device):
        return _ce_kernel().ce_and_grad(logits, targets, scale, IGNORE_INDEX)
    return _ce_and_grad(logits.float(), targets, scale)


def _fused_topk_loss(logits, targets, teacher, rows, options, weights):
    """Summed CE, summed D over the kept positions of one chunk of logits in the head's dtype and, when `weights`
    (ce_weight, kd_weight) are given, the gradient of ce_weight * CE + kd_weight * D wrt the logits, written over
    them: the kernels of kd_triton.py around the loss over the k + 1 buckets, which runs here (a (C, k) autograd)."""
    kernels, temperature, limit = _kd_kernels(), options.temperature, options.vocab_limit
    keep = targets != IGNORE_INDEX
    lse, lse_t = kernels.row_lse(logits, temperature, limit)
    ids = teacher.ids[rows].long()
    ce = torch.where(keep, lse - logits.gather(1, torch.where(keep, targets, 0)[:, None])[:, 0].float(), 0.0).sum()
    with torch.enable_grad():
        # The student's log-probs at the ids: the only place its (C, V) softmax enters the divergence.
        support_lp = logits.gather(1, ids).float().div_(temperature).sub_(lse_t[:, None])
        support_lp.requires_grad_(weights is not None)
        per_row = _divergence(teacher._buckets(rows, temperature), _append_tail(support_lp), options.divergence,
                              options.jsd_beta)
        kd = torch.where(keep, per_row, 0.0).sum()
        if weights is None:
            return ce, kd.detach(), None
        (grad_support,) = torch.autograd.grad(kd, support_lp)
    ce_weight, kd_weight = weights
    correction = grad_support * (kd_weight / temperature)  # d(kd_weight * D) / d(logit at id i), the ids' own part
    ce_scale = torch.where(keep, ce_weight, 0.0)  # (C,): 0 at ignored positions
    grad = kernels.write_grad(logits, targets, lse, lse_t, ce_scale, -correction.sum(-1), ids, correction,
                              temperature, limit)
    return ce, kd.detach(), grad


def _fused_ce(dtype: torch.dtype, device: torch.device) -> bool:
    return device.type == "cuda" and dtype in (torch.bfloat16, torch.float32) and has_triton()


@functools.cache
def _ce_kernel():
    """ce_triton, imported on first use (it needs Triton, which CPU-only installs lack)."""
    from trainer_ext.distill import ce_triton

    return ce_triton


@functools.cache
def _kd_kernels():
    """kd_triton, imported on first use (as `_ce_kernel`)."""
    from trainer_ext.distill import kd_triton

    return kd_triton


def _ce_and_grad(logits, targets, scale):
    """Summed CE over the kept positions of one chunk and, when `scale` (a 0-d tensor) is given, its gradient wrt
    the logits times `scale`: scale * (softmax - one-hot of the target) at kept positions, 0 at ignored ones.
    logits (C, V) fp32, overwritten by the gradient (no second C x V tensor)."""
    keep = targets != IGNORE_INDEX
    safe = torch.where(keep, targets, 0)[:, None]  # (C, 1)
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)
    ce = torch.where(keep[:, None], lse - logits.gather(1, safe), 0.0).sum()
    if scale is None:
        return ce, None
    grad = logits.sub_(lse).exp_()  # softmax, in place
    grad.scatter_add_(1, safe, torch.full_like(lse, -1.0))
    return ce, grad.mul_(torch.where(keep, scale, 0.0)[:, None])


def _chunk_loss_sums(logits, targets, teacher, rows, options):
    """Summed CE and summed D over the kept positions of one chunk; logits (C, V) fp32, teacher given."""
    ce = F.cross_entropy(logits, targets, ignore_index=IGNORE_INDEX, reduction="sum")
    teacher_lp, student_lp = teacher._log_probs(rows, logits, options.temperature, options.vocab_limit)
    per_row = _divergence(teacher_lp, student_lp, options.divergence, options.jsd_beta)
    kd = torch.where(targets != IGNORE_INDEX, per_row, 0.0).sum()  # ignored positions count in neither term
    return ce, kd


def _divergence(teacher_lp, student_lp, divergence, jsd_beta):
    """Per-row D from finite log-probs on a shared support, shape (C, S) -> (C,)."""
    if divergence == "forward_kl":
        return _kl(teacher_lp, student_lp)
    if divergence == "reverse_kl":
        return _kl(student_lp, teacher_lp)
    assert divergence == "jsd", divergence
    mixture_lp = torch.logaddexp(teacher_lp + math.log(jsd_beta), student_lp + math.log1p(-jsd_beta))
    return jsd_beta * _kl(teacher_lp, mixture_lp) + (1.0 - jsd_beta) * _kl(student_lp, mixture_lp)


def _kl(p_lp, q_lp):
    """KL(p || q) per row from log-probs. An underflowed p contributes 0 * finite = 0."""
    return (p_lp.exp() * (p_lp - q_lp)).sum(-1)


def _flattened(teacher):
    """The teacher with its per-position tensors (B, T, ...) flattened to (B * T, ...), once per loss call: each chunk
    of positions is then a view (a non-contiguous tensor is copied here once, not once per chunk)."""
    if isinstance(teacher, OnlineTeacher):
        return replace(teacher, hidden=teacher.hidden.flatten(0, 1))
    return replace(teacher, ids=teacher.ids.flatten(0, 1), logprobs=teacher.logprobs.flatten(0, 1))


def _append_tail(support_lp):
    """(C, k) log-probs of the support -> (C, k + 1) with the tail bucket 1 - sum(support) last.

    The support mass is capped at 1 - TAIL_FLOOR, so the tail is never 0 (see TAIL_FLOOR); above
    the cap the bucket distribution sums to at most 1 + TAIL_FLOOR.
    """
    support_mass = torch.logsumexp(support_lp, dim=-1, keepdim=True)
    support_mass = support_mass.clamp(max=math.log1p(-TAIL_FLOOR))
    tail_lp = torch.log(-torch.expm1(support_mass))  # log(1 - mass), exact for mass near 1
    return torch.cat([support_lp, tail_lp], dim=-1)


def _validate(hidden, weight, labels, teacher, alpha, temperature, divergence, jsd_beta, chunk_size):
    """Raise ValueError for bad arguments; return the resolved vocab_limit."""
    if hidden.dim() != 3:
        raise ValueError(f"hidden must be (B, T, H), got shape {tuple(hidden.shape)}")
    batch, seq, hidden_size = hidden.shape
    if weight.dim() != 2 or weight.shape[1] != hidden_size:
        raise ValueError(
            f"lm_head_weight must be (V, H={hidden_size}), got shape {tuple(weight.shape)}"
        )
    vocab = weight.shape[0]
    if tuple(labels.shape) != (batch, seq):
        raise ValueError(f"labels must be (B, T)=({batch}, {seq}), got shape {tuple(labels.shape)}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise ValueError(f"labels must be an integer tensor, got {labels.dtype}")
    if not (isinstance(alpha, (int, float)) and 0.0 <= alpha <= 1.0):
        raise ValueError(f"alpha must be a number in [0, 1], got {alpha!r}")
    if not (isinstance(temperature, (int, float)) and 0.0 < temperature < math.inf):
        raise ValueError(f"temperature must be a finite number > 0, got {temperature!r}")
    if divergence not in DIVERGENCES:
        raise ValueError(f"divergence must be one of {DIVERGENCES}, got {divergence!r}")
    if not (isinstance(jsd_beta, (int, float)) and 0.0 < jsd_beta < 1.0):
        # At 0 or 1 the mixture equals one side and the JSD is identically 0.
        raise ValueError(f"jsd_beta must be a number in the open interval (0, 1), got {jsd_beta!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be an int >= 1, got {chunk_size!r}")

    if teacher is None:
        return vocab
    if isinstance(teacher, OnlineTeacher):
        t_hidden, t_weight = teacher.hidden, teacher.lm_head_weight
        if t_hidden.dim() != 3 or tuple(t_hidden.shape[:2]) != (batch, seq):
            raise ValueError(
                f"teacher.hidden must be (B, T, H_t) with (B, T)=({batch}, {seq}), "
                f"got shape {tuple(t_hidden.shape)}"
            )
        if t_weight.dim() != 2 or t_weight.shape[1] != t_hidden.shape[2]:
            raise ValueError(
                f"teacher.lm_head_weight must be (V_t, H_t={t_hidden.shape[2]}), "
                f"got shape {tuple(t_weight.shape)}"
            )
        max_limit = min(vocab, t_weight.shape[0])
    elif isinstance(teacher, TopKTeacher):
        ids, logprobs = teacher.ids, teacher.logprobs
        if ids.dim() != 3 or tuple(ids.shape[:2]) != (batch, seq) or ids.shape[2] < 1:
            raise ValueError(
                f"teacher.ids must be (B, T, k) with (B, T)=({batch}, {seq}) and k >= 1, "
                f"got shape {tuple(ids.shape)}"
            )
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise ValueError(f"teacher.ids must be an integer tensor, got {ids.dtype}")
        if logprobs.shape != ids.shape or not logprobs.dtype.is_floating_point:
            raise ValueError(
                f"teacher.logprobs must be a float tensor shaped like teacher.ids {tuple(ids.shape)}, "
                f"got {logprobs.dtype} {tuple(logprobs.shape)}"
            )
        max_limit = vocab
    else:
        raise ValueError(
            f"teacher must be OnlineTeacher, TopKTeacher or None, got {type(teacher).__name__}"
        )
    vocab_limit = max_limit if teacher.vocab_limit is None else teacher.vocab_limit
    if not (isinstance(vocab_limit, int) and 1 <= vocab_limit <= max_limit):
        raise ValueError(
            f"teacher.vocab_limit must be an int in [1, {max_limit}] (vocab sizes of the heads), "
            f"got {teacher.vocab_limit!r}"
        )
    if isinstance(teacher, TopKTeacher) and teacher.ids.shape[2] > vocab_limit:
        raise ValueError(
            f"teacher.ids has k={teacher.ids.shape[2]} > vocab_limit={vocab_limit}"
        )
    return vocab_limit
