"""`hf-zenflow compare`: side-by-side runs of ZenFlow, no-offload AdamW and synchronous offload on a real model.

Owns the runner (`runner.py`, its settings `compare_config.py`, one timed run `training_run.py`, the order the runs
take their steps in `run_order.py`), the data layer (`data.py`, `data_source.py`, `batches.py`), metrics, the
timeline, plots, the report and card, the core split and the machine-load check, and the projection of a run onto a
hardware profile (`projection.py`, over `estimate`).

May import: `hf` (model cards), `estimate`, `optimizer`, `engine`, `settings`, `hf_zenflow._extras`. The emulated
accelerator (`hf-zenflow estimate`) is `hf_zenflow.estimate`; the tuner is `hf_zenflow.tuning`.

Heavy imports (transformers, matplotlib) happen inside the functions that need them, so importing this package is
cheap.
"""

from __future__ import annotations


__all__ = ["CompareConfig", "run_compare"]


def __getattr__(name: str):  # lazy re-exports: keep `import hf_zenflow.compare` free of heavy dependencies
    if name in ("CompareConfig", "run_compare"):
        from hf_zenflow.compare import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'hf_zenflow.compare' has no attribute {name!r}")
