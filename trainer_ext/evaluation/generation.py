"""Decoding with the KV cache: generation speed (tokens/s per batch size) and what the `shared` cache mode costs
in held-out quality against the exact `per_step` cache.

    generation_speed(model, num_steps=n)           -> {batch_size: generated tokens per second}
    forward_speed(model, dataset, num_steps=n)     -> tokens per second of full forward passes (no cache)
    cache_mode_cost(model, dataset, num_steps=n)   -> CE when decoding with a `per_step` vs a `shared` KV cache
    with kv_cache_mode(model, "shared"): ...       -> a recurrent model's cache mode for a block, restored after

`generation_speed` works for recurrent-depth models and plain causal LMs; `cache_mode_cost` for recurrent-depth
models only. GPU phases are timed with `torch.cuda.synchronize()` around them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Sequence
from contextlib import contextmanager

import torch
from torch.utils.data import DataLoader, Dataset
from transformers import DynamicCache

from hf_recurrent.presets import is_recurrent
from trainer_ext.devices import synchronize
from trainer_ext.evaluation.metrics import (
    add_logits,
    depth_kwargs,
    eval_mode,
    load_metric,
    place,
    unpack_batch,
)
from trainer_ext.progress import Progress

CACHE_MODES = ("per_step", "shared")


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
    **generate_kwargs,
) -> dict[int, float]:
    """Generated tokens per second with the KV cache, greedy, per batch size: batch x new_tokens / wall time.

    The wall time covers the whole `generate` call (prefill of the prompt included). Every row is the same
    fixed prompt: `prompt_ids` (first `prompt_len` ids) or a seeded pseudo-random one, so numbers are comparable
    across models and depths; `prompt_ids` of shape (B, >= prompt_len) gives each row of batch B its own (rows that
    differ exit apart under adaptive depth). EOS is suppressed (`min_new_tokens`) so every call generates
    `new_tokens`. One untimed warm-up call per batch size keeps kernel selection and allocator growth out of the
    timing; the figure is the median of `repeats` timed calls, which damps a noisy neighbour on a shared machine.
    `generate_kwargs` go to every `generate` call (e.g. `exit_threshold` for adaptive depth).
    """
    batch_sizes = list(batch_sizes)
    if min(prompt_len, new_tokens, repeats, *batch_sizes) < 1:
        raise ValueError(f"generation_speed: prompt_len={prompt_len}, new_tokens={new_tokens}, repeats={repeats} "
                         f"and batch_sizes={batch_sizes} must be >= 1.")
    device = place(model, device)
    config = model.config
    limit = getattr(config, "max_position_embeddings", None)
    if limit is not None and prompt_len + new_tokens > limit:
        raise ValueError(
            f"generation_speed: prompt_len + new_tokens = {prompt_len + new_tokens} exceeds the model's "
            f"max_position_embeddings={limit}; lower prompt_len or new_tokens.")
    prompt = _fixed_prompt(prompt_ids, prompt_len, config.vocab_size).to(device)  # (1 or B, prompt_len)
    pad = config.pad_token_id if config.pad_token_id is not None else 0
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, use_cache=True,
                  pad_token_id=pad, **depth_kwargs(model, num_steps), **generate_kwargs)

    speeds = {}
    with eval_mode(model), torch.inference_mode():
        for batch in batch_sizes:
            if prompt.shape[0] not in (1, batch):
                raise ValueError(f"generation_speed: prompt_ids has {prompt.shape[0]} rows; give one, or one per row "
                                 f"of the batch ({batch}).")
            input_ids = prompt.expand(batch, -1).contiguous()  # (B, prompt_len)
            attention_mask = torch.ones_like(input_ids)
            if warmup:
                model.generate(input_ids, attention_mask=attention_mask, **{**kwargs, "max_new_tokens": 2,
                                                                               "min_new_tokens": 2})
            seconds = []
            for _ in range(repeats):
                synchronize(device)
                start = time.perf_counter()
                output = model.generate(input_ids, attention_mask=attention_mask, **kwargs)
                synchronize(device)
                seconds.append(time.perf_counter() - start)
                assert output.shape[1] - prompt_len == new_tokens, (output.shape, prompt_len, new_tokens)
            speeds[batch] = batch * new_tokens / statistics.median(seconds)
    return speeds


def forward_speed(model, dataset: Dataset, num_steps: int | None = None, batch_size: int = 8, batches: int = 4,
                  repeats: int = 3, **forward_kwargs) -> float:
    """Tokens per second of full forward passes without a cache (an evaluation's, lm-eval's loglikelihood): the
    model's final hidden states of the first `batches` batches of `dataset`, no LM head and no metric, so that the
    figure is the forward's alone. One untimed batch first (kernel selection, allocator growth: a path's first call
    would otherwise carry them), then the median of `repeats` timed passes over the batches. `forward_kwargs` go to
    every call (e.g. `exit_threshold`)."""
    if min(batch_size, batches, repeats) < 1:
        raise ValueError(f"forward_speed: batch_size={batch_size}, batches={batches} and repeats={repeats} must be "
                         ">= 1.")
    device = place(model, None)
    kwargs = dict(use_cache=False, **depth_kwargs(model, num_steps), **forward_kwargs)
    inputs = [unpack_batch(batch, device)[0] for _, batch in zip(range(batches),
                                                                  DataLoader(dataset, batch_size=batch_size))]
    if not inputs:
        raise ValueError("forward_speed: the dataset is empty; check the eval split of --data_dir.")
    seconds = []
    with eval_mode(model), torch.inference_mode():
        model.base_model(input_ids=inputs[0], **kwargs)
        for _ in range(repeats):
            synchronize(device)
            start = time.perf_counter()
            for input_ids in inputs:
                model.base_model(input_ids=input_ids, **kwargs)
            synchronize(device)
            seconds.append(time.perf_counter() - start)
    return sum(ids.numel() for ids in inputs) / statistics.median(seconds)


def _fixed_prompt(prompt_ids, prompt_len: int, vocab_size: int) -> torch.Tensor:
    if prompt_ids is None:
        # Avoid the low ids, where tokenizers keep their special tokens.
        low = min(4, vocab_size - 1)
        return torch.randint(low, vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    prompt = torch.as_tensor(prompt_ids, dtype=torch.long)
    prompt = prompt if prompt.dim() == 2 else prompt.reshape(1, -1)
    if prompt.shape[1] < prompt_len:
        raise ValueError(f"generation_speed: prompt_ids has {prompt.shape[1]} ids a row, fewer than "
                         f"prompt_len={prompt_len}.")
    return prompt[:, :prompt_len]


# ----------------------------------------------------------------------------- KV cache modes


def cache_mode_cost(model, dataset: Dataset, num_steps: int | None = None, max_samples: int = 8,
                    prefix_len: int | None = None, batch_size: int = 8, device: str | torch.device | None = None,
                    progress: bool = True) -> dict:
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
    if max_samples < 1 or batch_size < 1:
        raise ValueError(f"cache_mode_cost: max_samples={max_samples} and batch_size={batch_size} must be >= 1.")
    num_steps = model.config.default_num_steps if num_steps is None else num_steps
    device = place(model, device)
    samples = torch.utils.data.Subset(dataset, range(min(max_samples, len(dataset))))
    if len(samples) == 0:
        raise ValueError("cache_mode_cost: the dataset is empty; check the eval split of --data_dir.")
    seq_len = samples[0]["input_ids"].shape[0]
    prefix_len = seq_len // 2 if prefix_len is None else prefix_len
    if not 0 <= prefix_len < seq_len:
        raise ValueError(f"cache_mode_cost: prefix_len={prefix_len} must be in [0, seq_len={seq_len}).")

    metrics = {name: load_metric("next_token") for name in ("full_forward", *CACHE_MODES)}
    loader = DataLoader(samples, batch_size=batch_size, shuffle=False)
    steps = len(loader) * len(CACHE_MODES) * (seq_len - prefix_len)
    bar = Progress(total=steps, desc=f"cache modes n={num_steps}", unit="token", disable=not progress, leave=False)
    try:
        with eval_mode(model), torch.inference_mode():
            for batch in loader:
                input_ids, targets = unpack_batch(batch, device)
                # Logits of the decoded positions only: a full (B, T, V) tensor is gigabytes for a 64k vocabulary.
                decoded = seq_len - prefix_len
                logits = model(input_ids, num_steps=num_steps, use_cache=False, logits_to_keep=decoded).logits
                add_logits(metrics["full_forward"], logits, targets[:, prefix_len:])
                for mode in CACHE_MODES:
                    with kv_cache_mode(model, mode):
                        for position, step_logits in _teacher_forced_decode(model, input_ids, prefix_len, num_steps):
                            add_logits(metrics[mode], step_logits, targets[:, position : position + 1])
                            bar.update(1)
    finally:
        bar.close()

    result = {name: metric.compute() for name, metric in metrics.items()}
    return {
        "num_steps": num_steps,
        "prefix_len": prefix_len,
        "tokens": result["full_forward"]["tokens"],
        **result,
        "shared_ce_increase": result["shared"]["ce"] - result["per_step"]["ce"],
    }


@contextmanager
def kv_cache_mode(model, mode: str):
    """Run a block with a recurrent-depth model's `config.kv_cache_mode` set to `mode`; the old mode is restored."""
    if mode not in CACHE_MODES:
        raise ValueError(f"kv_cache_mode={mode!r}: choose one of {list(CACHE_MODES)}.")
    original = model.config.kv_cache_mode
    model.config.kv_cache_mode = mode
    try:
        yield model
    finally:
        model.config.kv_cache_mode = original


def _teacher_forced_decode(model, input_ids: torch.Tensor, prefix_len: int, num_steps: int):
    """Prefill `prefix_len` tokens, then feed the reference tokens one at a time through the cache;
    yields (position, logits (B, 1, V) predicting the target of that position)."""
    cache = DynamicCache(config=model.config)
    if prefix_len > 0:
        model(input_ids[:, :prefix_len], past_key_values=cache, use_cache=True, num_steps=num_steps)
    for position in range(prefix_len, input_ids.shape[1]):
        out = model(input_ids[:, position : position + 1], past_key_values=cache, use_cache=True, num_steps=num_steps)
        yield position, out.logits
