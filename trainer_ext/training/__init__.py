"""The training machine: `RecurrentTrainer` (the HF Trainer with depth sampling, the in-backward optimizer and the
chunked loss), its arguments and defaults, the stability guard and its rollback, the callbacks, telemetry,
checkpoints and output folders, and the guards of a launch of several processes.

Imports `trainer_ext.optim`, `trainer_ext.memory`, `trainer_ext.distill`, the base modules and the model; nothing of
`trainer_ext.lr_search`, `trainer_ext.run` or the packages above them.
"""
