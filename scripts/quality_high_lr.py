"""ZenFlow settings across learning rates, paired against `adamw_torch`: the tiny byte-level Llama of `tests/hf`
pretrained for 150 steps, then fine-tuned 30 steps x 4 sequences under the Trainer (linear decay, no warm-up), held-out
loss. Small enough to sweep learning rates up to the edge of stability in a minute per setting
(BENCHMARKS.md "Quality: high learning rates").

    python scripts/quality_high_lr.py --seeds 0 1 2 --lrs 3e-3 1e-3 3e-4 \\
        --variants defaults "host_lr_scale=interval" "host_lr_scale=interval writeback_lag=1"

Each variant is a space-separated list of ZenFlowConfig ``KEY=VALUE`` settings or engine rules (`EngineRules`, applied
with `ZenFlowConfig.with_rules`; ``defaults`` = none); the tiny
model's matrices are all below the default `min_offload_numel`, so every run offloads them all (as the test does).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile
from pathlib import Path
from typing import Any


os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    p.add_argument("--lrs", type=float, nargs="+", default=[3e-3, 1e-3, 3e-4])
    p.add_argument("--pretrain-steps", type=int, default=150, help="steps of the base model's pretraining")
    p.add_argument("--variants", nargs="+", default=["defaults", "host_lr_scale=interval"])
    args = p.parse_args(argv)
    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "hf")]
    import torch
    from hf_helpers import SEQ_LEN, ByteLMDataset, corpus_text, tiny_llama, zenflow_args
    from transformers import Trainer
    from transformers.utils import logging as hf_logging

    from hf_zenflow.hf.trainer import ZenFlowTrainer
    from hf_zenflow.settings.rules import split_rules
    from hf_zenflow.tuning.paired_stats import paired_interval
    from hf_zenflow.tuning.tune import parse_settings

    hf_logging.set_verbosity_error()
    torch.set_num_threads(1)
    variants = {v: split_rules(parse_settings(v)) for v in args.variants}
    text = corpus_text()
    pretrain = ByteLMDataset(text, num_samples=512)
    finetune = ByteLMDataset(text, num_samples=256, offset=512 * SEQ_LEN)
    held_out = ByteLMDataset(text, num_samples=64, offset=768 * SEQ_LEN)
    out = tempfile.mkdtemp()
    quiet = dict(logging_steps=1000, disable_tqdm=True)
    diffs: dict[tuple[float, str], list[float]] = {}
    for seed in args.seeds:
        base = tiny_llama(seed=seed)
        Trainer(model=base, args=zenflow_args(f"{out}/pre", max_steps=args.pretrain_steps, seed=seed, **quiet),
                train_dataset=pretrain).train()
        for lr in args.lrs:
            ref = Trainer(model=copy.deepcopy(base), args=zenflow_args(f"{out}/ref", learning_rate=lr, seed=seed,
                                                                       **quiet), train_dataset=finetune)
            ref.train()
            ref_loss = ref.evaluate(held_out)["eval_loss"]
            for label, (settings, rules) in variants.items():
                flags: dict[str, Any] = {f"zenflow_{k}": v for k, v in settings.items()}
                zen = ZenFlowTrainer(model=copy.deepcopy(base), args=zenflow_args(
                    f"{out}/zen", rules=rules, learning_rate=lr, seed=seed, **quiet, **flags), train_dataset=finetune)
                zen.train()
                diff = 100.0 * (zen.evaluate(held_out)["eval_loss"] - ref_loss) / ref_loss
                diffs.setdefault((lr, label), []).append(diff)
                print(f"[high-lr] seed {seed} lr {lr:g} {label}: held-out loss {diff:+.2f} % vs adamw_torch "
                      f"({ref_loss:.4f})", flush=True)
    print("\n| lr | setting | held-out loss diff, % (mean ± 95 % CI) | per seed |\n|---|---|---|---|")
    for (lr, label), values in diffs.items():
        mean, half = paired_interval(values)
        ci = f"{mean:+.2f} ± {half:.2f}" if half is not None else f"{mean:+.2f}"
        print(f"| {lr:g} | {label} | {ci} | {' / '.join(f'{v:+.2f}' for v in values)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
