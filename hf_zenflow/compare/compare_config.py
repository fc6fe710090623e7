"""The settings of one `hf-zenflow compare` run (`CompareConfig`): the CLI flags map 1:1 onto its fields, and its
ZenFlow settings default to the library's, so that the comparison shows what a user gets."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from hf_zenflow.compare.data_source import DataSpec
from hf_zenflow.compare.run_order import MIN_BLOCK_STEPS, RUN_ORDERS
from hf_zenflow.settings.config import ZenFlowConfig


if TYPE_CHECKING:  # (imported where used: the command line reads this module's defaults and must stay quick)
    import torch

    from hf_zenflow.compare.cores import CoreSplit


#: The optimizers a comparison can run, in report order. (Here, not in `report`, which imports the Hugging Face
#: stack: the command-line parser reads it and must stay quick, so that a bad flag is refused at once.)
OPTIMIZERS = ("adamw_torch", "sync_offload", "zenflow")


#: The named values of `CompareConfig.device_memory_limit_bytes` (else a number of bytes).
DEVICE_MEMORY_LIMITS = ("sync", "free")

#: ZenFlow's re-selection period (steps) when `compare` is given ``--select-strategy step`` without an interval.
COMPARE_SELECT_STEPS = 10

_LIBRARY = ZenFlowConfig()


@dataclass
class CompareConfig:
    """Settings of one `hf-zenflow compare` run (the CLI flags map 1:1 onto these fields).

    The defaults are sized for a 2-core CPU: 150 steps of 16 sentences (one pass over 2400), evaluated on 1000
    held-out sentences. The ZenFlow settings default to the library's (`ZenFlowConfig()`), so the table shows what a
    user gets; the settings sweeps that chose those defaults are in BENCHMARKS.md "Quality: short fine-tunes" and the
    sections after it (paired runs over seeds; the earlier single-seed sweeps of this runner are in git's history of
    BENCHMARKS.md). ``select_interval=None`` resolves to `COMPARE_SELECT_STEPS` with ``select_strategy="step"`` and to
    ``"auto"`` otherwise.
    """

    model: str | None = None  # "minilm" (default), "smollm2", or a local HF model folder
    task: str = "auto"
    # The data and the metric (`hf_zenflow.compare.data_source`, `hf_zenflow.compare.metrics`): dataset None = the
    # built-in corpus of the model's task; metric None = accuracy (classification) or perplexity (causal LM).
    dataset: str | None = None  # a csv/json/jsonl/parquet/txt file, a folder of them by split, or a cached name
    text_column: str | None = None  # None: the first of "text", "sentence", "content", "review"
    label_column: str | None = None  # None: "label" or "labels" (classification only)
    train_split: str = "train"
    eval_split: str | None = None  # None: "validation" when present, else carved from the training split
    metric: str | None = None  # an evaluate metric name (accuracy, f1 ship with hf_zenflow) or a local script
    steps: int = 150
    train_size: int = 2400
    eval_size: int = 1000
    batch_size: int = 16
    eval_batch_size: int = 64
    max_length: int = 64
    lr: float = 2e-4
    weight_decay: float = 0.01
    warmup_ratio: float = 0.1
    max_grad_norm: float = 1.0
    seed: int = 0
    # ZenFlow settings: the library's defaults (`ZenFlowConfig`), so that compare shows what a user gets
    topk_ratio: float = _LIBRARY.topk_ratio
    update_interval: int | str = _LIBRARY.update_interval
    overlap_step: bool = _LIBRARY.overlap_step
    host_step: str = _LIBRARY.host_step
    # engine rules the ZenFlow run changes (`ZenFlowConfig.with_rules`), for studies of one rule; no flag sets them
    rules: dict[str, Any] = field(default_factory=dict)
    min_offload_numel: int = _LIBRARY.min_offload_numel
    # "auto": where the window is summed is decided under the device memory the run gives it
    host_state: str = _LIBRARY.host_state
    # ZenFlow's whole device memory (weights, gradients, state, sums): "sync" = what synchronous offload holds (the
    # weights and their gradients: where people offload, the device has no more), "free" = what the device has free,
    # or bytes (`DEVICE_MEMORY_LIMITS`): ZenFlowConfig.device_memory_limit_bytes of its run
    device_memory_limit_bytes: int | str = "sync"
    select_strategy: str = _LIBRARY.select_strategy
    select_interval: int | str | None = None  # None: COMPARE_SELECT_STEPS with "step", "auto" otherwise
    full_warm_up_rounds: int = _LIBRARY.full_warm_up_rounds
    # the resource model (`hf_zenflow.compare.cores`) and the projection after the runs (`compare.projection`)
    device_cores: int | None = None  # D: cores of "the device" on a CPU device (None: half the cores)
    host_cores: int | None = None  # H: cores of "the host", for every offloading run (None: half the cores)
    project_params: float | None = None  # model size of the projection (None: the model that ran)
    project_hardware: tuple[str, ...] = ("a100-80gb-pcie4", "h100-80gb-pcie5", "rtx4090-pcie4")
    host_from_profile: bool = False  # project with the profiles' published host rate instead of this host's
    device: str = "auto"
    layout: str = "auto"  # weights of the offloading runs: "column" (column_major_), "row"; auto = column on CPU
    embedding_select: str = "auto"  # ZenFlow on embedding tables: "rows" (tokens), "columns"; auto = rows on CPU
    optimizers: tuple[str, ...] = OPTIMIZERS
    # the runs one after the other, or taking turns in blocks of steps (`hf_zenflow.compare.run_order`)
    run_order: str = "auto"  # "interleaved" (auto on a CPU device), "sequential" (auto on CUDA)
    block_steps: int | None = None  # steps per turn when interleaved (None: two windows, at least 8)
    output_dir: str | None = None  # None: a new folder zenflow_compare/<UTC time>_<model>/ (see compare.output)
    overwrite: bool = False  # replace the results of an earlier run in output_dir
    log_every: int = 10  # the progress bar's loss and optimizer.step figures cover the last N steps; 0: no bar
    save_model: bool = False
    quiet: bool = False

    def __post_init__(self) -> None:
        if self.run_order not in RUN_ORDERS:
            raise ValueError(f"CompareConfig.run_order={self.run_order!r} is invalid: allowed are "
                             f"{', '.join(map(repr, RUN_ORDERS))}.")
        if self.block_steps is not None and (isinstance(self.block_steps, bool) or not isinstance(
                self.block_steps, int) or self.block_steps < MIN_BLOCK_STEPS):
            raise ValueError(f"CompareConfig.block_steps={self.block_steps!r} is invalid: allowed is None or an "
                             f"integer >= {MIN_BLOCK_STEPS} (the drawn timeline window lies within one turn).")
        limit = self.device_memory_limit_bytes
        if limit not in DEVICE_MEMORY_LIMITS and (isinstance(limit, bool) or not isinstance(limit, int)
                                                  or limit < 0):
            raise ValueError(f"CompareConfig.device_memory_limit_bytes={limit!r} is invalid: allowed are 'sync' "
                             "(synchronous offload's device memory), 'free' (the device's free memory) and an "
                             "integer >= 0 (bytes).")
        if self.select_interval is None:
            self.select_interval = COMPARE_SELECT_STEPS if self.select_strategy == "step" else "auto"

    def data_spec(self) -> DataSpec:
        return DataSpec(self.dataset, self.text_column, self.label_column, self.train_split, self.eval_split)

    def resolved_layout(self) -> str:
        """On a CPU device the offloading engines get column-major Linear weights (DeepSpeed's transposed layout:
        each input column contiguous, see `hf_zenflow.engine.layout`); on CUDA the gather/scatter is cheap
        either way."""
        if self.layout not in ("auto", "column", "row"):
            raise ValueError(f"CompareConfig.layout={self.layout!r} is invalid: allowed are 'auto', 'column', 'row'.")
        if self.layout == "auto":
            return "column" if self.resolved_device().type == "cpu" else "row"
        return self.layout

    def resolved_embedding_select(self) -> str:
        """What ZenFlow selects in embedding tables: their rows (the tokens: an embedding's input channels,
        contiguous) or, like any matrix, their columns (hidden features, strided in a row-major table). Rows on a
        CPU device, where strided columns sweep the whole table."""
        if self.embedding_select not in ("auto", "rows", "columns"):
            raise ValueError(f"CompareConfig.embedding_select={self.embedding_select!r} is invalid: allowed are "
                             "'auto', 'rows', 'columns'.")
        if self.embedding_select == "auto":
            return "rows" if self.resolved_device().type == "cpu" else "columns"
        return self.embedding_select

    def core_split(self) -> CoreSplit:
        """D device cores and H host cores, the same for every run (`hf_zenflow.compare.cores`)."""
        from hf_zenflow.compare.cores import CoreSplit

        return CoreSplit.resolve(self.device_cores, self.host_cores, cuda=self.resolved_device().type == "cuda")

    def resolved_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)
