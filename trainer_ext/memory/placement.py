"""The placement program: for one batch size, where each prelude layer, coda layer and graph-building core step keeps
what its backward needs (keep, recompute, selective recomputation, offload to pinned host memory), for the smallest
predicted step time under the device-memory budget and the host-memory bound. One binary variable per application
group and placement but keep (a core step is its core layers' applications together), at most one per group, solved
by `scipy.optimize.milp` (HiGHS); `plan.py` runs it for each batch size.

Per layer application of N tokens (K, R, S bytes per token):

    keep:       K N on the device, where K = the calibrated kept-activation coefficients (kept_intermediate x I +
                kept_hidden x H, the compiled ones with torch.compile); nothing added to the step time.
    recompute:  R N (R = recomputed_hidden x H, the layer's input; the compiled one with torch.compile); one more
                forward: the calibrated recompute terms.
    selective:  min(K, R + S) N, where S = 2 bytes x (q + k + v + attention output + o_proj + gate + up + down
                outputs) = 2 (2 q_dim + 2 kv_dim + 2 H + 2 I): what `offload.selective_checkpoint` saves. Its time is
                SELECTIVE_TIME_FRACTION of a full recompute: norms, SiLU x up, rotary and residual adds run again,
                memory-bound elementwise work of about 2-4% of a layer's forward at a 3090's or an H200's ratio of
                matmul rate to memory bandwidth (bytes moved x rate / bandwidth over the layer's FLOPs), fused under
                torch.compile; 10% allows for their launches.
    offload:    nothing on the device but the offload window (two applications' K N, once if any application is
                offloaded: `OffloadActivations.layer_boundary` lets the copies of one application run while the next
                computes, and backward fetches one application ahead; the calibration's `offload` entry replaces two
                by what offloaded probes measured, `calibrate.fit_offload`), K N in host memory. Its copies run on
                their own stream and overlap compute: the time added is max(0, K N / device-to-host bandwidth -
                forward seconds) + max(0, K N / host-to-device bandwidth - backward seconds) of that application,
                with forward seconds = the calibrated per-FLOP time x its forward FLOPs and backward twice that, plus
                a fixed time (the hooks' launches, the copies' and events' host work: the calibration's
                `offload.seconds_per_application`, fitted by `calibrate.fit_offload` to offloaded probes beside
                their references; OFFLOAD_SECONDS_PER_APPLICATION without it).
                This cost form is what the runtime does: at each layer boundary the compute stream waits for the
                copies of the application before, so a copy stream slower than compute stalls it by the difference.

Selective recomputation is calibrated by probe pairs (`memory_probe --selective_probes`: each batch recomputed
selectively and in full in one process; `estimator.fit_selective`, run by the calibration's fit): the bytes a
selective application holds over a full recompute's input, as a multiple of S (the largest over the pairs, an upper
bound like the peaks), and the share of a full recompute's time it still costs (the median), kept in the
calibration's `selective` entry. Without pairs S and SELECTIVE_TIME_FRACTION stand as above. Offload's time is the
model above with its fixed time fitted (on H100s, 36 offloaded probes of recurrent-3.3b and 7b at batch 1-4 in three
sets, as a ratio to the same step recomputed: 0.36 ms an application; the sets within 3.2%, 6.3% and 4.7% at the
median, the third 5.5% out of sample before it joined; the largest errors at batch 1, where the host's work sets the
step); its window is measured (above).
By default the program chooses among keep, recompute and selective recomputation (`--memory_placements selective`,
PLACEMENT_CHOICES; `recompute` leaves selective out): selective is priced by probe pairs, and recurrent-3.3b's plan
with it (batch 3, most applications selective, against batch 2 with nothing recomputed) trained 7.5% faster on an
H100. Training offers offload only when asked for (`all`): by default it would pin many GiB of host memory on a
consumer card, which WSL2 may refuse mid-training, and no such card has run a plan with it yet; hf-recurrent-plan-memory
offers it by default when planning for another card (`--device_profile`), and prints the flags.
The bandwidths are the device profile's (`--device_profile`), or for the calibration's own device the datasheet link
in CALIBRATION_DEVICE_HOST_DEVICE_BYTES_PER_SECOND; where neither is known, offload is not offered. Host memory: the
pinned memory all processes of the host may use (`--memory_host_gib`, default HOST_FRACTION of the machine's RAM;
WSL2 gives its VM part of the RAM and limits what CUDA may pin), split evenly among a launch's processes.
"""

import os

import numpy as np

from trainer_ext.memory.estimator import GIB, MEMORY_FEATURES, TIME_FEATURES, Calibration, ModelShape
from trainer_ext.memory.recompute import KEEP, OFFLOAD, PLACEMENTS, RECOMPUTE, SECTIONS, SELECTIVE, Applications, \
    RecomputeSet

SELECTIVE_TIME_FRACTION = 0.1
OFFLOAD_SECONDS_PER_APPLICATION = 5e-4
OFFLOAD_WINDOW_APPLICATIONS = 2
HOST_FRACTION = 0.5
# What the program may choose: keep / recompute (calibrated), those and selective recomputation (calibrated from probe
# pairs where the calibration has them, else analytic), or all four (offload: an analytic time, a measured window).
PLACEMENT_CHOICES = ("recompute", "selective", "all")
DEFAULT_PLACEMENTS = "selective"
OFFLOAD_PLACEMENTS = "all"  # the choices that include offload
PLACEMENTS_HELP = ("The placements the memory plan may choose per layer application: recompute (keep or recompute), "
                   "selective (also selective recomputation: the products' and attention's outputs kept, the rest "
                   "run again; priced by the calibration's probe pairs; the default) or all (also offload to pinned "
                   "host memory, priced by an analytic time model and the device memory offloaded probes measured).")
PLAN_PLACEMENTS_HELP = (f"{PLACEMENTS_HELP} Default here: {OFFLOAD_PLACEMENTS} with --device_profile (the card's "
                        f"compute and link decide whether offload pays), else {DEFAULT_PLACEMENTS}, the training's.")
# PCIe 5.0 x16: 32 GT/s per lane, 128b/130b encoding (PCI-SIG, PCI Express Base Specification 5.0), each way.
CALIBRATION_DEVICE_HOST_DEVICE_BYTES_PER_SECOND = {"NVIDIA H200": 32e9 * 16 * 128 / 130 / 8}
HOST_HELP = ("Pinned host memory, GiB, that activation offload may use on this machine, all processes together "
             f"(default: {HOST_FRACTION:g} of its RAM). Under WSL2 the VM has only part of the machine's RAM and "
             "CUDA may pin less still (NVIDIA's CUDA on WSL notes): set it below what `free -g` shows there. "
             "0: no offload.")


def machine_ram_bytes() -> int:
    """This machine's (or WSL2 VM's) physical memory."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def check_host_gib(value, flag: str = "--memory_host_gib") -> None:
    if value is not None and not (isinstance(value, (int, float)) and value >= 0 and np.isfinite(value)):
        raise ValueError(f"{flag}={value!r} is not allowed; give the pinned host memory offload may use in GiB, a "
                         "number >= 0 (0: no offload), or leave it unset for "
                         f"{HOST_FRACTION:g} of the machine's RAM.")


def check_placements(value, flag: str = "--memory_placements") -> None:
    if value not in PLACEMENT_CHOICES:
        raise ValueError(f"{flag}={value!r} is not allowed; choose one of {list(PLACEMENT_CHOICES)}.")


def host_bytes_for(gib: float | None = None, num_processes: int = 1) -> int:
    """One process's host-memory bound: `gib` (None: HOST_FRACTION of the RAM) shared evenly by the processes of one
    host."""
    check_host_gib(gib)
    total = HOST_FRACTION * machine_ram_bytes() if gib is None else gib * GIB
    return int(total // max(num_processes, 1))


def host_device_rates(calibration: Calibration) -> tuple[float, float] | None:
    """(device to host, host to device) bytes/s of the card the plan's step times are for, or None if not known."""
    profile = calibration.info.get("device_profile")
    if profile:
        return profile["device_to_host_bytes_per_second"], profile["host_to_device_bytes_per_second"]
    rate = CALIBRATION_DEVICE_HOST_DEVICE_BYTES_PER_SECOND.get(calibration.info.get("device_name"))
    return (rate, rate) if rate else None


def bytes_per_token(shape: ModelShape, calibration: Calibration, compiled: bool) -> dict[str, float]:
    """Device bytes one layer application holds per token under each placement but offload (module docstring)."""
    c = dict(zip(MEMORY_FEATURES, calibration.fit_for(shape).memory_coefficients))
    prefix = "compiled_" if compiled else ""
    h, i = shape.hidden_size, shape.intermediate_size
    keep = c[f"{prefix}kept_intermediate"] * i + c[f"{prefix}kept_hidden"] * h
    recompute = c[f"{prefix}recomputed_hidden"] * h
    saved = calibration.info.get("selective", {}).get("saved_multiple", 1.0) * shape.selective_saved_bytes
    return {"keep": keep, RECOMPUTE: recompute, SELECTIVE: min(keep, recompute + saved)}


def _groups(shape: ModelShape) -> list[tuple[str, int, int]]:
    """(section, index, layer applications) of each choice: unique layers first (the program's tie-break prefers
    their class), then core steps from the last one."""
    groups = [("prelude", i, 1) for i in range(shape.n_prelude_layers)]
    groups += [("coda", i, 1) for i in range(shape.n_coda_layers)]
    return groups + [("core_steps", s, shape.n_core_layers) for s in reversed(range(shape.graph_steps))]


def recomputed_applications(shape: ModelShape, placement: RecomputeSet) -> int:
    """Applications recomputed in full (what the calibration's recompute terms count)."""
    chosen = placement.recomputed
    if placement.selective:
        return 0
    return len(chosen.prelude) + len(chosen.coda) + shape.n_core_layers * len(chosen.core_steps)


def _applications(shape: ModelShape, group: Applications) -> int:
    return len(group.prelude) + len(group.coda) + shape.n_core_layers * len(group.core_steps)


class Program:
    """The terms of one batch size's program (module docstring): per placement, the device bytes and seconds one
    layer application adds against keeping it, and the host bytes of an offloaded one."""

    def __init__(self, shape: ModelShape, calibration: Calibration, batch: int, seq_len: int, compiled: bool,
                 distill_topk: int = 0, choices: str = DEFAULT_PLACEMENTS):
        check_placements(choices)
        self.shape, self.calibration, self.batch, self.seq_len = shape, calibration, batch, seq_len
        self.compiled, self.distill_topk, self.choices = compiled, distill_topk, choices
        tokens = batch * seq_len
        per_token = bytes_per_token(shape, calibration, compiled)
        self.keep_bytes = per_token["keep"] * tokens
        self.peak0 = calibration.peak_bytes(shape, batch, seq_len, 0, distill_topk, compiled)
        self.time0 = calibration.step_seconds(shape, batch, seq_len, 0, compiled)
        recompute_time = calibration.step_seconds(shape, batch, seq_len, 1, compiled) - self.time0
        self.memory = {RECOMPUTE: calibration.peak_bytes(shape, batch, seq_len, 1, distill_topk, compiled) - self.peak0,
                       SELECTIVE: (per_token[SELECTIVE] - per_token["keep"]) * tokens, OFFLOAD: -self.keep_bytes}
        fraction = calibration.info.get("selective", {}).get("time_fraction", SELECTIVE_TIME_FRACTION)
        self.seconds = {RECOMPUTE: recompute_time, SELECTIVE: max(fraction, 0.0) * recompute_time}
        offload = calibration.info.get("offload", {})
        self.window_bytes = offload.get("window_applications", OFFLOAD_WINDOW_APPLICATIONS) * self.keep_bytes
        self.offload_fixed_seconds = offload.get("seconds_per_application", OFFLOAD_SECONDS_PER_APPLICATION)
        rates = host_device_rates(calibration)
        self.offload_seconds = None if rates is None else self._offload_seconds(*rates)

    def _offload_seconds(self, to_host: float, to_device: float) -> float:
        coefficients, factor = self.calibration.fit_for(self.shape).time_for(self.compiled, self.shape.params)
        per_flop = dict(zip(TIME_FEATURES, coefficients))["training_flops"] / 1e12 * factor
        forward = per_flop * self.batch * self.seq_len * self.shape.layer_flops(self.seq_len)
        return (max(0.0, self.keep_bytes / to_host - forward) + max(0.0, self.keep_bytes / to_device - 2 * forward)
                + self.offload_fixed_seconds)

    @property
    def placements(self) -> tuple[str, ...]:
        """The placements but keep the program may choose: `choices`, offload where the bandwidth is known."""
        if self.choices == "recompute":
            return (RECOMPUTE,)
        offload = self.choices == OFFLOAD_PLACEMENTS and self.offload_seconds is not None
        return (RECOMPUTE, SELECTIVE) + ((OFFLOAD,) if offload else ())

    def _counts(self, placement: RecomputeSet) -> tuple[int, int, int]:
        """(recomputed in full, selective, offloaded) applications of `placement`."""
        selective = _applications(self.shape, placement.selective_recompute) + (
            _applications(self.shape, placement.recomputed) if placement.selective else 0)
        return (recomputed_applications(self.shape, placement), selective,
                _applications(self.shape, placement.offload))

    def peak_bytes(self, placement: RecomputeSet) -> float:
        """The predicted peak device bytes of `placement` (no bandwidth needed)."""
        recomputed, selective, offloaded = self._counts(placement)
        peak = self.calibration.peak_bytes(self.shape, self.batch, self.seq_len, recomputed, self.distill_topk,
                                           self.compiled) + selective * self.memory[SELECTIVE]
        return peak + (offloaded * self.memory[OFFLOAD] + self.window_bytes if offloaded else 0.0)

    def evaluate(self, placement: RecomputeSet) -> tuple[float, float, float]:
        """(peak device bytes, step seconds, host bytes) of `placement`."""
        recomputed, selective, offloaded = self._counts(placement)
        seconds = self.calibration.step_seconds(self.shape, self.batch, self.seq_len, recomputed, self.compiled)
        seconds += selective * self.seconds[SELECTIVE]
        if offloaded:
            if self.offload_seconds is None:
                raise ValueError("Offload is planned only where the card's host-device bandwidth is known: give "
                                 "--device_profile (rtx3090, rtx4090, measure or a profile file).")
            seconds += offloaded * self.offload_seconds
        return self.peak_bytes(placement), seconds, offloaded * self.keep_bytes

    def solve(self, budget_bytes: float, host_bytes: float) -> RecomputeSet | None:
        """The fastest placement within `budget_bytes` of device and `host_bytes` of host memory, or None.

        The choices of one class of groups (the unique layers; the core steps) cost the same, so the program counts how
        many of each class take each placement (`_in_forward_order` lays them out): a choice per group made the
        solver search the groups' interchangeable orders (51 s for recurrent-3.3b with selective priced as measured)."""
        from scipy.optimize import Bounds, LinearConstraint, milp

        groups = _groups(self.shape)
        if not groups:
            return RecomputeSet() if self.peak0 <= budget_bytes else None
        options = [kind for kind in self.placements if kind != OFFLOAD or host_bytes >= self.keep_bytes]
        classes = {}  # (core step or unique layer, applications per group) -> indices of its groups
        for index, (section, _, count) in enumerate(groups):
            classes.setdefault((section == "core_steps", count), []).append(index)
        members = list(classes.values())
        n, k = len(members), len(options)
        apps = np.array([groups[m[0]][2] for m in members], dtype=float)
        sizes = np.array([len(m) for m in members], dtype=float)
        seconds = dict(self.seconds, **({OFFLOAD: self.offload_seconds} if OFFLOAD in options else {}))
        # Variables: y[c, p], how many groups of class c take placement p (column-major by placement), then z:
        # "anything offloaded". The tie-break prefers the placements' order, then unique layers before core steps.
        tie_break = 1e-9 * (np.arange(n)[None, :] + n * np.arange(1, k + 1)[:, None])
        cost = np.concatenate([(apps * seconds[kind] + tie_break[j]) for j, kind in enumerate(options)] + [[0.0]])
        memory = np.concatenate([apps * self.memory[kind] / GIB for kind in options] + [[
            self.window_bytes / GIB if OFFLOAD in options else 0.0]])
        one_each = np.hstack([np.tile(np.eye(n), k), np.zeros((n, 1))])
        rows = [LinearConstraint(memory[None, :], -np.inf, (budget_bytes - self.peak0) / GIB + 1e-9),
                LinearConstraint(one_each, 0, sizes)]
        if OFFLOAD in options:
            j = options.index(OFFLOAD)
            host = np.zeros(n * k + 1)
            host[j * n:(j + 1) * n] = apps * self.keep_bytes / GIB
            needs_window = np.hstack([np.zeros((n, j * n)), np.eye(n), np.zeros((n, (k - j - 1) * n)),
                                      -sizes[:, None]])
            rows += [LinearConstraint(host[None, :], -np.inf, host_bytes / GIB + 1e-9),
                     LinearConstraint(needs_window, -np.inf, 0)]
        upper = np.concatenate([np.tile(sizes, k), [1.0]])
        result = milp(cost, integrality=np.ones(n * k + 1), bounds=Bounds(0, upper), constraints=rows)
        if result.status != 0 or result.x is None:
            return None
        chosen = np.round(result.x[:-1]).reshape(k, n).astype(int)
        kinds = [KEEP] * len(groups)
        for c, indices in enumerate(members):
            taking = iter(indices)
            for j, kind in enumerate(options):
                for _ in range(chosen[j, c]):
                    kinds[next(taking)] = kind
        return _in_forward_order(groups, kinds)


def _in_forward_order(groups, kinds) -> RecomputeSet:
    """The placement with the chosen number of each kind among the unique layers (prelude then coda) and among the
    core steps, laid out in forward order: offloaded first (their copies have the longest until backward needs them
    back), then recomputed, selective, kept last (backward needs the last layers first). Applications of one kind of
    group cost the same, so the program's optimum is kept; the layout reads as ranges instead of the solver's pick."""
    order = (OFFLOAD, RECOMPUTE, SELECTIVE, KEEP)
    picked = {kind: {name: [] for name in SECTIONS} for kind in order}
    for sections in (("prelude", "coda"), ("core_steps",)):
        members = [(section, index, kind) for (section, index, _), kind in zip(groups, kinds) if section in sections]
        positions = sorted(((section, index) for section, index, _ in members),
                           key=lambda place: (sections.index(place[0]), place[1]))
        for (section, index), kind in zip(positions, sorted((kind for *_, kind in members), key=order.index)):
            picked[kind][section].append(index)
    group = {kind: Applications(*(tuple(picked[kind][name]) for name in SECTIONS)) for kind in order}
    recomputed = group[RECOMPUTE]
    return RecomputeSet(recomputed.prelude, recomputed.core_steps, recomputed.coda,
                        selective_recompute=group[SELECTIVE], offload=group[OFFLOAD])


def placement_table(shape: ModelShape, placement: RecomputeSet) -> dict[str, dict]:
    """Each placement's applications, keep included (the plan's JSON)."""
    table = {kind: {name: [] for name in SECTIONS} for kind in PLACEMENTS}
    counts = {"prelude": shape.n_prelude_layers, "core_steps": shape.graph_steps, "coda": shape.n_coda_layers}
    for section in SECTIONS:
        for index in range(counts[section]):
            table[placement.placement(section, index)][section].append(index)
    return table


def application_counts(shape: ModelShape, table: dict[str, dict]) -> dict[str, int]:
    """Layer applications of each placement in `table`."""
    return {kind: _applications(shape, Applications.from_dict(groups)) for kind, groups in table.items()}


def describe_table(table: dict[str, dict]) -> str:
    """'keep prelude 0, core steps 0-1; recompute prelude 1-15, coda 0-15; offload ...' (every placement used)."""
    parts = [f"{kind} {Applications.from_dict(table[kind]).describe()}" for kind in PLACEMENTS
             if Applications.from_dict(table[kind])]
    return "; ".join(parts) or "no layer applications"
