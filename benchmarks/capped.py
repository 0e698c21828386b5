"""Run a module under an emulated memory cap (a 24 GiB card on a larger GPU):

    python -m benchmarks.capped 24 scripts.find_lr --preset recurrent-7b ...

`torch.cuda.set_per_process_memory_fraction(cap / total)` is set before anything is allocated; the module then runs
as `__main__` with the remaining arguments, and its exit code is this command's. Without CUDA the cap is a no-op.
"""

import runpy
import sys


def set_memory_cap(cap_gib: float) -> None:
    """Cap this process's CUDA allocations at `cap_gib` GiB of its device (at most all of it): device 0, or under
    torchrun / accelerate launch the process's own, LOCAL_RANK."""
    import os

    import torch

    if torch.cuda.is_available():
        device = int(os.environ.get("LOCAL_RANK", "0"))
        total = torch.cuda.get_device_properties(device).total_memory
        torch.cuda.set_per_process_memory_fraction(min(cap_gib * 2**30 / total, 1.0), device)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        sys.exit("usage: python -m benchmarks.capped CAP_GIB MODULE [ARGS...]")
    try:
        cap = float(argv[0])
    except ValueError:
        sys.exit(f"benchmarks.capped: CAP_GIB must be a number of GiB, e.g. 24 (got {argv[0]!r})")
    set_memory_cap(cap)
    sys.argv = [argv[1], *argv[2:]]
    runpy.run_module(argv[1], run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
