"""The same-data comparison: a recurrent-depth model against a Transformer baseline (or two: one of equal parameters,
one of equal compute), trained in token cycles.

Every cycle takes the next `cycle_tokens` training tokens of one data stream and, in this order:

    prepare          shards of the cycle's tokens (`trainer_ext.data.prepare`), starting where the previous
                     cycle's piece of the stream ended, with the held-out set's shards as its eval split
    cache_teacher    only with --teacher_cache_model: the teacher's top-k log-probs over the cycle's shards
    train_recurrent  `pretrain`: cycle 1 from the recurrent preset, later cycles continue the previous cycle's
                     training from its last checkpoint (weights, optimizer state, learning-rate schedule)
    train_baseline   the same for the baseline (a LlamaForCausalLM): same tokenizer, data, order and seed; then
                     the second baseline's (train_compute_baseline), with --compute_baseline_preset
    evaluate         every model on one fixed held-out set (the recurrent one at each evaluation depth),
                     appended to the results files; model cards rewritten; pushes submitted
    cleanup          the cycle's shards, teacher cache and intermediate checkpoints deleted, and the previous
                     cycle's last checkpoint (final weights stay, and the cycle's last checkpoint until the next ends)

The held-out set is the first `eval_tokens` tokens of the stream, prepared once before cycle 1 (which also trains
the tokenizer, unless one is given); no cycle trains on it. Cycle k trains for `cycle_tokens // (batch x grad
accum x seq_len)` optimizer steps on exactly the samples those steps consume. Each preparation records where its
piece of the stream ends, and the next one skips to there by whole documents without tokenizing them.

Each model's cycles are one training (`trainer_ext.comparison.training`): one learning-rate schedule spans the cycles
planned when the run started (`planned_cycles` in the state), with one warm-up, and each cycle resumes the previous
one's optimizer state, so N cycles train as one uninterrupted run over the same tokens. A later start may run fewer
cycles; more only under a schedule whose rate does not depend on its length (constant_with_warmup, ...).

Progress lives in `<output_dir>/compare_state.json` (`CompareState`): killed at any point, the same run continues
where it stopped; finished stages are not redone, an interrupted training resumes from its last checkpoint.

Under torchrun / accelerate launch the trainings run data-parallel on every process, with a global batch of the
processes x batch x gradient accumulation; every other stage, and the state and results files, are written by one
process while the others wait, then read the state it recorded (`trainer_ext.files.one_process_writes`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import logging
import os
import shutil

from tqdm.contrib.logging import logging_redirect_tqdm

from hf_recurrent import presets
from trainer_ext.checkpoints import checkpoint_step, is_complete, load_tokenizer
from trainer_ext.comparison.arguments import (
    NON_IDENTITY_ARGS,
    OPTIONAL_IDENTITY_ARGS,
    RUN_TRAINING_ARGS,
    CompareArguments,
    CompareDataArguments,
    TrainingOptions,
    changed_options,
    check_training_options,
    model_config_overrides,
    model_option,
    schedule_depends_on_length,
)
from trainer_ext.comparison.evaluation import HeldoutEvaluation, write_cycle_card
from trainer_ext.comparison.progress import RunProgress, StepProgress, inner_bars_off
from trainer_ext.comparison.pushes import CyclePushes
from trainer_ext.comparison.report import RESULT_FILES, write_results
from trainer_ext.comparison.state import CYCLE_STAGES, MODELS, STATE_NAME, CompareState
from trainer_ext.comparison.training import CycleEnd, CycleTraining, training_compute, whole_run_train_loss
from trainer_ext.data.corpus import hub_datasets, source_text
from trainer_ext.data.prepare import prepare
from trainer_ext.data.shards import read_manifest
from trainer_ext.distill.caching import CacheTeacherArguments, cache_teacher
from trainer_ext.files import check_free_space, format_bytes, one_process_writes
from trainer_ext.hub.model_card import ModelCardInfo, data_prompt
from trainer_ext.run.job import TrainingJob
from trainer_ext.run.model_setup import parse_overrides
from trainer_ext.run.pretrain import pretrain

logger = logging.getLogger(__name__)


class ComparisonRun:
    """One comparison run in `options.training.output_dir`: `run()` starts or continues it. Every check the
    arguments allow runs here, before any work."""

    def __init__(self, args: CompareArguments, data_args: CompareDataArguments, options: TrainingOptions):
        self.args, self.data_args, self.options = args, data_args, options
        training = options.training
        self.out = training.output_dir
        self._check_arguments()
        self.sample_len = data_args.seq_len + 1
        # The launcher's count: `training.world_size` follows accelerate's shared state, which the next
        # TrainingArguments made (the defaults `changed_options` compares with) resets. A launch whose processes
        # do not form one group is refused with the cycle jobs below.
        self.num_processes = int(os.environ.get("WORLD_SIZE", "1"))
        self.global_batch = (training.per_device_train_batch_size * training.gradient_accumulation_steps
                             * self.num_processes)
        self.tokens_per_step = self.global_batch * data_args.seq_len
        self.steps_per_cycle = args.cycle_tokens // self.tokens_per_step
        if self.steps_per_cycle < 1:
            raise ValueError(
                f"--cycle_tokens={args.cycle_tokens} is less than one optimizer step of {self.tokens_per_step} tokens "
                f"(batch {self.global_batch} x seq_len {data_args.seq_len}); raise it or lower the batch / seq_len.")
        self.tokens_per_cycle = self.steps_per_cycle * self.tokens_per_step
        # Stream tokens per cycle: whole samples, exactly what the cycle's steps consume.
        self.stream_per_cycle = self.steps_per_cycle * self.global_batch * self.sample_len
        self.eval_samples = data_args.eval_tokens // self.sample_len
        self.depths = self._eval_depths()
        self.models = tuple(m for m in MODELS if model_option(args, m, "preset") is not None)
        hub = training.hub_model_id
        self.repos = {"recurrent": hub, "baseline": args.hub_baseline_model_id or (hub and f"{hub}-baseline"),
                      "compute_baseline": hub and f"{hub}-compute-baseline"}
        self.state: CompareState | None = None
        self.overrides = {model: model_config_overrides(args, model, data_args.seq_len) for model in self.models}
        for model in self.models:  # cycle 1's jobs, so a bad option fails in seconds, not after data preparation
            TrainingJob.resolve(*self.training(model, 1).arguments(args, options))
        self.writer = True  # this process writes the run's files (the first of a launch of several)
        self.pushes: CyclePushes | None = None
        self.progress: RunProgress | None = None

    def _check_arguments(self) -> None:
        args, data_args, options = self.args, self.data_args, self.options
        check_training_options(options)
        for name in ("per_device_train_batch_size", "gradient_accumulation_steps"):
            if getattr(options.training, name) < 1:
                raise ValueError(f"--{name} must be >= 1, got {getattr(options.training, name)}.")
        if options.training.push_to_hub and not options.training.hub_model_id:
            raise ValueError("--push_to_hub needs --hub_model_id (the recurrent model's repo, e.g. me/r125m).")
        if args.teacher_cache_model is not None and data_args.tokenizer is None:
            raise ValueError("--teacher_cache_model needs --tokenizer: teacher and data must share one tokenizer, and "
                             "one trained by the comparison cannot match the teacher's (pass --tokenizer "
                             f"{args.teacher_cache_model}).")
        if args.teacher_cache_model is not None and options.model.teacher_model_name_or_path:
            raise ValueError("Pass either --teacher_model_name_or_path (online teacher) or --teacher_cache_model "
                             "(a cache per cycle), not both.")

    # -- paths

    def heldout_dir(self) -> str:
        return os.path.join(self.out, "data", "heldout")

    def data_dir(self, cycle: int) -> str:
        return os.path.join(self.out, "data", f"cycle-{cycle:03d}")

    def teacher_cache_dir(self, cycle: int) -> str:
        return os.path.join(self.out, "data", f"cycle-{cycle:03d}-teacher")

    def train_dir(self, model: str, cycle: int) -> str:
        return os.path.join(self.out, model, f"cycle-{cycle:03d}")

    def stages_per_cycle(self) -> tuple[str, ...]:
        skipped = {"cache_teacher": self.args.teacher_cache_model is None,
                   "train_compute_baseline": "compute_baseline" not in self.models}
        return tuple(s for s in CYCLE_STAGES if not skipped.get(s))

    # -- what the run is

    def _eval_depths(self) -> list[int]:
        overrides = parse_overrides(self.args.recurrent_config_overrides)
        mean = presets.get(self.args.recurrent_preset, **overrides).mean_recurrence
        limit = self.args.max_depth_factor * mean
        depths = sorted({d for d in self.args.eval_depths if d <= limit})
        dropped = sorted(set(self.args.eval_depths) - set(depths))
        if dropped:
            logger.info("Evaluation depths %s exceed %g x mean_recurrence (%d) and are skipped.", dropped,
                        self.args.max_depth_factor, mean)
        if not depths:
            raise ValueError(f"--eval_depths {self.args.eval_depths}: none is within --max_depth_factor "
                             f"{self.args.max_depth_factor:g} x mean_recurrence ({mean}); give smaller depths.")
        return depths

    def identity(self) -> dict:
        """What makes two runs the same run: the options that change data, models or results."""
        compare = {k: v for k, v in dataclasses.asdict(self.args).items()
                   if k not in NON_IDENTITY_ARGS and not (k in OPTIONAL_IDENTITY_ARGS and v is None)}
        compare.update({name: getattr(self.options.training, name) for name in RUN_TRAINING_ARGS})
        if self.num_processes > 1:  # part of the global batch; recorded only then, so one-process runs continue
            compare["num_processes"] = self.num_processes
        data = {k: v for k, v in dataclasses.asdict(self.data_args).items() if k not in NON_IDENTITY_ARGS}
        train_args = [[name, value] for name, value in changed_options(self.options)
                      if name not in NON_IDENTITY_ARGS and name not in RUN_TRAINING_ARGS]
        return {"compare": compare, "data": data, "train_args": train_args}

    def teacher(self) -> str | None:
        """The teacher the models are distilled from (a per-cycle cache or an online teacher), if any."""
        return self.args.teacher_cache_model or self.options.model.teacher_model_name_or_path

    def distillation(self) -> dict:
        """How the models were distilled, for the results: the teacher (None without one) and how it was used."""
        teacher, training = self.teacher(), self.options.training
        if teacher is None:
            return {"teacher": None}
        how = f"top-{self._cache_arguments(1).topk} cache per cycle" if self.args.teacher_cache_model else "online"
        return {"teacher": teacher, "distillation": f"{how}, {training.distill_divergence} at weight "
                f"{training.distill_alpha:g}, temperature {training.distill_temperature:g}"}

    def sources(self) -> list[dict]:
        """The data's sources, as the held-out set's manifest records them."""
        return read_manifest(self.heldout_dir()).get("sources", [])

    def _remove_outputs(self) -> None:
        """What an earlier run in this directory wrote (only our own files and folders)."""
        for name in ("data", *MODELS):
            shutil.rmtree(os.path.join(self.out, name), ignore_errors=True)
        for name in RESULT_FILES:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(self.out, name))

    # -- stages

    def prepare_heldout(self) -> None:
        manifest = prepare(self.data_args.prepare_args(
            self.heldout_dir(), eval_only=True, max_tokens=self.eval_samples * self.sample_len))
        num_samples = manifest["splits"]["eval"]["num_samples"]
        if num_samples < self.eval_samples:
            raise ValueError(f"The data stream holds only {num_samples} samples of {self.sample_len} tokens, fewer "
                             f"than the held-out set's {self.eval_samples} (--eval_tokens); add data or lower it.")
        self.state.mark_heldout(dir=self.heldout_dir(), num_samples=num_samples,
                                stream_tokens=num_samples * self.sample_len,
                                stream_end=manifest.get("stream_end"),
                                tokenizer_hash=manifest["tokenizer_hash"],
                                shards=[s["sha256"] for s in manifest["splits"]["eval"]["shards"]])

    def tokens_before(self, cycle: int) -> int:
        """Stream tokens before cycle `cycle`'s: the held-out set's and those of the earlier cycles."""
        return self.state.heldout["stream_tokens"] + (cycle - 1) * self.stream_per_cycle

    def cycle_start(self, cycle: int) -> dict:
        """Where cycle `cycle`'s tokens begin in the stream, as the preparation's skip arguments: the end of the
        previous piece (the held-out set before cycle 1), skipped by whole documents without tokenizing them.
        A piece recorded without its end (by a version before stream positions) is skipped by its token count
        instead, which tokenizes everything before it once; its successor records the position again."""
        previous = self.state.heldout if cycle == 1 else self.state.stage(cycle - 1, "prepare")
        end = previous.get("stream_end")
        if end is None:
            return {"skip_documents": 0, "skip_tokens": self.tokens_before(cycle)}
        return {"skip_documents": end["documents"], "skip_tokens": end["tokens"]}

    def prepare_cycle(self, cycle: int) -> None:
        skip = self.tokens_before(cycle)
        start = self.cycle_start(cycle)
        manifest = prepare(self.data_args.prepare_args(
            self.data_dir(cycle), tokenizer=None, eval_from=self.heldout_dir(), max_tokens=self.stream_per_cycle,
            **start))
        got = manifest["splits"]["train"]["num_samples"]
        needed = self.steps_per_cycle * self.global_batch
        if got < needed:
            raise ValueError(
                f"The data stream ends after {skip + got * self.sample_len:,} tokens: cycle {cycle} needs "
                f"{needed * self.sample_len:,} tokens after the {skip:,} used before it but got "
                f"{got * self.sample_len:,}. Add data (--files / --dataset), or lower --cycle_tokens or "
                "--num_cycles.")
        # A cycle's steps are one Trainer epoch of its shards: the resumed training counts cycle k as epoch k - 1.
        assert got == needed, (got, needed)
        self.state.mark_done(cycle, "prepare", dir=self.data_dir(cycle), skip_tokens=skip, start=start,
                             stream_end=manifest.get("stream_end"), train_samples=got,
                             eval_shards=[s["sha256"] for s in manifest["splits"]["eval"]["shards"]])

    def _cache_arguments(self, cycle: int) -> CacheTeacherArguments:
        options = {"topk": self.args.teacher_cache_topk, "quantization": self.args.teacher_cache_quantization}
        return CacheTeacherArguments(
            teacher_model_name_or_path=self.args.teacher_cache_model, data_dir=self.data_dir(cycle),
            output_dir=self.teacher_cache_dir(cycle), splits=["train"], device=self.args.device,
            trust_remote_code=self.options.model.trust_remote_code,
            **{k: v for k, v in options.items() if v is not None})

    def check_cache_space(self, cycle: int) -> None:
        """Before a cycle's data is prepared: its teacher cache's bytes per token and the disk it needs (logged), and
        a refusal naming the shortfall when the disk has less free."""
        tokenizer = load_tokenizer(self.data_args.tokenizer, "--tokenizer", "pass the teacher's tokenizer")
        codec = self._cache_arguments(cycle).codec(len(tokenizer))
        needed = self.args.cycle_tokens * codec.bytes_per_token
        logger.info("Cycle %d's teacher cache: %d bytes per token (%s codec, k = %d), about %s for %s tokens; it is "
                    "deleted with the cycle.", cycle, codec.bytes_per_token, codec.name, codec.topk,
                    format_bytes(needed), f"{self.args.cycle_tokens:,}")
        check_free_space(self.out, needed, f"cycle {cycle}'s teacher cache",
                         fix="lower --cycle_tokens or --teacher_cache_topk")

    def cache_teacher(self, cycle: int) -> None:
        manifest = cache_teacher(self._cache_arguments(cycle))
        self.state.mark_done(cycle, "cache_teacher", dir=self.teacher_cache_dir(cycle), topk=manifest["topk"],
                             teacher=manifest["teacher"])

    def total_steps(self) -> int:
        """The steps each model's learning-rate schedule spans: those of the planned cycles."""
        planned = self.state.planned_cycles if self.state is not None else None
        return (planned or self.args.num_cycles) * self.steps_per_cycle

    def training(self, model: str, cycle: int, previous_final: str | None = None,
                 previous_checkpoint: str | None = None) -> CycleTraining:
        """One model's training in `cycle`, continuing the previous cycle's (its final weights and last checkpoint)."""
        return CycleTraining(
            model=model, output_dir=self.train_dir(model, cycle), data_dir=self.data_dir(cycle),
            first_step=(cycle - 1) * self.steps_per_cycle, last_step=cycle * self.steps_per_cycle,
            total_steps=self.total_steps(), previous_final=previous_final, previous_checkpoint=previous_checkpoint,
            teacher_cache_dir=self.teacher_cache_dir(cycle) if self.args.teacher_cache_model is not None else None,
            config_overrides=self.overrides[model])

    def train(self, model: str, cycle: int) -> None:
        previous = self.state.stage(cycle - 1, f"train_{model}") if cycle > 1 else {}
        previous_final, previous_checkpoint = previous.get("final_dir"), previous.get("checkpoint")
        for path, present, what in (
                (previous_final, cycle == 1 or os.path.isfile(os.path.join(previous_final, "config.json")),
                 "final weights"),
                (previous_checkpoint, cycle == 1 or is_complete(previous_checkpoint),
                 "last checkpoint (with the optimizer state and the schedule's position)")):
            if not present:
                raise ValueError(f"{path}: the {what} of the {model} model's cycle {cycle - 1} is missing or "
                                 f"incomplete, so its cycle {cycle} cannot continue that training; restore it, or "
                                 "start the comparison again in another --output_dir.")
        training = self.training(model, cycle, previous_final, previous_checkpoint)
        resumed = training.checkpoint()
        if resumed is not None and resumed != previous_checkpoint:
            logger.info("Resuming the interrupted training of %s, cycle %d, from %s.", model, cycle, resumed)
        callbacks = [StepProgress(self.progress, cycle, model, training.first_step, self.steps_per_cycle,
                                  self.tokens_per_step), CycleEnd(training.last_step)]
        # Resolved as the training starts: the pipeline itself resumes, restarts or removes the cycle's folder
        # (--overwrite, a changed run), so the folder decisions of the jobs resolved up front may no longer hold.
        job = TrainingJob.resolve(*training.arguments(self.args, self.options))
        metrics = pretrain(job, callbacks=callbacks)

        def record():  # by the process that wrote the log history, once it is written
            with open(os.path.join(training.output_dir, "log_history.json"), encoding="utf-8") as f:
                log_history = json.load(f)
            train_loss = whole_run_train_loss(log_history, checkpoint_step(resumed) if resumed else None,
                                              metrics.get("train_loss"), training.first_step)

            def last(key):  # the training's own count at its end (carried over the cycles before and resumes)
                return next((entry[key] for entry in reversed(log_history) if key in entry), None)

            self.state.mark_done(cycle, f"train_{model}", final_dir=os.path.join(training.output_dir, "final"),
                                 checkpoint=training.end_checkpoint, base=previous_final,
                                 tokens_seen=cycle * self.tokens_per_cycle, steps=self.steps_per_cycle,
                                 train_loss=train_loss, train_seconds=last("train_seconds"),
                                 train_flops=last("total_flos"))

        self._by_one_process(f"the record of cycle {cycle}'s {model} training", record)

    def evaluate(self, cycle: int) -> None:
        heldout = HeldoutEvaluation(self.heldout_dir(), self.state.heldout["tokenizer_hash"], self.depths,
                                    self.args.eval_batch_size, self.args.eval_max_batches, self.args.device,
                                    self.args.eval_dtype)
        checkpoints = {model: (model_option(self.args, model, "preset"),
                               self.state.stage(cycle, f"train_{model}")["final_dir"]) for model in self.models}
        evaluated = heldout.evaluate(cycle, cycle * self.tokens_per_cycle, checkpoints, self.progress)
        records = [{**record, **training_compute(self.state, record["arch"], cycle, self.tokens_per_cycle),
                    **self.distillation()} for record in evaluated]
        for model in self.models:
            self.write_card(cycle, model, records)
        self.state.mark_done(cycle, "evaluate", results=records)
        write_results(self.out, self.all_records())

    def write_card(self, cycle: int, model: str, records: list[dict]) -> None:
        """The model card of a cycle's final checkpoint, with its held-out results (rewritten before a push, so
        it names the repo pushed to)."""
        other = " and ".join(f"`{model_option(self.args, m, 'preset')}`" for m in self.models if m != model
                             and "recurrent" in (m, model))
        tokens_seen, sources = cycle * self.tokens_per_cycle, self.sources()
        info = ModelCardInfo(
            repo_id=self.repos[model], preset=model_option(self.args, model, "preset"), teacher=self.teacher(),
            tokens_seen=tokens_seen, datasets=hub_datasets(sources), example_prompt=data_prompt(self.heldout_dir()),
            training_data=f"{'; '.join(map(source_text, sources))}, cycle {cycle}: {tokens_seen:,} tokens in cycles "
                          f"of {self.tokens_per_cycle:,}",
            training_details={"Comparison": f"same-data comparison with {other} (same tokenizer, data, order and "
                                            "seed); evaluated on a fixed held-out set of "
                                            f"{self.state.heldout['num_samples'] * self.data_args.seq_len:,} tokens"})
        compute = training_compute(self.state, model, cycle, self.tokens_per_cycle)
        if compute["train_flops"] is not None:
            seconds = compute["train_seconds"]
            info.training_details["Training compute"] = (
                f"{compute['train_flops']:.3g} FLOPs over {tokens_seen:,} tokens (at the depths the steps ran)"
                + (f", {seconds:,.0f} s of training" if seconds is not None else ""))
        write_cycle_card(self.state.stage(cycle, f"train_{model}")["final_dir"], model, records, info)

    def cleanup(self, cycle: int) -> None:
        shutil.rmtree(self.data_dir(cycle), ignore_errors=True)
        shutil.rmtree(self.teacher_cache_dir(cycle), ignore_errors=True)
        for model in self.models:  # resume checkpoints, but the last one, which the next cycle (or a longer run) takes
            keep = self.state.stage(cycle, f"train_{model}")["checkpoint"]
            folders = [self.train_dir(model, c) for c in (cycle - 1, cycle) if c >= 1]
            for checkpoint in (path for folder in folders for path in glob.glob(os.path.join(folder, "checkpoint-*"))):
                if os.path.normpath(checkpoint) != os.path.normpath(keep):
                    shutil.rmtree(checkpoint, ignore_errors=True)
        self.state.mark_done(cycle, "cleanup")

    def all_records(self) -> list[dict]:
        return [r for c in self.state.completed_cycles() for r in self.state.stage(c, "evaluate")["results"]]

    # -- driver

    def submit_pushes(self, cycle: int) -> None:
        for model in self.models:
            if not self.state.is_pushed(cycle, model):
                self.write_card(cycle, model, self.state.stage(cycle, "evaluate")["results"])
                stage = self.state.stage(cycle, f"train_{model}")
                self.pushes.submit(cycle, model, stage["final_dir"], stage["tokens_seen"])

    def _stage(self, cycle: int | str, model: str, name: str, work, *work_args, every_process: bool = False) -> None:
        """Run a stage: on `every_process` (a training, which records itself), else on one while the others wait."""
        self.progress.begin(cycle, model, name)
        with inner_bars_off():
            if every_process:
                work(*work_args)
            else:
                self._by_one_process(f"the {name} stage" + (f" of cycle {cycle}" if cycle != "-" else ""), work,
                                     *work_args)
        self.progress.end()
        if self.pushes is not None:
            self.pushes.sync()

    def _by_one_process(self, what: str, work, *work_args) -> None:
        """`work` (which writes files and records them in the state) on one process of a launch while the others
        wait, then read the state it recorded; just `work` in a run of one process."""
        with one_process_writes(what) as writes:
            if writes:
                work(*work_args)
            else:
                self.state = CompareState.read(self.state.path)

    def run(self) -> dict:
        """Run (or continue) the comparison; returns the output folder, the records, the results files and the
        state file."""
        args = self.args
        path = os.path.join(self.out, STATE_NAME)
        with one_process_writes(f"the state of {self.out}") as writes:
            if writes:
                os.makedirs(self.out, exist_ok=True)
                self.state = CompareState.open(path, self.identity(), args.overwrite,
                                               remove_outputs=self._remove_outputs)
                self._plan_cycles()
            else:
                self.state = CompareState.read(path)
        self.writer = writes
        if self.writer and self.options.training.push_to_hub:
            self.pushes = CyclePushes({m: self.repos[m] for m in self.models}, self.options.training.hub_private_repo,
                                      self.state)
        total = 1 + len(self.stages_per_cycle()) * args.num_cycles
        with logging_redirect_tqdm():
            self.progress = RunProgress(total, self.state.stages_done(), shown=self.writer)
            try:
                if self.pushes is not None:  # cycles evaluated by an earlier start whose push did not finish
                    for cycle in self.state.completed_cycles():
                        if cycle <= args.num_cycles:
                            self.submit_pushes(cycle)
                if self.state.heldout is None:
                    self._stage("-", "-", "heldout", self.prepare_heldout)
                for cycle in range(1, args.num_cycles + 1):
                    self._run_cycle(cycle)
            except Exception:
                if self.pushes is not None:  # record the uploads that finish; the next start retries the rest
                    self.pushes.wait()
                raise
            finally:
                self.progress.close()
        failures = self.pushes.wait() if self.pushes is not None else []
        records = self.all_records()
        with one_process_writes(f"the results files in {self.out}") as writes:
            if writes:
                paths = write_results(self.out, records)
            else:
                paths = [p for p in (os.path.join(self.out, name) for name in RESULT_FILES) if os.path.exists(p)]
        if failures:
            raise RuntimeError("Pushes failed (the checkpoints are intact; the same command retries them):\n"
                               + "\n".join(failures))
        logger.info("Comparison of %d cycles in %s", len(self.state.completed_cycles()), self.out)
        return {"output_dir": self.out, "results": records, "files": paths,
                "state": os.path.join(self.out, STATE_NAME)}

    def _plan_cycles(self) -> None:
        """Record the cycles the learning-rate schedule spans: --num_cycles of the run's first start. A later start
        may run fewer; more only where the rate does not depend on the schedule's length (the plan then grows)."""
        planned, wanted = self.state.planned_cycles, self.args.num_cycles
        if planned is not None and wanted <= planned:
            return
        training = self.options.training
        if planned is not None and schedule_depends_on_length(training):
            raise ValueError(
                f"--num_cycles {wanted} is more than the {planned} cycles this run's learning-rate schedule "
                f"({training.lr_scheduler_type.value}) spans: it was planned over "
                f"{planned * self.steps_per_cycle} steps when the run started, and its cycles so far trained under "
                f"it. Run at most {planned} cycles in {self.out}, or start a run of {wanted} cycles in another "
                "--output_dir (a run meant to grow needs a schedule whose rate does not depend on its length: "
                "--lr_scheduler_type constant_with_warmup with --warmup_steps in steps).")
        self.state.plan_cycles(wanted)

    def _run_cycle(self, cycle: int) -> None:
        state = self.state
        if "cache_teacher" in self.stages_per_cycle() and not state.is_done(cycle, "cache_teacher"):
            self.check_cache_space(cycle)
        if not state.is_done(cycle, "prepare"):
            self._stage(cycle, "-", "prepare", self.prepare_cycle, cycle)
        if "cache_teacher" in self.stages_per_cycle() and not state.is_done(cycle, "cache_teacher"):
            self._stage(cycle, "-", "cache_teacher", self.cache_teacher, cycle)
        for model in self.models:
            if not state.is_done(cycle, f"train_{model}"):
                self._stage(cycle, model, f"train_{model}", self.train, model, cycle, every_process=True)
        if not state.is_done(cycle, "evaluate"):
            self._stage(cycle, "all", "evaluate", self.evaluate, cycle)
            if self.pushes is not None:
                self.submit_pushes(cycle)  # uploads while the next cycle trains
        if not state.is_done(cycle, "cleanup"):
            self._stage(cycle, "-", "cleanup", self.cleanup, cycle)
