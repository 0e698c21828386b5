"""How a teacher cache stores one position's top-k: the compact codec of format version 2, and the fp16 layout of
version 1 (still read, and written with `--cache_format fp16`).

Compact, per position, for k ids of a vocabulary of V entries and log-probs sorted from the largest:

    ids        k ids bit-packed at b = ceil(log2 V) bits (17 at V = 99,520), little-endian: ceil(k b / 8) bytes
    log-probs  fp16: the `exact` largest log-probs as they are, then the `degree + 1` coefficients of a
               least-squares fit of the others against t = log(rank) (centred), then log(tail mass), the
               teacher's probability outside the k ids: 2 (exact + degree + 2) bytes

At k = 64, V = 99,520, exact 3, degree 1: 136 + 12 = 148 bytes per token, against 384 in fp16 with uint32 ids; at
k = 50, 107 + 12 = 119. A top-k distribution's log-probs fall almost linearly in log(rank) (Zipf): the fit
carries the shape of the ranks past the first few, and decoding rescales the fitted part so that the k
probabilities and the tail add up to one again: the largest probabilities and the tail mass, which weigh most in
the distillation loss, come back as stored (to fp16). `benchmarks/cache_codec_error.py` measures what the fit
loses on a real teacher's outputs.

Decoding is vectorized over positions (torch), one sample at a time in the data loader: no Python loop over
tokens.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["ABSENT_LOGPROB", "CompactCodec", "Fp16Codec", "SampledCodec", "codec_from_manifest", "id_bits"]

# The smallest finite fp16: a log-prob below it (a -inf logit) is stored as that, i.e. probability 0.
FP16_MIN = float(np.finfo(np.float16).min)
# The log-prob of a sampled cache's undrawn ids (count 0): probability 0 in fp32 (exp underflows), finite for the loss.
ABSENT_LOGPROB = -1e4


def id_bits(vocab_size: int) -> int:
    """Bits that hold every id below `vocab_size`."""
    return max(1, math.ceil(math.log2(vocab_size)))


@dataclass(frozen=True)
class Fp16Codec:
    """Format version 1: ids as uint16 (V <= 65,536) or uint32, log-probs as fp16, k of each per position."""

    topk: int
    vocab_size: int
    name = "fp16"
    logprobs_dtype = np.dtype(np.float16)

    @property
    def ids_dtype(self) -> np.dtype:
        return np.dtype(np.uint16 if self.vocab_size <= 2**16 else np.uint32)

    @property
    def ids_width(self) -> int:
        return self.topk

    @property
    def logprobs_width(self) -> int:
        return self.topk

    @property
    def bytes_per_token(self) -> int:
        return self.topk * (self.ids_dtype.itemsize + 2)

    def describe(self) -> dict:
        return {"name": self.name}

    def encode(self, ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(…, k) ids and temperature-1 log-probs -> the two arrays the shard files hold."""
        return (ids.cpu().numpy().astype(self.ids_dtype),
                logprobs.clamp(min=FP16_MIN).cpu().numpy().astype(np.float16))

    def decode(self, ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows of the shard files -> int64 ids and float32 log-probs, (…, k) each."""
        return ids.to(torch.long), logprobs.to(torch.float32)


@dataclass(frozen=True)
class CompactCodec:
    """Format version 2 (module docstring): bit-packed ids, a few exact log-probs, a fit of the rest, the tail."""

    topk: int
    vocab_size: int
    exact: int = 3
    degree: int = 1
    name = "compact"

    def __post_init__(self):
        if self.exact < 1 or self.degree < 0:
            raise ValueError(f"--cache_exact_logprobs must be >= 1 and --cache_fit_degree >= 0, got {self.exact} and "
                             f"{self.degree}.")

    @property
    def fitted(self) -> bool:
        """Whether ranks are left to fit (at least degree + 2 past the exact ones); else every log-prob is exact."""
        return self.topk >= self.exact + self.degree + 2

    @property
    def stored_exact(self) -> int:
        return self.exact if self.fitted else self.topk

    @property
    def bits(self) -> int:
        return id_bits(self.vocab_size)

    ids_dtype = np.dtype(np.uint8)
    logprobs_dtype = np.dtype(np.float16)

    @property
    def ids_width(self) -> int:
        return math.ceil(self.topk * self.bits / 8)

    @property
    def logprobs_width(self) -> int:
        return self.stored_exact + (self.degree + 1 if self.fitted else 0) + 1

    @property
    def bytes_per_token(self) -> int:
        return self.ids_width + 2 * self.logprobs_width

    def describe(self) -> dict:
        return {"name": self.name, "id_bits": self.bits, "exact_logprobs": self.exact, "fit_degree": self.degree}

    # -- ids

    def pack_ids(self, ids: torch.Tensor) -> torch.Tensor:
        """(…, k) ids < 2**bits -> (…, ids_width) uint8, bit i of id j at bit j * bits + i of the row."""
        return pack_bits(ids, self.bits)

    def unpack_ids(self, packed: torch.Tensor) -> torch.Tensor:
        """(…, ids_width) uint8 -> (…, k) int64."""
        return unpack_bits(packed, self.topk, self.bits)

    # -- log-probs

    def _fit_matrices(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(basis (k - exact, degree + 1), its pseudo-inverse (degree + 1, k - exact)), float64 on `device`."""
        basis = _basis(self.topk, self.exact, self.degree)
        return basis.to(device), torch.linalg.pinv(basis).to(device)

    def encode_logprobs(self, logprobs: torch.Tensor) -> torch.Tensor:
        """(…, k) sorted temperature-1 log-probs -> (…, logprobs_width) fp16."""
        logprobs = logprobs.double().clamp(min=FP16_MIN)
        parts = [logprobs[..., : self.stored_exact]]
        if self.fitted:
            parts.append(logprobs[..., self.exact:] @ self._fit_matrices(logprobs.device)[1].T)  # (…, degree + 1)
        parts.append(torch.log1p(-torch.exp(logprobs).sum(-1, keepdim=True).clamp(max=1.0)))  # log(1 - top-k mass)
        return torch.cat(parts, dim=-1).clamp(FP16_MIN, -FP16_MIN).to(torch.float16)

    def decode_logprobs(self, code: torch.Tensor) -> torch.Tensor:
        """(…, logprobs_width) fp16 -> (…, k) float32 log-probs whose probabilities and the tail add up to one."""
        code = code.double()
        head = code[..., : self.stored_exact]
        if not self.fitted:
            return head.float()
        rest = code[..., self.exact: self.exact + self.degree + 1] @ self._fit_matrices(code.device)[0].T
        tail = code[..., -1:].exp()
        # The fitted part takes what the stored head and tail leave (never less than a sliver): the two kept exactly.
        rest_mass = (1.0 - tail - head.exp().sum(-1, keepdim=True)).clamp(min=1e-12)
        rest = rest + (rest_mass.log() - torch.logsumexp(rest, dim=-1, keepdim=True))
        return torch.cat([head, rest], dim=-1).float()

    # -- files

    def encode(self, ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        return self.pack_ids(ids).cpu().numpy(), self.encode_logprobs(logprobs).cpu().numpy()

    def decode(self, ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.unpack_ids(ids), self.decode_logprobs(logprobs)


@dataclass(frozen=True)
class SampledCodec:
    """A sampled cache (``--teacher_cache_mode sampled``): k tokens drawn from the teacher's distribution with
    replacement, stored as the distinct ids drawn and their counts; the slots past the distinct ones hold other
    (undrawn) ids with count 0, so that every position has k distinct ids.

        ids     k ids bit-packed at ceil(log2 V) bits
        counts  k counts bit-packed at ceil(log2(k + 1)) bits (in the log-probs file, uint8)

    Decoding gives log(count / k), the draws' empirical distribution (an unbiased estimate of the teacher's, where
    a top-k cache is biased towards the head), and ABSENT_LOGPROB at count 0; its tail mass is 0. At k = 50 and
    V = 99,520: 107 + 38 = 145 bytes per token.
    """

    topk: int
    vocab_size: int
    name = "sampled"
    ids_dtype = np.dtype(np.uint8)
    logprobs_dtype = np.dtype(np.uint8)

    @property
    def bits(self) -> int:
        return id_bits(self.vocab_size)

    @property
    def count_bits(self) -> int:
        return id_bits(self.topk + 1)

    @property
    def ids_width(self) -> int:
        return math.ceil(self.topk * self.bits / 8)

    @property
    def logprobs_width(self) -> int:
        return math.ceil(self.topk * self.count_bits / 8)

    @property
    def bytes_per_token(self) -> int:
        return self.ids_width + self.logprobs_width

    def describe(self) -> dict:
        return {"name": self.name, "id_bits": self.bits, "count_bits": self.count_bits}

    def encode(self, ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        counts = (logprobs.double().exp() * self.topk).round().long()
        return pack_bits(ids, self.bits).cpu().numpy(), pack_bits(counts, self.count_bits).cpu().numpy()

    def decode(self, ids: torch.Tensor, logprobs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = unpack_bits(logprobs, self.topk, self.count_bits)
        empirical = torch.where(counts > 0, (counts.double() / self.topk).log(), ABSENT_LOGPROB)
        return unpack_bits(ids, self.topk, self.bits), empirical.float()


def pack_bits(values: torch.Tensor, bits: int) -> torch.Tensor:
    """(…, n) integers < 2**bits -> (…, ceil(n bits / 8)) uint8, bit i of value j at bit j * bits + i of the row."""
    width = math.ceil(values.shape[-1] * bits / 8)
    spread = (values.long().unsqueeze(-1) >> torch.arange(bits, device=values.device)) & 1  # (…, n, bits)
    spread = torch.nn.functional.pad(spread.flatten(-2), (0, width * 8 - values.shape[-1] * bits))
    weights = 1 << torch.arange(8, device=values.device)
    return (spread.unflatten(-1, (width, 8)) * weights).sum(-1).to(torch.uint8)


def unpack_bits(packed: torch.Tensor, count: int, bits: int) -> torch.Tensor:
    """(…, width) uint8 -> the first `count` values of `bits` (<= 57) bits, (…, count) int64.

    Value j starts in byte j * bits // 8: one little-endian word read at that byte (a numpy view of the row with a
    stride of one byte), shifted and masked, gives it: a sample's 2048 x 64 ids of 17 bits in about 0.2 ms on one
    core, where spreading every byte into single bits took 4-5 ms (benchmarks/cache_read_cost.py)."""
    width = packed.shape[-1]
    span, word = (4, np.dtype("<u4")) if bits <= 25 else (8, np.dtype("<u8"))
    rows = packed.reshape(-1, width).cpu().numpy()
    padded = np.zeros((rows.shape[0], width + span), np.uint8)  # the last words read past the row
    padded[:, :width] = rows
    words = np.ndarray((rows.shape[0], width), dtype=word, buffer=padded, strides=(width + span, 1))
    offsets = np.arange(count) * bits
    values = (words[:, offsets // 8] >> (offsets % 8).astype(word)) & np.array((1 << bits) - 1, dtype=word)
    return torch.from_numpy(values.astype(np.int64)).reshape(*packed.shape[:-1], count).to(packed.device)


@functools.cache
def _basis(topk: int, exact: int, degree: int) -> torch.Tensor:
    """Powers of the centred log(rank) for ranks exact + 1 .. topk, (topk - exact, degree + 1), float64."""
    t = torch.log(torch.arange(exact + 1, topk + 1, dtype=torch.float64))
    t = t - t.mean()  # centred: coefficients of similar size, well conditioned in fp16
    return torch.stack([t**power for power in range(degree + 1)], dim=-1)


def codec_from_manifest(manifest: dict) -> Fp16Codec | CompactCodec | SampledCodec:
    """The codec a teacher manifest records (version 1 caches: fp16)."""
    vocab_size, topk = manifest["data"]["vocab_size"], manifest["topk"]
    codec = manifest.get("codec", {"name": "fp16"})
    if codec["name"] == "compact":
        return CompactCodec(topk, vocab_size, codec["exact_logprobs"], codec["fit_degree"])
    if codec["name"] == "sampled":
        return SampledCodec(topk, vocab_size)
    return Fp16Codec(topk, vocab_size)
