"""Gradient norm of the first training step at initialisation, per preset: the width-stability check.

    python benchmarks/init_grad_norm.py --presets recurrent-125m recurrent-1b --seq_len 256
    python benchmarks/init_grad_norm.py --presets recurrent-3.3b --overrides n_prelude_layers=1,n_coda_layers=1

Random tokens, fp32 on CPU (bf16 on CUDA), loss at the preset's default depth and backprop depth, gradients of
the whole model. A healthy init gives a norm of order 1 whatever the width.
"""

import argparse
import json
import time

import torch
from transformers import AutoModelForCausalLM

import hf_recurrent  # noqa: F401
from hf_recurrent import presets


def first_step_grad_norm(config, seq_len: int, batch_size: int, seed: int, device: str, dtype) -> dict:
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.train()
    generator = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, config.vocab_size, (batch_size, seq_len + 1), generator=generator).to(device)
    loss = model(input_ids=ids[:, :-1], labels=ids[:, 1:], shift_labels=ids[:, 1:].contiguous()).loss
    loss.backward()
    norms = {name: p.grad.float().norm().item() for name, p in model.named_parameters() if p.grad is not None}
    total = sum(v * v for v in norms.values()) ** 0.5
    largest = sorted(norms.items(), key=lambda kv: -kv[1])[:3]
    del model
    return {"loss": round(loss.item(), 4), "grad_norm": round(total, 3), "largest": [(k, round(v, 3)) for k, v in largest]}


def parse_overrides(text: str | None) -> dict:
    return {k: json.loads(v) for k, _, v in (item.partition("=") for item in text.split(","))} if text else {}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["recurrent-125m", "recurrent-1b"])
    parser.add_argument("--overrides", default=None, help="config fields, e.g. n_prelude_layers=1,block_norm=\"pre\"")
    parser.add_argument("--seq_len", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=1)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    for name in args.presets:
        config = presets.get(name, **parse_overrides(args.overrides))
        for seed in args.seeds:
            start = time.perf_counter()
            row = first_step_grad_norm(config, args.seq_len, args.batch_size, seed, device, dtype)
            print(json.dumps({"preset": name, "overrides": args.overrides, "seed": seed, "device": device,
                              **row, "seconds": round(time.perf_counter() - start, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
