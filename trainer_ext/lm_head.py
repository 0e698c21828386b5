"""The LM head applied a chunk of positions at a time where no gradient is needed: how evaluation and the teacher
cache turn hidden states into logits. (The training loss, `trainer_ext.distill.losses`, runs the head inside its
own autograd function, which also computes the head's gradient chunk by chunk.)

A 64k vocabulary at batch 8 x 2048 would be a 4 GiB fp32 logits tensor; in chunks of `chunk_size` positions it is
chunk_size x V floats at a time.
"""

from collections.abc import Iterator

import torch


def output_head(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of a causal LM's output embedding, which must be a plain nn.Linear."""
    head = model.get_output_embeddings()
    if not isinstance(head, torch.nn.Linear):
        raise ValueError(
            f"{type(model).__name__}'s output embedding is {type(head).__name__}; applying the LM head in chunks "
            "needs a plain nn.Linear head (a standard *ForCausalLM).")
    return head.weight, head.bias


def chunked_logits(rows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                   chunk_size: int = 1024) -> Iterator[tuple[slice, torch.Tensor]]:
    """Yield (positions, logits) for `rows` (N, C) in chunks of `chunk_size` positions: logits (chunk, V), in the
    dtype of `rows` and `weight`."""
    if chunk_size <= 0:
        raise ValueError(f"chunk_size={chunk_size} must be > 0.")
    for start in range(0, rows.shape[0], chunk_size):
        positions = slice(start, min(start + chunk_size, rows.shape[0]))
        yield positions, torch.nn.functional.linear(rows[positions], weight, bias)
