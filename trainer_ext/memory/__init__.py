"""The memory planner: the calibrated estimator of peak memory and step time (`estimator`, its measured
`calibration.json`), one rank's memory among several processes, data parallel or FSDP2 (`processes`), the
mixed-integer plan of batch size and where each layer / core step keeps its activations (`plan`, `placement`), the
card a plan's speed is predicted for (`device_profile`: a measured or datasheet matmul rate and host-device
bandwidth) and the wiring that carries a placement out in the model (`recompute`, `offload`).

Imports the model, `trainer_ext.optim` (the optimizer state's bytes), `trainer_ext.distill.losses` (the loss's chunk)
and the base modules; nothing of `trainer_ext.training` or the packages above it.
"""
