"""Updating weights inside backward: what the mode requires of a run, and the hooks that run the updates.

Each hook calls its optimizer's update as soon as a parameter's gradient is accumulated. Under
DistributedDataParallel that gradient is the process's own: there the update runs in a communication hook after its
bucket's all-reduce instead (`register_update_after_all_reduce`), on the gradient averaged over the processes, so
every replica takes the same update. The hooks reach the optimizer through a weak reference: hooks bound to it
would close a cycle (parameter, its hook table, optimizer, parameter) through the tensor's C++ side, which Python's
collector does not see, so every finished training of a process would keep its weights and optimizer state
(results/in-process-trainings). The hooks go when the optimizer does.
"""

from __future__ import annotations

import collections
import functools
import weakref
from collections.abc import Callable

import torch


def check_gradient_accumulation(gradient_accumulation_steps: int, in_backward: bool = True) -> None:
    """Raise ValueError if ``gradient_accumulation_steps`` cannot be used (in backward: only 1)."""
    if not isinstance(gradient_accumulation_steps, int) or gradient_accumulation_steps < 1:
        raise ValueError(
            f"gradient_accumulation_steps must be an integer >= 1, got {gradient_accumulation_steps!r}"
        )
    if in_backward and gradient_accumulation_steps != 1:
        raise ValueError(
            f"gradient_accumulation_steps={gradient_accumulation_steps} is not supported with "
            "in_backward=True: each weight is updated as soon as its gradient is ready, so gradients "
            "cannot be summed over micro-batches. Use a larger per-device batch size, or set "
            "in_backward=False."
        )


class BackwardHooks:
    """Post-accumulate-grad hooks calling ``update(param)``, a bound method held by weak reference and removed when
    its object is collected (or by ``remove``)."""

    def __init__(self, update):
        self._update = weakref.WeakMethod(update)
        self._handles: list = []
        weakref.finalize(update.__self__, _remove, self._handles)

    def add(self, param: torch.Tensor) -> None:
        update = self._update

        def hook(p: torch.Tensor) -> None:
            update()(p)

        self._handles.append(param.register_post_accumulate_grad_hook(hook))

    def remove(self) -> None:
        _remove(self._handles)


# Gradients an update stream may hold beyond its newest before backward's stream waits for the oldest update.
UPDATE_STREAM_HELD_BYTES = 256 * 2**20


class UpdateStream:
    """A device's in-backward updates on a CUDA stream of their own, beside backward's kernels: the updates are
    memory-bound and backward's matrix products compute-bound, so on one stream the products wait for every update
    and on two the device runs both at once.

    Each update first waits for everything backward issued so far (its gradient among it). The gradient is held
    until the update's event has passed, then dropped: the caching allocator may then hand its block to backward
    again. Gradients held beyond the newest are bounded by ``max_held_bytes``: past it, backward's stream waits for
    the oldest update (nothing waits on the host). ``join`` makes backward's stream wait for every update and drops
    the rest; the optimizer calls it when backward ends and before its step's bookkeeping reads the totals."""

    def __init__(self, stream, current_stream: Callable, max_held_bytes: int):
        self.stream = stream
        self._current_stream = current_stream  # the stream backward runs on, when called
        self._held: collections.deque = collections.deque()  # (event, gradient, bytes), oldest first
        self._held_bytes = 0
        self.max_held_bytes = max_held_bytes

    def run(self, update: Callable[[], None], grad: torch.Tensor) -> None:
        compute = self._current_stream()
        self.stream.wait_stream(compute)
        with torch.cuda.stream(self.stream):
            update()
        size = grad.numel() * grad.element_size()
        self._held.append((self.stream.record_event(), grad, size))
        self._held_bytes += size
        while self._held:
            event, _, oldest_size = self._held[0]
            if not event.query():
                if len(self._held) == 1 or self._held_bytes - size <= self.max_held_bytes:
                    break
                compute.wait_event(event)
            self._held.popleft()
            self._held_bytes -= oldest_size

    def join(self) -> None:
        self._current_stream().wait_stream(self.stream)
        self._held.clear()
        self._held_bytes = 0

    @property
    def held_bytes(self) -> int:
        return self._held_bytes


class UpdateStreams:
    """The update stream of each device (created at its first update), joined when backward ends: a callback queued
    on the autograd engine at the first update of each backward."""

    def __init__(self, max_held_bytes: int = UPDATE_STREAM_HELD_BYTES):
        self._streams: dict[torch.device, UpdateStream] = {}
        self._join_queued = False
        self.max_held_bytes = max_held_bytes

    def run(self, device: torch.device, update: Callable[[], None], grad: torch.Tensor) -> None:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = UpdateStream(
                torch.cuda.Stream(device), functools.partial(torch.cuda.current_stream, device), self.max_held_bytes)
        stream.run(update, grad)
        if not self._join_queued:
            torch.autograd.Variable._execution_engine.queue_callback(self.join)
            self._join_queued = True

    def join(self) -> None:
        """Make the streams that run backward wait for every update (backward's end, the optimizer's step)."""
        self._join_queued = False
        for stream in self._streams.values():
            stream.join()

    def __len__(self) -> int:
        return len(self._streams)


def _remove(handles: list) -> None:
    for handle in handles:
        handle.remove()
    handles.clear()


def register_update_after_all_reduce(ddp_model, update) -> None:
    """A DDP communication hook on `ddp_model` that averages each gradient bucket over the processes (as DDP's
    default hook does) and then calls ``update(param, averaged_grad)`` for each parameter of the bucket, a bound
    method held by weak reference like the post-accumulate-grad hooks' (the model holds the hook).

    The all-reduces of later buckets overlap with the rest of backward, as in plain DDP; the updates of a bucket run
    once its own all-reduce is done. DDP then copies the averaged bucket into the parameters' `.grad` (the step's
    `zero_grad` clears them): unlike a single process, gradients exist in full, in DDP's buckets, until the step
    ends.
    """
    import torch.distributed as dist

    def average_then_update(state, bucket):  # state: the weakly held update
        group = dist.group.WORLD
        buffer = bucket.buffer().div_(dist.get_world_size(group))
        reduced = dist.all_reduce(buffer, group=group, async_op=True).get_future()

        def update_bucket(future):
            averaged = future.value()[0]
            run = state()
            if run is not None:
                for param, grad in zip(bucket.parameters(), bucket.gradients()):
                    run(param, grad)  # the optimizer's update runs under no_grad
            return averaged

        return reduced.then(update_bucket)

    ddp_model.register_comm_hook(weakref.WeakMethod(update), average_then_update)
