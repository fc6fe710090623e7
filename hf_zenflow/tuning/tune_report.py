"""What `hf-zenflow tune` writes: ``tune.json``, ``tune.md`` (the trials table and the recommendation),
``recommended.py`` and ``pareto.png`` (quality loss against modelled speed-up, the front and the recommended point)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hf_zenflow.atomic import save_figure, write_json, write_text
from hf_zenflow.compare.metrics import is_fraction


def _delta(value: float, points: bool) -> str:
    return f"{100 * value:+.1f}" if points else f"{value:+.4g}"


def format_table(payload: dict[str, Any]) -> str:
    ref = payload["reference"]
    metric = payload["task"].get("metric", "accuracy")
    points = is_fraction(metric)  # a share such as accuracy: its difference in points
    lines = [f"| setting | held-out loss | vs adamw_torch | {metric} diff{' (points)' if points else ''} | steps/s | "
             "critical path ms | "
             "mean window | modelled speed-up vs sync offload | Pareto | |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    if ref:
        lines.append(f"| adamw_torch (reference) | {ref['eval_loss']:.4f} | - | - | {ref['steps_per_s']:.2f} | "
                     f"{ref['critical_path_ms']:.1f} | - | - | | |")
    for r in payload["trials"]:
        window = "-" if r["mean_window"] is None else f"{r['mean_window']:.1f}"
        lines.append(f"| {r['label']} | {r['eval_loss']:.4f} | {r['quality_loss_pct']:+.2f} % | "
                     f"{_delta(r['metric_delta'], points)} | {r['steps_per_s']:.2f} | {r['critical_path_ms']:.1f} | "
                     f"{window} | {r['modelled_speedup']:.2f}x | {'yes' if r['pareto'] else ''} | "
                     f"{'**recommended**' if r['recommended'] else ('diverged' if r.get('diverged') else '')} |")
    return "\n".join(lines)


def format_recommendation(payload: dict[str, Any]) -> str:
    rec = payload["recommendation"]
    if rec is None:
        return "No ZenFlow trial finished: no recommendation."
    tol = payload["config"]["max_quality_loss_pct"]
    head = (f"Recommended: **{rec['label']}** (the fastest Pareto point within {tol:g} % of adamw_torch's held-out "
            "loss)." if rec["within_tolerance"] else
            f"No setting tried came within {tol:g} % of adamw_torch's held-out loss; the closest Pareto point that is "
            f"faster than synchronous offload is **{rec['label']}**: the trade-off curve is in pareto.png.")
    return "\n".join([head, "", "```python", "from hf_zenflow import ZenFlowTrainingArguments", "",
                      f"args = {rec['training_arguments']}", "```", "", "Command-line flags (HfArgumentParser):",
                      "", f"```\n{rec['cli_flags']}\n```"])


def write_outputs(payload: dict[str, Any], out_dir: Path) -> None:
    write_json(out_dir / "tune.json", payload, indent=2, default=str)
    t = payload["task"]
    hw = payload["hardware"]
    md = [f"# hf-zenflow tune: {t['model']}", "",
          (f"{payload['machine']['date_utc']} UTC; {t['dataset']}; {t['train_examples']} train / "
           f"{t['eval_examples']} held-out; {payload['config']['steps']} steps x batch "
           f"{payload['config']['batch_size']}, lr {payload['config']['lr']}, seed {payload['config']['seed']}; "
           f"speed-up modelled on `{hw['name']}` for {payload['modelled_params'] / 1e6:.1f}M params and "
           f"{payload['modelled_tokens_per_step']:.0f} tokens/step (hardware.schedule_model; a model, not a "
           f"measurement); {payload['seconds']:.0f} s wall."
           + (" Interrupted: the table holds the trials that finished." if payload["interrupted"] else "")),
          "", format_table(payload), ""]
    if payload["skipped"]:
        md += [f"Not run (budget): {', '.join(payload['skipped'])}.", ""]
    if payload.get("over_budget_s"):
        md += [f"The run took {payload['over_budget_s']:.0f} s longer than the budget: the adamw_torch reference "
               "always runs, and no trial starts once the budget cannot hold it; shorten --steps / --eval-size for a "
               "tighter budget.", ""]
    md += [format_recommendation(payload), "",
           "Quality is one seed per trial: differences below the seed-to-seed noise of a short fine-tune are ties."]
    write_text(out_dir / "tune.md", "\n".join(md) + "\n")
    rec = payload["recommendation"]
    if rec:
        write_text(out_dir / "recommended.py",
                   "from hf_zenflow import ZenFlowTrainingArguments\n\n" f"args = {rec['training_arguments']}\n")
    plot_pareto(payload, out_dir / "pareto.png")


def plot_pareto(payload: dict[str, Any], path: Path) -> None:
    from hf_zenflow.compare.plots import pyplot

    plt = pyplot()

    rows = payload["trials"]
    fig, ax = plt.subplots(figsize=(8.5, 5.5))
    if rows:
        xs = [r["modelled_speedup"] for r in rows]
        ys = [r["quality_loss_pct"] for r in rows]
        colors = {0.05: "#dd8452", 0.1: "#4c72b0", 0.2: "#55a868"}
        for r, x, y in zip(rows, xs, ys):
            marker = "o" if r["setting"]["host_step"] == "zenflow" else "s"
            ax.scatter(x, y, s=60, marker=marker, color=colors.get(r["setting"]["topk_ratio"], "#8c8c8c"),
                       edgecolors="black", linewidths=0.5, zorder=3)
            ax.annotate(r["label"], (x, y), textcoords="offset points", xytext=(5, 4), fontsize=7)
        front = sorted((r for r in rows if r["pareto"]), key=lambda r: r["modelled_speedup"])
        ax.plot([r["modelled_speedup"] for r in front], [r["quality_loss_pct"] for r in front], color="#c44e52",
                linewidth=1.5, zorder=2, label="Pareto front")
        best = next((r for r in rows if r["recommended"]), None)
        if best:
            ax.scatter(best["modelled_speedup"], best["quality_loss_pct"], s=320, marker="*", color="gold",
                       edgecolors="black", zorder=4, label=f"recommended: {best['label']}")
        tol = payload["config"]["max_quality_loss_pct"]
        ax.axhline(tol, color="#8c8c8c", linestyle="--", linewidth=1, label=f"tolerance {tol:g} %")
        ax.axhline(0, color="black", linewidth=0.6)
        for ratio, color in colors.items():
            if any(r["setting"]["topk_ratio"] == ratio for r in rows):
                ax.scatter([], [], color=color, label=f"topk_ratio {ratio:g}")
        ax.scatter([], [], marker="o", color="white", edgecolors="black", label='host_step "zenflow"')
        ax.scatter([], [], marker="s", color="white", edgecolors="black", label='host_step "auto"')
    hw = payload["hardware"]["name"]
    ax.set_xlabel(f"modelled speed-up over synchronous offload on {hw} "
                  f"({payload['modelled_params'] / 1e6:.0f}M params)")
    ax.set_ylabel("held-out loss vs adamw_torch (%; lower is better)")
    ax.set_title(f"hf-zenflow tune: {payload['task']['model']} ({payload['config']['steps']} steps, one seed)",
                 fontsize=10)
    ax.grid(alpha=0.3)
    if rows:
        ax.legend(fontsize=7, loc="best")
    else:
        ax.text(0.5, 0.5, "no ZenFlow trial finished", ha="center", va="center", transform=ax.transAxes)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)
