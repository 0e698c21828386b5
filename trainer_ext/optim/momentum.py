"""The first moment the low-memory optimizer keeps where the user leaves it unset: full bf16 momentum or subspace
momentum by model size, and the factor of the update outside the subspace."""

import math

from trainer_ext.optim.optimizer import SUBSPACE_MOMENTUM_FRACTION

# The low-memory optimizer's bf16 momentum costs 2 bytes per parameter: at 121M parameters it brought the held-out
# loss from 8.6% to 0.6% behind AdamW, and on small recurrent models in bf16 it made the difference between a stalled
# and a healthy run (BENCHMARKS.md). Full momentum is the default below this size (recurrent-1b: +2 GB); from it up the
# default is subspace momentum, `low_memory_7b` (as good at equal tokens over three seeds at 121M; 1.7 GiB for
# recurrent-7b, which would need +13.8 GB in full). On a 24 GB card the memory it frees is what the plan needs to keep
# activations instead of recomputing them: recurrent-3.3b trained 1.06x faster with it than with full momentum (+6.7
# GB), on the README's data and with a cached teacher at llm-jp's vocabulary (BENCHMARKS.md).
AUTO_MOMENTUM, AUTO_MOMENTUM_MAX_PARAMS = 0.9, 2e9


def resolve_momentum(momentum: float | None, rank_fraction: float | None,
                     num_params: int) -> tuple[float | None, float | None]:
    """The optimizer's (beta1, momentum_rank_fraction): beta1 is the argument if given (0 = off), else 0.9; the
    fraction is the argument if given (1 = full momentum), else full below AUTO_MOMENTUM_MAX_PARAMS parameters and
    SUBSPACE_MOMENTUM_FRACTION from there up."""
    momentum = AUTO_MOMENTUM if momentum is None else momentum or None
    if momentum is None:
        return None, None
    if rank_fraction is None:
        rank_fraction = 1.0 if num_params < AUTO_MOMENTUM_MAX_PARAMS else SUBSPACE_MOMENTUM_FRACTION
    return momentum, (rank_fraction if rank_fraction < 1 else None)


def resolve_subspace_residual(residual: float | None, momentum: float | None) -> float:
    """The factor of the update outside subspace momentum's subspace: the argument if given, else
    sqrt((1 - beta1) / (1 + beta1)) (0.229 at beta1 = 0.9), the factor by which momentum shrinks the RMS of
    uncorrelated noise, so that the update outside the subspace is as large as full momentum would make it."""
    if residual is not None:
        return residual
    return 1.0 if not momentum else math.sqrt((1.0 - momentum) / (1.0 + momentum))
