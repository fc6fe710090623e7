"""`hf-zenflow estimate`: the emulated accelerator and the hardware bound model.

Owns the emulator (`emulator.py` and its `emulator_*.py` parts: the scenario, the emulated device clock, the three
schedules run on this machine's cores, the report and the command line), the hardware profiles (`profiles.py`) and
the bound model (`hardware.py`; in words: `advice.py`), the measured host rates (`host_rates.py`) and data-parallel
ranks in the model (`ranks.py`).

May import: `optimizer` (the real engines it runs on the host), `engine`, `settings`, `hf_zenflow._base`. Not `hf`,
`compare` or `tuning` (`compare` and `tuning` use it for their projections).
"""

from __future__ import annotations


__all__ = ["EmulatorScenario", "run_estimate"]


def __getattr__(name: str):  # lazy re-exports, as `hf_zenflow.compare` had them
    if name in __all__:
        from hf_zenflow.estimate import emulator

        return getattr(emulator, name)
    raise AttributeError(f"module 'hf_zenflow.estimate' has no attribute {name!r}")
