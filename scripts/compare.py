"""Same-data comparison: a recurrent-depth model against a Transformer baseline, trained in token cycles.

    # debug presets on the embedded corpus, three small cycles (CPU, minutes):
    hf-recurrent-compare --cycle_tokens 200_000 --seq_len 128 --eval_tokens 20_000 --num_cycles 3
    hf-recurrent-compare --recurrent_preset recurrent-125m --baseline_preset transformer-125m \
        --dataset uonlp/CulturaX --dataset_config ja --tokenizer llm-jp/llm-jp-3-1.8b --seq_len 2048 \
        --cycle_tokens 200_000_000 --num_cycles 5 --per_device_train_batch_size 8 \
        --learning_rate 3e-4 --bf16 --output_dir outputs/compare-125m \
        --push_to_hub --hub_model_id me/recurrent-125m-ja

Every cycle takes the next `--cycle_tokens` training tokens of one data stream (the embedded corpus, `--files`
or `--dataset`) and prepares them, trains the recurrent model (cycle 1 from `--recurrent_preset`, later cycles
continuing the previous cycle's training), trains the baseline (`--baseline_preset`, a LlamaForCausalLM) on the same
tokens in the same order with the same seed, and with `--compute_baseline_preset` a second baseline (e.g.
transformer-125m-compute, of equal training FLOPs per token, beside transformer-125m), evaluates every model on one
fixed held-out set (the recurrent one at each of `--eval_depths`) into results.jsonl / results.md /
learning_curves.png / compute_curves.png, and deletes the cycle's shards. The held-out set is the first
`--eval_tokens` tokens of the stream; no cycle trains on it.

Training options: any flag of hf-recurrent-pretrain's model, data and training arguments (`--learning_rate`,
`--warmup_steps`, `--bf16`, `--optimizer`, `--teacher_model_name_or_path`, ...) applies to every training;
`--recurrent_learning_rate` / `--baseline_learning_rate` set one model's learning rate. Each model's cycles are
one training: a cycle resumes the previous one's last checkpoint (weights, optimizer state, learning-rate schedule,
RNG states), and one schedule (cosine unless `--lr_scheduler_type` says otherwise) spans all cycles of the run's
first start, warming up once (30 steps unless `--warmup_steps` says otherwise), so N cycles train as one
uninterrupted run over the same tokens. A learning rate left unset follows hf-recurrent-pretrain's rule for the
model's size; each training logs the schedule it continues. Options the comparison sets per cycle (`--max_steps`,
`--model_name_or_path`, `--data_dir`, `--save_only_model`, ...) are refused.

Resuming: progress lives in `<output_dir>/compare_state.json`. Killed at any point, the same command continues
where it stopped. A different command against the same output directory raises ValueError unless `--overwrite`
(which discards the old run); the hub options and `--num_cycles` may change between runs: fewer cycles run under the
planned schedule, more extend a finished run only where the rate does not depend on the schedule's length
(`--lr_scheduler_type constant_with_warmup`, warm-up in steps; each model's last checkpoint stays for that). A
directory of a version whose cycles each restarted the optimizer is refused (`--overwrite` starts it again).

`--push_to_hub --hub_model_id me/name` pushes each cycle's final checkpoints (recurrent to `me/name`, baseline
to `me/name-baseline` or `--hub_baseline_model_id`, the second baseline to `me/name-compute-baseline`) with their
model cards, in the background while the next cycle trains; commits are named after the cycle ("cycle 2: 400M
tokens"). Pushes that did not finish are retried by the next start of the same command. The token comes from
`HF_TOKEN` or the stored login.

Distillation applies to every model: online with `--teacher_model_name_or_path`, or offline with
`--teacher_cache_model TEACHER`, which caches the teacher's top-k log-probs over each cycle's shards (the data
must then use the teacher's tokenizer: `--tokenizer TEACHER`).

Under `torchrun --nproc_per_node N scripts/compare.py ...` (or accelerate launch) the trainings run data-parallel
on the N processes, each step over N x `--per_device_train_batch_size` x `--gradient_accumulation_steps` samples;
one process prepares, caches the teacher, evaluates and writes the state and results while the others wait. The
number of processes is part of the run: a run continues under the number it started with.
"""

import logging
import sys

from trainer_ext.comparison.arguments import parse_args
from trainer_ext.comparison.pipeline import ComparisonRun
from trainer_ext.training.distributed import end_process_group


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ComparisonRun(*parse_args(argv)).run()
    end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
