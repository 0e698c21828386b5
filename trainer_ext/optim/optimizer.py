"""Low-memory optimizer: factored second moment, bf16 weights updated in place, update in backward.

Why this exists: on one 24 GB card a 7B model does not fit with any stock optimizer, and moving optimizer state
elsewhere (CPU offload, NVMe) was too slow, so this optimizer removes state instead: a factored second moment
(Adafactor: a (4096, 11008) weight keeps 4096 + 11008 fp32 numbers), bf16 weights updated in place with stochastic
rounding and no fp32 copy of any parameter (HF Adafactor's ``p.float()`` is what runs out of memory), optionally
the update inside backward so full-model gradients never exist at once, and per-tensor update clipping instead of
global gradient clipping, with a non-finite gradient skipped on the device without a host sync.

Stochastic rounding needs random bits inside compiled code, where a ``torch.Generator`` cannot be used. They come
from a counter-based integer hash of (seed, parameter index, chunk, step, element): the same bits eager, compiled
or fused, on CPU or GPU, and a resumed run reproduces them without saving any generator state.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from trainer_ext.devices import has_triton
from trainer_ext.optim.bookkeeping import StepBookkeeping
from trainer_ext.optim.in_backward import (
    BackwardHooks,
    check_gradient_accumulation,
    register_update_after_all_reduce,
    update_stream,
)
from trainer_ext.optim.kernels import (
    EAGER_KERNELS,
    SHARD_SALT,
    compiled_kernels,
    factored_update,
    hyper_values,
    mix32,
    range_finder,
    row_chunks,
    to_device,
    unfactored_update,
    validate_group,
)
from trainer_ext.optim.shards import RowShard, local, row_shard, zero_state

__all__ = ["LowMemoryAdafactor", "check_gradient_accumulation", "create_optimizer", "subspace_rank",
           "SUBSPACE_MOMENTUM_FRACTION"]

# Tensors larger than this many elements are updated in row chunks of at most this size, so that fp32
# temporaries are bounded by 256 MiB (2**26 * 4 bytes) instead of the size of the weight. Eager mode makes
# several fp32 temporaries; a compiled update that is one graph still materialises one fp32 copy of the
# gradient (measured on a 32000 x 4096 bf16 weight: +500 MiB as one graph, +0.6 MiB in chunks).
# 2**26 keeps every projection of 7B-class models (4096 x 11008 = 45M) one compiled call: each chunk costs
# three more compiled calls, and a 3.3B step spent most of its host time in those calls (BENCHMARKS.md);
# only embedding matrices are chunked. Element indices within a chunk fit int32 for the random-bit hash.
DEFAULT_MAX_CHUNK_NUMEL = 2**26

_STATE_DICT_KEY = "low_memory_adafactor"

# The subspace momentum of the 7B-class configuration (`low_memory_7b`): 1/16 of full momentum's memory, which keeps
# recurrent-7b's extra optimizer state under 2 GiB (trainer_ext/optim/state.py counts it).
SUBSPACE_MOMENTUM_FRACTION = 1 / 16

# ----------------------------------------------------------------------------- the optimizer


def subspace_rank(shape: torch.Size | tuple[int, int], fraction: float) -> int:
    """Rank r of a (R, C) matrix's momentum subspace: ceil(fraction * min(R, C)), at least 1."""
    return max(1, math.ceil(fraction * min(shape[-2:])))


class LowMemoryAdafactor(StepBookkeeping, torch.optim.Optimizer):
    """Adafactor-style optimizer for bf16 (or fp32) weights with MB-scale state.

    Per tensor and step t (fp32 math; g = gradient):
        v      <- beta2_t * v + (1 - beta2_t) * (g**2 + eps)   factored into row/column means if ndim >= 2
        u      =  g / sqrt(v_hat)                              v_hat: bias-corrected (rank-1) estimate
        u      <- u / max(1, RMS(u) / clip_threshold)
        m      <- momentum * m + (1 - momentum) * u            only if momentum is not None,
        u      <- m / (1 - momentum**t)                         then bias-corrected as in Adam
        w      <- w * (1 - lr * weight_decay) - lr * u          rounded stochastically if w is bf16

    Subspace momentum (``momentum_rank_fraction`` f): a (R, C) matrix keeps its first moment only in a rank-r
    subspace of its rows' space, r = ceil(f * min(R, C)), spanned by the orthonormal columns of P (C, r):
        m      <- momentum * m + (1 - momentum) * u P           m is (R, r): f of the memory of full momentum
        u      <- rho u + (m / (1 - momentum**t) - rho u P) P^T  momentum inside the subspace, rho u outside
    P is refreshed every ``projection_interval`` steps from the gradient's dominant right singular subspace
    (one step of randomized subspace iteration) and m is carried into the new basis, m <- m P_old^T P_new.
    Gradients of language models are close to low rank, so most of what momentum averages lies in that subspace
    (GaLore's observation), while the update stays full rank. 1-D tensors keep full momentum (they are small).
    Outside the subspace nothing averages the noise of small batches: at rho = 1 the update's RMS stays near that
    of no momentum, about 4x that of full momentum (benchmarks/update_size.py), so the same rate moves the weights
    about 4x as far. ``subspace_residual`` rho scales that part down.

    Args:
        params: parameters or parameter groups (bf16 or fp32, contiguous).
        lr: learning rate (plain; no relative step sizes). Schedulers drive ``param_groups[i]["lr"]``.
        weight_decay: decoupled weight decay, multiplied by lr.
        momentum: beta1 of an optional first moment stored in the weight's dtype (bf16 for bf16
            weights); None (default) keeps no first moment.
        momentum_rank_fraction: None (default) for full momentum, or f in (0, 1) for subspace momentum of
            matrices (see above): their momentum costs about f of full momentum, plus an fp32 basis (C, r).
        projection_interval: steps between refreshes of the subspace bases.
        beta2: second-moment decay; with ``beta2_decay`` the cap of the schedule.
        beta2_decay: None for a constant beta2 with bias correction, or c for Adafactor's schedule
            beta2_t = min(beta2, 1 - t**-c) (c = 0.8 in the paper).
        eps: added to the squared gradients (Adafactor's eps1).
        clip_threshold: per-tensor update RMS clipping threshold.
        subspace_residual: rho above, the factor of the update outside the momentum's subspace (subspace
            momentum only; 1 passes it through as it is, 0 keeps the update inside the subspace, as GaLore).
        max_consecutive_skips: a step skips a tensor whose gradient is not finite; after this many
            steps in a row with any skip, ``step`` raises RuntimeError. The weights never see NaN/Inf.
        max_chunk_numel: larger tensors are updated in row chunks of at most this many elements, to
            bound fp32 temporaries (see DEFAULT_MAX_CHUNK_NUMEL).
        compile: run each tensor's update as ``torch.compile``d functions. None (default): for CUDA
            tensors when Triton is installed, eager otherwise; True: for all tensors (CPU tensors then
            need a C++ compiler); False: never.
        fused: where compiled, update CUDA matrices and vectors with the Triton kernels of triton_kernels.py (one
            kernel per pass over a matrix, one per vector; no fp32 copy of the gradient). None (default) or True:
            yes; False: the compiled torch functions.
        update_stream: in-backward mode on one CUDA device: run the updates on a stream of their own, beside
            backward's products (in_backward.py). False (default): on backward's stream.
        seed: seed of the stochastic-rounding bits; saved in the state dict.

    Bookkeeping (``last_grad_norm``, ``last_step_skips``, ``skipped_updates``) is accumulated on the
    device. On GPU, ``step`` reads the previous step's values, which are ready by then, so that training
    never waits for the GPU; reading one of these properties waits for the current step.
    """

    def __init__(
        self,
        params: Iterable[torch.Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        *,
        weight_decay: float = 0.0,
        momentum: float | None = None,
        momentum_rank_fraction: float | None = None,
        projection_interval: int = 200,
        beta2: float = 0.999,
        beta2_decay: float | None = None,
        eps: float = 1e-30,
        clip_threshold: float = 1.0,
        subspace_residual: float = 1.0,
        max_consecutive_skips: int = 20,
        max_chunk_numel: int = DEFAULT_MAX_CHUNK_NUMEL,
        compile: bool | None = None,
        fused: bool | None = None,
        update_stream: bool = False,
        seed: int = 0,
    ):
        defaults = dict(lr=lr, weight_decay=weight_decay, momentum=momentum,
                        momentum_rank_fraction=momentum_rank_fraction, projection_interval=projection_interval,
                        beta2=beta2, beta2_decay=beta2_decay, eps=eps, clip_threshold=clip_threshold,
                        subspace_residual=subspace_residual)
        # Set before super().__init__, which calls add_param_group for each group.
        self.in_backward = False
        self._hooks = BackwardHooks(self._backward_hook)
        # Stable position of each parameter: groups may be replaced by load_state_dict, parameters not.
        self._position: dict[torch.Tensor, tuple[int, int]] = {}
        self._num_steps = 0  # finished optimizer steps
        self._last_hooked_step: list[int] = []
        self._gate: Callable[[], bool] | None = None  # asked before this step's first in-backward update
        self._skipping = False  # this step's in-backward updates are skipped (the gate said so)
        super().__init__(params, defaults)
        if not isinstance(max_consecutive_skips, int) or max_consecutive_skips < 1:
            raise ValueError(f"max_consecutive_skips must be an integer >= 1, got {max_consecutive_skips!r}")
        if not isinstance(max_chunk_numel, int) or max_chunk_numel < 1:
            raise ValueError(f"max_chunk_numel must be an integer >= 1, got {max_chunk_numel!r}")
        if not isinstance(seed, int) or not 0 <= seed < 2**31:
            raise ValueError(f"seed must be an integer in [0, 2**31), got {seed!r}")
        self.max_consecutive_skips = max_consecutive_skips
        self.max_chunk_numel = max_chunk_numel
        if compile not in (None, True, False):
            raise ValueError(f"compile must be None, True or False, got {compile!r}")
        self.compile = compile
        if fused not in (None, True, False):
            raise ValueError(f"fused must be None, True or False, got {fused!r}")
        self.fused = fused
        if update_stream not in (True, False):
            raise ValueError(f"update_stream must be True or False, got {update_stream!r}")
        self.update_stream = update_stream
        self.seed = seed
        self._rng_keys: dict[tuple, torch.Tensor] = {}
        self._shards: dict[torch.Tensor, RowShard | None] = {}  # per parameter: the block this process holds
        self._hyper_cache: dict[tuple[int, torch.device], tuple[tuple, torch.Tensor]] = {}
        self._reset_bookkeeping()

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        group = self.param_groups[-1]
        validate_group(group)
        for p in group["params"]:
            self._position[p] = (len(self.param_groups) - 1, len(self._position))
            self._last_hooked_step.append(-1)
            if self.in_backward and p.requires_grad:
                self._hooks.add(p)

    # -- in-backward mode

    def attach_to_backward(self, gradient_accumulation_steps: int = 1) -> None:
        """Update each parameter inside backward, as soon as its gradient is accumulated.

        The gradient is freed right after its update, so full gradients never exist at once. ``step``
        then only finishes the step's bookkeeping and ``zero_grad`` has nothing to do; the training loop
        (e.g. HF Trainer) can call both as usual. Each parameter's gradient must be accumulated exactly
        once per backward: no gradient accumulation and no reentrant activation checkpointing
        (``use_reentrant=False`` is fine).
        """
        check_gradient_accumulation(gradient_accumulation_steps, in_backward=True)
        if self.in_backward:
            return
        for p in self._position:
            if p.requires_grad:
                self._hooks.add(p)
        self._hooks.stream = update_stream(self._position, self.update_stream)
        self.in_backward = True

    def detach_from_backward(self) -> None:
        """Remove the backward hooks; ``step`` updates from ``.grad`` again."""
        self._hooks.remove()
        self.in_backward = False

    def update_after_all_reduce(self, ddp_model) -> None:
        """Under DistributedDataParallel: update each parameter inside backward from the gradient averaged over the
        processes, as soon as its bucket's all-reduce is done (`in_backward.register_update_after_all_reduce`),
        instead of from the process's own gradient. Call before the first backward of the wrapped model."""
        if not self.in_backward:
            raise ValueError("update_after_all_reduce needs the in-backward mode (attach_to_backward)")
        self._hooks.remove()  # the post-accumulate-grad hooks would see the process's own gradient
        register_update_after_all_reduce(ddp_model, self._averaged_gradient_hook)

    def rebind_parameters(self) -> None:
        """Follow the parameters of `param_groups` as they are now. FSDP2 replaces a model's parameters by sharded
        ones, and a training loop that built the optimizer first (the HF Trainer; accelerate then swaps each
        group's parameters) leaves its positions and backward hooks on the old ones. Call before the first step.

        Sharded parameters get their state now (zeros, as a first update would create it): loaders that fill a state
        dict in place (`torch.distributed.checkpoint`, accelerate's FSDP loading) need the tensors, and would else
        call `step()` to make them."""
        params = [p for group in self.param_groups for p in group["params"]]
        if all(p in self._position for p in params):
            return
        if self.state:
            raise RuntimeError("rebind_parameters after the first step: the state belongs to the old parameters")
        self._position = {p: (g, i) for i, (g, p) in enumerate(
            (g, p) for g, group in enumerate(self.param_groups) for p in group["params"])}
        self._shards.clear()
        if self.in_backward:
            self._hooks.remove()
            for p in params:
                if p.requires_grad:
                    self._hooks.add(p)
        if any(row_shard(p) is not None for p in params):
            self.init_state()

    def _averaged_gradient_hook(self, p: torch.Tensor, grad: torch.Tensor) -> None:
        group_index, index = self._position[p]
        self._update(p, self.param_groups[group_index], index, grad)

    def _backward_hook(self, p: torch.Tensor) -> None:
        group_index, index = self._position[p]
        if self._last_hooked_step[index] == self._num_steps:
            raise RuntimeError(
                "a parameter's gradient was accumulated twice in one step while the optimizer updates "
                "in backward: call optimizer.step() after every backward, do not accumulate gradients, "
                "and use non-reentrant activation checkpointing (use_reentrant=False)"
            )
        self._last_hooked_step[index] = self._num_steps
        if self._gate is not None:
            decide, self._gate = self._gate, None
            self._skipping = not decide()
        if not self._skipping:
            self._update(p, self.param_groups[group_index], index)
        p.grad = None

    def gate_backward(self, decide: Callable[[], bool]) -> None:
        """Call ``decide()`` at this step's first in-backward update, before it: False skips every update of the
        step (each gradient is dropped as it arrives; no weight and no state changes). A decision that needs a value
        of the forward pass (the stability guard's, on the loss) then waits for that value while backward's first
        operations are queued, instead of before them with the GPU idle. The gate lasts until ``step``."""
        self._gate = decide

    # -- classic mode and step bookkeeping

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        """Update every parameter from ``.grad`` (classic mode), then finish the step's bookkeeping.

        In in-backward mode the parameters were already updated; only the bookkeeping runs.
        """
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self.in_backward:
            for group in self.param_groups:
                for p in group["params"]:
                    if p.grad is not None:
                        self._update(p, group, self._position[p][1])
        self._gate, self._skipping = None, False
        self._finish_step()
        return loss

    # -- the per-tensor update

    @torch.no_grad()
    def _update(self, p: torch.Tensor, group: dict, index: int, grad: torch.Tensor | None = None) -> None:
        grad = p.grad if grad is None else grad
        if grad is None or p.numel() == 0:  # a sharded weight's empty shard still joins the shards' sums
            return
        if grad.is_sparse:
            raise ValueError("LowMemoryAdafactor does not support sparse gradients")
        shard = self._shards[p] if p in self._shards else self._shards.setdefault(p, row_shard(p))
        if shard is not None and p.ndim > 2:
            raise ValueError(f"LowMemoryAdafactor updates sharded vectors and matrices, got a {p.ndim}-D parameter")
        subspace = _subspace(group, p)
        state = self._state_of(p, group)
        momentum = local(state["momentum"]) if group["momentum"] is not None else None

        hyper = self._hyper(group, p.device)
        totals = self._totals.get(p.device)
        if totals is None:
            totals = self._totals[p.device] = torch.zeros(2, dtype=torch.float32, device=p.device)
        beta2_decay = group["beta2_decay"] is not None
        param, grad = local(p.detach()), local(grad)
        compiled = self.compile if self.compile is not None else p.is_cuda and has_triton()
        fused = compiled and self.fused is not False and shard is None  # the fused kernels see whole tensors

        if p.ndim < 2:
            if fused and _fused_kernels().supports_vector(param):
                update = _fused_kernels().fused_vector_update
            else:  # a shard's sums are collectives: eager
                update = compiled_kernels()[2] if compiled and shard is None else unfactored_update
            extra = {} if shard is None else {"shard": shard}
            update(param, grad, local(state["second_moment"]), momentum, state["step"],
                   self._keys(index, p.device, 1, shard), hyper, totals, beta2_decay=beta2_decay, **extra)
            return
        shape3 = (-1, *param.shape[-2:])
        views = (param.view(shape3), grad.reshape(shape3), local(state["row"]).view(shape3[:2]),
                 local(state["col"]).view(-1, param.shape[-1]),
                 None if momentum is None else momentum.view(-1, *momentum.shape[-2:]))
        num_slices, rows, cols = views[0].shape
        chunks = row_chunks(num_slices, rows, cols, self.max_chunk_numel)
        keys = self._keys(index, p.device, len(chunks), shard)
        projector = self._projector(state, views[1], chunks, index, group, shard) if subspace else None
        args = (*views, state["step"], keys, hyper, totals, projector)
        if fused and _fused_kernels().supports(param):
            _fused_kernels().fused_factored_update(param, grad, *views[2:4], momentum, *args[5:],
                                                   rows_per_chunk=chunks[0][1].stop or rows, beta2_decay=beta2_decay)
        elif not compiled:
            factored_update(*args, chunks=chunks, kernels=EAGER_KERNELS, beta2_decay=beta2_decay, shard=shard)
        elif len(chunks) == 1 and shard is None:
            compiled_kernels()[1](*args, beta2_decay=beta2_decay)
        else:  # compiled kernels, with a shard's sums between them
            factored_update(*args, chunks=chunks, kernels=compiled_kernels()[0], beta2_decay=beta2_decay, shard=shard)

    def _state_of(self, p: torch.Tensor, group: dict) -> dict:
        state = self.state[p]
        if not state:
            rank = subspace_rank(p.shape, group["momentum_rank_fraction"]) if _subspace(group, p) else None
            state.update(zero_state(p, group["momentum"] is not None, rank))
        return state

    def init_state(self) -> None:
        """Create every parameter's state now, as its first update would (zeros). Loaders that fill the tensors of
        a state dict in place (`torch.distributed.checkpoint`) need them to exist before the first step."""
        for group in self.param_groups:
            for p in group["params"]:
                self._state_of(p, group)

    def _projector(self, state: dict, grad: torch.Tensor, chunks, index: int, group: dict,
                   shard: RowShard | None) -> torch.Tensor:
        """The subspace basis P (C, r) of a matrix's momentum, refreshed every ``projection_interval`` steps.

        At a refresh the momentum moves into the new basis (m <- m P_old^T P_new). Decided on the host from the
        optimizer's step count, computed on the device with no sync: a non-finite gradient keeps the old basis
        (the first basis then stays the first r unit vectors). The random test matrix is keyed by the parameter,
        not the shard: every shard of a weight draws the same one.
        """
        previous = local(state["projector"])
        if self._num_steps % group["projection_interval"]:
            return previous
        momentum = local(state["momentum"])
        key = self._keys(index, grad.device, 1)[0]
        basis = range_finder(grad, chunks, momentum.shape[-1], key, self._num_steps, shard)
        ok = torch.isfinite(basis).all()
        moved = momentum.float() @ (previous.T @ basis)
        momentum.copy_(torch.where(ok, moved, momentum.float()))
        previous.copy_(torch.where(ok, basis, previous))  # in place: row-major, as the fused kernels read it
        return previous

    def _hyper(self, group: dict, device: torch.device) -> torch.Tensor:
        """The group's hyperparameters as one device tensor, rebuilt only when one of them changes."""
        values = hyper_values(group)
        key = (id(group), device)
        cached = self._hyper_cache.get(key)
        if cached is None or cached[0] != values:
            validate_group(group, check_params=False)
            cached = self._hyper_cache[key] = (values, to_device(list(values), torch.float32, device))
        return cached[1]

    def _keys(self, index: int, device: torch.device, num_chunks: int, shard: RowShard | None = None) -> torch.Tensor:
        """Per-chunk int32 keys of the random-bit hash: a function of (seed, parameter index, chunk), and of the
        shard of a sharded parameter (each shard rounds with bits of its own)."""
        cache_key = (index, device, num_chunks, None if shard is None else shard.rank)
        keys = self._rng_keys.get(cache_key)
        if keys is None:
            base = mix32(torch.tensor(self.seed, dtype=torch.int32) ^ mix32(torch.tensor(index, dtype=torch.int32)))
            if shard is not None:
                base = mix32(base ^ mix32(torch.tensor(shard.rank + 1, dtype=torch.int32) ^ SHARD_SALT))
            keys = mix32(base + torch.arange(num_chunks, dtype=torch.int32))
            keys = self._rng_keys[cache_key] = to_device(keys.tolist(), torch.int32, device)
        return keys

    # -- state

    def state_bytes(self) -> int:
        """Total bytes of optimizer state tensors (second-moment factors, momentum, step counters)."""
        return sum(local(v).numel() * v.element_size()
                   for s in self.state.values() for v in s.values() if isinstance(v, torch.Tensor))

    def state_dict(self) -> dict[str, Any]:
        self._resolve_all()
        state_dict = super().state_dict()
        counters = {"seed": self.seed, "num_steps": self._num_steps, "skipped_updates": self._skipped_updates,
                    "consecutive_skip_steps": self._consecutive_skip_steps}
        for group in state_dict["param_groups"]:  # in each group: torch.distributed.checkpoint keeps only those
            group[_STATE_DICT_KEY] = dict(counters)
        return state_dict

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Standard loading, except that state tensors keep their dtype (torch's default would cast the
        fp32 row/column statistics to the bf16 dtype of the weights)."""
        state_dict = dict(state_dict)
        extra = state_dict.pop(_STATE_DICT_KEY, None)  # where checkpoints of earlier versions kept the counters
        state_dict["param_groups"] = [dict(group) for group in state_dict["param_groups"]]
        for group in state_dict["param_groups"]:
            extra = group.pop(_STATE_DICT_KEY, extra)
        saved_state = state_dict["state"]
        saved_ids = [i for group in state_dict["param_groups"] for i in group["params"]]
        super().load_state_dict({**state_dict, "state": {}})
        for group in self.param_groups:  # saved before the field existed: the update they were trained with
            group.setdefault("subspace_residual", 1.0)
        params = [p for group in self.param_groups for p in group["params"]]
        for saved_id, p in zip(saved_ids, params, strict=True):
            if saved_id in saved_state:
                self.state[p] = {k: v.to(p.device, copy=True) if isinstance(v, torch.Tensor) else v
                                 for k, v in saved_state[saved_id].items()}
        for group in self.param_groups:
            validate_group(group)
        self._hyper_cache.clear()
        self._rng_keys.clear()
        self._pending.clear()
        self._totals = {}
        if extra is not None:
            self.seed = extra["seed"]
            self._num_steps = extra["num_steps"]
            self._skipped_updates = extra["skipped_updates"]
            self._consecutive_skip_steps = extra["consecutive_skip_steps"]
        self._last_hooked_step = [-1] * len(self._position)


def _subspace(group: dict, p: torch.Tensor) -> bool:
    """Whether `p` keeps its momentum in a subspace (matrices, with momentum_rank_fraction)."""
    return group["momentum"] is not None and group["momentum_rank_fraction"] is not None and p.ndim == 2


@functools.cache
def _fused_kernels():
    """triton_kernels, imported on first use (it needs Triton, which CPU-only installs lack)."""
    from trainer_ext.optim import triton_kernels

    return triton_kernels


def create_optimizer(
    model: nn.Module,
    lr: float,
    weight_decay: float = 0.0,
    in_backward: bool = True,
    momentum: float | None = None,
    gradient_accumulation_steps: int = 1,
    **kwargs: Any,
) -> LowMemoryAdafactor:
    """Build a LowMemoryAdafactor for ``model``'s trainable parameters; attach it to backward if asked.

    Weight decay applies to matrices only: 1-D parameters (biases, norm gains) are not decayed, the usual
    practice in Transformer pretraining, since pulling a norm gain towards zero works against the
    normalisation instead of regularising. ``kwargs`` go to LowMemoryAdafactor.
    """
    check_gradient_accumulation(gradient_accumulation_steps, in_backward)
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]
    optimizer = LowMemoryAdafactor([g for g in groups if g["params"]], lr=lr, momentum=momentum, **kwargs)
    if in_backward:
        optimizer.attach_to_backward(gradient_accumulation_steps)
    return optimizer
