"""Held-out quality of a causal LM from full forward passes: the one metric set that the evaluation reports, the
comparison pipeline and the benchmarks share, and the warnings it supports.

    evaluate_model(model, dataset, num_steps=n)    -> {"ce", "perplexity", "top1", "top5", "tokens"}
    evaluate_model(..., exit_threshold=t)          -> the same at adaptive depth (at most n), plus "mean_steps_used"
    unigram_cross_entropy(dataset)                 -> the CE of predicting every token from its frequency alone
    learning_warnings(label, {n: ce}, unigram_ce)  -> what those figures say about a model that did not learn

Works for recurrent-depth models (`num_steps` picks the depth) and for plain causal LMs such as
`LlamaForCausalLM` (no `num_steps`) whose head is a linear layer. Quality figures come from the
`next_token` metric shipped in `trainer_ext/evaluation/` and loaded with `evaluate.load` from its directory,
so nothing is fetched from a hub. Decoding measurements (speed, KV cache modes) are in `generation.py`, which
shares the helpers at the end of this module.
"""

from __future__ import annotations

import os
from contextlib import contextmanager

import evaluate
import torch
from torch.utils.data import DataLoader, Dataset

from hf_recurrent.presets import is_recurrent
from trainer_ext.lm_head import chunked_logits, output_head
from trainer_ext.progress import Progress

METRICS_DIR = os.path.dirname(os.path.abspath(__file__))  # next_token/next_token.py beside this file
IGNORE_INDEX = -100


def load_metric(name: str = "next_token") -> evaluate.EvaluationModule:
    """One of the metric modules in `trainer_ext/evaluation/`, loaded offline and kept in memory."""
    path = os.path.join(METRICS_DIR, name)
    if not os.path.isfile(os.path.join(path, f"{name}.py")):
        available = sorted(os.listdir(METRICS_DIR)) if os.path.isdir(METRICS_DIR) else []
        raise ValueError(f"{path}: no metric module {name!r}; available: {available}.")
    return evaluate.load(path, keep_in_memory=True)


def token_statistics(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-position negative log-likelihood and rank of the target, the inputs of the `next_token` metric.

    logits (N, V) and targets (N,). rank = how many entries score strictly above the target (0: the argmax).
    """
    logits = logits.float()
    target_logit = logits.gather(1, targets[:, None])  # (N, 1)
    nll = (torch.logsumexp(logits, dim=-1) - target_logit[:, 0]).clamp_min(0.0)
    rank = (logits > target_logit).sum(dim=-1)
    return nll, rank


# ----------------------------------------------------------------------------- held-out quality


def evaluate_model(
    model,
    dataset: Dataset,
    num_steps: int | None = None,
    batch_size: int = 8,
    max_batches: int | None = None,
    device: str | torch.device | None = None,
    chunk_size: int = 1024,
    progress: bool = True,
    exit_threshold: float | None = None,
    exit_criterion: str | None = None,
) -> dict:
    """Cross-entropy (nats/token), perplexity, top-1 / top-5 accuracy over `dataset`.

    `dataset` yields {"input_ids", "shift_labels"} (`ShardedTokenDataset`; targets aligned with positions,
    -100 ignored). `num_steps` is the depth of a recurrent model (default: its `config.default_num_steps`) and must be
    None for other models. Logits are never built for a whole batch: the final hidden states go through the
    LM head `chunk_size` positions at a time, so a 64k vocabulary costs chunk_size x V floats, not B x T x V.
    `device`: where to run (the model is moved there); default: where the model is. `exit_threshold`: adaptive
    depth of a recurrent model (`hf_recurrent.adaptive_depth`, at most `num_steps` steps per token); the result then
    also has "mean_steps_used", the core steps per evaluated token; `exit_criterion` its criterion (default: the
    model config's). `progress`: a bar on a terminal, a progress line
    in the log every 30 s elsewhere (`trainer_ext.progress`); False shows none.
    """
    if batch_size < 1 or chunk_size < 1 or (max_batches is not None and max_batches < 1):
        raise ValueError(f"evaluate_model: batch_size={batch_size}, chunk_size={chunk_size} and "
                         f"max_batches={max_batches} must be >= 1 (max_batches may be None).")
    device = place(model, device)
    forward_kwargs = depth_kwargs(model, num_steps)
    if exit_threshold is not None:
        if not forward_kwargs:
            raise ValueError(f"exit_threshold={exit_threshold} was given but {type(model).__name__} has a fixed depth.")
        forward_kwargs["exit_threshold"] = exit_threshold
        if exit_criterion is not None:
            forward_kwargs["exit_criterion"] = exit_criterion
    steps_used = []  # per batch: (sum of core steps, tokens) over the evaluated positions
    weight, bias = output_head(model)
    metric = load_metric("next_token")

    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False)
    total = len(loader) if max_batches is None else min(len(loader), max_batches)
    if total == 0:
        raise ValueError("evaluate_model: the dataset is empty; check the eval split of --data_dir.")
    desc = "eval" if not forward_kwargs else f"eval n={forward_kwargs['num_steps']}"
    with eval_mode(model), torch.inference_mode():
        for index, batch in enumerate(Progress(loader, total=total, desc=desc, unit="batch", disable=not progress,
                                               leave=False)):
            if index == total:
                break
            input_ids, targets = unpack_batch(batch, device)
            outputs = model.base_model(input_ids=input_ids, use_cache=False, **forward_kwargs)
            hidden = outputs.last_hidden_state  # (B, T, C)
            keep = targets.reshape(-1) != IGNORE_INDEX
            rows, row_targets = hidden.reshape(-1, hidden.shape[-1])[keep], targets.reshape(-1)[keep]
            if exit_threshold is not None:
                steps_used.append((outputs.num_steps_used.reshape(-1)[keep].sum().item(), int(keep.sum())))
            for positions, logits in chunked_logits(rows, weight, bias, chunk_size):  # (chunk, V), model dtype
                nll, rank = token_statistics(logits, row_targets[positions])
                metric.add_batch(nll=nll.cpu().numpy(), rank=rank.cpu().numpy())
    result = metric.compute()
    if exit_threshold is not None:
        result["mean_steps_used"] = sum(total for total, _ in steps_used) / max(sum(n for _, n in steps_used), 1)
    return result


def unigram_cross_entropy(dataset: Dataset) -> float:
    """The entropy (nats) of the target tokens' own frequencies in `dataset`: the lowest CE any predictor that
    ignores the context can reach on exactly these tokens. A language model should be far below it."""
    targets = torch.cat([torch.as_tensor(dataset[i]["shift_labels"]).reshape(-1) for i in range(len(dataset))]
                        or [torch.zeros(0, dtype=torch.long)])
    counts = torch.bincount(targets[targets != IGNORE_INDEX].long())
    if counts.sum() == 0:
        raise ValueError("unigram_cross_entropy: the dataset has no target tokens.")
    probs = counts[counts > 0].double() / counts.sum()
    return float(-(probs * probs.log()).sum())


# A model within this many nats of the frequency-only CE has learned (almost) nothing from the context. On a
# held-out set of Python sources like results/compare-125m-gpu's (frequency-only CE 6.38), the 125M models there were
# 0.9 nats below it after 1.5M tokens and 1.5 after 4.5M; the collapsed runs were 0.9 above it.
CONTEXT_FREE_MARGIN = 0.25


def learning_warnings(label: str, ce_by_depth: dict, unigram_ce: float | None = None) -> list[str]:
    """What a held-out evaluation says about a model that did not learn: CE by depth (one entry, any key, for a
    plain Transformer) against the frequency-only CE of the same tokens, and for several depths, whether depth
    changes anything (`depth_collapse_warning`)."""
    warnings = []
    if unigram_ce is not None:
        warnings.append(context_free_warning(label, min(ce_by_depth.values()), unigram_ce))
    warnings.append(depth_collapse_warning(label, ce_by_depth))
    return [w for w in warnings if w]


def context_free_warning(label: str, ce: float, unigram_ce: float, margin: float = CONTEXT_FREE_MARGIN) -> str | None:
    """A warning when a model's held-out CE is no better than predicting every token from its frequency alone."""
    if ce < unigram_ce - margin:
        return None
    return (f"{label}: held-out CE {ce:.4f} is no better than predicting every token from its frequency alone "
            f"({unigram_ce:.4f} on the same tokens): the model has not learned to use the context (too early in "
            "training, or collapsed: lower the learning rate, README: Training).")


# A recurrent model whose held-out CE moves less than this (nats) between its shallowest and deepest evaluated
# depth ignores its core steps. Healthy models differed by 0.01-0.16 between n = 1 and n = mean_recurrence even when
# the state converges fast (BENCHMARKS.md); a collapsed 125M run differed by under 0.001 from n = 1 to n = 24. Another
# collapsed run differed by 0.017, more than a healthy one, which is why `context_free_warning` exists.
DEPTH_COLLAPSE_TOLERANCE = 1e-3


def depth_collapse_warning(label: str, ce_by_depth: dict[int, float],
                           tolerance: float = DEPTH_COLLAPSE_TOLERANCE) -> str | None:
    """A warning when a recurrent model's CE is the same at all evaluated depths (its state carries no
    information; seen with bf16 weights, no optimizer momentum and a high learning rate); None otherwise."""
    if len(ce_by_depth) < 2:
        return None
    shallow, deep = min(ce_by_depth), max(ce_by_depth)
    spread = abs(ce_by_depth[deep] - ce_by_depth[shallow])
    if spread >= tolerance:
        return None
    return (f"{label}: held-out CE is the same at depth {shallow} and depth {deep} ({ce_by_depth[shallow]:.4f} vs "
            f"{ce_by_depth[deep]:.4f}): the output does not depend on the core steps, so the recurrent state has "
            "probably collapsed. Retrain with a lower learning rate or a longer warm-up, sandwich blocks "
            "(block_norm=sandwich, the presets' default) and the optimizer's momentum on (README: Training).")


# ----------------------------------------------------------------------------- shared with generation.py


def add_logits(metric, logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Add (B, T, V) logits against (B, T) targets to a `next_token` metric, skipping ignored positions."""
    flat_targets = targets.reshape(-1)
    keep = flat_targets != IGNORE_INDEX
    nll, rank = token_statistics(logits.reshape(-1, logits.shape[-1])[keep], flat_targets[keep])
    metric.add_batch(nll=nll.cpu().numpy(), rank=rank.cpu().numpy())


def unpack_batch(batch: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, shift_labels) of a batch, on `device`."""
    if "input_ids" not in batch or "shift_labels" not in batch:
        raise ValueError(
            f"evaluation: a dataset item needs 'input_ids' and 'shift_labels' (targets aligned with positions, as "
            f"ShardedTokenDataset yields), got keys {sorted(batch)}.")
    return batch["input_ids"].to(device), batch["shift_labels"].to(device)


def place(model, device: str | torch.device | None) -> torch.device:
    """Move `model` to `device` and return it; None: leave the model where it is."""
    if device is None:
        return next(model.parameters()).device
    device = torch.device(device)
    model.to(device)
    return device


def depth_kwargs(model, num_steps: int | None) -> dict:
    """`num_steps` for a recurrent model (its default depth when None; the model rejects values < 1); nothing for a
    fixed-depth model."""
    if is_recurrent(model.config):
        return {"num_steps": model.config.default_num_steps if num_steps is None else num_steps}
    if num_steps is not None:
        raise ValueError(
            f"num_steps={num_steps} was given but {type(model).__name__} has a fixed depth; pass num_steps=None.")
    return {}


@contextmanager
def eval_mode(model):
    """`model.eval()` inside the block, its previous mode restored after."""
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)
