"""hf-recurrent's training library, one sub-package per concern:

- `trainer_ext.data`: text sources, tokenizer, token shards (written and read in `data.shards`), data preparation
- `trainer_ext.distill`: distillation losses, teacher loading, the offline teacher cache (written and read in
  `distill.cache`) and the pipeline that fills it
- `trainer_ext.training`: arguments and defaults, `RecurrentTrainer`, the low-memory optimizer, stability guard,
  telemetry, checkpoints and output folders, the learning-rate threshold test, `pretrain`
- `trainer_ext.evaluation`: held-out metrics, generation speed, reports and plots
- `trainer_ext.hub`: pushing checkpoints, Trainer callbacks, model cards
- `trainer_ext.comparison`: the same-data comparison against a plain Transformer, in token cycles
- `trainer_ext.cli`: the command-line scripts (the repository's `scripts/`), installed as `hf-recurrent-*`

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
