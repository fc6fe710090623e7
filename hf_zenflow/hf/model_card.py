"""Model cards for ZenFlow runs, rendered from the Jinja template shipped in `hf_zenflow/templates/`.

The card is a regular Hub model card (YAML front matter from `huggingface_hub.ModelCardData`) with a "ZenFlow"
section: the optimizer settings and the figures measured during training (critical path, host step time, bytes
moved, staleness...). `ZenFlowTrainer` writes it as `README.md` next to the saved weights.
"""

from __future__ import annotations

import importlib.metadata
import importlib.resources
import os
import re
from typing import Any

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from ..settings import __version__


#: Tags every card carries (the Hub filters on them).
ZENFLOW_TAGS = ("hf_zenflow", "zenflow")

TEMPLATE_NAME = "zenflow_model_card.md"


def template_text() -> str:
    """The card template shipped as package data (`hf_zenflow/templates/zenflow_model_card.md`)."""
    return (importlib.resources.files("hf_zenflow") / "templates" / TEMPLATE_NAME).read_text(encoding="utf-8")


def _version(distribution: str) -> str | None:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:
        return None


def framework_versions() -> dict[str, str]:
    """Versions of the libraries a reader needs to reproduce the run (those that are installed)."""
    versions: dict[str, str] = {}
    versions["hf_zenflow"] = __version__  # (the package may run from a source checkout, without installed metadata)
    for name, dist in (("Transformers", "transformers"), ("PyTorch", "torch"), ("Accelerate", "accelerate"),
                       ("PEFT", "peft"), ("Datasets", "datasets"), ("Tokenizers", "tokenizers")):
        version = _version(dist)
        if version is not None:
            versions[name] = version
    return versions


def format_bytes(num: float) -> str:
    """`1536` -> `'1.5 KiB'`."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(num) < 1024 or unit == "GiB":
            return f"{num:.0f} {unit}" if unit == "B" else f"{num:.1f} {unit}"
        num /= 1024
    return f"{num:.1f} GiB"  # pragma: no cover


def is_hub_id(name: str) -> bool:
    """Whether `name` names a Hub repository (`org/name`), not a local folder or file: only those get a link and
    the `base_model` metadata (the Hub rejects a card whose base model is a path)."""
    if not name or os.path.exists(name) or name.startswith((".", "/", "~")) or os.sep in name.replace("/", ""):
        return False
    try:
        validate_repo_id(name)
    except HFValidationError:
        return False
    return True


def format_value(value: Any) -> str:
    """Numbers for a Markdown table: ints as is, floats with 4 significant digits, None as a dash."""
    if value is None:
        return "–"
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, str):
        return value
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def render_zenflow_model_card(
    *,
    model_name: str,
    zenflow_settings: dict[str, Any],
    zenflow_measured: dict[str, Any] | None = None,
    hyperparameters: dict[str, Any] | None = None,
    results: dict[str, Any] | None = None,
    base_model: str | None = None,
    dataset_name: str | None = None,
    tags: list[str] | None = None,
    library_name: str = "transformers",
    license: str | None = None,
    language: str | list[str] | None = None,
    training_procedure: str | None = None,
    base_model_on_hub: bool | None = None,
    datasets: list[str] | None = None,
    eval_results: dict[str, Any] | None = None,
    eval_table: str | None = None,
    card_metadata: dict[str, Any] | None = None,
) -> ModelCard:
    """Render the ZenFlow model card.

    `training_procedure` replaces the sentence that says how the model was trained (default: by `ZenFlowTrainer`);
    `hf-zenflow compare --save-model` passes its own plain training loop. `base_model` is linked (and named in the
    metadata) only when it is a Hub id (`base_model_on_hub`, by default `is_hub_id`); a local path is named without
    a link. `datasets` (default: `[dataset_name]`) are the dataset names; `eval_results` the final evaluation
    figures and `eval_table` the Markdown table of every evaluation, as the plain Trainer card shows them;
    `card_metadata` more YAML keys (`metrics`, `model-index`, `datasets` tags: `Trainer.create_model_card`'s).

    Example:
        >>> card = render_zenflow_model_card(model_name="tiny", zenflow_settings={"topk_ratio": 0.1})
        >>> "hf_zenflow" in card.data.tags and "## ZenFlow" in card.content
        True
    """
    all_tags = list(dict.fromkeys([*(tags or []), *ZENFLOW_TAGS]))
    if base_model_on_hub is None:
        base_model_on_hub = bool(base_model) and is_hub_id(base_model)
    datasets = [d for d in (datasets if datasets is not None else [dataset_name]) if d]
    extra = dict(card_metadata or {})
    card_data = ModelCardData(
        base_model=base_model if base_model and base_model_on_hub else None,
        datasets=extra.pop("datasets", None) or datasets or None,
        library_name=library_name,
        license=license,
        language=language,
        model_name=model_name,
        tags=all_tags,
        **extra,
    )
    card = ModelCard.from_template(
        card_data,
        template_str=template_text(),
        model_name=model_name,  # card_data moves it into model-index when that is given
        base_model=base_model,
        base_model_on_hub=base_model_on_hub,
        datasets=[{"name": d, "on_hub": is_hub_id(d)} for d in datasets],
        eval_results={k: format_value(v) for k, v in (eval_results or {}).items()},
        eval_table=eval_table,
        hyperparameters={k: format_value(v) for k, v in (hyperparameters or {}).items()},
        results={k: format_value(v) for k, v in (results or {}).items()},
        # Booleans stay booleans: the template tests `zenflow_settings.overlap_step`.
        zenflow_settings={k: v if isinstance(v, bool) else format_value(v) for k, v in zenflow_settings.items()},
        zenflow_measured={k: format_value(v) for k, v in (zenflow_measured or {}).items()},
        framework_versions=framework_versions(),
        training_procedure=training_procedure,
    )
    # Jinja's block tags leave runs of blank lines around the tables; one is enough.
    return ModelCard(re.sub(r"\n{3,}", "\n\n", str(card)))
