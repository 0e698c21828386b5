"""The memory planner: batch size and recompute set decided once, before training, for a memory cap.

For each candidate batch size a mixed-integer program (`placement.py`, `scipy.optimize.milp`, HiGHS) chooses where
each prelude layer, coda layer and graph-building core step keeps what backward needs (keep, recompute or selective
recomputation; with `placements="all"` also offload to pinned host memory), minimising the predicted step
time subject to the predicted peak reserved memory <= cap - margin and the host-memory bound (`estimator.py`'s
calibrated terms, `placement.py`'s analytic ones; both linear in the choice at a fixed batch size). The batch size
with the highest predicted tokens/s wins. A plain
Transformer's layers count as prelude layers, and its choice is all of them or none: what transformers' checkpointing
flag carries out. On several processes (data parallel or FSDP2) it plans one rank, whose weights, optimizer state and
buffers `processes.py` accounts; the batch is per device. The plan is fixed for the run: nothing adapts during training.
A training's default cap is the memory free on its device when it starts plus what the process already holds (the
smallest over the processes), not the card's total; `device_profile.py` plans for another card than the calibration's.
"""

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field

from transformers import TrainerCallback

from trainer_ext.memory.device_profile import DeviceProfile, for_device, training_profile
from trainer_ext.memory.estimator import GIB, Calibration, ModelShape, load_calibration
from trainer_ext.memory.probes import default_allocator
from trainer_ext.memory.placement import DEFAULT_PLACEMENTS, OFFLOAD_PLACEMENTS, Program, application_counts, \
    describe_table, host_bytes_for, placement_table
from trainer_ext.memory.processes import FP32_BYTES, layout_of, per_rank_shape, resolve_sharding
from trainer_ext.memory.recompute import Applications, RecomputeCallback, RecomputeSet

logger = logging.getLogger(__name__)

DEFAULT_MARGIN_GIB = 1.4  # CUDA context and what the calibration misses: a plan peaks <= 22.6 GiB on a 24 GiB card
DEFAULT_CAP_GIB = 24.0  # hf-recurrent-plan-memory's card without --cap_gib or --device_profile
MAX_BATCH_SIZE = 64
PLAN_FILE = "memory_plan.json"
# The settings given on the command line that decide the training's own memory (an explicit evaluation batch does not).
TRAINING_SETTINGS = frozenset({"per_device_train_batch_size", "activation_checkpointing"})
MIXED_PRECISIONS = ("no", "bf16", "fp16")  # accelerate's; under FSDP2 anything but "no" keeps fp32 master shards
MEASURE_AFTER_STEPS = 3  # the peak of the first steps (warm-up and compilation included) is compared with the plan


class NoPlanError(ValueError):
    """No batch size and recompute set fits the cap."""


@dataclass
class MemoryPlan:
    seq_len: int
    cap_gib: float
    margin_gib: float
    per_device_train_batch_size: int
    recompute: RecomputeSet
    torch_compile: bool
    predicted_peak_gib: float
    predicted_step_seconds: float
    preset: str | None = None
    calibration: str | None = None
    candidates: list = field(default_factory=list)
    transformer: bool = False  # a plain Transformer: its layers, counted as prelude layers, all or none
    num_processes: int = 1
    sharding: str | None = None  # "ddp", "fsdp2", or None for one process
    fixed_gib: dict = field(default_factory=dict)  # one rank's memory whatever the batch, by term
    device_profile: dict | None = None  # the card whose speed the plan predicts (None: the calibration's device)
    placement: dict = field(default_factory=dict)  # each placement's applications (`placement.placement_table`)
    host_gib: float = 0.0  # pinned host memory the offloaded applications use
    host_cap_gib: float | None = None  # the bound on it, per process
    vocab_size: int | None = None  # the head's rows the plan was made for (a training run's: its data tokenizer's)
    placements: str = DEFAULT_PLACEMENTS  # the choices the program had (`placement.PLACEMENT_CHOICES`)

    @property
    def placement_description(self) -> str:
        """Every placement's applications, keep included (a Transformer: all or nothing recomputed)."""
        if self.transformer or not self.placement:
            return self.recompute_description
        return describe_table(self.placement)

    def placement_lines(self) -> list[str]:
        """What hf-recurrent-plan-memory prints of the placement: each kind's applications and the host memory."""
        if self.transformer or not self.placement:
            return [self.recompute_description]
        return (["where each layer application keeps what backward needs:"]
                + [f"  {kind + ':':11}{Applications.from_dict(groups).describe() or '-'}"
                   for kind, groups in self.placement.items()] + [self.host_description])

    @property
    def exact_flags(self) -> str:
        """The training flags that give exactly this plan (its cap; the placements where they are not the default's
        and matter: offload's only where the plan offloads; the host bound where it does)."""
        same = self.placements == DEFAULT_PLACEMENTS or (self.placements == OFFLOAD_PLACEMENTS and not self.host_gib)
        choices = "" if same else f" --memory_placements {self.placements}"
        host = f" --memory_host_gib {self.host_cap_gib * self.num_processes:g}" if self.host_gib else ""
        return f"--memory_cap_gib {self.cap_gib:g}" + choices + host

    @property
    def host_description(self) -> str:
        return (f"offload uses {self.host_gib:.2f} GiB of pinned host memory (bound {self.host_cap_gib:.2f} GiB per "
                "process, --memory_host_gib)" if self.host_gib else "no host memory used")

    @property
    def recompute_description(self) -> str:
        if self.transformer:
            return "every layer recomputed" if not self.recompute.empty else "nothing recomputed"
        return self.recompute.describe()

    @property
    def predicted_tokens_per_second(self) -> float:
        return self.per_device_train_batch_size * self.seq_len / self.predicted_step_seconds

    def to_dict(self) -> dict:
        return {"preset": self.preset, "seq_len": self.seq_len, "cap_gib": self.cap_gib, "margin_gib": self.margin_gib,
                "per_device_train_batch_size": self.per_device_train_batch_size,
                "recompute": self.recompute.to_dict(), "recompute_description": self.recompute_description,
                "activation_checkpointing": not self.recompute.empty, "torch_compile": self.torch_compile,
                "predicted_peak_gib": round(self.predicted_peak_gib, 3),
                "predicted_step_seconds": round(self.predicted_step_seconds, 4),
                "predicted_tokens_per_second": round(self.predicted_tokens_per_second, 1),
                "calibration": self.calibration, "num_processes": self.num_processes, "sharding": self.sharding,
                "per_rank_fixed_gib": self.fixed_gib, "device_profile": self.device_profile,
                "placements": self.placements, "placement": self.placement,
                "placement_description": self.placement_description, "host_gib": round(self.host_gib, 3),
                "host_cap_gib": None if self.host_cap_gib is None else round(self.host_cap_gib, 3),
                "vocab_size": self.vocab_size, "candidates": self.candidates}

    def describe(self) -> str:
        text = (f"batch {self.per_device_train_batch_size} x {self.seq_len} tokens, {self.recompute_description}, "
                f"torch.compile {'on' if self.torch_compile else 'off'}: predicted peak reserved "
                f"{self.predicted_peak_gib:.2f} GiB (cap {self.cap_gib:g} - margin {self.margin_gib:g} GiB), "
                f"{self.predicted_tokens_per_second:,.0f} tokens/s"
                + (f" on {self.device_profile['name']}" if self.device_profile else "")
                + (f"; {self.host_description}" if self.host_gib else ""))
        return f"{text}; {self.describe_processes()}" if self.sharding else text

    def describe_processes(self) -> str:
        """The process count, the sharding and one rank's fixed terms (empty for one process)."""
        if not self.sharding:
            return ""
        terms = ", ".join(f"{name} {gib:.2f}" for name, gib in self.fixed_gib.items())
        return (f"per device, on each of {self.num_processes} processes ({self.sharding}): {terms} GiB "
                f"({sum(self.fixed_gib.values()):.2f} GiB before activations)")


def training_shape(config, momentum: float | None = None, rank_fraction: float | None = None,
                   bytes_per_param: int = 2, num_processes: int = 1, sharding: str | None = None,
                   sharded_weight_bytes: int | None = None) -> ModelShape:
    """The estimator's view of `config` trained with LowMemoryAdafactor (momentum resolved as training does), on one
    rank of `num_processes` with `sharding` ("ddp", "fsdp2"; None: one process, or data parallel for several);
    `sharded_weight_bytes`: bytes per element of an FSDP2 shard (default: `bytes_per_param`)."""
    from hf_recurrent.cost import parameter_counts
    from trainer_ext.optim.momentum import resolve_momentum
    from trainer_ext.optim.state import low_memory_state, optimizer_state_bytes

    params = parameter_counts(config).unique
    momentum, rank_fraction = resolve_momentum(momentum, rank_fraction, params)
    state = low_memory_state(momentum, rank_fraction)
    shape = ModelShape.from_config(config, optimizer_state_bytes(config, state), params, bytes_per_param)
    return per_rank_shape(shape, config, state, bytes_per_param, num_processes, sharding, sharded_weight_bytes)


def plan_memory(shape: ModelShape, seq_len: int, cap_gib: float, calibration: Calibration,
                margin_gib: float = DEFAULT_MARGIN_GIB, batch_sizes=None, recompute: RecomputeSet | None = None,
                compiled: bool | None = None, distill_topk: int = 0, preset: str | None = None,
                calibration_path: str | None = None, memory_host_gib: float | None = None,
                placements: str = DEFAULT_PLACEMENTS) -> MemoryPlan:
    """The plan of highest predicted throughput with a predicted peak <= cap - margin.

    `batch_sizes`: the candidates (default 1..MAX_BATCH_SIZE); `recompute`: a fixed placement (the program then only
    checks it); `compiled`: torch.compile on or off (default: on where the calibration measured it faster);
    `memory_host_gib`: the pinned host memory offload may use on the host (`placement.host_bytes_for`);
    `placements`: the choices the program has (`placement.PLACEMENT_CHOICES`)."""
    compiled = calibration.compile_is_faster(shape) if compiled is None else compiled
    if recompute is None and not shape.n_core_layers:  # a plain Transformer checkpoints all its layers or none
        plans, error = [], None
        for fixed in (RecomputeSet(), RecomputeSet.named("all", shape, 0)):
            try:
                plans.append(plan_memory(shape, seq_len, cap_gib, calibration, margin_gib, batch_sizes, fixed,
                                         compiled, distill_topk, preset, calibration_path, memory_host_gib,
                                         placements))
            except NoPlanError as no_plan:
                error = no_plan
        if not plans:
            raise error
        return max(plans, key=lambda plan: plan.predicted_tokens_per_second)
    budget, host_bytes = (cap_gib - margin_gib) * GIB, host_bytes_for(memory_host_gib, shape.num_processes)
    best, candidates, smallest = None, [], math.inf
    for batch in batch_sizes or range(1, MAX_BATCH_SIZE + 1):
        program = Program(shape, calibration, batch, seq_len, compiled, distill_topk, placements)
        chosen = program.solve(budget, host_bytes) if recompute is None else recompute
        every = recompute if recompute is not None else RecomputeSet.named("all", shape, shape.graph_steps)
        smallest = min(smallest, program.evaluate(every)[0])
        peak, seconds, host = program.evaluate(chosen) if chosen is not None else (math.inf, math.inf, 0)
        if peak > budget or host > host_bytes:
            if batch_sizes is None:
                break  # the peak only grows with the batch
            continue
        table = placement_table(shape, chosen)
        counts = application_counts(shape, table)
        candidates.append({"per_device_train_batch_size": batch, "recomputed_applications": counts["recompute"],
                           "selective_applications": counts["selective"],
                           "offloaded_applications": counts["offload"], "predicted_peak_gib": round(peak / GIB, 3),
                           "host_gib": round(host / GIB, 3),
                           "predicted_tokens_per_second": round(batch * seq_len / seconds, 1)})
        if best is None or batch * seq_len / seconds > best[0] * seq_len / best[3]:
            best = (batch, chosen, peak, seconds, host, table)
    if best is None:
        fixed = f" with {recompute.describe()}" if recompute is not None else " with every layer recomputed"
        raise NoPlanError(
            f"No batch size fits a cap of {cap_gib:g} GiB minus a margin of {margin_gib:g} GiB at sequence length "
            f"{seq_len}: the smallest predicted peak reserved memory is {smallest / GIB:.2f} GiB (batch "
            f"{min(batch_sizes or [1])}{fixed}). Raise the cap (--cap_gib / --memory_cap_gib), lower the margin, "
            "shorten the sequence, or turn momentum off (--optimizer_momentum 0)."
            + (f" On {shape.num_processes} processes ({shape.sharding}) each rank holds "
               f"{shape.fixed_bytes / GIB:.2f} GiB before activations; FSDP2 over more processes holds less."
               if shape.sharding else ""))
    batch, chosen, peak, seconds, host, table = best
    fixed = {"weights": shape.weight_bytes, "optimizer_state": shape.optimizer_state_bytes, **dict(shape.process_terms)}
    return MemoryPlan(seq_len, cap_gib, margin_gib, batch, chosen, compiled, peak / GIB, seconds, preset,
                      calibration_path, candidates, transformer=not shape.n_core_layers,
                      num_processes=shape.num_processes, sharding=shape.sharding,
                      fixed_gib={name: round(size / GIB, 3) for name, size in fixed.items()},
                      placement=table, host_gib=host / GIB, host_cap_gib=host_bytes / GIB,
                      vocab_size=shape.vocab_size, placements=placements)


def plan_for_preset(preset: str, seq_len: int, cap_gib: float | None, calibration_path: str | None = None,
                    margin_gib: float = DEFAULT_MARGIN_GIB, momentum: float | None = None,
                    rank_fraction: float | None = None, compiled: bool | None = None, distill_topk: int = 0,
                    max_batch_size: int = MAX_BATCH_SIZE, num_processes: int = 1, sharding: str | None = None,
                    mixed_precision: str = "no", device_profile: DeviceProfile | None = None,
                    vocab_size: int | None = None, memory_host_gib: float | None = None,
                    placements: str | None = None) -> MemoryPlan:
    """The plan of a named preset (its default vocabulary, or a head of `vocab_size` entries, e.g. a tokenizer's) for
    one rank of `num_processes` with `sharding` ("ddp", "fsdp2"; None: one process, or data parallel for several)
    under accelerate's `mixed_precision`, on the card of `device_profile` (default: the calibration's; its memory is
    the default cap, else DEFAULT_CAP_GIB), with `placements` and `memory_host_gib` as `plan_memory` (default:
    offload offered on a profiled card, whose compute and link decide whether it pays, else the training's default);
    checks first (ValueError naming the fix)."""
    from hf_recurrent import presets

    if preset not in presets.NAMES:
        raise ValueError(f"--preset {preset!r} is not a preset; choose one of {list(presets.NAMES)}.")
    if vocab_size is not None and not (isinstance(vocab_size, int) and vocab_size >= 1):
        raise ValueError(f"--vocab_size={vocab_size!r} is not allowed; give the tokenizer's size, an integer >= 1.")
    config = presets.get(preset, vocab_size)
    if cap_gib is None:
        cap_gib = device_profile.memory_gib if device_profile else DEFAULT_CAP_GIB
    check_plan_numbers(seq_len, cap_gib, margin_gib, max_batch_size)
    sharding = resolve_sharding(num_processes, sharding)
    if mixed_precision not in MIXED_PRECISIONS:
        raise ValueError(f"--mixed_precision={mixed_precision!r} is not known; choose one of {list(MIXED_PRECISIONS)}.")
    calibration, profiled = _for_profile(load_calibration(calibration_path), device_profile, calibration_path)
    upcast = sharding == "fsdp2" and mixed_precision != "no"
    shape = training_shape(config, momentum, rank_fraction, num_processes=num_processes, sharding=sharding,
                           sharded_weight_bytes=FP32_BYTES if upcast else None)
    plan = plan_memory(shape, seq_len, cap_gib, calibration, margin_gib, range(1, max_batch_size + 1),
                       compiled=compiled, distill_topk=distill_topk, preset=preset, calibration_path=calibration_path,
                       memory_host_gib=memory_host_gib,
                       placements=placements or (OFFLOAD_PLACEMENTS if device_profile else DEFAULT_PLACEMENTS))
    plan.device_profile = profiled
    return plan


def _for_profile(calibration: Calibration, profile: DeviceProfile | None,
                 calibration_path: str | None) -> tuple[Calibration, dict | None]:
    """(the calibration with its device's step times at `profile`'s matmul rate, the plan's `device_profile` entry);
    without a profile, the calibration as it is and None."""
    if profile is None:
        return calibration, None
    scaled, scale = for_device(calibration, profile, calibration_path)
    return scaled, {**profile.to_dict(), "step_time_scale": round(scale, 4),
                    "calibration_device": calibration.info.get("device_name")}


def check_plan_numbers(seq_len, cap_gib, margin_gib, max_batch_size=MAX_BATCH_SIZE, prefix="--") -> None:
    for name, value, ok in (("seq_len", seq_len, seq_len >= 1), ("cap_gib", cap_gib, cap_gib > 0),
                            ("margin_gib", margin_gib, margin_gib >= 0),
                            ("max_batch_size", max_batch_size, max_batch_size >= 1)):
        if not ok:
            raise ValueError(f"{prefix}{name}={value!r} is not allowed; it must be > 0 (>= 0 for the margin).")


# -- training: run_pretrain --memory_plan auto


def apply_memory_plan(training_args, config, seq_len: int, bytes_per_param: int, distill_topk: int = 0,
                      online_teacher: bool = False, num_processes: int | None = None,
                      sharding: str | None = None):
    """Apply `--memory_plan auto` to `training_args` in place, before the Trainer is built; returns the callbacks
    that carry the plan out (the recompute set, the predicted against measured peak), empty when nothing applies.

    The plan is one rank's: `num_processes` and `sharding` ("ddp", "fsdp2") default to what the arguments and the
    launcher's environment say (`processes.layout_of`); given, they replace it. DeepSpeed, FSDP1 and the other
    layouts `layout_of` names are not planned (logged)."""
    import torch

    from hf_recurrent.presets import is_recurrent
    from trainer_ext.compat import CHECKPOINTING_FLAG
    from trainer_ext.devices import allocator_settings

    if training_args.memory_plan != "auto":
        return []
    layout = layout_of(training_args)
    if num_processes is not None or sharding is not None:
        num = layout.num_processes if num_processes is None else num_processes
        sharding = sharding or (layout.sharding if layout.sharding == "fsdp2" else None)
        layout = dataclasses.replace(layout, num_processes=num, sharding=resolve_sharding(num, sharding))
    reason = (training_args.optimizer != "low_memory" and "--optimizer hf is not calibrated"
              or layout.not_planned
              or online_teacher and "an online teacher's memory is not modelled"
              or not torch.cuda.is_available() and "no CUDA device")
    if reason:
        logger.warning("--memory_plan auto: not applied (%s); batch %d, checkpointing %s as given.", reason,
                       training_args.per_device_train_batch_size, getattr(training_args, CHECKPOINTING_FLAG))
        return []
    explicit = getattr(training_args, "explicit_memory_settings", set())
    cap, cap_source = training_args.memory_cap_gib, "--memory_cap_gib"
    if cap is None:
        cap, cap_source = default_cap_gib(training_args.device)
    shape = training_shape(config, training_args.optimizer_momentum, training_args.optimizer_momentum_rank_fraction,
                           bytes_per_param, layout.num_processes, layout.sharding, layout.sharded_weight_bytes)
    fixed_set = None
    if layout.fsdp_activation_checkpointing:  # FSDP's checkpoint wrapper recomputes every decoder layer
        fixed_set = RecomputeSet.named("all", shape, shape.graph_steps)
    elif "activation_checkpointing" in explicit:
        fixed_set = RecomputeSet.named("all" if getattr(training_args, CHECKPOINTING_FLAG) else "none", shape,
                                       shape.graph_steps)
    batches = [training_args.per_device_train_batch_size] if "per_device_train_batch_size" in explicit else None
    calibration = load_calibration(training_args.memory_calibration)
    profile = training_profile(training_args.memory_device_profile, training_args.memory_placements, calibration,
                               training_args.memory_calibration)
    calibration, profiled = _for_profile(calibration, profile, training_args.memory_calibration)
    try:
        plan = plan_memory(shape, seq_len, cap, calibration, training_args.memory_margin_gib, batches, fixed_set,
                           compiled=bool(training_args.torch_compile), distill_topk=distill_topk,
                           calibration_path=training_args.memory_calibration,
                           memory_host_gib=training_args.memory_host_gib,
                           placements=training_args.memory_placements)
    except NoPlanError as error:
        if not explicit & TRAINING_SETTINGS:
            raise ValueError(f"--memory_plan auto: {error} (--memory_plan none trains without a plan)") from error
        logger.warning("--memory_plan auto: %s Training with the settings given.", error)
        return []
    if explicit:
        logger.info("--memory_plan auto: %s given on the command line, kept; the plan decides the rest.",
                    " and ".join(f"--{name}" for name in sorted(explicit)))
    plan.device_profile = profiled
    training_args.per_device_train_batch_size = plan.per_device_train_batch_size
    if "per_device_eval_batch_size" not in explicit:
        # Evaluation at the planned batch fits where training does (no gradients, nothing kept for backward) and
        # reuses the training's cached blocks: recurrent-3.3b's evaluation at batch 8 after training at 6 reserved
        # 2.5 GiB more than the training, at batch 6 nothing more (results/training-control, eighth set).
        training_args.per_device_eval_batch_size = plan.per_device_train_batch_size
    callbacks = [MemoryPlanCallback(plan, training_args.output_dir)]
    if layout.fsdp_activation_checkpointing:
        # transformers refuses its own checkpointing flag next to FSDP's, which recomputes every layer already
        logger.info("--memory_plan auto: FSDP's activation checkpointing recomputes every decoder layer; planned so.")
    elif "activation_checkpointing" not in explicit:
        setattr(training_args, CHECKPOINTING_FLAG, not plan.recompute.empty)
        if not plan.recompute.empty and is_recurrent(config):  # a Transformer's checkpointing is all or nothing
            callbacks.insert(0, RecomputeCallback(plan.recompute, int(plan.host_cap_gib * GIB)))
    logger.info("Memory plan (cap %.2f GiB: %s): %s", cap, cap_source, plan.describe())
    if not default_allocator(allocator_settings()):
        logger.info("--memory_plan auto: the calibration was measured with the CUDA allocator's defaults, not %r: "
                    "the peaks logged may differ from the plan's.", allocator_settings())
    return callbacks


def default_cap_gib(device) -> tuple[float, str]:
    """(the cap of a training without --memory_cap_gib, how it was found, for the log): the memory free on CUDA
    `device` now plus what this process holds, within a per-process fraction, the smallest over the processes of
    a launch (they train one plan). Not the card's total: a desktop, another process or WSL2 takes its share. The
    card's total where the driver cannot say."""
    import torch

    from trainer_ext.devices import device_memory

    index = device.index if getattr(device, "type", None) == "cuda" else None
    try:
        memory = device_memory(index)
    except (RuntimeError, AssertionError) as error:
        total = torch.cuda.get_device_properties(index or 0).total_memory / GIB
        logger.warning("--memory_plan auto: the free memory of the CUDA device could not be read (%s); planning "
                       "against its total of %.2f GiB. --memory_cap_gib sets the cap.", error, total)
        return total, "the device's total memory"
    cap = _smallest_over_processes(memory.available / GIB, device)
    others = (memory.total - memory.free - memory.held) / GIB
    text = (f"{memory.free / GIB:.2f} GiB free + {memory.held / GIB:.2f} GiB held by this process, of "
            f"{memory.total / GIB:.2f} GiB (other processes and this one's CUDA context use {others:.2f} GiB)")
    if memory.fraction_limit is not None and memory.fraction_limit < memory.free + memory.held:
        text += f", within this process's memory fraction of {memory.fraction_limit / GIB:.2f} GiB"
    if cap < memory.available / GIB:
        text += f"; {cap:.2f} GiB, the smallest of the launch's processes"
    return cap, f"{text}; --memory_cap_gib sets it"


def _smallest_over_processes(value: float, device) -> float:
    """The smallest `value` of the processes of an initialised process group (`value` itself without one)."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() < 2:
        return value
    tensor = torch.tensor([value], dtype=torch.float64, device=device if dist.get_backend() == "nccl" else "cpu")
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return float(tensor.item())


class MemoryPlanCallback(TrainerCallback):
    """Logs the plan's predicted peak reserved memory against the measured one after the first steps (which checks
    the calibration) and the peak of the whole training at its end (the allocator's cache can grow after the first
    steps), in every training it takes part in (each trial of the threshold test); warns where a measured peak is
    above the plan's budget (cap minus margin), and writes them to `<output_dir>/memory_plan.json`
    (`measured_peak_gib`, `training_peak_gib`)."""

    def __init__(self, plan: MemoryPlan, output_dir: str, after_steps: int = MEASURE_AFTER_STEPS):
        self.plan, self.output_dir, self.after_steps, self.measured = plan, output_dir, after_steps, None

    def on_train_begin(self, args, state, control, **kwargs):
        self.measured = None

    def on_step_end(self, args, state, control, **kwargs):
        if self.measured is None and state.global_step >= self.after_steps:
            self._measure(args, "measured_peak_gib")

    def on_train_end(self, args, state, control, **kwargs):
        if self.measured is None:  # fewer steps than after_steps
            self._measure(args, "measured_peak_gib")
        self._measure(args, "training_peak_gib")

    def _measure(self, args, key: str):
        import torch

        if not torch.cuda.is_available():
            self.measured = {}
            return
        peak = round(torch.cuda.max_memory_reserved() / GIB, 3)
        earlier = max(self.measured.values()) if self.measured else 0.0
        self.measured = {**(self.measured or {}), key: peak}
        if key == "measured_peak_gib":
            logger.info("Memory plan: predicted peak reserved %.2f GiB, measured %.2f GiB (%+.1f%%)",
                        self.plan.predicted_peak_gib, peak, 100 * (peak / self.plan.predicted_peak_gib - 1))
        elif peak > earlier:
            logger.info("Memory plan: the training peaked at %.2f GiB reserved, %.2f GiB above its first steps",
                        peak, peak - earlier)
        budget = self.plan.cap_gib - self.plan.margin_gib
        if peak > budget and peak > earlier:  # each rise above the budget once
            logger.warning("Memory plan: the measured peak %.2f GiB is above the plan's budget of %.2f GiB (cap %g - "
                           "margin %g): a card of %g GiB may run out of memory; raise --memory_margin_gib by %.1f or "
                           "lower --memory_cap_gib.", peak, budget, self.plan.cap_gib, self.plan.margin_gib,
                           self.plan.cap_gib, math.ceil(10 * (peak - budget)) / 10)
        if args.should_save:
            os.makedirs(self.output_dir, exist_ok=True)
            with open(os.path.join(self.output_dir, PLAN_FILE), "w") as f:
                json.dump({**self.plan.to_dict(), **self.measured}, f, indent=1)
