"""Evaluate checkpoints on held-out shards: CE, perplexity, top-1/top-5 and generation speed per depth.

    hf-recurrent-evaluate --checkpoints outputs/r3b/final outputs/t3b/final --labels ours baseline \
        --data_dir outputs/data/ja --max_samples 256 --output_dir outputs/eval

(or `python scripts/evaluate_checkpoints.py ...`). A recurrent-depth checkpoint is evaluated at every `--depths`
value, a fixed-depth baseline (e.g. LlamaForCausalLM) at its one depth; for recurrent checkpoints the cost of the
`shared` KV cache against the exact `per_step` cache is measured too (`--cache_cost_samples 0` skips it), and
`--exit_thresholds 0.01 0.003` adds adaptive depth: mean core steps per token against the deepest `--depths` value and
the CE difference to that fixed depth. Writes
to `--output_dir`: results.json, results.md (metrics as rows, model / depth as columns) and the plots
quality_vs_depth.png and speed_vs_depth.png. A single .json or .yaml argument is read as the arguments file.
"""

import logging
import sys

from trainer_ext.evaluation.checkpoints import EvaluateArguments, evaluate_checkpoints
from trainer_ext.evaluation.report import render_report
from trainer_ext.run.job import parse_args_with_defaults


def parse_args(argv=None) -> EvaluateArguments:
    """The arguments of a command line (sys.argv without `argv`) or of one .json / .yaml file."""
    (args,) = parse_args_with_defaults((EvaluateArguments,), argv, command_line_defaults={})
    return args


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    report = evaluate_checkpoints(parse_args(argv))
    print(render_report(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
