"""Model card templates (Markdown with `string.Template` placeholders), shipped as package data.

`template_text(name)` reads one; `trainer_ext.hub.model_card` fills it in.
"""

from importlib import resources

TEMPLATES = ("recurrent_depth", "transformer_baseline")


def template_text(name: str) -> str:
    if name not in TEMPLATES:
        raise ValueError(f"Unknown model card template {name!r}; choose one of {list(TEMPLATES)}.")
    return resources.files(__name__).joinpath(f"{name}.md").read_text(encoding="utf-8")
