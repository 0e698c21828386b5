"""The learning-rate threshold test: short constant-rate trials on the same batches (`trials`), the verdicts and the
choice of a rate (`finder`), and the sweep's files (`sweep_file`: lr_sweep.json / .md / .png and the progress file,
written and read there).

Imports `trainer_ext.training` (the trials train with `RecurrentTrainer`), the base modules and the model; nothing of
`trainer_ext.run` or the packages above it.
"""
