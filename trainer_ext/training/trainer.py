"""`RecurrentTrainer`: the HF Trainer with depth sampling, the low-memory optimizer in backward, the chunked
loss (plain CE or distillation), a stability guard (skipped updates on loss spikes, a lower learning rate after a
gradient-norm blow-up), and step profiling / throughput / MFU / memory logging."""

import logging
import math
import os
import shutil
import time
from dataclasses import dataclass, field

import torch
from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, rotate_checkpoints

from hf_recurrent import DepthSampler, flops_per_token
from hf_recurrent.presets import is_recurrent

from trainer_ext.training.checkpoints import TRAINER_STATE_NAME, last_complete_checkpoint, publish, staging_dir
from trainer_ext.distill.losses import DIVERGENCES, OnlineTeacher, TopKTeacher, chunked_lm_loss
from trainer_ext.training.telemetry import PhaseProfiler, device_peak_flops, memory_stats
from trainer_ext.training.distributed import check_optimizer_supports, saved_as_pretrained_class
from trainer_ext.training.optimizer import check_gradient_accumulation, create_optimizer
from trainer_ext.training.stability import StabilityGuard, UnstableTrainingError, check_settings, write_interventions

logger = logging.getLogger(__name__)

OPTIMIZERS = ("low_memory", "hf")
# Batch key of the targets aligned with positions (target t belongs to input t); HF's loss functions use the
# same name for labels that are already shifted.
TARGETS = "shift_labels"
# The guard's running statistics live in the trainer state (trainer_state.json of each checkpoint) under this key,
# so that a resumed run takes the decisions an uninterrupted one would have taken.
STABILITY_STATE_KEY = "StabilityGuard"
INTERVENTIONS_FILE = "stability_interventions.json"
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
    stability_guard: bool = field(
        default=True, metadata={"help": "Skip the update of a loss spike, lower the learning rate for a while after "
                                        "a gradient-norm blow-up, stop after many skips in a row."})
    stability_warmup_steps: int = field(
        default=20, metadata={"help": "Losses (and gradient norms) seen before the guard compares against them."})
    stability_loss_spike: float = field(
        default=1.0, metadata={"help": "A loss this many nats above its running mean skips the update."})
    stability_loss_spike_sigmas: float = field(
        default=2.5, metadata={"help": "... or this many running standard deviations of the loss, if more (0: the "
                                       "fixed limit alone): small batches are noisy."})
    stability_grad_norm_factor: float = field(
        default=10.0, metadata={"help": "A gradient norm this many times its running typical value lowers the "
                                        "learning rate (low_memory optimizer only: it reports the norm for free)."})
    stability_lr_factor: float = field(
        default=0.5, metadata={"help": "Learning-rate multiplier after a gradient-norm blow-up."})
    stability_cooldown_steps: int = field(
        default=100, metadata={"help": "Steps at the lowered learning rate; it then returns to the schedule "
                                       "linearly over as many steps."})
    stability_max_consecutive_skips: int = field(
        default=20, metadata={"help": "Stop training after this many skipped steps in a row."})
    collapse_check_steps: int = field(
        default=10, metadata={"help": "Stop training (an error) once the training cross-entropy has stayed within "
                                      "--collapse_margin nats of ln(vocab_size), the loss of uniform predictions, "
                                      "for this many steps in a row: the model has collapsed, usually from too high "
                                      "a learning rate. 0 turns the check off."})
    collapse_margin: float = field(
        default=0.05, metadata={"help": "Nats around ln(vocab_size) that count as uniform predictions."})
    # Activation checkpointing on by default (transformers >= 5.24 renamed the flag; keep one, no warning).
    __annotations__[_CHECKPOINTING] = bool
    vars()[_CHECKPOINTING] = field(default=True, metadata={"help": "Recompute layer activations in backward."})
    # transformers 5 dropped `overwrite_output_dir` from TrainingArguments; scripts (run_pretrain) still follow
    # run_clm.py's rule, so the flag lives here (the Trainer itself ignores it).
    if "overwrite_output_dir" not in TrainingArguments.__dataclass_fields__:
        overwrite_output_dir: bool = field(
            default=False, metadata={"help": "Start afresh in a non-empty --output_dir: its checkpoints and final/ "
                                             "are deleted before training (default: resume its last complete "
                                             "checkpoint; refuse a folder without one)."})
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
        self._check_ranges()
        check_settings(**self.stability_settings(), name_prefix="--stability_")
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

    def _check_ranges(self):
        """Our fields' ranges, checked here because otherwise they fail late: at the first step (a depth of 0, a
        distillation weight of 5) or only at the first evaluation, after that many steps of training are lost."""
        def check(name: str, ok: bool, allowed: str):
            if not ok:
                raise ValueError(f"--{name}={getattr(self, name)!r} is not allowed; it must be {allowed}.")

        def is_int(value) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        def is_number(value) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

        for name in ("backprop_depth", "eval_num_steps"):
            value = getattr(self, name)
            check(name, value is None or (is_int(value) and value >= 1),
                  "an integer >= 1 (recurrent steps), or unset for the model config's default")
        check("profile_steps", is_int(self.profile_steps) and self.profile_steps >= 0,
              "an integer >= 0 (0 turns step profiling off)")
        check("loss_chunk_size", is_int(self.loss_chunk_size) and self.loss_chunk_size >= 1,
              "an integer >= 1 (positions per chunk of the loss)")
        check("optimizer_momentum",
              self.optimizer_momentum is None or (is_number(self.optimizer_momentum)
                                                  and 0 <= self.optimizer_momentum < 1),
              "in [0, 1) (0 turns momentum off), or unset for the size-based default")
        check("optimizer_clip_threshold",
              is_number(self.optimizer_clip_threshold) and self.optimizer_clip_threshold > 0, "a number > 0")
        check("peak_flops", self.peak_flops is None or (is_number(self.peak_flops) and self.peak_flops > 0),
              "a number > 0 (FLOP/s), or unset for the device's datasheet peak")
        check("distill_alpha", is_number(self.distill_alpha) and 0 <= self.distill_alpha <= 1,
              "in [0, 1] (the weight of the distillation term; 1 - alpha weighs the plain cross-entropy)")
        check("distill_temperature", is_number(self.distill_temperature) and self.distill_temperature > 0,
              "a number > 0")
        check("collapse_check_steps", is_int(self.collapse_check_steps) and self.collapse_check_steps >= 0,
              "an integer >= 0 (0 turns the collapse check off)")
        check("collapse_margin", is_number(self.collapse_margin) and self.collapse_margin > 0, "a number > 0 (nats)")

    def stability_settings(self) -> dict:
        """Keyword arguments of `StabilityGuard` from the `stability_*` fields."""
        return dict(warmup_steps=self.stability_warmup_steps, loss_spike=self.stability_loss_spike,
                    loss_spike_sigmas=self.stability_loss_spike_sigmas,
                    grad_norm_factor=self.stability_grad_norm_factor, lr_factor=self.stability_lr_factor,
                    cooldown_steps=self.stability_cooldown_steps,
                    max_consecutive_skips=self.stability_max_consecutive_skips)


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


class _StabilityCallback(TrainerCallback):
    """The stability guard's points in the Trainer's loop that lie outside `compute_loss`."""

    def __init__(self, trainer: "RecurrentTrainer"):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._start_stability_guard(state)

    def on_optimizer_step(self, args, state, control, **kwargs):
        # Before the scheduler steps: it must never see (and build on) the guard's lowered rate.
        self.trainer._restore_scheduled_lr()

    def on_step_end(self, args, state, control, **kwargs):
        if control.should_save:
            # The step's gradient norm is otherwise read at the next step, which a run resumed from this
            # checkpoint would never see; waiting for it costs nothing next to writing a checkpoint.
            self.trainer._observe_grad_norm()
        state.stateful_callbacks[STABILITY_STATE_KEY] = self.trainer.stability.state_dict()

    def on_train_end(self, args, state, control, **kwargs):
        self.trainer._write_interventions()


class _HealthCallback(TrainerCallback):
    """Starts the collapse and skipped-update bookkeeping of each `train()` once a resumed optimizer is loaded."""

    def __init__(self, trainer: "RecurrentTrainer"):
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._reset_health_bookkeeping()


class RecurrentTrainer(Trainer):
    """Trainer for recurrent-depth models (and their Transformer baselines, which simply have no depth).

    `teacher`: an optional frozen causal LM for online distillation. Batches carrying `teacher_topk_ids` and
    `teacher_topk_logprobs` (from an offline teacher cache) are distilled against those instead.

    With `args.stability_guard` (on by default) a `StabilityGuard` watches the training loss and the optimizer's
    gradient norm: its interventions are logged as warnings, counted in the logs (`stability/*`), kept in the
    trainer state of each checkpoint and written to `output_dir/stability_interventions.json` at the end.
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
        self._window = {"tokens": 0, "flops": 0.0, "ce": 0.0, "kd": 0.0, "depth": 0, "steps": 0, "nonfinite": 0}
        self._window_start = time.perf_counter()
        self._profile_logged = False
        self.stability = None
        if self.args.stability_guard:
            self.stability = StabilityGuard(**self.args.stability_settings())
            self.add_callback(_StabilityCallback(self))
        self._reset_stability_bookkeeping()
        self._reset_health_bookkeeping()
        self.add_callback(_HealthCallback(self))

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

    @property
    def unwrapped_optimizer(self):
        """The optimizer itself (LowMemoryAdafactor, ...), not Accelerate's wrapper around it."""
        return getattr(self.optimizer, "optimizer", self.optimizer)

    # -- checkpoints: written under a staging folder, renamed into place when complete

    def _save_checkpoint(self, model, trial):
        """The Trainer's save, made atomic: a kill at any point leaves `checkpoint-N` complete or absent.

        The Trainer writes `<run_dir>/checkpoint-N` file by file (weights, optimizer, RNG, `trainer_state.json` last,
        ~70 ms on the debug model, seconds at 3B). Here `_get_output_dir` points it at `<run_dir>/tmp-checkpoint-N`
        for the duration, so it writes `tmp-checkpoint-N/checkpoint-N` (its own rotation there finds nothing to
        delete), and the finished folder is then renamed to `<run_dir>/checkpoint-N`. Rotation runs after the
        rename, so older checkpoints are deleted only once the new one is visible.
        """
        run_dir = self._get_output_dir(trial=trial)
        checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        staging_root = staging_dir(checkpoint)
        staged = os.path.join(staging_root, os.path.basename(checkpoint))
        if self.args.should_save:
            shutil.rmtree(staging_root, ignore_errors=True)  # left by a save that was killed
        self.accelerator.wait_for_everyone()
        self._staging_root, self._deferred_push = staging_root, False
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._staging_root = None
        if self.state.best_model_checkpoint == staged:  # the Trainer recorded the staging path: name the final one
            self.state.best_model_checkpoint = checkpoint
            if self.args.should_save:
                self.state.save_to_json(os.path.join(staged, TRAINER_STATE_NAME))
        self.accelerator.wait_for_everyone()  # every process has written its part (RNG state, sharded weights)
        if self.args.should_save:
            publish(staged, checkpoint)
            os.rmdir(staging_root)
            rotate_checkpoints(output_dir=run_dir, save_total_limit=self.args.save_total_limit,
                               best_model_checkpoint=self.state.best_model_checkpoint, use_mtime=True)
        self.accelerator.wait_for_everyone()
        if self._deferred_push:
            super()._push_from_checkpoint(checkpoint)

    def _get_output_dir(self, trial):
        staging_root = getattr(self, "_staging_root", None)
        return staging_root if staging_root is not None else super()._get_output_dir(trial)

    def _push_from_checkpoint(self, checkpoint_folder):
        # The Trainer's own push (with push_to_hub) uploads from the checkpoint folder in the background: upload the
        # published folder, not the staging one that is about to be renamed.
        if getattr(self, "_staging_root", None) is not None:
            self._deferred_push = True
            return
        super()._push_from_checkpoint(checkpoint_folder)

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
            self._window["nonfinite"] += (~torch.isfinite(out.loss.detach())).sum()
            self._window["steps"] += 1
        loss = out.loss
        if training and self.stability is not None:
            loss = self._guarded_loss(model, loss)
        return (loss, {"loss": out.loss}) if return_outputs else loss

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

    # -- stability guard (trainer_ext/stability.py decides; this carries it out)

    def _reset_stability_bookkeeping(self):
        self._skipping_step = None  # step whose update is being skipped
        self._grad_norm_step = None  # step whose gradient norm the guard has not seen yet
        self._scheduled_lrs = None  # the scheduler's learning rates while the guard's multiplier is applied
        self._loss_window = {"finite_sum": 0.0, "finite": 0, "nonfinite": 0}  # since the last logged loss

    def _start_stability_guard(self, state):
        """A fresh guard for each `train()`, or the checkpoint's when resuming."""
        self.stability = StabilityGuard(**self.args.stability_settings())
        saved = state.stateful_callbacks.get(STABILITY_STATE_KEY)
        if saved is not None:
            self.stability.load_state_dict(saved)
        self._reset_stability_bookkeeping()

    def _guarded_loss(self, model, loss):
        """`loss`, or, when the guard skips this step, a stand-in with no graph to the parameters.

        The decision has to come before backward: the in-backward optimizer updates each weight as its gradient
        arrives. Backward of the stand-in reaches no parameter, so no weight and no optimizer state changes (a zero
        gradient would not do: the second-moment and momentum decay would still run); the Trainer's
        `optimizer.step()` then only does bookkeeping (in backward) or passes over parameters without a gradient
        (stock optimizers), and the scheduler steps as usual, so the schedule stays a function of the step.
        """
        step = self.state.global_step + 1  # numbered as in the logs
        if self._skipping_step == step:  # an earlier micro-batch of this step was already bad
            return self._stand_in(loss)
        value = self._loss_value(loss)
        self._observe_grad_norm()  # the previous step's, complete by now: the read above has waited for more
        intervention = self.stability.check_loss(step, value)
        if math.isfinite(value):
            self._loss_window["finite_sum"] += value
            self._loss_window["finite"] += 1
        else:
            self._loss_window["nonfinite"] += 1
        if intervention is None:
            self._scale_lr(self.stability.lr_scale(step))
            self._grad_norm_step = step
            return loss
        logger.warning("stability guard: %s", intervention.describe())
        if self.stability.should_stop:
            self._stop_unstable_training(intervention)
        self._skipping_step = step
        if self._grad_norm_step == step:
            self._grad_norm_step = None
        if self.args.gradient_accumulation_steps > 1:
            model.zero_grad(set_to_none=True)  # the whole step is skipped, its earlier micro-batches too
        return self._stand_in(loss)

    def _stand_in(self, loss):
        """The loss value for the Trainer's running sum, detached from the graph; backward of it is a no-op.

        A non-finite loss is replaced by the running mean: the Trainer's sum would stay NaN for the rest of the run
        (or, with its NaN filter, count the step as a 0.0 loss at the start of a logging window). `log` then
        reports the window's finite losses, or NaN. `torch.where` keeps this free of a device sync.
        """
        finite = torch.where(torch.isfinite(loss), loss.detach(), self.stability.loss_mean or 0.0)
        return finite.requires_grad_()

    def _loss_value(self, loss) -> float:
        """The loss on the host: the guard's one device sync per step (on several processes, their mean, so that
        every process takes the same decision). The Trainer's NaN filter, on by default, already waits for each
        step's loss, so in the default setting this adds no wait."""
        if self.accelerator.num_processes > 1:
            loss = self.accelerator.reduce(loss.detach(), reduction="mean")
        return loss.detach().item()

    def _observe_grad_norm(self):
        """Give the guard the gradient norm of the last step that was not skipped, once that step has run.

        LowMemoryAdafactor collects it on the device and hands it over a step late on GPU; read after this step's
        loss, it is ready and the read does not wait. Stock optimizers report no norm (the Trainer computes one
        only for clipping, inside its loop): there the guard acts on losses only.
        """
        step = self._grad_norm_step
        if step is None or step > self.state.global_step:
            return
        self._grad_norm_step = None
        optimizer = self.unwrapped_optimizer
        if not hasattr(optimizer, "last_grad_norm"):
            return
        intervention = self.stability.check_grad_norm(step, optimizer.last_grad_norm)
        if intervention is not None:
            logger.warning("stability guard: %s", intervention.describe())

    def _scale_lr(self, scale: float):
        """Multiply the scheduled learning rates for this step's update; `_restore_scheduled_lr` undoes it."""
        if scale == 1.0 and self._scheduled_lrs is None:
            return
        groups = self.optimizer.param_groups
        if self._scheduled_lrs is None:
            self._scheduled_lrs = [group["lr"] for group in groups]
        for group, lr in zip(groups, self._scheduled_lrs, strict=True):
            group["lr"] = lr * scale

    def _restore_scheduled_lr(self):
        # Put back the exact values: schedulers that build on the current rate stay on their schedule, and a
        # checkpoint holds the schedule's rates, so a resumed run applies the guard's multiplier the same way.
        if self._scheduled_lrs is None:
            return
        for group, lr in zip(self.optimizer.param_groups, self._scheduled_lrs, strict=True):
            group["lr"] = lr
        self._scheduled_lrs = None

    def _write_interventions(self):
        if self.args.should_save:
            write_interventions(os.path.join(self.args.output_dir, INTERVENTIONS_FILE), self.stability)

    def _stop_unstable_training(self, intervention):
        self._write_interventions()
        skips, step = self.stability.consecutive_skips, intervention.step
        output_dir = self.args.output_dir
        last = last_complete_checkpoint(output_dir)
        checkpoint = f"the last checkpoint ({last}) is intact" if last else "no checkpoint had been saved yet"
        raise UnstableTrainingError(
            f"Training stopped by the stability guard at step {step}: the last {skips} steps were all skipped "
            f"(this one: {intervention.describe()}). No update was applied after step {step - skips}, so the "
            f"weights and optimizer state are those of that step; {checkpoint}. The learning rate is most likely "
            "too high for this model and batch: lower --learning_rate (2-4x is a usual first try; resuming a "
            "checkpoint keeps its schedule, so start the schedule again) or run the learning-rate threshold test "
            "to find the largest rate that stays stable. With a non-finite loss, check the training data at these "
            f"steps as well. Interventions: {os.path.join(output_dir, INTERVENTIONS_FILE)}. Limits: "
            "--stability_loss_spike, --stability_max_consecutive_skips (--stability_guard false turns it off)."
        )

    # -- logging

    def log(self, logs: dict, *args, **kwargs):
        collapsed = False
        if "loss" in logs and self._window["steps"]:
            window, elapsed = self._window, max(time.perf_counter() - self._window_start, 1e-9)
            logs["tokens_per_second"] = round(window["tokens"] / elapsed, 1)
            if self.peak_flops:
                logs["mfu"] = round(window["flops"] / elapsed / self.peak_flops, 4)
            ce = float(window["ce"]) / window["steps"]
            logs["ce"] = round(ce, 4)
            kd = float(window["kd"]) / window["steps"]
            if self.teacher is not None or kd:
                logs["kd"] = round(kd, 4)
            if self.recurrent:
                logs["depth"] = round(window["depth"] / window["steps"], 2)
            optimizer = self.unwrapped_optimizer
            if hasattr(optimizer, "last_grad_norm"):
                logs["grad_norm"] = optimizer.last_grad_norm
                logs["skipped_updates"] = optimizer.skipped_updates
                self._report_skipped_updates(optimizer.skipped_updates)
            nonfinite = int(window["nonfinite"])
            if nonfinite:
                logs["nonfinite_losses"] = nonfinite
                if self.stability is None:
                    # The Trainer's NaN filter counts a non-finite loss as 0.0 at the start of a logging window
                    # (or as the window's mean so far): a healthy-looking number for a broken step.
                    logs["loss"] = float("nan")
            collapsed = self._track_collapse(ce)
            self._logged_step = self.state.global_step
            logs.update(memory_stats())
            self._window = dict.fromkeys(window, 0)
            self._window_start = time.perf_counter()
            if not self.profiler.active and not self._profile_logged and self.profiler.steps_seen:
                logs.update(self.profiler.breakdown())
                self._profile_logged = True
        if "loss" in logs and self.stability is not None:
            self._add_stability_logs(logs)
        super().log(logs, *args, **kwargs)
        if collapsed:  # after the log line, so that the losses that led here are on record
            self._stop_collapsed_training()

    # -- collapse and skipped updates: failures the loss alone does not make loud

    def _reset_health_bookkeeping(self):
        self._logged_step = self.state.global_step  # last step whose loss was logged
        self._uniform_since = None  # first step of the current run of near-uniform logged losses
        self._last_ce = None
        optimizer = self.unwrapped_optimizer
        # A resumed optimizer carries the skips of the run before: report only the new ones.
        self._reported_skips = optimizer.skipped_updates if hasattr(optimizer, "skipped_updates") else 0

    def _report_skipped_updates(self, skipped_updates: int):
        """Warn when the low-memory optimizer skipped tensors (non-finite gradients) since the last log: the step's
        loss looks normal, yet part of the model (or all of it) was not updated."""
        new = skipped_updates - self._reported_skips
        self._reported_skips = skipped_updates
        if new > 0:
            logger.warning("steps %d-%d: the optimizer skipped %d tensor update(s) for non-finite gradients (%d in "
                           "this run): those steps updated the model only in part, or not at all",
                           self._logged_step + 1, self.state.global_step, new, skipped_updates)

    def _track_collapse(self, ce: float) -> bool:
        """True once the training CE of every logged window over the last `collapse_check_steps` steps was within
        `collapse_margin` of ln(vocab_size): the loss of uniform predictions, whatever the data. A model at
        initialization usually sits above it (its logits are not all equal) and a learning one falls below it within
        a few steps; a run that stays there ignores its input, and the loss alone looks merely "high"."""
        if not self.args.collapse_check_steps:
            return False
        self._last_ce = ce
        if self.state.global_step <= self.args.get_warmup_steps(self.state.max_steps):
            # A large model near uniform at init under a long, slow warm-up passes ln(V) slowly: not a collapse.
            self._uniform_since = None
            return False
        uniform = math.log(self.model.config.vocab_size)
        if not (math.isfinite(ce) and abs(ce - uniform) <= self.args.collapse_margin):
            self._uniform_since = None
            return False
        if self._uniform_since is None:
            self._uniform_since = self._logged_step + 1
        return self.state.global_step - self._uniform_since + 1 >= self.args.collapse_check_steps

    def _stop_collapsed_training(self):
        vocab_size, step, since = self.model.config.vocab_size, self.state.global_step, self._uniform_since
        optimizer = self.unwrapped_optimizer
        skipped = getattr(optimizer, "skipped_updates", 0)
        skips = (f" The optimizer also skipped {skipped} tensor update(s) for non-finite gradients." if skipped
                 else "")
        message = (
            f"Training stopped at step {step}: the model has collapsed to uniform predictions. Its training "
            f"cross-entropy has stayed within {self.args.collapse_margin:g} nats of ln(vocab_size) = "
            f"{math.log(vocab_size):.4f} (vocab_size {vocab_size}), the loss of giving every token the same "
            f"probability, for steps {since}-{step} (last: {self._last_ce:.4f}).{skips} The learning rate is most "
            f"likely far too high: --learning_rate is {self.args.learning_rate:g}. Lower it, or run the "
            "learning-rate threshold test `hf-recurrent-find-lr` to find the largest rate that stays stable. "
            f"Checkpoints saved from step {since} on hold the collapsed weights; no final model was saved. "
            "(--collapse_check_steps 0 turns this check off; --collapse_margin sets the band.)"
        )
        logger.error(message)
        raise UnstableTrainingError(message)

    def _add_stability_logs(self, logs: dict):
        window = self._loss_window
        if window["nonfinite"]:
            # The Trainer's figure holds stand-ins for the non-finite losses: report the finite ones, or NaN.
            logs["loss"] = window["finite_sum"] / window["finite"] if window["finite"] else float("nan")
        self._loss_window = dict.fromkeys(window, 0)
        logs["stability/skipped_steps"] = self.stability.skipped_steps
        logs["stability/interventions"] = len(self.stability.interventions)
        logs["stability/lr_scale"] = self.stability.lr_scale(self.state.global_step)
