"""The teacher-cache codecs (trainer_ext/distill/cache_codec.py): the compact one (ids bit-packed exactly, log-probs
stored as a few exact values, a fit of the rest and the tail mass) within the issue's byte budget, and the sampled
mode's (distinct drawn ids and their counts)."""

import math

import pytest
import torch

from trainer_ext.distill.cache_codec import ABSENT_LOGPROB, CompactCodec, Fp16Codec, SampledCodec, codec_from_manifest
from trainer_ext.distill.caching import teacher_sampled


@pytest.mark.parametrize("vocab_size", [384, 4096, 65536, 99520, 151936])
def test_ids_round_trip_exactly(vocab_size):
    codec = CompactCodec(topk=64, vocab_size=vocab_size)
    ids = torch.randint(0, vocab_size, (3, 7, 64))
    ids[0, 0, :2] = torch.tensor([0, vocab_size - 1])  # both ends of the range
    packed = codec.pack_ids(ids)
    assert packed.dtype == torch.uint8 and packed.shape == (3, 7, math.ceil(64 * codec.bits / 8))
    assert torch.equal(codec.unpack_ids(packed), ids)


@pytest.mark.parametrize("bits", [1, 7, 8, 9, 16, 17, 25, 26, 33, 57])
def test_bit_packed_values_of_every_width_read_back_exactly(bits):
    from trainer_ext.distill.cache_codec import pack_bits, unpack_bits

    values = torch.randint(0, 2**bits, (2, 5, 13), generator=torch.Generator().manual_seed(bits))
    values[0, 0, -1] = 2**bits - 1  # every bit of the row's last value, up to the packed row's end
    assert torch.equal(unpack_bits(pack_bits(values, bits), 13, bits), values)


def test_bytes_per_token_meet_the_budget_at_the_users_vocabulary():
    """148 bytes at k = 64 and V = 99,520 (<= 150, against 384 in fp16 with uint32 ids); 119 at k = 50 (<= 120)."""
    assert CompactCodec(64, 99520).bytes_per_token == 148 <= 150
    assert CompactCodec(50, 99520).bytes_per_token == 119 <= 120
    assert Fp16Codec(64, 99520).bytes_per_token == 384 and Fp16Codec(64, 65536).bytes_per_token == 256


def zipf_topk(k: int, vocab_size: int = 8192, positions: int = 256, seed: int = 0):
    """Top-k log-probs of peaked, Zipf-like distributions (a trained LM's shape), with their real tail."""
    generator = torch.Generator().manual_seed(seed)
    base = -1.1 * torch.log(torch.arange(1, vocab_size + 1, dtype=torch.float64))
    logits = base[torch.randperm(vocab_size, generator=generator)] + 2 * torch.randn(positions, vocab_size,
                                                                                     generator=generator,
                                                                                     dtype=torch.float64)
    return torch.log_softmax(logits, -1).topk(k, -1).values


def test_log_probs_keep_the_head_and_the_tail_and_lose_little():
    codec = CompactCodec(topk=64, vocab_size=8192)
    logprobs = zipf_topk(64)
    decoded = codec.decode_logprobs(codec.encode_logprobs(logprobs)).double()
    assert decoded.shape == logprobs.shape
    # the exact head: as stored in fp16
    torch.testing.assert_close(decoded[:, :3], logprobs[:, :3], rtol=0, atol=2e-3)
    # the tail mass, outside the k ids, as stored
    tail, decoded_tail = (1 - lp.exp().sum(-1) for lp in (logprobs, decoded))
    torch.testing.assert_close(decoded_tail, tail, rtol=2e-3, atol=1e-4)
    # what distillation sees: the KL of the k + 1 buckets from the stored to the decoded distribution
    p = logprobs.exp()
    kl = (p * (logprobs - decoded)).sum(-1) + tail * (tail.log() - decoded_tail.log())
    assert kl.mean() < 0.01 and kl.max() < 0.05
    # a worse codec (no exact head, a constant fit) loses clearly more: the test can fail
    crude = CompactCodec(topk=64, vocab_size=8192, exact=1, degree=0)
    crude_decoded = crude.decode_logprobs(crude.encode_logprobs(logprobs)).double()
    crude_kl = (p * (logprobs - crude_decoded)).sum(-1).mean()
    assert crude_kl > 2 * kl.mean()


def test_a_certain_teacher_and_a_minus_infinity_survive():
    codec = CompactCodec(topk=8, vocab_size=100)
    logprobs = torch.full((2, 8), -1e4, dtype=torch.float64)
    logprobs[:, 0] = 0.0  # all mass on one id
    logprobs[1, 1:] = float("-inf")
    decoded = codec.decode_logprobs(codec.encode_logprobs(logprobs))
    assert torch.isfinite(decoded).all() and decoded[:, 0].abs().max() < 1e-3
    assert decoded.exp().sum(-1).max() <= 1 + 1e-6


def test_options_are_checked_a_small_k_is_stored_exactly_and_manifests_name_their_codec():
    with pytest.raises(ValueError, match="--cache_exact_logprobs must be >= 1"):
        CompactCodec(topk=8, vocab_size=100, exact=0)
    small = CompactCodec(topk=4, vocab_size=100)  # too few ranks past the exact ones to fit: all 4 exact, the tail
    assert not small.fitted and small.logprobs_width == 5
    logprobs = zipf_topk(4, vocab_size=100)
    decoded = small.decode_logprobs(small.encode_logprobs(logprobs)).double()
    torch.testing.assert_close(decoded, logprobs, rtol=0, atol=2e-3)
    manifest = {"topk": 16, "data": {"vocab_size": 384}, "codec": CompactCodec(16, 384).describe()}
    assert codec_from_manifest(manifest) == CompactCodec(16, 384)
    del manifest["codec"]  # a version 1 cache
    assert codec_from_manifest(manifest) == Fp16Codec(16, 384)


def test_a_sampled_cache_packs_ids_and_counts_exactly_in_its_budget():
    """k = 50 draws at V = 99,520: 17-bit ids and 6-bit counts, 145 bytes (about the compact top-64's 148)."""
    codec = SampledCodec(50, 99520)
    assert (codec.bits, codec.count_bits, codec.bytes_per_token) == (17, 6, 145)
    logits = torch.randn(40, 99520, generator=torch.Generator().manual_seed(0)) * 3
    ids, logprobs = teacher_sampled(logits, 50, 99520, torch.Generator().manual_seed(1))
    stored = codec.encode(ids, logprobs)
    assert stored[0].shape == (40, codec.ids_width) and stored[1].shape == (40, codec.logprobs_width)
    got_ids, got_logprobs = codec.decode(*(torch.from_numpy(a) for a in stored))
    assert torch.equal(got_ids, ids) and torch.equal(got_logprobs, logprobs)
    manifest = {"topk": 50, "data": {"vocab_size": 99520}, "codec": codec.describe()}
    assert codec_from_manifest(manifest) == codec


def test_sampled_targets_are_distinct_ids_whose_counts_estimate_the_teacher_without_bias():
    generator = torch.Generator().manual_seed(0)
    logits = 2 * torch.randn(300, generator=generator)
    rows, k, limit = 4000, 16, 250  # ids >= limit (head padding) are never drawn
    ids, logprobs = teacher_sampled(logits.expand(rows, -1), k, limit, torch.Generator().manual_seed(1))
    assert ids.shape == logprobs.shape == (rows, k) and int(ids.max()) < limit
    assert all(len(set(row.tolist())) == k for row in ids[:200])  # distinct: a student's mass is counted once
    counts = (logprobs.double().exp() * k).round()
    assert torch.all(counts.sum(-1) == k)
    drawn = counts > 0
    assert torch.all(drawn.long().diff(dim=-1) <= 0)  # the drawn ids first, then the fillers
    assert torch.all(logprobs[~drawn] == ABSENT_LOGPROB)
    # The mean empirical distribution over many positions of one teacher distribution is that distribution: the
    # top-k target is not (it drops the tail and renormalises nothing).
    empirical = torch.zeros(rows, limit, dtype=torch.float64).scatter_add_(1, ids, counts / k).mean(0)
    teacher = torch.softmax(logits[:limit].double(), -1)
    assert (empirical - teacher).abs().max() < 0.01 and (empirical - teacher).abs().sum() < 0.05
    again, _ = teacher_sampled(logits.expand(rows, -1), k, limit, torch.Generator().manual_seed(1))
    assert torch.equal(again, ids)  # a seed gives the same draws (a resumed cache)
