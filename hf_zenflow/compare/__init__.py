"""Side-by-side comparison of ZenFlow against no-offload AdamW and synchronous offload (`hf-zenflow compare`), and an
emulated accelerator for measuring end-to-end overlap without a GPU (`hf-zenflow estimate`).

Heavy imports (transformers, matplotlib) happen inside the functions that need them, so importing this package is
cheap.
"""

from __future__ import annotations


__all__ = ["CompareConfig", "EmulatorScenario", "run_compare", "run_estimate"]


def __getattr__(name: str):  # lazy re-exports: keep `import hf_zenflow.compare` free of heavy dependencies
    if name in ("CompareConfig", "run_compare"):
        from hf_zenflow.compare import runner

        return getattr(runner, name)
    if name in ("EmulatorScenario", "run_estimate"):
        from hf_zenflow.estimate import emulator

        return getattr(emulator, name)
    raise AttributeError(f"module 'hf_zenflow.compare' has no attribute {name!r}")
