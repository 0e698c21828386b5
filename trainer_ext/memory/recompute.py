"""Which layer applications of a recurrent-depth model keep their activations for backward and which are recomputed
(activation checkpointing, per layer and per unrolled core step).

A `RecomputeSet` names the recomputed prelude layers, coda layers and core steps. Core steps are counted among the
steps that build a graph, from the first one: with `backprop_depth` k and a depth n >= k, steps 0..k-1 are the last
k steps of the loop; the earlier n - k steps run under `no_grad` and keep nothing anyway. The core layers are shared
by every step, so their per-step choice is the model's `recompute_core_steps` attribute, read in the depth loop.

Transformers switches checkpointing on for every layer when training starts (`activation_checkpointing=True`);
`RecomputeCallback` then narrows it to the set, before the first step. A `selective` set recomputes its layer
applications selectively (`offload.selective_checkpoint`: the matrix products' and attention's outputs are kept, the
cheap ops recomputed); the memory plan does not choose it yet (its probes: `memory_probe --selective_probes`).
"""

from dataclasses import dataclass

from transformers import TrainerCallback

from hf_recurrent.presets import is_recurrent
from trainer_ext.memory.offload import selective_checkpoint

# Named sets the memory probes and the command line use, for a model with P prelude, C coda layers and G graph steps.
NAMED_SETS = ("all", "none", "prelude_coda", "core", "half_core")


@dataclass(frozen=True)
class RecomputeSet:
    prelude: tuple[int, ...] = ()
    core_steps: tuple[int, ...] = ()
    coda: tuple[int, ...] = ()
    selective: bool = False  # the chosen applications recompute selectively

    @property
    def empty(self) -> bool:
        return not (self.prelude or self.core_steps or self.coda)

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
        return {"prelude": list(self.prelude), "core_steps": list(self.core_steps), "coda": list(self.coda),
                **({"selective": True} if self.selective else {})}

    @classmethod
    def from_dict(cls, data: dict) -> "RecomputeSet":
        return cls(tuple(data.get("prelude", ())), tuple(data.get("core_steps", ())), tuple(data.get("coda", ())),
                   bool(data.get("selective", False)))

    def describe(self) -> str:
        parts = [f"{name} {_ranges(chosen)}" for name, chosen in
                 (("prelude", self.prelude), ("core steps", self.core_steps), ("coda", self.coda)) if chosen]
        if not parts:
            return "nothing recomputed"
        return ("recompute selectively " if self.selective else "recompute ") + ", ".join(parts)

    def apply(self, model) -> None:
        """Set the checkpointing flag of each layer of `model` (a RecurrentDepthForCausalLM, or a wrapper of one)
        and its `recompute_core_steps`. Checkpointing must have been enabled on the model first (the Trainer does
        it when `activation_checkpointing` is on), so that each layer has its checkpoint function."""
        base = _base_model(model)
        for section, chosen in (("prelude", self.prelude), ("coda", self.coda)):
            for index, layer in enumerate(getattr(base, section)):
                layer.gradient_checkpointing = index in chosen
        base.recompute_core_steps = frozenset(self.core_steps)
        for layer in base.core:
            layer.gradient_checkpointing = False  # set per step from recompute_core_steps
        for layer in (*base.prelude, *base.core, *base.coda):
            current = getattr(layer, "_gradient_checkpointing_func", None)
            if current is not selective_checkpoint:  # the function checkpointing was enabled with
                layer._full_checkpointing_func = current
            wanted = selective_checkpoint if self.selective else getattr(layer, "_full_checkpointing_func", None)
            if wanted is not None and wanted is not current:  # a plain set after a plain one changes nothing
                layer._gradient_checkpointing_func = wanted


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
    enabled checkpointing, before the first step)."""

    def __init__(self, recompute: RecomputeSet):
        self.recompute = recompute

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is not None:
            self.recompute.apply(model)
