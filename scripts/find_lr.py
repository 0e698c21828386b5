"""Find the learning rate for a production run: short constant-rate trials, the largest stable rate / margin.

    hf-recurrent-find-lr                         # debug preset, embedded corpus, CPU, about a minute
    hf-recurrent-find-lr --preset recurrent-3.3b --data_dir outputs/data/ja --bf16 \
        --per_device_train_batch_size 1 --output_dir outputs/r3b-lr
    hf-recurrent-pretrain --preset recurrent-3.3b ... --learning_rate_from outputs/r3b-lr/lr_sweep.json

Takes hf-recurrent-pretrain's model, data and training arguments (the trials use its optimizer, precision, batch
size and checkpointing, so they fit the same memory) plus the sweep's own (trainer_ext/lr_search/finder.py). The
schedule, evaluation and saving arguments of a training run are replaced by each trial's. Models under 50M
parameters get a quicker sweep around their 3e-3 default where the sweep's settings are not given. Writes
lr_sweep.json / .md / .png into --output_dir; exits 1 when no rate was stable. Run again with the same arguments,
a sweep stopped midway resumes from --output_dir/lr_sweep.progress.json (the start and the finished trials).
"""

import logging
import os
import sys

from trainer_ext.run.find_lr import find_lr, parse_find_lr_job
from trainer_ext.training.distributed import end_process_group


def main(argv=None) -> int:
    """Console entry point: 0 when a stable rate was found, 1 when none was."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    job, sweep_args = parse_find_lr_job(argv)
    result = find_lr(job, sweep_args)
    end_process_group()
    if result["learning_rate"] is None:
        smaller = [f"{rate / 10:g}" for rate in sweep_args.learning_rates[:3]]
        print(f"No stable learning rate among {[f'{r:g}' for r in sweep_args.learning_rates]} (the smallest was "
              f"unstable): try smaller rates, e.g. --learning_rates {' '.join(smaller)}. Details in "
              f"{os.path.join(job.training_args.output_dir, 'lr_sweep.md')}.", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
