"""Host work and host memory per rank: ZenFlowAdamW in one process, under DDP on 2 ranks and under FSDP2 on 2 ranks,
training the same model with the same settings, side by side in one invocation.

    python scripts/bench_ranks.py                                  # 26M parameters, 2 rounds, ~3 minutes here
    python scripts/bench_ranks.py --layers 1 --hidden 256 --steps 4 --rounds 1       # a quick look

The model is a stack of `--layers` Llama-MLP blocks (``x + down(silu(gate(x)) * up(x))``, intermediate size
8/3 × hidden rounded up to 256, no biases), row-major weights; MSE loss against random targets. ZenFlow settings for
all: r=0.1, U=4, overlap on, the write-back one step into the next window (the engine rule ``writeback_lag=1``), one
host worker thread, no re-selection after the first selection, every matrix offloaded (``min_offload_numel=0``).
Configurations, each in fresh processes spawned from this one (torch.multiprocessing, gloo over a rendezvous file,
``OMP_NUM_THREADS=1`` and 1 torch thread per process):

- ``one``: one process, batch 2B (the global batch of the others);
- ``ddp``: 2 ranks of ``DistributedDataParallel``, batch B each (`hf_zenflow.distributed.sharding`: 1/2 of every
  offloaded matrix's host state and host AdamW per rank, all-gather at each write-back);
- ``fsdp2``: 2 ranks of ``fully_shard`` (each block, then the root), batch B each (`hf_zenflow.distributed.fsdp`: each
  rank its own rows).

The three run one after another, `--rounds` times, the order rotated every round, so machine drift shows between
rounds. Per configuration and rank, over the steps after `--warmup`: median ``host_step_ms`` (the host AdamW of one
window, on the worker; sampled at each window close, when it is the last finished window's), median
``accumulate_ms`` (one step's gradient added into the window sum, on the worker), the CPU time of the worker thread
per step (``pthread_getcpuclockid``: the host work itself, whatever share of the cores the thread got),
``host_state_bytes`` at the end, ``gather_buffer_bytes`` (DDP's write-back all-gather buffer: on the host with gloo,
not part of the host state), mean ``bytes_to_host`` per step, median ``critical_path_ms`` (the caller's time in
``step()``) and median wall time of the whole training step (forward, backward with its collectives, ``step()``).
Ratios are against the ``one`` run of the same round. All ranks share this machine's cores: with fewer cores than
ranks × 2 threads (training + worker) the per-rank wall times are an upper bound of what a rank with its own cores
would take.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import statistics
import tempfile
import threading
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from hf_zenflow import ZenFlowAdamW
from hf_zenflow.tuning.tune_grid import study_config


#: (with the write-back one step into the next window, an engine rule)
SETTINGS = dict(topk_ratio=0.1, update_interval=4, overlap_step=True, cpu_threads=1,
                select_strategy="step", select_interval=100_000,  # one selection, at the first step
                min_offload_numel=0,  # a small --hidden still offloads every matrix
                writeback_lag=1)
CONFIGS = {"one": 1, "ddp": 2, "fsdp2": 2}  # name -> ranks
MiB = 2**20


class Block(torch.nn.Module):
    """A Llama MLP with a residual: the shapes whose host state dominates a decoder layer."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate = torch.nn.Linear(hidden, intermediate, bias=False)
        self.up = torch.nn.Linear(hidden, intermediate, bias=False)
        self.down = torch.nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.silu(self.gate(x)) * self.up(x))


def build(layers: int, hidden: int) -> torch.nn.Sequential:
    torch.manual_seed(0)  # every configuration and rank starts from the same weights
    intermediate = -(-hidden * 8 // 3 // 256) * 256
    return torch.nn.Sequential(*[Block(hidden, intermediate) for _ in range(layers)])


def _worker_cpu_s() -> float:
    """CPU seconds the host worker thread has used: its share of the work, whatever share of the cores it got."""
    worker = [t for t in threading.enumerate() if t.name == "hf_zenflow-host"]
    if len(worker) != 1 or worker[0].ident is None:
        raise RuntimeError(f"expected one hf_zenflow-host thread, found {len(worker)}")
    return time.clock_gettime(time.pthread_getcpuclockid(worker[0].ident))


def _rank_run(rank: int, init_file: str, kind: str, args: argparse.Namespace, out_dir: str) -> None:
    torch.set_num_threads(1)
    ranks = CONFIGS[kind]
    if ranks > 1:
        dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=ranks,
                                timeout=datetime.timedelta(seconds=300))
    try:
        record = _train(rank, ranks, kind, args)
    finally:
        if ranks > 1:
            dist.destroy_process_group()
    with open(os.path.join(out_dir, f"{kind}_rank{rank}.json"), "w") as f:
        json.dump(record, f)


def _train(rank: int, ranks: int, kind: str, args: argparse.Namespace) -> dict:
    model = build(args.layers, args.hidden)
    net: torch.nn.Module = model
    if kind == "ddp":
        net = torch.nn.parallel.DistributedDataParallel(model)
    elif kind == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in model:
            fully_shard(block)
        fully_shard(model)
    opt = ZenFlowAdamW(model.parameters(), lr=1e-4, config=study_config(
        {**SETTINGS, "accumulate_on": args.accumulate_on, "host_moment_dtype": args.host_moment_dtype}))
    opt.name_parameters(model)
    gen = torch.Generator().manual_seed(1)
    global_batch = 2 * args.batch  # every configuration trains on the same global batch
    batches = [(torch.randn(global_batch, args.hidden, generator=gen), torch.randn(global_batch, args.hidden,
                                                                                   generator=gen)) for _ in range(4)]
    part = slice(None) if ranks == 1 else slice(rank * args.batch, (rank + 1) * args.batch)
    series: dict[str, list[float]] = {k: [] for k in ("critical_path_ms", "accumulate_ms", "bytes_to_host",
                                                      "step_ms", "host_step_ms")}
    total = args.warmup + args.steps
    windows = 0
    worker_cpu = [0.0, 0.0]  # the host worker thread's CPU seconds at the start and end of the measured steps
    for i in range(total):
        if i == args.warmup:
            worker_cpu[0] = _worker_cpu_s()
        x, y = batches[i % len(batches)]
        t0 = time.perf_counter()
        torch.nn.functional.mse_loss(net(x[part]), y[part]).backward()
        opt.step()
        opt.zero_grad()
        wall_ms = (time.perf_counter() - t0) * 1e3
        stats = opt.stats()
        closed = stats["windows"] > windows
        windows = int(stats["windows"])
        if i >= args.warmup:
            for key in ("critical_path_ms", "accumulate_ms", "bytes_to_host"):
                series[key].append(stats[key])
            series["step_ms"].append(wall_ms)
            if closed and stats["host_step_ms"] > 0:
                series["host_step_ms"].append(stats["host_step_ms"])
        if rank == 0 and (i + 1) % 8 == 0:
            print(f"    {kind}: step {i + 1}/{total}, {wall_ms:.0f} ms", flush=True)
    worker_cpu[1] = _worker_cpu_s()
    opt.flush()  # a collective under DDP: every rank calls it
    stats = opt.stats()
    opt.close()
    return {"kind": kind, "rank": rank, "ranks": int(stats["ranks"]), "series": series,
            "host_state_bytes": stats["host_state_bytes"], "device_state_bytes": stats["device_state_bytes"],
            "gather_buffer_bytes": stats["gather_buffer_bytes"], "windows": windows,
            "worker_cpu_ms_per_step": (worker_cpu[1] - worker_cpu[0]) * 1e3 / args.steps,
            "params": sum(p.numel() for p in model.parameters())}


def run_config(kind: str, args: argparse.Namespace) -> list[dict]:
    """`kind` in fresh processes; each rank's record, by rank."""
    work = tempfile.mkdtemp(prefix="hf_zenflow_bench_ranks_")
    try:
        mp.spawn(_rank_run, args=(os.path.join(work, "pg_init"), kind, args, work), nprocs=CONFIGS[kind], join=True)
        records = []
        for rank in range(CONFIGS[kind]):
            with open(os.path.join(work, f"{kind}_rank{rank}.json")) as f:
                records.append(json.load(f))
        return records
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _med(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summarize(record: dict) -> dict[str, float]:
    s = record["series"]
    return {"host_adamw_ms": _med(s["host_step_ms"]), "host_windows": len(s["host_step_ms"]),
            "accumulate_ms": _med(s["accumulate_ms"]), "host_mib": record["host_state_bytes"] / MiB,
            "to_host_mib": statistics.fmean(s["bytes_to_host"]) / MiB if s["bytes_to_host"] else float("nan"),
            "critical_path_ms": _med(s["critical_path_ms"]), "step_ms": _med(s["step_ms"]),
            "worker_cpu_ms": record["worker_cpu_ms_per_step"]}


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def table(results: list[dict]) -> list[str]:
    lines = ["| round | config | rank | host AdamW ms (windows) | × one | accumulate ms | worker CPU ms/step | "
             "× one | host state MiB | × one | gather buffer MiB | to host MiB/step | critical path ms | step ms |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        one = summarize(next(r for r in results if r["round"] == res["round"] and r["kind"] == "one")["ranks"][0])
        for record in res["ranks"]:
            s = summarize(record)
            lines.append(
                f"| {res['round']} | {res['kind']} | {record['rank']} | {s['host_adamw_ms']:.1f} "
                f"({s['host_windows']}) | {_ratio(s['host_adamw_ms'], one['host_adamw_ms']):.2f} | "
                f"{s['accumulate_ms']:.1f} | {s['worker_cpu_ms']:.1f} | "
                f"{_ratio(s['worker_cpu_ms'], one['worker_cpu_ms']):.2f} | {s['host_mib']:.1f} | "
                f"{_ratio(s['host_mib'], one['host_mib']):.3f} | {record['gather_buffer_bytes'] / MiB:.1f} | "
                f"{s['to_host_mib']:.1f} | {s['critical_path_ms']:.1f} | {s['step_ms']:.0f} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=3, help="Llama-MLP blocks (default 3: 26M parameters)")
    ap.add_argument("--hidden", type=int, default=1024, help="hidden size (default 1024; intermediate 2816)")
    ap.add_argument("--batch", type=int, default=16, help="rows per rank (B; one process gets 2B; default 16)")
    ap.add_argument("--steps", type=int, default=16, help="measured steps per configuration (default 16: 4 windows)")
    ap.add_argument("--warmup", type=int, default=8, help="unmeasured steps first (default 8: two windows)")
    ap.add_argument("--rounds", type=int, default=2, help="times the three configurations run (default 2)")
    ap.add_argument("--accumulate-on", default="auto", choices=("auto", "host", "device"),
                    help='the rule accumulate_on for every configuration (default "auto": the host on a CPU device)')
    ap.add_argument("--host-moment-dtype", default="float32", choices=("float32", "bfloat16"),
                    help="the rule host_moment_dtype for every configuration (default float32)")
    ap.add_argument("--out", default=None, help="write the raw per-step numbers of every run to this JSON file")
    args = ap.parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = "1"  # inherited by the spawned processes: 1 training thread each
    started = time.perf_counter()
    load = os.getloadavg()
    print(f"{args.layers} x Llama MLP (hidden {args.hidden}), batch {args.batch} per rank; r=0.1, U=4, overlap, "
          f"writeback_lag=1, 1 worker thread; {os.cpu_count()} CPUs, load average {load[0]:.2f} before", flush=True)
    results: list[dict] = []
    names = list(CONFIGS)
    for rnd in range(1, args.rounds + 1):
        shift = (rnd - 1) % len(names)
        for kind in names[shift:] + names[:shift]:
            t0 = time.perf_counter()
            print(f"round {rnd}/{args.rounds}: {kind} ({CONFIGS[kind]} process(es))", flush=True)
            results.append({"round": rnd, "kind": kind, "ranks": run_config(kind, args)})
            print(f"  done in {time.perf_counter() - t0:.1f} s", flush=True)
    results.sort(key=lambda r: (r["round"], names.index(r["kind"])))
    params = results[0]["ranks"][0]["params"]
    print(f"\n{params / 1e6:.1f}M parameters; medians over the {args.steps} steps after {args.warmup} warm-up "
          f"steps; × one = ratio to the one-process run of the same round; {time.perf_counter() - started:.0f} s")
    print("\n".join(table(results)))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"args": vars(args), "settings": SETTINGS, "rules": {"writeback_lag": 1}, "load_before": load,
                       "results": results}, f)
        print(f"raw numbers: {args.out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
