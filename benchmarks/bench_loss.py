"""The chunked LM loss on a GPU, per path: peak memory and time of loss + backward for one step's tokens.

    python3 benchmarks/bench_loss.py [--vocab 99520 --hidden 4096 --tokens 8192 --topk 64] [--tf32]
        [--variants ce topk topk_torch fp32_addmm]

`ce`: plain cross-entropy (the fused CE kernel); `topk`: distillation from a cached teacher's top-k (the fused
distillation kernels, kd_triton.py); `topk_torch`: the same loss on the torch path (fp32 copies of each chunk of
logits, what a cached teacher ran before the kernels); `fp32_addmm`: plain CE with the head's gradient accumulated by
an fp32 addmm of upcast operands (the path before the bf16 GEMMs of `_accumulate_head_grad`, on TF32 tensor cores
only with --tf32). The default shape: 4 x 2048 tokens of a 4096-wide model with llm-jp's 99,520-entry vocabulary.
Prints one JSON line per variant, with its time and peak memory over the inputs against `ce`'s.
"""

import argparse
import json
import time

import torch

from trainer_ext.distill import losses

VARIANTS = ("ce", "topk", "topk_torch", "fp32_addmm")


def _fp32_addmm(grad_weight, grad_logits, grad_cast, chunk_hidden):
    grad_weight.addmm_(grad_logits.T, chunk_hidden.float())


def _run(args, variant, hidden, weight, labels, teacher):
    default_head_grad, default_fused = losses._accumulate_head_grad, losses._fused_ce
    if variant == "fp32_addmm":
        losses._accumulate_head_grad = _fp32_addmm
    if variant == "topk_torch":
        losses._fused_ce = lambda dtype, device: False
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base, times = torch.cuda.memory_allocated(), []
        for _ in range(args.repeats):
            torch.cuda.synchronize()
            start = time.perf_counter()
            losses.chunked_lm_loss(hidden, weight, labels, teacher=teacher if variant.startswith("topk") else None,
                                   alpha=0.5).loss.backward()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - start)
            grad_norm = float(weight.grad.float().norm())
            weight.grad, hidden.grad = None, None
    finally:
        losses._accumulate_head_grad, losses._fused_ce = default_head_grad, default_fused
    return {"variant": variant, "vocab": args.vocab, "tokens": args.tokens, "topk": args.topk, "tf32": args.tf32,
            "peak_allocated_over_base_mib": round((torch.cuda.max_memory_allocated() - base) / 2**20),
            "ms": round(1e3 * min(times[1:] or times), 2), "grad_w_norm": round(grad_norm, 6)}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--vocab", type=int, default=99520)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--tokens", type=int, default=4 * 2048)
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=4, help="Runs per path; the first is left out of the time.")
    parser.add_argument("--tf32", action="store_true", help="Allow TF32 matmuls (as training does by default).")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=["ce", "topk", "topk_torch"])
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("bench_loss.py needs a CUDA device.")
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    g = torch.Generator(device="cuda").manual_seed(0)
    weight = (0.02 * torch.randn(args.vocab, args.hidden, device="cuda", generator=g)).bfloat16().requires_grad_()
    hidden = torch.randn(1, args.tokens, args.hidden, device="cuda", generator=g).bfloat16().requires_grad_()
    labels = torch.randint(0, args.vocab, (1, args.tokens), device="cuda", generator=g)
    teacher_logits = 3 * torch.randn(args.tokens, args.vocab, device="cuda", generator=g)
    ids, logprobs = losses.teacher_topk(teacher_logits, args.topk)
    del teacher_logits
    teacher = losses.TopKTeacher(ids=ids[None], logprobs=logprobs[None])
    rows, reference = [], None
    for variant in args.variants:
        row = _run(args, variant, hidden, weight, labels, teacher)
        reference = reference or (row if variant == "ce" else None)
        if reference:
            row["ms_over_ce"] = round(row["ms"] - reference["ms"], 2)
            row["mib_over_ce"] = row["peak_allocated_over_base_mib"] - reference["peak_allocated_over_base_mib"]
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


if __name__ == "__main__":
    main()
