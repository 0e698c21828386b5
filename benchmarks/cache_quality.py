"""Do the compact and the sampled teacher caches teach as well as the fp16 one? Bytes per token, the codec's loss of
information, and the student's held-out CE after distillation at equal tokens, several seeds.

    python -m benchmarks.cache_quality --data_dir DATA --teacher_dir TEACHER/final --output_dir OUT --seeds 0 1 2

1. The teacher's top-k over the train and eval splits, cached once per format: `fp16` (format 1's layout) and
   `compact` (the default) with each --codecs variant (exact log-probs x fit degree).
2. On the fp16 cache's eval split: what each compact variant loses, the KL of the k + 1 buckets (top k and tail) from
   the stored to the decoded distribution, mean and 99th percentile over positions.
3. Students (--student_preset) trained with each cache (fp16 top-k, the default compact top-k, and a sampled cache of
   as many draws as fit the compact one's bytes: --caches) and each seed, the same data order, steps and schedule;
   their held-out plain CE at the end (their `eval_loss`).

Results: OUTPUT_DIR/results.json and a Markdown table, OUTPUT_DIR/cache_quality.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

import numpy as np
import torch


def build_cache(teacher_dir: str, data_dir: str, out: str, topk: int, cache_format: str, exact: int = 3,
                degree: int = 1, mode: str = "topk") -> dict:
    from trainer_ext.distill.caching import CacheTeacherArguments, cache_teacher

    return cache_teacher(CacheTeacherArguments(
        teacher_model_name_or_path=teacher_dir, data_dir=data_dir, output_dir=out, topk=topk,
        cache_format=cache_format, cache_exact_logprobs=exact, cache_fit_degree=degree, batch_size=16,
        teacher_cache_mode=mode))


def sampled_draws_at_equal_bytes(topk: int, vocab_size: int) -> int:
    """The most draws a sampled cache stores in the compact top-k cache's bytes per token."""
    from trainer_ext.distill.cache_codec import CompactCodec, SampledCodec

    budget = CompactCodec(topk, vocab_size).bytes_per_token
    return max(k for k in range(1, 4 * topk) if SampledCodec(k, vocab_size).bytes_per_token <= budget)


def codec_error(fp16_cache: str, vocab_size: int, topk: int, exact: int, degree: int) -> dict:
    """KL (nats) of the k + 1 buckets from the fp16-stored to the compact-decoded distribution, over the eval split."""
    from trainer_ext.distill.cache_codec import CompactCodec

    codec = CompactCodec(topk, vocab_size, exact, degree)
    kls = []
    for path in sorted(p for p in os.listdir(fp16_cache) if p.startswith("eval-") and p.endswith("logprobs.npy")):
        stored = torch.from_numpy(np.load(os.path.join(fp16_cache, path)).astype(np.float64)).flatten(0, 1)
        decoded = codec.decode_logprobs(codec.encode_logprobs(stored)).double()
        tail, decoded_tail = ((1 - lp.exp().sum(-1)).clamp(min=1e-6) for lp in (stored, decoded))
        kls.append((stored.exp() * (stored - decoded)).sum(-1) + tail * (tail.log() - decoded_tail.log()))
    kl = torch.cat(kls)
    return {"exact": exact, "degree": degree, "bytes_per_token": codec.bytes_per_token,
            "kl_mean": round(kl.mean().item(), 5), "kl_p99": round(kl.quantile(0.99).item(), 5)}


def train_student(args, cache_dir: str, seed: int, out: str) -> float | None:
    """The student's final held-out CE (None if the run failed)."""
    command = [sys.executable, "-m", "scripts.run_pretrain", "--preset", args.student_preset, "--data_dir",
               args.data_dir, "--teacher_cache_dir", cache_dir, "--output_dir", out, "--overwrite_output_dir", "true",
               "--max_steps", str(args.steps), "--per_device_train_batch_size", str(args.batch_size),
               "--learning_rate", str(args.learning_rate), "--warmup_steps", str(args.steps // 10),
               "--lr_scheduler_type", "cosine", "--seed", str(seed), "--depth_seed", str(seed),
               "--eval_strategy", "no", "--save_strategy", "no", "--save_final", "false", "--logging_steps", "10",
               "--disable_tqdm", "true", *args.extra]
    with open(out + ".log", "w") as log:
        result = subprocess.run(command, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        return None
    with open(os.path.join(out, "log_history.json")) as f:
        evaluated = [e["eval_loss"] for e in json.load(f) if "eval_loss" in e]
    return evaluated[-1] if evaluated else None


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True)
    parser.add_argument("--teacher_dir", required=True)
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--codecs", nargs="+", default=["3x1", "2x2", "1x1", "8x1"],
                        help="Compact variants for the error table, EXACTxDEGREE.")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--student_preset", default="recurrent-125m")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--batch_size", type=int, default=16)
    parser.add_argument("--learning_rate", type=float, default=1e-3)
    parser.add_argument("--caches", nargs="+", choices=CACHES, default=list(CACHES),
                        help="The caches students train with (fp16 always: the reference).")
    parser.add_argument("--sampled_k", type=int, default=None,
                        help="Draws of the sampled cache (default: as many as fit the compact top-k's bytes).")
    parser.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="More run_pretrain arguments.")
    args = parser.parse_args(argv)
    os.makedirs(args.output_dir, exist_ok=True)

    names = ["fp16", *(name for name in args.caches if name != "fp16")]
    caches = {name: os.path.join(args.output_dir, f"cache-{name}") for name in names}
    manifests = {"fp16": build_cache(args.teacher_dir, args.data_dir, caches["fp16"], args.topk, "fp16")}
    vocab_size = manifests["fp16"]["data"]["vocab_size"]
    sampled_k = args.sampled_k or sampled_draws_at_equal_bytes(args.topk, vocab_size)
    for name in names[1:]:
        k, mode = (sampled_k, "sampled") if name == "sampled" else (args.topk, "topk")
        manifests[name] = build_cache(args.teacher_dir, args.data_dir, caches[name], k, "compact", mode=mode)
    errors = []
    for variant in args.codecs:
        exact, degree = (int(x) for x in variant.split("x"))
        errors.append(codec_error(caches["fp16"], vocab_size, args.topk, exact, degree))
        print(json.dumps(errors[-1]), flush=True)
    students = []
    for name, cache in caches.items():
        for seed in args.seeds:
            loss = train_student(args, cache, seed, os.path.join(args.output_dir, f"student-{name}-{seed}"))
            students.append({"cache": name, "seed": seed, "eval_loss": loss})
            print(json.dumps(students[-1]), flush=True)
    results = {"vocab_size": vocab_size, "topk": args.topk, "sampled_k": sampled_k if "sampled" in names else None,
               "bytes_per_token": {name: m["bytes_per_token"] for name, m in manifests.items()},
               "codec_error": errors, "students": students, "settings": vars(args)}
    with open(os.path.join(args.output_dir, "results.json"), "w") as f:
        json.dump(results, f, indent=1)
    print(report(results))
    return results


CACHES = ("fp16", "compact", "sampled")


def report(results: dict) -> str:
    lines = [f"V = {results['vocab_size']}, k = {results['topk']}", "",
             "| codec | bytes/token | KL to the fp16 cache, mean | p99 |", "|---|---:|---:|---:|",
             f"| fp16 | {results['bytes_per_token']['fp16']} | 0 | 0 |"]
    lines += [f"| compact, {e['exact']} exact, degree {e['degree']} | {e['bytes_per_token']} | {e['kl_mean']:.5f} | "
              f"{e['kl_p99']:.5f} |" for e in results["codec_error"]]
    lines += ["", "| cache | bytes/token | held-out CE per seed | mean | spread (max - min) | minus fp16, per seed | "
                  "mean |", "|---|---:|---|---:|---:|---|---:|"]
    for name in results["bytes_per_token"]:
        losses = [s["eval_loss"] for s in results["students"] if s["cache"] == name and s["eval_loss"] is not None]
        if not losses:
            continue
        paired = [c["eval_loss"] - f["eval_loss"] for f in results["students"] for c in results["students"]
                  if f["cache"] == "fp16" and c["cache"] == name and f["seed"] == c["seed"]
                  and None not in (f["eval_loss"], c["eval_loss"])]
        label = f"sampled, k = {results['sampled_k']}" if name == "sampled" else f"{name} top-{results['topk']}"
        versus = ("- | -" if name == "fp16" or not paired else
                  f"{', '.join(f'{d:+.4f}' for d in paired)} | {statistics.mean(paired):+.4f}")
        lines.append(f"| {label} | {results['bytes_per_token'][name]} | {', '.join(f'{x:.4f}' for x in losses)} | "
                     f"{statistics.mean(losses):.4f} | {max(losses) - min(losses):.4f} | {versus} |")
    text = "\n".join(lines)
    with open(os.path.join(results["settings"]["output_dir"], "cache_quality.md"), "w") as f:
        f.write(text + "\n")
    return text


if __name__ == "__main__":
    main()
