"""Our presets against the stock peers, in one call, under the same memory cap: the MFU ratio.

    python3 -m benchmarks.bench_peers --data_dir DIR --cap_gib 24 --output peers.jsonl
    python3 -m benchmarks.bench_peers --device cpu --output peers.jsonl    # dry run of the structure (no results)

Runs, each in its own process (clean peak-memory counters; an out-of-memory error is recorded as data), one after
the other; on a machine with several GPUs peer A runs on the last GPU for the whole call, beside the others:
  peak    the device's bf16 matmul peak: median TFLOP/s of 8192^3 matmuls after 2 s of warm-up, measured in this call
          at its start and again at its end (peak-end): a fresh machine's card measured up to 3.6% slower at first
          than ten minutes later (BENCHMARKS.md), so MFU is against the larger of the two
  peer-a  transformers LlamaForCausalLM 6.74B (Llama-2-7B shape) from config in bf16, SDPA, non-reentrant
          checkpointing, random tokens, batch 4; GaLore AdamW8bit (rank 128, update_proj_gap 200, scale 0.25) on
          the attention and MLP projections, bitsandbytes AdamW8bit on the rest, one optimizer per parameter stepped
          in `register_post_accumulate_grad_hook` (in backward); Liger kernels applied before the model is built
  peer-b  the same Llama with HF Adafactor (scale_parameter=False, relative_step=False, lr 1e-4) in backward, batch 4
  PRESET  each of --presets through the real training path (benchmarks.bench_train's child: run_pretrain with
          RecurrentTrainer) with no performance flags: the defaults decide (on CUDA: the memory plan picks batch
          size and recompute for the cap, torch.compile on). The only additions are the cap (--memory_cap_gib: the
          card's size, where a training's default is the memory free when it starts) and the benchmark's bookkeeping (steps, logging, no saving).

Step time: the median after --warmup steps (the peers time each step; ours: the trainer's logged tokens/s, a line every
--log_every steps, as a training logs every 20: each line waits for the GPU). Peer A's
first step runs GaLore's SVD of every projection (242-247 s on an H200, once every 200 steps): it is recorded as
`first_step_seconds`, left out of the median, and has its own budget (--peer_a_first_step_seconds) on top of peer A's
share of the call, so one call of 540 s measures the peak, peer A, both presets and peer B; while it runs, our presets
compile (--precompile: a few untimed steps each, stopped before peer A's first step ends), so that their timed runs
start from the compile cache even on a fresh machine. Every run is
time-boxed: the peers stop timing 10 s before their share ends, ours stop training after the first step past their
share minus 20 s (evaluation and exit), marked `time_boxed` when that was before --steps; on a fresh machine ours
compile from cold (38 s against 9 for recurrent-3.3b on an H100). A run of ours stopped at its share after it wrote
its log history (trained and evaluated) keeps its figures, marked `stopped`.
MFU, all against the peak measured above:
  mfu     model FLOPs per token from `hf_recurrent.cost.flops_per_token` (attention and head included, the depth
          each step ran, recompute not counted) x tokens/s. For ours it is the trainer's logged MFU rescaled from
          --trainer_peak_flops (780e12) to the measured peak; for the peers the same accountant on their config.
  mfu_6n  peers only: 6 x parameters x tokens/s, the method of the published anchors.
The ratio of each preset to peer A uses `mfu` on both sides (like for like); the ratio to peer A's `mfu_6n` is
printed too. The bar: >= 1.05x. Records go to --output as JSON lines, one per run, then one summary line.
"""

import argparse
import importlib.util
import json
import os
import signal
import statistics
import subprocess
import sys
import time

LLAMA_7B = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=32, vocab_size=32000)
LLAMA_TINY = dict(hidden_size=64, intermediate_size=176, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, vocab_size=512)  # --device cpu: the structure only
GALORE_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
PEERS = {
    "peer-a": {"label": "Llama 6.74B, GaLore AdamW8bit in backward + Liger", "optimizer": "galore_adamw8bit",
               "liger": True, "requires": ("galore_torch", "bitsandbytes", "liger_kernel")},
    "peer-b": {"label": "Llama 6.74B, HF Adafactor in backward", "optimizer": "hf_adafactor", "liger": False,
               "requires": ()},
}
PIP_NAMES = {"galore_torch": "galore-torch", "bitsandbytes": "bitsandbytes", "liger_kernel": "liger-kernel==0.8.5"}
# Shares of what --max_seconds leaves after the first-step budgets (time a run leaves goes to the runs after it, in
# proportion). Peer A's share is for its model and its timed steps only: its first step, GaLore's SVD of all 224
# projection matrices (242.2-246.7 s on H200s, 2026-12-01 and 02), has a budget of its own. Ours need about 50 s
# each (start, compile, 21 steps), peer B about 50 s: a 540 s call holds them all.
SHARES = {"peak": 0.08, "peer-a": 0.14, "peer-b": 0.14, "peak-end": 0.02}
PEAK_RUNS = ("peak", "peak-end")
PRESET_SHARE = 0.28
# the SVD step and the 6.74B model's start: 242-247 s and about 20 on H200s, 264.5-270.4 and about 19 on H100s
# (2026-12-07); 290 left 20 s to spare on the second H100
PEER_A_FIRST_STEP_SECONDS = 310.0
# The matmul peak's own budget (about 15 s on an H200): as a share alone, a call shorter than 540 s left it under the
# 20 s a run needs once peer A's first step was set aside, and the call measured no peak (2026-12-05, 470 s).
PEAK_SECONDS = 30.0
BAR = 1.2  # each of our presets' MFU over peer A's in the same call (1.05 before the placement planner)
# What a run of ours needs after its last step: its evaluation (4 s for recurrent-3.3b on an H100), its log history
# and its exit. Training stops after the first step past its share minus this, as the peers stop before theirs.
OURS_EXIT_SECONDS = 20.0
# While peer A's first step runs GaLore's SVD (minutes in which the card mostly waits on the solver), each of our
# presets trains PRECOMPILE_STEPS untimed steps, one after another, so that its timed run later compiles from the cache
# instead of from cold: on a fresh H100 the 3.3b's first step took 33 s (9 s warm), and its share of a 540 s call did
# not hold it (2026-12-07). A precompile stops when peer A's log shows its first step done, or PRECOMPILE_SECONDS after
# peer A started (its start and SVD took 260-284 s on H200s and an H100), so that no timed step shares the card; only
# with one card large enough for two capped processes (`can_precompile`).
PRECOMPILE_STEPS = 3
PRECOMPILE_SECONDS = 200.0


def run_timeout(runs: list[str], index: int, seconds_left: float, first_step_seconds: dict[str, float]) -> float:
    """Seconds for runs[index] when `seconds_left` remain for runs[index:]: its share of what their first-step
    budgets leave, plus its own first-step budget."""
    budgets = [first_step_seconds.get(run, 0.0) for run in runs[index:]]
    shares = [SHARES.get(run, PRESET_SHARE) for run in runs[index:]]
    return max(seconds_left - sum(budgets), 0.0) * shares[0] / sum(shares) + budgets[0]


def missing_package(modules) -> str | None:
    """The skip reason of a run whose optional packages are not all installed, or None."""
    for module in modules:
        if importlib.util.find_spec(module) is None:
            name = PIP_NAMES.get(module, module)
            return f"skipped: {name} not installed (pip install {name})"
    return None


# -- children: one run per process, the record written to `out_path` as JSON


def _set_cap(cap_gib: float | None) -> None:
    import torch

    if cap_gib and torch.cuda.is_available():
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(cap_gib * 2**30 / total, 1.0))


def _write(out_path: str, record: dict) -> None:
    with open(out_path, "w") as f:
        json.dump(record, f)


def peak_child(device: str, size: int, out_path: str, samples: int = 20, per_sample: int = 10,
               run: str = "peak") -> None:
    """The matmul rate as `hf-recurrent-plan-memory --device_profile measure` measures it (clocks warmed 2 s)."""
    from trainer_ext.memory.device_profile import measure_matmul_flops

    flops = measure_matmul_flops(device, size, samples, per_sample, warmup_seconds=2.0 if device == "cuda" else 0.1)
    _write(out_path, {"run": run, "matmul_size": size, "peak_flops": flops, "tflops": round(flops / 1e12, 1)})


def _peer_optimizers(model, kind: str, device: str) -> tuple[dict, str]:
    """One optimizer per trainable parameter (stepped in its post-accumulate-grad hook), and their description."""
    import torch

    if kind == "hf_adafactor":
        from transformers.optimization import Adafactor

        return ({p: Adafactor([p], lr=1e-4, scale_parameter=False, relative_step=False) for p in model.parameters()},
                "HF Adafactor (lr 1e-4)")
    cuda = device == "cuda"  # 8-bit optimizers need CUDA: on CPU the wiring is checked with GaLoreAdamW (32-bit)
    if cuda:
        import bitsandbytes as bnb
        from galore_torch import GaLoreAdamW8bit as GaLore
        other = lambda p: bnb.optim.AdamW8bit([p], lr=1e-4)  # noqa: E731
    else:
        from galore_torch import GaLoreAdamW as GaLore
        other = lambda p: torch.optim.AdamW([p], lr=1e-4)  # noqa: E731
    group = {"rank": 128, "update_proj_gap": 200, "scale": 0.25, "proj_type": "std"}
    optimizers = {p: GaLore([{"params": [p], **group}], lr=1e-4) if n.split(".")[-2] in GALORE_TARGETS else other(p)
                  for n, p in model.named_parameters()}
    described = "GaLore AdamW8bit (rank 128) + bnb AdamW8bit" if cuda else \
        "CPU wiring check only: GaLoreAdamW (32-bit) + torch AdamW, no Liger"
    return optimizers, described


def peer_child(name: str, device: str, cap_gib: float | None, batch: int, seq_len: int, steps: int, warmup: int,
               deadline: float, out_path: str) -> None:
    """Train the peer `steps` steps (fewer if `deadline`, a time.time(), comes first); record the median step."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from hf_recurrent.cost import flops_per_token
    from trainer_ext.compat import set_checkpointing
    from trainer_ext.devices import synchronize

    _set_cap(cap_gib)
    peer = PEERS[name]
    label = peer["label"] if device == "cuda" else peer["label"].replace("Llama 6.74B", "tiny Llama").replace(
        "GaLore AdamW8bit in backward + Liger", "GaLore wiring check (32-bit, no Liger)")
    record = {"run": name, "label": label, "batch_size": batch, "seq_len": seq_len}
    liger = peer["liger"] and device == "cuda"
    if liger:
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    config = LlamaConfig(**(LLAMA_7B if device == "cuda" else LLAMA_TINY), max_position_embeddings=max(seq_len, 4096),
                         attn_implementation="sdpa", use_cache=False)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        model.train()
        set_checkpointing(model, True)
        params = sum(p.numel() for p in model.parameters())
        optimizers, record["optimizer"] = _peer_optimizers(model, peer["optimizer"], device)

        def hook(p):
            optimizers[p].step()
            optimizers[p].zero_grad(set_to_none=True)

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(hook)
        record.update(params=params, liger=liger, flops_per_token_6n=6 * params,
                      flops_per_token=flops_per_token(config, seq_len=seq_len))
        seconds = []
        for _ in range(steps):
            # The next step's time from the steps after the first: GaLore's first step runs the SVD of every
            # projection (about 244 s on an H200), the next ones take about a second.
            if len(seconds) > 1 and time.time() + max(seconds[1:][-3:]) > deadline:
                record["time_boxed"] = True
                break
            tokens = torch.randint(0, config.vocab_size, (batch, seq_len), device=device)
            synchronize(device)
            start = time.perf_counter()
            model(input_ids=tokens, labels=tokens).loss.backward()
            synchronize(device)
            seconds.append(time.perf_counter() - start)
            print(f"step {len(seconds)}: {seconds[-1]:.2f} s", flush=True)  # the log shows how far a time-out got
        record["steps"] = len(seconds)
        if seconds:
            record["first_step_seconds"] = round(seconds[0], 2)
        if len(seconds) <= warmup:  # only warm-up steps (GaLore's SVD among them): no steady-state figure
            record["error"] = (f"only {len(seconds)} step(s) of which {warmup} are warm-up (raise --max_seconds; "
                               "peer A: --peer_a_first_step_seconds)")
        else:
            steady = statistics.median(seconds[warmup:])
            record.update(step_seconds=round(steady, 4), tokens_per_second=round(batch * seq_len / steady, 1))
    except torch.OutOfMemoryError:
        record["error"] = "OOM"
    if device == "cuda":
        record["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 3)
    _write(out_path, record)


# -- the parent: runs, MFU, the table


def _start(code: str, log_path: str, gpu: int | None = None) -> subprocess.Popen:
    """`python -c code` in its own process group, output to `log_path`, on GPU `gpu` alone if given."""
    env = dict(os.environ, **({} if gpu is None else {"CUDA_VISIBLE_DEVICES": str(gpu)}))
    with open(log_path, "w") as log:
        return subprocess.Popen([sys.executable, "-c", code], stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True, env=env)


def _run(code: str, timeout: float, log_path: str, process: subprocess.Popen | None = None) -> str | None:
    """Run `python -c code` (or wait for `process`, started by _start); None, or why it failed."""
    process = process or _start(code, log_path)
    try:
        code = process.wait(timeout=max(timeout, 1))
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return f"timeout after {timeout:.0f} s (raise --max_seconds)"
    if code == 0:
        return None
    with open(log_path, errors="replace") as log:
        oom = "OutOfMemoryError" in log.read()
    return f"{'OOM, ' if oom else ''}exit code {code} (log: {log_path})"


def add_mfu(records: list[dict], peak_flops: float) -> None:
    """`mfu` (and the peers' `mfu_6n`) of every measured record, against `peak_flops`."""
    for r in records:
        if r.get("tokens_per_second") and r.get("flops_per_token"):
            r["mfu"] = round(r["flops_per_token"] * r["tokens_per_second"] / peak_flops, 4)
            if "flops_per_token_6n" in r:
                r["mfu_6n"] = round(r["flops_per_token_6n"] * r["tokens_per_second"] / peak_flops, 4)


def summarize_ratios(records: list[dict], presets: list[str]) -> dict:
    """Each preset's MFU over peer A's: like for like (`mfu` both sides) and against peer A's `mfu_6n`."""
    peer = next((r for r in records if r["run"] == "peer-a"), {})
    summary = {"run": "summary", "bar": BAR}
    for preset in presets:
        ours = next((r for r in records if r["run"] == preset), {})
        if ours.get("mfu") and peer.get("mfu"):
            ratio = round(ours["mfu"] / peer["mfu"], 3)
            summary[preset] = {"ratio": ratio, "ratio_vs_mfu_6n": round(ours["mfu"] / peer["mfu_6n"], 3),
                               "meets_bar": ratio >= BAR}
        else:
            missing = "peer-a" if not peer.get("mfu") else preset
            summary[preset] = {"ratio": None, "why": f"no MFU for {missing}"}
    return summary


def table(records: list[dict], summary: dict) -> str:
    def pct(value):
        return f"{100 * value:.1f}%" if isinstance(value, float) else "-"

    lines = ["| run | batch | tokens/s | peak reserved GiB | MFU | MFU 6N | MFU logged (trainer peak) |",
             "|---|---|---|---|---|---|---|"]
    for r in records:
        if r["run"] in (*PEAK_RUNS, "summary"):
            continue
        status = r.get("skipped") or r.get("error")
        tokens = f"{r['tokens_per_second']:,.0f}" if r.get("tokens_per_second") else status or "-"
        lines.append(f"| {r['run']}: {r.get('label', r['run'])} | {r.get('batch_size', '-')} | {tokens} | "
                     f"{r.get('peak_reserved_gib') or '-'} | {pct(r.get('mfu'))} | {pct(r.get('mfu_6n'))} | "
                     f"{pct(r.get('mfu_logged'))} |")
    dry, bar = "dry run, not a result: " if summary.get("dry_run") else "", summary.get("bar", BAR)
    for preset, ratio in summary.items():
        if isinstance(ratio, dict) and "ratio" in ratio:  # a preset's ratio (not the precompiles' seconds)
            if ratio["ratio"] is None:
                lines.append(f"{preset} / peer-a: n/a ({ratio['why']})")
            else:
                lines.append(f"{dry}{preset} / peer-a MFU: {ratio['ratio']:.3f}x like for like, "
                             f"{ratio['ratio_vs_mfu_6n']:.3f}x against its 6N MFU; the bar: >= {bar}x "
                             f"({'met' if ratio['meets_bar'] else 'not met'})")
    if summary.get("precompiled"):
        lines.append("compiled during peer A's first step (untimed): " + ", ".join(
            f"{preset} {done} s" if isinstance(done, float) else f"{preset} {done}"
            for preset, done in summary["precompiled"].items()))
    return "\n".join(lines)


def _ours_code(preset: str, args, out_dir: str, steps: int, deadline: float | None = None) -> str:
    """The `python -c` code of one training of ours: the defaults under the cap (the planner is told the cap: on a
    card of that size it is the default), `steps` steps, nothing saved."""
    from benchmarks.bench_train import run_arguments

    cuda = args.device == "cuda"
    run_args = [*run_arguments(preset, args.data_dir, out_dir, steps, args.warmup, args.cap_gib,
                               log_every=args.log_every),
                "--overwrite_output_dir", "true", "--peak_flops", str(args.trainer_peak_flops),
                *(["--bf16", "true"] if cuda else ["--use_cpu", "true"])]
    cap = args.cap_gib if cuda else None
    return f"from benchmarks.bench_train import child; child({cap!r}, {run_args!r}, deadline={deadline!r})"


def can_precompile(total_bytes: int, cap_gib: float) -> bool:
    """Whether a card of `total_bytes` holds peer A and a precompile beside it, each under the cap."""
    return total_bytes >= (2 * cap_gib + 2) * 2**30


def first_step_done(log_path: str) -> bool:
    """Whether a peer's log (`peer_child` prints a line per step) shows its first step done."""
    try:
        with open(log_path, errors="replace") as log:
            return any(line.startswith("step 1:") for line in log)
    except FileNotFoundError:
        return False


def precompile(presets: list[str], args, peer_log: str, until: float) -> dict:
    """Train each of `presets` PRECOMPILE_STEPS steps (module constants' comment), one after another, each stopped
    as soon as `peer_log` shows peer A's first step done or `until` (a time.time()) comes; {preset: seconds it took,
    or why it has none}."""
    def peer_done() -> bool:
        return time.time() >= until or first_step_done(peer_log)

    done = {}
    for preset in presets:
        if peer_done():
            done[preset] = "not run: peer A's first step ended first"
            continue
        started = time.time()
        process = _start(_ours_code(preset, args, os.path.join(args.output_dir, "precompile", preset),
                                    PRECOMPILE_STEPS), os.path.join(args.output_dir, f"precompile-{preset}.log"))
        while process.poll() is None and not peer_done():
            time.sleep(0.2)
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            done[preset] = f"stopped after {time.time() - started:.0f} s: peer A's first step ended"
        else:
            done[preset] = round(time.time() - started, 1) if process.returncode == 0 else \
                f"exit code {process.returncode}"
    return done


def _ours(preset: str, args, timeout: float) -> dict:
    from benchmarks.bench_train import summarize

    out_dir = os.path.join(args.output_dir, preset)
    started = time.time()
    code = _ours_code(preset, args, out_dir, args.steps, deadline=started + timeout - OURS_EXIT_SECONDS)
    error = _run(code, timeout, os.path.join(args.output_dir, f"{preset}.log"))
    # A run stopped after it wrote its log history (trained, evaluated; a fresh machine's first compile made the
    # 3.3b's run 74 s long, and it was stopped on its way out) has every figure: they are kept.
    history = os.path.join(out_dir, "log_history.json")
    if error and not (os.path.isfile(history) and os.path.getmtime(history) >= started):
        return {"run": preset, "label": f"{preset}, defaults", "error": error}
    row = summarize(preset, out_dir, args.warmup)
    if "error" in row:
        return {"run": preset, "label": f"{preset}, defaults", "error": row["error"]}
    record = {"run": preset, "label": f"{preset}, defaults", "steps": row["steps"],
              "tokens_per_second": row["tokens_per_second"], "mfu_logged": row["mfu"],
              "trainer_peak_flops": args.trainer_peak_flops, "peak_reserved_gib": row["peak_reserved_gib"] or None,
              **({"stopped": f"{error}, after its log history was written"} if error else {}),
              **({"time_boxed": True} if (row.get("last_step") or 0) < args.steps else {})}
    plan_path = os.path.join(out_dir, "memory_plan.json")
    if os.path.isfile(plan_path):
        with open(plan_path) as f:
            plan = json.load(f)
        record.update(batch_size=plan.get("per_device_train_batch_size"), plan=plan.get("recompute_description"))
    if row["mfu"] == row["mfu"] and row["tokens_per_second"]:  # the trainer's FLOPs per token, back from its MFU
        record["flops_per_token"] = row["mfu"] * args.trainer_peak_flops / row["tokens_per_second"]
    return record


def _start_peer(name: str, args, seq_len: int, timeout: float, gpu: int | None = None) -> subprocess.Popen:
    out_path = os.path.join(args.output_dir, f"{name}.json")
    if os.path.exists(out_path):
        os.remove(out_path)
    cap = args.cap_gib if args.device == "cuda" else None
    call = (f"peer_child({name!r}, {args.device!r}, {cap!r}, {args.peer_batch_size}, {seq_len}, {args.steps}, "
            f"{args.warmup}, {time.time() + timeout - 10!r}, {out_path!r})")
    return _start(f"from benchmarks.bench_peers import peer_child; {call}",
                  os.path.join(args.output_dir, f"{name}.log"), gpu)


def _collect(run: str, args, process: subprocess.Popen, timeout: float) -> dict:
    """Wait for a child started by _start (up to `timeout` s); its record, or why there is none."""
    error = _run("", timeout, os.path.join(args.output_dir, f"{run}.log"), process)
    if error is not None:
        return {"run": run, "label": PEERS.get(run, {}).get("label", run), "error": error}
    with open(os.path.join(args.output_dir, f"{run}.json")) as f:
        return json.load(f)


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data_dir", default=None, help="Prepared shards for our presets (default: the embedded "
                                                         "corpus); seq 2048 shards for the comparison.")
    parser.add_argument("--presets", nargs="+", default=None,
                        help="Default: recurrent-3.3b recurrent-7b (debug with --device cpu).")
    parser.add_argument("--runs", nargs="+", default=["peak", "peer-a", "peer-b", "ours"],
                        choices=["peak", "peer-a", "peer-b", "ours"])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument("--cap_gib", type=float, default=24.0)
    parser.add_argument("--seq_len", type=int, default=None, help="The peers' (default 2048; 128 on CPU).")
    parser.add_argument("--peer_batch_size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=21,
                        help="Steps of each run: ours log 4 windows of --log_every steps after the warm-up (their "
                             "medians; the depth each step draws moves a window's MFU by a few percent).")
    parser.add_argument("--warmup", type=int, default=3, help="Steps left out of the medians.")
    parser.add_argument("--log_every", type=int, default=4,
                        help="Our trainings' steps per log line, whose medians are then over windows of this many "
                             "steps: a log line waits for the GPU (the defaults log every 20 steps; the peers' timed "
                             "steps wait for it at their ends).")
    parser.add_argument("--max_seconds", type=float, default=540, help="The whole call; each run gets a share.")
    parser.add_argument("--peer_a_first_step_seconds", type=float, default=None,
                        help=f"Peer A's first step (GaLore's SVD) and start, on top of its share (default "
                             f"{PEER_A_FIRST_STEP_SECONDS:g} on CUDA, 0 on the CPU).")
    parser.add_argument("--precompile", action=argparse.BooleanOptionalAction, default=True,
                        help=f"Our presets train {PRECOMPILE_STEPS} untimed steps each while peer A's first step runs "
                             "(one card of twice the cap or more), so that their timed runs compile from the cache.")
    parser.add_argument("--peak_flops", type=float, default=None,
                        help="The peak MFU is computed against when the measured one is missing (peak run left out "
                             "or failed); the measured peak wins.")
    parser.add_argument("--trainer_peak_flops", type=float, default=None,
                        help="The peak our trainer logs MFU against (default 780e12; 1e12 with --device cpu).")
    parser.add_argument("--output_dir", default=os.path.join("outputs", "bench_peers"))
    parser.add_argument("--output", default=None, help="JSON lines (default: OUTPUT_DIR/results.jsonl).")
    args = parser.parse_args(argv)
    cuda = args.device == "cuda"
    if cuda:
        import torch

        if not torch.cuda.is_available():
            parser.error("--device cuda: no CUDA device here; use --device cpu for a dry run of the structure.")
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}: the median needs steady steps.")
    args.trainer_peak_flops = args.trainer_peak_flops or (780e12 if cuda else 1e12)
    presets = args.presets or (["recurrent-3.3b", "recurrent-7b"] if cuda else ["debug"])
    seq_len = args.seq_len or (2048 if cuda else 128)
    os.makedirs(args.output_dir, exist_ok=True)
    output = args.output or os.path.join(args.output_dir, "results.jsonl")
    if os.path.dirname(output):
        os.makedirs(os.path.dirname(output), exist_ok=True)

    start = time.time()
    runs = [r for r in ("peak", "peer-a") if r in args.runs] + [p for p in presets if "ours" in args.runs] + \
        (["peer-b"] if "peer-b" in args.runs else []) + (["peak-end"] if "peak" in args.runs else [])
    # With several GPUs peer A (GaLore's first step alone takes about 4 minutes) runs on the last one for the whole
    # call while the other runs take turns on the first, the same card type: one call holds them all.
    aside = None
    if cuda and torch.cuda.device_count() > 1 and "peer-a" in runs and not missing_package(PEERS["peer-a"]["requires"]):
        runs.remove("peer-a")
        aside = _start_peer("peer-a", args, seq_len, args.max_seconds, torch.cuda.device_count() - 1)
    # on CPU peer A checks its optimizer wiring only: no Liger (it needs a GPU)
    skips = {run: missing_package(PEERS[run]["requires"][:None if cuda else 2]) for run in runs if run in PEERS}
    first_step = args.peer_a_first_step_seconds
    first_step = {"peer-a": (PEER_A_FIRST_STEP_SECONDS if cuda else 0.0) if first_step is None else first_step,
                  **{run: PEAK_SECONDS if cuda else 0.0 for run in PEAK_RUNS}}
    first_step = {run: seconds for run, seconds in first_step.items() if run in runs and not skips.get(run)}
    records, precompiled = [], None
    # our presets that run, compiled while peer A's first step runs where the card holds both (`precompile`)
    to_precompile = [p for p in presets if p in runs] if args.precompile and cuda and can_precompile(
        torch.cuda.get_device_properties(0).total_memory, args.cap_gib) else []
    for i, run in enumerate(runs):
        timeout = run_timeout(runs, i, start + args.max_seconds - time.time(), first_step)
        out_path = os.path.join(args.output_dir, f"{run}.json")
        skip = skips.get(run)
        if timeout < 20:
            record = {"run": run, "skipped": "no time left (raise --max_seconds)"}
        elif run in presets:
            record = _ours(run, args, timeout)
        elif skip:
            record = {"run": run, "label": PEERS[run]["label"], "skipped": skip}
        else:
            started = time.time()
            process = _start_peer(run, args, seq_len, timeout) if run in PEERS else _start(
                f"from benchmarks.bench_peers import peak_child; peak_child({args.device!r}, "
                f"{8192 if cuda else 512}, {out_path!r}, run={run!r})", os.path.join(args.output_dir, f"{run}.log"))
            if run == "peer-a" and to_precompile:
                precompiled = precompile(to_precompile, args, os.path.join(args.output_dir, f"{run}.log"),
                                         started + PRECOMPILE_SECONDS)
            record = _collect(run, args, process, timeout - (time.time() - started))
        record.update(device=args.device, dry_run=not cuda)
        records.append(record)
        print(json.dumps(record), flush=True)
    if aside is not None:
        record = _collect("peer-a", args, aside, start + args.max_seconds - time.time())
        record.update(device=args.device, dry_run=False, gpu=torch.cuda.device_count() - 1)
        records.insert(1 if records and records[0]["run"] == "peak" else 0, record)
        print(json.dumps(record), flush=True)

    peaks = {r["run"]: r["peak_flops"] for r in records if r["run"] in PEAK_RUNS and "peak_flops" in r}
    measured = max(peaks.values(), default=None)  # the card warm: the larger of the call's start and end
    peak = measured or args.peak_flops
    if peak is None:
        print("No measured peak (the peak run failed or was left out) and no --peak_flops: MFU not computed.")
    else:
        add_mfu(records, peak)
    summary = summarize_ratios(records, presets if "ours" in args.runs else [])  # ratios of the presets that ran
    if precompiled is not None:
        summary["precompiled"] = precompiled
    summary.update(peak_flops=peak, peak_measured=measured is not None, peaks_measured=sorted(peaks.items()),
                   dry_run=not cuda, seconds=round(time.time() - start, 1))
    with open(output, "w") as f:
        for record in records + [summary]:
            f.write(json.dumps(record) + "\n")
    if not cuda:
        print("Dry run on CPU: the structure only; the numbers are not results.")
    source = ", ".join(f"{run} {flops / 1e12:.1f}" for run, flops in peaks.items()) or "--peak_flops"
    print(f"MFU against {peak / 1e12:.1f} TFLOP/s ({source}); " if peak else "", end="")
    print(f"results in {output}\n" + table(records, summary))
    return records + [summary]


if __name__ == "__main__":
    main()
