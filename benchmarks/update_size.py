"""How far one step moves the weights per unit of learning rate: the low-memory optimizer without momentum, with full
momentum and with subspace momentum at several factors of the update outside the subspace (`subspace_residual`).

    python benchmarks/update_size.py --residuals 1 0.5 0.229 0

A 4-layer Llama of width 256 (the transformer-125m preset, narrowed), fp32 on the CPU, batch 4 x 128 tokens of a
fixed random bigram stream (a learnable text whose batches are noisy, as small batches of real text are), 60 steps
at a constant rate. Prints, per configuration, the mean over weight matrices (embeddings left out) of
RMS(W_after - W_before) / lr over steps 1-10, 11-30 and 31-60, and the mean loss of the last 10 steps. Adam-style
updates of pure noise have an RMS near 1; momentum averages noise down, so the ratio says how large a step the same
learning rate takes under each configuration.
"""

import argparse
import json

import torch
from transformers import AutoModelForCausalLM

from hf_recurrent import presets
from trainer_ext.optim.optimizer import create_optimizer

VOCAB = 4096


def bigram_batches(steps: int, batch: int, seq: int, seed: int = 1) -> list[torch.Tensor]:
    """Each token is one of 4 successors of the previous one, drawn at random: the same stream for every run."""
    generator = torch.Generator().manual_seed(seed)
    successors = torch.randint(0, VOCAB, (VOCAB, 4), generator=generator)
    batches = []
    for _ in range(steps):
        ids = torch.empty(batch, seq, dtype=torch.long)
        ids[:, 0] = torch.randint(0, VOCAB, (batch,), generator=generator)
        for t in range(1, seq):
            ids[:, t] = successors[ids[:, t - 1], torch.randint(0, 4, (batch,), generator=generator)]
        batches.append(ids)
    return batches


def update_size(batches: list[torch.Tensor], lr: float, **optimizer_options) -> dict:
    torch.manual_seed(0)
    config = presets.get("transformer-125m", vocab_size=VOCAB, hidden_size=256, intermediate_size=704,
                         num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=4)
    model = AutoModelForCausalLM.from_config(config)
    optimizer = create_optimizer(model, lr=lr, in_backward=False, compile=False, fused=False, **optimizer_options)
    matrices = [p for name, p in model.named_parameters() if p.ndim == 2 and "embed" not in name]
    ratios, losses = [], []
    for ids in batches:
        before = [p.detach().clone() for p in matrices]
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        moved = [(p.detach() - b).pow(2).mean().sqrt().item() / lr for p, b in zip(matrices, before)]
        ratios.append(sum(moved) / len(moved))
        losses.append(loss.item())

    def mean(values):
        return round(sum(values) / len(values), 4)

    return {"update_rms_over_lr": {"steps_1_10": mean(ratios[:10]), "steps_11_30": mean(ratios[10:30]),
                                   "steps_31_60": mean(ratios[30:60])},
            "loss_first": round(losses[0], 4), "loss_last_10": mean(losses[-10:])}


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--residuals", type=float, nargs="*", default=[1.0, 0.5, 0.229, 0.0])
    parser.add_argument("--rank_fraction", type=float, default=1 / 16)
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=60)
    args = parser.parse_args(argv)
    batches = bigram_batches(args.steps, batch=4, seq=128)
    runs = [("no momentum", {}), ("full momentum", {"momentum": 0.9})]
    runs += [(f"subspace momentum, residual {r:g}", {"momentum": 0.9, "momentum_rank_fraction": args.rank_fraction,
                                                      "subspace_residual": r}) for r in args.residuals]
    rows = []
    for name, options in runs:
        rows.append({"config": name, "lr": args.lr, **update_size(batches, args.lr, **options)})
        print(json.dumps(rows[-1]), flush=True)
    return rows


if __name__ == "__main__":
    main()
