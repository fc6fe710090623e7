"""Plots of `hf-zenflow compare`: loss_curves.png and time_breakdown.png (matplotlib, Agg backend, imported lazily).

time_breakdown.png reads top-left to bottom-right: the optimizer's critical path (median with its p10-p90 spread,
ZenFlow's ratio to each baseline in the title), where a training step's time goes (mean), what the engines spend
their critical path on (their own phase timers), and every step's critical path (a rolling median over the raw
steps). Legends sit outside the data; numbers sit in tick labels and titles, where no bar can cover them.
"""

from __future__ import annotations

import statistics
import textwrap
from pathlib import Path
from typing import Any

from hf_zenflow._extras import require


LABELS = {
    "adamw_torch": "adamw_torch (no offload)",
    "sync_offload": "SyncOffloadAdamW",
    "zenflow": "ZenFlowAdamW",
}
COLORS = {"adamw_torch": "#4c72b0", "sync_offload": "#dd8452", "zenflow": "#55a868"}

#: Phases of the engines' step() as their telemetry names them (`hf_zenflow.engine.telemetry.PHASES`).
ENGINE_PHASES = ("norms", "select", "device_update", "handoff", "wait", "writeback", "host_update")

#: Window of the rolling median in the every-step panel.
ROLLING_STEPS = 10


def pyplot() -> Any:
    """matplotlib's pyplot on the Agg backend (files only, no display), or `MissingExtraError` naming the extra."""
    require("compare", "plotting (hf_zenflow.compare.plots)", modules=["matplotlib"])
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def rolling_median(values: list[float], window: int) -> list[float]:
    """Median of the last `window` values at every position (fewer at the start).

    Example:
        >>> rolling_median([1.0, 9.0, 2.0, 3.0], 3)
        [1.0, 5.0, 2.0, 3.0]
    """
    return [statistics.median(values[max(0, i + 1 - window):i + 1]) for i in range(len(values))]


def plot_loss_curves(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(9, 5))
    for name, r in results.items():
        loss = r["curves"]["loss"]
        ema, smooth = None, []
        for v in loss:  # exponential moving average: the raw per-batch loss is too noisy to compare by eye
            ema = v if ema is None else 0.9 * ema + 0.1 * v
            smooth.append(ema)
        steps = range(1, len(loss) + 1)
        ax.plot(steps, loss, color=COLORS[name], alpha=0.2, linewidth=0.8)
        # SyncOffloadAdamW runs the same AdamW arithmetic as adamw_torch, so their curves coincide: dash one.
        ax.plot(steps, smooth, color=COLORS[name], linewidth=2, linestyle="--" if name == "sync_offload" else "-",
                label=f"{LABELS[name]}: train loss (EMA 0.9); held-out loss {r['eval_loss']:.3f} (star)")
        ax.scatter([len(loss)], [r["eval_loss"]], color=COLORS[name], marker="*", s=140, zorder=5,
                   edgecolors="black")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss")
    ax.set_title(textwrap.fill(title, 100), fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=1, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _legend_below(ax: Any, ncol: int) -> None:
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=ncol, frameon=False)


def _stacked_bars(ax: Any, names: list[str], segments: list[tuple[str, Any, list[float]]], total_fmt: str,
                  xlabel: str, title: str, ncol: int) -> None:
    """Horizontal bars, one per optimizer in `names`, stacked from `segments` (label, color, one value per name),
    each labelled with its total; the legend goes below the axes."""
    left = [0.0] * len(names)
    for label, color, vals in segments:
        ax.barh(range(len(names)), vals, left=left, color=color, label=label)
        left = [a + v for a, v in zip(left, vals)]
    for i, total in enumerate(left):
        ax.text(total, i, " " + total_fmt.format(total), va="center", fontsize=9)
    ax.set_xlim(0, max(left) * 1.18 or 1.0)
    ax.set_yticks(range(len(names)), [LABELS[n] for n in names])
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    ax.set_title(title, fontsize=10, loc="left")
    _legend_below(ax, ncol)


def _step_parts(ax: Any, results: dict[str, dict[str, Any]], names: list[str], skip: int) -> None:
    """Stacked horizontal bars: mean ms per training step by part."""
    parts = [("forward_backward_ms_mean", "forward + backward", "#9e9e9e"),
             ("clip_ms_mean", "grad-norm clip", "#c44e52"),
             ("opt_step_ms_mean", "optimizer.step", "#8172b3"),
             ("other_ms_mean", "scheduler + zero_grad", "#ccb974")]
    totals = [sum(results[n].get(key) or 0.0 for key, _, _ in parts) for n in names]
    segments = []
    for key, label, color in parts:
        vals = [results[n].get(key) or 0.0 for n in names]
        if max(vals) < 0.02 * min(totals):  # a sliver nobody can see: say how big it is
            label += f" ({min(vals):.1f}–{max(vals):.1f} ms, too thin to see)"
        segments.append((label, color, vals))
    _stacked_bars(ax, names, segments, "{:.0f} ms", f"ms per training step (mean over steps {skip + 1}–)",
                  "Where a training step's time goes", ncol=2)


def _critical_path(ax: Any, results: dict[str, dict[str, Any]], names: list[str], skip: int) -> None:
    """Median optimizer.step per optimizer with its p10-p90 whisker; the title gives ZenFlow's ratios."""
    medians = [results[n].get("opt_step_ms_median") or 0.0 for n in names]
    lo = [m - (results[n].get("opt_step_ms_p10") or m) for n, m in zip(names, medians)]
    hi = [(results[n].get("opt_step_ms_p90") or m) - m for n, m in zip(names, medians)]
    ax.barh(range(len(names)), medians, color=[COLORS[n] for n in names], xerr=[lo, hi], capsize=5,
            error_kw={"elinewidth": 1.2, "ecolor": "black"})
    # the numbers go into the tick labels, where no whisker or axis limit can hide them
    ticks = [f"{LABELS[n]}\nmedian {m:.1f} ms, mean {results[n].get('opt_step_ms_mean') or 0.0:.1f}"
             for n, m in zip(names, medians)]
    ax.set_yticks(range(len(names)), ticks)
    ax.invert_yaxis()
    ax.set_xlim(0, max(m + h for m, h in zip(medians, hi)) * 1.05 or 1.0)
    ax.set_xlabel(f"optimizer.step ms per step: bar median, whisker p10–p90 (steps {skip + 1}–)")
    title = "The optimizer's critical path (time inside optimizer.step)"
    zen = results.get("zenflow", {}).get("opt_step_ms_median")
    ratios = [f"{zen / results[b]['opt_step_ms_median']:.2f}× {LABELS[b].split(' ')[0]}'s"
              for b in ("sync_offload", "adamw_torch") if zen and results.get(b, {}).get("opt_step_ms_median")]
    if ratios:
        title += "\nZenFlow's median = " + ", ".join(ratios)
    ax.set_title(title, fontsize=10, loc="left")
    ax.grid(alpha=0.3, axis="x")


def _engine_phases(ax: Any, results: dict[str, dict[str, Any]], names: list[str], skip: int) -> None:
    """Stacked horizontal bars of the engines' own phase timers (mean ms per step)."""
    engines = [n for n in names if results[n].get("engine_phases_ms_mean")]
    if not engines:
        ax.axis("off")
        return
    cmap = pyplot().get_cmap("tab10")
    segments = []
    for j, phase in enumerate(ENGINE_PHASES):
        vals = [results[n]["engine_phases_ms_mean"].get(phase) or 0.0 for n in engines]
        if any(vals):
            segments.append((phase.replace("_", " "), cmap(j), vals))
    _stacked_bars(ax, engines, segments, "{:.1f} ms",
                  f"ms per step, the engine's own phase timers (mean over steps {skip + 1}–)",
                  "Inside the offloading engines' optimizer.step", ncol=4)


def _every_step(ax: Any, results: dict[str, dict[str, Any]], names: list[str]) -> None:
    """Every step's optimizer.step: raw points, faint, and a rolling median line."""
    for n in names:
        opt_ms = results[n]["curves"]["opt_ms"]
        steps = range(1, len(opt_ms) + 1)
        ax.scatter(steps, opt_ms, color=COLORS[n], s=10, alpha=0.35, linewidths=0)
        ax.plot(steps, rolling_median(opt_ms, ROLLING_STEPS), color=COLORS[n], linewidth=2,
                label=f"{LABELS[n]}")
    ax.set_yscale("log")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("ms (log scale)")
    ax.set_title(f"optimizer.step, every step: dots raw, line rolling median of {ROLLING_STEPS}", fontsize=10,
                 loc="left")
    ax.grid(alpha=0.3, which="both")
    _legend_below(ax, 3)


def plot_time_breakdown(results: dict[str, dict[str, Any]], path: Path, title: str, skip: int,
                        banner: str | None = None) -> None:
    """The four panels; `banner` (the busy-machine line, or None) goes under the title in red."""
    plt = pyplot()
    names = list(results)
    fig, axes = plt.subplots(2, 2, figsize=(15, 9))
    _critical_path(axes[0][0], results, names, skip)
    _step_parts(axes[0][1], results, names, skip)
    _engine_phases(axes[1][0], results, names, skip)
    _every_step(axes[1][1], results, names)
    fig.suptitle(textwrap.fill(title, 150), fontsize=10, y=0.995)
    top = 0.965
    if banner:
        fig.text(0.5, 0.965, textwrap.fill(banner, 150), color="#b00020", fontsize=10, fontweight="bold",
                 ha="center", va="top")
        top = 0.945 - 0.02 * textwrap.fill(banner, 150).count("\n")
    fig.tight_layout(rect=(0, 0, 1, top))
    fig.savefig(path, dpi=100)
    plt.close(fig)
