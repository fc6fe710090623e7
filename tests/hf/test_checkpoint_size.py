"""The size of a Trainer checkpoint's ``optimizer.pt``: the state in its stored precision (bf16 host moments as bf16),
and nothing the fp32 weights saved beside it already hold (the host master where the weights are it, the device
columns' master values), on a model of all-MiniLM-L6-v2's shapes (22.7M parameters) saved mid-window with the
library's defaults."""

from __future__ import annotations

import torch
from hf_helpers import zenflow_args

from hf_zenflow import ZenFlowTrainer
from hf_zenflow.settings.config import MIN_OFFLOAD_NUMEL


class _Sentences(torch.utils.data.Dataset):
    """Random token ids of 16 tokens and a binary label: a sentence classification task's batches."""

    def __init__(self, vocab: int, n: int = 64) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(0, vocab, (n, 16), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(16, dtype=torch.long), "labels": self.labels[i]}


def test_an_optimizer_checkpoint_saved_mid_window_is_at_most_2_5x_the_fp32_weights(tmp_path):
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                        intermediate_size=1536, max_position_embeddings=512, num_labels=2)
    model = BertForSequenceClassification(config)
    params = sum(p.numel() for p in model.parameters())
    assert params >= 20_000_000
    # the library's defaults (update_interval 4, bf16 host moments, min_offload_numel 2**18), saved at step 6: two
    # steps into the second window, the first window's host result written back
    args = zenflow_args(tmp_path, max_steps=6, save_strategy="steps", save_steps=6, learning_rate=5e-5,
                        zenflow_min_offload_numel=MIN_OFFLOAD_NUMEL)
    trainer = ZenFlowTrainer(model=model, args=args, train_dataset=_Sentences(config.vocab_size))
    trainer.train()
    folder = tmp_path / "checkpoint-6"
    state = torch.load(folder / "optimizer.pt", weights_only=True)
    assert state["zenflow"]["window_steps"] == 2 and state["zenflow"]["accumulate_on"] == "host"
    ratio = (folder / "optimizer.pt").stat().st_size / (4 * params)
    assert ratio <= 2.5, ratio
