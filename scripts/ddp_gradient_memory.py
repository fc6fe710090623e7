"""Where DDP keeps the gradients' memory, and what setting ``p.grad`` to None (freeing a gradient in backward) gives
back: 2 gloo ranks on the CPU, the resident memory of rank 0 (``/proc/self/statm``) at each point of a step.

    python scripts/ddp_gradient_memory.py                  # 8 Linear(2048, 2048) layers: 128 MiB of fp32 gradients

For ``gradient_as_bucket_view`` False (DDP's default) and True, over the memory held before DDP is built: after the
first backward, after every ``p.grad`` is set to None, and after the next backward. DDP's reducer allocates its
bucket buffers (one whole gradient's bytes) when it is built and keeps them for the run; it all-reduces in them and
then copies into ``p.grad`` (False) or makes ``p.grad`` views of them (True). So freeing ``p.grad`` gives back at most
the second copy (False), which ``gradient_as_bucket_view=True`` never makes, and nothing with True: the device keeps
one whole gradient for the run whatever the optimizer does. (A communication hook is handed the same bucket buffer.)
"""

from __future__ import annotations

import argparse
import gc
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


MIB = 2 ** 20


def resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def rank_main(rank: int, init_file: str, bucket_view: bool, layers: int, width: int, results: mp.Queue) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])
        gradient_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        x = torch.randn(2, width)
        base = resident_bytes()
        ddp = torch.nn.parallel.DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
        ddp(x).square().mean().backward()
        after_backward = resident_bytes() - base
        for p in model.parameters():
            p.grad = None  # what freeing a gradient in backward does
        gc.collect()
        freed = resident_bytes() - base
        ddp(x).square().mean().backward()  # the next step: the reducer reuses its buckets
        next_backward = resident_bytes() - base
        if rank == 0:
            results.put((bucket_view, gradient_bytes, after_backward, freed, next_backward))
        del ddp, model
        gc.collect()
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--width", type=int, default=2048)
    args = parser.parse_args()
    results = mp.get_context("spawn").Queue()
    print("| gradient_as_bucket_view | gradients | after backward | every p.grad None | after the next backward |")
    print("|---|---|---|---|---|")
    for bucket_view in (False, True):
        with tempfile.TemporaryDirectory() as folder:
            mp.spawn(rank_main, args=(os.path.join(folder, "pg"), bucket_view, args.layers, args.width, results),
                     nprocs=2)
        view, grads, backward, freed, again = results.get()
        cells = [f"{b / MIB:.1f} MiB ({b / grads:.2f}x)" for b in (backward, freed, again)]
        print(f"| {view} | {grads / MIB:.1f} MiB | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
