#!/usr/bin/env python
"""Checks that only mean something on a CUDA device (`scripts/gpu_check.sh`, part 3); results to
``<out-dir>/cuda_checks.json``.

1. Host syncs per step: ``torch.cuda.set_sync_debug_mode("warn")`` makes every synchronising CUDA call (``.item()``,
   a blocking copy, ``.cpu()``...) warn; the warnings are counted per step of a small ZenFlow run and recorded for
   the ordinary steps (no selection, no window close) and the others. Recorded, not asserted: the figure is for the
   README's claim of one sync per ordinary step.
2. fp16 with ``torch.amp.GradScaler("cuda")``, the public recipe (``scaler.scale(loss).backward()``,
   ``scaler.unscale_(opt)``, ``opt.clip_grad_norm_``, ``scaler.step(opt)``, ``scaler.update()``) against the same
   loop without a scaler: clip norms within 1e-3 relative and weights within 1e-4 (a power-of-two scale unscales
   exactly, but fp16 autocast activations' gradients underflow differently with and without the scale), and an
   injected inf gradient skips the step on every parameter.

    python scripts/cuda_checks.py --out-dir gpu_out
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
import traceback
import warnings
from pathlib import Path
from typing import Any

import torch


def _model(device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(512, 256), torch.nn.Linear(256, 1024), torch.nn.GELU(),
                               torch.nn.LayerNorm(1024), torch.nn.Linear(1024, 512)).to(device)


def _batches(device: torch.device, n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 512, (8, 64), generator=g).to(device), torch.randint(0, 512, (8, 64), generator=g)
             .to(device)) for _ in range(n)]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x).float()
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))


def host_syncs(device: torch.device, steps: int = 24) -> dict[str, Any]:
    from hf_zenflow import ZenFlowAdamW

    model = _model(device)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-3, topk_ratio=0.1, update_interval=4, select_strategy="step",
                       select_interval=12, overlap_step=True, min_offload_numel=0)
    per_step: list[dict[str, Any]] = []
    try:
        for i, (x, y) in enumerate(_batches(device, steps)):
            before = opt.stats()
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    _loss(model, x, y).backward()
                    opt.clip_grad_norm_(1.0)
                    opt.step()
                    opt.zero_grad()
                finally:
                    torch.cuda.set_sync_debug_mode("default")
            after = opt.stats()
            syncs = sum("synchroniz" in str(w.message) for w in caught)
            special = (after["windows"] != before["windows"] or after["reselections"] != before["reselections"]
                       or i < 2)
            per_step.append({"step": i, "syncs": syncs, "window_closed_or_selection_or_warm_up": special})
        opt.flush()
    finally:
        opt.close()
    ordinary = [s["syncs"] for s in per_step if not s["window_closed_or_selection_or_warm_up"]]
    return {"per_step": per_step, "ordinary_steps": len(ordinary),
            "syncs_per_ordinary_step_max": max(ordinary) if ordinary else None,
            "syncs_per_ordinary_step_min": min(ordinary) if ordinary else None}


def fp16_grad_scaler(device: torch.device, steps: int = 12) -> dict[str, Any]:
    from hf_zenflow import ZenFlowAdamW

    settings = dict(lr=1e-3, topk_ratio=0.25, update_interval=3, select_strategy="step", select_interval=6,
                    overlap_step=True, min_offload_numel=0)
    data = _batches(device, steps)
    results = []
    for use_scaler in (False, True):
        model = _model(device)
        opt = ZenFlowAdamW(model.parameters(), **settings)
        scaler = torch.amp.GradScaler(device.type, init_scale=4096.0) if use_scaler else None
        norms = []
        try:
            for x, y in data:
                with torch.autocast(device.type, dtype=torch.float16):
                    loss = _loss(model, x, y)
                if scaler is None:
                    loss.backward()
                    norms.append(float(opt.clip_grad_norm_(1.0)))
                    opt.step()
                else:
                    scaler.scale(loss).backward()
                    scaler.unscale_(opt)
                    norms.append(float(opt.clip_grad_norm_(1.0)))
                    scaler.step(opt)
                    scaler.update()
                opt.zero_grad()
            opt.flush()
        finally:
            opt.close()
        results.append((norms, [p.detach().clone() for p in model.parameters()]))
    (plain_norms, plain_w), (scaled_norms, scaled_w) = results
    norm_rel = max(abs(a - b) / max(abs(a), 1e-12) for a, b in zip(plain_norms, scaled_norms))
    weight_diff = max((a - b).abs().max().item() for a, b in zip(plain_w, scaled_w))
    skipped = _overflow_step_changes_nothing(device, settings, data)
    ok = norm_rel < 1e-3 and weight_diff < 1e-4 and skipped
    return {"ok": ok, "clip_norm_max_rel_diff": norm_rel, "weight_max_abs_diff": weight_diff,
            "inf_step_skipped_everything": skipped}


def _overflow_step_changes_nothing(device: torch.device, settings: dict, data: list) -> bool:
    from hf_zenflow import ZenFlowAdamW

    model = _model(device)
    opt = ZenFlowAdamW(model.parameters(), **settings)
    scaler = torch.amp.GradScaler(device.type, init_scale=4096.0)
    try:
        for i, (x, y) in enumerate(data[:8]):
            with torch.autocast(device.type, dtype=torch.float16):
                loss = _loss(model, x, y)
            scaler.scale(loss).backward()
            if i == 5:
                model[1].weight.grad[0, 0] = float("inf")
                opt.synchronize()
                weights = copy.deepcopy(model.state_dict())
                state = copy.deepcopy(opt.state_dict())
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if i == 5:
                opt.synchronize()
                same_w = all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
                same_s = _same(state, opt.state_dict())
                return same_w and same_s
    finally:
        opt.close()
    return False


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a.cpu(), b.cpu())
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="gpu_out")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("cuda_checks: no CUDA device: nothing to check")
        return 0
    device = torch.device("cuda")
    out: dict[str, Any] = {"gpu": torch.cuda.get_device_name(device), "torch": torch.__version__}
    failed = False
    for name, check in (("host_syncs", host_syncs), ("fp16_grad_scaler", fp16_grad_scaler)):
        try:
            out[name] = check(device)
            failed |= out[name].get("ok") is False
        except Exception as exc:  # noqa: BLE001 - one failing check must not hide the other's result
            traceback.print_exc()
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
            failed = True
        print(name, json.dumps(out[name], default=str)[:2000], flush=True)
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    (Path(args.out_dir) / "cuda_checks.json").write_text(json.dumps(out, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
