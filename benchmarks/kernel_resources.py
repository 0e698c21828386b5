"""Registers, spills and matrix instructions of our Triton kernels for a GPU, without a GPU.

Compiles each kernel of trainer_ext/optim/triton_kernels.py for the target (default sm_90, the H100 / H200)
with the tile sizes given (default: the module's), and the loss's CE kernel (trainer_ext/distill/ce_triton.py, bf16
logits of a 65,536-entry vocabulary), then runs the ptxas that ships with Triton on the PTX. A kernel
that spills registers moves more bytes than the update needs (local memory), and one at 255 registers runs few
programs per multiprocessor: both show here before any GPU time is spent.

    python benchmarks/kernel_resources.py                        # the tiles in triton_kernels.py
    python benchmarks/kernel_resources.py --tiles 16x256 16x128  # the element-wise kernels at other tiles
    python benchmarks/kernel_resources.py --arch 86              # an RTX 3090
"""

import argparse
import json
import os
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from trainer_ext.distill import ce_triton
from trainer_ext.optim import triton_kernels as kernels

# Argument types: bf16 tensors (the 3-7B presets' weights), int32 sizes and offsets, fp32 everything else.
_BF16 = {"param", "grad", "momentum", "back", "projected"}
_INT32 = {"R", "C", "numel", "rows_per_chunk", "row_start", "row_end", "num_parts", "tiles_r", "tiles_c",
          "row_programs", "chunk", "rows_in_chunk", "rank", "n"}


def signature_of(fn, constants: dict) -> dict:
    """The Triton signature of kernel ``fn`` with ``constants`` as its constexprs."""
    def kind(name: str) -> str:
        return "constexpr" if name in constants else "*bf16" if name in _BF16 else "i32" if name in _INT32 \
            else "*i32" if name == "keys" else "*fp32"

    return {name: kind(name) for name in fn.arg_names}


def resources(fn, constants: dict, warps: int, arch: int, signature: dict | None = None) -> dict:
    """Compile `fn` for sm_`arch` (with `signature`, default `signature_of`) and read ptxas's report."""
    signature = signature or signature_of(fn, constants)
    compiled = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constants),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
    ptx = compiled.asm["ptx"]
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    # The ptxas binaries Triton ships, in its order: newer Triton releases emit a PTX version that only the second
    # (`ptxas-blackwell`) reads.
    for name in ("ptxas", "ptxas-blackwell"):
        ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", name)
        run = subprocess.run([ptxas, "-v", "--gpu-name", f"sm_{arch}{'a' if arch == 90 else ''}", f.name, "-o",
                              os.devnull], capture_output=True, text=True) if os.path.exists(ptxas) else None
        if run is not None and run.returncode == 0:
            break
    os.unlink(f.name)
    if run is None or run.returncode:
        raise RuntimeError(f"no ptxas of Triton {triton.__version__} assembled the PTX: "
                           f"{run.stderr.strip() if run else 'none found'}")
    report = run.stderr
    registers = int(report.split("Used ")[1].split(" registers")[0])
    spill = int(report.split(" bytes spill stores")[0].rsplit(" ", 1)[1])
    return {"registers": registers, "spill_store_bytes": spill, "shared_bytes": compiled.metadata.shared,
            "wgmma": ptx.count("wgmma.mma_async"), "mma_sync": ptx.count("mma.sync")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (90: H100/H200, 86: RTX 3090)")
    parser.add_argument("--tiles", nargs="+", default=None,
                        help="ROWSxCOLS of the element-wise kernels (statistics, update RMS, apply); default: the "
                             "module's (each pass's own; the statistics pass at its longest strip)")
    parser.add_argument("--warps", type=int, default=4, help="warps of the element-wise kernels")
    args = parser.parse_args()
    pairs = [(f"{kernels._TILE_ROWS}x{kernels._TILE_COLS}", f"{kernels._APPLY_ROWS}x{kernels._APPLY_COLS}")] \
        if args.tiles is None else [(tile, tile) for tile in args.tiles]
    apply = dict(PARAM_BF16=True, FULL_MOMENTUM=False, SUBSPACE=False, MOMENTUM_BF16=False, P=16)
    for pass_tile, apply_tile in pairs:
        full_tile = apply_tile if args.tiles else f"{kernels._APPLY_ROWS_FULL_MOMENTUM}x{kernels._APPLY_COLS}"
        stats_tile = pass_tile if args.tiles else f"{kernels._STATS_ROWS}x{kernels._STATS_COLS}"
        tiles = [dict(zip(("BR", "BC"), (int(x) for x in tile.split("x"))))
                 for tile in (pass_tile, apply_tile, full_tile, stats_tile)]
        runs = {
            "stats": (kernels._stats_kernel, {**tiles[3], "ITERATIONS": kernels._STATS_STRIP}, stats_tile),
            "update_sq": (kernels._update_sq_kernel, {**tiles[0], "P": 16}, pass_tile),
            "apply, no momentum": (kernels._apply_kernel, {**tiles[1], **apply}, apply_tile),
            "apply, full momentum": (kernels._apply_kernel,
                                     {**tiles[2], **apply, "FULL_MOMENTUM": True, "MOMENTUM_BF16": True}, full_tile),
            "apply, subspace momentum": (kernels._apply_kernel, {**tiles[1], **apply, "SUBSPACE": True}, apply_tile),
        }
        for name, (fn, constants, tile) in runs.items():
            print(json.dumps({"kernel": name, "tile": tile, "warps": args.warps, "arch": args.arch,
                              **resources(fn, constants, args.warps, args.arch)}))
    for name, fn, constants in [
            ("scalars", kernels._scalar_kernel, {"BETA2_DECAY": True, "B": 1024, "INTERPRETED": False}),
            ("factors", kernels._factor_kernel, {"FR": kernels._FACTOR_ROWS, "FBR": kernels._FACTOR_ROW_BLOCK,
                                                 "FC": kernels._FACTOR_COLS, "FBC": kernels._FACTOR_COL_BLOCK}),
            ("subspace momentum", kernels._momentum_kernel, {"BR": kernels._MOMENTUM_ROWS,
                                                             "BK": kernels._MOMENTUM_RANKS, "P": 16,
                                                             "MOMENTUM_BF16": True}),
            ("vector, full momentum", kernels._vector_kernel, {"BLOCK": kernels._VECTOR_BLOCK, "BETA2_DECAY": False,
                                                               "HAS_MOMENTUM": True, "PARAM_BF16": True,
                                                               "MOMENTUM_BF16": True, "INTERPRETED": False})]:
        print(json.dumps({"kernel": name, "warps": args.warps, "arch": args.arch,
                          **resources(fn, constants, args.warps, args.arch)}))
    ce = {"VOCAB": 65536, "HAS_GRAD": True, "BLOCK": ce_triton._BLOCK}
    ce_signature = {"logits_ptr": "*bf16", "row_stride": "i32", "targets_ptr": "*i64", "scale_ptr": "*fp32",
                    "loss_ptr": "*fp32", "ignore_index": "i32", **{name: "constexpr" for name in ce}}
    print(json.dumps({"kernel": "cross-entropy", "warps": ce_triton._WARPS, "arch": args.arch,
                      **resources(ce_triton._ce_kernel, ce, ce_triton._WARPS, args.arch, ce_signature)}))


if __name__ == "__main__":
    main()
