"""hf-recurrent's training library, one sub-package per concern:

- `trainer_ext.data`: text sources, tokenizer, token shards (written and read in `data.shards`), data preparation
- `trainer_ext.distill`: distillation losses, teacher loading, the offline teacher cache (written and read in
  `distill.cache`) and the pipeline that fills it
- `trainer_ext.optim`: the low-memory optimizer (kernels, state accountant, in-backward hooks, momentum defaults)
- `trainer_ext.memory`: the memory planner (estimator and its calibration, the MILP plan, recompute wiring)
- `trainer_ext.training`: `RecurrentTrainer`, its arguments and defaults, the stability guard and rollback,
  callbacks, telemetry, output folders, the guards of a launch of several processes
- `trainer_ext.lr_search`: the learning-rate threshold test (trials, verdicts, the sweep's files)
- `trainer_ext.run`: from arguments to a run (`TrainingJob`), `pretrain`, `find_lr`
- `trainer_ext.evaluation`: held-out metrics, generation speed, reports and plots
- `trainer_ext.hub`: pushing checkpoints, Trainer callbacks, model cards
- `trainer_ext.comparison`: the same-data comparison against a plain Transformer, in token cycles
- `trainer_ext.cli`: the command-line scripts (the repository's `scripts/`), installed as `hf-recurrent-*`
- base modules below all of them: `files` (atomic writes), `checkpoints` (checkpoint and model folders on disk),
  `devices`, `compat` (what differs between transformers lines), `lm_head` (the chunked LM head)

The main classes are importable from here; they load on first use, so `import trainer_ext` stays cheap.
"""

import importlib

_EXPORTS = {
    "RecurrentTrainer": "trainer_ext.training.trainer",
    "RecurrentTrainingArguments": "trainer_ext.training.arguments",
    "LowMemoryAdafactor": "trainer_ext.optim.optimizer",
    "create_optimizer": "trainer_ext.optim.optimizer",
    "pretrain": "trainer_ext.run.pretrain",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'trainer_ext' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
