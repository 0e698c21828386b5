"""Offline distillation end to end on the embedded corpus, on a CPU: does a cached teacher help the student?

    python -m benchmarks.distill_demo --torch_threads 1    # about 6 minutes on 2 (busy) CPU cores
    python -m benchmarks.distill_demo --teacher_steps 60 --student_steps 60 --train_samples 480   # a quick look

1. Data: the embedded corpus prepared with default arguments (``outputs/data/kjv``, reused if present).
2. Teacher: a Transformer several times the student's width, trained with ``run_pretrain`` on the full
   train split. It never sees the eval split.
3. Student data: the first ``--train_samples`` train samples as their own data directory (same tokenizer,
   same eval split). Caching costs a teacher forward pass per cached token; a subset keeps that within
   the CPU budget, and the students see it about once (steps x batch ~ samples).
4. Cache: ``cache_teacher`` stores the teacher's top-k (k = 32) over that subset and the eval split.
5. Students: the ``debug`` recurrent preset, trained twice with identical seeds, data order and schedule:
   once on plain CE, once on (1 - alpha) CE + alpha KL against the cache. Both are evaluated by plain
   cross-entropy on the held-out split at the same depth.

Every stage is skipped when its output already exists, so an interrupted run continues. Results go to
``<output_dir>/results.json`` and are printed as a table.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser

if __package__ in (None, ""):  # run as a file: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import hf_recurrent  # noqa: F401
from hf_recurrent import presets
from trainer_ext.data.prepare import PrepareDataArguments, prepare
from trainer_ext.data.shards import (
    MANIFEST_NAME,
    ShardedTokenDataset,
    read_manifest,
    shard_name,
    validate_data_dir,
    write_manifest,
    write_shard,
)
from trainer_ext.distill.cache import TEACHER_MANIFEST_NAME, TeacherCacheDataset
from trainer_ext.distill.caching import CacheTeacherArguments, cache_teacher
from trainer_ext.training.arguments import RecurrentTrainingArguments
from trainer_ext.run.pretrain import parse_pretrain_job, pretrain
from trainer_ext.training.trainer import RecurrentTrainer

logger = logging.getLogger("distill_demo")

# Twice the student's width, every layer unique: about 2.3x its unique parameters and a few CPU minutes to train.
TEACHER_OVERRIDES = "hidden_size=128,intermediate_size=352,num_attention_heads=4,num_key_value_heads=2"


@dataclass
class DistillDemoArguments:
    output_dir: str = field(default=os.path.join("outputs", "distill_demo"))
    data_dir: str = field(default=os.path.join("outputs", "data", "kjv"),
                          metadata={"help": "Prepared with default arguments if it has no manifest."})
    teacher_preset: str = field(default="transformer-debug")
    teacher_overrides: str = field(default=TEACHER_OVERRIDES)
    teacher_steps: int = field(default=200)
    teacher_learning_rate: float = field(default=3e-3)
    train_samples: int = field(default=800, metadata={"help": "Train samples the students use (and the cache holds)."})
    topk: int = field(default=32)
    student_preset: str = field(default="debug")
    student_block_norm: str = field(
        default="pre", metadata={"help": "Block normalisation of the student (`pre`, as in the recorded figures, or "
                                         "`sandwich`, the presets' default since)."})
    student_steps: int = field(default=100)
    student_learning_rate: float = field(default=3e-3)
    optimizer_momentum: float = field(
        default=0.0, metadata={"help": "Momentum of the low-memory optimizer, teacher and students (0 = off, as in "
                                       "the figures recorded in BENCHMARKS_distill.md)."})
    batch_size: int = field(default=8)
    distill_alpha: float = field(default=0.5)
    distill_temperature: float = field(default=1.0)
    seed: int = field(default=0, metadata={"help": "Seed of the teacher run."})
    student_seeds: list[int] = field(
        default_factory=lambda: [0],
        metadata={"help": "One CE and one distilled student per seed (init + data order)."})
    torch_threads: int = field(
        default=0, metadata={"help": "CPU threads for torch (0: torch's default). On a busy machine 1 can be "
                                     "several times faster than oversubscribed cores."})


# ----------------------------------------------------------------------------- stages


def ensure_data(data_dir: str) -> None:
    if not os.path.exists(os.path.join(data_dir, MANIFEST_NAME)):
        prepare(PrepareDataArguments(output_dir=data_dir))


def train_teacher(args: DistillDemoArguments) -> str:
    out = os.path.join(args.output_dir, "teacher")
    final = os.path.join(out, "final")
    if not os.path.exists(os.path.join(final, "train_metrics.json")):
        pretrain(parse_pretrain_job([
            "--preset", args.teacher_preset, "--config_overrides", args.teacher_overrides,
            "--data_dir", args.data_dir, "--output_dir", out, "--max_steps", str(args.teacher_steps),
            "--per_device_train_batch_size", str(args.batch_size), "--learning_rate", str(args.teacher_learning_rate),
            "--warmup_steps", str(max(args.teacher_steps // 10, 1)), "--eval_strategy", "no",
            "--save_strategy", "no", "--logging_steps", str(max(args.teacher_steps // 6, 1)),
            "--seed", str(args.seed), "--disable_tqdm", "true",
            "--use_cpu", str(not torch.cuda.is_available()).lower(),
            "--optimizer_momentum", str(args.optimizer_momentum),
        ]))
    return final


def make_train_subset(args: DistillDemoArguments) -> str:
    """A data directory with the first ``train_samples`` train samples and the full eval split."""
    out = os.path.join(args.output_dir, "data")
    if os.path.exists(os.path.join(out, MANIFEST_NAME)):
        return out
    os.makedirs(out, exist_ok=True)
    source = read_manifest(args.data_dir)
    if source["splits"]["train"]["num_samples"] < args.train_samples:
        raise ValueError(f"--train_samples {args.train_samples} exceeds the {source['splits']['train']['num_samples']} "
                         f"train samples of {args.data_dir}.")
    rows, kept = [], 0
    for entry in source["splits"]["train"]["shards"]:
        take = min(entry["num_samples"], args.train_samples - kept)
        rows.append(np.load(os.path.join(args.data_dir, entry["file"]), mmap_mode="r")[:take])
        kept += take
        if kept == args.train_samples:
            break
    train_entry = write_shard(os.path.join(out, shard_name("train", 0)), np.concatenate(rows))
    for entry in source["splits"]["eval"]["shards"]:
        shutil.copyfile(os.path.join(args.data_dir, entry["file"]), os.path.join(out, entry["file"]))
    for name in os.listdir(args.data_dir):  # the tokenizer files
        if not name.endswith(".npy") and name != MANIFEST_NAME and not name.startswith("."):
            shutil.copyfile(os.path.join(args.data_dir, name), os.path.join(out, name))
    manifest = dict(source)
    manifest["splits"] = {
        "train": {"num_samples": args.train_samples, "num_tokens": args.train_samples * (source["seq_len"] + 1),
                  "shards": [train_entry]},
        "eval": source["splits"]["eval"],
    }
    manifest["subset_of"] = {"data_dir": args.data_dir, "train_samples": args.train_samples}
    write_manifest(out, manifest)  # last: the directory is complete once it has a manifest
    validate_data_dir(out, "train")
    return out


def build_cache(args: DistillDemoArguments, teacher_dir: str, data_dir: str) -> str:
    out = os.path.join(args.output_dir, "teacher_cache")
    cache_teacher(CacheTeacherArguments(teacher_model_name_or_path=teacher_dir, data_dir=data_dir, output_dir=out,
                                        topk=args.topk, batch_size=16))
    return out


def train_student(args: DistillDemoArguments, data_dir: str, cache_dir: str | None, seed: int) -> dict:
    """One student run; returns its held-out CE (plain cross-entropy, same depth for every student)."""
    name = f"student_{'kd' if cache_dir is not None else 'ce'}-seed{seed}"
    out = os.path.join(args.output_dir, name)
    result_path = os.path.join(out, "result.json")
    if os.path.exists(result_path):
        with open(result_path) as f:
            return json.load(f)
    tokenizer = AutoTokenizer.from_pretrained(data_dir)
    torch.manual_seed(seed)
    config = presets.get(args.student_preset, vocab_size=len(tokenizer), pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         block_norm=args.student_block_norm)
    model = AutoModelForCausalLM.from_config(config)
    train_set = ShardedTokenDataset(data_dir, "train")
    if cache_dir is not None:
        train_set = TeacherCacheDataset(train_set, cache_dir)
    training_args = RecurrentTrainingArguments(
        output_dir=out, max_steps=args.student_steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=16, learning_rate=args.student_learning_rate, lr_scheduler_type="cosine",
        warmup_steps=max(args.student_steps // 10, 1), logging_steps=max(args.student_steps // 6, 1),
        save_strategy="no", eval_strategy="no",
        report_to="none", seed=seed, dataloader_pin_memory=False, disable_tqdm=True,
        use_cpu=not torch.cuda.is_available(), distill_alpha=args.distill_alpha,
        distill_temperature=args.distill_temperature, optimizer_momentum=args.optimizer_momentum,
        # The Trainer drops batch keys that model.forward does not name, the teacher keys included.
        remove_unused_columns=False,
    )
    trainer = RecurrentTrainer(model=model, args=training_args, train_dataset=train_set, processing_class=tokenizer)
    start = time.perf_counter()
    trainer.train()
    train_seconds = time.perf_counter() - start
    # Plain token eval set for both students: eval_loss is then cross-entropy, never mixed with KD.
    metrics = trainer.evaluate(eval_dataset=ShardedTokenDataset(data_dir, "eval"))
    logs = [e for e in trainer.state.log_history if "ce" in e]
    result = {
        "name": name, "distilled": cache_dir is not None, "seed": seed, "steps": args.student_steps,
        "eval_ce": metrics["eval_loss"], "eval_perplexity": math.exp(metrics["eval_loss"]),
        "eval_depth": config.mean_recurrence, "last_train_ce": logs[-1]["ce"], "last_train_kd": logs[-1].get("kd"),
        "train_seconds": round(train_seconds, 1),
        "unique_params": sum(p.numel() for p in model.parameters()),
    }
    os.makedirs(out, exist_ok=True)
    with open(result_path, "w") as f:
        json.dump(result, f, indent=2)
    return result


def teacher_eval_ce(teacher_dir: str) -> float:
    with open(os.path.join(teacher_dir, "train_metrics.json")) as f:
        return json.load(f)["eval_loss"]


def main(argv: list[str] | None = None) -> dict:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    (args,) = HfArgumentParser(DistillDemoArguments).parse_args_into_dataclasses(
        args=argv if argv is not None else sys.argv[1:])
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    os.makedirs(args.output_dir, exist_ok=True)
    timings = {}

    def stage(name, fn, *fn_args):
        start = time.perf_counter()
        value = fn(*fn_args)
        timings[name] = round(time.perf_counter() - start, 1)
        logger.info("%s done in %.1f s", name, timings[name])
        return value

    stage("prepare_data", ensure_data, args.data_dir)
    teacher_dir = stage("teacher", train_teacher, args)
    data_dir = stage("subset", make_train_subset, args)
    cache_dir = stage("cache", build_cache, args, teacher_dir, data_dir)
    students = []
    for seed in args.student_seeds:
        students.append(stage(f"student_ce-seed{seed}", train_student, args, data_dir, None, seed))
        students.append(stage(f"student_kd-seed{seed}", train_student, args, data_dir, cache_dir, seed))

    with open(os.path.join(cache_dir, TEACHER_MANIFEST_NAME)) as f:
        cache_manifest = json.load(f)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir)
    mean_ce = {kind: float(np.mean([s["eval_ce"] for s in students if s["distilled"] == distilled]))
               for kind, distilled in (("ce", False), ("kd", True))}
    results = {
        "args": asdict(args),
        "teacher": {"eval_ce": teacher_eval_ce(teacher_dir),
                    "unique_params": sum(p.numel() for p in teacher.parameters()),
                    "steps": args.teacher_steps},
        "cache": {"topk": cache_manifest["topk"], "ids_dtype": cache_manifest["ids_dtype"],
                  "bytes": sum(os.path.getsize(os.path.join(cache_dir, n)) for n in os.listdir(cache_dir)
                               if n.endswith(".npy"))},
        "students": students,
        "mean_eval_ce": mean_ce,
        "seconds": timings,
    }
    results_path = os.path.join(args.output_dir, "results.json")
    if os.path.exists(results_path):  # a stage reused from an earlier invocation keeps the time it took then
        with open(results_path) as f:
            earlier = json.load(f).get("seconds", {})
        results["seconds"] = {k: v if v >= 1.0 or k not in earlier else earlier[k] for k, v in timings.items()}
    with open(results_path, "w") as f:
        json.dump(results, f, indent=2)
    print("| model | seed | unique params | steps | held-out CE | perplexity |")
    print("|---|---|---|---|---|---|")
    teacher_ce = results["teacher"]["eval_ce"]
    print(f"| teacher ({args.teacher_preset} + overrides) | {args.seed} | "
          f"{results['teacher']['unique_params'] / 1e6:.2f}M | {args.teacher_steps} | {teacher_ce:.4f} | "
          f"{math.exp(teacher_ce):.1f} |")
    for student in students:
        label = f"student, distilled (top-{args.topk} cache)" if student["distilled"] else "student, CE only"
        print(f"| {label} | {student['seed']} | {student['unique_params'] / 1e6:.2f}M | {student['steps']} | "
              f"{student['eval_ce']:.4f} | {student['eval_perplexity']:.1f} |")
    print(f"mean held-out CE over seeds {args.student_seeds}: "
          f"CE only {mean_ce['ce']:.4f}, distilled {mean_ce['kd']:.4f}")
    print("seconds per stage:", results["seconds"])
    return results


if __name__ == "__main__":
    main()
