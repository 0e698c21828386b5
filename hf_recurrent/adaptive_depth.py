"""Adaptive per-token depth: a token stops iterating once its state has converged.

With `exit_threshold=t` (a `forward` / `generate` keyword, or `config.exit_threshold`), the core still runs up to
`num_steps` steps for the whole batch, but a token whose state changed by less than t after a step,

    ||s_i - s_{i-1}|| / ||s_i|| < t          (exit_criterion="state": cheap, no LM head per step)

keeps s_i from then on: later steps compute it (their cache slots need its keys and values, taken from the frozen
state exactly as a full forward pass computes them, so cached decoding stays exact) but do not change it. The
model reports the steps each token used as `num_steps_used` (B, T). t = 0 never exits (fixed depth); a huge t exits
every token after one step. Masked updates, no host syncs: a compiled decode step stays one graph.

Shipped next to the weights with the modeling file (`trust_remote_code` loads it as a flat module).
"""

from dataclasses import dataclass

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

try:
    from .configuration_recurrent_depth import EXIT_CRITERIA
except ImportError:  # loaded as a flat module by `trust_remote_code`
    from configuration_recurrent_depth import EXIT_CRITERIA


def check_exit(threshold, criterion: str) -> None:
    if threshold is not None and not (isinstance(threshold, (int, float)) and threshold >= 0):
        raise ValueError(f"exit_threshold={threshold!r} must be a number >= 0 (or None for a fixed depth).")
    if criterion not in EXIT_CRITERIA:
        raise ValueError(f"exit_criterion={criterion!r} is not allowed; choose one of {list(EXIT_CRITERIA)}.")


class DepthExit:
    """The exit state of one forward pass: which tokens still iterate and how many steps each has used."""

    def __init__(self, threshold: float, shape: tuple[int, int], device: torch.device):
        self.threshold = threshold
        self.active = torch.ones(shape, dtype=torch.bool, device=device)  # (B, T)
        self.steps_used = torch.zeros(shape, dtype=torch.long, device=device)

    def step(self, state: torch.Tensor, new_state: torch.Tensor) -> torch.Tensor:
        """The state after one more step: `new_state` for active tokens, `state` (frozen) for exited ones."""
        self.steps_used += self.active
        change = (new_state - state).float().norm(dim=-1) / new_state.float().norm(dim=-1).clamp_min(1e-12)
        state = torch.where(self.active[..., None], new_state, state)
        self.active = self.active & ~(change < self.threshold)
        return state


@dataclass
class RecurrentDepthModelOutput(BaseModelOutputWithPast):
    """`num_steps_used` (B, T): core steps each token used under adaptive depth (None at a fixed depth)."""

    num_steps_used: torch.Tensor | None = None


@dataclass
class RecurrentDepthCausalLMOutput(CausalLMOutputWithPast):
    """`num_steps_used` (B, T): core steps each token used under adaptive depth (None at a fixed depth)."""

    num_steps_used: torch.Tensor | None = None
