"""Paired differences over seeds, their mean and t-based 95 % interval: `hf_zenflow.compare.paired_stats`, importable
from here too (the tuner and the quality scripts use them)."""

from hf_zenflow.compare.paired_stats import paired_interval, t95


__all__ = ["paired_interval", "t95"]
