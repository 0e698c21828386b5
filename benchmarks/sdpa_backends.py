"""torch's attention kernels at the training shapes of recurrent-3.3b and recurrent-7b (32 query heads, 8 key/value
heads, head size 128, causal, bf16, GQA as transformers calls it), forward and backward: each backend's time and its
error against an fp32 reference, and the backend torch picks by itself, eager and compiled (read from the profiler's
ATen operations), with its time.

    python3 -m benchmarks.sdpa_backends --output sdpa.jsonl            # on the GPU
    python3 -m benchmarks.sdpa_backends --device cpu --seq_len 64 --batch_sizes 1 --heads 4 --kv_heads 2 --head_dim 16
"""

import argparse
import json
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from trainer_ext.devices import synchronize

BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "cudnn": SDPBackend.CUDNN_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
OPS = {"flash": "_scaled_dot_product_flash_attention", "cudnn": "_scaled_dot_product_cudnn_attention",
       "efficient": "_scaled_dot_product_efficient_attention", "math": "_scaled_dot_product_attention_math"}


def attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def forward_backward(fn, inputs, grad):
    for t in inputs:
        t.grad = None
    out = fn(*inputs)
    out.backward(grad)
    return out


def milliseconds(fn, inputs, grad, device, steps: int) -> float:
    """Median milliseconds of a forward and backward over `steps` after three warm-up calls."""
    for _ in range(3):
        forward_backward(fn, inputs, grad)
    times = []
    for _ in range(steps):
        synchronize(device)
        start = time.perf_counter()
        forward_backward(fn, inputs, grad)
        synchronize(device)
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def relative_errors(out, inputs, reference) -> dict:
    """Largest absolute difference of the output and each gradient from the fp32 reference's, over its largest
    magnitude."""
    got = [out] + [t.grad for t in inputs]
    names = ("out", "dq", "dk", "dv")
    return {n: float((g.detach().float() - r).abs().max() / r.abs().max()) for n, g, r in zip(names, got, reference)}


def backends_run(fn, inputs, grad) -> list[str]:
    """The attention backends whose ATen operations a forward and backward of `fn` ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        forward_backward(fn, inputs, grad)
    names = {e.name for e in prof.events()}
    return sorted(b for b, op in OPS.items() if any(op in n for n in names))


def measure(batch: int, args, device) -> list[dict]:
    gen = torch.Generator(device="cpu").manual_seed(batch)
    shapes = [(batch, h, args.seq_len, args.head_dim) for h in (args.heads, args.kv_heads, args.kv_heads)]
    base = [torch.randn(s, generator=gen) for s in shapes]
    grad = torch.randn(shapes[0], generator=gen).to(device, torch.bfloat16)
    inputs = [t.to(device, torch.bfloat16).requires_grad_() for t in base]
    exact = [t.to(device, torch.bfloat16).float().requires_grad_() for t in base]  # the bf16 inputs, exactly
    with sdpa_kernel([SDPBackend.MATH]):
        ref_out = forward_backward(attention, exact, grad.float())
    reference = [ref_out.detach()] + [t.grad for t in exact]
    del exact, ref_out
    flops = 4 * batch * args.heads * args.seq_len ** 2 * args.head_dim * 3.5 / 2  # causal: half; backward 2.5x
    shape = {"batch": batch, "heads": args.heads, "kv_heads": args.kv_heads, "seq_len": args.seq_len,
             "head_dim": args.head_dim, "device_name": torch.cuda.get_device_name(device) if device.type == "cuda"
             else "cpu", "torch": torch.__version__, "cudnn": torch.backends.cudnn.version()}
    records = []
    for name, backend in BACKENDS.items():
        record = {**shape, "kind": "backend", "backend": name}
        try:
            with sdpa_kernel([backend]):
                out = forward_backward(attention, inputs, grad)
                record.update(errors=relative_errors(out, inputs, reference),
                              ms=round(milliseconds(attention, inputs, grad, device, args.steps), 3))
            record["tflops"] = round(flops / record["ms"] / 1e9, 1)
        except RuntimeError as error:  # this backend cannot serve these inputs on this device
            record["unavailable"] = str(error).splitlines()[0][:200]
        records.append(record)
    for compiled in (False, True):  # torch's own choice, as training calls it
        torch._dynamo.reset()
        fn = torch.compile(attention) if compiled else attention
        forward_backward(fn, inputs, grad)
        records.append({**shape, "kind": "default", "compiled": compiled, "ran": backends_run(fn, inputs, grad),
                        "ms": round(milliseconds(fn, inputs, grad, device, args.steps), 3)})
    return records


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu (a check of the script alone).")
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[3, 5])
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv_heads", type=int, default=8)
    parser.add_argument("--head_dim", type=int, default=128)
    parser.add_argument("--steps", type=int, default=20, help="Timed forward and backward calls per backend.")
    parser.add_argument("--output", help="Append one JSON record per backend and per default run to this file.")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("--device cuda: no CUDA device here; pass --device cpu to check the script.", file=sys.stderr)
        return 2
    for batch in args.batch_sizes:
        for record in measure(batch, args, device):
            print(json.dumps(record))
            if args.output:
                with open(args.output, "a") as f:
                    f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
