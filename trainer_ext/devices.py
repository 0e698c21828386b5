"""The one reading of `--device auto` and `--dtype auto` shared by every entry point, and whether Triton (the fused
kernels' compiler, on Linux x86-64 installs) is there."""

import functools
import importlib.util

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
