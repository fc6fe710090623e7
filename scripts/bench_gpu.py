#!/usr/bin/env python
"""GPU benchmark: a Llama-architecture model built from config (bf16), sized so that the optimizer state is the
problem, trained for a few steps with each optimizer; prints a markdown table and writes JSON.

Optimizers (same model init, batch and hyper-parameters):
  adamw_torch_fused   torch.optim.AdamW(fused=True) on the GPU, no offload (bf16 params, so bf16 moments)
  sync_offload        hf_zenflow.SyncOffloadAdamW (ZeRO-Offload schedule)
  zenflow             hf_zenflow.ZenFlowAdamW (topk_ratio / update_interval from the flags)
  zenflow_device_acc  the same with accumulate_on="device" (window summed on the GPU, +4 B/offloaded param)
  torchao_offload     torchao.optim.CPUOffloadOptimizer(AdamW, fused=True), if torchao imports
  deepspeed_offload   DeepSpeed ZeRO-2 + offload_optimizer=cpu, if deepspeed imports (one process, world size 1)
  deepspeed_zenflow   DeepSpeed ZeRO-2 + zenflow block, if deepspeed imports and has ZenFlow

Per step the script synchronises the current CUDA stream after backward and after the optimizer step, so
"fwd+bwd ms" and "optimizer ms" split the step as the training loop sees it; "stall ms" is step time minus the
forward+backward time of the same run: the time the device waits for the optimizer; "GPU busy" is the CUDA-event
time of forward+backward over the step's wall time (the fraction of the step the GPU works on the model).
Unavailable optimizers are skipped with the reason in the table.

One call on an H200 (default size ~1.4B params; about 5 minutes):
    python scripts/bench_gpu.py --out-dir $OUT
Check on a CPU (tiny model, a few steps, every code path but DeepSpeed's launcher):
    python scripts/bench_gpu.py --smoke --out-dir /tmp/bench_smoke
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch


ALL = ("adamw_torch_fused", "sync_offload", "zenflow", "zenflow_device_acc", "torchao_offload", "deepspeed_offload",
       "deepspeed_zenflow")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=12, help="timed steps per optimizer")
    p.add_argument("--warmup", type=int, default=4, help="untimed steps first (state allocation, first windows)")
    p.add_argument("--lr", type=float, default=1e-5)
    p.add_argument("--topk-ratio", type=float, default=0.1)
    p.add_argument("--update-interval", type=int, default=4)
    p.add_argument("--cpu-threads", type=int, default=None, help="host optimizer threads (default: affinity)")
    p.add_argument("--optimizers", default=",".join(ALL))
    p.add_argument("--out-dir", default="bench_gpu_out")
    p.add_argument("--smoke", action="store_true", help="tiny model on CPU (or GPU if present), 2+1 steps")
    p.add_argument("--device", default=None, help="default: cuda if available else cpu")
    args = p.parse_args(argv)
    if args.smoke:
        args.hidden, args.layers, args.intermediate, args.heads, args.kv_heads = 64, 2, 160, 4, 4
        args.vocab, args.seq, args.batch, args.steps, args.warmup = 256, 32, 2, 2, 1
    return args


def build_model(args: argparse.Namespace, device: torch.device) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=args.hidden, num_hidden_layers=args.layers, intermediate_size=args.intermediate,
        num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
        max_position_embeddings=max(args.seq, 128), tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    with torch.device(device):  # initialise on the device: a 1.4B model initialised on the CPU takes minutes
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.config.use_cache = False
    return model


def make_batches(args: argparse.Namespace, device: torch.device, n: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(device) for _ in range(n)]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class _Plain:
    """Drives a torch.optim-like optimizer: backward on the loss, optimizer.step()."""

    def __init__(self, model: torch.nn.Module, opt: Any, name: str) -> None:
        self.model, self.opt, self.name = model, opt, name

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self) -> None:
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def stats(self) -> dict[str, Any]:
        return dict(self.opt.stats()) if hasattr(self.opt, "stats") else {}

    def finish(self) -> None:
        for meth in ("flush", "close"):
            if hasattr(self.opt, meth):
                getattr(self.opt, meth)()


class _DeepSpeed(_Plain):
    def backward(self, loss: torch.Tensor) -> None:
        self.model.backward(loss)

    def step(self) -> None:
        self.model.step()

    def finish(self) -> None:
        pass


def _deepspeed_engine(model: torch.nn.Module, args: argparse.Namespace, zenflow: bool) -> _DeepSpeed:
    import deepspeed  # noqa: F401 - raises ImportError when absent: the row is skipped

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    zero: dict[str, Any] = {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                            "overlap_comm": True, "contiguous_gradients": True}
    if zenflow:
        zero["zenflow"] = {"topk_ratio": args.topk_ratio, "update_interval": args.update_interval,
                           "select_strategy": "step", "select_interval": 100, "overlap_step": True,
                           "full_warm_up_rounds": 0}
    config = {"train_micro_batch_size_per_gpu": args.batch, "gradient_accumulation_steps": 1,
              "bf16": {"enabled": True}, "zero_optimization": zero,
              "optimizer": {"type": "AdamW", "params": {"lr": args.lr, "betas": [0.9, 0.999], "eps": 1e-8,
                                                         "weight_decay": 0.01}},
              "zero_allow_untested_optimizer": True, "wall_clock_breakdown": False}
    import deepspeed as ds

    engine, _, _, _ = ds.initialize(model=model, model_parameters=model.parameters(), config=config)
    return _DeepSpeed(engine, None, "deepspeed_zenflow" if zenflow else "deepspeed_offload")


def make_runner(name: str, model: torch.nn.Module, args: argparse.Namespace) -> _Plain:
    common = {"lr": args.lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    if name == "adamw_torch_fused":
        return _Plain(model, torch.optim.AdamW(model.parameters(), fused=True, **common), name)
    if name == "sync_offload":
        from hf_zenflow import SyncOffloadAdamW

        return _Plain(model, SyncOffloadAdamW(model.parameters(), cpu_threads=args.cpu_threads, **common), name)
    if name in ("zenflow", "zenflow_device_acc"):
        from hf_zenflow import ZenFlowAdamW
        from hf_zenflow.tuning.tune_grid import study_config

        config = study_config(dict(topk_ratio=args.topk_ratio, update_interval=args.update_interval,
                                   overlap_step=True, cpu_threads=args.cpu_threads, select_strategy="step",
                                   select_interval=100,
                                   accumulate_on="device" if name == "zenflow_device_acc" else "host"))
        opt = ZenFlowAdamW(model.parameters(), config=config, **common)
        return _Plain(model, opt, name)
    if name == "torchao_offload":
        from torchao.optim import CPUOffloadOptimizer

        return _Plain(model, CPUOffloadOptimizer(model.parameters(), torch.optim.AdamW, fused=True, **common), name)
    if name in ("deepspeed_offload", "deepspeed_zenflow"):
        return _deepspeed_engine(model, args, zenflow=name == "deepspeed_zenflow")
    raise ValueError(f"unknown optimizer {name!r}: allowed are {ALL}")


def run_one(name: str, args: argparse.Namespace, device: torch.device, batches: list[torch.Tensor]) -> dict[str, Any]:
    model = build_model(args, device)
    model.train()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    runner = make_runner(name, model, args)
    fwd = runner.model
    fb, opt_ms, step_ms, losses, stats, busy = [], [], [], [], [], []
    total = args.warmup + args.steps
    cuda = device.type == "cuda"
    for i in range(total):
        ids = batches[i % len(batches)]
        _sync(device)
        t0 = time.perf_counter()
        # GPU utilisation: CUDA events around the model's device work (forward and backward on the current stream)
        # against the step's wall time; the rest of the step the GPU waits for the optimizer
        start, end = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if cuda else (None,
                                                                                                               None)
        if start is not None:
            start.record()
        loss = fwd(input_ids=ids, labels=ids).loss
        runner.backward(loss)
        if end is not None:
            end.record()
        _sync(device)
        t1 = time.perf_counter()
        runner.step()
        _sync(device)
        t2 = time.perf_counter()
        losses.append(float(loss.detach()))
        if i >= args.warmup:
            fb.append((t1 - t0) * 1e3)
            opt_ms.append((t2 - t1) * 1e3)
            step_ms.append((t2 - t0) * 1e3)
            stats.append(runner.stats())
            if start is not None:
                busy.append(start.elapsed_time(end) / ((t2 - t0) * 1e3))
        print(f"[bench] {name:>18s} step {i + 1}/{total}: fwd+bwd {(t1 - t0) * 1e3:8.1f} ms, optimizer "
              f"{(t2 - t1) * 1e3:8.1f} ms, loss {losses[-1]:.4f}", flush=True)
    runner.finish()
    n_params = sum(p.numel() for p in model.parameters())
    out = {
        "optimizer": name,
        "params": n_params,
        "step_ms_mean": statistics.fmean(step_ms),
        "step_ms_median": statistics.median(step_ms),
        "fwd_bwd_ms_mean": statistics.fmean(fb),
        "optimizer_ms_mean": statistics.fmean(opt_ms),
        "optimizer_ms_median": statistics.median(opt_ms),
        "stall_ms_mean": statistics.fmean(step_ms) - statistics.fmean(fb),
        "steps_per_s": 1e3 / statistics.fmean(step_ms),
        "tokens_per_s": args.batch * args.seq * 1e3 / statistics.fmean(step_ms),
        "loss_first": losses[0],
        "loss_last": losses[-1],
        "gpu_busy_fraction": statistics.fmean(busy) if busy else None,
        # (ZenFlowAdamW resets the allocator's peak at the end of each step and keeps the run's in its stats)
        "peak_device_memory_gib": max(torch.cuda.max_memory_allocated(device),
                                      (stats[-1] if stats else {}).get("peak_device_bytes", 0)) / 2**30
        if device.type == "cuda" else None,
        "engine_stats_last": {k: v for k, v in (stats[-1] if stats else {}).items() if isinstance(v, (int, float))},
    }
    del runner, model, fwd
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return out


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| optimizer | steps/s | step ms (median) | fwd+bwd ms | optimizer ms (median) | stall ms | "
             "vs adamw_torch_fused | vs sync_offload | GPU busy | peak GPU GiB | loss first -> last |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    by = {r["optimizer"]: r for r in rows if "skipped" not in r}
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['optimizer']} | skipped: {r['skipped']} | | | | | | | | | |")
            continue
        base = by.get("adamw_torch_fused")
        sync = by.get("sync_offload")
        vs_base = f"{r['step_ms_mean'] / base['step_ms_mean']:.2f}x time" if base else "n/a"
        vs_sync = f"{sync['step_ms_mean'] / r['step_ms_mean']:.2f}x faster" if sync else "n/a"
        mem = "n/a" if r["peak_device_memory_gib"] is None else f"{r['peak_device_memory_gib']:.1f}"
        gpu = "n/a" if r["gpu_busy_fraction"] is None else f"{r['gpu_busy_fraction']:.0%}"
        lines.append(f"| {r['optimizer']} | {r['steps_per_s']:.3f} | {r['step_ms_mean']:.1f} "
                     f"({r['step_ms_median']:.1f}) | {r['fwd_bwd_ms_mean']:.1f} | {r['optimizer_ms_mean']:.1f} "
                     f"({r['optimizer_ms_median']:.1f}) | {r['stall_ms_mean']:.1f} | {vs_base} | {vs_sync} | "
                     f"{gpu} | {mem} | "
                     f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    names = [n.strip() for n in args.optimizers.split(",") if n.strip()]
    batches = make_batches(args, device, min(4, args.warmup + args.steps))
    info = {"date_utc": time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()), "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform(), "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None,
            "cpu_count": os.cpu_count(), "argv": sys.argv[1:], "args": vars(args)}
    print(f"[bench] {info['gpu'] or device}; torch {torch.__version__}; optimizers {names}", flush=True)
    rows: list[dict[str, Any]] = []
    for name in names:
        t0 = time.perf_counter()
        try:
            row = run_one(name, args, device, batches)
        except ImportError as exc:
            row = {"optimizer": name, "skipped": f"not importable ({exc.name or exc})"}
        except Exception as exc:  # noqa: BLE001 - one failing baseline must not lose the other rows
            traceback.print_exc()
            row = {"optimizer": name, "skipped": f"failed: {type(exc).__name__}: {str(exc)[:160]}"}
            gc.collect()
            if device.type == "cuda":
                torch.cuda.empty_cache()
        row["wall_s"] = time.perf_counter() - t0
        rows.append(row)
        (out_dir / "bench_gpu.json").write_text(json.dumps({"info": info, "rows": rows}, indent=2, default=str))
    md = table(rows)
    n = next((r["params"] for r in rows if "params" in r), None)
    head = (f"{info['date_utc']} UTC, {info['gpu'] or device}, torch {info['torch']}; Llama "
            f"{(n or 0) / 1e9:.2f}B params bf16, batch {args.batch} x {args.seq} tokens, {args.steps} timed steps "
            f"after {args.warmup}; ZenFlow topk_ratio {args.topk_ratio}, update_interval {args.update_interval}")
    print("\n" + head + "\n\n" + md, flush=True)
    (out_dir / "bench_gpu.md").write_text(head + "\n\n" + md + "\n")
    ok = [r for r in rows if "skipped" not in r]
    return 0 if ok and all(math.isfinite(r["step_ms_mean"]) for r in ok) else 1


if __name__ == "__main__":
    sys.exit(main())
