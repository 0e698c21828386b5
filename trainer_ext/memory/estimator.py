"""Peak reserved memory and step time of a training step, calibrated from measured probes.

The estimate of one training configuration (a model shape, batch size, sequence length, the number of layer
applications that recompute their activations, the optimizer state, a cached teacher's top-k):

    peak = weights + optimizer state + processes' terms       (known: bytes per parameter, accountant, `processes`)
         + c . [1, N * kept * I, N * kept * H, N * recomputed * H, N * graph steps * adapter width, N * H,
                N * top-k, max(theta * V * H, N * (H + I)), H * I, min(N, 2 * chunk) * V, V * H, V * H * old]

with N = batch * sequence tokens, H / I / V the hidden, MLP and vocabulary sizes, `kept` / `recomputed` the layer
applications of the graph-building part of the loop that keep their activations / only their input. The eighth term
is the larger of two transients: the head's update at the start of backward (about V x H) and one layer's workspace
(about N x (H + I)). It also covers the gradients one process has at any moment: the in-backward update consumes each
as it is made, so no whole gradient exists (DDP's buckets, which do hold one, are a term of `processes`). The ninth,
one MLP weight matrix's worth of elements, is a batch-independent part that grows with the model's width (the update's
temporaries of one matrix). A cached teacher adds its top-k ids and log-probs of the batch (the seventh term); its
loss runs in the fused kernels as plain CE does. The loss holds two chunks' logits (`distill.losses.
default_chunk_size` positions each, bf16) once N has two, a chunk's made before the last one's are freed: the tenth
term (without it transformer-125m's one-chunk batch was over-predicted by 22%). V x H on its own, the eleventh, is the
head's constant part, which the eighth term's maximum had to carry (recurrent-125m's batch 32 was 20% over). The
twelfth is a correction, not a term of any plan: V x H times the bf16 copies of the head's gradient beyond the step's
own that a record's peak held (`probes.head_copies`; fitted at about 2 bytes an element). A
compiled step fuses elementwise work, so it keeps other buffers than an eager one: every term but N * H, H * I and the
correction has a coefficient of its own for compiled steps (the features' `compiled_` entries; an eager
configuration's are zero, and the other way round).

The coefficients c >= 0 and theta are fitted to the probes' peak reserved memory as an upper bound: a linear program
(`scipy.optimize.linprog`, HiGHS) minimises the largest relative over-prediction (`FIT_OBJECTIVES`: or the summed one,
in bytes or relative) subject to no probe being predicted under its measured peak, theta by a grid search. The
measured peak is reserved memory, whose part over the allocated bytes (the allocator's cache, 0.06-2.9 GiB in the
committed probes) moves by up to 0.9 GiB between neighbouring shapes: between and beyond the probed shapes nothing
bounds the cache, and the plan's margin is for that. The features carry the model's shape, so every preset of a
family shares them; the two families, our recurrent-depth model and a plain Transformer (transformers' Llama code,
other saved tensors), are fitted apart.

    step time = t . [1, N * training FLOPs / token, N * recompute FLOPs / token, training FLOPs / token,
                     layer applications, parameters]

FLOPs per token from `hf_recurrent.cost`'s per-layer count (forward, backward at twice the forward, a recomputed
layer one more forward); the per-token and per-application terms are the launch-bound part of small batches. Eager
and compiled steps have coefficients of their own, each fitted to its probes: an eager step launches every kernel
from Python and spends a fixed part of each step on it, which a compiled one does not (one factor over the eager
coefficients put 0.17 s of eager overhead into every compiled step of the 3.3b).

Every term is linear in the number of recomputed applications at a fixed batch size, which the planner's mixed-integer
program relies on (`placement.py`). `fit_calibration` turns probe records (`benchmarks/memory_probe.py`) into a
calibration; `trainer_ext/memory/calibration.json` is the committed one.
"""

import datetime
import json
import os
import statistics
from dataclasses import dataclass, replace

import numpy as np

from trainer_ext.distill.losses import default_chunk_size
from trainer_ext.memory.probes import PROBE_COMMAND, head_copies, measured, probe_recomputed, steady_step_seconds, \
    timed_depths, usable_probes

GIB = 2**30
CALIBRATION_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "calibration.json")
CALIBRATE_COMMAND = "hf-recurrent-plan-memory --calibrate probes.jsonl --calibration my_card.json"
_SHARED_FEATURES = ("constant", "kept_intermediate", "kept_hidden", "recomputed_hidden", "adapter", "unique_hidden",
                    "distill_topk", "transient", "weight_matrix", "loss_logits", "head", "head_copies")
_COMPILE_DEPENDENT = (0, 1, 2, 3, 4, 6, 7, 9, 10)  # the features whose compiled counterparts follow the shared ones
MEMORY_FEATURES = _SHARED_FEATURES + tuple(f"compiled_{_SHARED_FEATURES[i]}" for i in _COMPILE_DEPENDENT)
TIME_FEATURES = ("constant", "training_flops", "recompute_flops", "flops_per_token", "layer_applications",
                 "parameters")
FORMAT_VERSION = 6  # 5: the head's cast alone corrected; 4: no logits or head terms; 3: least squares, fewer terms
MIN_MEMORY_PROBES = len(MEMORY_FEATURES) - 1  # a family's fit: a probe per term (the head-copies correction is none)
MIN_COMPILED_TIME_PROBES = 2 * len(TIME_FEATURES)  # compiled probes that get coefficients of their own
# From this size up (recurrent-1b, not the 125M presets) a compiled step is bound by the device's work, below it by the
# host's kernel launches (recurrent-125m's batch 8 ran faster than its batch 4 on the H200): no one linear model
# follows both, so the compiled probes of models this large get coefficients of their own
# (`FamilyFit.large_compiled_time_coefficients`).
LARGE_MODEL_PARAMS = 5e8
_THETAS = tuple(round(0.01 * i, 2) for i in range(0, 801, 2))  # grid of the transient's V x H multiple
# What the memory fit minimises under its bound (`_upper_bound`): "bytes" (the probes of most memory, where plans for a
# card land, weigh most), "relative" (every probe alike), "minimax" (the default: the worst probe's relative error).
FIT_OBJECTIVES = ("bytes", "relative", "minimax")
DEFAULT_FIT_OBJECTIVE = "minimax"


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs to know about a model and its optimizer."""

    hidden_size: int
    intermediate_size: int
    vocab_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    n_prelude_layers: int
    n_core_layers: int
    n_coda_layers: int
    num_steps: int
    graph_steps: int
    adapter_width: int  # activations the input adapter keeps per token and graph step, in units of H
    params: int
    weight_bytes: int  # per rank, as `optimizer_state_bytes`
    optimizer_state_bytes: int
    # One rank of several processes (`processes.per_rank_shape`): what they add to its memory, named, in bytes.
    num_processes: int = 1
    sharding: str | None = None
    process_terms: tuple[tuple[str, int], ...] = ()
    head_copies: int = 0  # a record's extra V x H bf16 copies of the head's gradient (the last feature); never a plan

    @property
    def fixed_bytes(self) -> int:
        """What the step's peak holds whatever the batch: weights, optimizer state and the processes' terms."""
        return self.weight_bytes + self.optimizer_state_bytes + sum(size for _, size in self.process_terms)

    @classmethod
    def from_config(cls, config, optimizer_state_bytes: int, params: int | None = None, bytes_per_param: int = 2):
        from hf_recurrent.cost import graph_steps, parameter_counts

        params = parameter_counts(config).unique if params is None else params
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        if hasattr(config, "n_core_layers"):
            layers = (config.n_prelude_layers, config.n_core_layers, config.n_coda_layers, config.mean_recurrence,
                      graph_steps(config), 3 if config.injection == "concat" else 1)
        else:  # a plain Transformer: its layers count as prelude layers, with no core and no adapter
            layers = (config.num_hidden_layers, 0, 0, 0, 0, 0)
        return cls(config.hidden_size, config.intermediate_size, config.vocab_size, config.num_attention_heads,
                   config.num_key_value_heads, head_dim, *layers, params, params * bytes_per_param,
                   optimizer_state_bytes)

    @classmethod
    def from_record(cls, record: dict):
        from types import SimpleNamespace

        shape = cls.from_config(SimpleNamespace(**record["config"]), record["optimizer_state_bytes"], record["params"])
        return replace(shape, head_copies=head_copies(record))

    @property
    def graph_applications(self) -> int:
        """Layer applications that build a graph: prelude, coda and the core layers of each graph step."""
        return self.n_prelude_layers + self.n_coda_layers + self.n_core_layers * self.graph_steps

    @property
    def selective_saved_bytes(self) -> int:
        """S: the bytes per token of what selective recomputation saves of one layer application (the matrix
        products' and attention's outputs in bf16, `offload.selective_checkpoint`; `placement`'s docstring)."""
        q_dim, kv_dim = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return 2 * (2 * q_dim + 2 * kv_dim + 2 * self.hidden_size + 2 * self.intermediate_size)

    def layer_flops(self, seq_len: int) -> float:
        """Forward FLOPs per token of one layer application (as `hf_recurrent.cost`)."""
        q_dim, kv_dim = self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim
        return (2 * self.hidden_size * (2 * q_dim + 2 * kv_dim) + 6 * self.hidden_size * self.intermediate_size
                + 2 * q_dim * (seq_len + 1))


def memory_features(shape: ModelShape, batch_size: int, seq_len: int, recomputed: float, theta: float,
                    distill_topk: int = 0, compiled: bool = False) -> np.ndarray:
    """The memory features (GiB units) of a configuration with `recomputed` layer applications recomputed."""
    tokens, h, i, v = batch_size * seq_len, shape.hidden_size, shape.intermediate_size, shape.vocab_size
    kept = shape.graph_applications - recomputed
    logits = min(tokens, 2 * default_chunk_size(v, 2)) * v  # two chunks of the fused kernels' bf16 logits at most
    shared = np.array([GIB, tokens * kept * i, tokens * kept * h, tokens * recomputed * h,
                       tokens * shape.graph_steps * shape.adapter_width * h, tokens * h, tokens * distill_topk,
                       max(theta * v * h, tokens * (h + i)), h * i, logits, v * h, v * h * shape.head_copies],
                      dtype=float) / GIB
    dependent = list(_COMPILE_DEPENDENT)
    own = np.zeros(len(dependent))
    if compiled:  # the compiled coefficients carry these terms instead of the shared ones
        own, shared[dependent] = shared[dependent].copy(), 0.0
    return np.concatenate([shared, own])


def time_features(shape: ModelShape, batch_size: int, seq_len: int, recomputed: float) -> np.ndarray:
    """The step-time features of a configuration (FLOPs in units of 1e12, per-token FLOPs in units of 1e9)."""
    tokens, layer = batch_size * seq_len, shape.layer_flops(seq_len)
    adapter = 4 * shape.hidden_size ** 2 if shape.adapter_width == 3 else 0
    no_grad_steps = shape.num_steps - shape.graph_steps
    training = (3 * shape.graph_applications * layer + 3 * shape.graph_steps * adapter
                + no_grad_steps * (shape.n_core_layers * layer + adapter) + 6 * shape.hidden_size * shape.vocab_size)
    applications = shape.n_prelude_layers + shape.n_coda_layers + shape.n_core_layers * shape.num_steps
    return np.array([1.0, tokens * training / 1e12, tokens * recomputed * layer / 1e12, training / 1e9,
                     applications + recomputed, shape.params / 1e9], dtype=float)


def record_time_features(shape: ModelShape, record: dict) -> np.ndarray:
    """The time features of a probe record; of a training run's, their mean over the depths its timed steps sampled
    (`probes.timed_depths`; each step's features at its depth: the mean step time is the mean of the features')."""
    depths = timed_depths(record)
    if depths is None:
        return time_features(shape, record["batch_size"], record["seq_len"], probe_recomputed(record))
    rows = []
    for depth in depths:
        graph_steps = min(shape.graph_steps, depth)
        rows.append(time_features(replace(shape, num_steps=depth, graph_steps=graph_steps), record["batch_size"],
                                  record["seq_len"], probe_recomputed(record, graph_steps)))
    return np.mean(rows, axis=0)


def model_family(shape: "ModelShape") -> str:
    """The family whose coefficients estimate `shape`: our recurrent-depth model, or a plain Transformer
    (transformers' Llama code: other layers, other saved tensors)."""
    return "recurrent" if shape.n_core_layers else "transformer"


@dataclass
class FamilyFit:
    """The fitted coefficients of one model family."""

    memory_coefficients: list[float]
    theta: float
    time_coefficients: list[float]  # eager steps
    compile_factor: float  # the median compiled step time over the eager prediction: whether compiling pays
    # Compiled steps, fitted to the compiled probes; None (too few compiled probes, or a calibration written before
    # they were fitted apart): the eager coefficients times compile_factor.
    compiled_time_coefficients: list[float] | None = None
    # Compiled steps of models of LARGE_MODEL_PARAMS or more, fitted to their probes alone; None: too few of them (or
    # an older calibration), `compiled_time_coefficients` predict them too.
    large_compiled_time_coefficients: list[float] | None = None

    def time_for(self, compiled: bool, params: int = 0) -> tuple[list[float], float]:
        """(coefficients, factor) of the step time of a model of `params` parameters: t . features x factor."""
        if compiled and params >= LARGE_MODEL_PARAMS and self.large_compiled_time_coefficients is not None:
            return self.large_compiled_time_coefficients, 1.0
        if compiled and self.compiled_time_coefficients is not None:
            return self.compiled_time_coefficients, 1.0
        return self.time_coefficients, (self.compile_factor if compiled else 1.0)

    def scaled(self, factor: float) -> "FamilyFit":
        """The same fit with every step time multiplied by `factor` (another card's matmul rate)."""
        def times(coefficients):
            return None if coefficients is None else [c * factor for c in coefficients]
        return FamilyFit(self.memory_coefficients, self.theta, times(self.time_coefficients), self.compile_factor,
                         times(self.compiled_time_coefficients), times(self.large_compiled_time_coefficients))

    def to_dict(self) -> dict:
        return {"memory_coefficients": self.memory_coefficients, "transient_theta": self.theta,
                "time_coefficients": self.time_coefficients, "compile_factor": self.compile_factor,
                "compiled_time_coefficients": self.compiled_time_coefficients,
                "large_compiled_time_coefficients": self.large_compiled_time_coefficients}

    @classmethod
    def from_dict(cls, data: dict) -> "FamilyFit":
        memory, time = [float(c) for c in data["memory_coefficients"]], [float(c) for c in data["time_coefficients"]]
        compiled, large = ([float(c) for c in data[key]] if data.get(key) is not None else None
                           for key in ("compiled_time_coefficients", "large_compiled_time_coefficients"))
        if len(memory) != len(MEMORY_FEATURES) or any(
                coefficients is not None and len(coefficients) != len(TIME_FEATURES)
                for coefficients in (time, compiled, large)):
            raise ValueError("its coefficients do not match this version's features")
        return cls(memory, float(data["transient_theta"]), time, float(data["compile_factor"]), compiled, large)


@dataclass
class Calibration:
    families: dict[str, FamilyFit]  # by `model_family`
    info: dict

    def fit_for(self, shape: ModelShape) -> FamilyFit:
        family = model_family(shape)
        if family not in self.families:
            kind = "plain Transformer (transformer-*)" if family == "transformer" else "recurrent-depth (recurrent-*)"
            raise ValueError(f"The memory calibration has no probes of a {kind} model; add probes of such a preset "
                             f"and fit again with `{CALIBRATE_COMMAND}`, or leave the calibration unset for the "
                             "committed one.")
        return self.families[family]

    def peak_bytes(self, shape: ModelShape, batch_size: int, seq_len: int, recomputed: float,
                   distill_topk: int = 0, compiled: bool = False) -> float:
        """Predicted peak reserved memory in bytes."""
        fit = self.fit_for(shape)
        variable = memory_features(shape, batch_size, seq_len, recomputed, fit.theta, distill_topk, compiled)
        return shape.fixed_bytes + float(variable @ fit.memory_coefficients) * GIB

    def step_seconds(self, shape: ModelShape, batch_size: int, seq_len: int, recomputed: float,
                     compiled: bool = False) -> float:
        """Predicted steady-state seconds of one optimizer step."""
        return self._seconds(shape, time_features(shape, batch_size, seq_len, recomputed), compiled)

    def record_seconds(self, shape: ModelShape, record: dict) -> float:
        """Predicted steady-state seconds of a probe or training run's record (`record_time_features`)."""
        return self._seconds(shape, record_time_features(shape, record), bool(record.get("compile")))

    def _seconds(self, shape: ModelShape, features: np.ndarray, compiled: bool) -> float:
        coefficients, factor = self.fit_for(shape).time_for(compiled, shape.params)
        return float(features @ coefficients) * factor

    def compile_is_faster(self, shape: ModelShape) -> bool:
        return self.fit_for(shape).compile_factor < 1.0

    def to_dict(self) -> dict:
        return {"format_version": FORMAT_VERSION, **self.info, "memory_features": list(MEMORY_FEATURES),
                "time_features": list(TIME_FEATURES),
                "units": "memory: GiB per feature unit, peak = weights + optimizer state + sum; time: seconds",
                "families": {name: fit.to_dict() for name, fit in self.families.items()}}

    @classmethod
    def from_dict(cls, data: dict, source: str = "calibration") -> "Calibration":
        try:
            if data["format_version"] != FORMAT_VERSION:
                raise ValueError(f"format_version {data['format_version']!r}, expected {FORMAT_VERSION}")
            if (list(data["memory_features"]) != list(MEMORY_FEATURES)
                    or list(data["time_features"]) != list(TIME_FEATURES)):
                raise ValueError("its features are not this version's")
            families = {name: FamilyFit.from_dict(fit) for name, fit in data["families"].items()}
            info = {k: v for k, v in data.items()
                    if k not in ("format_version", "memory_features", "time_features", "units", "families")}
            return cls(families, info)
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            raise ValueError(f"{source} is not a memory calibration of this version ({error}); make one with "
                             f"`{CALIBRATE_COMMAND}` from probes of `{PROBE_COMMAND}`.") from error


def load_calibration(path: str | None = None) -> Calibration:
    """The calibration at `path` (default: the committed one), or ValueError naming the file and the fix."""
    path = path or CALIBRATION_FILE
    if not os.path.isfile(path):
        raise ValueError(f"Memory calibration {path} not found; make one on your card with `{CALIBRATE_COMMAND}` "
                         f"from probes of `{PROBE_COMMAND}`, or leave the calibration unset for the committed one.")
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as error:
        raise ValueError(f"Memory calibration {path} does not read as JSON ({error}); make it again with "
                         f"`{CALIBRATE_COMMAND}`.") from error
    return Calibration.from_dict(data, source=f"Memory calibration {path}")


# -- fitting


def _fit_memory(shapes, probes, thetas=_THETAS, objective: str = DEFAULT_FIT_OBJECTIVE):
    """Coefficients and theta with no probe predicted under its peak, at the least `objective` (`FIT_OBJECTIVES`)."""
    fixed = np.array([s.fixed_bytes / GIB for s in shapes])
    measured = np.array([p["peak_reserved_bytes"] / GIB for p in probes])
    best = None
    for theta in thetas:
        features = np.array([memory_features(s, p["batch_size"], p["seq_len"], probe_recomputed(p), theta,
                                              p.get("distill_topk", 0), bool(p.get("compile")))
                             for s, p in zip(shapes, probes)])
        found = _upper_bound(features, fixed, measured, objective)
        if found is not None and (best is None or found[0] < best[0]):
            best = (found[0], theta, found[1])
    if best is None:
        raise ValueError("no coefficients bound the probes' peaks from above")
    return np.maximum(best[2], 0.0).tolist(), best[1]


def _upper_bound(features, fixed, measured, objective: str):
    """(objective's value, coefficients c >= 0) of the linear program: fixed + features @ c >= measured on every
    probe, at the least summed over-prediction in GiB ("bytes"), summed relative over-prediction ("relative"), or
    largest relative over-prediction t ("minimax": fixed + features @ c <= (1 + t) measured; ties broken by the
    summed relative one); None if no c bounds them."""
    from scipy.optimize import linprog

    weights = 1.0 if objective == "bytes" else 1.0 / measured[:, None]
    cost = (features * weights).sum(axis=0)  # the summed over-prediction less a constant
    bound_a, bound_b = -features, fixed - measured
    if objective == "minimax":
        count = len(measured)
        cost = np.append(1e-3 * cost, 1.0)
        bound_a = np.vstack([np.hstack([bound_a, np.zeros((count, 1))]), np.hstack([features, -measured[:, None]])])
        bound_b = np.concatenate([bound_b, measured - fixed])
    result = linprog(cost, A_ub=bound_a, b_ub=bound_b, bounds=(0, None), method="highs")
    if result.status != 0:
        return None
    coefficients = result.x[:features.shape[1]]
    over = fixed + features @ coefficients - measured
    if objective != "bytes":
        over = over / measured
    if objective == "minimax":
        return float(over.max()) + 1e-3 * float(over.sum()), coefficients
    return float(over.sum()), coefficients


def _fit_time(shapes, probes) -> tuple[list[float], float, list[float] | None, list[float] | None]:
    """(eager coefficients, compile factor, compiled coefficients or None, those of models of LARGE_MODEL_PARAMS or
    more or None), each set fitted to the relative error of its own probes (non-negative least squares); a compiled
    set where at least MIN_COMPILED_TIME_PROBES of its probes were compiled."""
    from scipy.optimize import nnls

    features = np.array([record_time_features(s, p) for s, p in zip(shapes, probes)])
    measured = np.array([steady_step_seconds(p) for p in probes])
    compiled = np.array([bool(p.get("compile")) for p in probes])
    large = compiled & np.array([s.params >= LARGE_MODEL_PARAMS for s in shapes])

    def fit(rows):
        return nnls(features[rows] / measured[rows, None], np.ones(int(rows.sum())))[0]

    eager = fit(~compiled)
    ratios = measured[compiled] / (features[compiled] @ eager)
    own = fit(compiled).tolist() if compiled.sum() >= MIN_COMPILED_TIME_PROBES else None
    large = fit(large).tolist() if large.sum() >= MIN_COMPILED_TIME_PROBES and own is not None else None
    return eager.tolist(), (statistics.median(ratios.tolist()) if len(ratios) else 1.0), own, large


def fit_selective(records: list[dict], calibration: Calibration) -> dict | None:
    """The selective placement's terms (`placement`'s docstring) from the probe pairs in `records`: a selective probe
    and, next to it in the file, the same preset, batch, length, compilation, momentum and teacher recomputed in full
    (`memory_probe --selective_probes` writes them so, in one process), with `calibration`'s step times for the
    share of a full step its recomputation takes; None without a pair."""
    def key(r):
        return (r["preset"], r["batch_size"], r["seq_len"], bool(r.get("compile")), r.get("distill_topk", 0),
                r.get("momentum"), r.get("config", {}).get("vocab_size"))

    multiples, shares = [], []
    for index, r in enumerate(records):
        if not (measured(r) and r.get("recompute_set", {}).get("selective")):
            continue
        neighbours = [records[j] for j in (index + 1, index - 1) if 0 <= j < len(records)]
        twin = next((t for t in neighbours if measured(t) and t.get("recompute") == "all"
                     and not t["recompute_set"].get("selective") and key(t) == key(r)), None)
        if twin is None:
            continue
        shape, applications = ModelShape.from_record(r), probe_recomputed(r)
        tokens = r["batch_size"] * r["seq_len"]
        extra = (r["peak_reserved_bytes"] - twin["peak_reserved_bytes"]) / (applications * tokens)
        multiples.append(max(extra, 0.0) / shape.selective_saved_bytes)
        predicted = [calibration.step_seconds(shape, r["batch_size"], r["seq_len"], n, bool(r.get("compile")))
                     for n in (0, applications)]
        full_seconds = steady_step_seconds(twin)  # the recompute's share of the step, on the device measured
        recompute_seconds = full_seconds * (predicted[1] - predicted[0]) / predicted[1]
        shares.append(1.0 - (full_seconds - steady_step_seconds(r)) / recompute_seconds)
    if not multiples:
        return None
    return {"saved_multiple": round(max(multiples), 4), "time_fraction": round(statistics.median(shares), 4),
            "pairs": len(multiples)}


def fit_calibration(records: list[dict], probe_command: str | None = None, fit_command: str | None = None, source:
                    str = "probes", leave_one_out: bool = True, objective: str = DEFAULT_FIT_OBJECTIVE) -> Calibration:
    """A calibration fitted to the usable probe records, each model family's coefficients to its own probes, with
    its residuals on them (and, with `leave_one_out`, the peak error of each probe predicted by a fit without it).

    The calibration is of the first usable record's card (`device_name`): step times are fitted to that card's records
    only, peaks to every card's (a step holds the same tensors on any card, the allocator's cache a few tenths of a
    GiB more or less: recurrent-3.3b at batch 7 peaked at 22.47 GiB on an H200 and 22.77 on an H100), so that a plan
    holds on each card measured. Selective pairs of any card give their terms (ratios to their own twins)."""
    if objective not in FIT_OBJECTIVES:
        raise ValueError(f"objective={objective!r}: the memory fit minimises one of {', '.join(FIT_OBJECTIVES)}.")
    probes = usable_probes(records)
    by_family = {}  # family -> (shapes, probes)
    for p in probes:
        shape = ModelShape.from_record(p)
        shapes, members = by_family.setdefault(model_family(shape), ([], []))
        shapes.append(shape)
        members.append(p)
    if not by_family:
        raise ValueError(f"{source}: no usable probes (status ok, CUDA memory figures). Measure them with "
                         f"`{PROBE_COMMAND}`.")
    families, device = {}, probes[0].get("device_name")
    for family, (shapes, members) in by_family.items():
        if len(members) < MIN_MEMORY_PROBES:
            raise ValueError(f"{source}: {len(members)} usable probes of {family} models (status ok, CUDA memory "
                             f"figures); a fit needs at least {MIN_MEMORY_PROBES}. Measure more with "
                             f"`{PROBE_COMMAND}`, or leave that family's presets out of the probe file.")
        memory, theta = _fit_memory(shapes, members, objective=objective)
        timed = [(s, p) for s, p in zip(shapes, members) if p.get("device_name") == device] or zip(shapes, members)
        families[family] = FamilyFit(memory, theta, *_fit_time(*zip(*timed)))
    selective = fit_selective(records, Calibration(families, {}))
    first = probes[0]
    info = {"device_name": first.get("device_name"), "device_total_bytes": first.get("device_total_bytes"),
            "torch": first.get("torch"), "transformers": first.get("transformers"),
            "date": datetime.date.today().isoformat(), "memory_objective": objective,
            "probe_command": probe_command or first.get("probe_command") or PROBE_COMMAND,
            "fit_command": fit_command, "probes": len(probes), "probe_records": len(records),
            "probes_per_preset": {}}
    for p in probes:
        info["probes_per_preset"][p["preset"]] = info["probes_per_preset"].get(p["preset"], 0) + 1
    if selective is not None:  # the selective placement's measured terms
        info["selective"] = selective
    calibration = Calibration(families, info)
    calibration.info["residuals"] = residuals(calibration, probes, leave_one_out)
    return calibration


def residuals(calibration: Calibration, probes: list[dict], leave_one_out: bool = False) -> dict:
    """Relative errors of the predicted peak and step time on `probes` (signed, predicted / measured - 1); the step
    time's summary over the records of the calibration's card (`device_name` in its info) where it names one."""
    rows, held_out = [], []
    shapes = [ModelShape.from_record(p) for p in probes]
    families = [model_family(shape) for shape in shapes]
    for index, (p, shape, family) in enumerate(zip(probes, shapes, families)):
        recomputed = probe_recomputed(p)
        peak = calibration.peak_bytes(shape, p["batch_size"], p["seq_len"], recomputed, p.get("distill_topk", 0),
                                      bool(p.get("compile")))
        seconds = calibration.record_seconds(shape, p)
        rows.append({"preset": p["preset"], "batch_size": p["batch_size"], "seq_len": p["seq_len"],
                     "recompute": p.get("recompute"), "compile": bool(p.get("compile")),
                     "momentum": p.get("momentum"), "distill": bool(p.get("distill_topk")),
                     "device_name": p.get("device_name"), "measured_peak_gib": round(p["peak_reserved_bytes"] / GIB, 3),
                     "peak_error": round(peak / p["peak_reserved_bytes"] - 1, 4),
                     "measured_step_seconds": round(steady_step_seconds(p), 4),
                     "step_time_error": round(seconds / steady_step_seconds(p) - 1, 4)})
        if leave_one_out:  # the probe's family fitted again without it
            others = [j for j, other in enumerate(families) if other == family and j != index]
            full = calibration.families[family]
            memory, theta = _fit_memory([shapes[j] for j in others], [probes[j] for j in others],
                                        thetas=(full.theta,), objective=calibration.info.get("memory_objective",
                                                                                              "bytes"))
            fit = Calibration({family: FamilyFit(memory, theta, full.time_coefficients, 1.0)}, {})  # peaks only
            held_out.append(fit.peak_bytes(shape, p["batch_size"], p["seq_len"], recomputed,
                                           p.get("distill_topk", 0), bool(p.get("compile")))
                            / p["peak_reserved_bytes"] - 1)
    peak = [abs(r["peak_error"]) for r in rows]
    device = calibration.info.get("device_name")
    time = [abs(r["step_time_error"]) for r in [r for r in rows if r["device_name"] == device] or rows]
    summary = {"peak_max_relative_error": round(max(peak), 4),
               "peak_mean_relative_error": round(statistics.mean(peak), 4),
               "peak_largest_under_prediction": round(min(0.0, *(r["peak_error"] for r in rows)), 4),
               "step_time_max_relative_error": round(max(time), 4),
               "step_time_median_relative_error": round(statistics.median(time), 4)}
    if held_out:
        summary["peak_leave_one_out_max_relative_error"] = round(max(abs(e) for e in held_out), 4)
        summary["peak_leave_one_out_largest_under_prediction"] = round(min(0.0, *held_out), 4)
    summary["peak_max_relative_error_per_family"] = {
        name: round(max(abs(r["peak_error"]) for r, family in zip(rows, families) if family == name), 4)
        for name in calibration.families if name in families}
    return {**summary, "per_probe": rows}
