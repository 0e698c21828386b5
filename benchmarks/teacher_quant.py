"""The quantized teacher path of `hf-recurrent-cache-teacher`, measured: a Llama of a given shape (random weights,
the data's vocabulary) saved in bf16, then cached over the data's eval split with each `--quantization` (none, 8bit,
4bit: bitsandbytes, CUDA only) in this process under a memory cap: seconds to load the teacher, caching tokens/s,
peak reserved memory. The user's teacher is a 32B model in 4-bit on a 24 GB card; a 32B model's bf16 weights do not
fit the benchmark machine's disk, so the shapes below bracket it (peak memory grows with the weights' bytes).
Random weights: the speed and memory of the path, not the quality of a quantized teacher.

    python -m benchmarks.teacher_quant --data_dir outputs/data/pystdlib --shapes 8b 14b --cap_gib 24 \
        --output teacher_quant.jsonl

A shape whose load or caching runs out of memory under the cap is a row with status "out of memory". Each shape's
teacher is saved under --work_dir and removed once measured (--keep_teachers keeps it).
"""

import argparse
import gc
import json
import logging
import os
import shutil
import time

import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from trainer_ext.distill.caching import CacheTeacherArguments, cache_teacher
from trainer_ext.files import write_text
from trainer_ext.hub.model_card import format_count

# Llama shapes: Llama-3-8B's, Qwen2.5-14B's (its 32B: width 5120, MLP 27648, 64 layers), and a CPU check.
SHAPES = {
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8),
    "14b": dict(hidden_size=5120, intermediate_size=13824, num_hidden_layers=48, num_attention_heads=40,
                num_key_value_heads=8),
    "tiny": dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}


class LoadClock(logging.Handler):
    """The time of the caching's "Caching ..." log line: the teacher is loaded and checked by then."""

    def __init__(self):
        super().__init__()
        self.loaded_at = None

    def emit(self, record):
        if self.loaded_at is None and record.getMessage().startswith("Caching "):
            self.loaded_at = time.perf_counter()


def save_teacher(shape: str, data_dir: str, path: str) -> int:
    """A random-weight Llama of `shape` with the data's tokenizer, saved in bf16 at `path`; its parameter count."""
    tokenizer = AutoTokenizer.from_pretrained(data_dir)
    config = LlamaConfig(**SHAPES[shape], vocab_size=len(tokenizer), max_position_embeddings=4096,
                         tie_word_embeddings=False)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":  # no cap while it is built: a 14B model's bf16 weights exceed 24 GiB
        torch.cuda.set_per_process_memory_fraction(1.0)
    torch.manual_seed(0)
    with torch.device(device):  # initialised in bf16 where it is fast; saved, then freed
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(path, max_shard_size="5GB")
    tokenizer.save_pretrained(path)
    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return params


def measure(teacher: str, data_dir: str, cache_dir: str, quantization: str, topk: int) -> dict:
    """Cache the eval split of `data_dir` with `teacher` quantized as asked: the timings and the peak memory."""
    clock, log = LoadClock(), logging.getLogger("trainer_ext.distill.caching")
    level = log.level
    log.setLevel(logging.INFO)  # the line is logged at INFO whatever the root logger lets through
    log.addHandler(clock)
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    try:
        manifest = cache_teacher(CacheTeacherArguments(
            teacher_model_name_or_path=teacher, data_dir=data_dir, output_dir=cache_dir, splits=["eval"],
            topk=topk, quantization=quantization, overwrite=True))
        status = "ok"
    except RuntimeError as error:  # torch.OutOfMemoryError is one; bitsandbytes' kernels raise a plain RuntimeError
        if not isinstance(error, torch.OutOfMemoryError) and "out of memory" not in str(error).lower():
            raise
        manifest, status = None, "out of memory"
    finally:
        log.removeHandler(clock)
        log.setLevel(level)
    end = time.perf_counter()
    gc.collect()
    row = {"quantization": quantization, "status": status,
           "peak_reserved_gib": round(torch.cuda.max_memory_reserved() / 2**30, 2) if torch.cuda.is_available()
           else None}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if manifest is not None:
        split = manifest["splits"]["eval"]
        tokens = sum(shard["num_samples"] for shard in split["shards"]) * manifest["data"]["seq_len"]
        load = clock.loaded_at - start
        row.update(load_seconds=round(load, 1), cache_seconds=round(end - clock.loaded_at, 2), tokens=tokens,
                   tokens_per_second=round(tokens / (end - clock.loaded_at), 1))
    shutil.rmtree(cache_dir, ignore_errors=True)
    return row


def render(rows: list[dict]) -> str:
    lines = ["| shape | parameters | quantization | status | load s | caching tokens/s | peak reserved GiB |",
             "|---|---:|---|---|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['shape']} | {format_count(r['params'])} | {r['quantization']} | {r['status']} | "
                     f"{r.get('load_seconds', '-')} | {r.get('tokens_per_second', '-')} | "
                     f"{r['peak_reserved_gib'] if r['peak_reserved_gib'] is not None else '-'} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", required=True, help="Prepared shards with an eval split (the teacher's data).")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=["8b", "14b"])
    parser.add_argument("--quantizations", nargs="+", choices=["none", "8bit", "4bit"],
                        default=["4bit", "8bit", "none"])
    parser.add_argument("--cap_gib", type=float, default=None, help="Memory cap of this process (e.g. 24).")
    parser.add_argument("--topk", type=int, default=64)
    parser.add_argument("--work_dir", default="outputs/teacher_quant")
    parser.add_argument("--keep_teachers", action="store_true")
    parser.add_argument("--output", required=True, help="JSON lines to append the rows to; a .md table beside it.")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    rows = []
    for shape in args.shapes:
        teacher = os.path.join(args.work_dir, f"llama-{shape}")
        params = save_teacher(shape, args.data_dir, teacher)
        if args.cap_gib is not None:  # once the bf16 model that was saved is freed
            from benchmarks.capped import set_memory_cap

            set_memory_cap(args.cap_gib)
        for quantization in args.quantizations:
            row = {"shape": shape, "params": params, "cap_gib": args.cap_gib,
                   **measure(teacher, args.data_dir, os.path.join(args.work_dir, "cache"), quantization, args.topk)}
            print(json.dumps(row), flush=True)
            with open(args.output, "a") as f:
                f.write(json.dumps(row) + "\n")
            rows.append(row)
        if not args.keep_teachers:
            shutil.rmtree(teacher, ignore_errors=True)
    write_text(os.path.splitext(args.output)[0] + ".md", render(rows) + "\n")
    print(render(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
