"""The one reading of `--device auto` and `--dtype auto` shared by every entry point, whether Triton (the fused
kernels' compiler, on Linux x86-64 installs) is there, how much memory a CUDA device has for this process, how
its caching allocator is set, and waiting for it (all of it, or one value on its way to the host)."""

import functools
import importlib.util
import os
from dataclasses import dataclass

import torch


def resolve_device(name: str) -> torch.device:
    """`auto`: CUDA when available, else the CPU; anything else as torch names it (cpu, cuda, cuda:1, ...)."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """`auto`: bf16 on CUDA, fp32 elsewhere (CPU bf16 matmuls are slow); otherwise the torch dtype of that name."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, name)


@functools.cache
def has_triton() -> bool:
    return importlib.util.find_spec("triton") is not None


def allocator_settings() -> str:
    """The CUDA caching allocator's settings from the environment (`PYTORCH_ALLOC_CONF`, formerly
    `PYTORCH_CUDA_ALLOC_CONF`), "" for the defaults. The memory calibration is fitted on the defaults: with
    `expandable_segments:True` the allocator holds less above its tensors (it fails on some WSL2 drivers)."""
    return os.environ.get("PYTORCH_ALLOC_CONF") or os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or ""


def synchronize(device: torch.device | str | None = None) -> None:
    """Wait for the work queued on a CUDA `device` (default: the current one, where CUDA is there), as a timer
    must; nothing to wait for elsewhere."""
    if device is None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    elif torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def to_host_later(value: torch.Tensor):
    """A function returning `value` on the host: on CUDA copied to pinned host memory behind the work queued so far,
    so that calling it waits for that work only, not for what is queued after this; elsewhere `value` itself."""
    if value.device.type != "cuda":
        return lambda: value
    host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
    host.copy_(value, non_blocking=True)
    ready = torch.cuda.Event()
    ready.record(torch.cuda.current_stream(value.device))

    def read() -> torch.Tensor:
        ready.synchronize()
        return host

    return read


@dataclass(frozen=True)
class DeviceMemory:
    """A CUDA device's memory as this process finds it, in bytes."""

    free: int  # what the driver reports free: other processes (a desktop under WSL2) and this one's context taken off
    held: int  # reserved by this process's caching allocator (weights already loaded, cached blocks)
    total: int  # the card's
    fraction_limit: int | None = None  # torch.cuda.set_per_process_memory_fraction's limit, where one is set

    @property
    def available(self) -> int:
        """What this process can fill: the free memory plus what it holds, within a per-process fraction."""
        available = self.free + self.held
        return min(available, self.fraction_limit) if self.fraction_limit is not None else available


def device_memory(device: torch.device | int | None = None) -> DeviceMemory:
    """The memory of CUDA `device` (default: the current one) now; RuntimeError where the driver cannot say."""
    index = device.index if isinstance(device, torch.device) else device
    free, total = torch.cuda.mem_get_info(index)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", None)  # torch >= 2.8 reports it
    fraction = fraction(index) if fraction is not None else 1.0
    return DeviceMemory(int(free), int(torch.cuda.memory_reserved(index)), int(total),
                        int(fraction * total) if 0.0 < fraction < 1.0 else None)
