"""ZenFlow under DDP with torch's gradient-compression communication hooks (`bf16_compress_hook`, PowerSGD), in two
real gloo processes.

A hook replaces DDP's all-reduce: it compresses each bucket, reduces the compressed form and writes the decompressed
result into the gradients, which `step()` then reads once (`GradientReads.reduced_later`). So ZenFlow sees exactly
the gradient plain AdamW sees under the same hook: with every column on the device (topk 1.0, ≡ AdamW) the two give
the same bits, and at topk 0.1 the ranks end bit for bit where one process ends when fed, each step, the gradient
the hook produced (so the result differs from one process on the global batch by the hook's own error, and by
nothing of ZenFlow's). The ranks agree bitwise (each reads the same decompressed all-reduce)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import run_in_group, spawn_ranks

from hf_zenflow import ZenFlowAdamW, ZenFlowConfig


STEPS, PER_RANK, RANKS, LR = 12, 4, 2, 1e-2
ZEN = dict(update_interval=2, overlap_step=True, select_strategy="step", select_interval=4, full_warm_up_rounds=0,
           min_offload_numel=0, cpu_threads=1)
#: (a write-back one step into the next window, fixed)
ZEN_RULES = ZenFlowConfig().with_rules(writeback_lag=1)
HOOKS = ("none", "bf16", "powersgd")
OPTIMIZERS = ("adamw", "zen_all", "zen_0.1")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 48), torch.nn.Tanh(), torch.nn.Linear(48, 24))


def _data() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One global batch, seen every step: its loss must fall."""
    g = torch.Generator().manual_seed(1)
    batch = torch.randn(RANKS * PER_RANK, 16, generator=g), torch.randint(0, 24, (RANKS * PER_RANK,), generator=g)
    return [batch] * STEPS


def _bf16_compress_hook_on_gloo(state: object, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """torch's `bf16_compress_hook` itself, under another name: DDP refuses that name unless NCCL (or XCCL) runs it,
    a gate of the GPU build only; gloo all-reduces bf16 tensors, so the same arithmetic runs here."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return default_hooks.bf16_compress_hook(state, bucket)


# DDP checks the annotations as objects (this module's are strings: `from __future__ import annotations`)
_bf16_compress_hook_on_gloo.__annotations__["bucket"] = dist.GradBucket
_bf16_compress_hook_on_gloo.__annotations__["return"] = torch.futures.Future[torch.Tensor]


def _register(ddp: torch.nn.parallel.DistributedDataParallel, hook: str) -> None:
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

    if hook == "bf16":
        ddp.register_comm_hook(None, _bf16_compress_hook_on_gloo)
    elif hook == "powersgd":
        # rank 1 from the third step on (the first two are plain all-reduces, PowerSGD's own warm-up), error
        # feedback on; min_compression_rate 1 so the tiny matrices are compressed too
        state = powerSGD_hook.PowerSGDState(process_group=None, matrix_approximation_rank=1, start_powerSGD_iter=2,
                                            min_compression_rate=1, random_seed=0)
        ddp.register_comm_hook(state, powerSGD_hook.powerSGD_hook)


def _optimizer(kind: str, model: torch.nn.Module) -> torch.optim.Optimizer:
    if kind == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=LR, fused=True)
    opt = ZenFlowAdamW(model.parameters(), lr=LR, topk_ratio=1.0 if kind == "zen_all" else 0.1,
                       config=ZEN_RULES, **ZEN)
    opt.name_parameters(model)
    return opt


def _run(rank: int, hook: str, kind: str) -> dict:
    model = _model()
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    _register(ddp, hook)
    opt = _optimizer(kind, model)
    part = slice(rank * PER_RANK, (rank + 1) * PER_RANK)
    losses, grads = [], []
    for x, y in _data():
        loss = torch.nn.functional.cross_entropy(ddp(x[part]), y[part])
        loss.backward()  # returns after the hook has written the decompressed reduction into the gradients
        grads.append([p.grad.clone() for p in model.parameters()])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    if isinstance(opt, ZenFlowAdamW):
        opt.flush()  # a collective (the last write-back): every rank calls it
        opt.close()
    return {"weights": [p.detach().clone() for p in model.parameters()], "losses": losses, "grads": grads}


def _rank_main(rank: int, init_file: str, out_dir: str) -> None:
    run_in_group(rank, init_file, _rank_main_body, out_dir)


def _rank_main_body(rank: int, out_dir: str) -> None:
    runs = {f"{hook}/{kind}": _run(rank, hook, kind) for hook in HOOKS for kind in OPTIMIZERS}
    for name, run in runs.items():  # only one process-reference needs them
        if not name.endswith("zen_0.1"):
            del run["grads"]
    torch.save(runs, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> list[dict]:
    out = tmp_path_factory.mktemp("comm_hooks")
    spawn_ranks(_rank_main, str(out), ranks=RANKS)
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(RANKS)]


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max(((x - y).norm() / y.norm()).item() for x, y in zip(a, b))


def _one_process_fed(grads: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """ZenFlow at topk 0.1 in one process, each step's gradients set to the ones the ranks' hook produced."""
    model = _model()
    opt = _optimizer("zen_0.1", model)
    for step in grads:
        for p, g in zip(model.parameters(), step):
            p.grad = g.clone()
        opt.step()
        opt.zero_grad()
    opt.flush()
    opt.close()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hook", ["bf16", "powersgd"])
def test_zenflow_under_a_compression_hook_trains_like_adamw_under_it(runs, hook):
    rank0, rank1 = runs
    for kind in OPTIMIZERS:  # the ranks read the same decompressed all-reduce: the same bits on both
        assert all(torch.equal(a, b) for a, b in zip(rank0[f"{hook}/{kind}"]["weights"],
                                                     rank1[f"{hook}/{kind}"]["weights"])), kind
    adamw, zen_all = rank0[f"{hook}/adamw"], rank0[f"{hook}/zen_all"]
    # the hook really changed the gradients: otherwise the comparisons below say nothing about it
    hook_error = _distance(adamw["weights"], rank0["none/adamw"]["weights"])
    assert hook_error > 1e-6, hook_error
    # every column on the device is AdamW: the same gradient in, the same bits out
    assert all(torch.equal(a, b) for a, b in zip(zen_all["weights"], adamw["weights"]))
    zen = rank0[f"{hook}/zen_0.1"]
    assert zen["losses"][-1] < zen["losses"][0]  # trains
    # ZenFlow at topk 0.1 reads the decompressed gradient: the ranks end where one process fed the hook's output
    # ends (a bound on its distance from the uncompressed run would not do: a compressed gradient may select other
    # columns, a discrete jump of its own)
    reference = _one_process_fed(zen["grads"])
    assert all(torch.equal(a, b) for a, b in zip(zen["weights"], reference))
