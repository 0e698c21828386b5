"""The fused optimizer's GPU time per kernel over one preset's matrices, as training meets them, at the default tiles
and at others.

Each of the preset's matrix shapes (read from the model built on the meta device, counted as often as the model has
them) gets its own bf16 weight and the optimizer's default state for the preset's size (subspace momentum above
`AUTO_MOMENTUM_MAX_PARAMS`). Before every update the gradient is written afresh by a copy, as backward's product
writes it just before the in-backward update: a gradient left over from the last step would be read from the L2
cache by a matrix that fits in it. A few updates are profiled; the kernels' time is summed by name.

    python3 -m benchmarks.optimizer_kernels --preset recurrent-3.3b --stats 32x256x4x8x512 32x256x4x1x512 \
        --tiles 32x256x4 64x128x4 --apply_tiles default 16x128

`--stats`: the statistics pass's tile (rows x columns x warps), its longest strip of tiles a program and the fewest
programs a matrix gets (`triton_kernels._STATS_*`); `--tiles`: the update-RMS pass's tile (rows x columns x warps);
`--apply_tiles`: the apply pass's (rows x columns; "default": the module's). The first of each list is the base, each
other entry a variant of it. One JSON row per variant: the microseconds a training step spends in each kernel over
all the preset's matrices, their total, and the statistics pass's read rate (GB/s: the gradients' bytes over its
time), beside the rate of the copy that wrote the gradients (read + write).
"""

import argparse
import json

import torch

from hf_recurrent import presets
from trainer_ext.optim import triton_kernels as fused
from trainer_ext.optim.momentum import resolve_momentum
from trainer_ext.optim.optimizer import LowMemoryAdafactor


def matrix_shapes(preset: str) -> tuple[dict[tuple[int, int], int], int]:
    """The preset's 2-D parameter shapes with how many the model has of each, and its number of parameters."""
    from transformers import AutoModelForCausalLM

    config = presets.get(preset)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    counts, total = {}, 0
    for p in model.parameters():
        total += p.numel()
        if p.ndim == 2:
            counts[tuple(p.shape)] = counts.get(tuple(p.shape), 0) + 1
    return counts, total


def set_tiles(stats: str, tile: str, apply: str) -> None:
    fused._STATS_ROWS, fused._STATS_COLS, fused._STATS_WARPS, fused._STATS_STRIP, fused._STATS_PROGRAMS = \
        (int(x) for x in stats.split("x"))
    fused._TILE_ROWS, fused._TILE_COLS, fused._TILE_WARPS = (int(x) for x in tile.split("x"))
    if apply != "default":  # the module's tile (its rows with full momentum apart), else this one for every momentum
        rows, fused._APPLY_COLS = (int(x) for x in apply.split("x"))
        fused._APPLY_ROWS = fused._APPLY_ROWS_FULL_MOMENTUM = rows
    fused._layout.cache_clear()


def profile_shape(shape, momentum, rank_fraction, warmup: int, steps: int) -> dict[str, float]:
    """Microseconds per update of one (R, C) matrix, by kernel name ("refresh": the gradient's copy)."""
    weight = torch.nn.Parameter(torch.randn(shape, device="cuda", dtype=torch.bfloat16))
    sources = [torch.randn(shape, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    weight.grad = torch.empty_like(weight)
    optimizer = LowMemoryAdafactor([weight], lr=1e-3, momentum=momentum, momentum_rank_fraction=rank_fraction,
                                   compile=True, fused=True)
    for i in range(warmup):
        weight.grad.copy_(sources[i % 2])
        optimizer.step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as profile:
        for i in range(steps):
            weight.grad.copy_(sources[i % 2])
            optimizer.step()
        torch.cuda.synchronize()
    times = {}
    for event in profile.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            name = "refresh" if event.name.startswith("Memcpy DtoD") else event.name[:60]
            times[name] = times.get(name, 0.0) + event.device_time / steps
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="recurrent-3.3b")
    parser.add_argument("--stats", nargs="+", default=["x".join(str(getattr(fused, f"_STATS_{name}")) for name in
                                                            ("ROWS", "COLS", "WARPS", "STRIP", "PROGRAMS"))])
    parser.add_argument("--tiles", nargs="+", default=[f"{fused._TILE_ROWS}x{fused._TILE_COLS}x{fused._TILE_WARPS}"])
    parser.add_argument("--apply_tiles", nargs="+", default=["default"])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks.optimizer_kernels needs a CUDA device")
    torch.backends.cuda.matmul.allow_tf32 = True  # as the trainer sets it
    counts, num_params = matrix_shapes(args.preset)
    momentum, rank_fraction = resolve_momentum(None, None, num_params)
    base = (args.stats[0], args.tiles[0], args.apply_tiles[0])
    variants = [base] + [(s, *base[1:]) for s in args.stats[1:]] + [(base[0], t, base[2]) for t in args.tiles[1:]] \
        + [(*base[:2], a) for a in args.apply_tiles[1:]]
    for stats, tile, apply in variants:
        set_tiles(stats, tile, apply)
        step, shapes = {}, {}
        for shape, count in counts.items():
            times = profile_shape(shape, momentum, rank_fraction, args.warmup, args.steps)
            shapes["x".join(map(str, shape))] = {"count": count,
                                                 "us": round(sum(times.values()) - times.get("refresh", 0))}
            for name, micros in times.items():
                step[name] = step.get(name, 0.0) + count * micros
        grad_bytes = 2 * sum(r * c * n for (r, c), n in counts.items())
        stats_us = sum(v for k, v in step.items() if "_stats_kernel" in k)
        print(json.dumps({
            "preset": args.preset, "stats": stats, "update_rms_tile": tile, "apply_tile": apply, "momentum": momentum,
            "momentum_rank_fraction": rank_fraction,
            "step_us": round(sum(step.values()) - step.get("refresh", 0.0)),
            "stats_read_GB_per_s": round(grad_bytes / stats_us / 1e3, 1) if stats_us else None,
            "refresh_GB_per_s": round(2 * grad_bytes / step["refresh"] / 1e3, 1) if step.get("refresh") else None,
            "kernels_us": {k: round(v) for k, v in sorted(step.items(), key=lambda item: -item[1])},
            "per_shape_us": shapes,
        }), flush=True)


if __name__ == "__main__":
    main()
