"""The step's bookkeeping of `LowMemoryAdafactor` (trainer_ext/optim/optimizer.py), read without waiting for the GPU.

Each update adds its squared gradient norm and whether it skipped a non-finite gradient to per-device totals on the
device. At the end of a step the totals are copied to pinned host memory behind an event; on GPU the newest snapshot
stays unread until the next step, when it is ready, so that training never waits for the GPU. Reading one of the
properties waits for the current step. Too many steps in a row with skips stop the run.
"""

from __future__ import annotations

import collections
import math

import torch

from trainer_ext.devices import to_host_later

__all__ = ["StepBookkeeping"]


class StepBookkeeping:
    """Mixin of the optimizer, which sets ``_num_steps`` and ``max_consecutive_skips``; ``_reset_bookkeeping`` sets
    the rest, among them ``_totals`` (per device: [sum of grad**2, skips]), where the updates add."""

    def _reset_bookkeeping(self) -> None:
        self._totals: dict[torch.device, torch.Tensor] = {}
        self._pending: collections.deque = collections.deque()
        self._last_grad_norm = float("nan")
        self._last_step_skips = 0
        self._skipped_updates = 0
        self._consecutive_skip_steps = 0

    def _finish_step(self) -> None:
        self._num_steps += 1
        on_gpu = any(device.type == "cuda" for device in self._totals)
        snapshot = [to_host_later(totals) for totals in self._totals.values()]
        self._totals = {}
        self._pending.append(snapshot)
        # Leave the newest GPU snapshot unread: reading it now would wait for the GPU.
        keep = 1 if on_gpu else 0
        while len(self._pending) > keep:
            self._resolve(self._pending.popleft())

    def _resolve(self, snapshot: list) -> None:
        grad_sq, skips = 0.0, 0
        for read in snapshot:
            host = read()
            grad_sq += float(host[0])
            skips += int(host[1])
        self._last_grad_norm = math.sqrt(grad_sq) if math.isfinite(grad_sq) else float("nan")
        self._last_step_skips = skips
        self._skipped_updates += skips
        self._consecutive_skip_steps = self._consecutive_skip_steps + 1 if skips else 0
        if self._consecutive_skip_steps >= self.max_consecutive_skips:
            raise RuntimeError(
                f"non-finite gradients in {self._consecutive_skip_steps} consecutive steps "
                f"(max_consecutive_skips={self.max_consecutive_skips}; {skips} tensor(s) in the last one); "
                "stopping training. Those updates were skipped, so the weights and the last checkpoint "
                "hold no NaN/Inf: resume from the checkpoint with a lower learning rate or check the data."
            )

    def _resolve_all(self) -> None:
        while self._pending:
            self._resolve(self._pending.popleft())

    @property
    def last_grad_norm(self) -> float:
        """L2 norm of all gradients of the last finished step (nan before the first step or when a
        gradient was not finite)."""
        self._resolve_all()
        return self._last_grad_norm

    @property
    def last_step_skips(self) -> int:
        """Number of tensors whose update was skipped in the last finished step."""
        self._resolve_all()
        return self._last_step_skips

    @property
    def skipped_updates(self) -> int:
        """Number of tensor updates skipped for non-finite gradients since construction (or resume)."""
        self._resolve_all()
        return self._skipped_updates
