"""CPU time to decode one sample of a teacher cache, per codec, at the user's shape (the data loader does this in the
training process for every sample, `TeacherCacheDataset.__getitem__`: decode, then the range check).

    python3 -m benchmarks.cache_read_cost --vocab_size 99520 --topk 64 --seq_len 2048 --threads 1

Rows are encoded from random ids and a Zipf-like teacher's sorted log-probs; each figure is the median of --repeats
timings of --inner decodes by the process's CPU clock. JSON on stdout.
"""

import argparse
import json
import statistics
import sys
import time

import torch

from trainer_ext.distill.cache_codec import CompactCodec, Fp16Codec, SampledCodec


def sample_row(codec, seq_len: int, generator: torch.Generator):
    ids = torch.stack([torch.randperm(codec.vocab_size, generator=generator)[: codec.topk] for _ in range(seq_len)])
    if isinstance(codec, SampledCodec):
        counts = torch.multinomial(torch.full((codec.topk,), 1.0), codec.topk, replacement=True, generator=generator)
        drawn = torch.bincount(counts, minlength=codec.topk).sort(descending=True).values / codec.topk
        return codec.encode(ids, drawn.log().expand(seq_len, -1))  # k draws: the distinct ids and their counts
    logits = -torch.log(torch.arange(1, codec.topk + 1, dtype=torch.float32)) * 1.1  # Zipf-like ranks
    logprobs = (logits + 0.1 * torch.randn(seq_len, codec.topk, generator=generator)).sort(-1, descending=True).values
    return codec.encode(ids, logprobs - torch.logsumexp(logprobs, -1, keepdim=True) - 0.05)  # 5% tail


def time_decode(codec, row, repeats: int, inner: int) -> float:
    ids, logprobs = (torch.from_numpy(part) for part in row)
    codec.decode(ids, logprobs)
    times = []
    for _ in range(repeats):
        start = time.process_time()
        for _ in range(inner):
            out_ids, out_logprobs = codec.decode(ids, logprobs)
            int(out_ids.min()), int(out_ids.max()), float(torch.logsumexp(out_logprobs, -1).max())  # the range check
        times.append((time.process_time() - start) / inner)
    return statistics.median(times)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab_size", type=int, default=99520)
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--inner", type=int, default=10)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    rows = []
    for codec in (Fp16Codec(args.topk, args.vocab_size), CompactCodec(args.topk, args.vocab_size),
                  SampledCodec(args.topk, args.vocab_size)):
        seconds = time_decode(codec, sample_row(codec, args.seq_len, generator), args.repeats, args.inner)
        rows.append({"codec": codec.name, "bytes_per_token": codec.bytes_per_token,
                     "ms_per_sample": round(seconds * 1000, 2)})
    print(json.dumps({"vocab_size": args.vocab_size, "topk": args.topk, "seq_len": args.seq_len,
                      "threads": args.threads, "torch": torch.__version__, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
