"""The arguments of a training run: the model, the data, `RecurrentTrainingArguments`, and their defaults.

Schedule fields a user leaves unset (`learning_rate`, `warmup_steps`, `max_steps`, `num_train_epochs`) stay None
until `resolve_schedule_defaults` fills them, once the model's size is known: a 3e-3 learning rate with 30 warm-up
steps suits the CPU demo and diverges at the billion scale. `COMMAND_LINE_DEFAULTS` holds what a bare command
(`hf-recurrent-pretrain`, `hf-recurrent-find-lr`) runs with besides: the debug preset on the embedded corpus.
"""

import contextlib
import functools
import logging
import math
import os
import sys
from dataclasses import dataclass, field

import torch
from transformers import TrainingArguments

from hf_recurrent import presets
from trainer_ext.compat import CHECKPOINTING_FLAG, align_tf32_settings
from trainer_ext.distill.losses import DIVERGENCES
from trainer_ext.memory.device_profile import TRAINING_PROFILE_HELP, check_profile_value
from trainer_ext.memory.placement import DEFAULT_PLACEMENTS, HOST_HELP, PLACEMENTS_HELP, check_host_gib, \
    check_placements
from trainer_ext.training.depth_supervision import WEIGHTINGS
from trainer_ext.training.stability import check_settings

logger = logging.getLogger(__name__)

OPTIMIZERS = ("low_memory", "hf")
MEMORY_PLANS = ("auto", "none")
# The batch size per device where neither the command line nor a memory plan sets one (TrainingArguments' default).
DEFAULT_BATCH_SIZE = 8
# The evaluation batch size where neither the command line nor a memory plan sets one.
DEFAULT_EVAL_BATCH_SIZE = 16
# Batch key of the targets aligned with positions (target t belongs to input t); HF's loss functions use the
# same name for labels that are already shifted.
TARGETS = "shift_labels"

# Models of LARGE_MODEL_PARAMS or more get LARGE_MODEL_SCHEDULE where the user left a field unset, smaller ones
# SMALL_MODEL_SCHEDULE (the CPU demo: a few minutes on the debug preset).
LARGE_MODEL_PARAMS = 50e6
LARGE_MODEL_SCHEDULE = {"learning_rate": 3e-4, "warmup_steps": 2000, "max_steps": -1}
SMALL_MODEL_SCHEDULE = {"learning_rate": 3e-3, "warmup_steps": 30, "max_steps": 240}
# A large model without a step budget trains one epoch.
LARGE_MODEL_EPOCHS = 1.0
SCHEDULE_FIELDS = ("learning_rate", "warmup_steps", "max_steps", "num_train_epochs")

# What a bare command runs with besides the schedule: parser defaults, so anything on the command line wins.
COMMAND_LINE_DEFAULTS = {
    "output_dir": os.path.join("outputs", "run_pretrain"),
    "lr_scheduler_type": "cosine",
    "logging_steps": 20,
    "eval_strategy": "steps",
    "eval_steps": 120,
    "save_steps": 120,
    "save_total_limit": 2,
    "report_to": "none",
    # In the training process: stacking fixed-length samples takes about a millisecond a batch, and the one GPU run
    # with two worker processes did not finish in its time box (BENCHMARKS.md).
    "dataloader_num_workers": 0,
    "seed": 0,
    "dataloader_pin_memory": torch.cuda.is_available(),
    # With pinned batches, copy them to the GPU without waiting: a blocking copy waits for all queued GPU work, a
    # drain of the device at every step.
    "accelerator_config": {"non_blocking": torch.cuda.is_available()},
}


@dataclass
class ModelArguments:
    preset: str = field(default="debug", metadata={"help": f"One of {list(presets.NAMES)}."})
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Start from this checkpoint instead of a fresh preset."})
    config_overrides: str | None = field(
        default=None, metadata={"help": "Comma-separated config fields, e.g. 'mean_recurrence=8,injection=add'."})
    dtype: str = field(default="auto", metadata={"help": "auto (bf16 on CUDA, fp32 on CPU), bfloat16 or float32."})
    attn_implementation: str = field(default="sdpa", metadata={"help": "eager, sdpa or flash_attention_2."})
    teacher_model_name_or_path: str | None = field(
        default=None, metadata={"help": "Online teacher: any causal LM sharing the student's tokenizer."})
    teacher_device: str | None = field(
        default=None, metadata={"help": "Where the teacher runs, e.g. cuda:1 (default: the training device)."})
    teacher_quantization: str = field(
        default="none", metadata={"help": "none, 8bit or 4bit (bitsandbytes, CUDA only) to fit a larger teacher."})
    trust_remote_code: bool = field(
        default=False, metadata={"help": "Run the Python code a --model_name_or_path / --teacher_model_name_or_path "
                                         "repository ships (auto_map). Off by default: a hub id's code runs on this "
                                         "machine. Not needed for this package's recurrent-depth checkpoints."})

    def __post_init__(self):
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"--dtype={self.dtype!r} is not allowed; choose one of ['auto', 'bfloat16', 'float32'].")


def _check(args, name: str, ok: bool, allowed: str) -> None:
    """ValueError naming --name, its value and what it must be, unless `ok` (checked as the command line is parsed)."""
    if not ok:
        raise ValueError(f"--{name}={getattr(args, name)!r} is not allowed; it must be {allowed}.")


def _is_int(value, low: int | None = None) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and (low is None or value >= low)


def _is_number(value, low: float | None = None, strict: bool = False, high: float | None = None) -> bool:
    """A finite number, not a bool, above `low` (or equal to it unless `strict`) and below `high`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return False
    return (low is None or (value > low if strict else value >= low)) and (high is None or value < high)


@dataclass
class DataArguments:
    data_dir: str | None = field(
        default=None, metadata={"help": "Prepared shards (hf-recurrent-prepare-data). Default: the embedded corpus, "
                                        "prepared on first use."})
    max_eval_samples: int | None = field(default=256, metadata={"help": "Evaluate on at most this many samples."})
    teacher_cache_dir: str | None = field(
        default=None, metadata={"help": "Offline teacher top-k cache (hf-recurrent-cache-teacher) aligned with "
                                        "--data_dir."})
    teacher_cache_workers: int = field(
        default=2, metadata={"help": "Processes that decode --teacher_cache_dir's samples ahead of a GPU's steps "
                                     "where --dataloader_num_workers is 0 (its default); 0: in the training process."})
    save_final: bool = field(default=True, metadata={"help": "Save the final model to <output_dir>/final."})

    def __post_init__(self):
        # An empty evaluation set fails only at the final evaluation (no eval_loss), after the whole training.
        _check(self, "max_eval_samples", self.max_eval_samples is None or _is_int(self.max_eval_samples, 1),
               "an integer >= 1: the evaluation at the end of training needs samples")
        _check(self, "teacher_cache_workers", _is_int(self.teacher_cache_workers, 0),
               "an integer >= 0 (0 decodes the cache in the training process)")


@dataclass
class RecurrentTrainingArguments(TrainingArguments):
    # The schedule: None where the user leaves it, filled by `resolve_schedule_defaults` from the model's size.
    learning_rate: float | None = field(
        default=None, metadata={"help": f"Peak learning rate (default: --learning_rate_from's, else "
                                        f"{LARGE_MODEL_SCHEDULE['learning_rate']:g} for models of "
                                        f"{LARGE_MODEL_PARAMS / 1e6:.0f}M parameters or more, "
                                        f"{SMALL_MODEL_SCHEDULE['learning_rate']:g} below)."})
    learning_rate_from: str | None = field(
        default=None, metadata={"help": "lr_sweep.json of hf-recurrent-find-lr (or its folder): take its learning_rate "
                                        "unless --learning_rate is given."})
    warmup_steps: float | None = field(
        default=None, metadata={"help": f"Linear warm-up steps, or a fraction of the run if < 1 (default: "
                                        f"{LARGE_MODEL_SCHEDULE['warmup_steps']} for large models, "
                                        f"{SMALL_MODEL_SCHEDULE['warmup_steps']} below)."})
    max_steps: int | None = field(
        default=None, metadata={"help": f"Optimizer steps; -1 trains --num_train_epochs (default: -1 and one epoch "
                                        f"for large models, {SMALL_MODEL_SCHEDULE['max_steps']} below)."})
    num_train_epochs: float | None = field(
        default=None, metadata={"help": "Epochs when --max_steps is -1 (default: 1 for a large model without "
                                        "--max_steps, else 3)."})
    backprop_depth: int | None = field(
        default=None, metadata={"help": "Gradients through the last k recurrent steps only (default: the config's)."})
    depth_seed: int = field(default=0, metadata={"help": "Seed of the per-step depth sampler."})
    eval_num_steps: int | None = field(
        default=None, metadata={"help": "Depth used for evaluation (default: the config's mean_recurrence)."})
    depth_supervision: int = field(
        default=1, metadata={"help": "Deep supervision: the weighted mean of the LM losses at this many depths of each "
                                     "step, spread over the steps with gradients, the last included (1: the plain "
                                     "loss). Logs ce_depth_<i>; trainer_ext/training/depth_supervision.py."})
    depth_supervision_weights: str = field(
        default="uniform", metadata={"help": f"Weights of the supervised depths: one of {list(WEIGHTINGS)} "
                                             "(linear: proportional to the step)."})
    exit_gate_entropy_weight: float = field(default=0.05, metadata={"help": "With exit_gate=true in the model "
                                                   "config: beta of the exit distribution's entropy (Ouro: 0.05)."})
    optimizer: str = field(
        default="low_memory",
        metadata={"help": "low_memory (factored, bf16 in place, update in backward) or hf (use `optim`)."})
    optimizer_in_backward: bool = field(
        default=True, metadata={"help": "Update each tensor as soon as its gradient exists (gradient release)."})
    optimizer_momentum: float | None = field(
        default=None, metadata={"help": "beta1 of the low-memory optimizer's bf16 first moment; 0 turns it off. "
                                        "Default 0.9 (see resolve_momentum)."})
    optimizer_momentum_rank_fraction: float | None = field(
        default=None, metadata={"help": "Momentum of each weight matrix kept in a subspace of this fraction of its rank "
                                        "(about this fraction of full momentum's 2 bytes per parameter); 1 = full "
                                        "momentum. Default: 1 under 2B parameters, 1/16 from 2B up (low_memory_7b)."})
    optimizer_clip_threshold: float = field(default=1.0, metadata={"help": "Per-tensor update RMS clip."})
    optimizer_subspace_residual: float | None = field(
        default=None, metadata={"help": "With subspace momentum: the factor of the update outside the subspace, in "
                                        "[0, 1] (1: as it is; 0: none, as GaLore). Default sqrt((1 - beta1) / "
                                        "(1 + beta1)), 0.229 at beta1 0.9: the size full momentum gives noise."})
    optimizer_fused: bool = field(
        default=True, metadata={"help": "Update CUDA weight matrices with the optimizer's fused Triton kernels (three "
                                        "passes over each tensor); false: its compiled torch functions."})
    optimizer_update_stream: bool = field(default=False, metadata={"help": (
        "Run the in-backward updates on a CUDA stream of their own, beside backward's products (one GPU): on "
        "recurrent-3.3b -1%% to +1.6%% tokens/s and about 3 GiB more reserved memory: off by default (BENCHMARKS.md).")})
    gc_interval: int = field(
        default=50, metadata={"help": "Run Python's garbage collector after every N-th step and nowhere else during "
                                      "training (its pauses would land inside steps); 0: automatic, as Python does."})
    profile_steps: int = field(default=30, metadata={"help": "Synchronized phase timing for the first N steps."})
    peak_flops: float | None = field(
        default=None, metadata={"help": "Peak FLOP/s for MFU (default: the device's bf16 datasheet peak)."})
    loss_chunk_size: int | None = field(
        default=None, metadata={"help": "Positions per chunk of the LM loss (default: at most 2**27 logits, 256 MiB in "
                                        "bf16, in multiples of 128 positions; 2,048 at a 65,536-entry vocabulary)."})
    distill_alpha: float = field(default=0.5, metadata={"help": "Weight of the distillation term."})
    distill_temperature: float = field(default=1.0, metadata={"help": "Distillation temperature T."})
    distill_divergence: str = field(default="forward_kl", metadata={"help": f"One of {list(DIVERGENCES)}."})
    stability_guard: bool = field(
        default=True, metadata={"help": "Skip the update of a loss spike, lower the learning rate for a while after "
                                        "a gradient-norm blow-up, stop after many skips in a row."})
    stability_warmup_steps: int = field(
        default=20, metadata={"help": "Losses (and gradient norms) seen before the guard compares against them."})
    stability_loss_spike: float = field(default=1.0, metadata={"help": "Nats above the running mean that skip a step."})
    stability_loss_spike_sigmas: float = field(
        default=2.5, metadata={"help": "... or this many running standard deviations of the loss, if more (0: the "
                                       "fixed limit alone): small batches are noisy."})
    stability_grad_norm_factor: float = field(
        default=10.0, metadata={"help": "A gradient norm this many times its running typical value lowers the "
                                        "learning rate (low_memory optimizer only: it reports the norm for free)."})
    stability_lr_factor: float = field(default=0.5, metadata={"help": "Learning-rate multiplier after a blow-up."})
    stability_cooldown_steps: int = field(
        default=100, metadata={"help": "Steps at the lowered learning rate; it then returns to the schedule "
                                       "linearly over as many steps."})
    stability_max_consecutive_skips: int = field(
        default=20, metadata={"help": "After this many skipped steps in a row, roll back to the newest checkpoint from "
                                      "before the trouble at a lower learning rate, or stop if there is none."})
    stability_max_rollbacks: int = field(
        default=2, metadata={"help": "Rollbacks allowed in a run (each multiplies the learning rate by "
                                     "--stability_lr_factor from then on); 0: stop instead."})
    stability_checkpoint_after_warmup: bool = field(
        default=True, metadata={"help": "With the guard on and checkpoints saved, also save one at the step the "
                                        "learning-rate warm-up ends: a run can break soon after it, before the "
                                        "first regular save, and a rollback needs a checkpoint from before the "
                                        "trouble."})
    collapse_check_steps: int = field(
        default=10, metadata={"help": "Stop training (an error) once the training cross-entropy has stayed within "
                                      "--collapse_margin nats of ln(vocab_size), the loss of uniform predictions, "
                                      "for this many steps in a row: the model has collapsed, usually from too high "
                                      "a learning rate. 0 turns the check off."})
    collapse_margin: float = field(
        default=0.05, metadata={"help": "Nats around ln(vocab_size) that count as uniform predictions."})
    # Activation checkpointing on by default (transformers >= 5.24 renamed the flag; keep one, no warning). Unset
    # (None) until __post_init__, like the batch size, so that the memory planner knows what the user gave.
    __annotations__[CHECKPOINTING_FLAG] = bool | None
    vars()[CHECKPOINTING_FLAG] = field(
        default=None, metadata={"help": "Recompute layer activations in backward (default: on, or what "
                                        "--memory_plan auto decides)."})
    per_device_train_batch_size: int | None = field(
        default=None, metadata={"help": f"Batch size per device (default: {DEFAULT_BATCH_SIZE}, or what "
                                        "--memory_plan auto decides)."})
    per_device_eval_batch_size: int | None = field(
        default=None, metadata={"help": f"Evaluation batch size per device (default: {DEFAULT_EVAL_BATCH_SIZE}, or "
                                        "with --memory_plan auto the training batch size the plan picks)."})
    torch_compile: bool | None = field(
        default=None, metadata={"help": "torch.compile each decoder layer (default: on with CUDA, where it measured "
                                        "faster, off elsewhere); the first steps' compile time is logged apart "
                                        "from the steady-state tokens/s."})
    memory_plan: str | None = field(
        default=None, metadata={"help": "auto: decide batch size and per-layer / per-step activation recompute "
                                        "before training for --memory_cap_gib (hf-recurrent-plan-memory); none: "
                                        "as given. Default: auto with CUDA, none elsewhere."})
    memory_cap_gib: float | None = field(
        default=None, metadata={"help": "Memory the plan may use, GiB (default: what is free on the CUDA device when "
                                        "the run starts plus what this process holds, not the card's total)."})
    memory_margin_gib: float = field(
        default=1.4, metadata={"help": "Kept free below the cap: the CUDA context and the estimate's error."})
    memory_host_gib: float | None = field(default=None, metadata={"help": HOST_HELP})
    memory_placements: str = field(default=DEFAULT_PLACEMENTS, metadata={"help": PLACEMENTS_HELP})
    memory_device_profile: str | None = field(default=None, metadata={"help": TRAINING_PROFILE_HELP})
    memory_calibration: str | None = field(
        default=None, metadata={"help": "The planner's calibration file (default: the package's, measured on an "
                                        "H200; hf-recurrent-plan-memory --calibrate makes one for your card)."})
    # transformers 5 dropped `overwrite_output_dir` from TrainingArguments; `pretrain` still follows run_clm.py's
    # rule, so the flag lives here (the Trainer itself ignores it).
    if "overwrite_output_dir" not in TrainingArguments.__dataclass_fields__:
        overwrite_output_dir: bool = field(
            default=False, metadata={"help": "Start afresh in a non-empty --output_dir: its checkpoints and final/ "
                                             "are deleted before training (default: resume its last complete "
                                             "checkpoint; refuse a folder without one)."})
    prediction_loss_only: bool = field(default=True, metadata={"help": "Evaluation computes the loss only."})
    # Batches carry keys the model's forward does not take (targets, teacher top-k): the loss reads them.
    remove_unused_columns: bool = field(default=False, metadata={"help": "Drop batch keys forward does not take."})

    def __post_init__(self):
        self._resolve_device_defaults()
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"--optimizer={self.optimizer!r} is not allowed; choose one of {list(OPTIMIZERS)}.")
        if self.torch_compile_mode == "reduce-overhead" or self.torch_compile_mode == "max-autotune":
            raise ValueError(
                f"--torch_compile_mode={self.torch_compile_mode!r} uses CUDA graphs, which break with a depth that "
                "changes every step and with gradient checkpointing; use 'default' or 'max-autotune-no-cudagraphs'."
            )
        if self.distill_divergence not in DIVERGENCES:
            raise ValueError(
                f"--distill_divergence={self.distill_divergence!r} is not allowed; choose one of {list(DIVERGENCES)}.")
        self._check_ranges()
        self._check_schedule_ranges()
        check_settings(**self.stability_settings(), name_prefix="--stability_")
        if self.label_names is None:
            self.label_names = [TARGETS]
        if self.tf32 is None and torch.cuda.is_available():
            # fp32 matmuls (the loss's head-gradient accumulation) otherwise run on SIMT cores: ~8% of a 3B step.
            self.tf32 = True
        if getattr(self, f"{CHECKPOINTING_FLAG}_kwargs") is None:
            setattr(self, f"{CHECKPOINTING_FLAG}_kwargs", {"use_reentrant": False})
        if self.disable_tqdm is None:
            # In a log file every bar refresh is one more carriage-return line (thousands per run); the log lines
            # (loss, learning rate every --logging_steps) still say how far it got.
            self.disable_tqdm = not sys.stderr.isatty()
        if self.optimizer == "low_memory" and self.optimizer_in_backward:
            # The optimizer's own check (optim.in_backward) says the same for library callers, without the flags.
            if self.gradient_accumulation_steps != 1:
                raise ValueError(
                    f"--gradient_accumulation_steps={self.gradient_accumulation_steps} is not allowed with the "
                    "low-memory optimizer's update in backward (--optimizer_in_backward, on by default): each weight "
                    "is updated as soon as its gradient exists, so there is nothing to sum over micro-batches. Raise "
                    "--per_device_train_batch_size instead, or pass --optimizer_in_backward false to accumulate "
                    "(the full gradients then stay in memory until each step).")
            # Gradients are freed as they are used: there is nothing left to clip; the optimizer clips per tensor.
            self.max_grad_norm = 0.0
        with self._unset_warmup_checked_as_zero():
            super().__post_init__()
        align_tf32_settings()  # transformers' tf32 left torch's legacy matmul flag disagreeing (compat.py)

    def _resolve_device_defaults(self):
        """Fields left None: batch sizes, checkpointing, torch.compile (on with CUDA) and the memory plan (auto with
        CUDA). `explicit_memory_settings` keeps which of the first three were given: they win over a memory plan."""
        explicit = {name for name, given in (("per_device_train_batch_size", self.per_device_train_batch_size),
                                             ("per_device_eval_batch_size", self.per_device_eval_batch_size),
                                             ("activation_checkpointing", getattr(self, CHECKPOINTING_FLAG)),
                                             ("activation_checkpointing", self.gradient_checkpointing))
                    if given is not None}
        if getattr(self, "explicit_memory_settings", None) is None:  # a copy of resolved arguments keeps the first
            self.explicit_memory_settings = explicit
        if self.per_device_train_batch_size is None:
            self.per_device_train_batch_size = DEFAULT_BATCH_SIZE
        if self.per_device_eval_batch_size is None:
            self.per_device_eval_batch_size = DEFAULT_EVAL_BATCH_SIZE
        if getattr(self, CHECKPOINTING_FLAG) is None:
            setattr(self, CHECKPOINTING_FLAG,
                    True if self.gradient_checkpointing is None else self.gradient_checkpointing)
        cuda = torch.cuda.is_available() and not self.use_cpu
        if self.torch_compile is None:
            self.torch_compile = cuda or self.torch_compile_mode is not None or self.torch_compile_backend is not None
        if self.memory_plan is None:
            self.memory_plan = "auto" if cuda else "none"
        _check(self, "memory_plan", self.memory_plan in MEMORY_PLANS, f"one of {list(MEMORY_PLANS)}")
        _check(self, "memory_cap_gib", self.memory_cap_gib is None or _is_number(self.memory_cap_gib, 0, strict=True),
               "> 0 (GiB), or unset for the memory free on the CUDA device when the run starts")
        check_host_gib(self.memory_host_gib)
        check_placements(self.memory_placements)
        check_profile_value(self.memory_device_profile, "--memory_device_profile")
        _check(self, "memory_margin_gib", _is_number(self.memory_margin_gib, 0), ">= 0 (GiB)")
        if self.memory_calibration is not None and not os.path.isfile(self.memory_calibration):
            raise ValueError(f"--memory_calibration {self.memory_calibration} not found; make one with "
                             "`hf-recurrent-plan-memory --calibrate probes.jsonl --calibration PATH`, or leave it "
                             "unset for the package's.")

    @contextlib.contextmanager
    def _unset_warmup_checked_as_zero(self):
        """TrainingArguments compares warmup_steps with 0: an unset one passes that check and stays unset."""
        unset = self.warmup_steps is None
        if unset:
            self.warmup_steps = 0
        try:
            yield
        finally:
            if unset:
                self.warmup_steps = None

    def _check_ranges(self):
        """Our fields' ranges, checked here because otherwise they fail late: at the first step (a depth of 0, a
        distillation weight of 5) or only at the first evaluation, after that many steps of training are lost."""
        check = functools.partial(_check, self)

        for name in ("backprop_depth", "eval_num_steps"):
            value = getattr(self, name)
            check(name, value is None or _is_int(value, 1),
                  "an integer >= 1 (recurrent steps), or unset for the model config's default")
        check("depth_supervision", _is_int(self.depth_supervision, 1),
              "an integer >= 1 (depths whose LM loss is averaged each step; 1, the default, is the last depth only)")
        check("depth_supervision_weights", self.depth_supervision_weights in WEIGHTINGS, f"one of {list(WEIGHTINGS)}")
        check("exit_gate_entropy_weight", _is_number(self.exit_gate_entropy_weight, 0),
              "a number >= 0 (0: the expected loss alone)")
        check("gc_interval", _is_int(self.gc_interval, 0),
              "an integer >= 0 (steps between garbage collections; 0 leaves Python's automatic collection)")
        check("profile_steps", _is_int(self.profile_steps, 0),
              "an integer >= 0 (0 turns step profiling off)")
        check("loss_chunk_size", self.loss_chunk_size is None or _is_int(self.loss_chunk_size, 1),
              "an integer >= 1 (positions per chunk of the loss), or unset for 2**27 logits per chunk")
        check("optimizer_momentum",
              self.optimizer_momentum is None or _is_number(self.optimizer_momentum, 0, high=1),
              "in [0, 1) (0 turns momentum off), or unset for the default 0.9")
        check("optimizer_momentum_rank_fraction",
              self.optimizer_momentum_rank_fraction is None
              or (_is_number(self.optimizer_momentum_rank_fraction) and 0 < self.optimizer_momentum_rank_fraction <= 1),
              "in (0, 1] (1 = full momentum), or unset for the size-based default")
        check("optimizer_clip_threshold",
              _is_number(self.optimizer_clip_threshold, 0, strict=True), "a number > 0")
        check("optimizer_subspace_residual", self.optimizer_subspace_residual is None
              or (_is_number(self.optimizer_subspace_residual) and 0 <= self.optimizer_subspace_residual <= 1),
              "in [0, 1], or unset for sqrt((1 - beta1) / (1 + beta1))")
        check("peak_flops", self.peak_flops is None or _is_number(self.peak_flops, 0, strict=True),
              "a number > 0 (FLOP/s), or unset for the device's datasheet peak")
        check("distill_alpha", _is_number(self.distill_alpha) and 0 <= self.distill_alpha <= 1,
              "in [0, 1] (the weight of the distillation term; 1 - alpha weighs the plain cross-entropy)")
        check("distill_temperature", _is_number(self.distill_temperature, 0, strict=True),
              "a number > 0")
        check("collapse_check_steps", _is_int(self.collapse_check_steps, 0),
              "an integer >= 0 (0 turns the collapse check off)")
        check("collapse_margin", _is_number(self.collapse_margin, 0, strict=True), "a number > 0 (nats)")

    def _check_schedule_ranges(self):
        """The schedule's and the Trainer's step counts and rates, flag by flag, as they are parsed: TrainingArguments
        takes --max_steps 0 for one step and a negative one for whole epochs, and a negative --learning_rate fails
        only in the optimizer, after the data and the model are built and the output folder is made."""
        check = functools.partial(_check, self)

        def steps(value) -> bool:
            """TrainingArguments' interval: a whole number of steps >= 1, or a fraction in (0, 1) of the run."""
            return _is_number(value, 0, strict=True) and (value < 1 or value == int(value))

        check("max_steps", self.max_steps is None or self.max_steps == -1 or _is_int(self.max_steps, 1),
              "an integer >= 1 (optimizer steps), or -1 to train --num_train_epochs epochs")
        check("learning_rate", self.learning_rate is None or _is_number(self.learning_rate, 0, strict=True),
              "a number > 0 (the peak learning rate)")
        check("warmup_steps", self.warmup_steps is None or _is_number(self.warmup_steps, 0),
              "a number >= 0 (warm-up steps, or a fraction of the run's steps if below 1)")
        check("num_train_epochs", self.num_train_epochs is None or _is_number(self.num_train_epochs, 0, strict=True),
              "a number > 0 (epochs, used when --max_steps is -1)")
        for name in ("gradient_accumulation_steps", "per_device_train_batch_size", "per_device_eval_batch_size"):
            check(name, _is_int(getattr(self, name), 1), "an integer >= 1")
        check("eval_accumulation_steps", self.eval_accumulation_steps is None
              or _is_int(self.eval_accumulation_steps, 1), "an integer >= 1, or unset")
        # An interval counts only where its strategy is "steps"; an unset --eval_steps takes --logging_steps.
        intervals = (("logging_steps", self.logging_strategy, ""), ("save_steps", self.save_strategy, ""),
                     ("eval_steps", self.eval_strategy, ", or unset to evaluate every --logging_steps"))
        for name, strategy, unset in intervals:
            value = getattr(self, name)
            if getattr(strategy, "value", strategy) == "steps" and not (name == "eval_steps" and value is None):
                check(name, steps(value), f"an integer >= 1 (steps), or a fraction in (0, 1) of the run's steps{unset}"
                      f" (--{name.replace('_steps', '_strategy')} no turns it off)")
        check("weight_decay", _is_number(self.weight_decay, 0), "a number >= 0")
        for name in ("adam_beta1", "adam_beta2"):
            check(name, _is_number(getattr(self, name), 0, high=1), "in [0, 1)")
        check("adam_epsilon", _is_number(self.adam_epsilon, 0, strict=True), "a number > 0")
        check("max_grad_norm", _is_number(self.max_grad_norm, 0), "a number >= 0 (0 turns clipping off)")

    def stability_settings(self) -> dict:
        """Keyword arguments of `StabilityGuard` from the `stability_*` fields."""
        return dict(warmup_steps=self.stability_warmup_steps, loss_spike=self.stability_loss_spike,
                    loss_spike_sigmas=self.stability_loss_spike_sigmas,
                    grad_norm_factor=self.stability_grad_norm_factor, lr_factor=self.stability_lr_factor,
                    cooldown_steps=self.stability_cooldown_steps,
                    max_consecutive_skips=self.stability_max_consecutive_skips,
                    max_rollbacks=self.stability_max_rollbacks)


def resolve_schedule_defaults(training_args: RecurrentTrainingArguments, num_params: int,
                              swept_learning_rate: float | None = None) -> dict:
    """Fill the schedule fields left None, in place, for a model of `num_params` parameters.

    learning_rate: `swept_learning_rate` (the rate of the --learning_rate_from sweep file, which the run's job
    read), else the size's default. warmup_steps and
    max_steps: LARGE_MODEL_SCHEDULE from LARGE_MODEL_PARAMS up (one epoch where max_steps is unset), else
    SMALL_MODEL_SCHEDULE. num_train_epochs: TrainingArguments' default (3) where not set otherwise. Fields the user
    set are never changed. Returns the large-model defaults applied (empty for a small model), for the log.
    """
    large = num_params >= LARGE_MODEL_PARAMS
    if training_args.learning_rate is None and swept_learning_rate is not None:
        training_args.learning_rate = swept_learning_rate
        logger.info("Learning rate %g from %s", training_args.learning_rate, training_args.learning_rate_from)
    schedule = LARGE_MODEL_SCHEDULE if large else SMALL_MODEL_SCHEDULE
    applied = {name: value for name, value in schedule.items() if getattr(training_args, name) is None}
    if large and training_args.max_steps is None and training_args.num_train_epochs is None:
        applied["num_train_epochs"] = LARGE_MODEL_EPOCHS
    for name, value in applied.items():
        setattr(training_args, name, value)
    fill_unset_schedule(training_args)  # num_train_epochs where max_steps decides
    return applied if large else {}


def fill_unset_schedule(training_args) -> None:
    """Schedule fields still None take TrainingArguments' defaults (5e-5, no warm-up, 3 epochs), in place.

    `RecurrentTrainer` calls this, so arguments built in code train as the HF Trainer would; `pretrain` calls
    `resolve_schedule_defaults` first, which leaves nothing unset."""
    for name in SCHEDULE_FIELDS:
        if getattr(training_args, name) is None:
            setattr(training_args, name, TrainingArguments.__dataclass_fields__[name].default)
