"""The token shard format: writing, reading, validating (the one shard reader and writer).

A prepared data directory holds

    manifest.json            what is in the directory (written last: no manifest, no data)
    train-00000.npy, ...     int arrays of shape (num_samples, seq_len + 1)
    eval-00000.npy, ...      the held-out split, same layout
    tokenizer.json, ...      the tokenizer the tokens came from (AutoTokenizer loads the dir)

Each sample stores ``seq_len + 1`` tokens so that ``input_ids = row[:-1]`` and
``shift_labels = row[1:]`` need no neighbour sample. The trainer, benchmarks, teacher caching and
evaluation read shards here; ``trainer_ext.data.prepare`` writes them here.
"""

from __future__ import annotations

import bisect
import copy
import glob
import hashlib
import json
import logging
import os
import shutil
import time
import warnings
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer_ext.files import atomic_open, atomic_path, write_json
from trainer_ext.progress import Progress

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
SPLITS = ("train", "eval")
_REQUIRED_MANIFEST_FIELDS = ("format_version", "seq_len", "dtype", "vocab_size", "tokenizer_hash", "splits")
_FIX_REPREPARE = "re-run `hf-recurrent-prepare-data` with --overwrite for this output directory"


# ----------------------------------------------------------------------------- tokenizer identity


def tokenizer_hash(tokenizer: Any) -> str:
    """sha256 of a tokenizer's canonical ``tokenizer.json`` content.

    Accepts a transformers fast tokenizer, a ``tokenizers.Tokenizer``, or a path to a
    ``tokenizer.json`` file / a directory holding one. Canonical means: keys sorted, no
    whitespace, and without the ``truncation`` / ``padding`` sections, because transformers
    mutates those on the backend whenever it is called with ``truncation=`` or ``padding=``;
    they change how a call pads, not which ids a text maps to.
    """
    if isinstance(tokenizer, (str, os.PathLike)):
        path = os.fspath(tokenizer)
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"{path}: no tokenizer.json to hash; save the tokenizer with save_pretrained first.")
        with open(path, encoding="utf-8") as f:
            content = f.read()
    else:
        backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
        if not hasattr(backend, "to_str"):
            raise ValueError(
                f"tokenizer_hash: {type(tokenizer).__name__} has no tokenizers backend "
                "(tokenizer.json); load it with AutoTokenizer.from_pretrained(..., use_fast=True)."
            )
        content = backend.to_str()
    data = json.loads(content)
    data.pop("truncation", None)
    data.pop("padding", None)
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id below ``vocab_size``: of token shards and of the teacher
    cache's top-k ids.

    uint16 halves disk and page-cache use for vocabularies up to 65,536 (ids 0..65,535);
    anything larger (e.g. 100k-250k multilingual vocabularies) needs uint32.
    """
    if vocab_size <= 0:
        raise ValueError(f"vocab_size must be positive, got {vocab_size}.")
    return np.dtype(np.uint16) if vocab_size <= 2**16 else np.dtype(np.uint32)


# ----------------------------------------------------------------------------- writing


def shard_name(split: str, index: int) -> str:
    return f"{split}-{index:05d}.npy"


def file_sha256(path: str, chunk_bytes: int = 1 << 22) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(chunk_bytes):
            digest.update(chunk)
    return digest.hexdigest()


def write_shard(path: str, samples: np.ndarray) -> dict:
    """Write one shard atomically and return its manifest entry.

    The array goes to a hidden ``.tmp`` file that is fsynced and then renamed, so a crash
    leaves either the previous file or the complete new one, never a half-written shard
    under the final name.
    """
    assert samples.ndim == 2 and samples.shape[0] > 0, samples.shape
    name = os.path.basename(path)
    with atomic_open(path, "wb") as f:
        np.save(f, np.ascontiguousarray(samples))
    return {
        "file": name,
        "num_samples": int(samples.shape[0]),
        "size_bytes": os.path.getsize(path),
        "sha256": file_sha256(path),
        "max_token_id": int(samples.max()),
    }


def write_split_shards(output_dir: str, samples: np.ndarray, indices: dict[str, np.ndarray],
                       shard_size: int, show_progress: bool = True) -> dict:
    """Write ``samples[indices[split]]`` of every split as shards of ``shard_size`` samples; return the manifest's
    ``splits`` entry."""
    splits = {}
    num_shards = sum(-(-len(idx) // shard_size) for idx in indices.values())
    with Progress(total=num_shards, desc="Writing shards", unit="shard", disable=not show_progress) as progress:
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


def link_split(source_dir: str, source: dict, output_dir: str, split: str) -> dict:
    """Place ``source_dir``'s shards of ``split`` in ``output_dir`` (hard links where possible, else copies; each
    lands under its final name by rename) and return the split's manifest entry (``source`` is its manifest)."""
    entry = copy.deepcopy(source["splits"][split])
    for shard in entry["shards"]:
        with atomic_path(os.path.join(output_dir, shard["file"])) as tmp_path:
            try:
                os.link(os.path.join(source_dir, shard["file"]), tmp_path)  # shards are never modified in place
            except OSError:
                shutil.copyfile(os.path.join(source_dir, shard["file"]), tmp_path)
    return entry


def write_manifest(data_dir: str, manifest: dict) -> str:
    """Write ``manifest.json`` atomically (same tmp + rename as the shards)."""
    return write_json(os.path.join(data_dir, MANIFEST_NAME), manifest)


def remove_data_files(data_dir: str) -> None:
    """Delete the manifest, the shards and the temp files of an earlier run (manifest first, so no reader sees a
    mix)."""
    manifest_path = os.path.join(data_dir, MANIFEST_NAME)
    if os.path.exists(manifest_path):
        os.remove(manifest_path)
    for pattern in [f"{split}-*.npy" for split in SPLITS] + [".*.tmp"]:
        for path in glob.glob(os.path.join(data_dir, pattern)):
            os.remove(path)


# ----------------------------------------------------------------------------- reading + validation


def load_manifest(path: str, required: tuple[str, ...], format_version: int | tuple[int, ...], not_found: str,
                  fix: str) -> dict:
    """Read a JSON manifest and check its fields and format version; every error names the file and the fix."""
    if not os.path.isfile(path):
        raise ValueError(f"{path}: not found; {not_found}")
    try:
        with open(path, encoding="utf-8") as f:
            manifest = json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not valid JSON ({err}); {fix}.") from err
    missing = [k for k in required if k not in manifest]
    if missing:
        raise ValueError(f"{path}: missing fields {missing}; {fix}.")
    versions = format_version if isinstance(format_version, tuple) else (format_version,)
    if manifest["format_version"] not in versions:
        raise ValueError(
            f"{path}: format_version {manifest['format_version']} but this code reads "
            f"version {' or '.join(map(str, versions))}; {fix}."
        )
    return manifest


def read_manifest(data_dir: str) -> dict:
    """Load and sanity-check ``manifest.json``; raise ValueError naming the file and the fix."""
    path = os.path.join(os.fspath(data_dir), MANIFEST_NAME)
    not_found = ("a data directory is complete only once prepare_data has written its manifest; run "
                 f"`hf-recurrent-prepare-data --output_dir {data_dir}`.")
    manifest = load_manifest(path, _REQUIRED_MANIFEST_FIELDS, FORMAT_VERSION, not_found, _FIX_REPREPARE)
    if manifest["dtype"] not in ("uint16", "uint32"):
        raise ValueError(f"{path}: dtype '{manifest['dtype']}' is not uint16/uint32; {_FIX_REPREPARE}.")
    return manifest


def read_npy_header(path: str) -> tuple[tuple[int, ...], np.dtype, bool, int]:
    """(shape, dtype, fortran_order, data offset) from an .npy header, without reading data."""
    with open(path, "rb") as f:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran_order, dtype = np.lib.format.read_array_header_1_0(f)
        elif version in ((2, 0), (3, 0)):
            shape, fortran_order, dtype = np.lib.format.read_array_header_2_0(f)
        else:
            raise ValueError(f"unsupported .npy version {version}")
        return shape, dtype, fortran_order, f.tell()


def validate_shard(data_dir: str, entry: dict, manifest: dict, model_vocab_size: int | None = None) -> None:
    """Check one shard against its manifest entry; ValueError naming the file and the fix.

    Catches what otherwise surfaces mid-run as a crash or, worse, silent garbage: empty or
    truncated files (interrupted copy), a foreign header, a shape/dtype that does not match
    the manifest, and token ids the model's embedding cannot index.
    """
    path = os.path.join(data_dir, entry["file"])
    sample_len = manifest["seq_len"] + 1
    if not os.path.isfile(path):
        raise ValueError(f"{path}: listed in {MANIFEST_NAME} but missing; {_FIX_REPREPARE}.")
    size = os.path.getsize(path)
    if size == 0:
        raise ValueError(f"{path}: empty file (0 bytes), probably an interrupted copy; {_FIX_REPREPARE}.")
    try:
        shape, dtype, fortran_order, offset = read_npy_header(path)
    except ValueError as err:
        raise ValueError(f"{path}: not a valid .npy file ({err}); {_FIX_REPREPARE}.") from err
    expected_shape = (entry["num_samples"], sample_len)
    if tuple(shape) != expected_shape or fortran_order:
        raise ValueError(
            f"{path}: shape {tuple(shape)} but {MANIFEST_NAME} says {expected_shape} "
            f"(num_samples, seq_len + 1); {_FIX_REPREPARE}."
        )
    if dtype != np.dtype(manifest["dtype"]):
        raise ValueError(f"{path}: dtype {dtype} but {MANIFEST_NAME} says {manifest['dtype']}; {_FIX_REPREPARE}.")
    expected_size = offset + expected_shape[0] * expected_shape[1] * dtype.itemsize
    if size != expected_size or size != entry["size_bytes"]:
        raise ValueError(
            f"{path}: {size} bytes but the header and {MANIFEST_NAME} imply {expected_size} "
            f"(recorded {entry['size_bytes']}); the file is truncated or corrupt; {_FIX_REPREPARE}."
        )
    if model_vocab_size is not None:
        # Scan the real data, not the manifest's max_token_id: the point is to catch data
        # the manifest does not describe. One sequential pass; it also warms the page cache.
        max_id = int(np.load(path, mmap_mode="r").max())
        if max_id >= manifest["vocab_size"]:
            # Past the tokenizer's own vocabulary: no model size fixes that (a larger, padded embedding would
            # train on it silently); the bytes on disk changed.
            raise ValueError(
                f"{path}: holds token id {max_id}, past the tokenizer's vocabulary ({manifest['vocab_size']} ids, "
                f"largest id written {entry['max_token_id']}); the shard is corrupt (a damaged "
                f"copy or disk). Copy it again from where it was prepared, or {_FIX_REPREPARE}."
            )
        if max_id >= model_vocab_size:
            raise ValueError(
                f"{path}: holds token id {max_id} but the model's vocab_size is {model_vocab_size}; "
                f"set the model config's vocab_size to at least {manifest['vocab_size']} "
                "(the tokenizer's size), or re-prepare the data with the model's tokenizer."
            )


# Shards whose sha256 matched in this process, keyed by (path, size, mtime, recorded sha256): the training and
# evaluation datasets, and each cycle of a comparison, open the same files again; a changed file is hashed again.
_VERIFIED: set[tuple] = set()


def check_file_sha256(path: str, expected: str, manifest_path: str, fix: str) -> int:
    """ValueError naming `path` unless its sha256 is `expected` (what `manifest_path` records); `fix` ends the message.
    Once per process for an unchanged file; returns the bytes hashed now (0 when it was checked before)."""
    stat = os.stat(path)
    key = (os.path.realpath(path), stat.st_size, stat.st_mtime_ns, expected)
    if key in _VERIFIED:
        return 0
    if file_sha256(path) != expected:
        raise ValueError(
            f"{path}: sha256 differs from {manifest_path}; the file is corrupt (a damaged copy or disk, or it was "
            f"changed after it was written). {fix}."
        )
    _VERIFIED.add(key)
    return stat.st_size


def verify_shard_checksums(data_dir: str, shards: list[dict], split: str) -> None:
    """Hash every shard of `split` and compare it with the manifest's sha256; ValueError naming the corrupt file.

    A flipped byte that keeps ids in range passes every other check and trains on garbage. Hashing reads each file
    once (0.5-2 GB/s: a few seconds per billion uint16 tokens, which training reads anyway); the log line says it ran
    and what it cost, so that a user with a huge corpus knows what `verify_checksums=False` would save.
    """
    start, hashed_bytes, hashed = time.perf_counter(), 0, 0
    manifest_path = os.path.join(data_dir, MANIFEST_NAME)
    for entry in shards:
        size = check_file_sha256(os.path.join(data_dir, entry["file"]), entry["sha256"], manifest_path,
                                 f"Copy it again from where it was prepared, or {_FIX_REPREPARE}")
        hashed_bytes += size
        hashed += size > 0
    if hashed:
        logger.info("%s: sha256 of %d %s shard(s) (%.1f MB) matches %s, checked in %.2f s (verify_checksums=False "
                    "skips this)", data_dir, hashed, split, hashed_bytes / 1e6, MANIFEST_NAME,
                    time.perf_counter() - start)


def validate_data_dir(
    data_dir: str,
    split: str = "train",
    expected_tokenizer_hash: str | None = None,
    model_vocab_size: int | None = None,
    verify_checksums: bool = True,
) -> dict:
    """Validate the manifest and every shard of ``split`` before training; return the manifest.

    ``verify_checksums`` (default on) also compares each shard's sha256 with the manifest, once per process and
    file; turn it off only for corpora too large to read once before training."""
    data_dir = os.fspath(data_dir)
    manifest = read_manifest(data_dir)
    manifest_path = os.path.join(data_dir, MANIFEST_NAME)
    if split not in manifest["splits"]:
        raise ValueError(
            f"{manifest_path}: no split '{split}' (has {sorted(manifest['splits'])}); "
            f"use one of those or {_FIX_REPREPARE}."
        )
    if expected_tokenizer_hash is not None and manifest["tokenizer_hash"] != expected_tokenizer_hash:
        raise ValueError(
            f"{manifest_path}: tokenizer_hash {manifest['tokenizer_hash'][:12]}... does not match the "
            f"expected tokenizer {expected_tokenizer_hash[:12]}...; the shards were made with another "
            f"tokenizer. Use the tokenizer saved in {data_dir} (AutoTokenizer.from_pretrained), or "
            "re-prepare the data with --tokenizer set to yours."
        )
    shards = manifest["splits"][split]["shards"]
    if not shards or sum(s["num_samples"] for s in shards) == 0:
        raise ValueError(
            f"{manifest_path}: split '{split}' has no samples; add text, lower --seq_len, or "
            "(for eval) raise --eval_samples / --eval_fraction, then re-prepare."
        )
    for entry in shards:
        validate_shard(data_dir, entry, manifest, model_vocab_size=model_vocab_size)
    if verify_checksums:
        verify_shard_checksums(data_dir, shards, split)
    return manifest


class ShardedTokenDataset(Dataset):
    """Fixed-length samples from a prepared data directory.

    ``ds[i]`` is ``{"input_ids": LongTensor(seq_len), "shift_labels": LongTensor(seq_len)}``: the
    targets already aligned with the positions (HF's name for shifted labels; ``model(**batch)`` does
    not mistake them for unshifted ``labels``), so ``default_data_collator`` stacks a batch and the model
    shifts nothing. Each shard is opened once with ``np.load(mmap_mode="r")`` and wrapped by
    one ``torch.from_numpy``; a sample is a row view of that tensor converted to int64, so
    there is no per-sample ``torch.tensor`` and no per-sample file open.

    All validation (manifest, tokenizer hash, shard headers and sizes, max token id vs the
    model's vocabulary, and the shards' sha256 unless ``verify_checksums=False``) runs in
    ``__init__``, before any training step.
    """

    def __init__(
        self,
        data_dir: str,
        split: str = "train",
        expected_tokenizer_hash: str | None = None,
        model_vocab_size: int | None = None,
        verify_checksums: bool = True,
    ):
        self.data_dir = os.fspath(data_dir)
        self.split = split
        self.manifest = validate_data_dir(
            self.data_dir,
            split=split,
            expected_tokenizer_hash=expected_tokenizer_hash,
            model_vocab_size=model_vocab_size,
            verify_checksums=verify_checksums,
        )
        self.seq_len: int = self.manifest["seq_len"]
        self.vocab_size: int = self.manifest["vocab_size"]
        self.tokenizer_hash: str = self.manifest["tokenizer_hash"]
        shards = self.manifest["splits"][split]["shards"]
        self._paths = [os.path.join(self.data_dir, s["file"]) for s in shards]
        self._starts: list[int] = []  # first global index of each shard, for bisect
        total = 0
        for s in shards:
            self._starts.append(total)
            total += s["num_samples"]
        self._len = total
        self._tensors: list[torch.Tensor | None] = [None] * len(shards)

    @property
    def num_tokens(self) -> int:
        """Training tokens (input positions) in this split."""
        return self._len * self.seq_len

    def __len__(self) -> int:
        return self._len

    def _shard(self, index: int) -> torch.Tensor:
        tensor = self._tensors[index]
        if tensor is None:
            array = np.load(self._paths[index], mmap_mode="r")
            # The memmap is read-only and torch warns that it cannot mark the tensor so;
            # nothing here writes to it.
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*not writable.*")
                tensor = torch.from_numpy(array)
            self._tensors[index] = tensor
        return tensor

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError(f"index {index} out of range for {self._len} samples")
        shard = bisect.bisect_right(self._starts, index) - 1
        row = self._shard(shard)[index - self._starts[shard]].to(torch.long)  # (seq_len + 1,)
        return {"input_ids": row[:-1], "shift_labels": row[1:]}

    def __getstate__(self) -> dict:
        # Pickling a memmap-backed tensor copies the whole shard; DataLoader workers started
        # with spawn (Windows, macOS, some WSL setups) would each get a full copy. Reopen lazily.
        state = self.__dict__.copy()
        state["_tensors"] = [None] * len(self._paths)
        return state

