"""Updating weights inside backward: what the mode requires of a run, and the hooks that run the updates.

Each hook calls its optimizer's update as soon as a parameter's gradient is accumulated. Under
DistributedDataParallel that gradient is the process's own: there the update runs in a communication hook after its
bucket's all-reduce instead (`register_update_after_all_reduce`), on the gradient averaged over the processes, so
every replica takes the same update. The hooks reach the optimizer through a weak reference: hooks bound to it
would close a cycle (parameter, its hook table, optimizer, parameter) through the tensor's C++ side, which Python's
collector does not see, so every finished training of a process would keep its weights and optimizer state
(results/in-process-trainings). The hooks go when the optimizer does.

On one CUDA device the updates can run on a stream of their own (`update_stream`): an update's kernels are bound by
the memory's bandwidth, backward's products by arithmetic, and the update of one layer's weights then runs beside the
products of the layers before it instead of between them. Each update waits for what backward had queued when its
hook ran (its gradient), its gradient is kept from reuse until the update has read it, and the end of backward makes
the training's stream wait for every update, so that nothing after backward (the next forward, a checkpoint) reads a
weight before it is written. Measured on recurrent-3.3b (BENCHMARKS.md): 28% of the updates' time hidden, between 1%
fewer and 1.6% more tokens/s in three comparisons, and about 3 GiB more memory reserved with the same allocated (not the
updates falling behind on the GPU: neither a high-priority stream nor a bound on how far backward ran ahead of them
changed it; most likely the allocator, which hands a gradient's block out again only once the GPU has passed its
update, while the host allocates backward's next buffers well ahead of the GPU): off by default.
"""

from __future__ import annotations

import weakref

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
        self.stream = None  # the CUDA stream the updates run on (`update_stream`), or None: backward's own
        self._joined_backward = None  # the backward pass whose end waits for the updates (a backward that raised
        # never reaches its end: the next one must queue its own wait)
        weakref.finalize(update.__self__, _remove, self._handles)

    def add(self, param: torch.Tensor) -> None:
        update, hooks = self._update, weakref.ref(self)

        def hook(p: torch.Tensor) -> None:
            run = hooks()
            if run.stream is None:
                update()(p)
            else:
                run.update_beside(p, update())

        self._handles.append(param.register_post_accumulate_grad_hook(hook))

    def update_beside(self, p: torch.Tensor, update) -> None:
        """``update(p)`` on `stream`, after the work backward has queued so far; the end of this backward waits."""
        stream, main = self.stream, torch.cuda.current_stream(self.stream.device)
        stream.wait_stream(main)
        backward = torch._C._current_graph_task_id()
        if backward != self._joined_backward:
            self._joined_backward = backward
            torch.autograd.Variable._execution_engine.queue_callback(lambda: main.wait_stream(stream))
        grad = p.grad
        with torch.cuda.stream(stream):
            update(p)
        grad.record_stream(stream)  # its memory is not handed out again before the update has read it

    def remove(self) -> None:
        _remove(self._handles)


def update_stream(params, wanted: bool):
    """A CUDA stream for the in-backward updates, or None (they run on backward's stream): where ``wanted`` and every
    parameter lies on one CUDA device of a single process (a process of several has its updates after the
    all-reduce, or on FSDP2's shards, on the streams those use)."""
    import torch.distributed as dist

    devices = {p.device for p in params}
    several = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    if not wanted or several or len(devices) != 1 or next(iter(devices)).type != "cuda":
        return None
    return torch.cuda.Stream(next(iter(devices)))


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
