"""Ouro's training objective for a learned exit gate (`config.exit_gate`): the expected loss over depths. The math
is here; `ExitGateLoss` (depth_supervision.py) applies it to the states a training step captured.

The gate reads the core state after each step, lambda_i = sigmoid(gate(s_i)) (the state the next step and the coda
read, after `state_norm`). Over the steps i_1 < ... < i_K a training step reads it at (which: below), each token's
exit distribution is

    p_j = lambda_{i_j} * prod_{l<j} (1 - lambda_{i_l})      (j < K),     p_K = prod_{l<K} (1 - lambda_{i_l})

(the last step takes the remaining mass), and the loss, averaged over the positions with a target, is

    loss = sum_j p_j * CE_j  -  beta * H(p),       H(p) = -sum_j p_j log p_j

with CE_j the token's cross-entropy read out after step i_j (coda, final norm, LM head: `DepthSupervision.readout`)
and beta `--exit_gate_entropy_weight` (Ouro uses about 0.05; the entropy keeps the gate from collapsing onto one
depth early in training). Gradients reach the gate through p and the model through each CE_j, weighted by p_j.

Which depths: the gate over every step 1..n of the sampled depth n, since inference reads it after each; the model
over those of deep supervision (depth_supervision.py, the same capture of the states): `--depth_supervision K`
evenly spaced among the steps with gradients, the last included; with K = 1 (the default) every step with gradients.
The other steps (before the last `backprop_depth`, or between the K) are read out without gradients: their CE enters
the gate's objective as a constant, and the gate reads their state detached. So the loss is split by what it trains:

    value and the gate's gradient:   sum_j p_j * sg(CE_j) - beta * H(p)                  (j over every step)
    the model's gradient:            sum_{j supervised} sg(p_j / sum_{l supervised} p_l) * CE_j

(sg: no gradient. At a supervised step the gate's input keeps its gradient, so the model also feels the gate's term
there, as in Ouro's objective.) Where every step is
supervised the two are exactly the gradient of the expected loss above; where some are not, the model keeps a full
weight on the steps it can learn at. Cost: one coda + head forward per unsupervised step (counted in the training
FLOPs, `flops_per_token(readout_only_depths=)`), and the state of every step kept until the loss (one (B, T, C)
tensor each). `--depth_supervision_weights` plays no part (the gate's p_j are the weights).

CE per token: a chunk of positions at a time, each chunk's logits recomputed in backward (`token_ce`), so neither full
logits nor per-chunk logits stay alive until backward; that recompute is one more head forward per supervised depth,
not counted in the training FLOPs (recomputation is not, `hf_recurrent.cost`). Distillation is not combined with the
gate yet: a teacher's loss is refused here (the objective is CE only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from trainer_ext.distill.losses import IGNORE_INDEX, chunk_logit_bytes, default_chunk_size

__all__ = ["exit_distribution", "expected_exit_loss", "token_ce"]


def exit_distribution(lambdas: torch.Tensor) -> torch.Tensor:
    """Exit probabilities (K, ...) from per-step exit probabilities `lambdas` (K, ...): the first exit at step j,
    the last step taking the mass left."""
    stay_before = torch.cumprod(torch.cat([torch.ones_like(lambdas[:1]), 1 - lambdas[:-1]]), dim=0)
    return torch.cat([lambdas[:-1] * stay_before[:-1], stay_before[-1:]])


def expected_exit_loss(lambdas: torch.Tensor, ce: torch.Tensor, keep: torch.Tensor,
                       entropy_weight: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss, expected CE, entropy), each averaged over the kept positions: lambdas and ce (K, B, T), keep (B, T)
    (positions with a target)."""
    p = exit_distribution(lambdas)
    count = keep.sum().clamp(min=1)
    expected = torch.where(keep, (p * ce).sum(0), 0.0).sum() / count
    entropy = torch.where(keep, -torch.special.xlogy(p, p).sum(0), 0.0).sum() / count
    return expected - entropy_weight * entropy, expected, entropy


def _rows_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = (hidden.to(weight.dtype) @ weight.T).float()  # (C, V)
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")


def token_ce(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
             chunk_size: int | None = None) -> torch.Tensor:
    """Cross-entropy per position (B, T) of the LM head `weight` (V, C) on `hidden` (B, T, C), 0 where the label
    is ignored; differentiable, `chunk_size` positions at a time with the logits recomputed in backward."""
    if chunk_size is None:
        chunk_size = default_chunk_size(weight.shape[0], chunk_logit_bytes(weight.dtype, weight.device, False))
    flat_hidden, flat_labels = hidden.flatten(0, 1), labels.flatten()
    pieces = [checkpoint(_rows_ce, flat_hidden[start:start + chunk_size], weight,
                         flat_labels[start:start + chunk_size], use_reentrant=False)
              for start in range(0, flat_labels.numel(), chunk_size)]
    return torch.cat(pieces).view(labels.shape)
