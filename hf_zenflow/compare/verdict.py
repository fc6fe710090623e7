"""The verdict `hf-zenflow compare` ends with: what its own figures say, in a few sentences.

- **Speed**, against each baseline: ZenFlow's whole-run time as a multiple of the baseline's, and an interval. The
  timed steps are cut into blocks of the steps the runs took turns in (the same blocks when they ran one after the
  other); each block's time ratio (its steps' times, with the wait for the run's own host work at the end of a turn)
  pairs the same batches. The geometric mean of the block ratios and its 95 % t-interval (over the logarithms) say
  whether a difference is shown: "no difference shown" when the interval holds 1. Blocks, not steps, because
  neighbouring steps share the machine's state of the moment.
- **Device memory**: ZenFlow's peak against each baseline's, and what it was held to (`--device-memory-limit-bytes`).
- **Quality**: the held-out metric and loss against each baseline; one seed is one seed.
- **The projection**: why the GPU profiles' projected times differ from what this machine measured, and, on each
  profile where ZenFlow's projected step is longer than no offload's, why (the side that bounds it).

Example:
    >>> [round(x, 3) for x in speed_interval([1.0, 1.1, 0.9, 1.05])]  # geometric mean, its 95 % interval, blocks
    [1.01, 0.881, 1.158, 4]
"""

from __future__ import annotations

import math
from typing import Any

from hf_zenflow.compare.metrics import is_cost, is_fraction, metric_key
from hf_zenflow.compare.paired_stats import paired_interval
from hf_zenflow.compare.report import SHORT_NAMES, format_size
from hf_zenflow.estimate.speed_words import than, versus


#: Fewer timed steps than this and the per-step statistics (p10–p90) and the speed interval say little: compare warns.
MIN_TIMED_STEPS = 20


def block_ratios(run: dict[str, Any], baseline: dict[str, Any], first: int, block: int) -> list[float]:
    """Per block of `block` steps from step `first` on: `run`'s time over `baseline`'s for the same steps (each step's
    ``step_ms`` plus its ``handover_ms``, from the results' per-step curves)."""
    def times(r: dict[str, Any]) -> list[float]:
        curves = r["curves"]
        return [s + h for s, h in zip(curves["step_ms"], curves.get("handover_ms") or [0.0] * len(curves["step_ms"]))]

    a, b = times(run), times(baseline)
    n = min(len(a), len(b))
    out = []
    for lo in range(first, n, block):
        ta, tb = sum(a[lo:lo + block]), sum(b[lo:lo + block])
        if ta > 0 and tb > 0:
            out.append(ta / tb)
    return out


def speed_interval(ratios: list[float]) -> tuple[float, float | None, float | None, int]:
    """The geometric mean of `ratios`, its 95 % t-interval (None, None with fewer than two) and their count."""
    logs = [math.log(r) for r in ratios]
    if not logs:
        return math.nan, None, None, 0
    mean, half = paired_interval(logs)
    if half is None:
        return math.exp(mean), None, None, 1
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half), len(logs)


def _speed(name: str, zen: dict[str, Any], base: dict[str, Any], first: int, block: int) -> str:
    label = SHORT_NAMES[name]
    geo, lo, hi, n = speed_interval(block_ratios(zen, base, first, block))
    whole = than(zen["step_ms"], base["step_ms"], f"{label}'s")
    text = f"Speed against {label}: ZenFlow's whole run was {whole}"
    if lo is None or hi is None:
        return text + f"; too few timed steps for an interval ({n} block of {block} steps; use more --steps)."
    if lo <= 1.0 <= hi:
        shown = "no difference shown"
    else:
        shown = f"ZenFlow {'slower' if lo > 1.0 else 'faster'}"
    text += (f"; per block of {block} steps {geo:.3f}× its time (95 % interval {lo:.3f}–{hi:.3f}, {n} blocks): "
             f"{shown}")
    parts = []
    for key, what, stat in (("forward_backward_ms_mean", "forward + backward", "mean"),
                            ("opt_step_ms_median", "optimizer.step", "median")):
        if zen.get(key) is not None and base.get(key) is not None:
            parts.append(f"{what} {zen[key]:.1f} against {base[key]:.1f} ms ({stat})")
    return text + (f"; {', '.join(parts)}." if parts else ".")


def _memory(results: dict[str, dict[str, Any]], option: Any) -> str | None:
    zen = results["zenflow"]
    key = "peak_device_bytes" if zen.get("peak_device_bytes") else "peak_device_memory_bytes"
    if not zen.get(key):
        return None
    text = f"Device memory: ZenFlow's peak {format_size(zen[key])}"
    if zen.get("peak_device_bytes_per_param") and key == "peak_device_bytes":
        text += f" ({zen['peak_device_bytes_per_param']:.1f} B/param)"
    others = [f"{zen[key] / r[key]:.2f}× {SHORT_NAMES[n]}'s {format_size(r[key])}" for n, r in results.items()
              if n != "zenflow" and r.get(key)]
    if others:
        text += ", " + " and ".join(others)
    limit = zen.get("device_memory_limit_bytes")
    if option == "free" or limit is None:
        text += "; it had the device's free memory (--device-memory-limit-bytes free)"
    else:
        held = "within" if zen[key] <= limit else "above"
        what = ", synchronous offload's weights and gradients" if option == "sync" else ""
        text += f"; held to {format_size(limit)}{what} (--device-memory-limit-bytes), {held} it"
    return text + "."


def _quality(results: dict[str, dict[str, Any]], metric_name: str) -> str:
    zen = results["zenflow"]
    key = metric_key(metric_name)
    parts = []
    for name, r in results.items():
        if name == "zenflow":
            continue
        if is_cost(metric_name):
            diff = f"{zen[key] / r[key]:.3f}×"
        elif is_fraction(metric_name):
            diff = f"{100 * (zen[key] - r[key]):+.2f} points"
        else:
            diff = f"{zen[key] - r[key]:+.4g}"
        parts.append(f"{SHORT_NAMES[name]} {r[key]:.4f} ({diff}), loss {r['eval_loss']:.4f} "
                     f"({zen['eval_loss'] / r['eval_loss']:.3f}×)")
    text = (f"Quality: held-out {metric_name} {zen[key]:.4f} and loss {zen['eval_loss']:.4f}"
            + (f" against {'; '.join(parts)}" if parts else ""))
    reference = results.get("adamw_torch")
    if reference is not None and not is_cost(metric_name):
        metric_better, loss_better = zen[key] > reference[key], zen["eval_loss"] < reference["eval_loss"]
        if zen[key] != reference[key] and metric_better != loss_better:
            text += f" (the {metric_name} and the loss disagree in direction)"
    return text + (". One seed is one seed: rerun with a few --seed values (or hf-zenflow tune) before reading the "
                   "difference as ZenFlow's, not the seed's.")


def _ms(value: float) -> str:
    """A time in ms: whole ms from 100 up, else three significant figures."""
    return f"{value:.0f}" if value >= 100 else f"{value:.3g}"


def _projection(results: dict[str, dict[str, Any]], projection: dict[str, Any], params_ran: float,
                cuda: bool, device_cores: int | None) -> list[str]:
    profiles = projection.get("profiles") or {}
    if not profiles:
        return []
    base = results.get("adamw_torch") or next(iter(results.values()))
    first_name, first_rows = next(iter(profiles.items()))
    no_offload = first_rows.get("adamw_torch") or next(iter(first_rows.values()))
    if cuda:
        here = "this GPU"
    else:
        here = f"{device_cores} CPU core{'s' if device_cores != 1 else ''} (--device-cores)"
    fb, step = base.get("forward_backward_ms_mean"), base.get("step_ms_mean")
    text = f"Why the projection differs from what this machine measured: here the device is {here}"
    if fb and step:
        text += (f", and {SHORT_NAMES[base['optimizer']]}'s forward + backward took {_ms(fb)} of its {_ms(step)} ms "
                 f"per step: the optimizer, and with it all that offloading costs and ZenFlow's overlap hides, was "
                 f"{max(0.0, 1 - fb / step):.0%} of a step")
    text += (f". A GPU runs forward and backward far faster ({first_name}: a whole no-offload step "
             f"{no_offload['step_ms']:.4g} ms projected) while the host's AdamW and the link are not faster, so there "
             "the offloaded side can set the step")
    size = projection.get("params") or params_ran
    if abs(size - params_ran) > 0.01 * params_ran:
        text += f"; and the projection is of {size / 1e9:.3g}B parameters, not the {params_ran / 1e6:.1f}M that ran"
    lines = [text + "."]
    losing = [(name, rows) for name, rows in profiles.items() if "zenflow" in rows and "adamw_torch" in rows
              and rows["zenflow"]["step_ms"] > rows["adamw_torch"]["step_ms"]]
    if not losing:
        return lines
    where = []
    for name, rows in losing:
        zen, none = rows["zenflow"], rows["adamw_torch"]
        item = f"{name} {zen['step_ms']:.4g} against {none['step_ms']:.4g} ms, {zen['bound']}-bound"
        if zen["bound"] != "device":
            side = zen[f"{zen['bound']}_ms"]
            item += f": its {zen['bound']} side {side:.4g} ms against {zen['device_ms']:.4g} ms of GPU work"
        where.append(item + ("" if none.get("fits_device_memory") else "; no offload does not fit this GPU"))
    text = f"Where the projection has ZenFlow slower than no offload ({'; '.join(where)})"
    bounds = {rows["zenflow"]["bound"] for _, rows in losing}
    if bounds & {"host", "link"}:
        text += (": the offloaded part's AdamW passes on the host, or its bytes over the link, take longer than the "
                 "GPU's forward and backward of a model this size, and no offload does none of that work")
    if all(rows["adamw_torch"].get("fits_device_memory") for _, rows in losing):
        text += "; no offload fits there, and offloading pays only where the model's state does not fit the GPU"
    faster = [f"{versus(rows['zenflow']['step_ms'], rows['sync_offload']['step_ms'])} on {name}"
              for name, rows in losing if "sync_offload" in rows]
    if faster:
        text += f". Against synchronous offload, which offloads the same, ZenFlow is {', '.join(faster)}"
    return [*lines, text + "."]


def verdict(results: dict[str, dict[str, Any]], projection: dict[str, Any] | None, metric_name: str, first: int,
            block: int, memory_limit: Any, params_ran: float, cuda: bool = False,
            device_cores: int | None = None) -> list[str]:
    """The verdict's paragraphs (see the module docstring); empty without a ZenFlow run."""
    zen = results.get("zenflow")
    if zen is None:
        return []
    lines = [_speed(name, zen, r, first, block) for name, r in results.items() if name != "zenflow"]
    memory = _memory(results, memory_limit)
    lines += [memory] if memory else []
    lines.append(_quality(results, metric_name))
    lines += _projection(results, projection or {}, params_ran, cuda, device_cores)
    return lines


__all__ = ["MIN_TIMED_STEPS", "block_ratios", "speed_interval", "verdict"]
