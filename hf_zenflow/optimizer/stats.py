"""`ZenFlowAdamW.stats()`: the step counters, the schedule's counts, where the state lives and the host worker's last
job times, gathered from the engine's parts (the per-step timing itself is `engine.telemetry`)."""

from __future__ import annotations

from typing import Any

from ..engine.device_memory import DeviceMemoryMeter
from ..engine.host_lr import host_lr_scale, peak_lr, rule_beta1, rule_window, window_lag
from ..engine.schedule import WindowSchedule
from ..engine.telemetry import ZenFlowStats, state_sizes
from ..engine.windows import HostWindows
from ..settings.config import ZenFlowConfig


def optimizer_stats(
    stats: ZenFlowStats,
    schedule: WindowSchedule | None,
    config: ZenFlowConfig,
    splits: dict,
    dense: dict,
    host: HostWindows,
    meter: DeviceMemoryMeter | None = None,
) -> dict[str, float | str]:
    """`ZenFlowAdamW.stats()`: the step counters of `stats` with the schedule's counts, the state sizes and the host
    worker's last job times; ``"accumulate_on"``: where windows are summed, "host", "device" or "device_bf16"
    ("auto" until its choice at the first step)."""
    stats.collect_device_time()  # (write-back copies that have run since the step)
    worker_ms: dict[str, Any] = host.worker.last_job_ms if host.worker is not None else {}
    # the last closed window; before the first one, the configured interval (auto: the open window so far)
    interval = (
        schedule.last_interval
        if schedule and schedule.last_interval
        else (schedule.window_steps if schedule else 0)
        if config.is_auto_interval
        else schedule.update_interval if schedule and schedule.update_interval else config.update_interval
    )
    # before the first step: what the rule will choose (`new_schedule`)
    high = schedule.high_lr_window if schedule else rule_window(config, host.groups)
    if schedule is None:
        interval = high or interval
    lr_scale = host.lr_scale.last
    if lr_scale is None:  # before the first window closes: what the next full window will take
        window = int(interval) or config.rules.auto_max_interval
        lr_scale = host_lr_scale(
            config.rules.host_lr_scale,
            window,
            peak_lr(host.groups[0]) if host.groups else 0.0,
            window_lag(schedule, config.overlap_step, window),
        )
    # `high_lr_rule="auto"`: the shortened window (0: not engaged) and the host beta1 of the first group
    beta1 = host.groups[0]["betas"][0] if host.groups else 0.9
    if high is not None:
        beta1 = rule_beta1(config, beta1, high, window_lag(schedule, config.overlap_step, high))
    out: dict[str, float | str] = {"accumulate_on": host.accumulate_on or "auto"}
    return out | stats.as_dict(
        **state_sizes(splits, dense),
        **(meter.as_dict() if meter is not None else {}),
        update_interval=float(interval),
        host_lr_scale=lr_scale,
        writeback_lag=float(schedule.writeback_lag if schedule and schedule.writeback_lag else interval),
        high_lr_window=float(high or 0),
        host_beta1=beta1,
        host_step_guard=host.guard.factor_for(config.rules.host_step_guard),  # (1.0: not engaged, or "off")
        host_step_guard_engaged=host.guard.engaged,
        host_threads=config.resolved_cpu_threads,
        steps=schedule.steps if schedule else 0,
        windows=schedule.windows if schedule else 0,
        reselections=schedule.reselections if schedule else 0,
        host_step_ms=worker_ms.get("host_adamw", 0.0),
        accumulate_ms=worker_ms.get("accumulate", 0.0),
        pinned_host_bytes=sum(t.pinned_bytes for t in host.transports.values()),
        ranks=host.reduce_group.ranks,
        gather_buffer_bytes=host.shards.buffer_bytes,
        # the run's threshold: the setting, or what device_memory_limit_bytes chose at the first step
        min_offload_numel=float(schedule.offload_threshold(config) if schedule else config.min_offload_numel),
    )


__all__ = ["optimizer_stats"]
