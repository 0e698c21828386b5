"""From arguments to a run: `job` resolves a training's parsed arguments into one `TrainingJob` (every decision
taken and checked once, before any work), `pretrain` and `find_lr` run a job, `model_setup` builds what a job
trains (the config overrides, the model, the data's tokenizer, the online teacher).

Imports `trainer_ext.training`, `trainer_ext.lr_search` (the sweep file a run takes its rate from),
`trainer_ext.memory`, `trainer_ext.hub`, `trainer_ext.distill`, the base modules and the model; the comparison and
the command-line scripts are built on it.
"""
