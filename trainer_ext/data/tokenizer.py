"""The tokenizer of data preparation: train a byte-level BPE offline or load one, and encode documents in bounded
pieces, each followed by EOS."""

from __future__ import annotations

import os
import re

import numpy as np

SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
BYTE_ALPHABET_SIZE = 256
# Characters handed to the tokenizer in one call. A fast tokenizer holds offsets and per-token structures for all
# of its input at once: one 12 MB line (a web dump without newlines) peaked at 2.7 GB, about 225x its size. The
# peak grows with the call: on a 12 MB line (debug BPE, 0.5 tokens per character) 2.0 GB in one call, 440 MB in
# calls of 1M characters, 130 MB in calls of 256K; encoding the embedded corpus in 256K calls is as fast as in
# batches of 1000 documents. Longer documents are split at whitespace into pieces of at most this size
# (split_long_text).
MAX_ENCODE_CHARS = 1 << 18
_WHITESPACE_BEFORE_WORD = re.compile(r"\s(?=\S)")


def train_bpe_tokenizer(documents, vocab_size: int, max_documents: int, batch_size: int = 1000):
    """Train a byte-level BPE on ``documents`` and wrap it as a transformers fast tokenizer.

    Byte-level means every string is encodable (no unknown token) and decoding is exact.
    bos/eos/pad get ids 0/1/2; the tokenizer adds none of them on its own, packing appends
    EOS explicitly.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS.values()),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=True,
    )
    backend.train_from_iterator(_training_texts(documents, batch_size, max_documents), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)


def _training_texts(documents, batch_size: int, limit: int):
    """Lists of texts from the first ``limit`` documents (long ones in pieces, as they are encoded)."""
    seen = 0
    for batch in documents.iter(batch_size=batch_size):
        texts = [t for t in batch["text"] if t]
        texts = texts[: limit - seen]
        seen += len(texts)
        yield [piece for text in texts for piece in split_long_text(text, MAX_ENCODE_CHARS)]
        if seen >= limit:
            return


def load_tokenizer_with_eos(name_or_path: str):
    """``AutoTokenizer.from_pretrained(name_or_path)``, refused without an EOS token (packing needs one).

    `name_or_path` may be a model folder, e.g. a checkpoint of this package (new data for a trained model).
    transformers 5's AutoTokenizer reads a folder's config.json through AutoConfig, which, for a model type it does
    not know and whose auto_map names code, asks on the terminal whether to run that code (a tokenizer needs none).
    The recurrent-depth type is registered first, so nothing is asked and no code of the folder runs.
    """
    from transformers import AutoConfig, AutoTokenizer

    if os.path.isfile(os.path.join(name_or_path, "config.json")):  # a local model folder (not a hub id, no data)
        from hf_recurrent import RecurrentDepthConfig

        AutoConfig.register(RecurrentDepthConfig.model_type, RecurrentDepthConfig, exist_ok=True)
    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"--tokenizer {name_or_path}: has no eos_token; documents are separated by EOS, so "
            "use a tokenizer that defines one (or set eos_token in its tokenizer_config.json)."
        )
    return tokenizer


def split_long_text(text: str, max_chars: int = MAX_ENCODE_CHARS) -> list[str]:
    """`text` in consecutive pieces of at most `max_chars` characters, each cut just before a whitespace character
    that is followed by a non-whitespace one (the last such point in the piece's window).

    There a byte-level BPE's pre-tokenizer (GPT-2's pattern: a word takes one leading space, a whitespace run
    before a word ends one character early) splits the text anyway, so its tokens are exactly those of the whole
    text; for other tokenizers (SentencePiece-style) they can differ at the cut points only. A window without
    such a point (e.g. Japanese text without spaces) is cut at `max_chars`.
    """
    if len(text) <= max_chars:
        return [text]
    pieces, start = [], 0
    while len(text) - start > max_chars:
        end = start + max_chars
        cut = end  # no whitespace boundary in the window
        # The window's last boundary, looked for near its end first (a scan of the whole window only without one).
        for lower in (max(start + 1, end - 4096), start + 1):
            boundaries = list(_WHITESPACE_BEFORE_WORD.finditer(text, lower, end + 1))
            if boundaries:
                cut = boundaries[-1].start()  # the piece ends before the whitespace character, the next starts with it
                break
        pieces.append(text[start:cut])
        start = cut
    pieces.append(text[start:])
    return pieces


def encode_documents(tokenizer, texts: list, eos_token_id: int) -> list[np.ndarray]:
    """Each document's ids (int64) followed by EOS; an empty document gives no ids (not even EOS).

    No special tokens from the tokenizer (e.g. a Llama BOS): the stream format is "doc EOS doc EOS ...",
    identical whatever tokenizer is used. A fast tokenizer encodes each call's texts in parallel Rust threads;
    a call gets at most MAX_ENCODE_CHARS characters (long documents in pieces, split_long_text), which bounds
    the tokenizer's memory whatever the documents' lengths. Ids become arrays as each call returns: as Python
    lists of ints they took 36 bytes per token.
    """
    encoded: list[list[np.ndarray]] = [[] for _ in texts]
    call: list[str] = []
    owners: list[int] = []  # the document of each text in `call`
    call_chars = 0

    def flush():
        ids = tokenizer(call, add_special_tokens=False, return_attention_mask=False, verbose=False)["input_ids"]
        for owner, piece_ids in zip(owners, ids, strict=True):
            encoded[owner].append(np.asarray(piece_ids, dtype=np.int64))
        call.clear()
        owners.clear()

    for index, text in enumerate(texts):
        if not text:
            continue
        for piece in split_long_text(text, MAX_ENCODE_CHARS):
            if call and call_chars + len(piece) > MAX_ENCODE_CHARS:
                flush()
                call_chars = 0
            call.append(piece)
            owners.append(index)
            call_chars += len(piece)
    if call:
        flush()
    eos = np.array([eos_token_id], dtype=np.int64)
    return [np.concatenate([*parts, eos]) if sum(map(len, parts)) else np.zeros(0, dtype=np.int64)
            for parts in encoded]
