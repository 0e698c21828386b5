"""Activation offload and selective recomputation: the two placements beside keep and recompute.

`OffloadActivations` is a `torch.autograd.graph.saved_tensors_hooks` context: the tensors autograd saves for backward
inside it move to pinned host memory on a copy stream of their own as they are saved (the compute stream goes on), and
come back in backward on that stream, a layer application's ahead: when backward first unpacks a tensor of one
application, the offloaded tensors of the application before it are fetched (backward runs the applications in reverse
order), so at most two applications' tensors are on the device, the plan's window. (Prefetching one tensor per unpack
ran away: the unpacks of tensors kept on the device fetched ahead too, and an H100's offload probe held 106 fetched
tensors, 5 GiB, half-way through backward.) No block changes hands between the streams' pools of the caching allocator
(with `record_stream` and device blocks allocated on the copy stream, 16 compiled MLP blocks on an H100 held 1.4 GiB
allocated in 20 GiB reserved, against 12 GiB reserved when keeping everything): a saved tensor is held until its copy is
known done (its event, or the compute stream's wait at a layer boundary) and then released on the compute stream; a
tensor coming back is allocated on the compute stream, which the copy waits for. One still on its way out when backward
asks for it is used as it is. Tensors under `min_bytes` (scalars, indices, norms' statistics) stay where they are: their
copies would cost more launches than they free. So do parameters and views of them (the weights a matrix product saves
for its input's gradient): the device keeps them anyway, so a host copy frees nothing, and the copy back is a second
device copy of the weight and as many bytes moved each way as the layer's activations at a batch of a few thousand
tokens. On a CPU the "host" copy is a plain copy, so the bookkeeping and the gradients are tested anywhere.
Host memory in use is bounded (`max_host_bytes`): a tensor that would pass it stays on the device, and the
forward's host memory is then spent (`exhausted`): `OffloadedForward` recomputes the forward's later offloaded layer
applications instead (their input alone stays on the device, less than the plan's window holds), so a forward that
runs out of host memory is slower than its plan but needs no more device memory. Under WSL2 the pinned memory a CUDA
application can hold is limited (NVIDIA's CUDA on WSL notes) and the VM has only part of the machine's RAM, which is
why the bound exists. Where pinning is refused all the same, the tensor stays on the device, the forward's host memory
is spent, the bound becomes what was pinned for every later forward (the allocator's cached pinned blocks serve them),
and a warning names the flag to lower.

`selective_policy` is the recomputation that keeps the expensive outputs: under `torch.utils.checkpoint` with
`create_selective_checkpoint_contexts`, the outputs of matrix products and attention are saved and everything else
(norms, activations, rotary, residual adds) is recomputed in backward: most of a layer's FLOPs are not repeated, for
part of its memory.

The model's layers reach both through `recompute.RecomputeSet.apply`: `selective_checkpoint` and `OffloadedForward`
become the checkpoint functions of the applications the plan places so. torchtune's `OffloadActivations` and
torchtitan's selective op checkpointing are the patterns followed.
"""

from __future__ import annotations

import bisect
import functools
import logging

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

logger = logging.getLogger(__name__)

MIN_OFFLOAD_BYTES = 1 << 20  # smaller saved tensors stay on the device: their copies cost more than they free

# Ops whose outputs selective recomputation saves: the matrix products and attention (their FLOPs), not the cheap
# elementwise ops around them.
SAVED_OPS = frozenset(getattr(torch.ops.aten, name).default for name in (
    "mm", "addmm", "bmm", "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")
    if hasattr(torch.ops.aten, name))


def _policy(ctx, op, *args, **kwargs):
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context():
    """The `context_fn` of `torch.utils.checkpoint.checkpoint` that saves the outputs of SAVED_OPS only."""
    return create_selective_checkpoint_contexts(_policy)


def selective_checkpoint(function, *args, **kwargs):
    """`function(*args, **kwargs)` recomputed in backward but for the outputs of SAVED_OPS (the checkpoint function
    of an eager layer placed selective)."""
    return checkpoint(function, *args, use_reentrant=False, context_fn=selective_context, **kwargs)


@functools.cache
def compiled_selective_checkpoint(mode: str = "default", backend: str = "inductor"):
    """`selective_checkpoint` under `torch.compile`, the checkpoint function of a compiled layer placed selective: the
    compiled region then holds the checkpoint, and the partitioner applies the policy to the traced graph (saves the
    products' outputs, recomputes the rest). transformers 5.17 calls the checkpoint function around the compiled layer
    (its `__call__`; later 5.x checkpoint `forward`, inside it): there the plain function's policy saw none of the
    layer's ops and the whole forward ran again (0.95 of a full recompute's time on an H100). One compilation serves
    every layer of a shape (the layer is an input of the graph)."""
    return torch.compile(selective_checkpoint, mode=mode, backend=backend)


def _is_parameter(tensor: torch.Tensor) -> bool:
    """A parameter or a view of one (module docstring: such saved tensors stay on the device)."""
    return isinstance(tensor, torch.nn.Parameter) or isinstance(tensor._base, torch.nn.Parameter)


class OffloadActivations(torch.autograd.graph.saved_tensors_hooks):
    """Saved tensors of at least `min_bytes` go to host memory while the forward runs and come back, prefetched, in
    backward (module docstring). One context per forward; it may be entered again for the next one."""

    def __init__(self, min_bytes: int = MIN_OFFLOAD_BYTES, max_host_bytes: int | None = None):
        self.min_bytes, self.max_host_bytes = min_bytes, max_host_bytes
        self.host_bytes = 0  # held on the host now
        self.exhausted = False  # a tensor found no host memory (the bound, or pinning refused): module docstring
        self.offloaded = 0  # tensors moved to the host, over the context's life
        self._stored: dict[int, tuple] = {}  # key -> (host tensor, device, copy event, stride) or ("kept", tensor)
        self._leaving: dict[int, tuple] = {}  # key -> (device tensor, copy event): copies not known to be done
        self._fetched: dict[int, tuple] = {}  # key -> (device tensor, copy event): brought back ahead of use
        self._next_key = 0
        self._stream = None
        self._boundary = None  # (event on the copy stream, the first key it does not cover) of the last boundary
        self._starts: list[int] = []  # the first key of each layer application (`layer_boundary`)
        self._prefetched = -1  # the application whose tensors were fetched last (-1: none)
        super().__init__(self._pack, self._unpack)

    def layer_boundary(self) -> None:
        """Before each offloaded layer application: the compute stream waits for the copies issued before the previous
        boundary, so that at most two applications' tensors are on their way out (the one before, the one running:
        the plan's offload window), and a copy stream slower than compute stalls compute rather than holding device
        memory. The device tensors of those copies are released then: the compute stream, which alone reuses their
        blocks, runs on only after the copies. Nothing to wait for on a CPU. Each boundary starts an application: the
        unit backward prefetches."""
        if not self._starts or self._starts[-1] != self._next_key:
            self._starts.append(self._next_key)
        if self._stream is None:
            return
        current = torch.cuda.current_stream(self._stream.device)
        if self._boundary is not None:
            event, covered = self._boundary
            current.wait_event(event)
            for key in [key for key in self._leaving if key < covered]:
                del self._leaving[key]
        event = torch.cuda.Event()
        event.record(self._stream)
        self._boundary = (event, self._next_key)

    def _release_copied(self) -> None:
        """Drop the device tensors whose copies to the host are done (a query, no wait)."""
        for key in [key for key, (_, event) in self._leaving.items() if event.query()]:
            del self._leaving[key]

    def _copy_stream(self, device: torch.device):
        if device.type != "cuda":
            return None
        if self._stream is None:
            self._stream = torch.cuda.Stream(device)
        return self._stream

    def _pack(self, tensor: torch.Tensor):
        key, self._next_key = self._next_key, self._next_key + 1
        size = tensor.numel() * tensor.element_size()
        if size < self.min_bytes or _is_parameter(tensor):
            return self._keep(key, tensor)
        if self.max_host_bytes is not None and self.host_bytes + size > self.max_host_bytes:
            self.exhausted = True
            return self._keep(key, tensor)
        stream = self._copy_stream(tensor.device)
        try:
            host, event = self._host_buffer(tensor, pinned=stream is not None), None
        except RuntimeError as error:  # pinning refused (WSL2): this one and what would pass the new bound stay
            self._refused(error)
            return self._keep(key, tensor)
        if stream is None:  # CPU: the same bookkeeping, a plain copy
            host.copy_(tensor)
        else:
            self._release_copied()
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor is written before it is copied
            with torch.cuda.stream(stream):
                host.copy_(tensor, non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
            self._leaving[key] = (tensor, event)  # its block is not reused before the copy has read it
        self._stored[key] = (host, tensor.device, event, tensor.stride())
        self.host_bytes += size
        self.offloaded += 1
        return key

    def _keep(self, key: int, tensor: torch.Tensor) -> int:
        self._stored[key] = ("kept", tensor)
        return key

    @staticmethod
    def _host_buffer(tensor: torch.Tensor, pinned: bool) -> torch.Tensor:
        return torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=pinned)  # dense

    def _refused(self, error: RuntimeError) -> None:
        """Pinned memory refused: the bound becomes what this forward pinned (module docstring)."""
        self.max_host_bytes, self.exhausted = self.host_bytes, True
        logger.warning("Activation offload: pinning host memory was refused after %.2f GiB (%s); later forwards pin "
                       "at most that much. WSL2 limits what CUDA may pin: give --memory_host_gib %.1f or less (times "
                       "the launch's processes) so that the plan accounts for it, or --memory_placements selective to "
                       "train without offload.",
                       self.host_bytes / 2**30, error, self.host_bytes / 2**30)

    def _unpack(self, key: int) -> torch.Tensor:
        tensor = self._take(key)
        application = bisect.bisect_right(self._starts, key) - 1
        if application >= 1 and application != self._prefetched:  # the application before: backward's next
            self._prefetched = application
            for earlier in range(self._starts[application - 1], self._starts[application]):
                entry = self._stored.get(earlier)
                if entry is not None and entry[0] != "kept" and earlier not in self._leaving:
                    self._fetch(earlier)
        return tensor

    def _drop_host(self, key: int) -> tuple:
        host, device, event, stride = self._stored.pop(key)
        self.host_bytes -= host.numel() * host.element_size()
        return host, device, event, stride

    def _fetch(self, key: int) -> None:
        """Back to the device with the strides it was saved with: a compiled backward checks them, and a saved view
        (a slice of a fused projection's output) is not dense. Such a view comes back in a block of its span."""
        host, device, event, stride = self._drop_host(key)
        stream = self._copy_stream(device)
        if stream is None:
            self._fetched[key] = (torch.empty_strided(host.shape, stride, dtype=host.dtype).copy_(host), None)
            return
        current = torch.cuda.current_stream(device)
        back = torch.empty_strided(host.shape, stride, dtype=host.dtype, device=device)  # the compute stream's pool
        stream.wait_stream(current)  # the block's earlier uses on the compute stream come first
        with torch.cuda.stream(stream):
            stream.wait_event(event)
            back.copy_(host, non_blocking=True)
            done = torch.cuda.Event()
            done.record(stream)
        self._fetched[key] = (back, done)

    def _take(self, key: int) -> torch.Tensor:
        if key in self._stored and self._stored[key][0] == "kept":
            return self._stored.pop(key)[1]
        if key in self._leaving:  # still on the device: no copy back (the host copy's buffer is freed safely, pinned)
            self._drop_host(key)
            return self._leaving.pop(key)[0]
        if key not in self._fetched:
            self._fetch(key)
        tensor, done = self._fetched.pop(key)
        if done is not None:
            torch.cuda.current_stream(tensor.device).wait_event(done)
        return tensor


class OffloadedForward:
    """The checkpoint function (`_gradient_checkpointing_func`) of the layer applications a plan offloads: it runs
    the layer's forward inside the `OffloadActivations` of the model's current forward. One context per forward of the
    model (`renew`, a forward pre-hook), not one per layer: backward's prefetch then runs across layers, and
    `max_host_bytes` bounds the host memory of the whole step. Not traced by torch.compile (`recursive=False`): the
    context is entered eagerly and the layer's forward inside it stays compiled, so the compiled graph's saved
    tensors pass through the hooks (torchtune's pattern: hooks outside the compiled region). Once a forward's host
    memory is spent (`OffloadActivations.exhausted`), its later applications run under `recompute` (the layers' full
    checkpoint function) instead, where one is given."""

    def __init__(self, min_bytes: int = MIN_OFFLOAD_BYTES, max_host_bytes: int | None = None, recompute=None):
        self.min_bytes, self.max_host_bytes, self.recompute = min_bytes, max_host_bytes, recompute
        self.context: OffloadActivations | None = None
        self._recomputed = False  # whether a forward has run out of host memory yet (warned once)

    def renew(self, *hook_args) -> None:
        """A fresh context for the next forward, under the bound the previous one ended with (lowered where pinning was
        refused); the previous one lives on in its graph until backward empties it."""
        if self.context is not None:
            self.max_host_bytes = self.context.max_host_bytes
        self.context = OffloadActivations(self.min_bytes, self.max_host_bytes)

    def __call__(self, function, *args):
        if self.context is None:
            self.renew()
        if self.context.exhausted and self.recompute is not None:
            if not self._recomputed:
                self._recomputed = True
                logger.warning("Activation offload: a forward ran out of host memory after %.2f GiB; its later "
                               "offloaded layer applications are recomputed instead, as in every such forward (slower "
                               "than the plan, no more GPU memory); --memory_host_gib sets the host memory offload may "
                               "pin.", self.context.host_bytes / 2**30)
            return self.recompute(function, *args)
        with self.context:
            self.context.layer_boundary()
            return function(*args)


OffloadedForward.__call__ = torch.compiler.disable(OffloadedForward.__call__, recursive=False)
