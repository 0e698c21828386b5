"""Where each layer application of a recurrent-depth model keeps what backward needs: on the device (keep), nowhere but
its input (recompute: activation checkpointing), the matrix products' and attention's outputs only (selective
recomputation), or in pinned host memory (offload), per prelude layer, coda layer and unrolled core step.

A `RecomputeSet` names the applications of each placement but keep. Core steps are counted among the steps that build
a graph, from the first one: with `backprop_depth` k and a depth n >= k, steps 0..k-1 are the last k steps of the
loop; the earlier n - k steps run under `no_grad` and keep nothing anyway. The core layers are shared by every step,
so their per-step placement is the model's `recompute_core_steps` mapping (graph step -> the function its core layers
run under), read in the depth loop.

Transformers switches checkpointing on for every layer when training starts (`activation_checkpointing=True`);
`RecomputeCallback` then narrows it to the set, before the first step: each placed layer's checkpoint function
(`_gradient_checkpointing_func`) becomes full checkpointing (the function transformers enabled),
`offload.selective_checkpoint`, or an `offload.OffloadedForward` that runs the layer under `OffloadActivations` (one
context per forward of the model).
`selective=True` is the probes' form: every recomputed application above recomputes selectively; the plan names its
selective applications in `selective_recompute` instead.
"""

from dataclasses import dataclass, field

from transformers import TrainerCallback

from hf_recurrent.presets import is_recurrent
from trainer_ext.memory.offload import MIN_OFFLOAD_BYTES, OffloadedForward, compiled_selective_checkpoint, \
    selective_checkpoint

# Named sets the memory probes and the command line use, for a model with P prelude, C coda layers and G graph steps.
NAMED_SETS = ("all", "none", "prelude_coda", "core", "half_core")
KEEP, RECOMPUTE, SELECTIVE, OFFLOAD = "keep", "recompute", "selective", "offload"
PLACEMENTS = (KEEP, RECOMPUTE, SELECTIVE, OFFLOAD)
SECTIONS = ("prelude", "core_steps", "coda")


@dataclass(frozen=True)
class Applications:
    """Layer applications by section: prelude layers, graph-building core steps, coda layers (indices)."""

    prelude: tuple[int, ...] = ()
    core_steps: tuple[int, ...] = ()
    coda: tuple[int, ...] = ()

    def __post_init__(self):
        for name in SECTIONS:
            object.__setattr__(self, name, tuple(sorted(int(i) for i in getattr(self, name))))

    def __bool__(self) -> bool:
        return bool(self.prelude or self.core_steps or self.coda)

    def to_dict(self) -> dict:
        return {name: list(getattr(self, name)) for name in SECTIONS}

    @classmethod
    def from_dict(cls, data: dict) -> "Applications":
        return cls(*(tuple(data.get(name, ())) for name in SECTIONS))

    def describe(self) -> str:
        return ", ".join(f"{label} {_ranges(chosen)}" for label, chosen in
                         (("prelude", self.prelude), ("core steps", self.core_steps), ("coda", self.coda)) if chosen)


@dataclass(frozen=True)
class RecomputeSet:
    prelude: tuple[int, ...] = ()  # recomputed in full (selectively where `selective`)
    core_steps: tuple[int, ...] = ()
    coda: tuple[int, ...] = ()
    selective: bool = False  # the probes' form: the applications above recompute selectively
    selective_recompute: Applications = field(default_factory=Applications)
    offload: Applications = field(default_factory=Applications)

    def __post_init__(self):
        seen = {}
        for kind, group in ((RECOMPUTE, self.recomputed), (SELECTIVE, self.selective_recompute),
                            (OFFLOAD, self.offload)):
            for section in SECTIONS:
                for index in getattr(group, section):
                    if seen.setdefault((section, index), kind) != kind:
                        raise ValueError(f"{section} {index} is placed twice ({seen[(section, index)]} and {kind}); "
                                         "give each layer application one placement.")

    @property
    def recomputed(self) -> Applications:
        return Applications(self.prelude, self.core_steps, self.coda)

    @property
    def empty(self) -> bool:
        """Every application keeps its activations on the device."""
        return not (self.recomputed or self.selective_recompute or self.offload)

    def placement(self, section: str, index: int) -> str:
        """keep, recompute, selective or offload: where application `index` of `section` keeps what backward needs."""
        if index in getattr(self.recomputed, section):
            return SELECTIVE if self.selective else RECOMPUTE
        if index in getattr(self.selective_recompute, section):
            return SELECTIVE
        return OFFLOAD if index in getattr(self.offload, section) else KEEP

    @classmethod
    def named(cls, name: str, config, graph_steps: int) -> "RecomputeSet":
        """`config`: anything with `n_prelude_layers` and `n_coda_layers` (a model config, a ModelShape).
        `all`: every layer application; `none`; `prelude_coda`: the unique layers only (core steps keep);
        `core`: the core steps only; `half_core`: the later half of the core steps (rounded up) only."""
        prelude, coda = tuple(range(config.n_prelude_layers)), tuple(range(config.n_coda_layers))
        steps = tuple(range(graph_steps))
        sets = {"all": (prelude, steps, coda), "none": ((), (), ()), "prelude_coda": (prelude, (), coda),
                "core": ((), steps, ()), "half_core": ((), steps[graph_steps // 2:], ())}
        if name not in sets:
            raise ValueError(f"Unknown recompute set {name!r}; choose one of {list(NAMED_SETS)}.")
        return cls(*sets[name])

    def to_dict(self) -> dict:
        """The recomputed lists as before (what older readers and the probes' fit read), the other placements under
        their own keys where there are any."""
        return {**self.recomputed.to_dict(), **({"selective": True} if self.selective else {}),
                **{key: group.to_dict() for key, group in (("selective_recompute", self.selective_recompute),
                                                           ("offload", self.offload)) if group}}

    @classmethod
    def from_dict(cls, data: dict) -> "RecomputeSet":
        """A set written by `to_dict`, this version's or an older one's (recompute lists only)."""
        try:
            return cls(*(tuple(data.get(name, ())) for name in SECTIONS), bool(data.get("selective", False)),
                       Applications.from_dict(data.get("selective_recompute", {})),
                       Applications.from_dict(data.get("offload", {})))
        except (TypeError, AttributeError) as error:
            raise ValueError(f"A recompute set must map {list(SECTIONS)} (and optionally selective_recompute, "
                             f"offload) to lists of indices; got {data!r} ({error}).") from error

    def describe(self) -> str:
        parts = [f"{text} {group.describe()}" for text, group in (
            ("recompute selectively" if self.selective else "recompute", self.recomputed),
            ("recompute selectively", self.selective_recompute), ("offload", self.offload)) if group]
        return "; ".join(parts) if parts else "nothing recomputed"

    def apply(self, model, max_host_bytes: int | None = None,
              offload_min_bytes: int = MIN_OFFLOAD_BYTES) -> None:
        """Set the checkpointing flag and function of each layer of `model` (a RecurrentDepthForCausalLM, or a wrapper
        of one) and its `recompute_core_steps`. Checkpointing must have been enabled on the model first (the Trainer
        does it when `activation_checkpointing` is on), so that each layer has its checkpoint function. Offloaded
        applications share one `OffloadActivations` per forward of the model, holding at most `max_host_bytes`."""
        base = _base_model(model)
        layers = (*base.prelude, *base.core, *base.coda)
        for layer in layers:
            if not hasattr(layer, "_full_checkpointing_func"):  # the function checkpointing was enabled with
                layer._full_checkpointing_func = getattr(layer, "_gradient_checkpointing_func", None)
        handle = getattr(base, "_offload_renewal", None)
        if handle is not None:
            handle.remove()
            base._offload_renewal = None
        offloaded = None
        if self.offload:
            # past the host memory, an application is recomputed (`OffloadedForward`): every layer's full function
            full = next((layer._full_checkpointing_func for layer in layers if layer._full_checkpointing_func), None)
            offloaded = OffloadedForward(offload_min_bytes, max_host_bytes, recompute=full)
            base._offload_renewal = base.register_forward_pre_hook(offloaded.renew)

        def function_of(kind: str, layer):
            if kind == RECOMPUTE:
                if layer._full_checkpointing_func is None:
                    raise ValueError("Recomputation needs checkpointing enabled on the model first (trainer_ext."
                                     "compat.set_checkpointing(model, True), or --activation_checkpointing true).")
                return layer._full_checkpointing_func
            if kind == SELECTIVE:
                options = getattr(layer, "compile_options", None)  # set where the layer was compiled
                return selective_checkpoint if options is None else compiled_selective_checkpoint(**options)
            return offloaded

        for section in ("prelude", "coda"):
            for index, layer in enumerate(getattr(base, section)):
                kind = self.placement(section, index)
                layer.gradient_checkpointing = kind != KEEP
                if kind != KEEP:
                    layer._gradient_checkpointing_func = function_of(kind, layer)
        steps = set(self.core_steps) | set(self.selective_recompute.core_steps) | set(self.offload.core_steps)
        base.recompute_core_steps = {step: function_of(self.placement("core_steps", step), base.core[0])
                                     for step in sorted(steps)} if base.core else {}
        for layer in base.core:
            layer.gradient_checkpointing = False  # set per step from recompute_core_steps


def _ranges(indices) -> str:
    """'0-3,5' for (0, 1, 2, 3, 5)."""
    groups: list[list[int]] = []
    for index in sorted(indices):
        if groups and index == groups[-1][-1] + 1:
            groups[-1].append(index)
        else:
            groups.append([index])
    return ",".join(str(g[0]) if len(g) == 1 else f"{g[0]}-{g[-1]}" for g in groups)


def _base_model(model):
    model = getattr(model, "module", model)  # DDP / accelerate wrappers
    model = getattr(model, "_orig_mod", model)
    if not is_recurrent(getattr(model, "config", None)):
        raise ValueError(f"A per-layer recompute set needs a recurrent-depth model, got {type(model).__name__}.")
    return model.model


class RecomputeCallback(TrainerCallback):
    """Narrows the Trainer's all-layer checkpointing to `recompute` when training starts (after the Trainer has
    enabled checkpointing, before the first step); offloaded applications hold at most `max_host_bytes` of host
    memory per step."""

    def __init__(self, recompute: RecomputeSet, max_host_bytes: int | None = None):
        self.recompute, self.max_host_bytes = recompute, max_host_bytes

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            self.recompute.apply(model, self.max_host_bytes)
