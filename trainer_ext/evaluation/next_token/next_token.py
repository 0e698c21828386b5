"""Next-token metrics for causal language models: cross-entropy, perplexity, top-1 and top-5 accuracy.

The inputs are per-position sufficient statistics, not logits: a (positions, vocab) logit tensor for a 64k
vocabulary is too large to hand to a metric, while these two numbers per position determine every figure
reported here and can be computed chunk by chunk next to the LM head:

    nll   -log p(reference token), natural log (the per-position cross-entropy)
    rank  how many vocabulary entries score strictly higher than the reference token (0 = the argmax)

so top-k accuracy is the share of positions with rank < k (a tie with the reference counts as a hit).

    >>> metric = evaluate.load("path/to/next_token")
    >>> metric.add_batch(nll=[0.5, 2.0], rank=[0, 3])
    >>> metric.compute()
    {'ce': 1.25, 'perplexity': 3.49..., 'top1': 0.5, 'top5': 1.0, 'tokens': 2}
"""

import math

import datasets
import evaluate
import numpy as np

_CITATION = ""

_DESCRIPTION = __doc__

_KWARGS_DESCRIPTION = """
Args:
    nll: per-position negative log-likelihood of the reference token (natural log), floats >= 0.
    rank: per-position count of vocabulary entries scoring strictly above the reference token, ints >= 0.
Returns:
    ce: mean nll over all positions (nats per token).
    perplexity: exp(ce).
    top1: share of positions whose reference token is the model's argmax.
    top5: share of positions whose reference token is among the model's five highest scores.
    tokens: number of positions.
"""


@evaluate.utils.file_utils.add_start_docstrings(_DESCRIPTION, _KWARGS_DESCRIPTION)
class NextToken(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description=_DESCRIPTION,
            citation=_CITATION,
            inputs_description=_KWARGS_DESCRIPTION,
            features=datasets.Features({"nll": datasets.Value("float64"), "rank": datasets.Value("int64")}),
        )

    def _compute(self, nll, rank):
        nll = np.asarray(nll, dtype=np.float64)
        rank = np.asarray(rank, dtype=np.int64)
        if nll.size == 0:
            raise ValueError("next_token metric: no positions were added; call add_batch(nll=..., rank=...) first.")
        # A little below 0 is float rounding of log-sum-exp minus the reference logit for a certain prediction.
        if not np.isfinite(nll).all() or (nll < -1e-4).any():
            raise ValueError("next_token metric: nll must be finite and >= 0 (a negative log-probability).")
        if (rank < 0).any():
            raise ValueError("next_token metric: rank must be >= 0 (0 means the reference is the argmax).")
        ce = float(nll.mean())
        return {
            "ce": ce,
            # exp overflows float64 near 709 nats; a model that bad has no meaningful perplexity anyway.
            "perplexity": math.exp(ce) if ce < 700 else math.inf,
            "top1": float((rank < 1).mean()),
            "top5": float((rank < 5).mean()),
            "tokens": int(nll.size),
        }
