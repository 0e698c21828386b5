"""Deep supervision over depth (`--depth_supervision K`): the LM loss on K depths of one training step.

A recurrent-depth model is trained on the output at its sampled depth n only; nothing asks the states of earlier
steps to be readable, and nothing asks later steps to improve on them. Here, as in Ouro's expected loss over steps
(with fixed weights instead of a learned exit distribution), the coda, the final norm and the LM head are applied to
the core state after each of K steps, and the step's loss is the weighted mean of their LM losses:

    loss = sum_j w_j * L(head(norm(coda(s_{i_j})))) / sum_j w_j

The K steps i_1 < ... < i_K are evenly spaced among the g steps that carry gradients (the last
`backprop_depth`, `hf_recurrent.cost.graph_steps`), counted back from the last one, which is always included:
i_j = n - g + floor(j * g / K). Where g < K (a short sampled depth) every graph-building step is supervised. Weights
w_j: "uniform" (1 each) or "linear" (w_j = i_j: deeper states weigh more).

Each depth's loss is `chunked_lm_loss` (never full logits), one depth at a time; the last depth's hidden state is the
decoder's own output, so K - 1 extra coda + norm passes are run, and counted in the training FLOPs
(`hf_recurrent.flops_per_token(..., supervised_depths=K)`). Memory: per extra depth, the coda's activations, one
(B, T, C) hidden state and the head-weight gradient that `chunked_lm_loss` computes in its forward (V x C in the
head's dtype) stay alive until backward.

The states and the coda's call arguments (causal mask, rotary phases) are taken with forward hooks on the decoder
while the training forward runs (through whatever wraps the model: DDP, FSDP2), and removed after it, before backward
(a recomputing checkpoint must not fire them again). Evaluation is unchanged: the loss at the evaluation depth.

A model with a learned exit gate (`config.exit_gate`) trains on Ouro's expected loss over depths instead of fixed
weights: `ExitGateLoss` (the objective's math in exit_gate.py), chosen by `supervision_for`; it captures the state
after every step, the gate being read after each at inference, and trains the model at the same supervised depths.
"""

from __future__ import annotations

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from hf_recurrent.cost import graph_steps
from trainer_ext.distill.losses import IGNORE_INDEX, LossOutput
from trainer_ext.training.exit_gate import exit_distribution, expected_exit_loss, token_ce

WEIGHTINGS = ("uniform", "linear")

__all__ = ["WEIGHTINGS", "DepthSupervision", "ExitGateLoss", "SupervisedStates", "supervised_steps", "supervision_for"]

EVERY_GRAPH_STEP = 1 << 30  # a count larger than any depth: `supervised_steps` then takes every graph step


def supervised_steps(num_steps: int, num_graph_steps: int, count: int) -> list[int]:
    """The steps (1-based, ascending) whose states are supervised at depth `num_steps` when the last
    `num_graph_steps` carry gradients: `count` of them evenly spaced, counted back from the last, which is included
    (all graph-building steps where there are fewer than `count`)."""
    count = min(count, num_graph_steps)
    first = num_steps - num_graph_steps
    return [first + j * num_graph_steps // count for j in range(1, count + 1)]


EXIT_GATE_WITH_A_TEACHER = (
    "exit_gate=true trains the gate with the expected CE over depths, which does not combine with distillation yet: "
    "train without a teacher (no --teacher_model_name_or_path / --teacher_cache_dir), or set exit_gate=false in "
    "--config_overrides.")


def supervision_for(args, recurrent: bool, exit_gate: bool = False) -> DepthSupervision | None:
    """The trainer's DepthSupervision from its arguments (`--depth_supervision`, `--depth_supervision_weights`), or
    None for the plain loss at the last depth. A model with an exit gate (`exit_gate`, its config's) gets the
    expected loss over depths (`ExitGateLoss`) whatever `--depth_supervision` says."""
    if exit_gate:
        return ExitGateLoss(args.depth_supervision, args.exit_gate_entropy_weight)
    if args.depth_supervision == 1:
        return None
    if not recurrent:
        raise ValueError(f"--depth_supervision {args.depth_supervision} needs a recurrent-depth model: this one is a "
                         "plain Transformer with a single depth. Leave --depth_supervision at 1 (the default) for it.")
    return DepthSupervision(args.depth_supervision, args.depth_supervision_weights)


@dataclass
class SupervisedStates:
    """What one training forward left for the supervised loss: the state after each supervised step but the last
    (the decoder's output stands for that one), and the call arguments of each coda layer."""

    steps: list[int]
    states: dict[int, torch.Tensor] = field(default_factory=dict)
    coda_kwargs: list[dict] = field(default_factory=list)
    # Steps read without gradients to the model (an exit gate's, before or between the supervised ones).
    gate_only: list[int] = field(default_factory=list)


class DepthSupervision:
    """The loss over several depths of a training step, and the per-depth CE of the logging window."""

    keeps_last_state = False  # the state after the last supervised step too (an exit gate reads it)

    def __init__(self, count: int, weighting: str = "uniform"):
        if weighting not in WEIGHTINGS:
            raise ValueError(f"--depth_supervision_weights={weighting!r} is not allowed; it must be one of "
                             f"{list(WEIGHTINGS)}.")
        if count < 2:
            raise ValueError(f"DepthSupervision needs count >= 2, got {count} (1 is the plain loss: no supervision).")
        self.count = count
        self.weighting = weighting
        self._window = defaultdict(lambda: [0.0, 0])  # depth -> [summed CE on the device, steps]

    def steps_for(self, config, depth: dict) -> list[int]:
        num_steps = depth["num_steps"]
        return supervised_steps(num_steps, graph_steps(config, num_steps, depth.get("backprop_depth")), self.count)

    def flops_kwargs(self, config, depth: dict) -> dict:
        """`hf_recurrent.flops_per_token`'s keywords for a training step at `depth`: the depths read out."""
        return {"supervised_depths": self.count}

    def weights(self, steps: list[int]) -> list[float]:
        return [float(step) for step in steps] if self.weighting == "linear" else [1.0] * len(steps)

    def states_for(self, config, depth: dict) -> SupervisedStates:
        return SupervisedStates(self.steps_for(config, depth))

    @contextlib.contextmanager
    def capture(self, decoder, depth: dict) -> Iterator[SupervisedStates]:
        """Around the training forward of `decoder` (the `RecurrentDepthModel`) at `depth` ({"num_steps",
        "backprop_depth"}): yields the SupervisedStates it fills."""
        captured = self.states_for(decoder.config, depth)
        wanted = set(captured.steps if self.keeps_last_state else captured.steps[:-1])
        calls = [0]

        def keep_state(module, args, output):
            calls[0] += 1  # state_norm ends every core step, once per step
            if calls[0] in wanted:
                captured.states[calls[0]] = output

        def keep_coda_kwargs(module, args, kwargs):
            if len(captured.coda_kwargs) < len(decoder.coda):  # the forward's own call, not a replay
                captured.coda_kwargs.append(dict(kwargs))

        handles = [decoder.state_norm.register_forward_hook(keep_state)]
        handles += [layer.register_forward_pre_hook(keep_coda_kwargs, with_kwargs=True) for layer in decoder.coda]
        try:
            yield captured
        finally:
            for handle in handles:
                handle.remove()
        if calls[0] != depth["num_steps"]:
            raise RuntimeError(f"depth supervision expected {depth['num_steps']} core steps, saw {calls[0]}")

    def loss(self, decoder, final_hidden: torch.Tensor, captured: SupervisedStates,
             lm_loss: Callable[[torch.Tensor], LossOutput]) -> LossOutput:
        """The weighted mean of `lm_loss` (a `chunked_lm_loss` with the head, targets and teacher bound) at the
        captured depths; `final_hidden`: the decoder's output (the last supervised step). The returned `ce` / `kd`
        are the last depth's, comparable with a run without supervision; each depth's CE is kept for `logs`."""
        steps, weights = captured.steps, self.weights(captured.steps)
        total_weight = sum(weights)
        loss = None
        for step, weight in zip(steps, weights):
            hidden = self.readout(decoder, final_hidden, captured, step)
            out = lm_loss(hidden)  # one depth's head at a time
            del hidden
            term = out.loss * (weight / total_weight)
            loss = term if loss is None else loss + term
            self.count_ce(step, out.ce)
        return LossOutput(loss=loss, ce=out.ce, kd=out.kd)

    @staticmethod
    def readout(decoder, final_hidden: torch.Tensor, captured: SupervisedStates, step: int) -> torch.Tensor:
        """What the LM head reads at supervised step `step`: the decoder's output for the last one, else the coda and
        the final norm applied to the captured state (released from `captured`)."""
        if step == captured.steps[-1]:
            return final_hidden
        hidden = captured.states.pop(step)
        for layer, kwargs in zip(decoder.coda, captured.coda_kwargs):
            hidden = layer(hidden, **kwargs)
        return decoder.norm(hidden)

    def count_ce(self, step: int, ce: torch.Tensor) -> None:
        window = self._window[step]
        window[0] += ce.detach()
        window[1] += 1

    def logs(self) -> dict:
        """`ce_depth_<i>`: the mean training CE of the state after step i over the steps of the window that
        supervised it (so a key appears only for depths supervised since the last log); resets the window."""
        logs = {f"ce_depth_{step}": round(float(total) / count, 4)
                for step, (total, count) in sorted(self._window.items())}
        self._window.clear()
        return logs


class ExitGateLoss(DepthSupervision):
    """`DepthSupervision`'s capture and readouts with Ouro's expected loss over depths (exit_gate.py), the gate read
    after every step (as at inference), the model trained at the supervised steps. `count`: `--depth_supervision`
    (1: every step with gradients); `entropy_weight`: beta."""

    keeps_last_state = True

    def __init__(self, count: int, entropy_weight: float):
        super().__init__(EVERY_GRAPH_STEP if count == 1 else count)
        self.entropy_weight = entropy_weight
        self._gate_window = [0.0, 0.0, 0]  # summed expected exit step, entropy (on the device), steps

    def states_for(self, config, depth: dict) -> SupervisedStates:
        trained = self.steps_for(config, depth)
        every = list(range(1, depth["num_steps"] + 1))
        return SupervisedStates(every, gate_only=[step for step in every if step not in trained])

    def flops_kwargs(self, config, depth: dict) -> dict:
        trained = self.steps_for(config, depth)
        return {"supervised_depths": self.count, "readout_only_depths": depth["num_steps"] - len(trained)}

    def loss(self, decoder, final_hidden: torch.Tensor, captured: SupervisedStates,
             lm_loss: Callable[..., LossOutput]) -> LossOutput:
        """`lm_loss`: the trainer's `chunked_lm_loss` partial, read for its head weight, targets and chunk size."""
        bound = lm_loss.keywords
        if bound.get("teacher") is not None:
            raise ValueError(EXIT_GATE_WITH_A_TEACHER)
        weight, labels = bound["lm_head_weight"], bound["labels"]
        gate_only = set(captured.gate_only)
        lambdas, ce = [], []
        for step in captured.steps:
            state = captured.states[step]
            lambdas.append(torch.sigmoid(decoder.exit_gate(state.detach() if step in gate_only else state)
                                         .float().squeeze(-1)))
            with torch.no_grad() if step in gate_only else contextlib.nullcontext():
                hidden = self.readout(decoder, final_hidden, captured, step)
                ce.append(token_ce(hidden, weight, labels, bound.get("chunk_size")))
            del hidden
        lambdas, ce = torch.stack(lambdas), torch.stack(ce)  # (S, B, T): every step
        keep = labels != IGNORE_INDEX
        # Value and the gate's gradient: the expected CE over every step (CE as constants).
        loss, _, entropy = expected_exit_loss(lambdas, ce.detach(), keep, self.entropy_weight)
        # The model's gradient: each supervised step's CE weighted by the gate's exit probability there, normalised
        # over those steps (with every step supervised, exactly the gradient of the expected loss).
        trained = [j for j, step in enumerate(captured.steps) if step not in gate_only]
        p = exit_distribution(lambdas.detach())[trained]
        model_ce = torch.where(keep, (p / p.sum(0).clamp_min(1e-12) * ce[trained]).sum(0), 0.0).sum()
        count = keep.sum().clamp(min=1)
        loss = loss + (model_ce - model_ce.detach()) / count
        mean_ce = torch.where(keep, ce.detach(), 0.0).flatten(1).sum(-1) / count  # (S,)
        for step, step_ce in zip(captured.steps, mean_ce):
            self.count_ce(step, step_ce)
        with torch.no_grad():
            steps = torch.tensor(captured.steps, dtype=torch.float32, device=lambdas.device)[:, None, None]
            exit_step = torch.where(keep, (exit_distribution(lambdas) * steps).sum(0), 0.0).sum() / count
        self._gate_window[0] += exit_step
        self._gate_window[1] += entropy.detach()
        self._gate_window[2] += 1
        return LossOutput(loss=loss, ce=mean_ce[-1], kd=torch.zeros_like(mean_ce[-1]))

    def logs(self) -> dict:
        """Deep supervision's `ce_depth_<i>`, and the window's mean `exit_gate_mean_step` (the expected exit step
        under the gate) and `exit_gate_entropy` (of its exit distribution, nats)."""
        logs = super().logs()
        exit_step, entropy, steps = self._gate_window
        if steps:
            logs["exit_gate_mean_step"] = round(float(exit_step) / steps, 3)
            logs["exit_gate_entropy"] = round(float(entropy) / steps, 4)
        self._gate_window = [0.0, 0.0, 0]
        return logs
