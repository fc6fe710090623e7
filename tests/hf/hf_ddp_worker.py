"""One rank of the multi-process tests (`test_trainer_ddp.py`), started by torchrun: trains the tiny Llama with
`ZenFlowTrainer` (DDP, gloo) or a plain accelerate loop with `ZenFlowPlugin` (DDP, or accelerate's FSDP with
``--fsdp-version``; ``--save-steps N``: ``save_state`` to ``OUT/state-N``; ``--resume OUT/state-N``: ``load_state``,
train on from batch N), or tries `ZenFlowTrainer` on a model sharded with `fully_shard` by hand (the Trainer's FSDP
off), and leaves what the test compares in ``--out``: ``rank{r}.pt`` (final weights and logged losses) or
``error_rank{r}.txt`` (the exception that ended the rank).

    python -m torch.distributed.run --nproc_per_node 2 tests/hf/hf_ddp_worker.py trainer --out OUT
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hf_helpers import ByteLMDataset, corpus_text, fsdp_on_cpu, full_weights, logged, tiny_llama, zenflow_args


ZENFLOW = dict(zenflow_topk_ratio=0.1, zenflow_update_interval=4, zenflow_overlap_step=True)


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


def device_args(opts: argparse.Namespace) -> dict:
    """CPU ranks talk over gloo; GPU ranks (scripts/gpu_check.sh) over NCCL, one GPU each; and the host moments'
    state's preset when `--host-state` names one."""
    moments = {"zenflow_host_state": opts.host_state} if opts.host_state else {}
    if opts.device == "cpu":
        return {"use_cpu": True, "ddp_backend": "gloo", **moments}
    return {"use_cpu": False, "ddp_backend": "nccl", **moments}


def on_host(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().cpu() for k, v in model.state_dict().items()}


def run_trainer(opts: argparse.Namespace) -> dict:
    from transformers import TrainerCallback

    from hf_zenflow import ZenFlowTrainer

    class DieAt(TrainerCallback):
        """Rank 1 stops taking part after `--die-at-step` steps: "exit" vanishes without an exception or a goodbye
        to the process group (exit code 0, so that torchrun leaves the other rank alone and the test sees how that
        rank itself ends); "hang" stays alive and silent (sleeps), so only the process group's timeout can tell."""

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == opts.die_at_step and rank() == 1:
                if opts.die_how == "exit":
                    os._exit(0)
                time.sleep(3600)

    save = dict(save_strategy="steps", save_steps=opts.save_steps) if opts.save_steps else {}
    args = zenflow_args(Path(opts.out) / "run", max_steps=opts.max_steps, ddp_timeout=opts.ddp_timeout,
                        ddp_find_unused_parameters=False, **device_args(opts), **save, **ZENFLOW)
    trainer = ZenFlowTrainer(model=tiny_llama(), args=args, train_dataset=ByteLMDataset(corpus_text(),
                                                                                         num_samples=256),
                             callbacks=[DieAt()] if opts.die_at_step else None)
    # "newest": resume_from_checkpoint=True (the newest complete checkpoint of the run)
    trainer.train(resume_from_checkpoint=True if opts.resume == "newest" else opts.resume)
    return {"weights": on_host(trainer.model), "losses": logged(trainer), "world_size": args.world_size}


def plugin_accelerator(opts: argparse.Namespace) -> Any:
    """The Accelerator of the plugin loop: DDP, or FSDP of ``--fsdp-version`` (on CPU through `fsdp_on_cpu`)."""
    from accelerate import Accelerator, FullyShardedDataParallelPlugin

    if not opts.fsdp_version:
        return Accelerator(cpu=opts.device == "cpu")
    if opts.device == "cpu":
        fsdp_on_cpu()
    return Accelerator(cpu=opts.device == "cpu",
                       fsdp_plugin=FullyShardedDataParallelPlugin(fsdp_version=opts.fsdp_version))


def run_plugin(opts: argparse.Namespace) -> dict:
    from hf_zenflow import ZenFlowPlugin

    accelerator = plugin_accelerator(opts)
    model = tiny_llama()
    loader = torch.utils.data.DataLoader(ByteLMDataset(corpus_text(), num_samples=256), batch_size=4)
    plugin = ZenFlowPlugin(topk_ratio=0.1, update_interval=4, cpu_threads=1, min_offload_numel=0)
    model, optimizer, loader = plugin.prepare(accelerator, model, loader, lr=3e-3)
    start, loaded = 0, None
    if opts.resume:  # a checkpoint of --save-steps N is a folder named state-N
        accelerator.load_state(opts.resume)
        start = int(Path(opts.resume).name.removeprefix("state-"))
        loader = accelerator.skip_first_batches(loader, start)
        zenflow = optimizer.state_dict()["zenflow"]  # every rank: a collective under DDP
        keys = ("steps", "fsdp_ranks", "fsdp_rank") if opts.fsdp_version else ("steps", "ranks", "rank")
        loaded = {key: zenflow.get(key) for key in keys}
    losses, first_batch = [], None
    for step, batch in enumerate(loader, start):
        first_batch = batch["input_ids"].tolist() if first_batch is None else first_batch
        if step == opts.max_steps:
            break
        if step and step == opts.save_steps:  # save mid-window, then train on
            accelerator.save_state(str(Path(opts.out) / f"state-{step}"))
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.optimizer.clip_grad_norm_(1.0)  # the ZenFlowAdamW inside the AcceleratedOptimizer
        optimizer.step()
        optimizer.zero_grad()
        losses.append(accelerator.reduce(loss.detach(), "mean").item())
    stats = optimizer.optimizer.stats()
    stats["dtensor_params"] = sum(type(p).__name__ == "DTensor" for g in optimizer.param_groups for p in g["params"])
    plugin.flush(optimizer)
    weights = full_weights(model) if opts.fsdp_version else on_host(accelerator.unwrap_model(model))
    return {"weights": weights, "losses": losses, "world_size": accelerator.num_processes,
            "first_batch": first_batch, "loaded": loaded, "stats": stats}


def run_fsdp2(opts: argparse.Namespace) -> dict:
    from torch.distributed.fsdp import fully_shard

    from hf_zenflow import ZenFlowTrainer

    torch.distributed.init_process_group("gloo")
    model = tiny_llama()
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    args = zenflow_args(Path(opts.out) / "run", max_steps=2, ddp_backend="gloo", **ZENFLOW)
    ZenFlowTrainer(model=model, args=args, train_dataset=ByteLMDataset(corpus_text(), num_samples=16)).train()
    return {"weights": {}, "losses": [], "world_size": torch.distributed.get_world_size()}


def common_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments every torchrun worker of these tests takes."""
    parser.add_argument("--out", required=True)
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--max-steps", type=int, default=12)
    parser.add_argument("--save-steps", type=int, default=0)
    parser.add_argument("--resume", default=None)
    parser.add_argument("--host-state", default=None, help="zenflow_host_state (default: the library's)")


def run_rank(opts: argparse.Namespace, run: Callable[[argparse.Namespace], dict]) -> None:
    """Run this rank's part and leave ``rank{r}.pt`` (its result) or ``error_rank{r}.txt`` in ``--out``."""
    torch.set_num_threads(1)  # two ranks on a small shared machine: see tests/hf/conftest.py
    out = Path(opts.out)
    out.mkdir(parents=True, exist_ok=True)
    try:
        result = run(opts)
    except BaseException:
        (out / f"error_rank{rank()}.txt").write_text(traceback.format_exc())
        raise
    torch.save(result, out / f"rank{rank()}.pt")
    # A gloo group left to the interpreter's exit tears its threads down in static destructors; once in CI
    # (2026-12-02, 1 run in ~12) a rank then aborted after its result was saved ("terminate called without an
    # active exception"). Destroying the group here ends its threads while the process is whole.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    # The result is on disk: leave without interpreter finalization, where any C++ thread that still needs the GIL
    # (a gloo or autograd thread the modes above do not reach) is ended inside a destructor and aborts the rank.
    # The library's own exit behaviour is tested where it is the subject (tests/test_rank_exit.py).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("mode", choices=["trainer", "plugin", "fsdp2"])
    common_arguments(parser)
    parser.add_argument("--die-at-step", type=int, default=0)
    parser.add_argument("--die-how", choices=["exit", "hang"], default="exit")
    parser.add_argument("--fsdp-version", type=int, choices=[0, 1, 2], default=0, help="plugin: 0 = DDP")
    parser.add_argument("--ddp-timeout", type=int, default=60)
    opts = parser.parse_args()
    run_rank(opts, {"trainer": run_trainer, "plugin": run_plugin, "fsdp2": run_fsdp2}[opts.mode])


if __name__ == "__main__":
    main()
