"""`RecurrentTrainer`: the HF Trainer with depth sampling, the low-memory optimizer in backward, the chunked
loss (plain CE or distillation), a stability guard (skipped updates on loss spikes, a lower learning rate after a
gradient-norm blow-up, a rollback to an earlier checkpoint after persistent trouble), step profiling /
throughput / MFU / memory logging, a checkpoint before stopping on SIGINT / SIGTERM, and a free-space check before
each checkpoint."""

import contextlib
import functools
import logging
import math
import os
import shutil
import signal
import time

import torch
from transformers import Trainer, default_data_collator
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from hf_recurrent import DepthSampler, flops_per_token
from hf_recurrent.presets import is_recurrent

from trainer_ext.checkpoints import (
    TRAINER_STATE_NAME,
    expected_checkpoint_bytes,
    last_complete_checkpoint,
    publish,
    rotate_checkpoints,
    staging_dir,
)
from trainer_ext.distill.losses import OnlineTeacher, TopKTeacher, chunked_lm_loss
from trainer_ext.files import check_free_space, disk_full_error, is_disk_full, remove_paths
from trainer_ext.progress import library_bars_off_without_terminal
from trainer_ext.optim.momentum import resolve_momentum, resolve_subspace_residual
from trainer_ext.optim.optimizer import create_optimizer
from trainer_ext.training.arguments import TARGETS, fill_unset_schedule
from trainer_ext.training.callbacks import (
    GarbageCollectionCallback,
    PhaseTimingCallback,
    StopOnSignalCallback,
    TrainingHooksCallback,
    TrainingInterrupted,
    WarmupEndCheckpointCallback,
)
from trainer_ext.training.compiling import compile_decoder_layers
from trainer_ext.training.depth_supervision import supervision_for
from trainer_ext.training.distributed import (
    bind_optimizer,
    check_optimizer_supports,
    decoder_hidden,
    saved_as_pretrained_class,
)
from trainer_ext.training.stability import StabilityGuard, UnstableTrainingError
from trainer_ext.training.stability_mixin import StabilityMixin
from trainer_ext.training.telemetry import PhaseProfiler, device_peak_flops, memory_stats, reset_memory_peaks

logger = logging.getLogger(__name__)

# Older checkpoints are deleted only once the new one is complete: --save_total_limit N needs room for N + 1.
_FIX_CHECKPOINT_SPACE = ("delete checkpoints no longer needed or lower --save_total_limit{now} (the save needs room "
                         "for one more than it keeps)")
# Steps of a compiled run whose time (compilation and warm-up) is logged as `compile_warmup_seconds`, apart from the
# steady-state tokens/s and MFU, which start after them.
COMPILE_WARMUP_STEPS = 2


class RecurrentTrainer(StabilityMixin, Trainer):
    """Trainer for recurrent-depth models (and their Transformer baselines, which simply have no depth).

    `teacher`: an optional frozen causal LM for online distillation. Batches carrying `teacher_topk_ids` and
    `teacher_topk_logprobs` (from an offline teacher cache) are distilled against those instead.

    With `args.stability_guard` (on by default) a `StabilityGuard` watches the training loss and the optimizer's
    gradient norm: its interventions are logged as warnings, counted in the logs (`stability/*`), kept in the
    trainer state of each checkpoint and written to `output_dir/stability_interventions.json` at the end.
    """

    def __init__(self, *args, teacher=None, teacher_vocab_limit: int | None = None, **kwargs):
        args_ = kwargs.get("args", args[1] if len(args) > 1 else None)
        if args_ is not None:
            fill_unset_schedule(args_)
        # torch.compile is applied per decoder layer and norm (compiling.py), not to the whole model.
        compile_options = None
        if args_ is not None and args_.torch_compile:
            compile_options = {"mode": args_.torch_compile_mode or "default",
                               "backend": args_.torch_compile_backend or "inductor"}
            args_.torch_compile = False
        # The samples of the token shards have one length: stacking is all a batch needs. Given a tokenizer as
        # processing_class, the Trainer would pick DataCollatorWithPadding: 20-30 ms of Python per batch of
        # 32 x 1,024 tokens, and an all-ones attention_mask with which the causal mask's creation waits for the GPU
        # in every forward (BENCHMARKS.md).
        if len(args) < 3 and kwargs.get("data_collator") is None:
            kwargs["data_collator"] = default_data_collator
        super().__init__(*args, **kwargs)
        if compile_options is not None:
            compile_decoder_layers(self.model, **compile_options)
        config = self.model.config
        self.recurrent = is_recurrent(config)
        self.depth_sampler = DepthSampler(config, seed=self.args.depth_seed) if self.recurrent else None
        # None: the loss at the last depth only; an exit gate's expected loss over depths otherwise (exit_gate.py)
        self.depth_supervision = supervision_for(self.args, self.recurrent, getattr(config, "exit_gate", False))
        self.teacher = teacher
        self.teacher_vocab_limit = teacher_vocab_limit
        if teacher is not None:
            teacher.eval().requires_grad_(False)
        self.profiler = PhaseProfiler(self.args.profile_steps)
        self.add_callback(PhaseTimingCallback(self.profiler))
        self.peak_flops = self.args.peak_flops or device_peak_flops()
        # Since the last logged loss. `nonfinite` counts non-finite losses once: on the host where the stability
        # guard reads each loss anyway, else on the device (no sync). `finite_sum` / `finite`: the guard's losses.
        self._window = {"tokens": 0, "flops": 0.0, "ce": 0.0, "kd": 0.0, "depth": 0, "steps": 0, "nonfinite": 0,
                        "finite_sum": 0.0, "finite": 0}
        self._window_start = time.perf_counter()
        self._step_flops = 0.0  # of the step under way, handed to the Trainer's FLOP count (floating_point_ops)
        self._training_clock = None  # (seconds before this train() call, its start): _start_training_clock
        self._profile_logged = False
        self._warmup_steps_left = COMPILE_WARMUP_STEPS if compile_options is not None else 0
        self._warmup = {"start": None, "seconds": None, "logged": False}
        self.stability = None
        if self.args.stability_guard:
            self.stability = StabilityGuard(**self.args.stability_settings())
        self._reset_stability_bookkeeping()
        self._reset_health_bookkeeping()
        # Before the hooks: their step end reads the save this one asks for.
        self._signals = StopOnSignalCallback()
        self.add_callback(self._signals)
        self._hooks = TrainingHooksCallback(self)
        self.add_callback(self._hooks)
        if self.args.stability_guard and self.args.stability_checkpoint_after_warmup:
            self.add_callback(WarmupEndCheckpointCallback())
        self._gc = GarbageCollectionCallback(self.args.gc_interval) if self.args.gc_interval else None
        if self._gc is not None:
            self.add_callback(self._gc)

    def train(self, *args, **kwargs):
        reset_memory_peaks()
        try:
            with self._signals.handling(), library_bars_off_without_terminal(), \
                    self._gc.during_training() if self._gc is not None else contextlib.nullcontext():
                result = super().train(*args, **kwargs)
        finally:
            self._hooks.restore_nan_filter(self.args)  # also after an exception inside a step
        if self._signals.received is not None:
            self._raise_interrupted()
        return result

    def _raise_interrupted(self):
        """After train() stopped on a signal: say where it saved and how to go on, then end with the signal's exit
        status (TrainingInterrupted)."""
        name = signal.Signals(self._signals.received).name
        run_dir = self._get_output_dir(trial=None)
        if self._signals.stopped_at is not None:
            checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self._signals.stopped_at}")
            where = f"at step {self._signals.stopped_at}, saved as {checkpoint}"
        else:  # the signal came after the last step: nothing was left to save
            checkpoint = last_complete_checkpoint(run_dir)
            where = (f"after its last step ({self.state.global_step}), before the end of the run; the last complete "
                     f"checkpoint is {checkpoint}")
        message = (f"Training stopped by {name} {where}. Run the same command again to resume from it (a non-empty "
                   "--output_dir resumes from its last complete checkpoint); the losses continue as if "
                   "uninterrupted.")
        logger.error(message)
        raise TrainingInterrupted(self._signals.received, message, checkpoint)

    # -- optimizer

    def create_optimizer(self, model=None):
        check_optimizer_supports(self.model, self.args.optimizer, self.accelerator)
        if self.args.optimizer != "low_memory":
            return super().create_optimizer(model)
        if self.optimizer is None:
            num_params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
            momentum, rank_fraction = resolve_momentum(self.args.optimizer_momentum,
                                                       self.args.optimizer_momentum_rank_fraction, num_params)
            logger.info("LowMemoryAdafactor: momentum %s (%s) for %.0fM trainable parameters", momentum,
                        "off" if momentum is None else "full" if rank_fraction is None
                        else f"subspace, rank fraction {rank_fraction:g}", num_params / 1e6)
            self.optimizer = create_optimizer(
                self.model,
                lr=self.args.learning_rate,
                weight_decay=self.args.weight_decay,
                in_backward=self.args.optimizer_in_backward,
                momentum=momentum,
                momentum_rank_fraction=rank_fraction,
                gradient_accumulation_steps=self.args.gradient_accumulation_steps,
                clip_threshold=self.args.optimizer_clip_threshold,
                subspace_residual=resolve_subspace_residual(self.args.optimizer_subspace_residual, momentum),
                beta2=self.args.adam_beta2,  # HF's flag, the same 0.999 default
                fused=self.args.optimizer_fused,
                update_stream=self.args.optimizer_update_stream,
                seed=self.args.seed,
            )
        return self.optimizer

    def _bind_optimizer(self) -> None:
        """The in-backward optimizer follows the wrapped model (DDP's averaged gradients, FSDP2's shards):
        `distributed.bind_optimizer`, before the first backward and before a resumed optimizer state loads."""
        bind_optimizer(self.model_wrapped, self.unwrapped_optimizer)

    def _load_optimizer_and_scheduler(self, checkpoint):
        if checkpoint is not None:
            self._bind_optimizer()  # under FSDP2 the state to load into lives on the shards
        super()._load_optimizer_and_scheduler(checkpoint)

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

        Before writing, the free space is checked against the checkpoint's expected size; a save that fills the disk
        anyway removes its staging folder and says how much more space is needed (a rerun resumes from the last
        complete checkpoint).
        """
        run_dir = self._get_output_dir(trial=trial)
        checkpoint = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}")
        staging_root = staging_dir(checkpoint)
        staged = os.path.join(staging_root, os.path.basename(checkpoint))
        if self.args.should_save:
            shutil.rmtree(staging_root, ignore_errors=True)  # left by a save that was killed
        # Every process checks (one filesystem is shared), so that all stop together rather than wait for a writer.
        needed = expected_checkpoint_bytes(self.model, self.unwrapped_optimizer, run_dir)
        what, fix = os.path.basename(checkpoint), _FIX_CHECKPOINT_SPACE.format(
            now=f" (now {self.args.save_total_limit})" if self.args.save_total_limit else "")
        check_free_space(run_dir, needed, what, fix)
        self.accelerator.wait_for_everyone()
        self._staging_root, self._deferred_push = staging_root, False
        try:
            super()._save_checkpoint(model, trial)
        except Exception as err:
            if not (self.args.should_save and is_disk_full(err)):
                raise
            # torch.save's error on a full disk ("unexpected pos ...") names neither the cause nor the folder, and
            # the partial save would keep the disk full for the rerun.
            removed = remove_paths([staging_root])
            raise disk_full_error(run_dir, needed, what, removed, fix, err) from err
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
            rotate_checkpoints(run_dir, self.args.save_total_limit, self.state.best_model_checkpoint)
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
        supervision = self.depth_supervision if training else None
        with self.profiler.phase("forward"), (contextlib.nullcontext() if supervision is None
                                              else supervision.capture(unwrapped.model, depth)) as captured:
            hidden = decoder_hidden(model, unwrapped, input_ids, inputs.get("attention_mask"), depth)
        teacher = self._teacher_for(inputs) if training else None  # evaluation reports the plain CE
        lm_loss = functools.partial(  # the head's loss from a hidden state (B, T, C), never full logits
            chunked_lm_loss, lm_head_weight=unwrapped.lm_head.weight, labels=targets, teacher=teacher,
            alpha=self.args.distill_alpha, temperature=self.args.distill_temperature,
            divergence=self.args.distill_divergence, chunk_size=self.args.loss_chunk_size,
        )
        with self.profiler.phase("loss"):
            out = (lm_loss(hidden) if supervision is None
                   else supervision.loss(unwrapped.model, hidden, captured, lm_loss))
        if training:
            num_steps = depth.get("num_steps")
            self._window["tokens"] += input_ids.numel()
            readouts = {} if supervision is None else supervision.flops_kwargs(unwrapped.config, depth)
            step_flops = input_ids.numel() * flops_per_token(
                unwrapped.config, num_steps, depth.get("backprop_depth"), seq_len=input_ids.shape[1], **readouts)
            self._window["flops"] += step_flops
            self._step_flops += step_flops
            # Summed on the device and read at logging time: a float() here would wait for the GPU every step.
            self._window["ce"] += out.ce.detach()
            self._window["kd"] += out.kd.detach()
            self._window["depth"] += num_steps or 0
            if self.stability is None:
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

    # -- logging

    def log(self, logs: dict, *args, **kwargs):
        logs["step"] = self.state.global_step  # a log line without it (the Trainer's has the epoch) says not when
        collapsed = False
        if "loss" in logs and self._window["steps"]:
            window, elapsed = self._window, max(time.perf_counter() - self._window_start, 1e-9)
            if self._warmup_steps_left == 0 and window["tokens"]:  # steady state only
                logs["tokens_per_second"] = round(window["tokens"] / elapsed, 1)
                if self.peak_flops:
                    logs["mfu"] = round(window["flops"] / elapsed / self.peak_flops, 4)
            if self._warmup["seconds"] is not None and not self._warmup["logged"]:
                logs["compile_warmup_seconds"] = round(self._warmup["seconds"], 2)
                self._warmup["logged"] = True
            ce = float(window["ce"]) / window["steps"]
            logs["ce"] = round(ce, 4)
            kd = float(window["kd"]) / window["steps"]
            if self.teacher is not None or kd:
                logs["kd"] = round(kd, 4)
            if self.recurrent:
                logs["depth"] = round(window["depth"] / window["steps"], 2)
            if self.depth_supervision is not None:
                logs.update(self.depth_supervision.logs())
            optimizer = self.unwrapped_optimizer
            if hasattr(optimizer, "last_grad_norm"):
                logs["grad_norm"] = optimizer.last_grad_norm
                logs["skipped_updates"] = optimizer.skipped_updates
                self._report_skipped_updates(optimizer.skipped_updates)
            nonfinite = int(window["nonfinite"])
            if nonfinite:
                logs["nonfinite_losses"] = nonfinite
                # The Trainer's figure holds the guard's stand-ins for non-finite losses or, without the guard, its
                # NaN filter's 0.0 (or the window's mean so far): healthy-looking numbers for broken steps. Report
                # the mean of the finite losses the guard saw, or NaN.
                logs["loss"] = window["finite_sum"] / window["finite"] if window["finite"] else float("nan")
            collapsed = self._track_collapse(ce)
            self._logged_step = self.state.global_step
            logs.update(memory_stats())
            self._window = dict.fromkeys(window, 0)
            self._window_start = time.perf_counter()
            if not self.profiler.active and not self._profile_logged and self.profiler.steps_seen:
                logs.update(self.profiler.breakdown())
                self._profile_logged = True
        if ("loss" in logs or "train_runtime" in logs) and self._training_clock is not None:
            base, start = self._training_clock
            logs["train_seconds"] = round(base + time.perf_counter() - start, 3)
        if "loss" in logs and self.stability is not None:
            self._add_stability_logs(logs)
        super().log(logs, *args, **kwargs)
        if collapsed:  # after the log line, so that the losses that led here are on record
            self._stop_collapsed_training()

    def floating_point_ops(self, inputs) -> float:
        """The training FLOPs of the step just run, at the depth it ran (`hf_recurrent.flops_per_token`, recompute
        and backprop depth included), which the Trainer sums over steps and processes into `state.total_flos`: kept
        in every checkpoint, so a resumed run counts on (the Trainer's own estimate, 6 x parameters per token, knows
        no depth)."""
        flops, self._step_flops = self._step_flops, 0.0
        return flops

    def _start_training_clock(self):
        """`train_seconds` of the log lines: wall time in train() since the run began, carried over a resume from the
        last logged value (the time of steps lost after the checkpoint a run resumes from does not count)."""
        logged = [entry["train_seconds"] for entry in self.state.log_history if "train_seconds" in entry]
        self._training_clock = (logged[-1] if logged else 0.0, time.perf_counter())

    def _count_warmup_step(self, starting: bool = False):
        """Times the first COMPILE_WARMUP_STEPS steps of a compiled run apart from the steady-state throughput."""
        if self._warmup_steps_left <= 0:
            return
        if starting:
            self._warmup["start"] = self._warmup["start"] or time.perf_counter()
            return
        self._warmup_steps_left -= 1
        if self._warmup_steps_left == 0:
            self._warmup["seconds"] = time.perf_counter() - self._warmup["start"]
            logger.info("torch.compile: the first %d steps took %.1f s (compilation and warm-up); tokens/s and MFU "
                        "count the steps after them", COMPILE_WARMUP_STEPS, self._warmup["seconds"])
            self._window["tokens"], self._window["flops"] = 0, 0.0
            self._window_start = time.perf_counter()

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
