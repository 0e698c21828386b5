"""`RecurrentTrainer`: the HF Trainer with depth sampling, the low-memory optimizer in backward, the chunked
loss (plain CE or distillation), and step profiling / throughput / MFU / memory logging."""

import logging
import time
from dataclasses import dataclass, field

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments

from hf_recurrent import DepthSampler, flops_per_token
from hf_recurrent.presets import is_recurrent

from .distill import DIVERGENCES, OnlineTeacher, TopKTeacher, chunked_lm_loss
from .telemetry import PhaseProfiler, device_peak_flops, memory_stats
from .distributed import check_optimizer_supports, saved_as_pretrained_class
from .optim import check_gradient_accumulation, create_optimizer

logger = logging.getLogger(__name__)

OPTIMIZERS = ("low_memory", "hf")
# Batch key of the targets aligned with positions (target t belongs to input t); HF's loss functions use the
# same name for labels that are already shifted.
TARGETS = "shift_labels"
_CHECKPOINTING = (
    "activation_checkpointing" if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
    else "gradient_checkpointing"
)


# The low-memory optimizer's bf16 momentum costs 2 bytes per parameter. It is on by default below this size
# (recurrent-3.3b: +6.7 GB, still fits a 24 GB card) and off from it up (recurrent-7b would need +13.8 GB): at 121M
# parameters it brought the held-out loss from 8.6% to 0.6% behind AdamW, and on small recurrent models in bf16 it
# made the difference between a stalled and a healthy run (BENCHMARKS.md).
AUTO_MOMENTUM, AUTO_MOMENTUM_MAX_PARAMS = 0.9, 5e9


def resolve_momentum(momentum: float | None, num_params: int) -> float | None:
    """The optimizer's beta1: the argument if given (0 = off), else the size-based default."""
    if momentum is None:
        return AUTO_MOMENTUM if num_params < AUTO_MOMENTUM_MAX_PARAMS else None
    return momentum or None


@dataclass
class RecurrentTrainingArguments(TrainingArguments):
    backprop_depth: int | None = field(
        default=None, metadata={"help": "Gradients through the last k recurrent steps only (default: the config's)."})
    depth_seed: int = field(default=0, metadata={"help": "Seed of the per-step depth sampler."})
    eval_num_steps: int | None = field(
        default=None, metadata={"help": "Depth used for evaluation (default: the config's mean_recurrence)."})
    optimizer: str = field(
        default="low_memory",
        metadata={"help": "low_memory (factored, bf16 in place, update in backward) or hf (use `optim`)."})
    optimizer_in_backward: bool = field(
        default=True, metadata={"help": "Update each tensor as soon as its gradient exists (gradient release)."})
    optimizer_momentum: float | None = field(
        default=None, metadata={"help": "beta1 of a bf16 first moment (2 bytes per parameter); 0 turns it off. Default: "
                                        "0.9 for models under 5B parameters, off from 5B up (see resolve_momentum)."})
    optimizer_clip_threshold: float = field(default=1.0, metadata={"help": "Per-tensor update RMS clip."})
    profile_steps: int = field(default=30, metadata={"help": "Synchronized phase timing for the first N steps."})
    peak_flops: float | None = field(
        default=None, metadata={"help": "Peak FLOP/s for MFU (default: the device's bf16 datasheet peak)."})
    loss_chunk_size: int = field(default=1024, metadata={"help": "Positions per chunk of the LM loss."})
    distill_alpha: float = field(default=0.5, metadata={"help": "Weight of the distillation term."})
    distill_temperature: float = field(default=1.0, metadata={"help": "Distillation temperature T."})
    distill_divergence: str = field(default="forward_kl", metadata={"help": f"One of {list(DIVERGENCES)}."})
    # Activation checkpointing on by default (transformers >= 5.24 renamed the flag; keep one, no warning).
    __annotations__[_CHECKPOINTING] = bool
    vars()[_CHECKPOINTING] = field(default=True, metadata={"help": "Recompute layer activations in backward."})
    prediction_loss_only: bool = field(default=True, metadata={"help": "Evaluation computes the loss only."})
    # Batches carry keys the model's forward does not take (targets, teacher top-k): the loss reads them.
    remove_unused_columns: bool = field(default=False, metadata={"help": "Drop batch keys forward does not take."})

    def __post_init__(self):
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
        if self.label_names is None:
            self.label_names = [TARGETS]
        if self.tf32 is None and torch.cuda.is_available():
            # fp32 matmuls (the loss's head-gradient accumulation) otherwise run on SIMT cores: ~8% of a 3B step.
            self.tf32 = True
        if getattr(self, f"{_CHECKPOINTING}_kwargs") is None:
            setattr(self, f"{_CHECKPOINTING}_kwargs", {"use_reentrant": False})
        uses_release = self.optimizer == "low_memory" and self.optimizer_in_backward
        if uses_release:
            check_gradient_accumulation(self.gradient_accumulation_steps, in_backward=True)
            # Gradients are freed as they are used: there is nothing left to clip; the optimizer clips per tensor.
            self.max_grad_norm = 0.0
        super().__post_init__()


def compile_decoder_layers(model, mode: str = "default", backend: str = "inductor") -> int:
    """`torch.compile` each decoder layer in place; returns how many were compiled."""
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    for layer in layers:
        layer.compile(mode=mode, backend=backend)
    return len(layers)


class _PhaseCallback(TrainerCallback):
    """Times the optimizer step the Trainer runs between backward and the next batch."""

    def __init__(self, profiler: PhaseProfiler):
        self.profiler = profiler
        self._phase = None

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._phase = self.profiler.phase("optimizer")
        self._phase.__enter__()

    def on_optimizer_step(self, args, state, control, **kwargs):
        if self._phase is not None:
            self._phase.__exit__(None, None, None)
            self._phase = None

    def on_step_end(self, args, state, control, **kwargs):
        self.profiler.mark_step_end()


class RecurrentTrainer(Trainer):
    """Trainer for recurrent-depth models (and their Transformer baselines, which simply have no depth).

    `teacher`: an optional frozen causal LM for online distillation. Batches carrying `teacher_topk_ids` and
    `teacher_topk_logprobs` (from an offline teacher cache) are distilled against those instead.
    """

    def __init__(self, *args, teacher=None, teacher_vocab_limit: int | None = None, **kwargs):
        args_ = kwargs.get("args", args[1] if len(args) > 1 else None)
        # torch.compile is applied per decoder layer (below), not to the whole model: the depth loop stays
        # eager, so a new depth does not recompile, and saved keys carry no `_orig_mod.` prefix.
        compile_options = None
        if args_ is not None and args_.torch_compile:
            compile_options = {"mode": args_.torch_compile_mode or "default",
                               "backend": args_.torch_compile_backend or "inductor"}
            args_.torch_compile = False
        super().__init__(*args, **kwargs)
        if compile_options is not None:
            compile_decoder_layers(self.model, **compile_options)
        config = self.model.config
        self.recurrent = is_recurrent(config)
        self.depth_sampler = DepthSampler(config, seed=self.args.depth_seed) if self.recurrent else None
        self.teacher = teacher
        self.teacher_vocab_limit = teacher_vocab_limit
        if teacher is not None:
            teacher.eval().requires_grad_(False)
        self.profiler = PhaseProfiler(self.args.profile_steps)
        self.add_callback(_PhaseCallback(self.profiler))
        self.peak_flops = self.args.peak_flops or device_peak_flops()
        self._window = {"tokens": 0, "flops": 0.0, "ce": 0.0, "kd": 0.0, "depth": 0, "steps": 0}
        self._window_start = time.perf_counter()
        self._profile_logged = False

    # -- optimizer

    def create_optimizer(self, model=None):
        check_optimizer_supports(self.model, self.args.optimizer, self.accelerator)
        if self.args.optimizer != "low_memory":
            return super().create_optimizer(model)
        if self.optimizer is None:
            num_params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            momentum = resolve_momentum(self.args.optimizer_momentum, num_params)
            logger.info("LowMemoryAdafactor: momentum %s for %.0fM trainable parameters", momentum, num_params / 1e6)
            self.optimizer = create_optimizer(
                self.model,
                lr=self.args.learning_rate,
                weight_decay=self.args.weight_decay,
                in_backward=self.args.optimizer_in_backward,
                momentum=momentum,
                gradient_accumulation_steps=self.args.gradient_accumulation_steps,
                clip_threshold=self.args.optimizer_clip_threshold,
                seed=self.args.seed,
            )
        return self.optimizer

    def _save(self, output_dir=None, state_dict=None):
        # FSDP2 swaps the model's class for a wrapper; saved code and auto_map must name the real class.
        with saved_as_pretrained_class(self.model):
            super()._save(output_dir, state_dict)

    # -- depth

    def current_depth(self, training: bool) -> dict:
        if not self.recurrent:
            return {}
        if not training:
            return {"num_steps": self.args.eval_num_steps}
        return {"num_steps": self.depth_sampler(self.state.global_step), "backprop_depth": self.args.backprop_depth}

    # -- loss

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.profiler.mark_step_start()
        with self.profiler.phase("training_step"):  # forward + loss + backward; backward is the remainder
            return super().training_step(model, inputs, num_items_in_batch)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        training = model.training
        unwrapped = self.accelerator.unwrap_model(model)
        input_ids = inputs["input_ids"]
        targets = inputs[TARGETS]
        depth = self.current_depth(training)
        with self.profiler.phase("forward"):
            hidden = unwrapped.model(
                input_ids=input_ids, attention_mask=inputs.get("attention_mask"), use_cache=False, **depth
            ).last_hidden_state
        teacher = self._teacher_for(inputs) if training else None  # evaluation reports the plain CE
        with self.profiler.phase("loss"):
            out = chunked_lm_loss(
                hidden,
                unwrapped.lm_head.weight,
                targets,
                teacher=teacher,
                alpha=self.args.distill_alpha,
                temperature=self.args.distill_temperature,
                divergence=self.args.distill_divergence,
                chunk_size=self.args.loss_chunk_size,
            )
        if training:
            num_steps = depth.get("num_steps")
            self._window["tokens"] += input_ids.numel()
            self._window["flops"] += input_ids.numel() * flops_per_token(
                unwrapped.config, num_steps, depth.get("backprop_depth"), seq_len=input_ids.shape[1])
            # Summed on the device and read at logging time: a float() here would wait for the GPU every step.
            self._window["ce"] += out.ce.detach()
            self._window["kd"] += out.kd.detach()
            self._window["depth"] += num_steps or 0
            self._window["steps"] += 1
        return (out.loss, {"loss": out.loss}) if return_outputs else out.loss

    def _teacher_for(self, inputs):
        if "teacher_topk_ids" in inputs:
            return TopKTeacher(ids=inputs["teacher_topk_ids"], logprobs=inputs["teacher_topk_logprobs"])
        if self.teacher is None:
            return None
        with torch.no_grad():
            teacher_device = self.teacher.device
            hidden = self.teacher.model(input_ids=inputs["input_ids"].to(teacher_device), use_cache=False)
            hidden = hidden.last_hidden_state.to(inputs["input_ids"].device)
        weight = self.teacher.get_output_embeddings().weight.to(hidden.device)
        return OnlineTeacher(hidden=hidden, lm_head_weight=weight, vocab_limit=self.teacher_vocab_limit)

    # -- logging

    def log(self, logs: dict, *args, **kwargs):
        if "loss" in logs and self._window["steps"]:
            window, elapsed = self._window, max(time.perf_counter() - self._window_start, 1e-9)
            logs["tokens_per_second"] = round(window["tokens"] / elapsed, 1)
            if self.peak_flops:
                logs["mfu"] = round(window["flops"] / elapsed / self.peak_flops, 4)
            logs["ce"] = round(float(window["ce"]) / window["steps"], 4)
            kd = float(window["kd"]) / window["steps"]
            if self.teacher is not None or kd:
                logs["kd"] = round(kd, 4)
            if self.recurrent:
                logs["depth"] = round(window["depth"] / window["steps"], 2)
            optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
            if hasattr(optimizer, "last_grad_norm"):
                logs["grad_norm"] = optimizer.last_grad_norm
                logs["skipped_updates"] = optimizer.skipped_updates
            logs.update(memory_stats())
            self._window = dict.fromkeys(window, 0)
            self._window_start = time.perf_counter()
            if not self.profiler.active and not self._profile_logged and self.profiler.steps_seen:
                logs.update(self.profiler.breakdown())
                self._profile_logged = True
        super().log(logs, *args, **kwargs)
