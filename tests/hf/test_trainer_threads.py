"""The thread rule under `ZenFlowTrainer` (docs/threads.md): the training thread's pool is decided once, before
the first forward, the same way for a fresh and a resumed run; a run that offloads nothing (LoRA) starts no host
worker, keeps torch's pool and the weights' layout, and is the plain Trainer's run.

These tests run at torch's own pool size (as ``import hf_zenflow`` found it), not the single thread the other
Trainer tests pin: a rule that changed the pool mid-run would change forward/backward rounding here."""

from __future__ import annotations

import threading

import pytest
import torch
from hf_helpers import tiny_llama, zenflow_args
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainerCallback

import hf_zenflow.settings.threads
from hf_zenflow import ZenFlowConfig, ZenFlowTrainer


#: torch's pool when `hf_zenflow` was imported: a pool at this size is "not chosen by the user".
TORCH_DEFAULT = hf_zenflow.settings.threads._TORCH_THREADS_AT_IMPORT


@pytest.fixture
def torch_default_pool():
    """The training thread at torch's default pool (the conftest pins 1 thread, which would hide a change)."""
    if TORCH_DEFAULT < 2 or hf_zenflow.settings.threads.rank_cpu_count() < 2:
        pytest.skip("needs 2 cores or more and torch's default pool at 2 threads or more")
    torch.set_num_threads(TORCH_DEFAULT)
    yield TORCH_DEFAULT


class _Observed(TrainerCallback):
    """Per step, before its forward and after its optimizer step: the training thread's pool, and the host worker
    threads alive."""

    def __init__(self) -> None:
        self.pools: list[int] = []
        self.host_threads: set[str] = set()

    def _look(self) -> None:
        self.pools.append(torch.get_num_threads())
        self.host_threads |= {f"{t.name}:{t.ident}" for t in threading.enumerate() if t.name == "hf_zenflow-host"}

    def on_step_begin(self, args, state, control, **kwargs):
        self._look()

    def on_step_end(self, args, state, control, **kwargs):
        self._look()


def _lora_model(peft):
    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(tiny_llama(), config)


# peft's get_peft_model reads transformers' deprecated `is_gradient_checkpointing` itself (peft_model.py), not our code
@pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning")
def test_lora_offloading_nothing_is_the_plain_trainer(tmp_path, train_dataset, torch_default_pool):
    """Nothing offloaded (adapters below `min_offload_numel`): no host worker thread, torch's pool untouched, the
    frozen base weights keep their strides, and the adapters equal the plain Trainer's (fused AdamW: the same
    arithmetic as ZenFlow's device path) bit for bit."""
    peft = pytest.importorskip("peft")
    common = dict(max_steps=8, learning_rate=1e-2, weight_decay=0.01, optim="adamw_torch_fused")
    ref = Trainer(model=_lora_model(peft), args=zenflow_args(tmp_path / "ref", zenflow=False, **common),
                  train_dataset=train_dataset)
    ref.train()

    model = _lora_model(peft)
    q_proj = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
    strides = q_proj.stride()
    seen = _Observed()
    # zenflow_layout "auto": column-major on a CPU device, for offloaded weights only
    zen = ZenFlowTrainer(model=model, args=zenflow_args(tmp_path / "zen", zenflow_layout="auto",
                                                        zenflow_min_offload_numel=ZenFlowConfig().min_offload_numel,
                                                        **common),
                         train_dataset=train_dataset, callbacks=[seen])
    zen.train()
    assert zen.zenflow_optimizer.stats()["selected_fraction"] == 1.0  # nothing offloaded
    assert seen.host_threads == set()  # no worker thread ever ran
    assert seen.pools == [torch_default_pool] * 16  # before and after every step
    assert torch.get_num_threads() == torch_default_pool
    assert q_proj.stride() == strides  # the frozen base weights were not re-laid
    ref_weights = dict(ref.model.named_parameters())
    adapters = [(n, p) for n, p in zen.model.named_parameters() if p.requires_grad]
    assert adapters and all("lora_" in n for n, _ in adapters)
    for name, p in adapters:
        assert torch.equal(p, ref_weights[name]), name


def _minilm(seed: int) -> BertForSequenceClassification:
    """all-MiniLM-L6-v2's layout (BERT: hidden 384, 6 layers, 12 heads, intermediate 1536, vocabulary 30522),
    randomly initialised from config: the 384x1536 MLP matrices and the word embeddings are above the default
    `min_offload_numel` (offloaded), the 384x384 attention matrices below it (device), as in the real model."""
    torch.manual_seed(seed)
    config = BertConfig(vocab_size=30522, hidden_size=384, num_hidden_layers=6, num_attention_heads=12,
                        intermediate_size=1536, max_position_embeddings=512, num_labels=2)
    return BertForSequenceClassification(config)


class _Sentences(torch.utils.data.Dataset):
    """Short random "sentences" with a binary label, a run_glue-shaped batch."""

    def __init__(self, n: int = 64, length: int = 12) -> None:
        g = torch.Generator().manual_seed(0)
        self.ids = torch.randint(1000, 30522, (n, length), generator=g)
        self.labels = torch.randint(0, 2, (n,), generator=g)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "attention_mask": torch.ones_like(self.ids[i]), "labels": self.labels[i]}


def test_minilm_resumed_mid_window_is_bit_identical_at_torchs_pool(tmp_path, torch_default_pool):
    """The issue's run_glue case, small: MiniLM's layout with the default settings (U=4, overlap, default
    `min_offload_numel`), checkpoint at step 2 (mid-window), resumed in a new Trainer from a different
    initialisation: every tensor equals the uninterrupted run's, at torch's own pool (no OMP_NUM_THREADS=1)."""
    common = dict(max_steps=4, per_device_train_batch_size=4, learning_rate=5e-4, save_strategy="steps", save_steps=2,
                  zenflow_min_offload_numel=ZenFlowConfig().min_offload_numel, zenflow_update_interval=4,
                  zenflow_overlap_step=True, zenflow_layout="auto")
    data = _Sentences()
    full_seen = _Observed()
    full = ZenFlowTrainer(model=_minilm(0), args=zenflow_args(tmp_path / "full", **common),
                          train_dataset=data, callbacks=[full_seen])
    full.train()
    opt = full.zenflow_optimizer
    assert 0.0 < opt.stats()["selected_fraction"] < 1.0  # some matrices offloaded, some not
    resumed_seen = _Observed()
    resumed = ZenFlowTrainer(model=_minilm(123), args=zenflow_args(tmp_path / "resumed", **common),
                             train_dataset=data, callbacks=[resumed_seen])
    resumed.train(resume_from_checkpoint=str(tmp_path / "full" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    full_state, resumed_state = full.model.state_dict(), resumed.model.state_dict()
    assert full_state.keys() == resumed_state.keys()
    differ = [name for name in full_state if not torch.equal(full_state[name], resumed_state[name])]
    assert not differ, f"{len(differ)} of {len(full_state)} tensors differ: {differ[:5]}"
    # the pool was decided before the first forward and kept: the same in both runs, at every step
    assert len(set(full_seen.pools)) == 1 and set(resumed_seen.pools) == set(full_seen.pools)
