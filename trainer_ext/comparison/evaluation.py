"""A cycle's evaluation: every final checkpoint on the one held-out set, the recurrent model at each depth.

Each record holds the cycle, the tokens seen, the model (arch, preset, kind, depth, unrolled layers), the
checkpoint, the held-out metrics and the frequency-only CE of the same tokens (what a model that ignores the
context reaches). The model card of each checkpoint is rewritten with its results.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from hf_recurrent import presets
from hf_recurrent.cost import unrolled_layers
from trainer_ext.comparison.progress import RunProgress
from trainer_ext.comparison.report import record_label
from trainer_ext.data.shards import ShardedTokenDataset
from trainer_ext.devices import resolve_device, resolve_dtype
from trainer_ext.evaluation.checkpoints import load_checkpoint
from trainer_ext.evaluation.metrics import evaluate_model, learning_warnings, unigram_cross_entropy
from trainer_ext.hub.model_card import ModelCardInfo, write_model_card

logger = logging.getLogger(__name__)


@dataclass
class HeldoutEvaluation:
    """How the held-out set is read and where the models run."""

    heldout_dir: str
    tokenizer_hash: str
    depths: list[int]  # of the recurrent model
    batch_size: int = 8
    max_batches: int | None = None
    device: str = "auto"
    dtype: str = "auto"

    def evaluate(self, cycle: int, tokens_seen: int, checkpoints: dict[str, tuple[str, str]],
                 progress: RunProgress | None = None) -> list[dict]:
        """Records of each model in `checkpoints` ({arch: (preset, final_dir)}), in that order."""
        device = resolve_device(self.device)
        dtype = resolve_dtype(self.dtype, device)
        records = []
        unigram_ce = None
        for arch, (preset, final_dir) in checkpoints.items():
            model = load_checkpoint(final_dir, dtype, device)
            heldout = ShardedTokenDataset(self.heldout_dir, "eval", expected_tokenizer_hash=self.tokenizer_hash,
                                          model_vocab_size=model.config.vocab_size)
            if unigram_ce is None:  # over the samples evaluate_model reads
                evaluated = len(heldout) if self.max_batches is None else min(
                    len(heldout), self.max_batches * self.batch_size)
                unigram_ce = unigram_cross_entropy(torch.utils.data.Subset(heldout, range(evaluated)))
            recurrent = presets.is_recurrent(model.config)
            for depth in self.depths if recurrent else [None]:
                if progress is not None:
                    progress.show(f"cycle={cycle}, model={arch}, stage=evaluate" + (f" n={depth}" if depth else ""))
                metrics = evaluate_model(model, heldout, num_steps=depth, batch_size=self.batch_size,
                                         max_batches=self.max_batches, progress=False)
                record = {"cycle": cycle, "tokens_seen": tokens_seen, "arch": arch, "preset": preset,
                          "kind": "recurrent" if recurrent else "transformer", "num_steps": depth,
                          "layers": unrolled_layers(model.config, depth), "checkpoint": final_dir,
                          "frequency_only_ce": unigram_ce, **metrics}
                record["model"] = record_label(record)
                records.append(record)
            ce_by_depth = {r["num_steps"]: r["ce"] for r in records if r["arch"] == arch}
            for warning in learning_warnings(f"cycle {cycle}, {preset}", ce_by_depth, unigram_ce):
                logger.warning(warning)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
        return records


def write_cycle_card(final_dir: str, arch: str, records: list[dict], info: ModelCardInfo) -> str:
    """The model card of a cycle's final checkpoint with its held-out results (`info` gives the rest)."""
    results = {}
    for r in records:
        if r["arch"] == arch:
            results[r["num_steps"] or f"{r['layers']} layers"] = {
                "cross-entropy": r["ce"], "perplexity": r["perplexity"], "top-1": r["top1"], "top-5": r["top5"]}
    info.eval_results = results
    return write_model_card(final_dir, None, info)
