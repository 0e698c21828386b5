"""The low-memory optimizer: `LowMemoryAdafactor` (factored second moment, bf16 weights updated in place with
stochastic rounding, the update inside backward), its torch and Triton kernels, the accountant of its state's bytes,
the in-backward hooks and the momentum defaults.

Imports only the model (`hf_recurrent`) and the library's base modules (`trainer_ext.devices`); nothing of
`trainer_ext.training`, `trainer_ext.memory` or the packages above them.
"""
