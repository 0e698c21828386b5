"""Benchmark the low-memory optimizer on a stack of bf16 matrices shaped like a Llama decoder.

Measures, after warm-up: time of one forward+backward+update step and of the update alone (CUDA
synchronised around each phase), peak reserved memory, optimizer state size, and how many graphs
torch.compile built (all shapes should share a few). Example:

    python benchmarks/bench_optimizer.py --hidden 4096 --intermediate 11008 --layers 4 --vocab 32000
    python benchmarks/bench_optimizer.py --probe --hidden 4096 --intermediate 11008 --vocab 65536 --kv_rows 1024 \
        --momentum 0.9 --momentum_rank_fraction 0.0625 [--tf32] [--no-fused]   # one tensor at a time, 7B shapes
    python benchmarks/bench_optimizer.py --host_only --hidden 768 --intermediate 2048 --momentum 0.9
        # no GPU: the fused path's host time per matrix, its Triton launches replaced by no-ops
"""

from __future__ import annotations

import argparse
import json
import time

import torch
from torch import nn

from trainer_ext.optim.optimizer import DEFAULT_MAX_CHUNK_NUMEL, LowMemoryAdafactor, create_optimizer


class _Block(nn.Module):
    """Llama-shaped weights (attention projections + SwiGLU MLP) without attention itself."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.norm = nn.Parameter(torch.ones(hidden))
        self.qkvo = nn.ModuleList(nn.Linear(hidden, hidden, bias=False) for _ in range(4))
        self.gate = nn.Linear(hidden, intermediate, bias=False)
        self.up = nn.Linear(hidden, intermediate, bias=False)
        self.down = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x):  # (B, T, C)
        h = nn.functional.rms_norm(x, x.shape[-1:], self.norm)
        q, k, v, o = self.qkvo
        x = x + o(q(h) * torch.sigmoid(k(h)) + v(h))
        h = nn.functional.rms_norm(x, x.shape[-1:], self.norm)
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def _build(args) -> nn.Module:
    model = nn.ModuleDict({
        "embed": nn.Embedding(args.vocab, args.hidden),
        "blocks": nn.ModuleList(_Block(args.hidden, args.intermediate) for _ in range(args.layers)),
        "head": nn.Linear(args.hidden, args.vocab, bias=False),
    })
    return model.to(device="cuda", dtype=torch.bfloat16)


def _loss(model, tokens):
    x = model["embed"](tokens)
    for block in model["blocks"]:
        x = block(x)
    return nn.functional.cross_entropy(model["head"](x).flatten(0, 1).float(), tokens.flatten())


def _update_cpu_cost(optimizer: LowMemoryAdafactor, weight: torch.Tensor, calls: int = 16) -> dict:
    """Host time of one tensor's update as training runs it in backward (``_update``, no step bookkeeping, no sync;
    few enough calls that the launch queue never fills), and where it goes: the functions with most own time."""
    import cProfile
    import pstats

    group = optimizer.param_groups[0]
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        optimizer._update(weight, group, 0)
    host_us = (time.perf_counter() - start) / calls * 1e6
    torch.cuda.synchronize()
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(calls):
        optimizer._update(weight, group, 0)
    profiler.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(profiler).stats
    top = sorted(stats.items(), key=lambda item: -item[1][2])[:12]
    return {"update_host_us": round(host_us, 1),
            "host_top": [[f"{func[0].rsplit('/', 1)[-1]}:{func[1]}:{func[2]}", round(v[2] / calls * 1e6, 1),
                          round(v[3] / calls * 1e6, 1)] for func, v in top]}


def _probe(args) -> None:
    """One bf16 tensor at a time: update time (launch and GPU) and memory beyond weight + gradient."""
    shapes = [(args.vocab, args.hidden), (args.intermediate, args.hidden), (args.hidden, args.hidden)]
    for shape in shapes + [(args.kv_rows, args.hidden)] * bool(args.kv_rows):
        weight = nn.Parameter(torch.randn(shape, device="cuda", dtype=torch.bfloat16))
        weight.grad = torch.randn_like(weight)
        optimizer = LowMemoryAdafactor([weight], lr=1e-3, momentum=args.momentum, compile=not args.no_compile,
                                       fused=not args.no_fused,
                                       momentum_rank_fraction=args.momentum_rank_fraction,
                                       max_chunk_numel=args.max_chunk_numel)
        for _ in range(args.warmup):
            optimizer.step()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        launch, total = [], []
        for _ in range(args.steps):
            start = time.perf_counter()
            optimizer.step()
            launch.append(time.perf_counter() - start)
            torch.cuda.synchronize()
            total.append(time.perf_counter() - start)
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
            optimizer.step()
            torch.cuda.synchronize()
        kernels = [e for e in profile.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        cpu = _update_cpu_cost(optimizer, weight) if args.cpu_profile else {}
        gpu_ms = sum(e.device_time for e in kernels) / 1000
        gigabytes = weight.numel() * 2 * 5 / 1e9  # grad read 3x, weight read + write
        median = sorted(total)[len(total) // 2]
        print(json.dumps({
            "shape": shape, "momentum": args.momentum, "momentum_rank_fraction": args.momentum_rank_fraction,
            "max_chunk_numel": args.max_chunk_numel, "compile": not args.no_compile, "fused": not args.no_fused,
            "tf32": args.tf32, "apply_tile": args.apply_tile,
            "launch_ms": round(1000 * sorted(launch)[len(launch) // 2], 3), "total_ms": round(1000 * median, 3),
            "kernels": len(kernels), "kernel_ms": round(gpu_ms, 3),
            "GB_per_s_at_10_bytes_per_element": round(gigabytes / median, 1),
            "extra_peak_MiB": round((torch.cuda.max_memory_allocated() - base) / 2**20, 1), **cpu,
        }))
        del weight, optimizer


def _host_only(args) -> None:
    """The fused update's host time per matrix and per vector without its kernel launches (they are replaced by
    no-ops), on the CPU: the Python around the launches, which a small model's step waits on."""
    import os

    from trainer_ext.optim import triton_kernels as fused

    class _NoLaunch:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: None

    os.environ["TRITON_INTERPRET"] = "1"  # the fused path takes CPU tensors under the interpreter
    for name in [name for name in vars(fused) if name.endswith("_kernel")]:
        setattr(fused, name, _NoLaunch())
    shapes = [(args.intermediate, args.hidden), (args.hidden, args.hidden), (args.hidden, args.intermediate)]
    row = {"shapes": shapes, "momentum": args.momentum, "momentum_rank_fraction": args.momentum_rank_fraction}
    for kind, kind_shapes in (("matrix", shapes), ("vector", [(args.hidden,)])):
        weights = [nn.Parameter(torch.randn(shape, dtype=torch.bfloat16)) for shape in kind_shapes]
        optimizer = LowMemoryAdafactor(weights, lr=1e-3, momentum=args.momentum, compile=True,
                                       momentum_rank_fraction=args.momentum_rank_fraction)
        group = optimizer.param_groups[0]
        for weight in weights:
            weight.grad = torch.randn_like(weight)
            optimizer._update(weight, group, optimizer._position[weight][1])
        calls = args.steps * 20
        start = time.perf_counter()
        for _ in range(calls):
            for weight in weights:
                optimizer._update(weight, group, optimizer._position[weight][1])
        row[f"host_us_per_{kind}_without_launches"] = round((time.perf_counter() - start) / (calls * len(weights))
                                                            * 1e6, 1)
    print(json.dumps(row))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=5632)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--seq", type=int, default=512)
    parser.add_argument("--steps", type=int, default=10, help="timed steps after warm-up")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--classic", action="store_true", help="update in optimizer.step(), not in backward")
    parser.add_argument("--momentum", type=float, default=None)
    parser.add_argument("--momentum_rank_fraction", type=float, default=None,
                        help="subspace momentum (1/16: the 7B default); None: full momentum")
    parser.add_argument("--kv_rows", type=int, default=0, help="--probe: also a (kv_rows, hidden) tensor (GQA)")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-fused", action="store_true", help="the compiled torch functions, not the Triton kernels")
    parser.add_argument("--tf32", action="store_true",
                        help="TF32 matmuls, as the trainer sets them (subspace momentum)")
    parser.add_argument("--apply_tile", default=None, help="ROWSxCOLS of the fused apply kernel "
                        "(default: triton_kernels's); see benchmarks/kernel_resources.py")
    parser.add_argument("--cpu_profile", action="store_true", help="--probe: also the host time of one tensor's "
                        "update and the functions it goes to (own and cumulative microseconds per update)")
    parser.add_argument("--max-chunk-numel", type=int, default=DEFAULT_MAX_CHUNK_NUMEL)
    parser.add_argument("--release-only", action="store_true",
                        help="baseline: free each gradient in backward without any update")
    parser.add_argument("--probe", action="store_true", help="time and measure single-tensor updates instead")
    parser.add_argument("--host_only", action="store_true",
                        help="no GPU: the fused update's host time per matrix, its kernel launches replaced by no-ops")
    args = parser.parse_args()
    if args.host_only:
        return _host_only(args)
    if not torch.cuda.is_available():
        raise SystemExit("bench_optimizer needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = args.tf32
    if args.apply_tile:
        from trainer_ext.optim import triton_kernels as fused

        rows, fused._APPLY_COLS = (int(x) for x in args.apply_tile.split("x"))
        fused._APPLY_ROWS = fused._APPLY_ROWS_FULL_MOMENTUM = rows
    if args.probe:
        return _probe(args)

    torch.manual_seed(0)
    model = _build(args)
    optimizer = create_optimizer(model, lr=1e-3, weight_decay=0.1, in_backward=not args.classic,
                                 momentum=args.momentum, compile=not args.no_compile, fused=not args.no_fused,
                                 max_chunk_numel=args.max_chunk_numel)
    if args.release_only:
        optimizer.detach_from_backward()
        for p in model.parameters():
            p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device="cuda")

    def timed(fn) -> float:
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - start

    compile_start = time.perf_counter()
    for _ in range(args.warmup):
        _loss(model, tokens).backward()
        optimizer.step()
        optimizer.zero_grad()
    torch.cuda.synchronize()
    warmup_s = time.perf_counter() - compile_start
    torch.cuda.reset_peak_memory_stats()

    step_times, update_times = [], []
    for _ in range(args.steps):
        if args.classic:
            step_times.append(timed(lambda: _loss(model, tokens).backward()))
            update_times.append(timed(optimizer.step))
            step_times[-1] += update_times[-1]
            optimizer.zero_grad()
        else:
            step_times.append(timed(lambda: (_loss(model, tokens).backward(), optimizer.step())))
    if args.classic:
        update_ms = 1000 * sorted(update_times)[len(update_times) // 2]
    else:
        update_ms = None

    try:
        from torch._dynamo.utils import counters
        graphs = int(counters["stats"]["unique_graphs"])
    except Exception:  # counters are a private API; the benchmark does not depend on them
        graphs = None
    params = sum(p.numel() for p in model.parameters())
    print(json.dumps({
        "params_M": round(params / 1e6, 1),
        "mode": "classic" if args.classic else "in_backward",
        "compile": optimizer.compile,
        "median_step_ms": round(1000 * sorted(step_times)[len(step_times) // 2], 2),
        "median_update_ms": None if update_ms is None else round(update_ms, 2),
        "warmup_s": round(warmup_s, 1),
        "peak_reserved_GiB": round(torch.cuda.max_memory_reserved() / 2**30, 2),
        "weights_GiB": round(params * 2 / 2**30, 2),
        "state_MiB": round(optimizer.state_bytes() / 2**20, 2),
        "compiled_graphs": graphs,
        "last_grad_norm": optimizer.last_grad_norm,
        "last_loss": round(_loss(model, tokens).item(), 4),
    }))


if __name__ == "__main__":
    main()
