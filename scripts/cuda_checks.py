#!/usr/bin/env python
"""Checks of `ZenFlowAdamW` that the reference tests do not make (`scripts/gpu_check.sh`); results to
``<out-dir>/cuda_checks.json``, the exit status non-zero when one fails.

Device-independent (they run on any device; ``--device cpu`` runs them on the CPU, as CI does through
tests/test_cuda_checks.py): fp16 autocast with ``torch.amp.GradScaler``, for ``accumulate_on="host"`` and
``"device"`` (`fp16_grad_scaler`):

- the two public recipes on the same scaled backward give the same weights bit for bit: ``scaler.step(opt)`` alone
  (the optimizer unscales inside its step) and ``scaler.unscale_(opt)``, ``opt.clip_grad_norm_(inf)``,
  ``scaler.step(opt)`` (the gradients unscaled in place, after the backward hooks read them). The scale is a power
  of two, so unscaling is exact either way; a difference means the optimizer used something read before
  ``unscale_`` (a norm, a gradient copy started in backward);
- after ``unscale_`` the norm ``clip_grad_norm_`` returns is torch's norm of the unscaled gradients (relative 1e-6:
  the hooks' per-matrix norms and torch's are the same kernels, so only a missed rescale by the scale shows);
- with every column selected (``topk_ratio=1``: ZenFlow is AdamW) the Trainer's recipe (``unscale_``, clip 1.0,
  ``step``, ``update``) equals torch's AdamW (fused where the device has it, as ZenFlow's device update) under its
  own scaler, within 1e-6 relative per parameter (torch clips by scaling the gradients, ZenFlow folds the same
  coefficient into its gather: one rounding apart);
- a step whose gradients overflowed (an inf injected) changes no weight and no optimizer state but the count of
  skipped steps (and that count's checksum), under either recipe.

CUDA only (skipped elsewhere):

- `host_syncs`: for ``accumulate_on="host"`` and ``"device"``, the synchronising CUDA calls of the training thread
  per step under ``torch.cuda.set_sync_debug_mode("warn")``, and the ``torch.cuda.Event.synchronize`` calls, which
  that mode does not see, counted here per thread (the training thread's, and the host worker's waits for landed
  copies). Recorded, not asserted, except that an ordinary step's training thread waits on no event;
- `pinned_link_buffers`: every host buffer that crosses the link (write-back buffers, the chunks of the rings that the
  gradients, the device sums and the write-back from the master cross) is page-locked (``Tensor.is_pinned()``, asked of
  the CUDA driver), and ``stats()["pinned_host_bytes"]`` covers them: a fallback to pageable memory (``ulimit -l``)
  would make every "asynchronous" copy synchronous, and ``set_sync_debug_mode`` does not report it;
- `nccl_two_ranks_one_gpu`: two processes, one NCCL group, both on the one GPU, an all-reduce. NCCL refuses two
  ranks on one device in one communicator ("Duplicate GPU detected"); the check says so when it does, and does not
  count it as a failure.

    python scripts/cuda_checks.py --out-dir gpu_out [--device cpu]
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
import tempfile
import threading
import traceback
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch


#: The loss scale: a power of two, so that scaling and unscaling the fp32 gradients are exact.
SCALE = 4096.0
#: The learning rate of every run (ZenFlow's and torch's AdamW's).
LR = 1e-3
#: The accumulation places the checks cover (``"auto"`` would choose one of them by the device's free memory).
ACCUMULATIONS = ("host", "device")


def _model(device: torch.device, width: int) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(2 * width, width), torch.nn.Linear(width, 4 * width),
                               torch.nn.GELU(), torch.nn.LayerNorm(4 * width),
                               torch.nn.Linear(4 * width, 2 * width)).to(device)


def _width(device: torch.device) -> int:
    """CUDA: matrices of 256 x 1024; elsewhere smaller (the CPU runs the same code in seconds)."""
    return 256 if device.type == "cuda" else 32


def _batches(device: torch.device, n: int, width: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    vocab = 2 * width
    return [(torch.randint(0, vocab, (8, 64), generator=g).to(device), torch.randint(0, vocab, (8, 64), generator=g)
             .to(device)) for _ in range(n)]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    logits = model(x).float()
    return torch.nn.functional.cross_entropy(logits.view(-1, logits.shape[-1]), y.view(-1))


def _zenflow(model: torch.nn.Module, lr: float = LR, **settings: Any) -> Any:
    """`ZenFlowAdamW` under `_SETTINGS` with `settings` over them: settings, or engine rules (where windows are
    summed, whether gradients are freed in backward), which reach it through `ZenFlowConfig.with_rules`."""
    from hf_zenflow import ZenFlowAdamW
    from hf_zenflow.tuning.tune_grid import study_config

    return ZenFlowAdamW(model.parameters(), lr=lr, config=study_config({**_SETTINGS, **settings}))


#: The offloaded schedule the fp16 checks run: windows of 3 steps, a re-selection every 6, overlapped.
_SETTINGS: dict[str, Any] = dict(topk_ratio=0.25, update_interval=3, select_strategy="step",
                                 select_interval=6, overlap_step=True, writeback_lag=1, high_lr_rule="off",
                                 min_offload_numel=0)


# ---------------------------------------------------------------------------------------------------------------
# Device-independent: fp16 autocast with a GradScaler
# ---------------------------------------------------------------------------------------------------------------
def _scaled_run(device: torch.device, recipe: str, steps: int, accumulate_on: str) -> tuple[list, list[float]]:
    """Train with fp16 autocast under a GradScaler. `recipe`: "step" (``scaler.step`` alone) or "unscale"
    (``unscale_``, ``clip_grad_norm_(inf)``, ``step``). Returns the weights and, for "unscale", the relative
    difference of each step's clip norm from torch's norm of the unscaled gradients."""
    width = _width(device)
    model = _model(device, width)
    opt = _zenflow(model, accumulate_on=accumulate_on)
    scaler = torch.amp.GradScaler(device.type, init_scale=SCALE)
    norm_diffs: list[float] = []
    # torch's reference norm is taken of the gradients as backward produces them (the optimizer may free
    # `p.grad` in its backward hooks: `free_gradients_in_backward`), unscaled by the scaler's power-of-two scale
    produced: list[torch.Tensor] = []
    hooks = [p.register_hook(lambda g: produced.append(g.detach().clone())) for p in model.parameters()]
    try:
        for x, y in _batches(device, steps, width):
            produced.clear()
            with torch.autocast(device.type, dtype=torch.float16):
                loss = _loss(model, x, y)
            scaler.scale(loss).backward()
            if recipe == "unscale":
                inv_scale = 1.0 / scaler.get_scale()
                scaler.unscale_(opt)
                ours = opt.clip_grad_norm_(math.inf)
                theirs = torch.nn.utils.get_total_norm([g.float() * inv_scale for g in produced])
                norm_diffs.append(float((ours - theirs).abs() / theirs.clamp_min(1e-30)))
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        opt.flush()
    finally:
        opt.close()
        for hook in hooks:
            hook.remove()
    return [p.detach().clone() for p in model.parameters()], norm_diffs


def _all_columns_against_adamw(device: torch.device, steps: int) -> float:
    """ZenFlow with every column selected against torch's AdamW, each under its own scaler, the Trainer's recipe
    (``unscale_``, clip 1.0, ``step``, ``update``): the largest relative difference of a parameter."""
    width = _width(device)
    data = _batches(device, steps, width)
    weights = []
    for zenflow in (True, False):
        model = _model(device, width)
        opt = (_zenflow(model, topk_ratio=1.0) if zenflow else
               torch.optim.AdamW(model.parameters(), lr=LR, fused=True))
        scaler = torch.amp.GradScaler(device.type, init_scale=SCALE)
        try:
            for x, y in data:
                with torch.autocast(device.type, dtype=torch.float16):
                    loss = _loss(model, x, y)
                scaler.scale(loss).backward()
                scaler.unscale_(opt)
                if zenflow:
                    opt.clip_grad_norm_(1.0)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        finally:
            if zenflow:
                opt.close()
        weights.append([p.detach().clone() for p in model.parameters()])
    return max(float((a - b).norm() / b.norm().clamp_min(1e-30)) for a, b in zip(*weights))


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, item in value.items() for k, v in _flat(item, f"{prefix}/{key}").items()}
    if isinstance(value, (list, tuple)):
        return {k: v for i, item in enumerate(value) for k, v in _flat(item, f"{prefix}[{i}]").items()}
    return {prefix: value.detach().cpu().clone() if isinstance(value, torch.Tensor) else value}


def _changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The state-dict entries that differ (NaN equals NaN)."""
    keys = sorted(before.keys() | after.keys())
    changed = []
    for key in keys:
        a, b = before.get(key), after.get(key)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            same = a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.nan_to_num(), b.nan_to_num()) \
                and torch.equal(a.isnan(), b.isnan())
        else:
            same = a == b or (a != a and b != b)
        if not same:
            changed.append(key)
    return changed


#: What a skipped step must change in the state dict: its count of skipped steps and that count's checksum.
SKIP_COUNTERS = ("/zenflow/skipped_steps", "/zenflow/checksum/zenflow.skipped_steps")


def _with_inf_at_origin(grad: torch.Tensor) -> torch.Tensor:
    grad = grad.clone()
    grad[0, 0] = float("inf")
    return grad


def _overflow_step_changes_nothing(device: torch.device, recipe: str, accumulate_on: str) -> dict[str, Any]:
    """Inject an inf gradient at step 5 (mid-window, the first window's host result pending) under `recipe`: the
    scaler skips the step, which must leave the weights and the optimizer's state as they were, except the count
    of skipped steps, which goes up by one (and its checksum)."""
    width = _width(device)
    model = _model(device, width)
    opt = _zenflow(model, accumulate_on=accumulate_on)
    scaler = torch.amp.GradScaler(device.type, init_scale=SCALE)
    try:
        for i, (x, y) in enumerate(_batches(device, 6, width)):
            poisoned = None
            if i == 5:
                opt.synchronize()
                weights = copy.deepcopy(model.state_dict())
                state = _flat(opt.state_dict())
                # the inf enters as backward produces the gradient, so that it reaches the optimizer whether the
                # gradient then stays in `p.grad` or is freed in its backward hook (`free_gradients_in_backward`)
                poisoned = model[1].weight.register_hook(_with_inf_at_origin)
            with torch.autocast(device.type, dtype=torch.float16):
                loss = _loss(model, x, y)
            scaler.scale(loss).backward()
            if poisoned is not None:
                poisoned.remove()
            if recipe == "unscale":
                scaler.unscale_(opt)
                opt.clip_grad_norm_(1.0)
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        opt.synchronize()
        after = _flat(opt.state_dict())
        changed = _changed(state, after)
        counted = after.get(SKIP_COUNTERS[0]) == state.get(SKIP_COUNTERS[0], 0) + 1
        weights_same = all(torch.equal(v, model.state_dict()[k]) for k, v in weights.items())
    finally:
        opt.close()
    unexpected = [k for k in changed if k not in SKIP_COUNTERS]
    return {"ok": weights_same and not unexpected and counted, "weights_unchanged": weights_same,
            "state_entries_changed": changed, "skip_counted": counted}


def fp16_grad_scaler(device: torch.device, steps: int = 12) -> dict[str, Any]:
    """The fp16 + GradScaler checks of the module docstring, on `device` (any device with fp16 autocast)."""
    out: dict[str, Any] = {}
    ok = True
    for accumulate_on in ACCUMULATIONS:
        step_w, _ = _scaled_run(device, "step", steps, accumulate_on)
        unscale_w, norm_diffs = _scaled_run(device, "unscale", steps, accumulate_on)
        recipe_diff = max(float((a - b).abs().max()) for a, b in zip(step_w, unscale_w))
        overflow = {recipe: _overflow_step_changes_nothing(device, recipe, accumulate_on)
                    for recipe in ("step", "unscale")}
        part = {"recipes_weight_max_abs_diff": recipe_diff,
                "clip_norm_max_rel_diff_from_torch": max(norm_diffs),
                "overflow_step": overflow}
        part["ok"] = (recipe_diff == 0.0 and max(norm_diffs) < 1e-6 and all(o["ok"] for o in overflow.values()))
        out[f"accumulate_on={accumulate_on}"] = part
        ok &= part["ok"]
    adamw_diff = _all_columns_against_adamw(device, steps)
    out["all_columns_vs_torch_adamw_max_rel_diff"] = adamw_diff
    out["ok"] = ok and adamw_diff < 1e-6
    return out


# ---------------------------------------------------------------------------------------------------------------
# CUDA only
# ---------------------------------------------------------------------------------------------------------------
class EventWaits:
    """Counts ``torch.cuda.Event.synchronize`` calls per thread (the training thread's, and the others': the host
    worker waiting for copies to land), by wrapping the method for the duration of a ``with`` block."""

    def __init__(self) -> None:
        self.by_thread: Counter[str] = Counter()
        self._lock = threading.Lock()
        self._main = threading.current_thread()

    def __enter__(self) -> EventWaits:
        self._original = torch.cuda.Event.synchronize
        original, counts, lock, main = self._original, self.by_thread, self._lock, self._main

        def synchronize(event: torch.cuda.Event) -> None:
            with lock:
                counts["training" if threading.current_thread() is main else "other"] += 1
            original(event)

        torch.cuda.Event.synchronize = synchronize  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        torch.cuda.Event.synchronize = self._original  # type: ignore[method-assign]


#: The training thread's synchronising CUDA calls an ordinary step may make: the step's one read of its scalars.
SYNCS_PER_ORDINARY_STEP = 1


def host_syncs(device: torch.device, steps: int = 24) -> dict[str, Any]:
    """Per accumulation place: synchronising CUDA calls and event waits of the training thread per step; an
    ordinary step makes at most `SYNCS_PER_ORDINARY_STEP` and waits on no event."""
    out: dict[str, Any] = {}
    ok = True
    for accumulate_on in ACCUMULATIONS:
        width = _width(device)
        model = _model(device, width)
        opt = _zenflow(model, topk_ratio=0.1, update_interval=4, select_interval=12, accumulate_on=accumulate_on)
        per_step: list[dict[str, Any]] = []
        try:
            for i, (x, y) in enumerate(_batches(device, steps, width)):
                before = opt.stats()
                with warnings.catch_warnings(record=True) as caught, EventWaits() as waits:
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
                per_step.append({"step": i, "syncs": syncs, "event_waits_training": waits.by_thread["training"],
                                 "event_waits_other": waits.by_thread["other"],
                                 "writeback_device_ms": after["writeback_device_ms"],
                                 "window_closed_or_selection_or_warm_up": special})
            opt.flush()
            chosen = opt.stats()["accumulate_on"]
        finally:
            opt.close()
        ordinary = [s for s in per_step if not s["window_closed_or_selection_or_warm_up"]]
        # an ordinary step's training thread waits on no event (copies to the host are waited for by the worker)
        # and synchronises once: the step's one read of its scalars
        part_ok = (chosen == accumulate_on and bool(ordinary)
                   and all(s["event_waits_training"] == 0 and s["syncs"] <= SYNCS_PER_ORDINARY_STEP for s in ordinary))
        out[f"accumulate_on={accumulate_on}"] = {
            "ok": part_ok, "per_step": per_step, "ordinary_steps": len(ordinary),
            "syncs_per_ordinary_step_max": max((s["syncs"] for s in ordinary), default=None),
            "syncs_per_ordinary_step_min": min((s["syncs"] for s in ordinary), default=None),
            "event_waits_training_ordinary_max": max((s["event_waits_training"] for s in ordinary), default=None)}
        ok &= part_ok
    out["ok"] = ok
    return out


def pinned_link_buffers(device: torch.device) -> dict[str, Any]:
    """Per accumulation place: every host buffer that crosses the link (the rings' chunks) is page-locked, the stats
    count them, and the write-back buffers are ordinary memory (they cross through the write ring)."""
    out: dict[str, Any] = {}
    ok = True
    for accumulate_on in ACCUMULATIONS:
        width = _width(device)
        model = _model(device, width)
        opt = _zenflow(model, accumulate_on=accumulate_on)
        try:
            for x, y in _batches(device, 4, width):
                _loss(model, x, y).backward()
                opt.step()
                opt.zero_grad()
            opt.synchronize()
            pinned_writeback = sum(1 for split in opt._split.values() if split.host is not None
                                   and not split.host.writes_back_master and split.host.writeback.is_pinned())
            buffers = []
            # (the rings' chunks: the write-back's, the gradients' and the device sums', which land in ordinary
            # memory from there)
            for transport in opt._host.transports.values():
                rings = [getattr(transport, "ring", None), getattr(transport, "receive_ring", None),
                         getattr(getattr(transport, "lander", None), "ring", None)]
                buffers += [("ring", t) for ring in rings if ring is not None for t in ring._buffers]
            unpinned = sorted({name for name, t in buffers if not t.is_pinned()})
            link_bytes = sum(t.numel() * t.element_size() for _, t in buffers)
            pinned_bytes = int(opt.stats()["pinned_host_bytes"])
        finally:
            opt.close()
        part_ok = bool(buffers) and not unpinned and pinned_bytes >= link_bytes and pinned_writeback == 0
        out[f"accumulate_on={accumulate_on}"] = {"ok": part_ok, "link_buffers": len(buffers),
                                                  "pinned_writeback_buffers": pinned_writeback,
                                                  "unpinned_kinds": unpinned, "link_bytes": link_bytes,
                                                  "pinned_host_bytes": pinned_bytes}
        ok &= part_ok
    out["ok"] = ok
    return out


def _nccl_rank(rank: int, init_file: str, results: Any) -> None:
    import datetime

    import torch.distributed as dist

    try:
        gpu = rank % torch.cuda.device_count()
        torch.cuda.set_device(gpu)
        dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=2,
                                timeout=datetime.timedelta(seconds=30), device_id=torch.device("cuda", gpu))
        t = torch.full((4,), float(rank + 1), device="cuda")
        dist.all_reduce(t)
        torch.cuda.synchronize()
        results.put((rank, "ok", float(t[0])))
        dist.destroy_process_group()
    except Exception as exc:  # noqa: BLE001 - reported to the parent, which decides
        results.put((rank, "error", f"{type(exc).__name__}: {exc}"[:500]))


def nccl_two_ranks(device: torch.device, wait_s: float = 30.0) -> dict[str, Any]:
    """Two processes, one NCCL group, one per GPU (rank r on GPU r modulo the GPUs), one all-reduce (3 expected on
    both ranks); `wait_s` for both answers together."""
    import queue
    import time

    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_nccl_available():
        return {"ok": True, "ran": False, "why": "this torch has no NCCL"}
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "rendezvous")
        procs = [ctx.Process(target=_nccl_rank, args=(rank, init_file, results)) for rank in range(2)]
        for p in procs:
            p.start()
        answers = []
        deadline = time.monotonic() + wait_s
        try:
            for _ in procs:
                answers.append(results.get(timeout=max(0.1, deadline - time.monotonic())))
        except queue.Empty:
            pass
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    return nccl_verdict(answers)


def nccl_verdict(answers: list[tuple[int, str, Any]]) -> dict[str, Any]:
    """The check's result from the ranks' answers ``(rank, "ok", value)`` or ``(rank, "error", message)``: both
    ranks reduced to 3 (passed); NCCL refused two ranks on one GPU (not run, said so; not a failure); anything else
    (an error, a rank that did not answer) fails."""
    done = [a for a in answers if a[1] == "ok"]
    if len(done) == 2:
        agree = all(a[2] == 3.0 for a in done)
        return {"ok": agree, "ran": True, "all_reduce": [a[2] for a in done]}
    errors = [a[2] for a in answers if a[1] == "error"]
    # NCCL's words ("Duplicate GPU detected"), or where torch's message leaves NCCL's last error out, its code
    if any("Duplicate GPU" in e or "invalid usage" in e.lower() for e in errors):
        return {"ok": True, "ran": False, "why": "NCCL does not allow two ranks of one group on one GPU",
                "errors": errors}
    return {"ok": False, "ran": False, "answers": answers, "why": "the two ranks did not both finish"}


# ---------------------------------------------------------------------------------------------------------------
# Races made visible: copies made late on purpose, against the same run with every copy synchronous
# ---------------------------------------------------------------------------------------------------------------
#: Cycles a slowed stream spins before each copy and before each module's gradients (`torch.cuda._sleep`): about
#: 10 ms at 2 GHz, far longer than a missing wait could go unnoticed.
SLEEP_CYCLES = 20_000_000
#: The schedules the race check runs: copies in backward with gradients freed there (host sums), bf16 window sums
#: shipped once per window (``accumulate_on="device_bf16"``), and the write-back from the fp32 master through the
#: transport's ring of pinned chunks (each chunk refilled only after its copy has run); windows of 2 steps, a
#: re-selection at step 4.
RACE_SETTINGS: dict[str, dict[str, Any]] = {
    "host_sums_freed": dict(accumulate_on="host", free_gradients_in_backward="on"),
    "device_bf16_sums": dict(accumulate_on="device_bf16", free_gradients_in_backward="off"),
    "master_through_ring": dict(accumulate_on="host", free_gradients_in_backward="on", host_writeback="master"),
}


def _cuda_streams_slowed(cycles: int) -> Any:
    from hf_zenflow.transport import CudaStreams

    class SlowedStreams(CudaStreams):
        """Every copy waits `cycles` on its own stream first: the side stream's device->host copies and the
        compute stream's write-back land late, so a reader that does not wait for them reads too early."""

        def copy(self, dst: torch.Tensor, src: torch.Tensor) -> None:
            torch.cuda._sleep(cycles)  # (on the current stream: the copy's)
            super().copy(dst, src)

    return SlowedStreams()


class MlpPair(torch.nn.Module):
    """A Llama MLP's two largest matrices (4096 x 11008 and 11008 x 4096 on CUDA), bf16."""

    def __init__(self, hidden: int, intermediate: int, device: torch.device) -> None:
        super().__init__()
        self.up = torch.nn.Linear(hidden, intermediate, bias=False, dtype=torch.bfloat16, device=device)
        self.down = torch.nn.Linear(intermediate, hidden, bias=False, dtype=torch.bfloat16, device=device)
        self.norm = torch.nn.Parameter(torch.ones(hidden, dtype=torch.bfloat16, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.nn.functional.silu(self.up(x * self.norm)))


def race_shape(device: torch.device) -> tuple[int, int]:
    """(hidden, intermediate): Llama-7B's on CUDA; small on the CPU, where the double makes the copies late."""
    return (4096, 11008) if device.type == "cuda" else (64, 172)


def _race_run(device: torch.device, settings: dict[str, Any], slowed: bool, steps: int, cycles: int
              ) -> tuple[list[torch.Tensor], list[float], int]:
    """Train `steps` steps; `slowed`: copies made late (CUDA: `_cuda_streams_slowed`, and the compute stream slowed
    before each module's gradients; the CPU: the asynchronous double with long delays), else every copy
    synchronous (`CopyTransport` over pageable memory). Returns the weights, the losses and the copies made."""
    import hf_zenflow.transport as transport_package
    from hf_zenflow.transport import CopyTransport, CudaTransport

    backends: list[Any] = []

    def late(dev: torch.device) -> Any:
        if device.type == "cuda":
            return CudaTransport(streams=_cuda_streams_slowed(cycles))
        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
        from tests.doubles.async_device import AsyncCopies, CheckedRegistrar

        backends.append(AsyncCopies(seed=len(backends), max_delay_s=0.01))
        return CudaTransport(streams=backends[-1], registrar=CheckedRegistrar(backends[-1]))

    real = transport_package.transport_for
    transport_package.transport_for = late if slowed else (lambda dev: CopyTransport())
    hidden, intermediate = race_shape(device)
    torch.manual_seed(0)
    model = MlpPair(hidden, intermediate, device)
    hooks = []
    if slowed and device.type == "cuda":
        # the compute stream is late too: a copy that did not wait for the gradient it reads reads it unfinished
        hooks = [m.register_full_backward_pre_hook(lambda *_: torch.cuda._sleep(cycles))
                 for m in (model.up, model.down)]
    g = torch.Generator().manual_seed(3)
    opt = _zenflow(model, lr=1e-3, topk_ratio=0.1, update_interval=2, select_interval=4, **settings)
    losses = []
    try:
        for _ in range(steps):
            x = torch.randn(16, hidden, generator=g).to(device, torch.bfloat16)
            loss = model(x).float().square().mean()
            loss.backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            losses.append(float(loss.detach()))
        opt.flush()
        copies = int(opt.stats()["total_bytes_to_host"])
    finally:
        opt.close()
        transport_package.transport_for = real
        for hook in hooks:
            hook.remove()
    for backend in backends:
        backend.synchronize(torch.device("cpu"))
        backend.check()
    return [p.detach().clone() for p in model.parameters()], losses, copies


def races(device: torch.device, steps: int = 6, cycles: int = SLEEP_CYCLES) -> dict[str, Any]:
    """Per schedule of `RACE_SETTINGS`: the run with copies made late equals, bit for bit, the same run with every
    copy synchronous (weights and losses). Any device: on the CPU over the asynchronous double (CI runs it)."""
    out: dict[str, Any] = {"shape": race_shape(device)}
    ok = True
    for name, settings in RACE_SETTINGS.items():
        reference, ref_losses, _ = _race_run(device, settings, slowed=False, steps=steps, cycles=cycles)
        weights, losses, moved = _race_run(device, settings, slowed=True, steps=steps, cycles=cycles)
        differing = [i for i, (a, b) in enumerate(zip(weights, reference)) if not torch.equal(a, b)]
        part_ok = not differing and losses == ref_losses and moved > 0
        out[name] = {"ok": part_ok, "parameters_differing": differing, "losses_equal": losses == ref_losses,
                     "bytes_to_host": moved}
        ok &= part_ok
    out["ok"] = ok
    return out


def sanitized(device: torch.device, timeout_s: float = 25.0) -> dict[str, Any]:
    """The race check's schedules on small matrices in a process under ``TORCH_CUDA_SANITIZER=1`` (torch's CUDA
    stream sanitizer: it raises where a kernel or copy reads or writes a tensor that another stream used without a
    synchronisation between them). Fails on its report, or when the run fails otherwise."""
    import subprocess

    code = ("import sys, torch; sys.path[:0] = sys.argv[1:3]; import cuda_checks as c; "
            "c.race_shape = lambda device: (256, 688); "
            "r = c.races(torch.device('cuda'), steps=4, cycles=0); print(r); sys.exit(0 if r['ok'] else 1)")
    env = {**os.environ, "TORCH_CUDA_SANITIZER": "1"}
    try:
        here = Path(__file__).resolve().parent
        done = subprocess.run([sys.executable, "-c", code, str(here), str(here.parent)], env=env,
                              capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return {"ok": False, "ran": False, "why": f"did not finish within {timeout_s} s"}
    tail = (done.stdout + done.stderr)[-3000:]
    reported = "CUDASanitizerErrors" in tail or "CSAN detected" in tail
    return {"ok": done.returncode == 0 and not reported, "ran": True, "race_reported": reported,
            "returncode": done.returncode, "output_tail": tail}


# ---------------------------------------------------------------------------------------------------------------
# Device memory, measured against the estimate (CUDA only)
# ---------------------------------------------------------------------------------------------------------------
#: What the allocator may hold beyond the estimate and the activations: cuBLAS's workspace, rounding to blocks.
MEMORY_SLACK_BYTES = 96 << 20


def _memory_model(device: torch.device) -> torch.nn.Module:
    hidden, intermediate = race_shape(device)
    torch.manual_seed(0)
    return torch.nn.Sequential(MlpPair(hidden, intermediate, device), MlpPair(hidden, intermediate, device))


def _memory_run(device: torch.device, steps: int, **settings: Any) -> dict[str, int]:
    """Peak allocated and reserved bytes of `steps` steps (from a fresh allocator state), the optimizer's estimate
    of its peak (`device_budget.estimate_peak`, as the limit uses it) and the activations' bytes."""
    from hf_zenflow.engine.device_budget import estimate_peak

    model = _memory_model(device)
    hidden = race_shape(device)[0]
    x = torch.randn(16, hidden, device=device, dtype=torch.bfloat16)
    weights = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    model(x).float().square().mean().backward()  # (activations and gradients, no optimizer)
    gradients = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    activations = max(0, torch.cuda.max_memory_allocated(device) - weights - gradients)
    model.zero_grad(set_to_none=True)
    opt = _zenflow(model, lr=1e-3, topk_ratio=0.1, update_interval=2, select_interval=100, **settings)
    try:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
        for _ in range(steps):
            model(x).float().square().mean().backward()
            opt.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
        opt.synchronize()
        estimate = estimate_peak(opt.param_groups, opt.config, opt._offload_threshold(),
                                 opt._host.backward.free_kind is not None,
                                 accumulate_on=opt.stats()["accumulate_on"]).total
        return {"allocated_peak": torch.cuda.max_memory_allocated(device),
                "reserved_peak": torch.cuda.max_memory_reserved(device), "estimate": estimate,
                "activations": activations, "offloaded_gradient_bytes": gradients}
    finally:
        opt.close()


def device_memory(device: torch.device, steps: int = 4) -> dict[str, Any]:
    """Measured against the estimate: with gradients freed in backward and without, the allocator's peak stays
    within the optimizer's estimate plus the activations (and `MEMORY_SLACK_BYTES`); freeing lowers it by at least
    half of the gradients it frees (all but the largest, which its hook still holds); and under a
    ``device_memory_limit_bytes`` of the freed run's estimate, the memory the allocator reserves stays within the
    limit plus the activations and the slack."""
    runs = {free: _memory_run(device, steps, accumulate_on="host", free_gradients_in_backward=free)
            for free in ("off", "on")}
    limit = runs["on"]["estimate"]
    limited = _memory_run(device, steps, accumulate_on="host", free_gradients_in_backward="on",
                          device_memory_limit_bytes=limit)
    within = {name: run["allocated_peak"] <= run["estimate"] + run["activations"] + MEMORY_SLACK_BYTES
              for name, run in {**{f"free={k}": v for k, v in runs.items()}, "limited": limited}.items()}
    hidden, intermediate = race_shape(device)
    largest = hidden * intermediate * torch.bfloat16.itemsize  # (the largest gradient: one MLP matrix's)
    freed_saves = runs["off"]["allocated_peak"] - runs["on"]["allocated_peak"]
    freeing_ok = freed_saves >= 0.5 * (runs["on"]["offloaded_gradient_bytes"] - largest)
    limit_ok = limited["estimate"] <= limit and \
        limited["reserved_peak"] <= limit + limited["activations"] + MEMORY_SLACK_BYTES
    return {"ok": all(within.values()) and freeing_ok and limit_ok, "within_estimate": within,
            "freeing_saves_bytes": freed_saves, "freeing_ok": freeing_ok, "limit_bytes": limit, "limit_ok": limit_ok,
            "runs": {**{f"free={k}": v for k, v in runs.items()}, "limited": limited}}


DEVICE_INDEPENDENT = {"fp16_grad_scaler": fp16_grad_scaler, "races": races}
CUDA_ONLY = {"host_syncs": host_syncs, "pinned_link_buffers": pinned_link_buffers, "device_memory": device_memory,
             "sanitized": sanitized}
#: Checks that need more than one GPU (skipped, and said so, on one).
MULTI_GPU = {"nccl_two_ranks": nccl_two_ranks}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--out-dir", default="gpu_out")
    p.add_argument("--device", default="cuda", help="cuda (every check) or cpu (the device-independent ones)")
    p.add_argument("--checks", default=None,
                   help="comma-separated names to run (default: every check the device allows); results go to "
                        "<out-dir>/cuda_checks_<names>.json then")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("cuda_checks: no CUDA device: nothing to check (--device cpu runs the device-independent checks)")
        return 0
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else device.type,
                           "torch": torch.__version__}
    allowed = {**DEVICE_INDEPENDENT}
    if device.type == "cuda":
        allowed.update(CUDA_ONLY)
        if torch.cuda.device_count() > 1:
            allowed.update(MULTI_GPU)
    wanted = args.checks.split(",") if args.checks else list(allowed)
    unknown = [name for name in wanted if name not in {**DEVICE_INDEPENDENT, **CUDA_ONLY, **MULTI_GPU}]
    if unknown:
        p.error(f"unknown checks {unknown}")
    results = Path(args.out_dir) / (f"cuda_checks_{'_'.join(wanted)}.json" if args.checks else "cuda_checks.json")
    Path(args.out_dir).mkdir(parents=True, exist_ok=True)
    failed = False
    for name in wanted:
        if name not in allowed:
            out[name] = {"ok": True, "ran": False,
                         "why": "needs CUDA" if name in CUDA_ONLY else "needs more than one GPU"}
        else:
            try:
                out[name] = allowed[name](device)
                failed |= out[name].get("ok") is not True
            except Exception as exc:  # noqa: BLE001 - one failing check must not hide the others' results
                traceback.print_exc()
                out[name] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
                failed = True
        print(name, "ok" if out[name].get("ok") else "FAILED", json.dumps(out[name], default=str)[:2000], flush=True)
        # written after every check: a run stopped by its time limit keeps the results it has
        results.write_text(json.dumps(out, indent=2, default=str))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
