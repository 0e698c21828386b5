"""Tokenize a corpus and pack it into fixed-length numpy shards with a manifest.

    python -m scripts.prepare_data                      # embedded KJV corpus -> outputs/data/kjv
    python -m scripts.prepare_data --files "data/*.jsonl" notes.txt --output_dir outputs/data/mine
    python -m scripts.prepare_data --dataset uonlp/CulturaX --dataset_config ja \
        --tokenizer llm-jp/llm-jp-3-1.8b --seq_len 2048 --max_tokens 1_000_000_000 \
        --output_dir outputs/data/culturax-ja

Steps: stream documents (corpus.py; nothing is copied into the datasets cache) -> load or
train a tokenizer -> tokenize batch by batch and append EOS after every document ->
concatenate into one token stream on disk (reading stops once ``--max_tokens`` are there) ->
cut it into samples of ``seq_len + 1`` tokens (the tail shorter than one sample is dropped)
-> shuffle samples with ``--seed`` -> hold out an eval split -> write ``train-*.npy`` /
``eval-*.npy`` shards and ``manifest.json`` (format: trainer_ext/data.py).

Reruns: the manifest is written last, so a directory with a manifest is complete. Running
again with the same arguments and sources finds the manifest, checks the shards and exits
without work. Different arguments are refused unless ``--overwrite`` is given. A directory
without a manifest (an interrupted run) is cleaned of its shard/temp files and redone;
shuffling needs the whole stream, so there is no partial resume.

Taking the stream in pieces (the comparison pipeline's token cycles): ``--skip_tokens N`` starts
after the first N tokens of the packed stream, ``--eval_only`` writes every sample to the eval
split (a fixed held-out set), and ``--eval_from DIR`` copies DIR's eval split instead of holding
samples out, so many directories share one held-out set (and, by default, DIR's tokenizer).
Skipped tokens must be tokenized to be counted, so the manifest also records where its stream
ends as ``stream_end: {documents: D, tokens: T}`` (D whole documents of the source, skipped
ones included, then T tokens of the next); ``--skip_documents D --skip_tokens T`` starts the
next piece there, reading the D documents without tokenizing them. Each document is tokenized
on its own, so this gives exactly the tokens of the equivalent absolute ``--skip_tokens``, and
a piece costs the reading of what comes before it plus the tokenizing of its own documents.
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import glob
import logging
import os
import re
import shutil
import sys
from dataclasses import dataclass, field

import numpy as np
from tqdm.auto import tqdm

from trainer_ext.data import corpus
from trainer_ext.data.shards import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    SPLITS,
    read_manifest,
    shard_name,
    token_dtype,
    tokenizer_hash,
    validate_data_dir,
    write_manifest,
    write_shard,
)

logger = logging.getLogger("prepare_data")

DEFAULT_OUTPUT_DIR = os.path.join("outputs", "data", "kjv")
SPECIAL_TOKENS = {"bos_token": "<|bos|>", "eos_token": "<|eos|>", "pad_token": "<|pad|>"}
_BYTE_ALPHABET_SIZE = 256
_TOKEN_FILE = ".tokens.bin.tmp"  # the packed stream before shuffling; removed at the end
_FIRST_BATCH_SIZE = 16  # documents tokenized first when --max_tokens may be reached within the first batch
# Characters handed to the tokenizer in one call. A fast tokenizer holds offsets and per-token structures for all
# of its input at once: one 12 MB line (a web dump without newlines) peaked at 2.7 GB, about 225x its size. The
# peak grows with the call: on a 12 MB line (debug BPE, 0.5 tokens per character) 2.0 GB in one call, 440 MB in
# calls of 1M characters, 130 MB in calls of 256K; encoding the embedded corpus in 256K calls is as fast as in
# batches of 1000 documents. Longer documents are split at whitespace into pieces of at most this size
# (split_long_text).
MAX_ENCODE_CHARS = 1 << 18
_WHITESPACE_BEFORE_WORD = re.compile(r"\s(?=\S)")

# Arguments that change where work happens or how fast, not what is written; a rerun that
# differs only in these is still "the same data".
_NON_CONTENT_ARGS = ("output_dir", "num_proc", "map_batch_size", "cache_dir", "overwrite", "disable_tqdm")
# Arguments added after manifests were first written: recorded only when set, so a directory
# prepared before they existed still counts as prepared with the same arguments.
_OPTIONAL_CONTENT_ARGS = {"skip_documents": 0, "skip_tokens": 0, "eval_only": False, "eval_from": None}


@dataclass
class PrepareDataArguments:
    """Arguments of prepare_data. With none given it prepares the embedded KJV corpus."""

    output_dir: str | None = field(
        default=None,
        metadata={"help": f"Where shards, manifest and tokenizer go. Default {DEFAULT_OUTPUT_DIR} for the "
                  "embedded corpus; required for --files / --dataset."},
    )
    # ---- source: one of --dataset, --files, or nothing (embedded corpus)
    dataset: str | None = field(
        default=None, metadata={"help": "A datasets hub name (or local dataset dir), read with streaming."}
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Config (subset) of --dataset, e.g. 'ja'."})
    split: str = field(default="train", metadata={"help": "Split of --dataset to read."})
    files: list[str] | None = field(
        default=None,
        metadata={"help": "Local .txt / .jsonl / .json / .parquet files or quoted globs (optionally .gz etc.)."},
    )
    text_column: str = field(default="text", metadata={"help": "Column holding document text (JSONL/parquet/hub)."})
    text_sample_by: str = field(
        default="document",
        metadata={"help": "What one document of a .txt file is: 'document' (whole file), 'paragraph' "
                  "(blank-line separated) or 'line'."},
    )
    max_documents: int | None = field(default=None, metadata={"help": "Use at most this many documents."})
    max_tokens: int | None = field(
        default=None,
        metadata={"help": "Stop once this many tokens are collected (after the skipped ones): reading and "
                  "tokenizing stop there, after the batch of --map_batch_size documents under way."},
    )
    # ---- tokenizer
    tokenizer: str | None = field(
        default=None,
        metadata={"help": "Tokenizer path or hub id (AutoTokenizer). If unset, a byte-level BPE is trained "
                  "on the corpus."},
    )
    vocab_size: int = field(default=8192, metadata={"help": "Vocabulary size of the trained BPE."})
    tokenizer_train_documents: int = field(
        default=100_000, metadata={"help": "Train the BPE on at most this many (leading) documents."}
    )
    # ---- packing and layout
    seq_len: int = field(default=256, metadata={"help": "Model context; each sample stores seq_len + 1 tokens."})
    shard_size: int = field(default=32768, metadata={"help": "Samples per shard file."})
    eval_fraction: float = field(default=0.01, metadata={"help": "Fraction of samples held out for eval."})
    eval_samples: int | None = field(
        default=None, metadata={"help": "Exact number of eval samples; overrides --eval_fraction (0 = none)."}
    )
    eval_only: bool = field(
        default=False, metadata={"help": "Write every sample to the eval split (a fixed held-out set; no train split)."}
    )
    eval_from: str | None = field(
        default=None,
        metadata={"help": "Copy the eval split of this prepared directory instead of holding samples out of this "
                  "stream (all samples go to train). Needs the same tokenizer and --seq_len; --tokenizer "
                  "defaults to the one saved there."},
    )
    skip_documents: int = field(
        default=0,
        metadata={"help": "Skip this many documents at the start of the source without tokenizing them (they are "
                  "still read), before --skip_tokens. With --skip_tokens, continues the stream where an earlier "
                  "directory's manifest says it ended (its stream_end: documents, tokens)."},
    )
    skip_tokens: int = field(
        default=0,
        metadata={"help": "Skip this many tokens of the packed stream (after --skip_documents, before --max_tokens), "
                  "to take the stream's next tokens after earlier directories. These tokens are tokenized and "
                  "dropped; skip whole documents with --skip_documents to avoid that work."},
    )
    shuffle: bool = field(default=True, metadata={"help": "Shuffle samples with --seed (--no_shuffle keeps stream order)."})
    seed: int = field(default=1234, metadata={"help": "Seed of the sample shuffle."})
    # ---- execution
    num_proc: int = field(
        default=1,
        metadata={"help": "No effect, accepted so existing commands still run: a fast tokenizer encodes each batch "
                  "in parallel threads (one core per thread, unless TOKENIZERS_PARALLELISM=false)."},
    )
    map_batch_size: int = field(default=1000, metadata={"help": "Documents per tokenization batch."})
    cache_dir: str | None = field(default=None, metadata={"help": "datasets cache dir (default: HF default)."})
    overwrite: bool = field(default=False, metadata={"help": "Replace an output dir prepared with other arguments."})
    disable_tqdm: bool = field(
        default=False, metadata={"help": "No packing / shard-writing progress bars (for callers that show their own)."}
    )

    def __post_init__(self):
        if self.dataset is not None and self.files:
            raise ValueError("Pass either --dataset or --files, not both.")
        if self.output_dir is None:
            if self.dataset is not None or self.files:
                raise ValueError("--output_dir is required with --dataset or --files.")
            self.output_dir = DEFAULT_OUTPUT_DIR
        if self.text_sample_by not in ("document", "paragraph", "line"):
            raise ValueError(
                f"--text_sample_by must be 'document', 'paragraph' or 'line', got '{self.text_sample_by}'."
            )
        for name in ("skip_documents", "skip_tokens"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name} must be >= 0, got {getattr(self, name)}.")
        if self.eval_from is not None:
            if self.eval_only:
                raise ValueError("Pass either --eval_only (write a held-out set) or --eval_from (copy one), not both.")
            if self.eval_samples is not None:
                raise ValueError("--eval_samples has no effect with --eval_from (the eval split is copied); drop it.")
            if self.tokenizer is None:
                self.tokenizer = self.eval_from  # the held-out ids are only comparable under its tokenizer
        positive = ("seq_len", "shard_size", "num_proc", "map_batch_size", "tokenizer_train_documents",
                    "max_documents", "max_tokens")
        for name in positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be >= 1, got {value}.")
        if self.tokenizer is None and self.vocab_size <= _BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS):
            raise ValueError(
                f"--vocab_size must exceed {_BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)} (256 byte tokens + "
                f"{len(SPECIAL_TOKENS)} special tokens) for a byte-level BPE, got {self.vocab_size}."
            )
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"--eval_fraction must be in [0, 1), got {self.eval_fraction}.")
        if self.eval_samples is not None and self.eval_samples < 0:
            raise ValueError(f"--eval_samples must be >= 0, got {self.eval_samples}.")

    def content_args(self) -> dict:
        """The arguments that determine the written data (recorded in the manifest)."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in _NON_CONTENT_ARGS and not (k in _OPTIONAL_CONTENT_ARGS and v == _OPTIONAL_CONTENT_ARGS[k])}


# ----------------------------------------------------------------------------- sources


def describe_sources(args: PrepareDataArguments) -> tuple[list[dict], list[str] | None]:
    """Manifest description of the input, and the expanded local file list (if any)."""
    if args.dataset is not None:
        return [{"type": "hub", "name": args.dataset, "config": args.dataset_config, "split": args.split,
                 "text_column": args.text_column}], None
    if args.files:
        files = corpus.expand_file_patterns(args.files)
        for path in files:
            corpus.file_format(path)  # fail on unknown suffixes before any work
        return [{"type": "files", "text_column": args.text_column, "text_sample_by": args.text_sample_by,
                 "files": [{"path": p, "size_bytes": os.path.getsize(p)} for p in files]}], files
    corpus_files = corpus.default_corpus_files()
    return [{"type": "embedded", "name": corpus.DEFAULT_CORPUS_NAME,
             "files": [{"path": "bible/data/" + os.path.basename(p), "size_bytes": os.path.getsize(p)}
                       for p in corpus_files]}], None


def load_documents(args: PrepareDataArguments, files: list[str] | None):
    """The source's documents from its start (at most ``--max_documents``), as a streamed
    ``datasets.IterableDataset`` with a ``text`` column: read only as far as they are used."""
    if args.dataset is not None:
        return corpus.load_hub_dataset(args.dataset, args.dataset_config, args.split, args.text_column,
                                       args.max_documents)
    if files is not None:
        return corpus.load_local_files(files, args.text_column, args.text_sample_by, args.max_documents,
                                       args.cache_dir)
    return corpus.load_default_corpus(args.max_documents)


def _text_batches(documents, batch_size: int, limit: int):
    """Lists of texts from the first ``limit`` documents (for tokenizer training; long ones in pieces, as they are
    encoded)."""
    seen = 0
    for batch in documents.iter(batch_size=batch_size):
        texts = [t for t in batch["text"] if t]
        texts = texts[: limit - seen]
        seen += len(texts)
        yield [piece for text in texts for piece in split_long_text(text, MAX_ENCODE_CHARS)]
        if seen >= limit:
            return


# ----------------------------------------------------------------------------- tokenizer


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
    backend.train_from_iterator(_text_batches(documents, batch_size, max_documents), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, **SPECIAL_TOKENS)


def load_tokenizer(name_or_path: str):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(name_or_path)
    if tokenizer.eos_token_id is None:
        raise ValueError(
            f"--tokenizer {name_or_path}: has no eos_token; documents are separated by EOS, so "
            "use a tokenizer that defines one (or set eos_token in its tokenizer_config.json)."
        )
    return tokenizer


# ----------------------------------------------------------------------------- tokenize + pack


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
    progress = tqdm(total=max_tokens, desc="Packing", unit="tok", unit_scale=True, disable=not show_progress)
    with open(path, "wb") as f:
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
    progress.close()
    if counts is not None:
        counts["replacement_characters"] = replacements
    return num_tokens, num_documents, end


def warn_about_replacements(count: int, files: list[str] | None) -> None:
    """Say how much of the text was not valid UTF-8 (it trains as U+FFFD, silently, otherwise), and in which of the
    local text files; a file in another encoding (Shift_JIS, cp1252) shows up here."""
    if not count:
        return
    per_file = []
    for path in files or []:
        if corpus.file_format(path) == "text":
            replaced = corpus.count_decoding_replacements(path)
            if replaced:
                per_file.append(f"{path}: {replaced:,}")
    where = ("; decoding replacements per file: " + ", ".join(per_file) + ". Convert those files to UTF-8 "
             "(e.g. iconv -f SHIFT_JIS -t UTF-8) and prepare again" if per_file
             else "; they come from the source itself (no local text file had invalid UTF-8)")
    logger.warning("%s U+FFFD replacement characters in the tokenized text (bytes that were not valid UTF-8)%s.",
                   f"{count:,}", where)


def split_indices(num_samples: int, args: PrepareDataArguments) -> dict[str, np.ndarray]:
    """Sample indices per split: a seeded permutation (or stream order), eval taken from its end."""
    order = np.random.default_rng(args.seed).permutation(num_samples) if args.shuffle else np.arange(num_samples)
    if args.eval_only:
        return {"train": order[:0], "eval": order}
    if args.eval_from is not None:  # the eval split is copied from there, none is held out here
        return {"train": order, "eval": order[:0]}
    if args.eval_samples is not None:
        num_eval = args.eval_samples
    else:
        num_eval = int(round(num_samples * args.eval_fraction))
        if args.eval_fraction > 0 and num_samples > 1:
            num_eval = max(num_eval, 1)
    if num_eval >= num_samples:
        raise ValueError(
            f"The corpus gives {num_samples} samples of {args.seq_len + 1} tokens but {num_eval} are asked "
            "for eval, leaving none to train on; lower --eval_samples / --eval_fraction or add text."
        )
    num_train = num_samples - num_eval
    return {"train": order[:num_train], "eval": order[num_train:]}


def write_split_shards(output_dir: str, samples: np.ndarray, indices: dict[str, np.ndarray],
                       shard_size: int, show_progress: bool = True) -> dict:
    splits = {}
    num_shards = sum(-(-len(idx) // shard_size) for idx in indices.values())
    with tqdm(total=num_shards, desc="Writing shards", unit="shard", disable=not show_progress) as progress:
        for split, idx in indices.items():
            shards = []
            for shard_index, start in enumerate(range(0, len(idx), shard_size)):
                rows = samples[idx[start:start + shard_size]]  # gather (shard_size, seq_len + 1)
                shards.append(write_shard(os.path.join(output_dir, shard_name(split, shard_index)), rows))
                progress.update(1)
            num_split_samples = int(len(idx))
            splits[split] = {
                "num_samples": num_split_samples,
                "num_tokens": num_split_samples * samples.shape[1],
                "shards": shards,
            }
    return splits


def read_eval_source(args: PrepareDataArguments) -> dict:
    """The manifest of ``--eval_from``, checked before any work: it must hold an eval split of this seq_len."""
    manifest = read_manifest(args.eval_from)
    path = os.path.join(args.eval_from, MANIFEST_NAME)
    if not manifest["splits"].get("eval", {}).get("shards"):
        raise ValueError(f"{path}: --eval_from needs a directory with an eval split, this one has none; prepare "
                         "one with --eval_only (or --eval_samples N).")
    if manifest["seq_len"] != args.seq_len:
        raise ValueError(f"{path}: its samples have seq_len {manifest['seq_len']} but --seq_len is {args.seq_len}; "
                         "pass the same --seq_len so both splits hold samples of one length.")
    validate_data_dir(args.eval_from, split="eval")
    return manifest


def copy_eval_split(source_dir: str, source: dict, output_dir: str, tokenizer_id: str, dtype: np.dtype) -> dict:
    """Place ``source_dir``'s eval shards in ``output_dir`` (hard links where possible, else copies; each
    lands under its final name by rename) and return the split's manifest entry."""
    path = os.path.join(source_dir, MANIFEST_NAME)
    if source["tokenizer_hash"] != tokenizer_id:
        raise ValueError(f"{path}: its eval split was made with another tokenizer than this data; omit --tokenizer "
                         f"(it defaults to the one in {source_dir}) or prepare the eval set with yours.")
    if np.dtype(source["dtype"]) != dtype:
        raise ValueError(f"{path}: dtype {source['dtype']} differs from this data's {dtype.name}; re-prepare it.")
    split = copy.deepcopy(source["splits"]["eval"])
    for entry in split["shards"]:
        tmp_path = os.path.join(output_dir, f".{entry['file']}.tmp")
        if os.path.exists(tmp_path):
            os.remove(tmp_path)
        try:
            os.link(os.path.join(source_dir, entry["file"]), tmp_path)  # shards are never modified in place
        except OSError:
            shutil.copyfile(os.path.join(source_dir, entry["file"]), tmp_path)
        os.replace(tmp_path, os.path.join(output_dir, entry["file"]))
    return split


# ----------------------------------------------------------------------------- output dir state


def _remove_stale_outputs(output_dir: str) -> None:
    """Delete shards and temp files of an earlier run (manifest first, so no reader sees a mix)."""
    manifest_path = os.path.join(output_dir, MANIFEST_NAME)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)
    patterns = [f"{split}-*.npy" for split in SPLITS] + [".*.tmp"]
    for pattern in patterns:
        for path in glob.glob(os.path.join(output_dir, pattern)):
            os.remove(path)


def _existing_manifest_if_current(args: PrepareDataArguments, sources: list[dict],
                                  tokenizer_id: str | None) -> dict | None:
    """The manifest of an identical earlier run, None if there is none; raise if it differs."""
    manifest_path = os.path.join(args.output_dir, MANIFEST_NAME)
    if not os.path.exists(manifest_path):
        return None
    manifest = read_manifest(args.output_dir)
    previous_args, current_args = manifest.get("args") or {}, args.content_args()
    differences = [f"--{k}" for k in sorted(set(previous_args) | set(current_args))
                   if previous_args.get(k) != current_args.get(k)]
    if manifest.get("sources") != sources:
        differences.append("sources (files or their sizes)")
    if tokenizer_id is not None and manifest["tokenizer_hash"] != tokenizer_id:
        differences.append("tokenizer_hash")
    if differences:
        raise ValueError(
            f"{manifest_path}: this directory already holds data prepared with different settings "
            f"({', '.join(differences)}). Pass --overwrite to replace it, or choose another --output_dir."
        )
    for split in SPLITS:
        if manifest["splits"].get(split, {}).get("shards"):
            validate_data_dir(args.output_dir, split=split)
    return manifest


# ----------------------------------------------------------------------------- driver


def prepare(args: PrepareDataArguments) -> dict:
    """Run the whole preparation; return the manifest (also written to ``output_dir``)."""
    from transformers import AutoTokenizer

    output_dir = args.output_dir
    os.makedirs(output_dir, exist_ok=True)
    sources, files = describe_sources(args)
    eval_source = read_eval_source(args) if args.eval_from is not None else None

    given_tokenizer = load_tokenizer(args.tokenizer) if args.tokenizer is not None else None
    if not args.overwrite:
        tokenizer_id = tokenizer_hash(given_tokenizer) if given_tokenizer is not None else None
        existing = _existing_manifest_if_current(args, sources, tokenizer_id)
        if existing is not None:
            logger.info("%s is already prepared with these arguments; nothing to do.", output_dir)
            return existing
    if args.num_proc > 1:
        logger.warning("--num_proc has no effect: the tokenizer encodes each batch in parallel threads.")
    # Overwriting, or leftovers of an interrupted run (no manifest): start clean.
    _remove_stale_outputs(output_dir)

    documents = load_documents(args, files)
    if given_tokenizer is None:
        logger.info("Training a byte-level BPE tokenizer (vocab_size=%d).", args.vocab_size)
        tokenizer = train_bpe_tokenizer(documents, args.vocab_size, args.tokenizer_train_documents,
                                        args.map_batch_size)
        tokenizer_source = f"trained byte-level BPE (vocab_size={args.vocab_size})"
    else:
        tokenizer, tokenizer_source = given_tokenizer, args.tokenizer
    # Tokenize with the copy AutoTokenizer loads back from output_dir, so the recorded hash
    # and the ids are by construction those of the tokenizer the trainer will find there.
    tokenizer.save_pretrained(output_dir)
    tokenizer = AutoTokenizer.from_pretrained(output_dir)
    vocab_size = len(tokenizer)
    dtype = token_dtype(vocab_size)

    # The tokenizer above was trained on the source's leading documents whatever is skipped here.
    if args.skip_documents:
        documents = documents.skip(args.skip_documents)
    token_path = os.path.join(output_dir, _TOKEN_FILE)
    counts: dict = {}
    num_tokens, num_documents, stream_end = pack_token_stream(
        documents, tokenizer, token_path, dtype, args.max_tokens, args.map_batch_size, args.skip_documents,
        args.skip_tokens, show_progress=not args.disable_tqdm, counts=counts)
    warn_about_replacements(counts["replacement_characters"], files)

    sample_len = args.seq_len + 1
    num_samples = num_tokens // sample_len
    if num_samples == 0:
        os.remove(token_path)
        skipped = [f"{args.skip_documents:,} documents skipped (--skip_documents)"] if args.skip_documents else []
        skipped += [f"{args.skip_tokens:,} skipped (--skip_tokens)"] if args.skip_tokens else []
        raise ValueError(
            f"The corpus gives {num_tokens} tokens"
            + (f" after the {' and the '.join(skipped)}" if skipped else "")
            + f", fewer than one sample of seq_len + 1 = {sample_len}; "
            "add text, raise --max_documents / --max_tokens, or lower --seq_len."
        )
    stream = np.memmap(token_path, dtype=dtype, mode="r", shape=(num_samples * sample_len,))
    samples = stream.reshape(num_samples, sample_len)
    splits = write_split_shards(output_dir, samples, split_indices(num_samples, args), args.shard_size,
                                show_progress=not args.disable_tqdm)
    del stream, samples
    os.remove(token_path)
    if eval_source is not None:
        splits["eval"] = copy_eval_split(args.eval_from, eval_source, output_dir, tokenizer_hash(tokenizer), dtype)

    manifest = {
        "format_version": FORMAT_VERSION,
        "seq_len": args.seq_len,
        "sample_len": sample_len,
        "dtype": dtype.name,
        "vocab_size": vocab_size,
        "tokenizer_hash": tokenizer_hash(tokenizer),
        "tokenizer": {
            "source": tokenizer_source,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        "total_tokens": num_samples * sample_len,
        "stream_tokens": num_tokens,  # before dropping the tail shorter than one sample
        "num_documents": num_documents,  # read and tokenized (the skipped documents not included)
        "stream_end": stream_end,  # where the packed stream ends: pass as --skip_documents / --skip_tokens to go on
        "splits": splits,
        "sources": sources,
        "seed": args.seed,
        "shuffle": args.shuffle,
        "created": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "args": args.content_args(),
    }
    write_manifest(output_dir, manifest)
    logger.info(
        "Wrote %s: %d train / %d eval samples of %d tokens (%s tokens total, %s, vocab %d).",
        output_dir, splits["train"]["num_samples"], splits["eval"]["num_samples"], sample_len,
        f"{manifest['total_tokens']:,}", dtype.name, vocab_size,
    )
    return manifest


def main(argv: list[str] | None = None) -> None:
    from transformers import HfArgumentParser

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    (args,) = HfArgumentParser(PrepareDataArguments).parse_args_into_dataclasses(
        args=argv if argv is not None else sys.argv[1:]
    )
    prepare(args)


if __name__ == "__main__":
    main()
