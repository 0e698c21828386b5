"""The model card (README.md) written into every saved or pushed checkpoint.

The prose lives in the templates of `trainer_ext.hub.model_cards` (`string.Template` placeholders); this module
computes the values: YAML metadata, parameter counts (unique, and unrolled at a depth) and the compute per token
at a few depths from `hf_recurrent.cost`, the training summary and the evaluation table.

    info = ModelCardInfo(repo_id="me/r3b", preset="recurrent-3.3b", datasets=["uonlp/CulturaX"],
                         tokens_seen=400_000_000, teacher="llm-jp/llm-jp-3-13b",
                         eval_results={4: {"ce": 3.1}, 12: {"ce": 2.9}})
    write_model_card("outputs/r3b/final", model, info)
"""

import functools
import json
import math
import os
import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from transformers import AutoConfig

from hf_recurrent.cost import ParameterCounts, flops_per_token, parameter_counts
from hf_recurrent.presets import is_recurrent

from trainer_ext.files import write_text

CARD_NAME = "README.md"
BASE_TAGS = ("hf-recurrent",)
RECURRENT_TAGS = ("recurrent-depth", "looped-transformer", "custom_code")
DEFAULT_PROMPT = "In the beginning"  # the usage snippet's prompt where the data gives none
# A Hub repository id: "name" or "namespace/name" (what metadata fields like base_model must reference).
REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]{0,95}(/[\w.-]{1,96})?$")


@dataclass
class ModelCardInfo:
    """What the card says beyond the config. Every field is optional; missing facts are reported as such."""

    repo_id: str | None = None  # shown in the loading snippet (default: a placeholder path)
    model_name: str | None = None  # the card's title (default: the repo name, then the preset)
    preset: str | None = None
    license: str = "apache-2.0"
    language: list[str] = field(default_factory=list)
    datasets: list[str] = field(default_factory=list)  # Hub dataset ids, for the metadata and the text
    training_data: str | None = None  # free text: corpus, filtering, tokenizer
    tokens_seen: int | None = None
    teacher: str | None = None  # distillation teacher (a Hub id or a name)
    base_model: str | None = None  # the checkpoint training started from, if any
    eval_results: str | Mapping | None = None  # a Markdown table, or {depth: {metric: value}}
    training_details: Mapping[str, Any] = field(default_factory=dict)  # e.g. {"optimizer": ..., "hardware": ...}
    tags: list[str] = field(default_factory=list)
    limitations: str | None = None  # appended to the standard limitations
    example_prompt: str | None = None  # the usage snippet's prompt (`data_prompt`: a text like the training data's)

    def __post_init__(self):
        for name in ("language", "datasets", "tags"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, [value])
            elif not all(isinstance(item, str) for item in value):
                raise ValueError(f"ModelCardInfo.{name}={value!r} must be a list of strings.")
        if self.tokens_seen is not None and (not isinstance(self.tokens_seen, int) or self.tokens_seen < 0):
            raise ValueError(f"ModelCardInfo.tokens_seen={self.tokens_seen!r} must be an integer >= 0 (or None).")
        if self.eval_results is not None and not isinstance(self.eval_results, (str, Mapping)):
            raise ValueError(
                f"ModelCardInfo.eval_results has type {type(self.eval_results).__name__}; pass a Markdown table "
                "(str) or a mapping {depth: {metric: value}}.")


# -- numbers


def format_count(n: float) -> str:
    """Human scale: 950 -> '950', 12_345 -> '12.3K', 400_000_000 -> '400M', 3.41e9 -> '3.41B'."""
    value, suffixes = float(n), ("", "K", "M", "B", "T")
    index = 0
    while abs(value) >= 999.5 and index < len(suffixes) - 1:  # 999,999 is '1M', not '1e+03K'
        value /= 1000
        index += 1
    return f"{value:.3g}{suffixes[index]}" if index else f"{value:.0f}"


def _count_with_scale(n: int) -> str:
    """'400,000,000 (400M)'; just '512' where the scale adds nothing."""
    exact, scaled = f"{n:,}", format_count(n)
    return exact if scaled == f"{n}" else f"{exact} ({scaled})"


def _format_metric(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if math.isnan(value) or math.isinf(value):
        return str(value)
    return f"{value:,.0f}" if abs(value) >= 1000 else f"{value:.4g}"


# -- sections


def _is_repo_id(name: str | None) -> bool:
    return bool(name) and REPO_ID.match(name) is not None and not os.path.exists(name)


def _hub_link(name: str) -> str:
    return f"[{name}](https://huggingface.co/{name})" if _is_repo_id(name) and "/" in name else f"`{name}`"


def _dataset_link(name: str) -> str:
    return f"[{name}](https://huggingface.co/datasets/{name})" if _is_repo_id(name) and "/" in name else f"`{name}`"


def _metadata(config, info: ModelCardInfo) -> str:
    recurrent = is_recurrent(config)
    tags = [*BASE_TAGS, *(RECURRENT_TAGS if recurrent else ("transformer-baseline",))]
    if info.teacher:
        tags.append("distillation")
    tags += [tag for tag in info.tags if tag not in tags]
    metadata: dict[str, Any] = {"license": info.license, "library_name": "transformers",
                                "pipeline_tag": "text-generation"}
    if info.language:
        metadata["language"] = list(info.language)
    metadata["tags"] = tags
    if info.datasets:
        metadata["datasets"] = list(info.datasets)
    # The Hub resolves `base_model` to a repository; a local path there would make the metadata invalid.
    if _is_repo_id(info.base_model):
        metadata["base_model"] = info.base_model
    return yaml.safe_dump(metadata, sort_keys=False, allow_unicode=True).strip()


def _architecture_rows(config, counts: ParameterCounts, recurrent: bool) -> str:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rows = [("unique parameters", _count_with_scale(counts.unique))]
    if recurrent:
        rows += [
            ("layers (prelude / core / coda)",
             f"{config.n_prelude_layers} / {config.n_core_layers} / {config.n_coda_layers}"),
            ("parameters per recurrent step", _count_with_scale(counts.per_step)),
            ("default depth (`num_steps`, else `mean_recurrence`)", str(config.default_num_steps)),
            ("input injection", f"`{config.injection}`"),
            ("block normalisation", f"`{config.block_norm}`"),
        ]
    else:
        rows.append(("layers", str(config.num_hidden_layers)))
    rows += [
        ("hidden size / MLP size", f"{config.hidden_size} / {config.intermediate_size}"),
        ("attention heads / key-value heads / head dim",
         f"{config.num_attention_heads} / {config.num_key_value_heads} / {head_dim}"),
        ("vocabulary", f"{config.vocab_size:,}"),
        ("context length", f"{config.max_position_embeddings:,}"),
    ]
    return "\n".join(f"| {key} | {value} |" for key, value in rows)


def _depths_to_show(config, info: ModelCardInfo) -> list[int]:
    default = config.default_num_steps
    depths = {1, max(default // 2, 1), default, 2 * default}
    if isinstance(info.eval_results, Mapping):
        depths.update(d for d in info.eval_results if isinstance(d, int) and d > 0)
    return sorted(depths)


def _depth_rows(config, counts: ParameterCounts, info: ModelCardInfo, context: int) -> str:
    rows = []
    for depth in _depths_to_show(config, info):
        gflops = flops_per_token(config, num_steps=depth, seq_len=context, training=False) / 1e9
        marker = " (default)" if depth == config.default_num_steps else ""
        rows.append(f"| {depth}{marker} | {format_count(counts.unrolled(depth))} | {gflops:.3g} |")
    return "\n".join(rows)


def _training_depths(config) -> str:
    if config.depth_distribution == "fixed":
        text = f"a fixed {config.mean_recurrence} steps"
    else:
        cap = f", capped at {config.max_recurrence}" if config.max_recurrence else ""
        text = (f"depths sampled per step from a Poisson log-normal distribution with mean {config.mean_recurrence} "
                f"and sigma {config.depth_sigma:g}{cap}")
    return text


def _training_section(config, info: ModelCardInfo) -> str:
    lines = []
    if info.training_data:
        lines.append(f"- Data: {info.training_data}")
    if info.datasets:
        lines.append("- Datasets: " + ", ".join(_dataset_link(name) for name in info.datasets))
    if not info.training_data and not info.datasets:
        lines.append("- Data: not recorded.")
    tokens = _count_with_scale(info.tokens_seen) if info.tokens_seen is not None else "not recorded."
    lines.append(f"- Tokens seen: {tokens}")
    if info.base_model:
        lines.append(f"- Initialised from: {_hub_link(info.base_model)}")
    if info.teacher:
        lines.append(f"- Distilled from the teacher {_hub_link(info.teacher)}: the loss mixes cross-entropy on the "
                     "data with a divergence to the teacher's next-token distribution.")
    else:
        lines.append("- No teacher: plain next-token cross-entropy.")
    if is_recurrent(config):
        backprop = (f"gradients through the last {config.backprop_depth} steps only"
                    if config.backprop_depth else "gradients through every step")
        lines.append(f"- Depth during training: {_training_depths(config)}; {backprop}.")
    for key, value in info.training_details.items():
        lines.append(f"- {key}: {value}")
    return "\n".join(lines)


def eval_table(results: Mapping) -> str:
    """A Markdown table from {depth: {metric: value}} (rows in the mapping's order, columns in first-seen order)."""
    columns: list[str] = []
    for metrics in results.values():
        if not isinstance(metrics, Mapping):
            raise ValueError(f"eval_results values must be mappings of metric -> value, got {metrics!r}.")
        columns += [name for name in metrics if name not in columns]
    header = "| depth | " + " | ".join(columns) + " |"
    rule = "|---" * (len(columns) + 1) + "|"
    rows = [f"| {depth} | " + " | ".join(_format_metric(metrics[c]) if c in metrics else "-" for c in columns) + " |"
            for depth, metrics in results.items()]
    return "\n".join([header, rule, *rows])


def _evaluation_section(info: ModelCardInfo, recurrent: bool) -> str:
    if info.eval_results is None:
        return "No evaluation was recorded for this checkpoint."
    if isinstance(info.eval_results, str):
        return info.eval_results.strip()
    intro = ("Held-out metrics per depth (`num_steps`):\n\n" if recurrent else "Held-out metrics:\n\n")
    return intro + eval_table(info.eval_results)


def _limitations_section(config, info: ModelCardInfo, recurrent: bool) -> str:
    tokens = f"on {format_count(info.tokens_seen)} tokens " if info.tokens_seen else ""
    lines = [
        f"- A research model pretrained {tokens}without instruction tuning or safety alignment: it continues "
        "text, may state falsehoods, and reproduces biases and offensive content of its training data.",
        "- Not evaluated for any downstream use; do not rely on it for decisions about people.",
    ]
    if recurrent:
        lines.append("- Depths far from those seen in training are untested; quality need not improve with more "
                     "steps.")
        if config.kv_cache_mode == "shared":
            lines.append("- The `shared` key/value cache makes cached generation an approximation for `num_steps > 1`;"
                         " set `kv_cache_mode=\"per_step\"` in the config for exact generation.")
        lines.append("- `trust_remote_code=True` runs the modeling code stored in this repository; read it first.")
    if info.limitations:
        lines.append(info.limitations.strip())
    return "\n".join(lines)


_KV_NOTES = {
    "per_step": "one slot per step and core layer, exact; its memory grows with `num_steps`.",
    "shared": "one slot per core layer written by the last step; memory independent of `num_steps`, "
              "an approximation for `num_steps > 1`.",
}


def _template(name: str) -> string.Template:
    try:
        from trainer_ext.hub import model_cards

        return string.Template(model_cards.template_text(name))
    except ImportError:
        # A source checkout run without installing it (e.g. `python -m scripts.run_pretrain` on a machine where the
        # package is only on PYTHONPATH): the templates are in model_cards/ at the repository root.
        path = Path(__file__).resolve().parents[2] / "model_cards" / f"{name}.md"
        return string.Template(path.read_text(encoding="utf-8"))


def render_model_card(model_or_config, info: ModelCardInfo | None = None) -> str:
    """The README.md text for a recurrent-depth model (or a Transformer baseline) and what `info` records."""
    info = info or ModelCardInfo()
    config = getattr(model_or_config, "config", model_or_config)
    counts = parameter_counts(config)  # raises ValueError for anything but a model or a config
    recurrent = is_recurrent(config)
    repo_name = info.repo_id.split("/")[-1] if info.repo_id else None
    name = info.model_name or repo_name or info.preset
    title = name or ("Recurrent-depth model" if recurrent else "Transformer baseline")
    values = {
        "metadata": _metadata(config, info),
        "title": title,
        "subject": f"`{name}`" if name else "This model",
        "repo_id": info.repo_id or "path/to/checkpoint",
        "example_prompt": json.dumps(info.example_prompt or DEFAULT_PROMPT, ensure_ascii=False),  # a Python literal
        "unique_params": format_count(counts.unique),
        "preset_clause": f" (preset `{info.preset}`)" if info.preset else "",
        "architecture_rows": _architecture_rows(config, counts, recurrent),
        "training_section": _training_section(config, info),
        "evaluation_section": _evaluation_section(info, recurrent),
        "limitations_section": _limitations_section(config, info, recurrent),
    }
    if recurrent:
        context = min(2048, config.max_position_embeddings)
        values.update(
            unrolled_params=format_count(counts.unrolled(config.default_num_steps)),
            default_depth=config.default_num_steps,
            deep_depth=2 * config.default_num_steps,
            n_prelude=config.n_prelude_layers,
            n_core=config.n_core_layers,
            n_coda=config.n_coda_layers,
            state_init="zeros" if config.state_init == "zeros" else
            f"a fixed pseudo-random normal, std {config.state_init_std:g}",
            training_depths=_training_depths(config),
            flops_context=f"{context:,}",
            depth_rows=_depth_rows(config, counts, info, context),
            kv_cache_mode=config.kv_cache_mode,
            kv_cache_note=_KV_NOTES[config.kv_cache_mode],
        )
    return _template("recurrent_depth" if recurrent else "transformer_baseline").substitute(values)


def data_prompt(data_dir: str, max_chars: int = 40) -> str | None:
    """A prompt for the usage snippet in the language of prepared data: the start of the first document that begins
    in the first 256 samples of its eval, then train split (after an end-of-sequence token), on one line, at most
    `max_chars` characters; None where the data cannot be read or no document begins there. Read once per folder and
    preparation in a process (a comparison writes several cards a cycle from the same held-out data; a folder
    prepared again, e.g. by --overwrite, writes a new manifest and is read again)."""
    from trainer_ext.data.shards import MANIFEST_NAME

    manifest = os.path.join(data_dir, MANIFEST_NAME)
    return _data_prompt(data_dir, max_chars, os.stat(manifest).st_mtime_ns if os.path.isfile(manifest) else None)


@functools.lru_cache(maxsize=16)
def _data_prompt(data_dir: str, max_chars: int, manifest_stamp: int | None) -> str | None:
    from transformers import AutoTokenizer

    from trainer_ext.data.shards import ShardedTokenDataset

    def samples(split):
        try:
            data = ShardedTokenDataset(data_dir, split, verify_checksums=False)
        except ValueError:  # no such split
            return
        for index in range(min(len(data), 256)):
            yield data[index]["input_ids"].tolist()

    try:
        tokenizer = AutoTokenizer.from_pretrained(data_dir)
        eos = tokenizer.eos_token_id
        ids = next((ids for split in ("eval", "train") for ids in samples(split) if eos in ids[:-1]), None)
    except (ValueError, OSError):
        return None
    if ids is None:
        return None
    start = ids.index(eos) + 1
    text = " ".join(tokenizer.decode(ids[start:start + 16], skip_special_tokens=True).split()).rstrip("\ufffd")
    if len(text) > max_chars:  # cut before a word where the text has spaces
        text = text[:max_chars].rsplit(" ", 1)[0] if " " in text[:max_chars] else text[:max_chars]
    return text or None


def write_model_card(save_dir: str, model_or_config=None, info: ModelCardInfo | None = None) -> str:
    """Render the card into `<save_dir>/README.md` (atomically) and return its path. Without a model or config,
    the checkpoint's own config.json is read."""
    if not os.path.isdir(save_dir):
        raise ValueError(f"write_model_card: {save_dir!r} is not a directory; save the checkpoint there first.")
    if model_or_config is None:
        if not os.path.isfile(os.path.join(save_dir, "config.json")):
            raise ValueError(f"write_model_card: {save_dir!r} has no config.json; pass the model or its config.")
        model_or_config = AutoConfig.from_pretrained(save_dir)
    text = render_model_card(model_or_config, info)
    return write_text(os.path.join(save_dir, CARD_NAME), text)  # a reader (or an upload) never sees half a card


__all__ = ["ModelCardInfo", "data_prompt", "eval_table", "format_count", "render_model_card", "write_model_card"]
