"""Tables of `hf-zenflow compare`: a short headline table for the terminal, the full table for results.md.

One convention throughout: every ratio is **ZenFlow ÷ baseline of a cost** (time, bytes, memory, loss), so below 1×
means ZenFlow needs less; accuracy is a difference (ZenFlow minus baseline, in points). Every row names its statistic
(median, p10-p90, mean, whole run) and the per-step statistics are over the steps after `timing_skip`.

Example:
    >>> format_ratio(0.2734), format_points(-0.4), format_size(90_734_592)
    ('0.27×', '-0.40 pts', '86.5 MiB')
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hf_zenflow.compare.compare_config import OPTIMIZERS
from hf_zenflow.compare.metrics import is_cost, is_fraction, metric_key
from hf_zenflow.hf.model_card import format_bytes


BASELINES = ("adamw_torch", "sync_offload")
#: Column headers: short enough for an ~110-character terminal table.
SHORT_NAMES = {"adamw_torch": "adamw_torch", "sync_offload": "sync offload", "zenflow": "ZenFlow"}
#: A mean ratio and a median ratio further apart than this factor are called out: a few slow steps rule the mean.
MEAN_MEDIAN_DISAGREEMENT = 1.5


def format_ratio(value: float | None) -> str:
    if value is None:
        return "n/a"
    return f"{value:.3f}×" if abs(value) < 0.1 else f"{value:.2f}×"


def format_points(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.2f} pts"


def format_delta(value: float | None) -> str:
    return "n/a" if value is None else f"{value:+.4g}"


def format_size(value: float | None) -> str:
    return "n/a" if value is None else format_bytes(value)


def format_utilization(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.0f} %"


def format_ms(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.1f}"


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


@dataclass(frozen=True)
class Row:
    """One row of the comparison: a label that names the statistic, how to print one optimizer's value, and the
    result key the ZenFlow ÷ baseline ratio is taken of (None: no ratio column)."""

    label: str
    cell: Callable[[dict[str, Any]], str]
    ratio_key: str | None = None
    headline: bool = False


def _get(key: str, fmt: Callable[[Any], str]) -> Callable[[dict[str, Any]], str]:
    return lambda r: fmt(r.get(key))


def format_spread(r: dict[str, Any]) -> str:
    """p10–p90 of one optimizer's optimizer.step ms: ``"12.1–30.2"``."""
    lo, hi = r.get("opt_step_ms_p10"), r.get("opt_step_ms_p90")
    return "n/a" if lo is None or hi is None else f"{lo:.1f}–{hi:.1f}"


def _step_time(r: dict[str, Any]) -> str:
    return f"{r['step_ms']:.0f} ({r['steps_per_s']:.2f}/s)"


def _load(r: dict[str, Any]) -> str:
    load = r.get("machine_load") or {}
    if load.get("others_cores") is None:
        return "n/a"
    steal = load.get("steal_fraction")
    return f"{load['others_cores']:.2f}" + ("" if steal is None else f", {100 * steal:.1f} %")


def _peak_device(r: dict[str, Any]) -> str:
    peak, per_param = r.get("peak_device_bytes"), r.get("peak_device_bytes_per_param")
    if peak is None:
        return "n/a"
    # (compact: the headline table must fit an ordinary terminal)
    return f"{peak / 2**20:.0f} MiB {per_param:.1f}" if per_param else format_size(peak)


def rows(metric_name: str, cuda: bool) -> list[Row]:
    """Every row of the full table; `headline` marks the terminal's subset."""
    memory = (Row("peak device memory", _get("peak_device_memory_bytes", format_size), "peak_device_memory_bytes",
                  headline=True) if cuda else None)
    out = [
        Row(f"held-out {metric_name}", _get(metric_key(metric_name), "{:.4f}".format), metric_key(metric_name),
            headline=True),
        Row("held-out loss", _get("eval_loss", "{:.4f}".format), "eval_loss", headline=True),
        Row("train loss, mean of the last 10% of steps", _get("train_loss", "{:.4f}".format), "train_loss"),
        Row("ms per step, whole run (steps/s)", _step_time, "step_ms", headline=True),
        # a share, not a cost: no ZenFlow ÷ baseline ratio
        Row("device utilisation, busy share", _get("device_utilization", format_utilization),
            headline=True),
        Row("optimizer.step ms, median", _get("opt_step_ms_median", format_ms), "opt_step_ms_median", headline=True),
        Row("optimizer.step ms, p10–p90", format_spread, headline=True),
        Row("optimizer.step ms, mean", _get("opt_step_ms_mean", format_ms), "opt_step_ms_mean", headline=True),
        Row("  engine's own critical-path timer, mean", _get("engine_critical_path_ms_mean", format_ms),
            "engine_critical_path_ms_mean"),
        Row("forward + backward ms, mean", _get("forward_backward_ms_mean", format_ms), "forward_backward_ms_mean"),
        Row("grad-norm clip ms, mean", _get("clip_ms_mean", format_ms), "clip_ms_mean"),
        Row("scheduler + zero_grad ms, mean", _get("other_ms_mean", format_ms), "other_ms_mean"),
        Row("host AdamW ms, mean per host step", _get("host_step_ms_mean", format_ms)),
        Row("final flush ms (once, after the last step)", _get("flush_ms", format_ms)),
        Row("bytes to host per step, mean", _get("bytes_to_host_per_step", format_size), "bytes_to_host_per_step",
            headline=True),
        Row("bytes to device per step, mean", _get("bytes_to_device_per_step", format_size),
            "bytes_to_device_per_step", headline=True),
        Row("optimizer state on device", _get("optimizer_state_device_bytes", format_size),
            "optimizer_state_device_bytes", headline=True),
        Row("optimizer state on host", _get("optimizer_state_host_bytes", format_size), "optimizer_state_host_bytes"),
        memory,
        # weights + gradients on the device + optimizer device state (a CPU device: counted, `device_memory.py`)
        Row("peak device memory, MiB B/param", _peak_device, "peak_device_bytes", headline=True),
        Row("  the last step's peak", _get("step_peak_device_bytes", format_size), "step_peak_device_bytes"),
        Row("parameters offloaded", _get("offloaded_params_fraction", format_utilization), headline=True),
        # the three runs share one process, so a later run's peak includes what earlier runs left: no ratio
        Row("host RSS peak, whole process", _get("host_rss_peak_bytes", format_size), headline=not cuda),
        Row("other processes' CPU: cores, steal", _load, headline=True),
    ]
    return [r for r in out if r is not None]


def ratios(results: dict[str, dict[str, Any]], metric_name: str = "accuracy",
           cuda: bool = False) -> dict[str, dict[str, float | None]]:
    """ZenFlow relative to each baseline that ran: ``{"zenflow_vs_<baseline>": {"<key>_ratio": ZenFlow ÷ baseline,
    "eval_accuracy_delta_points": ...}}``; below 1 means ZenFlow needs less. The held-out metric (`metric_name`) is
    a difference when it is a score (``<key>_delta_points`` for a share such as accuracy, else ``<key>_delta``) and a
    ratio when it is a cost (perplexity)."""
    out: dict[str, dict[str, float | None]] = {}
    z = results.get("zenflow")
    if z is None:
        return out
    for base in BASELINES:
        b = results.get(base)
        if b is None:
            continue
        entry: dict[str, float | None] = {}
        for row in rows(metric_name, cuda):
            if row.ratio_key == metric_key(metric_name) and not is_cost(metric_name):
                diff = z[row.ratio_key] - b[row.ratio_key]
                if is_fraction(metric_name):
                    entry[f"{row.ratio_key}_delta_points"] = 100 * diff
                else:
                    entry[f"{row.ratio_key}_delta"] = diff
            elif row.ratio_key is not None:
                entry[f"{row.ratio_key}_ratio"] = _ratio(z.get(row.ratio_key), b.get(row.ratio_key))
        out[f"zenflow_vs_{base}"] = entry
    return out


def _ratio_cell(rat: dict[str, float | None], row: Row) -> str:
    if row.ratio_key is None:
        return ""
    if f"{row.ratio_key}_delta_points" in rat:
        return format_points(rat[f"{row.ratio_key}_delta_points"])
    if f"{row.ratio_key}_delta" in rat:
        return format_delta(rat[f"{row.ratio_key}_delta"])
    return format_ratio(rat.get(f"{row.ratio_key}_ratio"))


def markdown_table(header: list[str], body: list[list[str]]) -> str:
    """A Markdown table padded to aligned columns, so it reads in a terminal as well as rendered."""
    widths = [max(len(line[i]) for line in [header, *body]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"

    return "\n".join([line(header), "|" + "|".join("-" * (w + 2) for w in widths) + "|", *map(line, body)])


def comparison_table(results: dict[str, dict[str, Any]], rat: dict[str, dict[str, float | None]],
                     metric_name: str, cuda: bool, headline: bool) -> str:
    """Rows = figures, columns = the optimizers that ran, then ZenFlow ÷ each baseline (see `TABLE_CAPTION`)."""
    names = [n for n in OPTIMIZERS if n in results]
    bases = [b for b in BASELINES if f"zenflow_vs_{b}" in rat]
    header = ["figure (statistic)", *(SHORT_NAMES[n] for n in names), *(f"÷ {SHORT_NAMES[b]}" for b in bases)]
    body = []
    for row in rows(metric_name, cuda):
        if headline and not row.headline:
            continue
        body.append([row.label, *(row.cell(results[n]) for n in names),
                     *(_ratio_cell(rat[f"zenflow_vs_{b}"], row) for b in bases)])
    return markdown_table(header, body)


#: The line above every comparison table.
TABLE_CAPTION = ("ZenFlow against the baselines. \"÷ X\" columns: ZenFlow ÷ X of a cost, below 1× = ZenFlow needs "
                 "less; the held-out metric, if a score: ZenFlow minus X (in points for accuracy).")


def statistics_note(steps: int, timing_skip: int) -> str:
    first = min(timing_skip, max(0, steps - 1)) + 1
    return (f"Per-step figures (median, p10–p90, mean) are over steps {first}–{steps}: the first {first - 1} allocate "
            "the optimizer state and make the first selection. \"Whole run\" = wall time of the training loop ÷ "
            "steps. Ratios: ZenFlow ÷ baseline of a cost (time, bytes, memory, loss): below 1× ZenFlow needs less. "
            "Held-out metric: ZenFlow minus baseline (accuracy in points); perplexity, a cost, as a ratio. \"Other "
            "processes' CPU\": mean cores used by other processes on the cores this run may use, and CPU steal, "
            "during that optimizer's run (runs that take turns share one figure, over all their turns). With "
            "interleaved runs, \"whole run\" counts each run's own turns only.")


def disagreement_notes(rat: dict[str, dict[str, float | None]]) -> list[str]:
    """Baselines whose optimizer.step mean ratio and median ratio disagree by more than `MEAN_MEDIAN_DISAGREEMENT`."""
    notes = []
    for key, r in rat.items():
        mean, median = r.get("opt_step_ms_mean_ratio"), r.get("opt_step_ms_median_ratio")
        if mean and median and max(mean, median) / min(mean, median) > MEAN_MEDIAN_DISAGREEMENT:
            base = SHORT_NAMES[key.replace("zenflow_vs_", "")]
            notes.append(f"optimizer.step ZenFlow ÷ {base}: the mean ratio ({format_ratio(mean)}) and the median "
                         f"ratio ({format_ratio(median)}) disagree: a minority of slow steps rules the mean; compare "
                         "p10–p90 and the other processes' CPU of the runs.")
    return notes


def busy_warning(reasons: list[str], per_run: dict[str, dict[str, Any]], interleaved: bool = False) -> str | None:
    """The busy-machine warning for the terminal and results.md; None when the machine was quiet over the whole
    comparison and in every run. `per_run` maps optimizer name to its `LoadReport.to_dict()`; `interleaved`: the
    runs took turns (`compare.run_order`), so they shared one measurement of the load."""
    if not reasons and not any(load.get("busy") for load in per_run.values()):
        return None
    because = "; ".join(reasons) if reasons else "during some of the runs"
    if interleaved:
        return (f"WARNING: the machine was busy during this comparison ({because}). The runs took turns, so the "
                "load met them alike, but a busy machine makes every timing slower and noisier than a quiet one's: "
                "the time ratios can be off and the mean and median can diverge. Held-out accuracy, loss and bytes "
                "moved are not timings. Rerun on a quiet machine to compare times.")
    cores = "; ".join(f"{SHORT_NAMES[n]} {load['others_cores']:.2f}" for n, load in per_run.items()
                      if load.get("others_cores") is not None)
    return (f"WARNING: the machine was busy during this comparison ({because}; other processes' mean cores per run: "
            f"{cores}). Timings are slower and noisier than on a quiet machine, and the runs, one after the other, "
            "were not equally disturbed: the time ratios can be far from a quiet machine's and the mean and median "
            "can diverge. Held-out accuracy, loss and bytes moved are not timings. Rerun on a quiet machine to "
            "compare times.")


def busy_banner(whole: dict[str, Any], per_run: dict[str, dict[str, Any]]) -> str | None:
    """The busy-machine line for time_breakdown.png; None when `busy_warning` has nothing to say."""
    if busy_warning(whole.get("busy_reasons") or [], per_run) is None:
        return None
    cores = ", ".join(f"{SHORT_NAMES[n]} {load['others_cores']:.2f}" for n, load in per_run.items()
                      if load.get("others_cores") is not None)
    return (f"BUSY MACHINE: other processes used these mean cores of {whole.get('cores')} during the runs: {cores}. "
            "Timings are disturbed: see the warning in results.md")
