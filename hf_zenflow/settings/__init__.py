"""Settings: what a ZenFlow run is told, checked before anything runs.

Owns `ZenFlowConfig` (`config.py`: every field validated at construction), the flags, plugin arguments, environment
variables and docs derived from its fields (`flags.py`), the reader of DeepSpeed configs (`deepspeed_config.py`), the
thread rule (`threads.py`: how many cores the host worker and the training thread get) and the argparse types of the
`hf-zenflow` numeric flags (`cli_types.py`).

May import: `hf_zenflow._base` and nothing else of hf_zenflow (it is the bottom layer; `pyproject.toml`'s import-linter
contract checks this). The old module path ``hf_zenflow.settings`` (the flag generation, now `flags.py`) keeps its
names here.
"""

from .config import ZenFlowConfig
from .flags import (
    FALSE_WORDS,
    SETTINGS,
    SETTINGS_BY_NAME,
    TRUE_WORDS,
    LowercaseChoice,
    Setting,
    add_arguments,
    cli_annotation,
    field_default,
    format_default,
    hf_parameter_doc,
    optional_fields,
    parse_text,
    rename_fields,
    render_help,
    trainer_fields,
    wrap,
)


#: The package version (pyproject.toml's); `hf_zenflow.__version__` re-exports it. Kept in the bottom layer so that
#: every layer (the model cards, the compare report) can name it without importing the package's top.
__version__ = "0.1.0"

__all__ = [
    "FALSE_WORDS",
    "SETTINGS",
    "SETTINGS_BY_NAME",
    "TRUE_WORDS",
    "LowercaseChoice",
    "Setting",
    "ZenFlowConfig",
    "__version__",
    "add_arguments",
    "cli_annotation",
    "field_default",
    "format_default",
    "hf_parameter_doc",
    "optional_fields",
    "parse_text",
    "rename_fields",
    "render_help",
    "trainer_fields",
    "wrap",
]
