"""Writes `checkpoint_fixture.pt`: a ZenFlowAdamW checkpoint taken mid-window, with what two more steps must give.

The fixture was written with the package as it stood before the re-layout of issue 25 (every module flat in
`hf_zenflow/`); `tests/checkpoint/test_checkpoint_fixture.py` loads it with today's code and continues the run, so a
checkpoint written by an older layout keeps loading. Rerun only to replace the fixture on purpose:

    python tests/data/make_checkpoint_fixture.py

The run: a two-layer MLP, every matrix split (``min_offload_numel=0``), windows of 3 steps, the host step overlapped
and written back one step into the next window. Saved after step 5 (one gradient of the second window accumulated on
the host, the first window's result written back); the two steps after it close the window (step 6) and write its
host result back (step 7), so the continued run goes through the loaded accumulator, the host AdamW and the write-back.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch

from hf_zenflow import ZenFlowAdamW


FIXTURE = Path(__file__).with_name("checkpoint_fixture.pt")
SAVED_AFTER, CONTINUED = 5, 2
LR = 1e-2
#: explicit settings: none of them "auto", so the continued run does not depend on measured times
SETTINGS = dict(
    topk_ratio=0.25,
    update_interval=3,
    overlap_step=True,
    writeback_lag=1,
    select_strategy="step",
    select_interval=4,
    min_offload_numel=0,
    accumulate_on="host",
    host_lr_scale=1.0,
    cpu_threads=1,
    host_moment_dtype="float32",
)


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 24), torch.nn.Tanh(), torch.nn.Linear(24, 8))


def make_batches(count: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(12, 16, generator=gen), torch.randn(12, 8, generator=gen)) for _ in range(count)]


def make_optimizer(model: torch.nn.Module) -> ZenFlowAdamW:
    return ZenFlowAdamW(model.parameters(), lr=LR, **SETTINGS)


def train_step(model: torch.nn.Module, opt: ZenFlowAdamW, batch: tuple[torch.Tensor, torch.Tensor]) -> float:
    inputs, targets = batch
    loss = torch.nn.functional.mse_loss(model(inputs), targets)
    loss.backward()
    opt.clip_grad_norm_(1.0)
    opt.step()
    opt.zero_grad()
    return loss.item()


def main() -> None:
    batches = make_batches(SAVED_AFTER + CONTINUED)
    model = make_model()
    opt = make_optimizer(model)
    for batch in batches[:SAVED_AFTER]:
        train_step(model, opt, batch)
    saved = {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "optimizer": copy.deepcopy(opt.state_dict()),
    }
    # (deep copies: state_dict() returns the live tensors, which the next steps change)
    losses = [train_step(model, opt, batch) for batch in batches[SAVED_AFTER:]]
    opt.flush()  # the expected weights hold every gradient seen, as the test's continued run will after its flush
    torch.save(
        {
            **saved,
            "batches": batches[SAVED_AFTER:],
            "expected_model": {k: v.clone() for k, v in model.state_dict().items()},
            "expected_losses": losses,
            "settings": SETTINGS,
            "lr": LR,
        },
        FIXTURE,
    )
    opt.close()
    print(f"wrote {FIXTURE} ({FIXTURE.stat().st_size} bytes)")


if __name__ == "__main__":
    main()
