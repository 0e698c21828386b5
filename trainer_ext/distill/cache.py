"""The offline teacher cache format: writing and reading its shards and manifest, validation, and the dataset that
serves it to the trainer (``trainer_ext.distill.caching`` runs the teacher that fills it).

A teacher cache directory holds, next to nothing else,

    teacher_manifest.json             what the cache was built from (written after every finished shard)
    train-00000.topk_ids.npy          (num_samples, seq_len, ids width) of the codec
    train-00000.topk_logprobs.npy     (num_samples, seq_len, log-probs width) float16
    eval-00000.topk_ids.npy, ...      one pair per token shard of each cached split

What a position's row holds is the codec's (``cache_codec.py``): in format version 2 by default the compact codec
(ids bit-packed at ceil(log2 V) bits, a few exact log-probs, a fit of the others, the tail mass: 148 bytes per
token at k = 64 and V = 99,520), or the fp16 layout of version 1 (k ids as uint16 / uint32 and k fp16 log-probs:
256 / 384 bytes per token at k = 64), which version 1 caches keep and are read as.

Shard ``train-00000`` of the cache belongs to token shard ``train-00000.npy`` of the data directory:
same stem, same sample count, same sample order, and position t of a sample holds the teacher's
prediction for ``shift_labels[t]`` (the token after ``input_ids[t]``). Log-probs are over the real
vocabulary (the tokenizer's size; head padding never appears), so the teacher's mass outside the
top k, the tail bucket of ``TopKTeacher``, is ``1 - sum(exp(logprobs))``.

The manifest ties the cache to its token shards (the data's tokenizer hash, seq_len, and the
sha256 / size of every token shard it was computed from) and to the teacher (name or path, revision,
tokenizer hash, k, num_steps), and (version 2) records the sha256 of every cache file. ``validate_teacher_cache``
checks all of it before training, so a cache built from other shards or another tokenizer, or a cache file
changed after it was written, is refused instead of silently teaching garbage; each sample read is range-checked
(ids below the vocabulary, log-probs finite and <= 0, probabilities adding up to at most one).
"""

from __future__ import annotations

import bisect
import glob
import logging
import math
import os
import warnings
from collections.abc import Iterable

import numpy as np
import torch
from torch.utils.data import Dataset

from trainer_ext.data.shards import (
    MANIFEST_NAME,
    ShardedTokenDataset,
    check_file_sha256,
    file_sha256,
    load_manifest,
    read_manifest,
    read_npy_header,
)
from trainer_ext.distill.cache_codec import CompactCodec, Fp16Codec, codec_from_manifest
from trainer_ext.files import atomic_path, write_json

logger = logging.getLogger(__name__)

CACHE_FORMAT_VERSION = 2  # version 1: the fp16 layout, no cache-file checksums; read as such
READ_FORMAT_VERSIONS = (1, 2)
TEACHER_MANIFEST_NAME = "teacher_manifest.json"
IDS_SUFFIX = ".topk_ids.npy"
LOGPROBS_SUFFIX = ".topk_logprobs.npy"
_FIX_RECACHE = "re-run `hf-recurrent-cache-teacher` for this cache directory"
# Slack of the range check on the probabilities' sum: fp16 log-probs of a near-certain prediction round up.
_MASS_SLACK = 1e-2


def cache_file_names(token_file: str) -> tuple[str, str]:
    """(ids file, logprobs file) of the cache shard aligned with token shard ``token_file``."""
    stem = token_file[: -len(".npy")] if token_file.endswith(".npy") else token_file
    return stem + IDS_SUFFIX, stem + LOGPROBS_SUFFIX


# ----------------------------------------------------------------------------- manifest


def read_teacher_manifest(cache_dir: str) -> dict:
    path = os.path.join(os.fspath(cache_dir), TEACHER_MANIFEST_NAME)
    not_found = (f"{cache_dir} is not a teacher cache. Build one with `hf-recurrent-cache-teacher "
                 f"--output_dir {cache_dir} --data_dir ... --teacher_model_name_or_path ...`.")
    required = ("format_version", "topk", "ids_dtype", "data", "teacher", "splits")
    return load_manifest(path, required, READ_FORMAT_VERSIONS, not_found, f"{_FIX_RECACHE} with --overwrite")


def check_cache_divergence(manifest: dict, cache_dir: str, divergence: str) -> None:
    """ValueError for a divergence the cache cannot carry: reverse KL weighs the student's mass by the teacher's
    log-probability of each id, which a sampled cache lacks for every id not drawn."""
    if divergence == "reverse_kl" and manifest.get("codec", {}).get("name") == "sampled":
        raise ValueError(f"--teacher_cache_dir {cache_dir} is a sampled cache (the teacher's probabilities of the drawn "
                         "ids only), which reverse KL cannot use: pass --distill_divergence forward_kl or jsd, or "
                         "cache the teacher with --teacher_cache_mode topk.")


def write_teacher_manifest(cache_dir: str, manifest: dict) -> str:
    """Atomic (tmp + fsync + rename): a crash leaves the previous manifest or the new one."""
    return write_json(os.path.join(cache_dir, TEACHER_MANIFEST_NAME), manifest)


def record_shard(manifest: dict, split: str, entry: dict, token_order: list[str]) -> None:
    """Put a finished cache shard's ``entry`` into ``manifest`` (replacing an older one), in token-shard order."""
    shards = [e for e in manifest["splits"].setdefault(split, {"shards": []})["shards"]
              if e["token_file"] != entry["token_file"]]
    shards.append(entry)
    shards.sort(key=lambda e: token_order.index(e["token_file"]) if e["token_file"] in token_order else -1)
    manifest["splits"][split]["shards"] = shards


# ----------------------------------------------------------------------------- writing


def write_cache_shard(cache_dir: str, token_file: str, num_samples: int, seq_len: int,
                      codec: CompactCodec | Fp16Codec, batches: Iterable[tuple[torch.Tensor, torch.Tensor]]) -> dict:
    """Write the cache shard of token shard ``token_file``; return the file part of its manifest entry.

    ``batches`` yields (ids, log-probs) tensors of consecutive samples, (batch, seq_len, k) each, until
    ``num_samples`` are written. They are encoded by ``codec`` on their device and go straight into memory-mapped
    temp files, which are fsynced, hashed and renamed into place only once complete.
    """
    ids_file, logprobs_file = cache_file_names(token_file)
    ids_path, logprobs_path = (os.path.join(cache_dir, name) for name in (ids_file, logprobs_file))
    with atomic_path(ids_path) as ids_tmp, atomic_path(logprobs_path) as logprobs_tmp:
        ids_out = np.lib.format.open_memmap(ids_tmp, mode="w+", dtype=codec.ids_dtype,
                                            shape=(num_samples, seq_len, codec.ids_width))
        logprobs_out = np.lib.format.open_memmap(logprobs_tmp, mode="w+", dtype=codec.logprobs_dtype,
                                                 shape=(num_samples, seq_len, codec.logprobs_width))
        start = 0
        for ids, logprobs in batches:
            ids_out[start:start + len(ids)], logprobs_out[start:start + len(ids)] = codec.encode(ids, logprobs)
            start += len(ids)
        assert start == num_samples, (start, num_samples)
        ids_out.flush()
        logprobs_out.flush()
        del ids_out, logprobs_out  # no memmap refers to the files once they are renamed
        sha256 = {"ids_sha256": file_sha256(ids_tmp), "logprobs_sha256": file_sha256(logprobs_tmp)}
    return {
        "ids_file": ids_file,
        "logprobs_file": logprobs_file,
        "ids_size_bytes": os.path.getsize(ids_path),
        "logprobs_size_bytes": os.path.getsize(logprobs_path),
        **sha256,
    }


def remove_cache_files(cache_dir: str) -> None:
    """Delete the manifest, the shards and the temp files of a cache."""
    # Manifest first, so no reader ever sees it pointing at deleted shards.
    for pattern in (TEACHER_MANIFEST_NAME, "*" + IDS_SUFFIX, "*" + LOGPROBS_SUFFIX, ".*.tmp"):
        for path in glob.glob(os.path.join(cache_dir, pattern)):
            os.remove(path)


def drop_stale_shards(cache_dir: str, token_manifest: dict, manifest: dict) -> None:
    """Forget (and delete) cache shards of token shards the data manifest no longer lists."""
    for split, info in manifest["splits"].items():
        current = {e["file"] for e in token_manifest["splits"].get(split, {}).get("shards", [])}
        stale = [e for e in info["shards"] if e["token_file"] not in current]
        if stale:
            logger.warning("Dropping cache shards of token shards that no longer exist: %s",
                           [e["token_file"] for e in stale])
            info["shards"] = [e for e in info["shards"] if e["token_file"] in current]
            write_teacher_manifest(cache_dir, manifest)  # before deleting: never point at missing files
            for entry in stale:
                for name in (entry["ids_file"], entry["logprobs_file"]):
                    path = os.path.join(cache_dir, name)
                    if os.path.exists(path):
                        os.remove(path)


# ----------------------------------------------------------------------------- validation


def check_cache_shard(cache_dir: str, entry: dict, seq_len: int, codec: CompactCodec | Fp16Codec,
                      verify_checksums: bool = False) -> None:
    """ValueError unless both files of one cache shard exist whole, with the codec's shape and dtype, and (with
    ``verify_checksums``, where the manifest records them) the sha256 they were written with."""
    for name, dtype, width, key in ((entry["ids_file"], codec.ids_dtype, codec.ids_width, "ids_sha256"),
                                    (entry["logprobs_file"], codec.logprobs_dtype, codec.logprobs_width,
                                     "logprobs_sha256")):
        shape = (entry["num_samples"], seq_len, width)
        path = os.path.join(cache_dir, name)
        if not os.path.isfile(path):
            raise ValueError(f"{path}: listed in {TEACHER_MANIFEST_NAME} but missing; {_FIX_RECACHE}.")
        try:
            file_shape, file_dtype, fortran_order, offset = read_npy_header(path)
        except ValueError as err:
            raise ValueError(f"{path}: not a valid .npy file ({err}); {_FIX_RECACHE}.") from err
        if tuple(file_shape) != shape or file_dtype != dtype or fortran_order:
            raise ValueError(
                f"{path}: {file_dtype} {tuple(file_shape)} but {TEACHER_MANIFEST_NAME} implies {dtype} {shape} "
                f"(num_samples, seq_len, {codec.name} codec width); {_FIX_RECACHE}."
            )
        expected = offset + int(np.prod(shape)) * dtype.itemsize
        if os.path.getsize(path) != expected:
            raise ValueError(
                f"{path}: {os.path.getsize(path)} bytes, expected {expected}; the file is truncated or corrupt; "
                f"{_FIX_RECACHE} (it recomputes only the damaged shards)."
            )
        if verify_checksums and key in entry:
            check_file_sha256(path, entry[key], os.path.join(cache_dir, TEACHER_MANIFEST_NAME),
                              f"{_FIX_RECACHE}: it recomputes the shards whose files do not match")


def check_token_shard_match(data_dir: str, token_entry: dict, cache_entry: dict) -> None:
    """ValueError unless the cache shard was computed from exactly this token shard."""
    token_path = os.path.join(data_dir, token_entry["file"])
    recorded, current = cache_entry["token_sha256"], token_entry["sha256"]
    if recorded != current or cache_entry["num_samples"] != token_entry["num_samples"]:
        raise ValueError(
            f"{token_path}: the teacher cache shard {cache_entry['ids_file']} was computed from a token shard with "
            f"sha256 {recorded} ({cache_entry['num_samples']} samples), but {os.path.join(data_dir, MANIFEST_NAME)} "
            f"lists sha256 {current} ({token_entry['num_samples']} samples); the data was re-prepared after "
            f"caching. {_FIX_RECACHE} against this data directory."
        )
    if os.path.isfile(token_path) and os.path.getsize(token_path) != cache_entry["token_size_bytes"]:
        raise ValueError(
            f"{token_path}: {os.path.getsize(token_path)} bytes on disk, but the teacher cache was computed from "
            f"{cache_entry['token_size_bytes']} bytes; the token shard changed. {_FIX_RECACHE}."
        )


def missing_shards(cache_dir: str, data_dir: str, token_manifest: dict, manifest: dict,
                   splits: list[str]) -> list[tuple[str, dict]]:
    """(split, token shard entry) of every token shard of ``splits`` without a whole, current cache shard."""
    missing = []
    for split in splits:
        recorded = {e["token_file"]: e for e in manifest["splits"].get(split, {}).get("shards", [])}
        for token_entry in token_manifest["splits"][split]["shards"]:
            entry = recorded.get(token_entry["file"])
            if entry is not None:
                try:
                    check_token_shard_match(data_dir, token_entry, entry)
                    check_cache_shard(cache_dir, entry, token_manifest["seq_len"], codec_from_manifest(manifest),
                                      verify_checksums=True)
                    continue
                except ValueError as err:
                    logger.warning("Recomputing %s: %s", token_entry["file"], err)
            missing.append((split, token_entry))
    return missing


def validate_teacher_cache(
    cache_dir: str, data_dir: str, splits: list[str] | None = None, verify_checksums: bool = False
) -> dict:
    """Check that ``cache_dir`` is a complete teacher cache of the token shards in ``data_dir``.

    Raises ValueError, naming both hashes or files, when the cache was built with another tokenizer,
    another seq_len, or from other token shards (a re-prepared data directory), and when a cache
    shard is missing, truncated or of the wrong shape. ``splits`` defaults to every split the cache
    holds. ``verify_checksums`` also re-hashes the token shards and the cache files on disk (once per process; about
    a second per GB).
    Returns the teacher manifest with each split's shards in token-manifest order.
    """
    cache_dir, data_dir = os.fspath(cache_dir), os.fspath(data_dir)
    manifest = read_teacher_manifest(cache_dir)
    token_manifest = read_manifest(data_dir)
    cache_manifest_path = os.path.join(cache_dir, TEACHER_MANIFEST_NAME)
    data_manifest_path = os.path.join(data_dir, MANIFEST_NAME)
    cached_hash, data_hash = manifest["data"]["tokenizer_hash"], token_manifest["tokenizer_hash"]
    if cached_hash != data_hash:
        raise ValueError(
            f"{cache_manifest_path}: the teacher cache was built for tokenizer hash {cached_hash}, but "
            f"{data_manifest_path} has tokenizer hash {data_hash}; the cache belongs to other data. "
            f"{_FIX_RECACHE} with --data_dir {data_dir}."
        )
    if manifest["data"]["seq_len"] != token_manifest["seq_len"]:
        raise ValueError(
            f"{cache_manifest_path}: seq_len {manifest['data']['seq_len']} but {data_manifest_path} has seq_len "
            f"{token_manifest['seq_len']}; {_FIX_RECACHE} with --data_dir {data_dir}."
        )
    splits = list(manifest["splits"]) if splits is None else list(splits)
    codec = codec_from_manifest(manifest)
    for split in splits:
        if split not in token_manifest["splits"]:
            raise ValueError(f"{data_manifest_path}: no split {split!r} (has {sorted(token_manifest['splits'])}).")
        cached = {e["token_file"]: e for e in manifest["splits"].get(split, {}).get("shards", [])}
        aligned = []
        for token_entry in token_manifest["splits"][split]["shards"]:
            cache_entry = cached.pop(token_entry["file"], None)
            if cache_entry is None:
                raise ValueError(
                    f"{cache_manifest_path}: no teacher outputs for token shard {token_entry['file']} (split "
                    f"{split!r}); the cache is incomplete. {_FIX_RECACHE} to finish it (finished shards are kept)."
                )
            check_token_shard_match(data_dir, token_entry, cache_entry)
            check_cache_shard(cache_dir, cache_entry, token_manifest["seq_len"], codec, verify_checksums)
            if verify_checksums:
                check_file_sha256(os.path.join(data_dir, token_entry["file"]), cache_entry["token_sha256"],
                                  cache_manifest_path, f"the teacher cache was computed from other data; "
                                  f"{_FIX_RECACHE}")
            aligned.append(cache_entry)
        if cached:
            raise ValueError(
                f"{cache_manifest_path}: holds shards {sorted(cached)} that {data_manifest_path} does not list; "
                f"the cache was built from other token shards. {_FIX_RECACHE} with --overwrite."
            )
        manifest["splits"][split]["shards"] = aligned
    return manifest


# ----------------------------------------------------------------------------- dataset


class TeacherCacheDataset(Dataset):
    """A ``ShardedTokenDataset`` plus the cached teacher top-k of each sample.

    ``ds[i]`` is the token dataset's item with ``teacher_topk_ids`` (int64, (seq_len, k)) and
    ``teacher_topk_logprobs`` (float32, (seq_len, k)) added; RecurrentTrainer distills against
    batches carrying those keys. The cache is validated against the token shards here, before
    training, its files' sha256 too (``verify_checksums``, on by default as for the token shards). Like the token
    reader, each cache file is opened once with ``np.load(mmap_mode="r")`` and wrapped by one ``torch.from_numpy``;
    a sample is a row of that tensor, decoded by the cache's codec and range-checked.
    """

    def __init__(self, token_dataset: ShardedTokenDataset, cache_dir: str, verify_checksums: bool = True):
        if not isinstance(token_dataset, ShardedTokenDataset):
            raise ValueError(
                f"TeacherCacheDataset wraps a ShardedTokenDataset (whose shards the cache is aligned with), got "
                f"{type(token_dataset).__name__}; wrap first, then take a Subset of the result."
            )
        self.token_dataset = token_dataset
        self.cache_dir = os.fspath(cache_dir)
        self.manifest = validate_teacher_cache(
            self.cache_dir, token_dataset.data_dir, splits=[token_dataset.split], verify_checksums=verify_checksums
        )
        self.topk: int = self.manifest["topk"]
        self.codec = codec_from_manifest(self.manifest)
        shards = self.manifest["splits"][token_dataset.split]["shards"]
        self._paths = [
            (os.path.join(self.cache_dir, s["ids_file"]), os.path.join(self.cache_dir, s["logprobs_file"]))
            for s in shards
        ]
        self._starts: list[int] = []
        total = 0
        for s in shards:
            self._starts.append(total)
            total += s["num_samples"]
        assert total == len(token_dataset), (total, len(token_dataset))
        self._tensors: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * len(shards)

    @property
    def seq_len(self) -> int:
        return self.token_dataset.seq_len

    @property
    def num_tokens(self) -> int:
        return self.token_dataset.num_tokens

    def __len__(self) -> int:
        return len(self.token_dataset)

    def _shard(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        tensors = self._tensors[index]
        if tensors is None:
            with warnings.catch_warnings():
                # Read-only memmaps; torch warns it cannot mark the tensors so. Nothing writes to them.
                warnings.filterwarnings("ignore", message=".*not writable.*")
                tensors = tuple(torch.from_numpy(np.load(path, mmap_mode="r")) for path in self._paths[index])
            self._tensors[index] = tensors
        return tensors

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        item = dict(self.token_dataset[index])  # also checks the range
        if index < 0:
            index += len(self)
        shard = bisect.bisect_right(self._starts, index) - 1
        ids, logprobs = self._shard(shard)
        row = index - self._starts[shard]
        ids, logprobs = self.codec.decode(ids[row], logprobs[row])  # (seq_len, k) each
        self._check_range(ids, logprobs, shard, row)
        item["teacher_topk_ids"] = ids
        item["teacher_topk_logprobs"] = logprobs
        return item

    def _check_range(self, ids: torch.Tensor, logprobs: torch.Tensor, shard: int, row: int) -> None:
        """ValueError naming the shard's files unless the ids are below the vocabulary and the log-probs finite,
        <= 0 and of probabilities adding up to at most one: what a teacher can have written. The sha256 check
        before training catches files changed since; this catches a writer that went wrong."""
        vocab_size = self.manifest["data"]["vocab_size"]
        problem = None
        if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
            problem = f"ids outside [0, {vocab_size}) (the vocabulary): {int(ids.min())} .. {int(ids.max())}"
        elif not bool(torch.isfinite(logprobs).all()):
            problem = "non-finite log-probs"
        elif float(logprobs.max()) > 0 or float(torch.logsumexp(logprobs, -1).max()) > math.log1p(_MASS_SLACK):
            problem = f"log-probs above 0 or probabilities adding up to more than one (largest {float(logprobs.max()):.3f})"
        if problem is not None:
            ids_path, logprobs_path = self._paths[shard]
            raise ValueError(
                f"{ids_path} / {logprobs_path}, sample {row}: {problem}; the cache shard is corrupt. Delete these "
                f"two files and {_FIX_RECACHE}: it recomputes only the missing shards."
            )

    def __getstate__(self) -> dict:
        # Pickling memmap-backed tensors would copy whole shards into every DataLoader worker; reopen lazily.
        state = self.__dict__.copy()
        state["_tensors"] = [None] * len(self._paths)
        return state
