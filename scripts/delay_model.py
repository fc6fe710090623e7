"""A one-step-late update in plain AdamW: what the overlap's delay alone costs a fine-tune, without ZenFlow.

``run`` trains the quality study's task (`scripts/quality_study.py`) with the `hf-zenflow compare` runner's
`adamw_torch` reference — the same initial weights, batches, parameter groups, fused AdamW, warm-up schedule,
clipping and evaluation — with one change: in the matrices ZenFlow would split (2-D, at least ``--min-numel``
elements, not an embedding table), the input columns that a top-``--ratio`` selection by the step's per-column
gradient norm leaves unselected receive the update AdamW computes from step t's gradient at step t + ``--delay``
instead of at step t. The moments stay AdamW's own and every column sees every gradient, so nothing else differs from
AdamW: ``--delay 0`` is the reference itself (the same held-out loss as the quality study's `adamw_torch` run, to the
last digit), and ``--delay 1`` is the schedule of ZenFlow's overlapped one-step windows (host columns written back one
step late) without ZenFlow's code. ``--split rows`` holds back the output rows outside a top selection by row norm
instead, and ``--split elements`` the single elements outside the top ``--ratio`` by magnitude: no layout the engine
has, the most that any selection of that size keeps on time. ``--score update`` ranks by the step's AdamW update
instead of its gradient (what the moments make of the gradient, which a gradient norm does not see), and ``--score
random`` by a fresh random draw each step (the control: what any selection of that size is worth). Updates still
pending at the end are applied before the evaluation, as a save drains ZenFlow's.

``spread`` follows the reference's own trajectory (``--delay 0``) and reports, per split matrix, how its gradient
spreads: the share of the squared gradient norm on the top ``--ratio`` input columns, on the top rows and on the top
elements; the share of the step's AdamW update on the same top columns (what a selection by gradient norm keeps on
time of what the weights receive); and the cosine between consecutive steps' gradients on the columns the selection
leaves over (what a late update of those columns acts on).

``summary`` pairs each delayed arm with the ``--delay 0`` runs of the same task, learning rate and seed, found in the
given files: held-out loss difference in % and accuracy difference in points, mean with its t-based 95 % interval.

Usage (each run appends one JSON line per seed; ~2 min per seed of the 63-step ``minilm`` task on one core):

    python scripts/delay_model.py run --task minilm --lr 2e-4 --delay 0 --seeds 0 1 2 3 4 --out delay.jsonl
    python scripts/delay_model.py run --task minilm --lr 2e-4 --delay 1 --ratio 0.1 --seeds 0 1 2 3 4 --out delay.jsonl
    python scripts/delay_model.py summary delay.jsonl
    python scripts/delay_model.py spread --task minilm --lr 2e-4 --seed 0
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import torch

from hf_zenflow import ZenFlowConfig
from hf_zenflow.compare.training_run import evaluate, make_optimizer
from hf_zenflow.engine.selection import column_scores, num_selected, top_columns
from hf_zenflow.tuning.paired_stats import paired_interval


sys.path.insert(0, str(Path(__file__).resolve().parent))
from quality_study import TASKS, prepare  # noqa: E402  (a sibling script, not a package)


def split_matrices(model: torch.nn.Module, min_numel: int) -> list[tuple[str, torch.nn.Parameter]]:
    """The matrices whose columns a ZenFlow run splits between device and host (embedding tables excluded: their
    rows are selected by token, and delaying them costs nothing measurable on the MiniLM task)."""
    tables = {id(m.weight) for m in model.modules() if isinstance(m, torch.nn.Embedding)}
    return [(n, p) for n, p in model.named_parameters()
            if p.requires_grad and p.dim() == 2 and p.numel() >= min_numel and id(p) not in tables]


def unselected_columns(scores: torch.Tensor, ratio: float) -> torch.Tensor:
    """A boolean mask over input columns: True where ZenFlow's top-k selection by `scores` (`column_scores` of a
    gradient) leaves a column to the host."""
    mask = torch.ones_like(scores, dtype=torch.bool)
    mask[top_columns(scores, num_selected(ratio, scores.numel()))] = False
    return mask


SPLITS = ("columns", "rows", "elements")
SCORES = ("gradient", "update", "random")


def held_back(ranked: torch.Tensor, ratio: float, split: str) -> torch.Tensor:
    """A boolean mask, broadcastable to the ``[out, in]`` matrix `ranked` (a gradient or an update), True where a
    top-`ratio` selection by its squared norm along `split` leaves the update to land late: input columns (ZenFlow's
    selection), output rows, or single elements."""
    if split == "columns":
        return unselected_columns(column_scores(ranked.contiguous(), 1), ratio)
    if split == "rows":
        return unselected_columns(column_scores(ranked.t().contiguous(), 1), ratio)[:, None]
    return unselected_columns(ranked.float().pow(2).flatten(), ratio).view(ranked.shape)


def on_time_share(values: torch.Tensor, late: torch.Tensor) -> float:
    """The share of `values`' squared norm outside the mask `late`."""
    squares = values.float().pow(2)
    return float(1 - squares[late.expand_as(squares)].sum() / squares.sum().clamp_min(1e-30))


def train(task_name: str, seed: int, lr: float, delay: int, ratio: float, min_numel: int,
          split: str = "columns", score: str = "gradient", observe: Any = None) -> dict[str, Any]:
    """One run of the delayed AdamW (``delay == 0``: the runner's `adamw_torch` reference). `observe(step, matrices,
    updates)` is called after each step, before the gradients are cleared, with each matrix's AdamW update (by
    ``id``)."""
    task, cfg = prepare(task_name, seed, lr)
    from transformers import get_linear_schedule_with_warmup

    torch.manual_seed(cfg.seed)  # the runner's: dropout masks as in the reference run
    model = copy.deepcopy(task.base_model)
    model.train()
    opt = make_optimizer("adamw_torch", model, cfg)
    steps = len(task.train_batches)
    sched = get_linear_schedule_with_warmup(opt, int(cfg.warmup_ratio * steps), steps)
    matrices = split_matrices(model, min_numel)
    # per matrix, the host-column updates still to land, oldest first (at most `delay` of them)
    pending: dict[int, list[torch.Tensor]] = {id(p): [] for _, p in matrices}
    draws = torch.Generator().manual_seed(seed)  # `--score random`'s, apart from the run's own random stream
    t0 = time.perf_counter()
    for step, batch in enumerate(task.train_batches):
        model(**batch.inputs).loss.backward()
        if cfg.max_grad_norm and cfg.max_grad_norm > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.max_grad_norm)
        if delay and score == "random":
            masks = {id(p): held_back(torch.randn(p.shape, generator=draws), ratio, split) for _, p in matrices}
        elif delay and score == "gradient":
            masks = {id(p): held_back(p.grad, ratio, split) for _, p in matrices}
        else:
            masks = {}
        before = {id(p): p.detach().clone() for _, p in matrices} if delay or observe else {}
        opt.step()
        if observe is not None:
            with torch.no_grad():
                observe(step, matrices, {id(p): p - before[id(p)] for _, p in matrices})
        sched.step()
        opt.zero_grad(set_to_none=True)
        with torch.no_grad():
            for _, p in matrices if delay else ():
                update = p - before[id(p)]
                late = held_back(update, ratio, split) if score == "update" else masks[id(p)]
                held = update * late  # this step's update of the host columns, held back
                p.sub_(held)
                queue = pending[id(p)]
                queue.append(held)
                if len(queue) > delay:
                    p.add_(queue.pop(0))  # the update computed `delay` steps ago lands now
    with torch.no_grad():
        for _, p in matrices:
            for held in pending[id(p)]:
                p.add_(held)  # drained before the evaluation, as a save drains the host's pending updates
    result = evaluate(model, task, torch.device("cpu"))
    return {"task": task_name, "lr": lr, "seed": seed, "delay": delay, "ratio": ratio if delay else None,
            "split": split if delay else None, "score": score if delay else None, "min_numel": min_numel,
            "eval_loss": result["eval_loss"], "eval_accuracy": result.get("eval_accuracy"),
            "seconds": round(time.perf_counter() - t0, 1)}


def run(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for seed in args.seeds:
        record = train(args.task, seed, args.lr, args.delay, args.ratio, args.min_numel, args.split, args.score)
        with out.open("a") as f:
            f.write(json.dumps(record) + "\n")
        print(f"seed {seed}: held-out loss {record['eval_loss']:.5f}, accuracy {record['eval_accuracy']:.4f} "
              f"({record['seconds']:.0f} s)", flush=True)
    return 0


def spread(args: argparse.Namespace) -> int:
    torch.set_num_threads(args.threads)
    previous: dict[str, torch.Tensor] = {}
    share: dict[str, list[float]] = defaultdict(list)
    other: dict[str, dict[str, list[float]]] = {split: defaultdict(list) for split in SPLITS[1:]}
    update_share: dict[str, list[float]] = defaultdict(list)
    cosine: dict[str, list[float]] = defaultdict(list)
    # the matrices' mean share per step: what `ZenFlowAdamW.stats()["selected_grad_share"]` reads at a selection
    overall: list[float] = []

    def observe(step: int, matrices: list[tuple[str, torch.nn.Parameter]], updates: dict[int, torch.Tensor]) -> None:
        for name, p in matrices:
            grad = p.grad.detach().float()
            mask = held_back(grad, args.ratio, "columns")
            share[name].append(on_time_share(grad, mask))
            update_share[name].append(on_time_share(updates[id(p)], mask))
            if name in previous:
                cosine[name].append(float(torch.nn.functional.cosine_similarity(
                    grad[:, mask].flatten(), previous[name][:, mask].flatten(), dim=0)))
            previous[name] = grad
            for split, shares in other.items():
                shares[name].append(on_time_share(grad, held_back(grad, args.ratio, split)))
        overall.append(statistics.fmean(share[name][-1] for name, _ in matrices))

    def mean_over_matrices(shares: dict[str, list[float]]) -> float:
        return statistics.fmean(statistics.fmean(v) for v in shares.values())

    record = train(args.task, args.seed, args.lr, 0, args.ratio, args.min_numel, observe=observe)
    tail = max(1, len(next(iter(share.values()))) // 3)
    print(f"{args.task}, lr {args.lr:g}, seed {args.seed}: held-out loss {record['eval_loss']:.5f}; top "
          f"{args.ratio:g} of the input columns")
    print(f"mean over the {len(share)} matrices: {statistics.fmean(overall):.2f} of the squared gradient norm on the "
          f"top columns (first third {statistics.fmean(overall[:tail]):.2f}, last third "
          f"{statistics.fmean(overall[-tail:]):.2f}; range {min(overall):.2f}-{max(overall):.2f})")
    for split, shares in other.items():
        print(f"on the top {args.ratio:g} of the {split} instead: {mean_over_matrices(shares):.2f}")
    print(f"of the squared norm of AdamW's update, the top gradient columns get "
          f"{mean_over_matrices(update_share):.2f}")
    print("| matrix | share of the squared gradient norm on the top columns: mean (first third / last third) | "
          "cosine of consecutive gradients on the other columns: mean (last third) | on the top rows | "
          "on the top elements | update's share on the top columns |")
    print("|---|---|---|---|---|---|")
    for name in share:
        s, c = share[name], cosine[name]
        print(f"| {name} | {statistics.fmean(s):.2f} ({statistics.fmean(s[:tail]):.2f} / "
              f"{statistics.fmean(s[-tail:]):.2f}) | {statistics.fmean(c):.2f} ({statistics.fmean(c[-tail:]):.2f}) | "
              f"{statistics.fmean(other['rows'][name]):.2f} | {statistics.fmean(other['elements'][name]):.2f} | "
              f"{statistics.fmean(update_share[name]):.2f} |")
    return 0


def summary(args: argparse.Namespace) -> int:
    records = [json.loads(line) for f in args.files for line in Path(f).read_text().splitlines() if line.strip()]
    reference = {(r["task"], r["lr"], r["seed"]): r for r in records if r["delay"] == 0}
    arms: dict[tuple[Any, ...], list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        if r["delay"]:
            arms[(r["task"], r["lr"], r["delay"], r["ratio"], r.get("split") or "columns",
                  r.get("score") or "gradient", r["min_numel"])].append(r)
    print("| task | lr | delay | ratio | split | ranked by | seeds | held-out loss diff, % (mean ± 95 % CI) | "
          "per seed, % | accuracy diff, points |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for (task, lr, delay, ratio, split, score, _), runs in arms.items():
        pairs = sorted((r["seed"], r, reference[(task, lr, r["seed"])]) for r in runs
                       if (task, lr, r["seed"]) in reference)
        if not pairs:
            print(f"| {task} | {lr:g} | {delay} | {ratio:g} | {split} | {score} | 0 | no delay-0 reference in these "
                  "files | | |")
            continue
        loss = [100 * (r["eval_loss"] / a["eval_loss"] - 1) for _, r, a in pairs]
        acc = [100 * (r["eval_accuracy"] - a["eval_accuracy"]) for _, r, a in pairs]
        (lm, lh), (am, ah) = paired_interval(loss), paired_interval(acc)
        print(f"| {task} | {lr:g} | {delay} | {ratio:g} | {split} | {score} | {len(pairs)} | {_pm(lm, lh)} | "
              f"{' / '.join(f'{v:+.2f}' for v in loss)} | {_pm(am, ah)} |")
    return 0


def _pm(mean: float, half: float | None) -> str:
    """A mean with its interval (one seed: the mean alone, no interval)."""
    return f"{mean:+.2f}" if half is None else f"{mean:+.2f} ± {half:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "spread"):
        p = commands.add_parser(name, allow_abbrev=False)
        p.add_argument("--task", choices=sorted(TASKS), default="minilm")
        p.add_argument("--lr", type=float, required=True)
        p.add_argument("--ratio", type=float, default=ZenFlowConfig().topk_ratio,
                       help="share of each matrix's input columns updated on time (ZenFlow's topk_ratio)")
        p.add_argument("--min-numel", type=int, default=ZenFlowConfig().min_offload_numel,
                       help="smallest matrix with delayed columns (ZenFlow's min_offload_numel)")
        p.add_argument("--threads", type=int, default=1)
        if name == "run":
            p.add_argument("--delay", type=int, required=True, help="steps the host columns' update lands late")
            p.add_argument("--split", choices=SPLITS, default="columns",
                           help="what the top selection keeps on time: input columns (ZenFlow's), rows, elements")
            p.add_argument("--score", choices=SCORES, default="gradient",
                           help="what the selection ranks by: the step's gradient (ZenFlow's), its AdamW update, "
                                "or a fresh random draw (the control)")
            p.add_argument("--seeds", type=int, nargs="+", required=True)
            p.add_argument("--out", required=True)
        else:
            p.add_argument("--seed", type=int, default=0)
    p = commands.add_parser("summary", allow_abbrev=False)
    p.add_argument("files", nargs="+")
    args = parser.parse_args(argv)
    if getattr(args, "delay", 0) < 0:
        parser.error(f"--delay must be 0 or more, got {args.delay}")
    if hasattr(args, "ratio") and not 0 < args.ratio <= 1:
        parser.error(f"--ratio must be in (0, 1], got {args.ratio}")
    return {"run": run, "spread": spread, "summary": summary}[args.command](args)


if __name__ == "__main__":
    raise SystemExit(main())
