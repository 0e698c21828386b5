"""Data preparation: tokenize a corpus and pack it into fixed-length token shards with a manifest.

Steps: stream documents (corpus.py; nothing is copied into the datasets cache) -> load or train a tokenizer
(tokenizer.py) -> tokenize batch by batch and append EOS after every document, into one token stream on disk
(packing.py; reading stops once ``max_tokens`` are there) -> cut it into samples of ``seq_len + 1`` tokens (the tail
shorter than one sample is dropped) -> shuffle samples with ``seed`` -> hold out an eval split -> write
``train-*.npy`` / ``eval-*.npy`` shards and ``manifest.json`` (shards.py).

Reruns: the manifest is written last, so a directory with a manifest is complete. Running again with the same
arguments and sources finds the manifest, checks the shards and returns it without work. Different arguments are
refused unless ``overwrite``. A directory without a manifest (an interrupted run) is cleaned of its shard/temp
files and redone; shuffling needs the whole stream, so there is no partial resume.

Taking the stream in pieces (the comparison pipeline's token cycles): ``skip_tokens=N`` starts after the first N
tokens of the packed stream, ``eval_only`` writes every sample to the eval split (a fixed held-out set), and
``eval_from=DIR`` links DIR's eval split instead of holding samples out, so many directories share one held-out set
(and, by default, DIR's tokenizer). Skipped tokens must be tokenized to be counted, so the manifest also records
where its stream ends as ``stream_end: {documents: D, tokens: T}`` (D whole documents of the source, skipped ones
included, then T tokens of the next); ``skip_documents=D, skip_tokens=T`` starts the next piece there, reading the
D documents without tokenizing them. Each document is tokenized on its own, so this gives exactly the tokens of the
equivalent absolute ``skip_tokens``, and a piece costs the reading of what comes before it plus the tokenizing of
its own documents.

Disk space: before tokenizing, the free space of ``output_dir`` is checked against the stream and its shards (twice
the expected tokens: both exist until the shards are written) where the size can be told (``max_tokens``, local
files), and against the exact shard size before writing the shards; when the disk fills up anyway the partial files
(``.tokens.bin.tmp``, the shards so far) are removed and the error says how much more space is needed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import glob
import logging
import os
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from trainer_ext.data import corpus
from trainer_ext.data.json_records import ON_BAD_LINES, BadLines
from trainer_ext.data.packing import pack_token_stream
from trainer_ext.data.shards import (
    FORMAT_VERSION,
    MANIFEST_NAME,
    SPLITS,
    link_split,
    read_manifest,
    remove_data_files,
    token_dtype,
    tokenizer_hash,
    validate_data_dir,
    write_manifest,
    write_split_shards,
)
from trainer_ext.data.tokenizer import BYTE_ALPHABET_SIZE, SPECIAL_TOKENS, load_tokenizer_with_eos, train_bpe_tokenizer
from trainer_ext.files import (
    DiskFullError,
    check_free_space,
    check_same_run,
    disk_full_error,
    is_disk_full,
    remove_paths,
)
from trainer_ext.progress import Progress, on_terminal

logger = logging.getLogger(__name__)

DEFAULT_OUTPUT_DIR = os.path.join("outputs", "data", "kjv")
_TOKEN_FILE = ".tokens.bin.tmp"  # the packed stream before shuffling; removed at the end
# Bytes of text per token of a typical BPE, for the disk-space check before tokenizing local files: a low estimate of
# the tokens (small vocabularies take fewer bytes per token), so that the check refuses only what cannot fit.
_TEXT_BYTES_PER_TOKEN = 4
_FIX_DISK = "lower --max_tokens (or --max_documents)"
# Arguments that change where work happens or how fast, not what is written; a rerun that
# differs only in these is still "the same data".
# --on_bad_lines only decides whether bad JSON lines are refused: data that is written is the same either way.
_NON_CONTENT_ARGS = ("output_dir", "map_batch_size", "cache_dir", "overwrite", "disable_tqdm", "on_bad_lines")
# Options of taking a piece of the stream, recorded only when set: a manifest lists the options that shaped it.
_PIECE_ARGS_UNSET = {"skip_documents": 0, "skip_tokens": 0, "eval_only": False, "eval_from": None}


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
    on_bad_lines: str = field(
        default="skip",
        metadata={"help": "A JSON line that holds no document (not JSON, e.g. cut off; not an object; no "
                  "--text_column string): 'skip' leaves it out, counted, with a warning naming the file and its "
                  "first bad line; 'error' refuses it, naming the file and line, before the tokenizer is trained "
                  "(every JSON file is read once first)."},
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
        if self.on_bad_lines not in ON_BAD_LINES:
            raise ValueError(f"--on_bad_lines must be one of {list(ON_BAD_LINES)}, got '{self.on_bad_lines}'.")
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
        positive = ("seq_len", "shard_size", "map_batch_size", "tokenizer_train_documents", "max_documents",
                    "max_tokens")
        for name in positive:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"--{name} must be >= 1, got {value}.")
        if self.tokenizer is None and self.vocab_size <= BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS):
            raise ValueError(
                f"--vocab_size must exceed {BYTE_ALPHABET_SIZE + len(SPECIAL_TOKENS)} (256 byte tokens + "
                f"{len(SPECIAL_TOKENS)} special tokens) for a byte-level BPE, got {self.vocab_size}."
            )
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ValueError(f"--eval_fraction must be in [0, 1), got {self.eval_fraction}.")
        if self.eval_samples is not None and self.eval_samples < 0:
            raise ValueError(f"--eval_samples must be >= 0, got {self.eval_samples}.")

    def content_args(self) -> dict:
        """The arguments that determine the written data (recorded in the manifest)."""
        return {k: v for k, v in dataclasses.asdict(self).items()
                if k not in _NON_CONTENT_ARGS and not (k in _PIECE_ARGS_UNSET and v == _PIECE_ARGS_UNSET[k])}


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


def load_documents(args: PrepareDataArguments, files: list[str] | None, bad_lines: BadLines | None = None):
    """The source's documents from its start (at most ``--max_documents``), as a streamed
    ``datasets.IterableDataset`` with a ``text`` column: read only as far as they are used."""
    if args.dataset is not None:
        return corpus.load_hub_dataset(args.dataset, args.dataset_config, args.split, args.text_column,
                                       args.max_documents)
    if files is not None:
        return corpus.load_local_files(files, args.text_column, args.text_sample_by, args.max_documents,
                                       args.cache_dir, bad_lines)
    return corpus.load_default_corpus(args.max_documents)


# ----------------------------------------------------------------------------- splits


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


def check_eval_source_matches(source_dir: str, source: dict, tokenizer_id: str, dtype: np.dtype) -> None:
    """The eval split of ``source_dir`` fits this data only with the same tokenizer and token dtype."""
    path = os.path.join(source_dir, MANIFEST_NAME)
    if source["tokenizer_hash"] != tokenizer_id:
        raise ValueError(f"{path}: its eval split was made with another tokenizer than this data; omit --tokenizer "
                         f"(it defaults to the one in {source_dir}) or prepare the eval set with yours.")
    if np.dtype(source["dtype"]) != dtype:
        raise ValueError(f"{path}: dtype {source['dtype']} differs from this data's {dtype.name}; re-prepare it.")


# ----------------------------------------------------------------------------- disk space and progress


def expected_stream_tokens(args: PrepareDataArguments, sources: list[dict]) -> int | None:
    """About how many tokens the packed stream will hold, for the disk-space check before tokenizing: at most
    ``max_tokens``, and for local files taken whole their size over _TEXT_BYTES_PER_TOKEN (a compressed file counts
    its compressed size: an estimate too low, never too high). None where nothing tells (a hub dataset without
    ``max_tokens``): the exact check before the shards are written still holds."""
    files = sources[0].get("files") if sources else None
    whole_files = files and not (args.max_documents or args.skip_documents or args.skip_tokens)
    estimates = [args.max_tokens] if args.max_tokens is not None else []
    if whole_files:
        estimates.append(sum(entry["size_bytes"] for entry in files) // _TEXT_BYTES_PER_TOKEN)
    return min(estimates) if estimates else None


def _file_size(path: str) -> int:
    return os.path.getsize(path) if os.path.exists(path) else 0


def partial_data_files(output_dir: str) -> list[str]:
    """What an unfinished preparation has written: the token stream, shards, temporary files of atomic writes."""
    patterns = [_TOKEN_FILE, *(f"{split}-*.npy" for split in SPLITS), ".*.tmp"]
    return sorted({path for pattern in patterns for path in glob.glob(os.path.join(output_dir, pattern))})


@contextlib.contextmanager
def partial_files_removed_on_full_disk(output_dir: str, needed: Callable[[], int]):
    """On a full disk inside the block, remove what this preparation has written (a rerun starts from scratch
    anyway, and left there it keeps the disk full) and raise DiskFullError saying how much is needed: `needed()`,
    asked before the removal. A refusal of `check_free_space` inside the block removes them too."""
    try:
        yield
    except Exception as err:
        if not is_disk_full(err):
            raise
        size = needed()
        removed = remove_paths(partial_data_files(output_dir))
        if isinstance(err, DiskFullError):  # a refusal before writing: its message says it all
            raise
        raise disk_full_error(output_dir, size, "the prepared data", removed, _FIX_DISK, err) from err


class CountedDocuments:
    """``documents`` as the BPE trainer reads them (``.iter(batch_size=...)``), counted into ``progress``. The
    merges computed after the reading report nothing of their own: the progress line then says that they run."""

    def __init__(self, documents, progress: Progress):
        self.documents, self.progress = documents, progress

    def iter(self, batch_size: int):
        try:
            for batch in self.documents.iter(batch_size=batch_size):
                # The trainer stops at its document limit (the total) within a batch.
                self.progress.update(min(len(batch["text"]), self.progress.total - self.progress.n))
                yield batch
        finally:
            self.progress.set_postfix_str("documents read, computing the merges")


# ----------------------------------------------------------------------------- driver


def existing_manifest(args: PrepareDataArguments, sources: list[dict], tokenizer_id: str | None) -> dict | None:
    """The manifest of an identical earlier run, None if there is none; raise if it differs."""
    manifest_path = os.path.join(args.output_dir, MANIFEST_NAME)
    if not os.path.exists(manifest_path):
        return None
    manifest = read_manifest(args.output_dir)
    saved = {**{f"--{k}": v for k, v in (manifest.get("args") or {}).items()}, "sources": manifest.get("sources")}
    current = {**{f"--{k}": v for k, v in args.content_args().items()}, "sources": sources}
    if tokenizer_id is not None:
        saved["tokenizer_hash"], current["tokenizer_hash"] = manifest["tokenizer_hash"], tokenizer_id
    check_same_run(f"{manifest_path}: this directory holds data prepared", saved, current,
                   "Pass --overwrite to replace it, or choose another --output_dir.")
    for split in SPLITS:
        if manifest["splits"].get(split, {}).get("shards"):
            validate_data_dir(args.output_dir, split=split)
    return manifest


def prepare(args: PrepareDataArguments) -> dict:
    """Run the whole preparation; return the manifest (also written to ``output_dir``)."""
    from transformers import AutoTokenizer

    output_dir = args.output_dir
    os.makedirs(output_dir, exist_ok=True)
    sources, files = describe_sources(args)
    eval_source = read_eval_source(args) if args.eval_from is not None else None

    given_tokenizer = load_tokenizer_with_eos(args.tokenizer) if args.tokenizer is not None else None
    if not args.overwrite:
        tokenizer_id = tokenizer_hash(given_tokenizer) if given_tokenizer is not None else None
        existing = existing_manifest(args, sources, tokenizer_id)
        if existing is not None:
            logger.info("%s is already prepared with these arguments; nothing to do.", output_dir)
            return existing
    # Overwriting, or leftovers of an interrupted run (no manifest): start clean.
    # Input problems found by reading a little (empty files, a wrong --text_column), or with --on_bad_lines error
    # by reading every JSON file, stop the run here: before the old data is removed and minutes of work are spent.
    bad_lines = BadLines(args.on_bad_lines)
    if files is not None:
        files = corpus.check_local_files(files, args.text_column, bad_lines)
    remove_data_files(output_dir)

    documents = load_documents(args, files, bad_lines)
    if given_tokenizer is None:
        logger.info("Training a byte-level BPE tokenizer (vocab_size=%d).", args.vocab_size)
        # On a terminal the tokenizers library draws its own bars; in a log it is silent, so progress lines there.
        with Progress(total=min(args.tokenizer_train_documents, args.max_documents or args.tokenizer_train_documents),
                      desc="BPE training", unit="doc", disable=args.disable_tqdm or on_terminal()) as progress:
            tokenizer = train_bpe_tokenizer(CountedDocuments(documents, progress), args.vocab_size,
                                            args.tokenizer_train_documents, args.map_batch_size)
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
    expected_tokens = expected_stream_tokens(args, sources)
    if expected_tokens is not None:  # the stream, then as much again for the shards
        check_free_space(output_dir, 2 * expected_tokens * dtype.itemsize,
                         f"the token stream and shards of about {expected_tokens:,} tokens ({dtype.name})", _FIX_DISK)
    counts: dict = {}
    # Failing, it needs the stream expected (at least the part written) and as much again for the shards.
    with partial_files_removed_on_full_disk(
            output_dir, lambda: 2 * max((expected_tokens or 0) * dtype.itemsize, _file_size(token_path))):
        num_tokens, num_documents, stream_end = pack_token_stream(
            documents, tokenizer, token_path, dtype, args.max_tokens, args.map_batch_size, args.skip_documents,
            args.skip_tokens, show_progress=not args.disable_tqdm, counts=counts)
    corpus.warn_about_replacements(counts["replacement_characters"], files)
    bad_lines.report()

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
    shard_bytes = samples.nbytes
    with partial_files_removed_on_full_disk(output_dir, lambda: num_tokens * dtype.itemsize + shard_bytes):
        check_free_space(output_dir, shard_bytes, f"the shards of {num_samples:,} samples", _FIX_DISK)
        splits = write_split_shards(output_dir, samples, split_indices(num_samples, args), args.shard_size,
                                    show_progress=not args.disable_tqdm)
    del stream, samples
    os.remove(token_path)
    if eval_source is not None:
        check_eval_source_matches(args.eval_from, eval_source, tokenizer_hash(tokenizer), dtype)
        splits["eval"] = link_split(args.eval_from, eval_source, output_dir, "eval")

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
        **({"skipped_records": bad_lines.summary()} if bad_lines.count else {}),  # JSON records left out, per file
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
