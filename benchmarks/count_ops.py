"""Aten ops per decoded token, by category: ours against the Llama peer of `bench_decode` (same widths, prelude +
n x core + coda layers), device-independent.

Batch-1 eager decoding on a GPU is bound by the host issuing ops, so the count of dispatched aten ops (views left
out: they launch no kernel) per decode step predicts the eager tokens/s ratio better than a CPU timing, where our
small-width arithmetic differs from a GPU's. A `TorchDispatchMode` counts every op of `generate`, sorted by the
Python frames it was issued from (`category`).

    python3 -m benchmarks.count_ops --preset debug --dtype bfloat16 --depths 12 --batch_sizes 1 8

`forward`: the ops of one decode-step forward (the second call of `generate`, after the prompt's), by category;
`per_token`: the whole generate loop's ops per new token (forward, logits processing, stopping checks), from the
difference of two `generate` calls.
"""

import argparse
import collections
import json
import linecache
import sys

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import LlamaForCausalLM

from benchmarks.bench_decode import build, llama_peer
from hf_recurrent import RecurrentDepthForCausalLM, presets

CATEGORIES = ("norm", "mask", "cache", "rotary", "injection", "attention", "linear", "mlp", "residual",
              "initial_state", "positions", "embedding", "other")


def _frames():
    frame = sys._getframe(3)
    while frame is not None:
        yield frame
        frame = frame.f_back


# Per frame: (category, priority); among the frames an op was issued under, the highest priority names it.
def _frame_category(frame) -> tuple[str, int] | None:
    code, owner = frame.f_code, type(frame.f_locals.get("self", None)).__name__
    name, file = code.co_name, code.co_filename
    if "RMSNorm" in owner:
        return "norm", 9
    if file.endswith("masking_utils.py"):
        return "mask", 9
    if name == "attend_cache" or file.endswith("cache_utils.py"):
        return "cache", 9
    if "Rotary" in owner or name in ("rotary_phases", "apply_rotary_pos_emb", "rotate_half"):
        return "rotary", 9
    if name == "inject":
        return "injection", 8
    if name in ("sdpa_attention_forward", "eager_attention_forward", "repeat_kv"):
        return "attention", 7
    if owner == "Linear":
        return "linear", 6
    if "MLP" in owner:
        return "mlp", 5
    if "Attention" in owner:
        line = linecache.getline(file, frame.f_lineno)
        return ("rotary", 9) if "cos" in line or "rotated" in line else ("attention", 4)
    if "DecoderLayer" in owner:
        return "residual", 3
    if owner == "InitialStates" or name == "initial_state":
        return "initial_state", 3
    if name in ("call_positions", "positions_from_mask"):
        return "positions", 3
    if "Embedding" in owner:
        return "embedding", 3
    return None


def category(frames) -> str:
    """The category of an op issued under `frames`: the highest-priority one any frame names ("other": none)."""
    best = ("other", 0)
    for frame in frames:
        found = _frame_category(frame)
        if found is not None and found[1] > best[1]:
            best = found
    return best[0]


class OpCounter(TorchDispatchMode):
    """Counts non-view aten ops per forward call of `model` (call index: 0 the prompt, 1 the first decode step, ...)
    and per category; ops outside a forward count towards the call before them under "generate"."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.calls, self.inside = [], False
        self.handles = [model.register_forward_pre_hook(self._enter), model.register_forward_hook(self._leave)]

    def _enter(self, module, inputs):
        self.calls.append(collections.Counter())
        self.inside = True

    def _leave(self, module, inputs, output):
        self.inside = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not func.is_view and self.calls:
            self.calls[-1][category(_frames()) if self.inside else "generate"] += 1
        return func(*args, **(kwargs or {}))

    def remove(self):
        for handle in self.handles:
            handle.remove()


def count_generate(model, prompt, new_tokens: int, **kwargs) -> list[collections.Counter]:
    counter = OpCounter(model)
    try:
        with torch.no_grad(), counter:
            model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0, **kwargs)
    finally:
        counter.remove()
    return counter.calls


def decode_step_ops(model, prompt, **kwargs) -> dict:
    """`forward`: one decode step's forward ops by category; `per_token`: the generate loop's ops per new token."""
    calls = count_generate(model, prompt, 4, **kwargs)
    forward = {key: value for key, value in calls[2].items() if key != "generate"}
    per_token = sum(calls[2].values())  # the third call: a decode step, with the loop's work after it
    return {"forward": dict(sorted(forward.items(), key=lambda item: CATEGORIES.index(item[0]))),
            "forward_total": sum(forward.values()), "per_token": per_token}


def models(preset: str, num_steps: int, dtype: torch.dtype, device: str = "cpu"):
    config = presets.get(preset)
    torch.manual_seed(0)
    return (build(RecurrentDepthForCausalLM, config, device, dtype),
            build(LlamaForCausalLM, llama_peer(config, num_steps), device, dtype))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="debug")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--depths", type=int, nargs="+", default=[12])
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt_len", type=int, default=8)
    parser.add_argument("--device", default="cpu", help="cuda: the counts of an accelerator's paths (e.g. s_0).")
    parser.add_argument("--output", default=None)
    args = parser.parse_args(argv)
    rows = []
    for num_steps in args.depths:
        ours, llama = models(args.preset, num_steps, getattr(torch, args.dtype), args.device)
        for batch in args.batch_sizes:
            prompt = torch.randint(3, ours.config.vocab_size, (batch, args.prompt_len),
                                   generator=torch.Generator().manual_seed(0)).to(args.device)
            row = {"num_steps": num_steps, "batch": batch,
                   "recurrent": decode_step_ops(ours, prompt, num_steps=num_steps),
                   "llama": decode_step_ops(llama, prompt)}
            rows.append(row)
            print(f"n={num_steps} batch={batch}")
            for kind in ("recurrent", "llama"):
                counts = row[kind]
                print(f"  {kind:9s} forward {counts['forward_total']:5d}  per token {counts['per_token']:5d}  "
                      + " ".join(f"{key}={value}" for key, value in counts["forward"].items()))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
