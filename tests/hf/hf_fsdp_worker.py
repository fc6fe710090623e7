"""One rank of the FSDP2 Trainer tests (`test_trainer_fsdp.py`), started by torchrun: trains the tiny Llama with
`ZenFlowTrainer` sharded by the Trainer's own FSDP2 (``--fsdp --fsdp_config '{"version": 2}'``) and leaves in
``--out`` ``rank{r}.pt`` (the full weights gathered from the shards, the logged losses, the optimizer's stats at the
last step) or ``error_rank{r}.txt`` (the exception that ended the rank).

On CPU, accelerate 1.15 leaves FSDP off without a word; `hf_helpers.fsdp_on_cpu` turns it on the way a GPU run gets
it, and the rest of the Trainer's and accelerate's FSDP2 path (optimizer creation before ``fully_shard``, the
parameter swap, checkpoints) is the one a GPU run takes.

    python -m torch.distributed.run --nproc_per_node 2 tests/hf/hf_fsdp_worker.py --out OUT --max-steps 12
"""

from __future__ import annotations

import argparse
from pathlib import Path

from hf_ddp_worker import ZENFLOW, common_arguments, device_args, run_rank
from hf_helpers import ByteLMDataset, corpus_text, fsdp_on_cpu, full_weights, logged, tiny_llama, zenflow_args


FSDP2 = dict(fsdp=True, fsdp_config={"version": 2})


def run(opts: argparse.Namespace) -> dict:
    from transformers import TrainerCallback

    from hf_zenflow import ZenFlowTrainer

    stats: dict[str, float] = {}

    class LastStats(TrainerCallback):
        """The optimizer's stats after each step (the Trainer closes the optimizer at the end of train())."""

        def on_step_end(self, args, state, control, optimizer=None, **kwargs):
            stats.update(trainer.zenflow_optimizer.stats())
            stats["dtensor_params"] = float(sum(type(p).__name__ == "DTensor"
                                                for g in optimizer.param_groups for p in g["params"]))

    if opts.device == "cpu":
        fsdp_on_cpu()
    save = dict(save_strategy="steps", save_steps=opts.save_steps) if opts.save_steps else {}
    args = zenflow_args(Path(opts.out) / "run", max_steps=opts.max_steps, **device_args(opts), **FSDP2, **save,
                        **ZENFLOW)
    trainer = ZenFlowTrainer(model=tiny_llama(), args=args,
                             train_dataset=ByteLMDataset(corpus_text(), num_samples=256), callbacks=[LastStats()])
    trainer.train(resume_from_checkpoint=opts.resume)
    return {"weights": full_weights(trainer.model), "losses": logged(trainer), "world_size": args.world_size,
            "fsdp": trainer.is_fsdp_enabled, "stats": stats}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    common_arguments(parser)
    run_rank(parser.parse_args(), run)


if __name__ == "__main__":
    main()
