"""The device a plan is made for: its bf16 matmul rate, its host-device bandwidth and its memory.

A profile is a card's datasheet figures (`SPEC_PROFILES`: the RTX 3090 and 4090), measured on this machine once
(`measured_profile`: a few seconds, then read from a cache file), or given as a JSON file of the same fields. The
calibration's step-time model is its own device's (an H200): a profile scales every step-time coefficient by the
calibration device's measured matmul rate over the profile's (`for_device`), so a plan for a 3090 predicts a 3090's
tokens/s on any machine. Two things this leaves out: the parts of a step that are not matrix products (the optimizer,
norms, launches) follow memory bandwidth and latency rather than the matmul rate, and a datasheet rate is an upper
bound that a card's own matmuls reach only in part. A calibration measured on the card itself
(`hf-recurrent-plan-memory --calibrate`) carries neither approximation. The host-device bandwidth prices activation
offload to pinned host memory (`placement.py`): copies that do not hide under a layer's compute stall it.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import re
import statistics
import time
from dataclasses import asdict, dataclass

from trainer_ext.devices import synchronize
from trainer_ext.memory.estimator import GIB, Calibration
from trainer_ext.memory.placement import OFFLOAD_PLACEMENTS

logger = logging.getLogger(__name__)

MEASURE = "measure"
TRAINING_PROFILE_HELP = (
    "The card the memory plan is made for: rtx3090, rtx4090 (datasheet), measure (this CUDA device's, measured once "
    "and cached) or a profile JSON file. Default: with --memory_placements all, this device's measured profile where "
    "it is not the calibration's card (offload is priced at its compute and bandwidth); else the calibration's card.")
PROFILE_FIELDS = ("name", "matmul_flops", "host_to_device_bytes_per_second", "device_to_host_bytes_per_second",
                  "memory_gib", "source")
MATMUL_SIZE = 8192
COPY_BYTES = 256 * 2**20


@dataclass(frozen=True)
class DeviceProfile:
    name: str  # as torch.cuda.get_device_name reports it
    matmul_flops: float  # dense bf16 matrix products, fp32 accumulation, FLOP/s
    host_to_device_bytes_per_second: float  # pinned host memory to the device
    device_to_host_bytes_per_second: float
    memory_gib: float  # the card's memory: the planner's default cap
    source: str  # where the figures come from

    @property
    def host_device_bytes_per_second(self) -> float:
        """The slower direction: an activation moved out in forward comes back in backward."""
        return min(self.host_to_device_bytes_per_second, self.device_to_host_bytes_per_second)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict, source: str) -> DeviceProfile:
        try:
            values = {name: data[name] for name in PROFILE_FIELDS}
            for name in PROFILE_FIELDS[1:5]:
                values[name] = float(values[name])
                if not values[name] > 0:
                    raise ValueError(f"{name} must be > 0")
            return cls(**values)
        except (KeyError, TypeError, ValueError) as error:
            raise ValueError(f"{source} is not a device profile ({error}): it needs {list(PROFILE_FIELDS)}, FLOP/s, "
                             "bytes/s and GiB; `--device_profile measure` on the card writes one.") from error

    def describe(self) -> str:
        return (f"{self.name} ({self.source}: {self.matmul_flops / 1e12:.1f} TFLOP/s bf16, "
                f"{self.host_device_bytes_per_second / 1e9:.1f} GB/s host-device, {self.memory_gib:g} GiB)")


# Datasheet figures. Dense bf16 tensor rate with fp32 accumulation (what torch's bf16 matmul uses), the sparse rate
# being twice that: NVIDIA Ampere GA102 GPU Architecture whitepaper, RTX 3090, "Peak BF16 Tensor TFLOPS with FP32
# Accumulate 71/142"; NVIDIA Ada GPU Architecture whitepaper, RTX 4090, 165.2/330.4. Memory: 24 GB GDDR6X on both
# (NVIDIA's product pages); the driver reports a little less, and a desktop on the card takes more (training plans
# against what is free when it starts). Host link: PCIe 4.0 x16 on both, 16 GT/s per lane with 128b/130b encoding
# (PCI-SIG, PCI Express Base Specification 4.0) = 31.5 GB/s each way; pinned copies measure about 25 GB/s.
PCIE4_X16_BYTES_PER_SECOND = 16e9 * 16 * 128 / 130 / 8
SPEC_PROFILES = {
    "rtx3090": DeviceProfile("NVIDIA GeForce RTX 3090", 71e12, PCIE4_X16_BYTES_PER_SECOND, PCIE4_X16_BYTES_PER_SECOND,
                             24.0, "datasheet"),
    "rtx4090": DeviceProfile("NVIDIA GeForce RTX 4090", 165.2e12, PCIE4_X16_BYTES_PER_SECOND,
                             PCIE4_X16_BYTES_PER_SECOND, 24.0, "datasheet"),
}
# The measured bf16 matmul rate of the device a calibration's step times come from, by its `device_name`. The
# committed calibration's probes ran on H200 machines on 2026-12-02; the peer call that trained its plans that day
# measured 665.1 TFLOP/s (BENCHMARKS.md, "matmul peak"; 654.7-669.7 on the H200 machines of 2026-12-02 and 03, 776-794
# on earlier days). A calibration may carry its own figure as `matmul_flops`.
CALIBRATION_DEVICE_MATMUL_FLOPS = {"NVIDIA H200": 665.1e12}


# -- measuring


def measure_matmul_flops(device="cuda", size: int = MATMUL_SIZE, samples: int = 20, per_sample: int = 10,
                         warmup_seconds: float = 2.0) -> float:
    """The bf16 matmul rate of `device`, FLOP/s: the median of `samples` timings of `per_sample` size^3 products,
    after `warmup_seconds` of products (the clocks ramp up from idle) and 3 samples more."""
    import torch

    a, b = (torch.randn(size, size, dtype=torch.bfloat16, device=device) for _ in range(2))
    synchronize(device)
    warm_until = time.perf_counter() + warmup_seconds
    while time.perf_counter() < warm_until:
        a @ b
        synchronize(device)
    seconds = []
    for _ in range(samples + 3):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(per_sample):
            a @ b
        synchronize(device)
        seconds.append((time.perf_counter() - start) / per_sample)
    return 2 * size**3 / statistics.median(seconds[3:])


def measure_copy_rates(device="cuda", num_bytes: int = COPY_BYTES, repeats: int = 5) -> tuple[float, float]:
    """(host to device, device to host) bytes/s of copies between pinned host memory and `device`: medians."""
    import torch

    try:
        host = torch.empty(num_bytes, dtype=torch.uint8).pin_memory()
    except RuntimeError as error:
        raise ValueError(f"--device_profile measure: {num_bytes / 2**20:.0f} MiB of pinned host memory could not be "
                         f"allocated ({error}); WSL2 limits pinned memory. Give the profile as a file "
                         "(--device_profile PATH.json) or pick a spec profile.") from error
    on_device = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    rates = []
    for source, target in ((host, on_device), (on_device, host)):
        seconds = []
        for _ in range(repeats + 2):  # the first 2 warm up
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            target.copy_(source, non_blocking=True)
            torch.cuda.synchronize(device)
            seconds.append(time.perf_counter() - start)
        rates.append(num_bytes / statistics.median(seconds[2:]))
    return rates[0], rates[1]


def measure_profile(device="cuda") -> DeviceProfile:
    """This machine's profile of CUDA `device`, measured now (a few seconds)."""
    import torch

    properties = torch.cuda.get_device_properties(device)
    flops = measure_matmul_flops(device)
    to_device, to_host = measure_copy_rates(device)
    torch.cuda.empty_cache()  # what the measurement reserved goes back before anything is planned
    return DeviceProfile(properties.name, flops, to_device, to_host, round(properties.total_memory / GIB, 2),
                         f"measured {datetime.date.today().isoformat()}")


def _slug(name: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", name.lower()).strip("_")


def cache_path(device_name: str, calibration_path: str | None = None) -> str:
    """Where a measured profile of `device_name` is kept (delete it to measure again): next to a calibration of the
    user's own (`--calibration`), else in the user's cache folder (XDG_CACHE_HOME, else ~/.cache)."""
    folder = os.path.dirname(os.path.abspath(calibration_path)) if calibration_path else os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "hf-recurrent")
    return os.path.join(folder, f"device_profile_{_slug(device_name)}.json")


def load_profile(path: str) -> DeviceProfile:
    """A profile file (written by `measured_profile`, or by hand), or ValueError naming the file and the fix."""
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"--device_profile {path} does not read as a JSON device profile ({error}); give one of "
                         f"{[*SPEC_PROFILES, MEASURE]} or a profile file.") from error
    return DeviceProfile.from_dict(data if isinstance(data, dict) else {}, f"--device_profile {path}")


def measured_profile(calibration_path: str | None = None, device="cuda") -> tuple[DeviceProfile, str]:
    """(this machine's profile, its cache file): read from the cache where it holds this device's, else measured
    and written there."""
    import torch

    if not torch.cuda.is_available():
        raise ValueError("--device_profile measure needs a CUDA device; on this machine pick a spec profile "
                         f"({', '.join(SPEC_PROFILES)}) or give a profile file measured on the card "
                         "(--device_profile PATH.json).")
    path = cache_path(torch.cuda.get_device_name(device), calibration_path)
    if os.path.isfile(path):
        return load_profile(path), path
    profile = measure_profile(device)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(profile.to_dict(), f, indent=1)
        f.write("\n")
    return profile, path


def check_profile_value(value: str | None, flag: str = "--device_profile") -> None:
    """ValueError naming `flag` unless `value` is unset, a spec name, `measure` or an existing file."""
    if value and value.lower() not in SPEC_PROFILES and value != MEASURE and not os.path.isfile(value):
        raise ValueError(f"{flag} {value!r} is neither a known card ({', '.join(SPEC_PROFILES)}), '{MEASURE}' (this "
                         "machine's CUDA device) nor a profile file.")


def resolve_device_profile(value: str | None, calibration_path: str | None = None) -> DeviceProfile | None:
    """`--device_profile`: None (the calibration's device), a spec name, `measure`, or a profile file."""
    check_profile_value(value)
    if not value:
        return None
    if value.lower() in SPEC_PROFILES:
        return SPEC_PROFILES[value.lower()]
    return measured_profile(calibration_path)[0] if value == MEASURE else load_profile(value)


def training_profile(value: str | None, placements: str, calibration: Calibration,
                     calibration_path: str | None = None) -> DeviceProfile | None:
    """The card a training's plan is made for (TRAINING_PROFILE_HELP): `value` as `--device_profile` takes it; unset,
    where the plan may offload (`--memory_placements all`), this CUDA device's measured profile unless it is the
    calibration's card (keep, recompute and selective alone: a profile scales every step time alike and changes no
    choice). A measurement that fails (WSL2 limits pinned memory) is logged and the plan made at the calibration
    card's speed."""
    if value:
        return resolve_device_profile(value, calibration_path)
    import torch

    if placements != OFFLOAD_PLACEMENTS or not torch.cuda.is_available() or (
            torch.cuda.get_device_name() == calibration.info.get("device_name")):
        return None
    try:
        return measured_profile(calibration_path)[0]
    except (RuntimeError, ValueError) as error:
        logger.warning("--memory_placements %s: this card's profile could not be measured (%s); the plan prices "
                       "offload at the calibration card's speed. Give --memory_device_profile (rtx3090, rtx4090 or "
                       "a profile file) to plan for this card.", placements, error)
        return None


# -- scaling the calibration's step times


def reference_matmul_flops(calibration: Calibration, calibration_path: str | None = None) -> float:
    """The measured matmul rate of the device the calibration's step times come from, or ValueError with the fix."""
    name = calibration.info.get("device_name") or "an unnamed device"
    if calibration.info.get("matmul_flops"):
        return float(calibration.info["matmul_flops"])
    if name in CALIBRATION_DEVICE_MATMUL_FLOPS:
        return CALIBRATION_DEVICE_MATMUL_FLOPS[name]
    cached = cache_path(name, calibration_path)
    if os.path.isfile(cached):
        return load_profile(cached).matmul_flops
    raise ValueError(f"--device_profile: the calibration's step times were measured on {name}, whose matmul rate is "
                     f"not known. Measure it on that card (--device_profile measure with the same --calibration "
                     "writes it next to the calibration), or leave --device_profile unset to plan at that card's "
                     "speed.")


def for_device(calibration: Calibration, profile: DeviceProfile,
               calibration_path: str | None = None) -> tuple[Calibration, float]:
    """(the calibration with its step times scaled to `profile`'s matmul rate, the factor); the memory terms as
    they were."""
    factor = reference_matmul_flops(calibration, calibration_path) / profile.matmul_flops
    families = {name: fit.scaled(factor) for name, fit in calibration.families.items()}
    return Calibration(families, {**calibration.info, "device_profile": profile.to_dict()}), factor
