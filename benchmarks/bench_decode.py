"""Greedy decoding speed: our eager (dynamic cache) and static-cache + compiled decode paths against a Llama with the
same unrolled layer count, compiled the same way.

    python3 -m benchmarks.bench_decode --output $OUT/decode.json                       # recurrent-3.3b, GPU
    python3 -m benchmarks.bench_decode --preset debug --device cpu --depths 2 --prompt_len 8 --new_tokens 8 \
        --compile_backend eager --output /tmp/decode.json                              # a CPU check that it runs
    python3 -m benchmarks.bench_decode --preset debug --device cpu --paths eager --threads 1 --clock process \
        --rounds 5 --repeats 3 --prompt_len 32 --new_tokens 64                         # the CPU eager comparison

Random init (speed does not depend on the weights; exits do: `--checkpoint` times a trained model, Llama's peer of its
widths, with prompts from the held-out split of `--data_dir`, random ids without it), `--dtype` (bf16 on CUDA), SDPA
attention. For each depth n and batch size: tokens/s of `generate` with the dynamic cache (eager), with
`cache_implementation="static"` and a compiled decode step (`CompileConfig(fullgraph=True, dynamic=False)`, inductor +
CUDA graphs by default), and the same two for `LlamaForCausalLM` with prelude + n x core + coda layers of the same
width, heads, MLP and vocabulary.
`--exit_thresholds` adds runs with adaptive depth (at most n steps) on each path in each of `--exit_kv_cache_modes`
(default `shared`, the mode where exited rows skip the core steps before the last), each next to the fixed-depth
figure of the same path and cache mode; eager ones with the mean core steps used and core passes run per decoded
token (`--exit_compaction rows masked`: both ways of running a step while some rows iterate). Compiled exit rows
come once per `--exit_check_every` value k (default 0 and 4, labelled `k=`): 0 masks the exits in one graph (the
forward's default), k > 0 runs the steps in segments of k with a host check between them in shared mode (a compiled
`generate`'s default is 4; hf_recurrent.adaptive_depth; graph breaks, so those rows compile with fullgraph=False).
Each figure: the median of `--repeats` timed calls after `--warmup` untimed ones (which compile), with the spread
(max - min) / median, and the first call's tokens/s (what a first `generate` of the row's shapes pays: compilation,
and on Hopper cuDNN attention's graph per new key length, unless an earlier row built it); `--sdpa no_cudnn` runs the
whole benchmark with flash / memory-efficient / math attention only, against torch's choice (the default);
`--rounds R` runs the whole list R times in turn, each figure then the median of its R x repeats calls, spread over
the run. `--paths eager` leaves out the compiled path (on a CPU, where the eager comparison at
small width measures per-step Python and dispatch overhead); `--threads` sets torch's intra-op threads; `--clock
process` times by the process's CPU time. Both steady a CPU comparison on cores shared with other work. Measurements
run most important first (every eager row, then every compiled one, each by depth, then batch size, in the order
given, ours then Llama's; then the exit rows); past `--time_budget_s` the rest are listed as skipped, so a run stays
short on any machine.
"""

import argparse
import json
import os
import statistics
import time
from contextlib import nullcontext

import torch
import transformers
from torch.nn.attention import sdpa_kernel
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

from hf_recurrent import RecurrentDepthForCausalLM, adaptive_depth, presets
from hf_recurrent.configuration_recurrent_depth import KV_CACHE_MODES
from hf_recurrent.cost import unrolled_layers
from trainer_ext.data.shards import ShardedTokenDataset
from trainer_ext.devices import synchronize

PATHS = ("eager", "static+compile")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="recurrent-3.3b", help="A recurrent preset of hf_recurrent.presets.")
    parser.add_argument("--checkpoint", default=None, help="A trained recurrent checkpoint in place of --preset's "
                        "random init (exits depend on the weights).")
    parser.add_argument("--data_dir", default=None, help="Prepared data whose held-out samples give the prompts "
                        "(default: random ids).")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--dtype", default=None, help="bfloat16 or float32 (default: bf16 on CUDA, fp32 on CPU).")
    parser.add_argument("--depths", type=int, nargs="+", default=[12, 4])
    parser.add_argument("--batch_sizes", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3, help="Timed calls per figure (the median counts).")
    parser.add_argument("--warmup", type=int, default=2, help="Untimed calls first (compilation, CUDA graphs).")
    parser.add_argument("--paths", nargs="+", choices=PATHS, default=list(PATHS),
                        help="Decoding paths timed for both models (eager: dynamic cache; static+compile).")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's).")
    parser.add_argument("--rounds", type=int, default=1,
                        help="Run every measurement this many times in turn, each figure the median of all its calls.")
    parser.add_argument("--clock", choices=["wall", "process"], default="wall",
                        help="process: the process's CPU time, for a CPU run on a machine shared with other work.")
    parser.add_argument("--compile_backend", default="inductor")
    parser.add_argument("--compile_mode", default="reduce-overhead", help="'none' for the backend's default.")
    parser.add_argument("--exit_thresholds", type=float, nargs="*", default=[],
                        help="Adaptive depth thresholds (state criterion) timed on each path of --paths.")
    parser.add_argument("--exit_check_every", type=int, nargs="+", default=[0, 4],
                        help="Compiled exit rows, one set per value: core steps per segment between host checks "
                             "(0: masked exits in one graph, the forward's default; a compiled generate's is 4).")
    parser.add_argument("--exit_kv_cache_modes", nargs="+", choices=KV_CACHE_MODES, default=["shared"],
                        help="kv_cache_mode(s) of the adaptive depth runs; a mode other than the preset's also gets "
                             "a fixed-depth eager run. Exits skip core steps in 'shared' only (per_step caches "
                             "need every step's keys and values).")
    parser.add_argument("--exit_compaction", nargs="+", choices=["rows", "masked"], default=["rows"],
                        help="Eager exit rows: 'rows' runs a step on the rows still iterating (the model's default), "
                             "'masked' on the whole batch until every row has exited (labelled masked): which is "
                             "faster where a step is bound by issuing its ops rather than by its arithmetic.")
    parser.add_argument("--no_llama", action="store_true", help="Skip the Llama peer.")
    parser.add_argument("--sdpa", choices=["torch", "no_cudnn"], default="torch",
                        help="SDPA kernels of the whole run: torch's choice (cuDNN's first on Hopper, which builds a "
                             "graph per new shape), or flash / memory-efficient / math only.")
    parser.add_argument("--time_budget_s", type=float, default=270.0,
                        help="Stop starting new measurements after this many seconds.")
    parser.add_argument("--output", default=None, help="Write the results as JSON here.")
    args = parser.parse_args(argv)
    if not presets.is_recurrent(presets.get(args.preset)):
        parser.error(f"--preset {args.preset!r} is a Transformer preset; give a recurrent one.")
    for name in ("checkpoint", "data_dir"):
        path = getattr(args, name)
        if path is not None and not os.path.isdir(path):
            parser.error(f"--{name} {path!r} is not a directory; give a {name.replace('_', ' ')} written by this "
                         "package.")
    if args.repeats < 3:
        parser.error("--repeats must be >= 3 (the median of at least three timed calls).")
    return args


def llama_peer(config, num_steps: int) -> LlamaConfig:
    """A Llama of the recurrent model's width, heads, MLP and vocabulary, with its unrolled layer count at depth n."""
    return LlamaConfig(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.intermediate_size,
        num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim, num_hidden_layers=unrolled_layers(config, num_steps),
        max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.rms_norm_eps,
        tie_word_embeddings=False, pad_token_id=0)


def build(model_class, config, device, dtype):
    with torch.device(device):
        model = model_class._from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def prompt_ids(args, batch: int, vocab_size: int) -> torch.Tensor:
    """(batch, prompt_len) prompt ids: the first tokens of the first held-out samples of --data_dir, else random."""
    if args.data_dir is None:
        generator = torch.Generator().manual_seed(batch)
        return torch.randint(3, vocab_size, (batch, args.prompt_len), generator=generator)
    heldout = ShardedTokenDataset(args.data_dir, split="eval")
    rows = [heldout[i]["input_ids"][:args.prompt_len] for i in range(min(batch, len(heldout)))]
    if len(rows) < batch or len(rows[0]) < args.prompt_len:
        raise ValueError(f"--data_dir {args.data_dir}: {batch} held-out samples of {args.prompt_len} tokens are "
                         "needed for the prompts; lower --batch_sizes or --prompt_len.")
    return torch.stack(rows)


def time_generate(model, prompt, args, **kwargs) -> tuple[list[float], float]:
    """Tokens/s of `repeats` timed greedy calls after `warmup` untimed ones, and of the first call (untimed unless
    --warmup is 0: what a first `generate` of these shapes pays for compilation and per-shape kernel plans)."""
    kwargs = dict(max_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0, **kwargs)
    rates, first = [], None
    for index in range(args.warmup + args.repeats):
        synchronize(args.device)
        clock = time.process_time if args.clock == "process" else time.perf_counter
        start = clock()
        out = model.generate(prompt, **kwargs)
        synchronize(args.device)
        elapsed = clock() - start
        new = out.shape[1] - prompt.shape[1]
        if new != args.new_tokens:
            raise RuntimeError(f"generate stopped after {new} of {args.new_tokens} tokens; no eos is expected here.")
        first = prompt.shape[0] * new / elapsed if first is None else first
        if index >= args.warmup:
            rates.append(prompt.shape[0] * new / elapsed)
    return rates, first


def compile_config(args) -> CompileConfig:
    config = CompileConfig(fullgraph=True, dynamic=False, backend=args.compile_backend,
                           mode=None if args.compile_mode == "none" else args.compile_mode)
    config._compile_all_devices = True  # transformers compiles on GPUs only unless told
    return config


class StepsRecorder:
    """Per decode step (one new token per row) of adaptive-depth calls: mean core steps used per token (the model's
    `num_steps_used`) and core passes run per token (tokens through the first core layer over the step's tokens;
    fewer than n once exited steps are skipped or run on the rows still iterating).
    """

    def __init__(self, model):
        self.steps = self.tokens = self.passes = self.call_passes = 0
        self.handles = [model.model.register_forward_hook(self.hook),
                        model.model.core[0].register_forward_pre_hook(self.count_pass)]

    def count_pass(self, module, inputs):
        self.call_passes += inputs[0].shape[0] * inputs[0].shape[1]

    def hook(self, module, inputs, output):
        used = getattr(output, "num_steps_used", None)
        if used is not None and used.shape[1] == 1:  # decode steps, not the prefill
            self.steps += used.sum().item()
            self.tokens += used.numel()
            self.passes += self.call_passes
        self.call_passes = 0

    def means(self) -> dict:
        for handle in self.handles:
            handle.remove()
        return {"mean_steps_used": self.steps / self.tokens if self.tokens else None,
                "mean_core_passes": self.passes / self.tokens if self.tokens else None}


def measurements(args, preset_mode: str):
    """(label, model kind, kv_cache_mode, depth, batch, generate kwargs) in the order they run."""
    paths = [("eager", {}), ("static+compile", {"cache_implementation": "static", "compile_config": compile_config(args)})]
    paths = [(path, kwargs) for path, kwargs in paths if path in args.paths]
    exit_modes = dict.fromkeys(args.exit_kv_cache_modes) if args.exit_thresholds else {}
    for path, kwargs in paths:  # every eager row first: the default path, and no compilation to wait for
        for num_steps in args.depths:
            for batch in args.batch_sizes:
                yield path, "recurrent", preset_mode, num_steps, batch, {"num_steps": num_steps, **kwargs}
                if not args.no_llama:
                    yield path, "llama", None, num_steps, batch, kwargs
    for num_steps in args.depths:
        for batch in args.batch_sizes:
            for mode in exit_modes:
                for path, kwargs in paths:
                    if mode != preset_mode:  # the fixed-depth figure the exits compare with
                        yield path, "recurrent", mode, num_steps, batch, {"num_steps": num_steps, **kwargs}
                    if path == "eager":  # each way of running a step while some rows iterate
                        variants = [({}, "" if how == "rows" else " masked") for how in args.exit_compaction]
                    else:
                        variants = [({"exit_check_every": k}, f" k={k}") for k in args.exit_check_every]
                    for exits, label in variants:
                        for threshold in args.exit_thresholds:
                            yield f"{path} exit<{threshold:g}{label}", "recurrent", mode, num_steps, batch, {
                                "num_steps": num_steps, "exit_threshold": threshold, **kwargs, **exits}


def run(args) -> dict:
    dtype = getattr(torch, args.dtype) if args.dtype else (torch.bfloat16 if args.device.startswith("cuda")
                                                           else torch.float32)
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # Every depth, batch size, cache mode and exit setting compiles the decode step anew: more than dynamo's default
    # 8 per function, past which it would run the rest uncompiled.
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    torch.manual_seed(0)
    if args.checkpoint:
        ours = RecurrentDepthForCausalLM.from_pretrained(args.checkpoint, dtype=dtype, attn_implementation="sdpa")
        ours = ours.to(args.device).eval()
    else:
        ours = build(RecurrentDepthForCausalLM, presets.get(args.preset), args.device, dtype)
    config = ours.config
    llama, llama_steps = None, None
    prompts = {b: prompt_ids(args, b, config.vocab_size).to(args.device) for b in args.batch_sizes}
    results, skipped, started = {}, {}, time.perf_counter()
    preset_mode = config.kv_cache_mode  # the model shares `config`, whose mode the exit runs change
    rounds = (item for _ in range(args.rounds) for item in measurements(args, preset_mode))
    for path, kind, mode, num_steps, batch, kwargs in rounds:
        key = (path, kind, mode, num_steps, batch)
        record = results.get(key) or {
            "model": kind, "path": path, "kv_cache_mode": mode, "num_steps": num_steps, "batch": batch,
            "layers": unrolled_layers(config, num_steps), "exit_threshold": kwargs.get("exit_threshold"),
            "exit_check_every": kwargs.get("exit_check_every"),
            "tokens_per_s_runs": []}
        if time.perf_counter() - started > args.time_budget_s:
            if key not in results:
                skipped[key] = record
            continue
        if kind == "llama" and llama_steps != num_steps:
            llama = None  # free the previous depth's peer first
            if args.device.startswith("cuda"):
                torch.cuda.empty_cache()
            llama, llama_steps = build(LlamaForCausalLM, llama_peer(config, num_steps), args.device, dtype), num_steps
        model = ours if kind == "recurrent" else llama
        if kind == "recurrent":
            ours.config.kv_cache_mode = mode  # read at every forward call; only exit runs change it
        # Hooks would run inside a compiled decode step: compiled exit rows report the tokens/s only.
        recorder = StepsRecorder(model) if "exit_threshold" in kwargs and path.startswith("eager") else None
        adaptive_depth.COMPACT_EXITED_STEPS = not path.endswith(" masked")
        rates, first = time_generate(model, prompts[batch], args, **kwargs)
        rates = record["tokens_per_s_runs"] = record["tokens_per_s_runs"] + rates
        median = statistics.median(rates)
        record.update(tokens_per_s=median, spread=(max(rates) - min(rates)) / median)
        record.setdefault("first_call_tokens_per_s", first)
        if recorder is not None:
            record.update(recorder.means())
        results[key] = record
        print(f"{kind:9s} {path:18s} {mode or '-':8s} n={num_steps:<3d} batch={batch:<3d} {median:10.1f} tokens/s "
              f"(spread {record['spread']:.1%})", flush=True)
    return {
        "preset": args.preset, "checkpoint": args.checkpoint,
        "device": torch.cuda.get_device_name() if args.device.startswith("cuda") else "cpu",
        "dtype": str(dtype).removeprefix("torch."), "torch": torch.__version__, "transformers": transformers.__version__,
        "threads": torch.get_num_threads(), "clock": args.clock, "prompt_len": args.prompt_len,
        "new_tokens": args.new_tokens, "repeats": args.repeats, "rounds": args.rounds, "warmup": args.warmup,
        "compile": {"backend": args.compile_backend, "mode": args.compile_mode, "fullgraph": True,
                    "exit_check_every": args.exit_check_every},
        "results": list(results.values()), "ratios": ratios(list(results.values()), preset_mode),
        "adaptive_depth": adaptive(list(results.values())), "skipped": list(skipped.values()),
    }


def ratios(results: list[dict], mode: str) -> list[dict]:
    """Per depth and batch: compiled over eager (ours), ours compiled over Llama compiled, ours eager over Llama eager;
    ours in the preset's kv_cache_mode `mode`."""
    rate = {(r["model"], r["path"], r["num_steps"], r["batch"]): r["tokens_per_s"] for r in results
            if r["kv_cache_mode"] in (mode, None) and r["exit_threshold"] is None}
    rows = []
    for num_steps, batch in sorted({(r["num_steps"], r["batch"]) for r in results}):
        def ratio(a, b):
            a, b = rate.get((*a, num_steps, batch)), rate.get((*b, num_steps, batch))
            return a / b if a and b else None
        rows.append({"num_steps": num_steps, "batch": batch,
                     "compiled_over_eager": ratio(("recurrent", "static+compile"), ("recurrent", "eager")),
                     "compiled_over_llama_compiled": ratio(("recurrent", "static+compile"), ("llama", "static+compile")),
                     "eager_over_llama_eager": ratio(("recurrent", "eager"), ("llama", "eager"))})
    return rows


def adaptive(results: list[dict]) -> list[dict]:
    """Per adaptive-depth run: its tokens/s over the fixed-depth run of the same path, depth, batch and cache mode."""
    fixed = {(r["path"], r["kv_cache_mode"], r["num_steps"], r["batch"]): r["tokens_per_s"] for r in results
             if r["model"] == "recurrent" and r["exit_threshold"] is None}
    rows = []
    for r in results:
        if r["exit_threshold"] is None:
            continue
        path = r["path"].split(" exit<")[0]
        base = fixed.get((path, r["kv_cache_mode"], r["num_steps"], r["batch"]))
        path += " masked" if r["path"].endswith(" masked") else ""
        rows.append({key: r.get(key) for key in ("num_steps", "batch", "kv_cache_mode", "exit_threshold",
                                                 "exit_check_every", "mean_steps_used", "mean_core_passes",
                                                 "tokens_per_s")}
                    | {"path": path, "fixed_depth_tokens_per_s": base,
                       "speedup": r["tokens_per_s"] / base if base else None})
    return rows


def render(report: dict) -> str:
    lines = [f"{report['checkpoint'] or report['preset']} on {report['device']} ({report['dtype']}), "
             f"prompt {report['prompt_len']}, "
             f"{report['new_tokens']} new tokens, median of {report['rounds']} x {report['repeats']} "
             f"({report['clock']} clock), SDPA kernels: {report.get('sdpa', 'torch')}",
             "| model | path | cache | n | layers | batch | tokens/s | spread | first call |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        lines.append(f"| {r['model']} | {r['path']} | {r['kv_cache_mode'] or '-'} | {r['num_steps']} | {r['layers']} | "
                     f"{r['batch']} | {r['tokens_per_s']:.1f} | {r['spread']:.1%} | "
                     f"{r['first_call_tokens_per_s']:.1f} |")
    lines += ["", "| n | batch | compiled / eager | compiled / Llama compiled | eager / Llama eager |", "|---:|---:|---:|---:|---:|"]
    fmt = lambda value: "-" if value is None else f"{value:.2f}x"  # noqa: E731
    num = lambda value: "-" if value is None else f"{value:.2f}"  # noqa: E731
    for r in report["ratios"]:
        lines.append(f"| {r['num_steps']} | {r['batch']} | {fmt(r['compiled_over_eager'])} | "
                     f"{fmt(r['compiled_over_llama_compiled'])} | {fmt(r['eager_over_llama_eager'])} |")
    if report["adaptive_depth"]:
        lines += ["", "Adaptive depth (per decoded token: mean core steps used, core passes run, eager only; k: "
                  "--exit_check_every)",
                  "| path | k | n | batch | cache | threshold | steps used | core passes | tokens/s | fixed depth | gain |",
                  "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
        for r in report["adaptive_depth"]:
            base = r["fixed_depth_tokens_per_s"]
            every = "-" if r["exit_check_every"] is None else r["exit_check_every"]
            lines.append(f"| {r['path']} | {every} | {r['num_steps']} | {r['batch']} | {r['kv_cache_mode']} | "
                         f"{r['exit_threshold']:g} | "
                         f"{num(r['mean_steps_used'])} | {num(r['mean_core_passes'])} | {r['tokens_per_s']:.1f} | "
                         f"{'-' if base is None else f'{base:.1f}'} | {fmt(r['speedup'])} |")
    if report["skipped"]:
        lines.append(f"\nskipped (time budget): {len(report['skipped'])} measurements")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse_args(argv)
    with sdpa_kernel(adaptive_depth.BLOCK_SDPA_BACKENDS) if args.sdpa == "no_cudnn" else nullcontext():
        report = run(args) | {"sdpa": args.sdpa}
    print(render(report))
    if args.output:
        with open(args.output, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
