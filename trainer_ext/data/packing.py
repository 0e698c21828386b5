"""Tokenize a stream of documents into one flat token file ("doc EOS doc EOS ..."), optionally a piece of it:
after skipped documents and tokens, up to a token budget, recording where the piece ends."""

from __future__ import annotations

import numpy as np

from trainer_ext.data import corpus
from trainer_ext.data.tokenizer import encode_documents
from trainer_ext.progress import Progress

_FIRST_BATCH_SIZE = 16  # documents tokenized first when max_tokens may be reached within the first batch


def _growing_batches(documents, batch_size: int, small_first: bool):
    """Lists of texts of ``batch_size`` documents; with ``small_first`` the first ones are smaller (16, 32, ...
    documents), so that a small piece of a large corpus does not tokenize many documents it does not need."""
    size = min(_FIRST_BATCH_SIZE, batch_size) if small_first else batch_size
    for batch in documents.iter(batch_size=batch_size):
        texts = batch["text"]
        while texts:
            yield texts[:size]
            texts = texts[size:]
            size = min(2 * size, batch_size)


def pack_token_stream(documents, tokenizer, path: str, dtype: np.dtype, max_tokens: int | None, batch_size: int,
                      skip_documents: int = 0, skip_tokens: int = 0,
                      show_progress: bool = True, counts: dict | None = None) -> tuple[int, int, dict]:
    """Tokenize ``documents`` batch by batch into one flat binary file; return (num_tokens, num_documents, end).

    ``documents`` starts after the ``skip_documents`` documents already skipped (never tokenized). The first
    ``skip_tokens`` tokens of what follows are dropped before anything is written or counted against
    ``max_tokens``; reading stops as soon as ``max_tokens`` are written (the batches grow from a few documents to
    ``batch_size`` then, so little is tokenized beyond that point). ``end`` is where the written stream
    ends, as a position that can be skipped without tokenizing: ``documents`` whole documents from the very
    start of the source (the skipped ones included), then ``tokens`` tokens of the next document. Since every
    document is tokenized on its own, skipping to that position gives exactly the tokens that follow.

    ``counts``, if given, receives ``replacement_characters``: the U+FFFD in the tokenized documents (bytes that
    were not UTF-8, replaced when a text file was read, or replacements made before the text reached us).
    """
    eos = tokenizer.eos_token_id
    replacements = 0
    to_skip = skip_tokens
    num_tokens = 0
    num_documents = 0
    end = {"documents": skip_documents, "tokens": skip_tokens}
    progress = Progress(total=max_tokens, desc="Packing", unit="tok", unit_scale=True, disable=not show_progress)
    with progress, open(path, "wb") as f:
        for texts in _growing_batches(documents, batch_size, small_first=max_tokens is not None):
            encoded = encode_documents(tokenizer, texts, eos)
            replacements += sum(text.count(corpus.REPLACEMENT_CHARACTER) for text in texts if text)
            lengths = np.fromiter(map(len, encoded), dtype=np.int64, count=len(encoded))
            flat = np.concatenate([np.asarray(ids, dtype=dtype) for ids in encoded]) if encoded else \
                np.zeros(0, dtype=dtype)
            start = min(to_skip, len(flat))
            to_skip -= start
            stop = len(flat) if max_tokens is None else min(len(flat), start + max_tokens - num_tokens)
            f.write(flat[start:stop].tobytes())
            num_tokens += stop - start
            # Whole documents of this batch before `stop`, then the tokens of the next one.
            ends = np.cumsum(lengths)
            whole = int(np.searchsorted(ends, stop, side="right"))
            end = {"documents": skip_documents + num_documents + whole,
                   "tokens": int(stop - (ends[whole - 1] if whole else 0))}
            num_documents += len(encoded)
            progress.update(stop - start)
            progress.set_postfix(documents=f"{num_documents:,}")
            if max_tokens is not None and num_tokens >= max_tokens:
                break
    if counts is not None:
        counts["replacement_characters"] = replacements
    return num_tokens, num_documents, end
