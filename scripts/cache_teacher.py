"""Run a teacher once over prepared token shards and cache its top-k log-probs (trainer_ext.distill.caching).

    hf-recurrent-cache-teacher --teacher_model_name_or_path outputs/teacher/final \
        --data_dir outputs/data/kjv --output_dir outputs/teacher_cache/kjv --topk 64
    hf-recurrent-cache-teacher --teacher_model_name_or_path my-recurrent-teacher --num_steps 16 \
        --data_dir outputs/data/ja --output_dir outputs/teacher_cache/ja --device cuda --batch_size 4
    hf-recurrent-cache-teacher --teacher_model_name_or_path llm-jp/llm-jp-3-13b --quantization 4bit \
        --data_dir outputs/data/ja --output_dir outputs/teacher_cache/ja-13b --splits train
    hf-recurrent-cache-teacher --teacher_model_name_or_path outputs/teacher/final --teacher_cache_mode sampled \
        --topk 50 --data_dir outputs/data/kjv --output_dir outputs/teacher_cache/kjv-sampled   # 50 draws per token

(`python -m trainer_ext.cli.cache_teacher ...` is the same command.) The teacher must come with the data's
tokenizer. Cache shards sit beside the token shards' names (`train-00000.topk_ids.npy`, `...topk_logprobs.npy`);
train with `--teacher_cache_dir`. An interrupted run continues where it stopped when started again with the same
arguments; other arguments are refused unless --overwrite. Started by torchrun / accelerate launch, one process
builds the cache (on its device) while the others wait.
"""

from __future__ import annotations

import logging
import sys

from transformers import HfArgumentParser

from trainer_ext.distill.caching import CacheTeacherArguments, cache_teacher
from trainer_ext.files import launch_process_group, one_process_writes


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    (args,) = HfArgumentParser(CacheTeacherArguments).parse_args_into_dataclasses(args=argv)
    with launch_process_group(), one_process_writes(f"the teacher cache in {args.output_dir}") as writes:
        if writes:
            cache_teacher(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
