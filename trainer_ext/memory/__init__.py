"""The memory planner: the calibrated estimator of peak memory and step time (`estimator`, its measured
`calibration.json`), one rank's memory among several processes, data parallel or FSDP2 (`processes`), the
mixed-integer plan of batch size and recomputed layers / core steps (`plan`), the card a plan's speed is predicted for
(`device_profile`: a measured or datasheet matmul rate and host-device bandwidth) and the wiring that carries a
recompute set out in the model (`recompute`).

Imports the model, `trainer_ext.optim` (the optimizer state's bytes), `trainer_ext.distill.losses` (the loss's chunk)
and the base modules; nothing of `trainer_ext.training` or the packages above it.
"""
