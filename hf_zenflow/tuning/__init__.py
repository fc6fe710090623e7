"""`hf-zenflow tune` and `hf_zenflow.tune`: paired short runs of the settings that matter, scored on held-out quality
and the modelled speed on a hardware profile.

Owns the tuner (`tune.py`), its grid (`tune_grid.py`), the Pareto front (`pareto.py`), paired statistics
(`paired_stats.py`) and its report (`tune_report.py`). (Named `tuning`, not `tune`: `hf_zenflow.tune` is the function.)

May import: `compare` (one timed training run, the data, the metrics), `estimate` (the bound model), `settings`,
`hf_zenflow._extras`.
"""
