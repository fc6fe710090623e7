"""Fixtures of the Hugging Face integration tests (helpers: `hf_helpers.py`)."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import SEQ_LEN, ByteLMDataset, corpus_text


@pytest.fixture(autouse=True)
def _one_training_thread():
    """One intra-op thread for the training thread (the tests also give the ZenFlow host worker one thread,
    `zenflow_cpu_threads=1`): the models are tiny, and on a small shared CI machine OpenMP teams that spin-wait on
    oversubscribed cores make every matmul ~50x slower (measured: 1.2 s vs 15 ms per step of the tiny Llama on 2
    busy cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="session")
def text() -> str:
    return corpus_text()


@pytest.fixture(scope="session")
def train_dataset(text: str) -> ByteLMDataset:
    return ByteLMDataset(text, num_samples=256)


@pytest.fixture(scope="session")
def eval_dataset(text: str) -> ByteLMDataset:
    return ByteLMDataset(text, num_samples=32, offset=256 * SEQ_LEN)
