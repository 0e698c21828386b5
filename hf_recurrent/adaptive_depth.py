"""Adaptive per-token depth: a token stops iterating once its state has converged.

With `exit_threshold=t` (a `forward` / `generate` keyword, or `config.exit_threshold`), the core runs up to
`num_steps` steps, and a token whose state changed by less than t after a step,

    ||s_i - s_{i-1}|| / ||s_i|| < t          (exit_criterion="state": cheap, no LM head per step)

keeps s_i from then on. The model reports the steps each token used as `num_steps_used` (B, T). t = 0 never exits
(fixed depth); a huge t exits every token after one step.

A model with a learned exit gate (`config.exit_gate`, Ouro's) can exit by it instead: the gate reads the state after
each step, lambda_i = sigmoid(gate(s_i)), and a token exits after the first step at which its cumulative exit
probability reaches t, a number in (0, 1] (exit_criterion="gate"):

    1 - prod_{j<=i} (1 - lambda_j) >= t

The gate is read from the same normed state the next step and the coda read. Both criteria share what follows: only
the test of "this token stops now" differs (`DepthExit._stops`).

An exited token's state no longer changes, but later steps may still need it: in `kv_cache_mode="per_step"` every
step's cache slot holds its keys and values, and at every step the tokens after it attend to its keys and values at
that step, computed from the frozen state exactly as a full forward pass computes them, so cached decoding stays
exact. What no later computation reads is left out (`DepthExit.steps`, then `DepthExit.run`), where that is exact:

- no cache (a full forward, evaluation): a step runs only on the batch rows that still have an iterating token, each
  cut after the last such token of any of them (causal attention: no earlier token reads a later one), the cut
  rounded up to a multiple of `BLOCK_LENGTH_MULTIPLE` positions (1: none), its attention by the kernels of
  `BLOCK_SDPA_BACKENDS` (not cuDNN's, which builds a graph per new shape); once every
  token has exited, the loop stops. A batch whose tokens exited after j steps costs j core passes instead of n.
- `kv_cache_mode="shared"`: the steps before the last only read the cache, so they run on the same compacted batch
  (the rows' cache entries gathered), and the last step runs on every token: it writes the shared slot with keys and
  values from the frozen states. Decoding a batch, a row whose token exited after j steps costs j + 1 passes.
- `kv_cache_mode="per_step"`: every later step's slot needs the token's keys and values at that step, so nothing
  is left out (masked: exited tokens are computed and their new state discarded).

With a static cache a step is not compacted; it is left out only once every token of the call has exited (shared
mode), as with a dynamic cache. Skipped steps record the frozen state in `hidden_states` (as the masked steps do:
same values, length 1 + P + n + C). Deciding what to run syncs with the host once per step, so it is made only
without autograd (`generate`, evaluation under `no_grad` / `inference_mode`) and without `output_attentions`
(left-out steps would leave out their attention weights). Outputs, the cache and `num_steps_used` equal the masked
path's: exactly where whole steps are left out, up to the kernels' rounding where a step runs on a smaller block
(matrix products and attention round differently for another number of rows or keys). `COMPACT_EXITED_STEPS =
False` runs every step on the whole batch while some token iterates; `SKIP_EXITED_STEPS = False` forces the masked
path throughout.

Under `torch.compile` exits are masked by default (`EXIT_CHECK_EVERY`, 0): one graph that runs every step. With
`exit_check_every=k` (a `forward` / `generate` keyword) the check runs every k steps instead, in shared mode or without
a cache: the steps before the last skippable one (L = n - 1 shared, n without a cache) split into a first part of 1..k
steps, traced with the prelude, and segments of k steps, each preceded by a host check (`run_segments`, not compiled)
that leaves out the segments left once every token of the call has exited; the last step, the coda and the head
follow. Those steps compute alike (same slot, read only), so every segment is the same graph, called 0 to (L - 1) // k
times: at n = 12, k = 4 a call runs 3, 7 or 11 steps before the last (depth buckets 4, 8, 12), as graphs of the prelude
and first part, of a segment, of the rest (and of the head: transformers' forward wraps the model's). No step runs on a
smaller block, so outputs, the cache and `num_steps_used` equal the masked compiled path's exactly under the same
kernels (inductor may fuse across the graph boundaries differently and round differently). The graph breaks need
`fullgraph=False`. `generate` with a compiled decode step and exits in shared mode checks every
`GENERATE_EXIT_CHECK_EVERY` (4) steps unless the call says otherwise, and compiles such a call with a copy of a
`fullgraph=True` compile config set to False (`compile_in_segments`): on an H100, recurrent-125m trained with
`bench_gpu.sh adaptive`, state criterion 0.3, k = 4 decoded 1.37x / 1.34x faster than compiled fixed depth at batch 8 /
1, the masked graph 1.01x (BENCHMARKS.md); on a shared 2-core CPU at the `debug` preset's width the segments were no
faster than the masked graph (0.5-1.2x). With `torch.compile(model, fullgraph=True)` keep `exit_check_every=0` (the
forward's default), which keeps the masked path in one graph (so do a per_step cache, `output_attentions` and
autograd). A fixed depth is unchanged: one graph, no host sync.

Shipped next to the weights with the modeling file (`trust_remote_code` loads it as a flat module).
"""

import copy
from collections.abc import Callable, Iterable, Iterator
from contextlib import nullcontext
from dataclasses import dataclass

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers.modeling_outputs import BaseModelOutputWithPast, CausalLMOutputWithPast

try:
    from .configuration_recurrent_depth import EXIT_CRITERIA
except ImportError:  # loaded as a flat module by `trust_remote_code`
    from configuration_recurrent_depth import EXIT_CRITERIA

SKIP_EXITED_STEPS = True  # False: run every step masked, even once all tokens have exited (for comparisons)
COMPACT_EXITED_STEPS = True  # False: while some token iterates, a step runs on the whole batch (masked)
EXIT_CHECK_EVERY = 0  # under torch.compile: core steps per compiled segment between two host checks (0: masked)
GENERATE_EXIT_CHECK_EVERY = 4  # the same for `generate`'s compiled decode step, which may break its graph
# A step's block is cut after a multiple of this many positions (or the sequence's end); the positions a rounding adds
# after the last iterating token are computed and discarded, as for any exited token. 1 (no rounding): with the
# attention kernels below, 64 (a bounded set of shapes) measured no faster on an H100 (recurrent-125m, batch 8, seq
# 1024: forward speed-ups 1.67x / 1.96x / 2.00x at 1 against 1.52x / 1.87x / 1.96x at 64 in three calls; BENCHMARKS.md).
BLOCK_LENGTH_MULTIPLE = 1
# The SDPA kernels a step on a block may use (None: torch's own choice). Blocks come in many shapes, and torch's SDPA
# prefers cuDNN's attention on Hopper and Blackwell cards, which builds an execution graph per shape (batch and
# lengths among its keys) on its first call; the other kernels run any shape as it comes.
BLOCK_SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def check_exit(threshold, criterion: str, has_gate: bool = False, check_every: int | None = None) -> None:
    """Raise ValueError for a threshold, criterion or `exit_check_every` a call cannot use; `has_gate`: the model's
    `config.exit_gate`."""
    if check_every is not None and not (isinstance(check_every, int) and check_every >= 0):
        raise ValueError(f"exit_check_every={check_every!r} must be an integer >= 0 (0: compiled calls check never).")
    if threshold is not None and not (isinstance(threshold, (int, float)) and threshold >= 0):
        raise ValueError(f"exit_threshold={threshold!r} must be a number >= 0 (or None for a fixed depth).")
    if criterion not in EXIT_CRITERIA:
        raise ValueError(f"exit_criterion={criterion!r} is not allowed; choose one of {list(EXIT_CRITERIA)}.")
    if criterion == "gate" and not has_gate:
        raise ValueError("exit_criterion='gate' needs a model with a learned exit gate, and this one has none "
                         "(config.exit_gate is False): train one with exit_gate=True (--config_overrides "
                         "exit_gate=true), or use exit_criterion='state'.")
    if criterion == "gate" and threshold is not None and not 0 < threshold <= 1:
        raise ValueError(f"exit_threshold={threshold!r} must be in (0, 1] with exit_criterion='gate' (the cumulative "
                         "exit probability at which a token stops).")


class DepthExit:
    """The exit state of one forward pass: which tokens still iterate and how many steps each has used.
    `cache_mode`: the call's `kv_cache_mode`, None without a cache (which steps `steps` may leave out); `compact`:
    whether a step may run on part of the batch (no cache or a dynamic one, no mask or a tensor one, no attention
    keyword arguments beyond the model's own); `gate`: the model's exit gate for exit_criterion="gate" (None: the
    state criterion)."""

    def __init__(self, threshold: float, shape: tuple[int, int], device: torch.device, cache_mode: str | None = None,
                 compact: bool = False, gate: Callable | None = None):
        self.threshold = threshold
        self.cache_mode = cache_mode
        self.compact = compact
        self.gate = gate
        self.active = torch.ones(shape, dtype=torch.bool, device=device)  # (B, T)
        self.steps_used = torch.zeros(shape, dtype=torch.long, device=device)
        # The gate criterion's prod_j (1 - lambda_j) over the steps so far: the probability of not having exited.
        self.survival = torch.ones(shape, dtype=torch.float32, device=device) if gate is not None else None
        # What the next step runs on: None (every token), or (rows, length): the rows (None: all) cut to `length`.
        self.block = None

    def _stops(self, old: torch.Tensor, new: torch.Tensor, index) -> torch.Tensor:
        """Which tokens of `index` (a block of the batch, None: all) stop after the step that took `old` to `new`."""
        if self.gate is None:
            change = (new - old).float().norm(dim=-1) / new.float().norm(dim=-1).clamp_min(1e-12)
            return change < self.threshold
        survival = (self.survival if index is None else self.survival[index]) * (
            1 - torch.sigmoid(self.gate(new).float().squeeze(-1)))
        if index is None:  # out of place, as `step`'s updates
            self.survival = survival
        else:
            self.survival[index] = survival  # an exited token's value is never read again
        return 1 - survival >= self.threshold

    def step(self, state: torch.Tensor, new_state: torch.Tensor) -> torch.Tensor:
        """The state after one more step: `new_state` for active tokens, `state` (frozen) for exited ones. Out of
        place, so that a compiled segment (module docstring) mutates none of its inputs (inductor keeps a graph that
        mutates an input it does not own out of CUDA graphs)."""
        self.steps_used = self.steps_used + self.active
        stops = self._stops(state, new_state, None)
        state = torch.where(self.active[..., None], new_state, state)
        self.active = self.active & ~stops
        return state

    def run(self, core_step: Callable, state: torch.Tensor, embedded: torch.Tensor, layer_kwargs: dict) -> torch.Tensor:
        """The state after the next step, `core_step(state, embedded, layer_kwargs)` (B, T, C) -> (B, T, C), run on
        the whole batch or on the block `steps` chose; the tokens outside the block have exited and stay frozen."""
        if self.block is None:
            return self.step(state, core_step(state, embedded, layer_kwargs))
        rows, length = self.block
        old = take_block(state, rows, length)
        with sdpa_kernel(BLOCK_SDPA_BACKENDS) if BLOCK_SDPA_BACKENDS else nullcontext():
            new = core_step(old, take_block(embedded, rows, length), block_kwargs(layer_kwargs, rows, length,
                                                                                 state.shape[1]))
        active = take_block(self.active, rows, length)
        self.steps_used += self.active
        index = (slice(None) if rows is None else rows, slice(None, length))
        stops = self._stops(old, new, index)
        state, self.active = state.clone(), self.active.clone()
        state[index] = torch.where(active[..., None], new, old)
        self.active[index] = active & ~stops
        return state

    def steps(self, num_steps: int, hidden_states: list | None, attentions: list | None) -> Iterable[int]:
        """The core steps (0-based) to run: all `num_steps`, or fewer once every token has exited, each on the part
        of the batch that is needed (module docstring), set as `block` before the step is yielded. `hidden_states`
        (the forward's list, or None) gets the frozen state once per skipped step; collected `attentions` keep every
        step."""
        skip = self._may_skip(attentions) and not torch.compiler.is_compiling()
        return self._skipping_steps(num_steps, hidden_states) if skip else range(num_steps)

    def _may_skip(self, attentions: list | None) -> bool:
        """Whether steps may be left out at all: not in per_step mode, without attention weights or autograd."""
        return (SKIP_EXITED_STEPS and self.cache_mode != "per_step" and attentions is None
                and not torch.is_grad_enabled())

    def _last_skippable(self, num_steps: int) -> int:
        """The steps before this one may be left out: all without a cache; the shared cache's writing step runs."""
        return num_steps if self.cache_mode is None else num_steps - 1

    def segments(self, num_steps: int, attentions: list | None, every: int | None) -> tuple[range, range, int] | None:
        """Under `torch.compile` where exited steps may be left out: the first steps, the steps of one segment and
        how many segments follow, the steps before the last skippable one (module docstring); None: every step in
        one graph. `every`: steps per segment (None: `EXIT_CHECK_EVERY`)."""
        every = EXIT_CHECK_EVERY if every is None else every
        last = self._last_skippable(num_steps)
        if not (0 < every < last and self._may_skip(attentions) and torch.compiler.is_compiling()):
            return None
        first = (last - 1) % every + 1
        # The steps before `last` compute alike (same cache slot, read only): every segment runs the same steps.
        return range(first), range(last - every, last), (last - first) // every

    def _skipping_steps(self, num_steps: int, hidden_states: list | None) -> Iterator[int]:
        last = self._last_skippable(num_steps)
        step = 0
        while step < num_steps:
            yield step
            step += 1
            self.block = None
            if step >= last:
                continue
            block = self._needed_block()  # a host sync, once per step
            if block is None:  # every token has exited
                if hidden_states is not None:  # the last entry is the state just recorded: the frozen one
                    hidden_states += [hidden_states[-1]] * (last - step)
                step = last
            elif block[0] is not None or block[1] < self.active.shape[1]:  # smaller than the batch
                self.block = block

    def _needed_block(self) -> tuple[torch.Tensor | None, int] | None:
        """(rows with an active token, or None for all; 1 + the last active position among them, rounded up by
        `block_length`), None if none."""
        batch, seq = self.active.shape
        if not (self.compact and COMPACT_EXITED_STEPS):
            return (None, seq) if bool(self.active.any()) else None
        ends = torch.where(self.active, torch.arange(1, seq + 1, device=self.active.device), 0).amax(-1).tolist()
        rows = [row for row, end in enumerate(ends) if end]
        if not rows:
            return None
        index = None if len(rows) == batch else torch.tensor(rows, device=self.active.device)
        return index, block_length(max(ends), seq)


@torch.compiler.disable(recursive=False)
def run_segments(depth_exit: DepthExit, run: Callable, segment: range, count: int, state: torch.Tensor,
                 hidden_states: list | None) -> torch.Tensor:
    """The state after up to `count` calls `run(segment, state)`, none once every token has exited (a host sync
    before each). Not compiled itself, so that the check can run in Python; `run` is compiled as a frame of its own,
    the same graph for every segment."""
    for done in range(count):
        if not bool(depth_exit.active.any()):
            if hidden_states is not None:  # the steps left out record the frozen state
                hidden_states += [hidden_states[-1]] * ((count - done) * len(segment))
            break
        state = run(segment, state)
    return state


def compile_in_segments(generation_config, config, model_kwargs: dict) -> None:
    """`generate` whose decode step compiles, with exits in `kv_cache_mode="shared"`: the steps run in segments of
    the call's `exit_check_every`, by default `GENERATE_EXIT_CHECK_EVERY` (set in `model_kwargs`); their graph breaks,
    which a `fullgraph=True` compile config refuses, so the call compiles with a copy set to fullgraph=False (as
    transformers does for flash attention); exit_check_every=0 keeps one graph."""
    threshold = model_kwargs.get("exit_threshold")
    if config.kv_cache_mode != "shared" or (threshold if threshold is not None else config.exit_threshold) is None:
        return
    if model_kwargs.get("exit_check_every") is None:
        model_kwargs["exit_check_every"] = GENERATE_EXIT_CHECK_EVERY
    compile_config = generation_config.compile_config
    if compile_config is not None and compile_config.fullgraph and model_kwargs["exit_check_every"] > 0:
        generation_config.compile_config = copy.copy(compile_config)
        generation_config.compile_config.fullgraph = False


def block_length(end: int, seq: int) -> int:
    """The positions a step's block covers: `end` (1 + its last iterating position) rounded up to a multiple of
    `BLOCK_LENGTH_MULTIPLE`, at most the sequence length `seq`."""
    return min(-(-end // BLOCK_LENGTH_MULTIPLE) * BLOCK_LENGTH_MULTIPLE, seq)


def take_block(tensor: torch.Tensor, rows: torch.Tensor | None, length: int) -> torch.Tensor:
    """`tensor` (B or 1, T, ...) cut to a block: rows `rows` (all: None, or a batch of 1 that broadcasts), positions
    before `length`."""
    if rows is not None and tensor.shape[0] > 1:
        tensor = tensor.index_select(0, rows)
    return tensor[:, :length]


def block_kwargs(layer_kwargs: dict, rows: torch.Tensor | None, length: int, seq: int) -> dict:
    """The decoder layers' keyword arguments for a step run on a block of the batch: the rotary phases and the mask
    cut alike (the mask's key axis loses the cut positions, which come last), the cache rows to attend over."""
    kwargs = dict(layer_kwargs)
    kwargs["position_embeddings"] = tuple(take_block(t, rows, length) for t in layer_kwargs["position_embeddings"])
    mask = layer_kwargs["attention_mask"]
    if mask is not None:
        keys = mask.shape[-1] - (seq - length)
        if rows is not None and mask.shape[0] > 1:
            mask = mask.index_select(0, rows)
        kwargs["attention_mask"] = mask[..., :length, :keys] if mask.dim() == 4 else mask[:, :keys]
    if rows is not None and layer_kwargs.get("cache") is not None:
        kwargs["cache_rows"] = rows
    return kwargs


@dataclass
class RecurrentDepthModelOutput(BaseModelOutputWithPast):
    """`num_steps_used` (B, T): core steps each token used under adaptive depth (None at a fixed depth)."""

    num_steps_used: torch.Tensor | None = None


@dataclass
class RecurrentDepthCausalLMOutput(CausalLMOutputWithPast):
    """`num_steps_used` (B, T): core steps each token used under adaptive depth (None at a fixed depth)."""

    num_steps_used: torch.Tensor | None = None
