"""The `ZenFlowTrainer` card carries what `Trainer.create_model_card` puts on the plain card for the same run (every
evaluation metric, `tasks`, the dataset names, the `metrics` / `model-index` metadata) plus the ZenFlow section; a
local base model is named without a Hub link."""

from __future__ import annotations

import re

import torch
import yaml
from hf_helpers import zenflow_args
from transformers import LlamaConfig, LlamaForSequenceClassification, Trainer

from hf_zenflow.hf.model_card import is_hub_id
from hf_zenflow.hf.trainer import ZenFlowTrainer


class PairDataset(torch.utils.data.Dataset):
    """Sequences labelled by whether token 7 occurs in them: learnable by a tiny classifier."""

    def __init__(self, n: int, seed: int) -> None:
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(8, 64, (n, 12), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)
        self.ids[self.labels == 1, 3] = 7

    def __len__(self) -> int:
        return len(self.labels)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.labels[i]}


def accuracy(eval_pred) -> dict[str, float]:
    logits, labels = eval_pred
    return {"accuracy": float((logits.argmax(-1) == labels).mean())}


def front_matter(card: str) -> dict:
    return yaml.safe_load(card.split("---")[1])


def glue_style_run(tmp_path):
    """run_glue.py's shape: a classifier loaded from a local folder, accuracy from compute_metrics, evaluation
    during training, and the card arguments run_glue passes."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, num_labels=2, pad_token_id=0)
    local = tmp_path / "local-base"
    LlamaForSequenceClassification(config).save_pretrained(local)
    model = LlamaForSequenceClassification.from_pretrained(str(local))
    args = zenflow_args(tmp_path / "glue", max_steps=4, eval_strategy="steps", eval_steps=2, learning_rate=1e-3)
    trainer = ZenFlowTrainer(model=model, args=args, train_dataset=PairDataset(64, 0),
                             eval_dataset=PairDataset(16, 1), compute_metrics=accuracy)
    trainer.train()
    trainer.evaluate()
    card_kwargs = {"finetuned_from": str(local), "tasks": "text-classification", "dataset_tags": "glue",
                   "dataset_args": "mrpc", "dataset": "GLUE MRPC"}
    return trainer, card_kwargs, str(local)


def test_card_carries_what_the_plain_card_carries(tmp_path):
    trainer, card_kwargs, local = glue_style_run(tmp_path)
    readme = tmp_path / "glue" / "README.md"
    Trainer.create_model_card(trainer, **card_kwargs)  # transformers' own card for the same run
    plain = readme.read_text()
    trainer.create_model_card(**card_kwargs)
    ours = readme.read_text()

    plain_meta, our_meta = front_matter(plain), front_matter(ours)
    assert "accuracy" in plain_meta["metrics"]
    for key in ("metrics", "datasets", "model-index"):
        assert our_meta[key] == plain_meta[key], key
    result = our_meta["model-index"][0]["results"][0]
    assert result["task"]["type"] == "text-classification" and result["dataset"]["name"] == "GLUE MRPC"
    # Every evaluation figure of the plain card ("- Accuracy: 0.5625", "- Loss: ...").
    plain_results = re.findall(r"^- ([A-Z][\w ]*): (\S+)$", plain.split("## Model description")[0], re.M)
    assert ("Accuracy", plain_results[[n for n, _ in plain_results].index("Accuracy")][1]) in plain_results
    for name, value in plain_results:
        assert f"- {name}: {float(value):.4g}" in ours, name
    # The plain card's table of evaluations during training, as is.
    table = plain.split("### Training results\n\n")[1].split("\n\n")[0]
    assert table in ours
    assert "on the GLUE MRPC dataset" in ours and "# Model Card for glue\n" in ours
    # The local base model: named, not linked, not in the metadata (the plain card links the folder path).
    assert f"https://huggingface.co/{local}" in plain
    assert f"https://huggingface.co/{local}" not in ours and f"local model `{local}`" in ours
    assert "base_model" not in our_meta
    # plus ZenFlow's own
    assert "hf_zenflow" in our_meta["tags"] and "### ZenFlow settings" in ours and "| optimizer steps | 4 |" in ours


def test_local_base_model_without_arguments_is_named_without_link(tmp_path):
    trainer, _, local = glue_style_run(tmp_path)
    trainer.save_model()
    card = (tmp_path / "glue" / "README.md").read_text()
    assert "https://huggingface.co/" + local not in card and f"local model `{local}`" in card
    assert "base_model" not in front_matter(card)
    assert "- Accuracy: " in card  # the evaluation figures without any card argument


def test_hub_ids_and_paths():
    assert is_hub_id("HuggingFaceTB/SmolLM2-135M") and is_hub_id("gpt2")
    for path in ("/tmp/model", "./model", "../x/y", "~/m", "a/b/c"):
        assert not is_hub_id(path), path
