"""Extra optimizer state of each optimizer configuration, from a model's real parameter shapes.

"Extra" is what training holds beyond the bf16 weights and the gradients: an fp32 master copy of each weight
(the mixed-precision reference keeps one; LowMemoryAdafactor updates bf16 weights in place and keeps none), the
first moment, the second moment and per-tensor step counters. A configuration is given by its name (see
``OPTIMIZER_STATES``) or as an ``OptimizerState``. Shapes come from a model built on the meta device, so a
7B-class figure costs no memory and counts exactly the tensors the optimizer would see (tied weights once).
"""

from __future__ import annotations

import copy
import math
from dataclasses import dataclass

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PretrainedConfig

from trainer_ext.optim.optimizer import SUBSPACE_MOMENTUM_FRACTION, subspace_rank

__all__ = ["OPTIMIZER_STATES", "OptimizerState", "low_memory_state", "optimizer_state_bytes", "optimizer_state_gib",
           "state_gib_for_preset"]

GIB = 2**30


@dataclass(frozen=True)
class OptimizerState:
    """Bytes the optimizer stores, per element of a parameter or per parameter tensor.

    master_weight_bytes: an fp32 copy of each weight (0: the bf16 weights are updated in place).
    first_moment_bytes: momentum, per element (0: no first moment).
    factored_second_moment: matrices (ndim >= 2) keep row and column statistics over the last two dimensions
        (LowMemoryAdafactor and Adafactor); 1-D tensors always keep a full second moment.
    second_moment_bytes: per stored second-moment value.
    step_bytes: a device step counter per tensor (LowMemoryAdafactor keeps an fp32 scalar; torch AdamW keeps its
        step on the host unless fused or capturable, so it costs the GPU nothing).
    momentum_rank_fraction: subspace momentum (LowMemoryAdafactor): a 2-D (R, C) weight keeps its first moment as
        (R, r), r = subspace_rank, plus an fp32 basis (C, r); other tensors keep full momentum.
    """

    master_weight_bytes: int
    first_moment_bytes: int
    factored_second_moment: bool
    second_moment_bytes: int = 4
    step_bytes: int = 0
    momentum_rank_fraction: float | None = None

    def tensor_bytes(self, shape: torch.Size | tuple[int, ...]) -> int:
        """Extra state held for one parameter of this shape (an empty tensor gets none)."""
        numel = math.prod(shape)
        if numel == 0:
            return 0
        if self.factored_second_moment and len(shape) >= 2:
            leading = math.prod(shape[:-2])
            second_moment_values = leading * shape[-2] + leading * shape[-1]  # row + column statistics
        else:
            second_moment_values = numel
        first_moment = numel * self.first_moment_bytes
        if self.first_moment_bytes and self.momentum_rank_fraction is not None and len(shape) == 2:
            rank = subspace_rank(shape, self.momentum_rank_fraction)
            first_moment = shape[0] * rank * self.first_moment_bytes + shape[1] * rank * 4  # momentum + fp32 basis
        return (numel * self.master_weight_bytes + first_moment
                + second_moment_values * self.second_moment_bytes + self.step_bytes)


def low_memory_state(momentum: float | None, rank_fraction: float | None) -> OptimizerState:
    """LowMemoryAdafactor's state for bf16 weights at a resolved beta1 (None: no momentum) and rank fraction (None:
    full momentum): fp32 statistics and step counters, momentum in the weights' dtype, no master copy."""
    return OptimizerState(master_weight_bytes=0, first_moment_bytes=2 if momentum else 0, factored_second_moment=True,
                          step_bytes=4, momentum_rank_fraction=rank_fraction)


# The configurations the optimizer-quality benchmark compares.
OPTIMIZER_STATES: dict[str, OptimizerState] = {
    # torch AdamW with fp32 master weights: the quality reference.
    "adamw_fp32": OptimizerState(master_weight_bytes=4, first_moment_bytes=4, factored_second_moment=False),
    # HF Adafactor (no first moment) needs fp32 weights: it upcasts bf16 weights with p.float() every step.
    "hf_adafactor": OptimizerState(master_weight_bytes=4, first_moment_bytes=0, factored_second_moment=True),
    # LowMemoryAdafactor without momentum (--optimizer_momentum 0).
    "low_memory": low_memory_state(None, None),
    # LowMemoryAdafactor with full bf16 momentum (the default below 2B parameters).
    "low_memory_momentum": low_memory_state(0.9, None),
    # LowMemoryAdafactor with bf16 subspace momentum (the default from 2B parameters up).
    "low_memory_7b": low_memory_state(0.9, SUBSPACE_MOMENTUM_FRACTION),
}


def _parameter_shapes(model_or_config: nn.Module | PretrainedConfig) -> list[torch.Size]:
    if isinstance(model_or_config, nn.Module):
        model = model_or_config
    elif isinstance(model_or_config, PretrainedConfig):
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(model_or_config))
    else:
        raise ValueError(f"Expected a model or a transformers config, got {type(model_or_config).__name__}.")
    return [p.shape for p in model.parameters() if p.requires_grad]  # shared (tied) tensors are listed once


def _resolve(optimizer: str | OptimizerState) -> OptimizerState:
    if isinstance(optimizer, OptimizerState):
        return optimizer
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} is not a known configuration; choose one of "
                         f"{sorted(OPTIMIZER_STATES)} or pass an OptimizerState.")
    return OPTIMIZER_STATES[optimizer]


def optimizer_state_bytes(model_or_config: nn.Module | PretrainedConfig, optimizer: str | OptimizerState) -> int:
    """Extra optimizer state in bytes for the trainable parameters of a model (or of a config's model)."""
    state = _resolve(optimizer)
    return sum(state.tensor_bytes(shape) for shape in _parameter_shapes(model_or_config))


def optimizer_state_gib(model_or_config: nn.Module | PretrainedConfig, optimizer: str | OptimizerState) -> float:
    """``optimizer_state_bytes`` in GiB (2**30 bytes)."""
    return optimizer_state_bytes(model_or_config, optimizer) / GIB


def state_gib_for_preset(optimizer: str | OptimizerState, preset: str = "recurrent-7b") -> float:
    """Extra optimizer state of a named preset (vocabulary as in the preset) in GiB, e.g. ``state_gib_recurrent_7b``."""
    from hf_recurrent import presets

    return optimizer_state_gib(presets.get(preset), optimizer)
