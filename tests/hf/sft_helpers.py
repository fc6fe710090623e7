"""Helpers of the trl tests: a word-level tokenizer and a tiny text dataset, both built in memory (no download)."""

from __future__ import annotations

import random
from typing import Any


WORDS = ("the king queen ghost prince sword poison castle night love death speak remember father mother son "
         "murder play act stage crown throne river grave skull fool ").split()


def word_tokenizer():
    """A `PreTrainedTokenizerFast` over `WORDS` (ids below the tiny Llama's 256), with pad / eos / unk tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(["<pad>", "<eos>", "<unk>", *WORDS])}
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def text_dataset(rows: int = 64, seed: int = 0):
    """`datasets.Dataset` of `rows` random sentences of 6-12 words in a `text` column."""
    from datasets import Dataset

    rng = random.Random(seed)
    return Dataset.from_dict({"text": [" ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 12)))
                                       for _ in range(rows)]})


def sft_values(output_dir: Any, **overrides: Any) -> dict[str, Any]:
    """Settings of a fast deterministic CPU SFT run (trl's other defaults kept: bf16, activation checkpointing)."""
    values: dict[str, Any] = dict(
        output_dir=str(output_dir), max_steps=4, per_device_train_batch_size=4, learning_rate=3e-3,
        logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, dataloader_num_workers=0, seed=0,
        data_seed=0, disable_tqdm=True, max_length=16,
    )
    values.update(overrides)
    return values


ZENFLOW_VALUES = dict(zenflow_cpu_threads=1, zenflow_min_offload_numel=0, zenflow_topk_ratio=0.25,
                      zenflow_update_interval=2)
