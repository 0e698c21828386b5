"""Adaptive per-token depth: a token stops iterating once its state has converged.

With `exit_threshold=t` (a `forward` / `generate` keyword, or `config.exit_threshold`), the core runs up to
`num_steps` steps, and a token whose state changed by less than t after a step,

    ||s_i - s_{i-1}|| / ||s_i|| < t          (exit_criterion="state": cheap, no LM head per step)

keeps s_i from then on. The model reports the steps each token used as `num_steps_used` (B, T). t = 0 never exits
(fixed depth); a huge t exits every token after one step.

While some token of the call still iterates, the exited ones are computed at every step but not changed (masked):
later steps' cache slots need their keys and values, taken from the frozen state exactly as a full forward pass
computes them, so cached decoding stays exact. Once every token of the call has exited (typical in batch-1
decoding), the steps left change no state and are skipped where that is exact (`DepthExit.steps`):

- no cache: the loop stops; a token that exits after j steps costs j core passes instead of n.
- `kv_cache_mode="shared"`: only the last step runs, which writes the shared slot with keys and values from the
  frozen state (earlier steps only read the cache): j + 1 passes. This is the mode where exits save compute.
- `kv_cache_mode="per_step"`: every later step's slot needs the token's keys and values at that step, so nothing
  is skipped.

Skipped steps record the frozen state in `hidden_states` (as the masked steps do: same values, length 1 + P + n + C).
Deciding "all exited" syncs with the host once per step, so it is made only without autograd (`generate`,
evaluation under `no_grad` / `inference_mode`), outside `torch.compile` (a compiled decode step stays one graph,
masked) and without `output_attentions` (skipped steps would leave out their attention weights). Outputs, the cache
and `num_steps_used` equal the masked path's; `SKIP_EXITED_STEPS = False` forces the masked path.

Shipped next to the weights with the modeling file (`trust_remote_code` loads it as a flat module).
"""

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

try:
    from .configuration_recurrent_depth import EXIT_CRITERIA
except ImportError:  # loaded as a flat module by `trust_remote_code`
    from configuration_recurrent_depth import EXIT_CRITERIA

SKIP_EXITED_STEPS = True  # False: run every step masked, even once all tokens have exited (for comparisons)


def check_exit(threshold, criterion: str) -> None:
    if threshold is not None and not (isinstance(threshold, (int, float)) and threshold >= 0):
        raise ValueError(f"exit_threshold={threshold!r} must be a number >= 0 (or None for a fixed depth).")
    if criterion not in EXIT_CRITERIA:
        raise ValueError(f"exit_criterion={criterion!r} is not allowed; choose one of {list(EXIT_CRITERIA)}.")


class DepthExit:
    """The exit state of one forward pass: which tokens still iterate and how many steps each has used.
    `cache_mode`: the call's `kv_cache_mode`, None without a cache (which steps `steps` may skip)."""

    def __init__(self, threshold: float, shape: tuple[int, int], device: torch.device, cache_mode: str | None = None):
        self.threshold = threshold
        self.cache_mode = cache_mode
        self.active = torch.ones(shape, dtype=torch.bool, device=device)  # (B, T)
        self.steps_used = torch.zeros(shape, dtype=torch.long, device=device)

    def step(self, state: torch.Tensor, new_state: torch.Tensor) -> torch.Tensor:
        """The state after one more step: `new_state` for active tokens, `state` (frozen) for exited ones."""
        self.steps_used += self.active
        change = (new_state - state).float().norm(dim=-1) / new_state.float().norm(dim=-1).clamp_min(1e-12)
        state = torch.where(self.active[..., None], new_state, state)
        self.active = self.active & ~(change < self.threshold)
        return state

    def steps(self, num_steps: int, hidden_states: list | None, attentions: list | None) -> Iterable[int]:
        """The core steps (0-based) to run: all `num_steps`, or fewer once every token has exited, where that is
        exact (module docstring). `hidden_states` (the forward's list, or None) gets the frozen state once per
        skipped step; collected `attentions` keep every step."""
        skip = (SKIP_EXITED_STEPS and self.cache_mode != "per_step" and attentions is None
                and not torch.is_grad_enabled() and not torch.compiler.is_compiling())
        return self._skipping_steps(num_steps, hidden_states) if skip else range(num_steps)

    def _skipping_steps(self, num_steps: int, hidden_states: list | None) -> Iterator[int]:
        last = num_steps if self.cache_mode is None else num_steps - 1  # the shared cache's writing step runs
        step = 0
        while step < num_steps:
            yield step
            step += 1
            if step < last and not bool(self.active.any()):  # a host sync, once per step
                if hidden_states is not None:  # the last entry is the state just recorded: the frozen one
                    hidden_states += [hidden_states[-1]] * (last - step)
                step = last


@dataclass
class RecurrentDepthModelOutput(BaseModelOutputWithPast):
    """`num_steps_used` (B, T): core steps each token used under adaptive depth (None at a fixed depth)."""

    num_steps_used: torch.Tensor | None = None


@dataclass
class RecurrentDepthCausalLMOutput(CausalLMOutputWithPast):
    """`num_steps_used` (B, T): core steps each token used under adaptive depth (None at a fixed depth)."""

    num_steps_used: torch.Tensor | None = None
