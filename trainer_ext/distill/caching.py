"""Run a teacher once over prepared token shards and cache its top-k log-probs for offline distillation.

The teacher is any causal LM that ``AutoModelForCausalLM`` loads: our recurrent-depth checkpoints load as they are
(``num_steps`` sets their depth); a model whose code lives in its repository needs ``trust_remote_code``. It must
come with the data's tokenizer: a different tokenizer hash is refused before any work. Its head may be padded past
the tokenizer size; only the first ``len(tokenizer)`` logits count.

Per position it stores the top-k token ids and their temperature-1 log-probs, aligned 1:1 with the token shards
(format and ``teacher_manifest.json``: trainer_ext.distill.cache; the bytes of a position: cache_codec.py). Cost with
the default compact codec: ceil(k * ceil(log2 V) / 8) + 12 bytes per token, 148 at k = 64 and V = 99,520 (the fp16
layout, ``--cache_format fp16``: k * (2 + 2) or k * (4 + 2) above V = 65,536, 384 there). ``--teacher_cache_mode
sampled`` stores k draws from the teacher's distribution instead (their distinct ids and counts, `teacher_sampled`):
a top-k target leaves the tail's shape out and is biased towards the head, the draws' empirical distribution is an
unbiased estimate of the teacher's ("Sparse Logit Sampling", ACL 2025); 145 bytes per token at k = 50.

Memory: the teacher's final hidden states are computed for a batch, then its head is applied to
``position_chunk_size`` positions at a time, so a (batch, seq_len, vocab) fp32 logit tensor of a large vocabulary is
never built. Outputs go straight into memory-mapped files, not RAM.

Resuming: each shard is written to hidden temp files, fsynced, renamed, and only then recorded in the manifest. A
rerun with the same arguments skips every recorded shard whose files are whole and whose token shard is unchanged,
and computes the rest; other arguments are refused unless ``overwrite``.
"""

from __future__ import annotations

import glob
import inspect
import logging
import os
import time
import zlib
from dataclasses import dataclass, field

import numpy as np
import torch

from trainer_ext.checkpoints import load_tokenizer
from trainer_ext.data.shards import SPLITS, file_sha256, tokenizer_hash, validate_data_dir
from trainer_ext.devices import resolve_device, resolve_dtype
from trainer_ext.distill.cache import (
    CACHE_FORMAT_VERSION,
    TEACHER_MANIFEST_NAME,
    drop_stale_shards,
    missing_shards,
    read_teacher_manifest,
    record_shard,
    remove_cache_files,
    write_cache_shard,
    write_teacher_manifest,
)
from trainer_ext.distill.cache_codec import ABSENT_LOGPROB, CompactCodec, Fp16Codec, SampledCodec
from trainer_ext.distill.losses import teacher_topk
from trainer_ext.distill.teacher import QUANTIZATIONS, TEACHER_TOKENIZER_FIX, load_frozen_teacher
from trainer_ext.files import check_free_space, check_same_run, disk_space_for, format_bytes
from trainer_ext.lm_head import chunked_logits, output_head
from trainer_ext.progress import Progress

logger = logging.getLogger(__name__)


@dataclass
class CacheTeacherArguments:
    teacher_model_name_or_path: str = field(
        metadata={"help": "Teacher checkpoint (directory or hub id) holding the data's tokenizer."})
    data_dir: str = field(metadata={"help": "Prepared token shards (prepare_data)."})
    output_dir: str = field(metadata={"help": "Cache directory (shards + teacher_manifest.json)."})
    splits: list[str] = field(default_factory=lambda: list(SPLITS), metadata={"help": "Splits to cache."})
    topk: int = field(default=64, metadata={"help": "Token ids kept per position (the rest is one tail bucket); "
                                                    "with --teacher_cache_mode sampled, the draws per position."})
    teacher_cache_mode: str = field(
        default="topk", metadata={"help": "topk (the k most likely ids and their log-probs) or sampled (k draws from "
                                          "the teacher's distribution, their distinct ids and counts: an unbiased "
                                          "target, 145 bytes per token at k = 50, V = 99,520)."})
    seed: int = field(default=0, metadata={"help": "sampled: the draws' seed (each shard's own, from it and its "
                                                   "name, so a resumed cache draws the same)."})
    cache_format: str = field(
        default="compact", metadata={"help": "compact (bit-packed ids, a few exact log-probs, a fit of the rest, the "
                                             "tail mass: 148 bytes per token at k = 64, V = 99,520) or fp16 (every "
                                             "log-prob in fp16, uint16/uint32 ids: 384 bytes there)."})
    cache_exact_logprobs: int = field(
        default=3, metadata={"help": "compact: the largest log-probs of a position stored exactly (fp16)."})
    cache_fit_degree: int = field(
        default=1, metadata={"help": "compact: degree of the fit in log(rank) of the other log-probs."})
    num_steps: int | None = field(
        default=None, metadata={"help": "Depth of a recurrent teacher (default: its config's mean_recurrence)."})
    revision: str | None = field(default=None, metadata={"help": "Teacher revision (branch, tag or commit)."})
    batch_size: int = field(default=8, metadata={"help": "Samples per teacher forward pass."})
    position_chunk_size: int = field(
        default=4096, metadata={"help": "Positions whose logits exist at once (chunk x vocab fp32)."})
    device: str = field(default="auto", metadata={"help": "auto (cuda if available), cpu, cuda, cuda:1, ..."})
    dtype: str = field(
        default="auto", metadata={"help": "auto (bf16 on CUDA, fp32 on CPU), bfloat16, float16 or float32."})
    quantization: str = field(
        default="none", metadata={"help": "none, 8bit or 4bit (bitsandbytes, CUDA only): a 32B teacher in 4-bit "
                                          "takes about 18 GB."})
    overwrite: bool = field(default=False, metadata={"help": "Replace a cache built with other arguments."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run the Python code the teacher's repository ships (auto_map). Off by "
                                         "default: a hub id's code runs on this machine."})

    def __post_init__(self):
        for name in ("topk", "batch_size", "position_chunk_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(self, name)}.")
        if self.num_steps is not None and self.num_steps < 1:
            raise ValueError(f"--num_steps must be >= 1, got {self.num_steps}.")
        if self.dtype not in ("auto", "bfloat16", "float16", "float32"):
            raise ValueError(f"--dtype={self.dtype!r} is not allowed; choose auto, bfloat16, float16 or float32.")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(f"--quantization={self.quantization!r} is not allowed; choose one of {list(QUANTIZATIONS)}.")
        bad = [s for s in self.splits if s not in SPLITS]
        if bad or not self.splits:
            raise ValueError(f"--splits {self.splits} is not allowed; choose from {list(SPLITS)}.")
        if self.cache_format not in CACHE_FORMATS:
            raise ValueError(f"--cache_format={self.cache_format!r} is not allowed; choose one of {CACHE_FORMATS}.")
        if self.teacher_cache_mode not in CACHE_MODES:
            raise ValueError(f"--teacher_cache_mode={self.teacher_cache_mode!r} is not allowed; choose one of "
                             f"{CACHE_MODES}.")
        if self.teacher_cache_mode == "sampled" and self.cache_format == "fp16":
            raise ValueError("--cache_format fp16 stores top-k log-probs; --teacher_cache_mode sampled stores the "
                             "draws' counts in its own packing: drop --cache_format fp16.")
        self.codec(vocab_size=2)  # the codec's own checks of --topk and its options, before any work

    def codec(self, vocab_size: int) -> CompactCodec | Fp16Codec | SampledCodec:
        """What one position of this cache holds, for a vocabulary of `vocab_size` entries."""
        if self.teacher_cache_mode == "sampled":
            return SampledCodec(self.topk, vocab_size)
        if self.cache_format == "fp16":
            return Fp16Codec(self.topk, vocab_size)
        return CompactCodec(self.topk, vocab_size, self.cache_exact_logprobs, self.cache_fit_degree)


CACHE_FORMATS = ("compact", "fp16")
CACHE_MODES = ("topk", "sampled")


def cache_identity(args: CacheTeacherArguments, token_manifest: dict, teacher_hash: str, dtype: torch.dtype) -> dict:
    """The manifest fields that say what this cache holds (compared on reruns)."""
    vocab_limit = token_manifest["vocab_size"]
    codec = args.codec(vocab_limit)
    return {
        "topk": args.topk,
        "codec": codec.describe(),
        **({"seed": args.seed} if args.teacher_cache_mode == "sampled" else {}),
        "ids_dtype": codec.ids_dtype.name,
        "bytes_per_token": codec.bytes_per_token,
        "data": {
            "tokenizer_hash": token_manifest["tokenizer_hash"],
            "seq_len": token_manifest["seq_len"],
            "vocab_size": vocab_limit,
        },
        "teacher": {
            "name_or_path": args.teacher_model_name_or_path,
            "revision": args.revision,
            "tokenizer_hash": teacher_hash,
            "num_steps": args.num_steps,
            "dtype": str(dtype).removeprefix("torch."),
            # Recorded only when used: the manifest lists the options that shaped the cache.
            **({"quantization": args.quantization} if args.quantization != "none" else {}),
        },
    }


def existing_manifest(args: CacheTeacherArguments, identity: dict) -> dict | None:
    """The manifest of an earlier run with the same identity, None if there is none; raise if it differs."""
    path = os.path.join(args.output_dir, TEACHER_MANIFEST_NAME)
    if not os.path.exists(path):
        return None
    manifest = read_teacher_manifest(args.output_dir)
    manifest.setdefault("codec", {"name": "fp16"})  # a version 1 cache: the fp16 layout
    manifest.setdefault("bytes_per_token", args.codec(identity["data"]["vocab_size"]).bytes_per_token)
    check_same_run(f"{path}: this directory caches a teacher", {k: manifest.get(k) for k in identity}, identity,
                   "Pass --overwrite to replace it, or choose another --output_dir.")
    return manifest


def teacher_sampled(teacher_logits: torch.Tensor, k: int, vocab_limit: int,
                    generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """k draws per position from softmax(logits[..., :vocab_limit]) with replacement, as (N, k) ids (int64) and
    log-probs of the draws' empirical distribution: the distinct ids drawn with log(count / k) first, then the most
    likely undrawn ids with ABSENT_LOGPROB, so that a position's k ids are distinct (a student's probability is
    counted once per id). teacher_logits (N, V)."""
    probs = torch.softmax(teacher_logits[..., :vocab_limit].float(), dim=-1)
    draws = torch.multinomial(probs, k, replacement=True, generator=generator).sort(dim=-1).values  # (N, k)
    first = torch.ones_like(draws, dtype=torch.bool)
    first[:, 1:] = draws[:, 1:] != draws[:, :-1]
    group = first.long().cumsum(-1) - 1  # the slot of each draw's id among the distinct ones
    counts = torch.zeros_like(draws).scatter_add_(1, group, torch.ones_like(draws))
    distinct = torch.zeros_like(draws).scatter_(1, group, draws)
    drawn = group[:, -1:] + 1  # (N, 1) distinct ids drawn
    top = probs.topk(k, dim=-1).indices  # k undrawn ids exist among these: at most drawn - 1 < k of them were drawn
    undrawn_first = torch.sort((top[:, :, None] == draws[:, None, :]).any(-1).to(torch.int8), dim=-1, stable=True)
    filler = top.gather(1, undrawn_first.indices)
    slot = torch.arange(k, device=draws.device)
    ids = torch.where(slot < drawn, distinct, filler.gather(1, (slot - drawn).clamp(min=0)))
    logprobs = torch.where(slot < drawn, (counts.float() / k).log(), ABSENT_LOGPROB)
    return ids, logprobs


class TeacherTopK:
    """Teacher forward -> top-k (or k sampled) ids per position, computing the head's logits a chunk of positions at
    a time."""

    def __init__(self, model, vocab_limit: int, topk: int, num_steps: int | None, position_chunk_size: int,
                 mode: str = "topk"):
        self.model = model
        self.base = model.base_model
        if self.base is model:
            raise ValueError(
                f"{type(model).__name__}: cannot split into a base model and an output head "
                "(base_model / get_output_embeddings); cache_teacher needs a standard *ForCausalLM."
            )
        self.weight, self.bias = output_head(model)
        logits_size = self.weight.shape[0]
        if vocab_limit > logits_size:
            raise ValueError(
                f"The data's tokenizer has {vocab_limit} entries but the teacher predicts only {logits_size} "
                "logits; the teacher cannot have been trained with this tokenizer."
            )
        self.step_kwargs = {}
        if num_steps is not None:
            if "num_steps" not in inspect.signature(self.base.forward).parameters:
                raise ValueError(
                    f"--num_steps={num_steps} given, but {type(model).__name__} is not a recurrent model "
                    "(its forward takes no num_steps); drop --num_steps."
                )
            self.step_kwargs["num_steps"] = num_steps
        self.vocab_limit, self.topk, self.chunk, self.mode = vocab_limit, topk, position_chunk_size, mode

    def __call__(self, input_ids: torch.Tensor, generator: torch.Generator | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids (B, T) -> ids (B, T, k) int64, log-probs (B, T, k) fp32 (`generator`: the draws' in sampled
        mode)."""
        return self._select(input_ids, self.mode, generator)

    @torch.inference_mode()
    def _select(self, input_ids, mode, generator=None):
        hidden = self.base(input_ids=input_ids, use_cache=False, **self.step_kwargs).last_hidden_state
        ids, logprobs = [], []
        for _, logits in chunked_logits(hidden.flatten(0, 1), self.weight, self.bias, self.chunk):  # (B*T, H) in
            if mode == "sampled":
                chunk_ids, chunk_logprobs = teacher_sampled(logits, self.topk, self.vocab_limit, generator)
            else:
                chunk_ids, chunk_logprobs = teacher_topk(logits, self.topk, self.vocab_limit)
            ids.append(chunk_ids)
            logprobs.append(chunk_logprobs)
        shape = (*input_ids.shape, self.topk)
        return torch.cat(ids).view(shape), torch.cat(logprobs).view(shape)

    @torch.inference_mode()
    def check_against_full_forward(self, input_ids: torch.Tensor, atol: float) -> None:
        """Refuse teachers whose logits are not just head(last hidden state) (e.g. logit soft-capping)."""
        ids, logprobs = self._select(input_ids, "topk")
        logits = self.model(input_ids=input_ids, use_cache=False, **self.step_kwargs).logits
        reference = torch.log_softmax(logits[..., : self.vocab_limit].float(), dim=-1).gather(-1, ids)
        error = (reference - logprobs).abs().max().item()
        if error > atol:
            raise ValueError(
                f"{type(self.model).__name__}: log-probs from its base model + output head differ from its own "
                f"forward by up to {error:.3g} (> {atol}); its logits are transformed after the head, which "
                "cache_teacher does not reproduce. Use a teacher whose logits are head(hidden states)."
            )


def cache_shard(args: CacheTeacherArguments, teacher: TeacherTopK, token_entry: dict, seq_len: int,
                codec: CompactCodec | Fp16Codec, device: torch.device, progress) -> dict:
    """Compute the cache shard of one token shard and return its manifest entry."""
    token_path = os.path.join(args.data_dir, token_entry["file"])
    # The manifest records the token shard's sha256; hash the bytes actually read so the record is true.
    token_sha256 = file_sha256(token_path)
    if token_sha256 != token_entry["sha256"]:
        raise ValueError(
            f"{token_path}: sha256 {token_sha256} but its data manifest lists {token_entry['sha256']}; the token "
            "shard is corrupt. Re-prepare the data (prepare_data --overwrite)."
        )
    rows = np.load(token_path, mmap_mode="r")  # (num_samples, seq_len + 1)
    # Sampled mode: the shard's draws from the seed and its name, so a shard cached again draws the same.
    generator = torch.Generator(device).manual_seed(args.seed * 2**32 + zlib.crc32(token_entry["file"].encode()))

    def batches():
        for start in range(0, rows.shape[0], args.batch_size):
            batch = torch.from_numpy(rows[start:start + args.batch_size, :-1].astype(np.int64)).to(device)
            yield teacher(batch, generator)
            progress.update(len(batch))

    files = write_cache_shard(args.output_dir, token_entry["file"], rows.shape[0], seq_len, codec, batches())
    return {
        "token_file": token_entry["file"],
        "token_sha256": token_sha256,
        "token_size_bytes": os.path.getsize(token_path),
        "num_samples": int(rows.shape[0]),
        **files,
    }


def cache_teacher(args: CacheTeacherArguments) -> dict:
    """Build or finish the cache; return its manifest (also written to ``output_dir``)."""
    token_manifest = None
    for split in args.splits:
        token_manifest = validate_data_dir(args.data_dir, split=split)
    data_hash = token_manifest["tokenizer_hash"]
    # The tokenizer check comes before loading the teacher: a mismatch must cost nothing.
    teacher_hash = tokenizer_hash(load_tokenizer(
        args.teacher_model_name_or_path, "--teacher_model_name_or_path", TEACHER_TOKENIZER_FIX,
        revision=args.revision, trust_remote_code=args.trust_remote_code))
    if teacher_hash != data_hash:
        raise ValueError(
            f"--teacher_model_name_or_path {args.teacher_model_name_or_path} has tokenizer hash {teacher_hash}, but "
            f"the data in {args.data_dir} was tokenized with tokenizer hash {data_hash}. Distillation compares "
            "token ids, so teacher and data need one tokenizer: re-prepare the data with "
            f"--tokenizer {args.teacher_model_name_or_path}, or use a teacher trained with the data's tokenizer."
        )
    vocab_limit = token_manifest["vocab_size"]
    if args.topk > vocab_limit:
        raise ValueError(f"--topk {args.topk} exceeds the vocabulary size {vocab_limit}.")
    device = resolve_device(args.device)
    dtype = resolve_dtype(args.dtype, device)
    identity = cache_identity(args, token_manifest, teacher_hash, dtype)

    os.makedirs(args.output_dir, exist_ok=True)
    if args.overwrite:
        remove_cache_files(args.output_dir)
    for path in glob.glob(os.path.join(args.output_dir, ".*.tmp")):  # partial shards of an interrupted run
        os.remove(path)
    manifest = existing_manifest(args, identity)
    if manifest is None:
        manifest = {"format_version": CACHE_FORMAT_VERSION, **identity, "splits": {}}
    drop_stale_shards(args.output_dir, token_manifest, manifest)
    todo = missing_shards(args.output_dir, args.data_dir, token_manifest, manifest, args.splits)
    if not todo:
        logger.info("%s already holds every shard of %s; nothing to do.", args.output_dir, args.splits)
        return manifest

    # The disk it needs, checked before the teacher loads: a 32B teacher's cache of a cycle takes hours to fill.
    seq_len, codec = token_manifest["seq_len"], args.codec(vocab_limit)
    total = sum(entry["num_samples"] for _, entry in todo)
    needed = total * seq_len * codec.bytes_per_token
    logger.info("%s: %d shard(s) to cache, %d samples of %d tokens at %d bytes per token (%s codec, k = %d): about "
                "%s of disk", args.output_dir, len(todo), total, seq_len, codec.bytes_per_token, codec.name, args.topk,
                format_bytes(needed))
    check_free_space(args.output_dir, needed, f"the teacher cache ({len(todo)} shard(s))",
                     "lower --topk, keep --cache_format compact, or cache fewer --splits")
    model = load_frozen_teacher(args.teacher_model_name_or_path, device, dtype, args.quantization, args.revision,
                                option="--quantization", trust_remote_code=args.trust_remote_code)
    # Informational (not compared on reruns): what was actually loaded.
    manifest["teacher_details"] = {
        "model_type": model.config.model_type,
        "commit_hash": getattr(model.config, "_commit_hash", None),
        "logits_size": model.get_output_embeddings().weight.shape[0],
        "num_steps_used": args.num_steps or getattr(model.config, "mean_recurrence", None),
    }
    teacher = TeacherTopK(model, vocab_limit, args.topk, args.num_steps, args.position_chunk_size,
                          args.teacher_cache_mode)
    _, first_entry = todo[0]
    sample = np.load(os.path.join(args.data_dir, first_entry["file"]), mmap_mode="r")[:1, :-1]
    teacher.check_against_full_forward(torch.from_numpy(sample.astype(np.int64)).to(device),
                                       atol=1e-3 if dtype == torch.float32 else 0.1)

    logger.info("Caching %s of %s over %d shards (%d samples of %d tokens) into %s",
                f"top-{args.topk}" if args.teacher_cache_mode == "topk" else f"{args.topk} draws",
                args.teacher_model_name_or_path, len(todo), total, seq_len, args.output_dir)
    # A bar on a terminal; in a log file a line every 30 s within a shard (a 32B teacher's shard takes hours), and
    # one per finished shard.
    start, done = time.perf_counter(), 0
    with Progress(total=total, desc="Teacher top-k", unit="sample") as progress:
        for index, (split, token_entry) in enumerate(todo, 1):
            shard_bytes = token_entry["num_samples"] * seq_len * codec.bytes_per_token
            with disk_space_for(args.output_dir, shard_bytes, f"the teacher cache of {token_entry['file']}"):
                entry = cache_shard(args, teacher, token_entry, seq_len, codec, device, progress)
            token_order = [e["file"] for e in token_manifest["splits"][split]["shards"]]
            record_shard(manifest, split, entry, token_order)
            write_teacher_manifest(args.output_dir, manifest)
            done += entry["num_samples"]
            logger.info("Cached %s: shard %d/%d, %d/%d samples, %.0fs so far", token_entry["file"], index,
                        len(todo), done, total, time.perf_counter() - start)
    return manifest
