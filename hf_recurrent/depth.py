"""Training-time depth sampling: the `num_steps` of each optimizer step.

A draw is a pure function of (seed, step): resuming at step s reproduces the depths of an uninterrupted run
without saving any sampler state.
"""

import math

import torch

from .configuration_recurrent_depth import RecurrentDepthConfig


class DepthSampler:
    def __init__(self, config: RecurrentDepthConfig, seed: int = 0):
        self.mean = config.mean_recurrence
        self.distribution = config.depth_distribution
        self.sigma = config.depth_sigma
        self.warmup_steps = config.depth_warmup_steps
        self.max_num_steps = config.max_recurrence or 4 * config.mean_recurrence
        self.seed = seed

    def mean_at(self, step: int) -> float:
        """The mean depth at optimizer step `step`: 1 -> `mean` linearly over the curriculum, then `mean`."""
        if step >= self.warmup_steps:
            return float(self.mean)
        return 1 + (self.mean - 1) * step / self.warmup_steps

    def __call__(self, step: int) -> int:
        """`num_steps` for optimizer step `step`: `fixed`, or Huginn's log-normal Poisson (n = 1 + Poisson(exp(tau)),
        tau ~ N(log(mean - 1) - sigma^2 / 2, sigma), so E[n] = mean)."""
        mean = self.mean_at(step)
        if self.distribution == "fixed" or mean - 1 < 1e-6:
            return max(1, round(mean))
        generator = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        mu = math.log(mean - 1) - self.sigma**2 / 2
        tau = torch.normal(mu, self.sigma, (1,), generator=generator).exp()
        num_steps = 1 + int(torch.poisson(tau, generator=generator).item())
        return min(num_steps, self.max_num_steps)
