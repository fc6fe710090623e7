"""Host bytes per offloaded parameter, measured from the host tensors, per host state (the ``host_state`` presets and
the engine's host-state rules between them, set through `ZenFlowConfig.with_rules`), in one process.

    python scripts/host_bytes.py                      # MiniLM (all-MiniLM-L6-v2, real weights), 8 steps per setting
    python scripts/host_bytes.py --model llama --steps 6

Each setting trains a fresh copy of the model on the same random batches with ZenFlow (r=0.1, U=4, overlap on,
``writeback_lag=1``, ``accumulate_on="host"``: the window summed on the host, ``min_offload_numel=0``, one worker
thread) on the CPU device, then reads every distinct storage the offloaded matrices' host state holds (each counted
once, however many roles it plays) and `stats()["host_bytes_per_param"]`, which must agree. Per setting: bytes by
role (master, moments with their block scales, window sum and, with ``host_sum_columns="unselected"``, its column
indices, write-back buffer), bytes per offloaded parameter, and
the median of the training thread's write-back time per write-back (reading the master moves a copy there;
a timing, so only comparable between the rows of one run on an otherwise idle machine).
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

import torch

from hf_zenflow import ZenFlowAdamW
from hf_zenflow.engine.quantized_moments import QuantizedMoment
from hf_zenflow.tuning.tune_grid import study_config


SETTINGS = {
    "fp32 moments and sums (host_state=fp32)": dict(host_state="fp32"),
    "bf16 moments, fp32 sums, a write-back buffer": dict(host_sum_dtype="float32", host_sum_columns="all",
                                                         host_writeback="buffer"),
    "bf16 moments, fp32 sums": dict(host_sum_dtype="float32", host_sum_columns="all"),
    "bf16 moments, bf16 sums": dict(host_sum_columns="all"),
    "bf16 moments, bf16 sums of the unselected columns (host_state=auto, the default)": dict(),
    "int8 moments, bf16 sums": dict(host_moment_dtype="int8", host_sum_columns="all"),
    "int8, bf16 sums of the unselected columns (host_state=lean)": dict(host_state="lean"),
}
COMMON = dict(topk_ratio=0.1, update_interval=4, overlap_step=True, accumulate_on="host", min_offload_numel=0,
              cpu_threads=1, writeback_lag=1)


def build(name: str) -> tuple[torch.nn.Module, callable]:
    torch.manual_seed(0)
    if name == "minilm":
        from transformers import AutoModelForSequenceClassification

        from hf_zenflow.compare.data import minilm_path

        model = AutoModelForSequenceClassification.from_pretrained(str(minilm_path()), num_labels=2)

        def loss(batch: torch.Tensor) -> torch.Tensor:
            return model(input_ids=batch, labels=batch[:, 0] % 2).loss

        return model, loss
    from transformers import LlamaConfig, LlamaForCausalLM

    model = LlamaForCausalLM(LlamaConfig(vocab_size=4096, hidden_size=256, intermediate_size=704,
                                         num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=4))

    def loss(batch: torch.Tensor) -> torch.Tensor:
        return model(input_ids=batch, labels=batch).loss

    return model, loss


def host_bytes(opt: ZenFlowAdamW) -> tuple[dict[str, int], int]:
    """Bytes by role of the distinct host storages (a storage shared by two roles counted under the first), and the
    offloaded elements."""
    seen: set[int] = set()
    roles: dict[str, int] = {}
    elements = 0
    for split in opt._split.values():
        host = split.host
        if host is None:
            continue
        elements += host.master.numel()
        for f in dataclasses.fields(host):
            value = getattr(host, f.name)
            parts = [value.codes, value.scales] if isinstance(value, QuantizedMoment) else [value]
            if isinstance(value, list):
                parts = value
            for t in parts:
                if not isinstance(t, torch.Tensor) or f.name == "step":
                    continue
                ptr = t.untyped_storage().data_ptr()
                if ptr in seen:
                    continue
                seen.add(ptr)
                # (the kept columns' index and the places the window pass reads them through)
                role = ("moments" if f.name.startswith("exp_avg") else "indices" if f.name.startswith("sum_")
                        else f.name)
                roles[role] = roles.get(role, 0) + t.untyped_storage().nbytes()
    return roles, elements


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--model", choices=["minilm", "llama"], default="minilm")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--length", type=int, default=64)
    args = p.parse_args()
    gen = torch.Generator().manual_seed(1)
    data = [torch.randint(1000, 4000, (args.batch, args.length), generator=gen) for _ in range(args.steps)]
    print(f"{args.model}, {args.steps} steps, {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| setting | master | moments | window sum | sum's indices | write-back buffer | host bytes | "
          "offloaded elements | B/param (tensors) | stats()['host_bytes_per_param'] | write-back ms, median |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, settings in SETTINGS.items():
        model, loss_of = build(args.model)
        opt = ZenFlowAdamW(model.parameters(), lr=5e-5, config=study_config({**COMMON, **settings}))
        writeback_ms = []
        for batch in data:
            loss_of(batch).backward()
            opt.step()
            opt.zero_grad()
            ms = opt.stats().get("cp_writeback_ms")
            if ms:
                writeback_ms.append(ms)
        opt.flush()
        roles, elements = host_bytes(opt)
        total = sum(roles.values())
        stats = opt.stats()
        opt.close()
        assert stats["host_state_bytes"] == total, (stats["host_state_bytes"], total)
        per = {k: v / elements for k, v in roles.items()}
        print(f"| {label} | {per.get('master', 0):.2f} | {per.get('moments', 0):.5f} | {per.get('accum', 0):.2f} | "
              f"{per.get('indices', 0):.5f} | {per.get('writeback', 0):.2f} | {total} | {elements} | "
              f"{total / elements:.5f} | {stats['host_bytes_per_param']:.5f} | "
              f"{statistics.median(writeback_ms) if writeback_ms else float('nan'):.2f} |")


if __name__ == "__main__":
    main()
