"""`hf-zenflow estimate`: the bound model of the offload schedules on a hardware profile.

Owns the hardware profiles (`profiles.py`), the bound model (`hardware.py`: step time per side, device and host
memory, what fits and the largest model each schedule trains; in words and tables: `advice.py`), the measured host
rates (`host_rates.py`), data-parallel ranks in the model (`ranks.py`) and the command line (`command.py`).

May import: `engine` (the byte counts it holds: selected-column state, gradient slots, the accumulation margin),
`settings`, `hf_zenflow._base`. Not `hf`, `compare` or `tuning` (`compare` and `tuning` use it for their
projections).
"""

from __future__ import annotations
