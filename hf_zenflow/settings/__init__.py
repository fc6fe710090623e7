"""Settings: what a ZenFlow run is told, checked before anything runs.

Owns `ZenFlowConfig` (`config.py`: every field validated at construction), the flags, plugin arguments, environment
variables and docs derived from its fields (`flags.py`), the reader of DeepSpeed configs (`deepspeed_config.py`), the
thread rule (`threads.py`: how many cores the host worker and the training thread get) and the argparse types of the
`hf-zenflow` numeric flags (`cli_types.py`).

May import: `hf_zenflow._base` and nothing else of hf_zenflow (it is the bottom layer; `pyproject.toml`'s import-linter
contract checks this).
"""

from .config import ZenFlowConfig


#: The package version (pyproject.toml's); `hf_zenflow.__version__` re-exports it. Kept in the bottom layer so that
#: every layer (the model cards, the compare report) can name it without importing the package's top.
__version__ = "0.1.0"

__all__ = ["ZenFlowConfig", "__version__"]
