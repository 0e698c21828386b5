"""The chunked LM loss's two head-gradient paths on a GPU: peak memory and time of loss + backward.

    python3 benchmarks/bench_loss.py [--vocab 65536 --hidden 4096 --tokens 12288] [--tf32]

`bf16_gemm` is the default path (a bf16 head's gradient as bf16 GEMMs into fp32, `_accumulate_head_grad`);
`fp32_addmm` the path before it (the gradient accumulated by an fp32 addmm of upcast operands, which runs on TF32
tensor cores only with --tf32). The default shape is recurrent-3.3b's planned step: 6 x 2048 tokens, 4096 wide, a
65,536-entry head. Prints one JSON line per run (the first bf16 run pays the allocator's warm-up).
"""

import argparse
import json
import time

import torch

from trainer_ext.distill import losses


def _fp32_addmm(grad_weight, grad_logits, grad_cast, chunk_hidden):
    grad_weight.addmm_(grad_logits.T, chunk_hidden.float())


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=65536)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=6 * 2048)
    parser.add_argument("--repeats", type=int, default=4, help="Runs per path; the first is left out of the time.")
    parser.add_argument("--tf32", action="store_true", help="Allow TF32 matmuls (as training does by default).")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_loss.py needs a CUDA device.")
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = (0.02 * torch.randn(args.vocab, args.hidden, device="cuda", generator=g)).bfloat16().requires_grad_()
    hidden = torch.randn(1, args.tokens, args.hidden, device="cuda", generator=g).bfloat16().requires_grad_()
    labels = torch.randint(0, args.vocab, (1, args.tokens), device="cuda", generator=g)
    default_path, rows = losses._accumulate_head_grad, []
    try:
        for name, path in (("bf16_gemm", default_path), ("fp32_addmm", _fp32_addmm), ("bf16_gemm", default_path)):
            losses._accumulate_head_grad = path
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            base, times = torch.cuda.memory_allocated(), []
            for _ in range(args.repeats):
                torch.cuda.synchronize()
                start = time.perf_counter()
                losses.chunked_lm_loss(hidden, weight, labels).loss.backward()
                torch.cuda.synchronize()
                times.append(time.perf_counter() - start)
                grad_norm = float(weight.grad.float().norm())
                weight.grad, hidden.grad = None, None
            row = {"variant": name, "tf32": args.tf32,
                   "peak_allocated_over_base_mib": round((torch.cuda.max_memory_allocated() - base) / 2**20),
                   "peak_reserved_mib": round(torch.cuda.max_memory_reserved() / 2**20),
                   "ms": round(1e3 * min(times[1:] or times), 2), "grad_w_norm": grad_norm}
            print(json.dumps(row))
            rows.append(row)
    finally:
        losses._accumulate_head_grad = default_path
    return rows


if __name__ == "__main__":
    main()
