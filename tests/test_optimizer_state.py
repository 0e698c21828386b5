"""Tests of the optimizer-state accountant: hand counts and the real optimizers' state on the debug preset, and the
recurrent-7b figures on the meta device."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_recurrent import presets
from hf_recurrent.cost import parameter_counts
from trainer_ext.optim.optimizer import SUBSPACE_MOMENTUM_FRACTION, LowMemoryAdafactor
from trainer_ext.optim.state import (
    OPTIMIZER_STATES,
    OptimizerState,
    optimizer_state_bytes,
    state_gib_for_preset,
)


def _debug_model(dtype):
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(presets.get("debug")).to(dtype)


def _step_with_zero_gradients(model, optimizer):
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    optimizer.step()


def test_debug_preset_matches_a_hand_count_over_the_tensors():
    model = _debug_model(torch.bfloat16)
    numel = factored = tensors = 0
    for p in model.parameters():
        numel += p.numel()
        tensors += 1
        # matrices: one fp32 value per row and per column; vectors: one per element
        factored += p.shape[0] + p.shape[1] if p.ndim == 2 else p.numel()
    assert all(p.ndim <= 2 for p in model.parameters())
    assert optimizer_state_bytes(model, "adamw_fp32") == 12 * numel
    assert optimizer_state_bytes(model, "hf_adafactor") == 4 * numel + 4 * factored
    assert optimizer_state_bytes(model, "low_memory") == 4 * factored + 4 * tensors
    assert optimizer_state_bytes(model, "low_memory_momentum") == 2 * numel + 4 * factored + 4 * tensors
    # the config path builds the same model on the meta device
    for name in OPTIMIZER_STATES:
        assert optimizer_state_bytes(presets.get("debug"), name) == optimizer_state_bytes(model, name)


@pytest.mark.parametrize("name, momentum, fraction", [("low_memory", None, None), ("low_memory_momentum", 0.9, None),
                                                      ("low_memory_7b", 0.9, SUBSPACE_MOMENTUM_FRACTION)])
def test_low_memory_figures_equal_the_optimizers_real_state(name, momentum, fraction):
    model = _debug_model(torch.bfloat16)
    optimizer = LowMemoryAdafactor(model.parameters(), lr=1e-3, momentum=momentum, momentum_rank_fraction=fraction,
                                   compile=False)
    _step_with_zero_gradients(model, optimizer)
    assert optimizer.state_bytes() == optimizer_state_bytes(model, name)


def test_adamw_figure_equals_fp32_master_weights_plus_torch_adamw_moments():
    model = _debug_model(torch.float32)  # the fp32 weights stand for the master copy
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    _step_with_zero_gradients(model, optimizer)
    moments = sum(state[key].numel() * state[key].element_size()
                  for state in optimizer.state.values() for key in ("exp_avg", "exp_avg_sq"))
    master = sum(p.numel() * p.element_size() for p in model.parameters())
    assert optimizer_state_bytes(model, "adamw_fp32") == moments + master


def test_recurrent_7b_figures():
    num_params = parameter_counts(presets.get("recurrent-7b")).unique
    momentum_gb = optimizer_state_bytes(presets.get("recurrent-7b"), "low_memory_momentum") / 1e9
    # The cost quoted for the bf16 momentum at 7B is 13.8 GB (2 bytes x 6.95B parameters + factored state).
    assert momentum_gb == pytest.approx(13.8, rel=0.01)
    assert state_gib_for_preset("low_memory") < 0.05  # factored statistics: megabytes
    assert state_gib_for_preset("adamw_fp32") == pytest.approx(12 * num_params / 2**30)
    # The 7B-class configuration: subspace momentum (bf16, 1/16 of the rank) and its fp32 bases, under 2 GiB.
    assert 1.0 < state_gib_for_preset("low_memory_7b") <= 2.0


def test_unknown_configuration_and_custom_state():
    with pytest.raises(ValueError, match="low_memory"):
        optimizer_state_bytes(presets.get("debug"), "adamw")
    with pytest.raises(ValueError, match="config"):
        optimizer_state_bytes("debug", "low_memory")
    custom = OptimizerState(master_weight_bytes=0, first_moment_bytes=1, factored_second_moment=True)
    assert custom.tensor_bytes((3, 4, 5)) == 60 + 4 * (12 + 15)
    assert custom.tensor_bytes((0, 5)) == 0
