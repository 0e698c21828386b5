"""Memory and step-time probes of the real training step, the data the memory planner is calibrated from.

    python3 -m benchmarks.memory_probe --presets recurrent-125m recurrent-1b recurrent-3.3b recurrent-7b \
        transformer-125m --output probes.jsonl --max_seconds 450
    python3 -m benchmarks.memory_probe --presets debug --device cpu --output probes.jsonl    # dry run of the loop
    python3 -m benchmarks.memory_probe --fit probes.jsonl [--calibration memory_calibration.json]
    python3 -m benchmarks.memory_probe --verify --presets recurrent-3.3b recurrent-7b --cap_gib 24 \
        --output verify.jsonl --max_seconds 200
    python3 -m benchmarks.memory_probe --presets recurrent-3.3b recurrent-7b --offload_probes --output offload.jsonl

Each probe trains a few steps of `RecurrentTrainer` (the low-memory optimizer in backward, the chunked loss, the
depth loop; random tokens, the depth fixed at `mean_recurrence`) at one point of a grid: batch size, sequence length,
which layers and core steps recompute their activations (`trainer_ext.memory.recompute`), momentum on or off,
`torch.compile` on or off, a cached teacher's top-k in the batch or not. A plain Transformer preset
(`transformer-125m`) is probed with every layer recomputed or none, what its checkpointing flag can do. It records
the peak reserved and allocated memory (peak counters reset and the cache emptied between probes) and the time of
every step; a probe that runs out of memory is recorded as such. One child process per preset runs its probes in
order, each preset within its share of `--max_seconds`; probes left when time runs out are recorded as skipped.
Records are appended to --output as JSON lines as they finish. Without a cap the whole device is usable: a peak
above the planned card's memory is still a data point. `--fit` turns a probe file into the calibration the planner
reads (`hf-recurrent-plan-memory`).

`--verify` checks plans instead: for each preset it computes the plan for --cap_gib and --seq_len from the
calibration (--calibration, default the package's), trains a few steps with it the way a probe does, under the cap
(the process may use no more than --cap_gib), and prints one JSON line per preset with the predicted and measured
peak reserved memory and tokens/s (an OOM is caught and reported). With --device cpu it is a dry run of the same
path (no memory figures). With --only_distill_probes the plans carry a cached teacher's top-k at each of
--vocab_sizes; --seq_lens plans several lengths; --breakdown adds the steady steps' GPU time by kernel kind
(`benchmarks/kernel_breakdown.py`), --snapshot what is live at the last step's peak (`benchmarks/peak_memory.py`).
`peak_error` is predicted / measured - 1: negative where the plan under-predicts.

    python3 -m benchmarks.memory_probe --verify --presets recurrent-3.3b recurrent-7b --cap_gib 24 \
        --only_distill_probes --vocab_sizes 65536 99520 151936 --seq_lens 2048 4096 --breakdown --output v.jsonl
"""

import argparse
import dataclasses
import gc
import json
import os
import platform
import subprocess
import sys
import tempfile
import time

from trainer_ext.memory.estimator import DEFAULT_FIT_OBJECTIVE, FIT_OBJECTIVES
from trainer_ext.memory.probes import HEAD_GRAD_IN_WEIGHT_DTYPE

# Batch unit per preset: the grid's batch sizes are multiples of it (small models need more tokens to load the GPU).
BATCH_UNIT = {"debug": 1, "recurrent-125m": 4, "recurrent-1b": 2, "recurrent-3.3b": 1, "recurrent-7b": 1,
              "transformer-125m": 4}
# Share of --max_seconds per preset; presets not listed share the rest equally.
TIME_SHARE = {"recurrent-125m": 0.1, "recurrent-1b": 0.15, "recurrent-3.3b": 0.4, "recurrent-7b": 0.35,
              "transformer-125m": 0.1}
TOPK = 64  # a teacher cache's default top-k


def selective_grid(preset: str, seq_len: int, compiled_variants: tuple[bool, ...]) -> list[dict]:
    """Probes of selective recomputation (every layer application, the matrix products' outputs kept), each beside the
    same batch fully recomputed in the same process: the pairs the fit prices the placement from
    (`trainer_ext.memory.estimator.fit_selective`; the peak fit leaves the selective ones out)."""
    u = BATCH_UNIT.get(preset, 1)
    return [{"preset": preset, "seq_len": seq_len, "batch_size": batch * u, "recompute": "all", "compile": compiled,
             "momentum": None, "distill": False, "selective": selective}
            for compiled in compiled_variants for batch in (1, 2, 4) for selective in (True, False)]


def offload_grid(preset: str, seq_len: int, compiled_variants: tuple[bool, ...]) -> list[dict]:
    """Probes of activation offload (`--memory_placements all`'s placement, forced): the unique layers offloaded and
    the core steps recomputed, then every graph-building application offloaded, at batches 1, 2, 4 (units), each
    batch beside every application recomputed (`recompute_reference`: the step the offloaded ones are set against on
    the device they run on, whatever device the calibration's step times come from). Each record carries the placement
    program's prediction of its peak and step time (`predicted_*`): what the overlap of the copies with compute has to
    meet (the fit leaves the offload records out)."""
    from hf_recurrent import presets
    from trainer_ext.memory.recompute import Applications, RecomputeSet

    config = presets.get(preset)
    prelude, coda = tuple(range(config.n_prelude_layers)), tuple(range(config.n_coda_layers))
    steps = tuple(range(config.backprop_depth or config.mean_recurrence))
    placements = {"recompute_reference": RecomputeSet(prelude, steps, coda),
                  "offload_unique": RecomputeSet(core_steps=steps, offload=Applications(prelude, (), coda)),
                  "offload_all": RecomputeSet(offload=Applications(prelude, steps, coda))}
    u = BATCH_UNIT.get(preset, 1)
    return [{"preset": preset, "seq_len": seq_len, "batch_size": batch * u, "recompute": name,
             "recompute_set": placement.to_dict(), "compile": compiled, "momentum": None, "distill": False,
             "predict": True}
            for compiled in compiled_variants for name, placement in placements.items() for batch in (1, 2, 4)]


def predicted_figures(record: dict) -> dict:
    """The placement program's peak (GiB) and step seconds for a probe's placement (with the H200 calibration's
    host-device bandwidth for offload), to set beside the measured ones."""
    from hf_recurrent import presets
    from trainer_ext.memory.estimator import GIB, load_calibration
    from trainer_ext.memory.placement import Program
    from trainer_ext.memory.plan import training_shape
    from trainer_ext.memory.recompute import RecomputeSet

    config = presets.get(record["preset"], record["config"]["vocab_size"])
    shape = training_shape(config, record["momentum"] or 0.0, record["momentum_rank_fraction"])
    program = Program(shape, load_calibration(), record["batch_size"], record["seq_len"], record["compile"],
                      record.get("distill_topk", 0), choices="all")
    peak, seconds, host = program.evaluate(RecomputeSet.from_dict(record["recompute_set"]))
    return {"predicted_peak_gib": round(peak / GIB, 3), "predicted_step_seconds": round(seconds, 4),
            "predicted_host_gib": round(host / GIB, 6)}


def distill_grid(preset: str, seq_len: int, vocab_sizes: list[int], compile_probes: bool) -> list[dict]:
    """Probes of a cached teacher's top-k at the vocabularies of real teachers (llm-jp's 99,520, Qwen's 151,936): the
    training's compiled step at `seq_len` and twice it, and an eager one, per vocabulary."""
    u = BATCH_UNIT.get(preset, 1)
    specs = []
    for vocab in vocab_sizes:
        shapes = [(2, seq_len, False), (1, seq_len * 2, False)]
        if compile_probes:
            shapes = [(2, seq_len, True), (1, seq_len * 2, True), (2, seq_len, False)]
        specs += [{"preset": preset, "seq_len": seq, "batch_size": batch * u, "recompute": "all", "compile": compiled,
                   "momentum": None, "distill": True, "vocab_size": vocab} for batch, seq, compiled in shapes]
    return specs


def default_grid(preset: str, seq_len: int, compile_probes: bool, distill_probes: bool,
                 only_compiled: bool = False) -> list[dict]:
    """Probe specs of one preset, most informative first (the time box cuts from the end). A plain Transformer's
    probes recompute every layer or none (what its checkpointing flag can do). `only_compiled`: the compiled ones
    alone (to add them to eager probes measured before)."""
    from hf_recurrent import presets

    u = BATCH_UNIT.get(preset, 1)
    specs, recurrent = [], presets.is_recurrent(presets.get(preset))

    def add(recompute, batch, seq=seq_len, compile=False, momentum=None, distill=False):
        if recurrent or recompute in ("all", "none"):
            specs.append({"preset": preset, "seq_len": seq, "batch_size": batch * u, "recompute": recompute,
                          "compile": compile, "momentum": momentum, "distill": distill})

    for batch in (1, 2, 4, 8):
        add("all", batch)
    for batch in (1, 2):
        add("none", batch)
    add("prelude_coda", 1)
    add("prelude_coda", 2)
    add("half_core", 2)
    add("core", 1)
    add("all", 2, momentum="off")
    add("all", 1, seq=seq_len * 2)
    add("none", 1, seq=seq_len * 2)
    add("all", 4, seq=seq_len // 2)
    if distill_probes:
        add("all", 2, distill=True)
    if compile_probes:  # last: the first compiled step of each layer shape takes a minute
        for batch in (1, 2, 4):
            add("all", batch, compile=True)
        add("none", 1, compile=True)
        add("prelude_coda", 2, compile=True)
        add("half_core", 2, compile=True)
        add("all", 8, compile=True)
        add("none", 2, compile=True)
        add("core", 1, compile=True)
        if distill_probes:
            add("all", 2, compile=True, distill=True)
    return [spec for spec in specs if spec["compile"]] if only_compiled else specs


# -- child: one preset's probes in one process


class _RandomTokens:
    """Random token rows (and a random teacher top-k), the items prepared shards give the trainer."""

    def __init__(self, vocab_size: int, seq_len: int, length: int, topk: int = 0):
        import torch

        self.vocab_size, self.seq_len, self.length, self.topk = vocab_size, seq_len, length, topk
        self.generator = torch.Generator().manual_seed(0)

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        import torch

        row = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=self.generator)
        item = {"input_ids": row[:-1], "shift_labels": row[1:]}
        if self.topk:  # distinct ids per position, as a teacher's top-k
            first = torch.randint(0, self.vocab_size, (self.seq_len, 1), generator=self.generator)
            item["teacher_topk_ids"] = (first + torch.arange(self.topk)) % self.vocab_size
            logits = torch.randn(self.seq_len, self.topk, generator=self.generator)
            item["teacher_topk_logprobs"] = torch.log_softmax(logits, dim=-1) - 0.5
        return item


def _build(preset: str, device: str, vocab_size: int | None = None):
    import torch

    from hf_recurrent import presets
    from trainer_ext.training.arguments import ModelArguments
    from trainer_ext.run.model_setup import build_model

    config = presets.get(preset, vocab_size)
    if presets.is_recurrent(config):
        config = presets.get(preset, vocab_size, depth_distribution="fixed")
    return build_model(ModelArguments(preset=preset), torch.device(device), config)


def _reset_model(model) -> None:
    """Back to the state a fresh model starts training in: no checkpointing, not compiled, no gradients."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    for module in model.modules():
        if isinstance(module, GradientCheckpointingLayer) or hasattr(module, "gradient_checkpointing"):
            module.gradient_checkpointing = False
        if type(module).__name__.endswith("DecoderLayer"):
            module._compiled_call_impl = None
    if hasattr(model.model, "recompute_core_steps"):  # a recurrent-depth model
        model.model.recompute_core_steps = None
    model.zero_grad(set_to_none=True)


def _free(device: str) -> None:
    import torch

    gc.collect()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def run_probe(model, spec: dict, steps: int, device: str, output_dir: str) -> dict:
    """Train `steps` steps of the spec on `model`; the measured record (without the spec)."""
    import torch
    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    from hf_recurrent.cost import graph_steps, parameter_counts
    from hf_recurrent.presets import is_recurrent
    from trainer_ext.compat import CHECKPOINTING_FLAG
    from trainer_ext.optim.momentum import resolve_momentum
    from trainer_ext.memory.estimator import ModelShape
    from trainer_ext.optim.state import low_memory_state, optimizer_state_bytes
    from trainer_ext.memory.recompute import RecomputeCallback, RecomputeSet
    from trainer_ext.training.trainer import RecurrentTrainer

    config = model.config
    cuda = device == "cuda"
    params = parameter_counts(config).unique
    momentum, rank_fraction = resolve_momentum(0.0 if spec["momentum"] == "off" else None, None, params)
    state = low_memory_state(momentum, rank_fraction)
    recurrent = is_recurrent(config)
    steps_with_graphs = graph_steps(config) if recurrent else 0
    recompute = (RecomputeSet.from_dict(spec["recompute_set"]) if spec.get("recompute_set") is not None
                 else RecomputeSet.named(spec["recompute"], ModelShape.from_config(config, 0, params),
                                         steps_with_graphs))
    if spec.get("selective"):
        recompute = dataclasses.replace(recompute, selective=True)
    times = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            if not times:
                if cuda:
                    torch.cuda.synchronize()
                times.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kwargs):
            if cuda:
                torch.cuda.synchronize()
            times.append(time.perf_counter())

    args_kwargs = dict(
        output_dir=output_dir, per_device_train_batch_size=spec["batch_size"], max_steps=steps, learning_rate=1e-5,
        warmup_steps=0, lr_scheduler_type="constant", bf16=cuda, logging_steps=steps, save_strategy="no",
        eval_strategy="no", report_to="none", optimizer_momentum=momentum or 0.0,
        optimizer_momentum_rank_fraction=rank_fraction or 1.0, torch_compile=spec["compile"],
        profile_steps=0, collapse_check_steps=0, dataloader_num_workers=0, dataloader_pin_memory=False,
        disable_tqdm=True, seed=0, use_cpu=not cuda, **{CHECKPOINTING_FLAG: not recompute.empty},
        # The CPU dry run checks the compiled path's bookkeeping without a C++ toolchain.
        **({} if cuda else {"torch_compile_backend": "eager"}))
    from trainer_ext.distill.losses import chunk_logit_bytes, default_chunk_size
    from trainer_ext.training.arguments import RecurrentTrainingArguments

    args = RecurrentTrainingArguments(**args_kwargs)
    data = _RandomTokens(config.vocab_size, spec["seq_len"], steps * spec["batch_size"], TOPK if spec["distill"] else 0)
    record = {"momentum": momentum or 0.0, "momentum_rank_fraction": rank_fraction,
              "optimizer_state_bytes": optimizer_state_bytes(model, state), "recompute_set": recompute.to_dict(),
              "graph_steps": steps_with_graphs,
              "num_steps": config.mean_recurrence if recurrent else 0, "params": params,
              "loss_chunk_size": args.loss_chunk_size or default_chunk_size(
                  config.vocab_size, chunk_logit_bytes(model.dtype, torch.device(device), online_teacher=False)),
              "distill_topk": TOPK if spec["distill"] else 0, "config": config_fields(config),
              "outer_norms": "compiled" if spec["compile"] else "eager",  # calibrate.as_measured_now reads it
              "head_grad": HEAD_GRAD_IN_WEIGHT_DTYPE}
    _reset_model(model)
    _free(device)
    if cuda:
        record["baseline_reserved_bytes"] = torch.cuda.memory_reserved()
        record["baseline_allocated_bytes"] = torch.cuda.memory_allocated()
    trainer = None
    started = time.perf_counter()
    try:
        # A Transformer's checkpointing flag recomputes every layer or none: no per-layer set to apply.
        callbacks = [RecomputeCallback(recompute)] if recurrent else []
        if spec.get("profile"):  # the steps after the warm-up (compilation included)
            from benchmarks.kernel_breakdown import KernelProfile

            callbacks.append(KernelProfile(start_step=2 if spec["compile"] else 1))
        if spec.get("snapshot"):  # the last step (a steady one)
            from benchmarks.peak_memory import PeakSnapshot

            callbacks.insert(0, PeakSnapshot(step=steps - 1, context="all" if spec["snapshot"] == "frames" else None))
        trainer = RecurrentTrainer(model=model, args=args, train_dataset=data, callbacks=callbacks + [Timer()])
        trainer.remove_callback(PrinterCallback)  # the probe prints one line per probe
        trainer.train()
        record["status"] = "ok"
        if spec.get("profile"):
            record["kernel_breakdown"] = callbacks[-1].result
        if spec.get("snapshot"):
            record["peak_composition"] = callbacks[0].result
    except torch.OutOfMemoryError as error:
        record["status"], record["error"] = "oom", str(error).splitlines()[0][:300]
    except Exception as error:  # recorded, the next probe still runs
        record["status"], record["error"] = "error", f"{type(error).__name__}: {str(error)[:300]}"
    record["seconds"] = round(time.perf_counter() - started, 3)
    record["step_seconds"] = [round(b - a, 5) for a, b in zip(times, times[1:])]
    if cuda:
        record["peak_reserved_bytes"] = torch.cuda.max_memory_reserved()
        record["peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
        record["alloc_retries"] = torch.cuda.memory_stats().get("num_alloc_retries", 0)
    if trainer is not None:
        optimizer = trainer.unwrapped_optimizer
        if hasattr(optimizer, "detach_from_backward"):
            optimizer.detach_from_backward()  # the next probe's optimizer hooks the same parameters
    del trainer
    _reset_model(model)
    _free(device)
    return record


def config_fields(config) -> dict:
    """The config fields the estimator reads back (`ModelShape.from_record`)."""
    from hf_recurrent.presets import is_recurrent

    names = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
             "vocab_size")
    names += (("n_prelude_layers", "n_core_layers", "n_coda_layers", "mean_recurrence", "backprop_depth",
               "injection", "block_norm") if is_recurrent(config) else ("num_hidden_layers",))
    return {name: getattr(config, name, None) for name in names}


def child(specs_path: str, output: str, deadline: float, steps: int, compile_steps: int, device: str,
          cap_gib: float | None) -> None:
    import torch

    if device == "cuda" and cap_gib:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(cap_gib * 2**30 / total, 1.0))
    # Probes change batch size and checkpointing of the same layers: keep every compiled variant.
    import torch._dynamo.config as dynamo_config

    for name, value in (("recompile_limit", 64), ("cache_size_limit", 64), ("accumulated_recompile_limit", 1024),
                        ("accumulated_cache_size_limit", 1024)):
        if hasattr(dynamo_config, name):
            setattr(dynamo_config, name, value)
    with open(specs_path) as f:
        specs = json.load(f)
    machine = _machine(device, cap_gib)
    model = None
    with tempfile.TemporaryDirectory() as output_dir:
        for spec in specs:
            if time.time() > deadline:
                record = {"status": "skipped", "error": "--max_seconds reached"}
            else:
                vocab = spec.get("vocab_size")
                if model is not None and vocab and model.config.vocab_size != vocab:
                    model = None  # another head: the next probes' model
                    _free(device)
                if model is None:
                    started = time.perf_counter()
                    model = _build(spec["preset"], device, vocab)
                    machine["model_build_seconds"] = round(time.perf_counter() - started, 2)
                run_steps = compile_steps if spec["compile"] else steps
                record = run_probe(model, spec, run_steps, device, output_dir)
                if spec.get("predict") and record["status"] == "ok":
                    record.update(predicted_figures({**spec, **record}))
            _append(output, {**spec, **record, **machine})
            print(json.dumps({k: v for k, v in {**spec, **record}.items() if k not in ("config", "recompute_set")}),
                  flush=True)


def _machine(device: str, cap_gib: float | None) -> dict:
    import torch
    import transformers

    from trainer_ext.devices import allocator_settings

    info = {"device": device, "torch": torch.__version__, "transformers": transformers.__version__,
            "cap_gib": cap_gib, "host": platform.node(), "allocator": allocator_settings()}
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(device_name=props.name, device_total_bytes=props.total_memory)
    return info


def _append(path: str, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


# -- parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--presets", nargs="+", default=["recurrent-125m", "recurrent-1b", "recurrent-3.3b",
                                                         "recurrent-7b", "transformer-125m"],
                        help="The presets to probe; plain Transformers (transformer-*) are fitted apart, so plans "
                             "of a Transformer baseline need one of them here.")
    parser.add_argument("--output", default="probes.jsonl", help="JSON lines, appended to.")
    parser.add_argument("--seq_len", type=int, default=2048)
    parser.add_argument("--max_seconds", type=float, default=450.0, help="Time box of all probes.")
    parser.add_argument("--steps", type=int, default=4, help="Steps per eager probe (the first is warm-up).")
    parser.add_argument("--compile_steps", type=int, default=5, help="Steps per compiled probe (two warm-up).")
    parser.add_argument("--no_compile_probes", action="store_true")
    parser.add_argument("--no_distill_probes", action="store_true")
    parser.add_argument("--only_compile_probes", action="store_true",
                        help="Only the compiled probes (to add to eager probes measured before).")
    parser.add_argument("--offload_probes", action="store_true",
                        help="Only probes of activation offload, each with the placement program's prediction.")
    parser.add_argument("--selective_probes", action="store_true",
                        help="Only probes of selective recomputation (offload.selective_checkpoint).")
    parser.add_argument("--only_distill_probes", action="store_true",
                        help="Only probes with a cached teacher's top-k, at each of --vocab_sizes.")
    parser.add_argument("--vocab_sizes", type=int, nargs="+", default=[99520, 151936],
                        help="With --only_distill_probes: the vocabularies probed (with --verify: planned).")
    parser.add_argument("--cap_gib", type=float, default=None, help="Emulated card size (default: the device).")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: a dry run of the probe loop (no memory figures), e.g. with --presets debug.")
    parser.add_argument("--fit", metavar="PROBES", default=None, help="Fit a calibration from this probe file.")
    parser.add_argument("--calibration", default=None, help="With --fit: where to write it (default: the "
                                                            "package's trainer_ext/memory/calibration.json).")
    parser.add_argument("--fit_objective", choices=FIT_OBJECTIVES, default=DEFAULT_FIT_OBJECTIVE,
                        help="With --fit: what the peak's upper bound minimises (trainer_ext.memory.estimator).")
    parser.add_argument("--probe_command", default=None, help="With --fit: the command that measured the probes "
                                                              "(recorded in the calibration).")
    parser.add_argument("--verify", action="store_true", help="Train with each preset's plan for --cap_gib and "
                                                              "print predicted against measured figures.")
    parser.add_argument("--max_batch_size", type=int, default=64, help="With --verify: the plan's largest batch.")
    parser.add_argument("--seq_lens", type=int, nargs="+", default=None,
                        help="With --verify: the sequence lengths planned (default: --seq_len).")
    parser.add_argument("--breakdown", action="store_true",
                        help="With --verify: the GPU time of the steady steps by kernel kind and idle "
                             "(benchmarks/kernel_breakdown.py).")
    parser.add_argument("--snapshot", nargs="?", const="sizes", choices=("sizes", "frames"),
                        help="With --verify: the blocks live at the peak of the last step, by size (no stack traces) "
                             "or by where they were allocated (frames: failed on compiled steps under torch 2.11) "
                             "(benchmarks/peak_memory.py; not with --breakdown: it slows that step).")
    parser.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.only_compile_probes and args.no_compile_probes:
        parser.error("--only_compile_probes and --no_compile_probes leave no probe; give one of them.")
    if args.snapshot and args.breakdown:
        parser.error("--snapshot slows the step it records, one of those --breakdown times; give one of them.")
    if args.child:
        specs_path, output, deadline, steps, compile_steps, device, cap = args.child
        child(specs_path, output, float(deadline), int(steps), int(compile_steps), device,
              float(cap) if cap != "none" else None)
        return 0
    if args.fit:
        from trainer_ext.memory.calibrate import write_calibration_from_probes

        command = " ".join(["python3 -m benchmarks.memory_probe", *(sys.argv[1:] if argv is None else argv)])
        path = write_calibration_from_probes(args.fit, args.calibration, command=command,
                                             probe_command=args.probe_command, objective=args.fit_objective)
        print(f"Wrote {path}")
        return 0
    if args.verify:
        return _verify(args)
    return _run_all(args)


def _verify(args) -> int:
    """Plan each preset (at each of --seq_lens, and with --only_distill_probes a cached top-k at each of
    --vocab_sizes) for --cap_gib, train with the plan, print predicted against measured figures (JSON lines)."""
    from trainer_ext.memory.estimator import ModelShape, time_features
    from trainer_ext.memory.probes import probe_recomputed
    from trainer_ext.memory.plan import NoPlanError, plan_for_preset

    if not args.cap_gib:
        raise SystemExit("--verify needs --cap_gib: the memory the plans are made for and the probes may use.")
    vocabs = args.vocab_sizes if args.only_distill_probes else [None]
    topk = TOPK if args.only_distill_probes else 0
    plans, specs = [], {}
    for preset in args.presets:
        for vocab in vocabs:
            for seq_len in args.seq_lens or [args.seq_len]:
                try:
                    plan = plan_for_preset(preset, seq_len, args.cap_gib, args.calibration, distill_topk=topk,
                                           max_batch_size=args.max_batch_size, vocab_size=vocab)
                except NoPlanError as error:  # a shape no batch fits: said, and the other shapes still verified
                    print(json.dumps({"preset": preset, "vocab_size": vocab, "seq_len": seq_len, "distill_topk": topk,
                                      "status": "no plan", "error": str(error), "cap_gib": args.cap_gib}), flush=True)
                    continue
                plans.append(plan)
                specs.setdefault(preset, []).append({
                    "preset": preset, "seq_len": seq_len, "batch_size": plan.per_device_train_batch_size,
                    "recompute": "plan", "recompute_set": plan.recompute.to_dict(), "compile": plan.torch_compile,
                    "momentum": None, "distill": bool(topk), "profile": args.breakdown, "snapshot": args.snapshot,
                    **({"vocab_size": vocab} if vocab else {})})
    done_before = _count_lines(args.output)
    code = _run_all(args, specs)
    with open(args.output) as f:
        records = [json.loads(line) for line in f if line.strip()][done_before:]
    for plan, record in zip(plans, records):  # both in the order of the presets' specs
        measured_peak = record.get("peak_reserved_bytes") if record["status"] == "ok" else None  # else: the baseline
        steps = record.get("step_seconds", [])[2 if record.get("compile") else 1:]
        steady = sorted(steps)[len(steps) // 2] if steps else None
        row = {
            "preset": record["preset"], "vocab_size": record.get("vocab_size"), "seq_len": record["seq_len"],
            "distill_topk": topk, "status": record["status"], "error": record.get("error"), "cap_gib": args.cap_gib,
            "per_device_train_batch_size": plan.per_device_train_batch_size,
            "recompute": plan.recompute_description, "torch_compile": plan.torch_compile,
            "predicted_peak_gib": round(plan.predicted_peak_gib, 3),
            "measured_peak_gib": round(measured_peak / 2**30, 3) if measured_peak else None,
            "peak_error": round(plan.predicted_peak_gib / (measured_peak / 2**30) - 1, 4) if measured_peak else None,
            "within_cap_minus_margin": (measured_peak / 2**30 <= args.cap_gib - plan.margin_gib)
            if measured_peak else None,
            "predicted_tokens_per_second": round(plan.predicted_tokens_per_second, 1),
            "measured_tokens_per_second": round(plan.per_device_train_batch_size * record["seq_len"] / steady, 1)
            if steady else None}
        if record.get("config"):  # executed FLOPs (the recomputed forwards too) over the model's
            shape = ModelShape.from_record(record)
            features = time_features(shape, record["batch_size"], record["seq_len"], probe_recomputed(record))
            row["flops_ratio"] = round(1 + features[2] / features[1], 4)
        for key in ("kernel_breakdown", "peak_composition"):
            if record.get(key):
                row[key] = record[key]
        print(json.dumps(row), flush=True)
    return code


def _run_all(args, specs_by_preset: dict | None = None) -> int:
    start = time.time()
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    compile_probes = not args.no_compile_probes
    variants = (True,) if args.only_compile_probes else (True, False) if compile_probes else (False,)
    known = sum(TIME_SHARE.get(p, 0) for p in args.presets)
    unknown = [p for p in args.presets if p not in TIME_SHARE]
    share = {p: TIME_SHARE.get(p, (1 - min(known, 1)) / len(unknown) if unknown else 0) for p in args.presets}
    total_share, spent_share, failures = sum(share.values()) or 1.0, 0.0, 0
    for preset in args.presets:
        if specs_by_preset is not None:
            specs = specs_by_preset[preset]
        elif args.offload_probes:
            specs = offload_grid(preset, args.seq_len, variants)
        elif args.selective_probes:
            specs = selective_grid(preset, args.seq_len, variants)
        elif args.only_distill_probes:
            specs = distill_grid(preset, args.seq_len, args.vocab_sizes, compile_probes)
        else:
            specs = default_grid(preset, args.seq_len, compile_probes, not args.no_distill_probes,
                                 args.only_compile_probes)
        spent_share += share[preset]
        deadline = start + args.max_seconds * spent_share / total_share  # time left over carries to later presets
        with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
            json.dump(specs, f)
        cmd = [sys.executable, "-m", "benchmarks.memory_probe", "--child", f.name, args.output, str(deadline),
               str(args.steps), str(args.compile_steps), args.device, str(args.cap_gib or "none")]
        done_before = _count_lines(args.output)
        try:  # a probe started just before the deadline may finish after it; a hung one is stopped
            code = subprocess.run(cmd, timeout=max(deadline - time.time(), 0) + 180).returncode
        except subprocess.TimeoutExpired:
            code = "timeout"
        os.unlink(f.name)
        recorded = _count_lines(args.output) - done_before
        if code != 0:
            failures += 1
            for spec in specs[recorded:]:
                _append(args.output, {**spec, "status": "error", "error": f"probe process ended: {code}"})
    print(f"probes of {len(args.presets)} preset(s) in {time.time() - start:.0f} s -> {args.output}")
    return 1 if failures else 0


def _count_lines(path: str) -> int:
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for line in f if line.strip())


if __name__ == "__main__":
    sys.exit(main())
