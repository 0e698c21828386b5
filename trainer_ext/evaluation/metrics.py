"""Held-out quality and generation speed of a causal LM: the one implementation that the evaluation script, the
comparison pipeline and the benchmarks share.

    evaluate_model(model, dataset, num_steps=n)    -> {"ce", "perplexity", "top1", "top5", "tokens"}
    generation_speed(model, num_steps=n)           -> {batch_size: generated tokens per second}
    cache_mode_cost(model, dataset, num_steps=n)   -> CE when decoding with a `per_step` vs a `shared` KV cache

Works for recurrent-depth models (`num_steps` picks the depth) and for plain causal LMs such as
`LlamaForCausalLM` (no `num_steps`) whose head is a linear layer. Quality figures come from the
`next_token` metric shipped in `trainer_ext/evaluation/` and loaded with `evaluate.load` from its directory,
so nothing is fetched from a hub.
"""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager

import evaluate
import torch
from torch.utils.data import DataLoader, Dataset
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_recurrent.presets import is_recurrent

METRICS_DIR = os.path.dirname(os.path.abspath(__file__))  # next_token/next_token.py beside this file
IGNORE_INDEX = -100
CACHE_MODES = ("per_step", "shared")


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
) -> dict:
    """Cross-entropy (nats/token), perplexity, top-1 / top-5 accuracy over `dataset`.

    `dataset` yields {"input_ids", "shift_labels"} (`ShardedTokenDataset`; targets aligned with positions,
    -100 ignored). `num_steps` is the depth of a recurrent model (default: its `config.default_num_steps`) and must be
    None for other models. Logits are never built for a whole batch: the final hidden states go through the
    LM head `chunk_size` positions at a time, so a 64k vocabulary costs chunk_size x V floats, not B x T x V.
    `device`: where to run (the model is moved there); default: where the model is.
    """
    _check_positive("batch_size", batch_size)
    _check_positive("chunk_size", chunk_size)
    if max_batches is not None:
        _check_positive("max_batches", max_batches)
    device = _place(model, device)
    forward_kwargs = _depth_kwargs(model, num_steps)
    weight, bias = _lm_head(model)
    metric = load_metric("next_token")

    loader = DataLoader(dataset, batch_size=batch_size, shuffle=False)
    total = len(loader) if max_batches is None else min(len(loader), max_batches)
    if total == 0:
        raise ValueError("evaluate_model: the dataset is empty; check the eval split of --data_dir.")
    desc = "eval" if not forward_kwargs else f"eval n={forward_kwargs['num_steps']}"
    with _eval_mode(model), torch.inference_mode():
        for index, batch in enumerate(tqdm(loader, total=total, desc=desc, disable=_bar_disabled(progress),
                                           leave=False)):
            if index == total:
                break
            input_ids, targets = _unpack(batch, device)
            outputs = model.base_model(input_ids=input_ids, use_cache=False, **forward_kwargs)
            hidden = outputs.last_hidden_state  # (B, T, C)
            keep = targets.reshape(-1) != IGNORE_INDEX
            rows, row_targets = hidden.reshape(-1, hidden.shape[-1])[keep], targets.reshape(-1)[keep]
            for chunk, chunk_targets in zip(rows.split(chunk_size), row_targets.split(chunk_size)):
                logits = torch.nn.functional.linear(chunk, weight, bias)  # (chunk, V), in the model's dtype
                nll, rank = token_statistics(logits, chunk_targets)
                metric.add_batch(nll=nll.cpu().numpy(), rank=rank.cpu().numpy())
    return metric.compute()


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


# ----------------------------------------------------------------------------- speed


def generation_speed(
    model,
    prompt_len: int = 32,
    new_tokens: int = 32,
    batch_sizes: Iterable[int] = (1, 8),
    num_steps: int | None = None,
    prompt_ids: torch.Tensor | Sequence[int] | None = None,
    device: str | torch.device | None = None,
    repeats: int = 3,
    warmup: bool = True,
) -> dict[int, float]:
    """Generated tokens per second with the KV cache, greedy, per batch size: batch x new_tokens / wall time.

    The wall time covers the whole `generate` call (prefill of the prompt included). Every row is the same
    fixed prompt: `prompt_ids` (first `prompt_len` ids) or a seeded pseudo-random one, so numbers are comparable
    across models and depths. EOS is suppressed (`min_new_tokens`) so every call generates `new_tokens`. One
    untimed warm-up call per batch size keeps kernel selection and allocator growth out of the timing; the
    figure is the median of `repeats` timed calls, which damps a noisy neighbour on a shared machine.
    """
    _check_positive("prompt_len", prompt_len)
    _check_positive("new_tokens", new_tokens)
    _check_positive("repeats", repeats)
    batch_sizes = list(batch_sizes)
    for batch in batch_sizes:
        _check_positive("batch_sizes", batch)
    device = _place(model, device)
    config = model.config
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and prompt_len + new_tokens > limit:
        raise ValueError(
            f"generation_speed: prompt_len + new_tokens = {prompt_len + new_tokens} exceeds the model's "
            f"max_position_embeddings={limit}; lower prompt_len or new_tokens.")
    prompt = _fixed_prompt(prompt_ids, prompt_len, config.vocab_size).to(device)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                  pad_token_id=pad, **_depth_kwargs(model, num_steps))

    speeds = {}
    with _eval_mode(model), torch.inference_mode():
        for batch in batch_sizes:
            input_ids = prompt.expand(batch, -1).contiguous()  # (B, prompt_len)
            attention_mask = torch.ones_like(input_ids)
            if warmup:
                model.generate(input_ids, attention_mask=attention_mask, **{**kwargs, "max_new_tokens": 2,
                                                                               "min_new_tokens": 2})
            seconds = []
            for _ in range(repeats):
                _synchronize(device)
                start = time.perf_counter()
                output = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
                _synchronize(device)
                seconds.append(time.perf_counter() - start)
                assert output.shape[1] - prompt_len == new_tokens, (output.shape, prompt_len, new_tokens)
            speeds[batch] = batch * new_tokens / statistics.median(seconds)
    return speeds


def _fixed_prompt(prompt_ids, prompt_len: int, vocab_size: int) -> torch.Tensor:
    if prompt_ids is None:
        # Avoid the low ids, where tokenizers keep their special tokens.
        low = min(4, vocab_size - 1)
        return torch.randint(low, vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long).reshape(-1)
    if prompt.numel() < prompt_len:
        raise ValueError(f"generation_speed: prompt_ids has {prompt.numel()} ids, fewer than prompt_len={prompt_len}.")
    return prompt[:prompt_len].unsqueeze(0)


# ----------------------------------------------------------------------------- KV cache modes


def cache_mode_cost(
    model,
    dataset: Dataset,
    num_steps: int | None = None,
    max_samples: int = 8,
    prefix_len: int | None = None,
    batch_size: int = 8,
    device: str | torch.device | None = None,
    progress: bool = True,
) -> dict:
    """What decoding with a `shared` KV cache costs in held-out quality, against the exact `per_step` cache.

    Teacher-forced: the first `prefix_len` tokens of each sample (default: half) are prefilled in one call, then
    the reference tokens are fed one at a time through the cache, and the next-token metrics are taken over the
    decoded positions only. `full_forward` scores the same positions without a cache: `per_step` must match it
    (up to float rounding), and at num_steps=1 `shared` equals `per_step`. Costs (seq_len - prefix_len) forward
    calls per batch and mode. The model's `kv_cache_mode` is restored afterwards.

    Returns {"num_steps", "prefix_len", "tokens", "full_forward": {...}, "per_step": {...}, "shared": {...},
    "shared_ce_increase"}; each {...} is the `next_token` metric (ce, perplexity, top1, top5, tokens).
    """
    if not is_recurrent(model.config):
        raise ValueError(
            f"cache_mode_cost: {type(model).__name__} has no kv_cache_mode; it applies to recurrent-depth models.")
    _check_positive("max_samples", max_samples)
    _check_positive("batch_size", batch_size)
    num_steps = model.config.default_num_steps if num_steps is None else num_steps
    _check_positive("num_steps", num_steps)
    device = _place(model, device)
    samples = torch.utils.data.Subset(dataset, range(min(max_samples, len(dataset))))
    if len(samples) == 0:
        raise ValueError("cache_mode_cost: the dataset is empty; check the eval split of --data_dir.")
    seq_len = samples[0]["input_ids"].shape[0]
    prefix_len = seq_len // 2 if prefix_len is None else prefix_len
    if not 0 <= prefix_len < seq_len:
        raise ValueError(f"cache_mode_cost: prefix_len={prefix_len} must be in [0, seq_len={seq_len}).")

    metrics = {name: load_metric("next_token") for name in ("full_forward", *CACHE_MODES)}
    original_mode = model.config.kv_cache_mode
    loader = DataLoader(samples, batch_size=batch_size, shuffle=False)
    steps = len(loader) * len(CACHE_MODES) * (seq_len - prefix_len)
    bar = tqdm(total=steps, desc=f"cache modes n={num_steps}", disable=_bar_disabled(progress), leave=False)
    try:
        with _eval_mode(model), torch.inference_mode():
            for batch in loader:
                input_ids, targets = _unpack(batch, device)
                # Logits of the decoded positions only: a full (B, T, V) tensor is gigabytes for a 64k vocabulary.
                decoded = seq_len - prefix_len
                logits = model(input_ids, num_steps=num_steps, use_cache=False, logits_to_keep=decoded).logits
                _add(metrics["full_forward"], logits, targets[:, prefix_len:])
                for mode in CACHE_MODES:
                    model.config.kv_cache_mode = mode
                    for position, step_logits in _teacher_forced_decode(model, input_ids, prefix_len, num_steps):
                        _add(metrics[mode], step_logits, targets[:, position : position + 1])
                        bar.update(1)
    finally:
        model.config.kv_cache_mode = original_mode
        bar.close()

    result = {name: metric.compute() for name, metric in metrics.items()}
    return {
        "num_steps": num_steps,
        "prefix_len": prefix_len,
        "tokens": result["full_forward"]["tokens"],
        **result,
        "shared_ce_increase": result["shared"]["ce"] - result["per_step"]["ce"],
    }


def _teacher_forced_decode(model, input_ids: torch.Tensor, prefix_len: int, num_steps: int):
    """Prefill `prefix_len` tokens, then feed the reference tokens one at a time through the cache;
    yields (position, logits (B, 1, V) predicting the target of that position)."""
    cache = DynamicCache(config=model.config)
    if prefix_len > 0:
        model(input_ids[:, :prefix_len], past_key_values=cache, use_cache=True, num_steps=num_steps)
    for position in range(prefix_len, input_ids.shape[1]):
        out = model(input_ids[:, position : position + 1], past_key_values=cache, use_cache=True, num_steps=num_steps)
        yield position, out.logits


# ----------------------------------------------------------------------------- helpers


def _add(metric, logits: torch.Tensor, targets: torch.Tensor) -> None:
    """Add (B, T, V) logits against (B, T) targets to a `next_token` metric, skipping ignored positions."""
    flat_targets = targets.reshape(-1)
    keep = flat_targets != IGNORE_INDEX
    nll, rank = token_statistics(logits.reshape(-1, logits.shape[-1])[keep], flat_targets[keep])
    metric.add_batch(nll=nll.cpu().numpy(), rank=rank.cpu().numpy())


def _unpack(batch: dict, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if "input_ids" not in batch or "shift_labels" not in batch:
        raise ValueError(
            f"evaluation: a dataset item needs 'input_ids' and 'shift_labels' (targets aligned with positions, as "
            f"ShardedTokenDataset yields), got keys {sorted(batch)}.")
    return batch["input_ids"].to(device), batch["shift_labels"].to(device)


def _place(model, device) -> torch.device:
    if device is None:
        return next(model.parameters()).device
    device = torch.device(device)
    model.to(device)
    return device


def _depth_kwargs(model, num_steps: int | None) -> dict:
    """`num_steps` for a recurrent model (its default depth when None); nothing for a fixed-depth model."""
    if is_recurrent(model.config):
        num_steps = model.config.default_num_steps if num_steps is None else num_steps
        _check_positive("num_steps", num_steps)
        return {"num_steps": num_steps}
    if num_steps is not None:
        raise ValueError(
            f"num_steps={num_steps} was given but {type(model).__name__} has a fixed depth; pass num_steps=None.")
    return {}


def _lm_head(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"evaluation: {type(model).__name__}'s output embedding is {type(head).__name__}; the chunked "
            "evaluation needs a plain nn.Linear LM head.")
    return head.weight, head.bias


@contextmanager
def _eval_mode(model):
    was_training = model.training
    model.eval()
    try:
        yield
    finally:
        model.train(was_training)


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _bar_disabled(progress: bool) -> bool | None:
    """tqdm's `disable`: None shows the bar only when stderr is a terminal. In a log file or a pipe each refresh
    would be one more carriage-return line, thousands per run."""
    return None if progress else True


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"evaluation: {name}={value!r} must be an integer >= 1.")
