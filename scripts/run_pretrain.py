"""Pretrain a recurrent-depth model (or its Transformer baseline) with RecurrentTrainer.

    hf-recurrent-pretrain                        # debug preset, embedded corpus, CPU, a few minutes
    python -m scripts.run_pretrain --preset recurrent-3.3b --data_dir outputs/data/ja --bf16 \
        --max_steps 1000 --output_dir outputs/r3b     # on CUDA the memory plan picks the batch size
    accelerate launch --config_file trainer_ext/configs/accelerate_single_24gb.yaml scripts/run_pretrain.py ...
    hf-recurrent-pretrain args.json              # every argument from one .json / .yaml file

Arguments: ModelArguments, DataArguments and RecurrentTrainingArguments (trainer_ext/training/arguments.py). The
schedule (--learning_rate, --warmup_steps, --max_steps) follows the model's size where it is not given: 3e-3, 30
warm-up steps and 240 steps below 50M parameters (the CPU demo), 3e-4, 2000 warm-up steps and one epoch from there
up; --learning_rate_from takes the rate an `hf-recurrent-find-lr` sweep chose. Without --data_dir the embedded
corpus is prepared first. The final checkpoint (safetensors, config with auto_map, modeling code, tokenizer) goes
to `<output_dir>/final` and loads with `AutoModelForCausalLM.from_pretrained(...)` where this package is installed
(`import hf_recurrent`), or with `trust_remote_code=True` anywhere else.

The output directory follows transformers' run_clm.py: a non-empty --output_dir resumes from its last complete
checkpoint (incomplete ones, from a save interrupted by a kill, are passed over), one without a complete checkpoint
is refused, and --overwrite_output_dir starts afresh there. A run already at --max_steps is not resumed (nothing
would train): raise --max_steps to continue it. Every argument is checked before data preparation writes anything.
"""

import logging
import sys

from trainer_ext.run.pretrain import parse_pretrain_job, pretrain
from trainer_ext.training.distributed import end_process_group


def main(argv=None) -> int:
    """Console entry point: 0 after a successful run (a failure raises, which exits non-zero)."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    pretrain(parse_pretrain_job(argv))
    end_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
