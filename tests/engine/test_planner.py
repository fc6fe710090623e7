"""The planner (`hf_zenflow.engine.planner`): its rule (the fastest option that fits, then the smallest), the host RAM
it sees (cgroup limits included), the node it plans on in a run, and the same choice in the engine and in
`hf-zenflow estimate` for the same machine."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from hf_zenflow import ZenFlowConfig
from hf_zenflow.engine import planner
from hf_zenflow.engine.host_ram import available_host_bytes
from hf_zenflow.engine.planner import RUNTIME_NODE, SAME_SPEED, Option, choose
from hf_zenflow.estimate.command import DEFAULT_HARDWARE
from hf_zenflow.estimate.hardware import auto_accumulation
from hf_zenflow.estimate.memory import HOST_MEMORY_HEADROOM, llama_shape
from hf_zenflow.estimate.profiles import PROFILES
from hf_zenflow.transport import CudaTransport
from tests.conftest import plan_with_host_ram


def test_the_fastest_that_fits_then_the_smallest():
    host = Option("host", 656.0, device_bytes=0.0, host_bytes=126e9)
    device = Option("device", 691.0, device_bytes=42e9, host_bytes=98e9)
    assert choose([device, host]) is host
    # equally fast (within SAME_SPEED): the smallest
    near = Option("device", 656.0 * (1 + SAME_SPEED / 2), device_bytes=1.0, host_bytes=1.0)
    assert choose([host, near]) is near
    assert choose([host, replace(near, step_ms=656.0 * (1 + 2 * SAME_SPEED))]) is host
    # what does not fit is not taken, however fast
    assert choose([replace(host, host_over=1.0), device]) is device
    # none fits: the least device overflow (an out-of-memory error), then the least host overflow
    short = [replace(host, host_over=30e9), replace(device, device_over=1.0, host_over=2e9)]
    assert choose(short).accumulate_on == "host"
    assert choose([replace(host, host_over=30e9), replace(device, host_over=2e9)]).accumulate_on == "device"


def _tree(tmp_path: Path, cgroup: str, files: dict[str, str], mem_available_kib: int = 64 << 20) -> tuple[Path, Path]:
    proc, sys = tmp_path / "proc", tmp_path / "cgroup"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(f"MemTotal: 100000000 kB\nMemAvailable: {mem_available_kib} kB\n")
    (proc / "self" / "cgroup").write_text(cgroup)
    for name, text in files.items():
        (sys / name).parent.mkdir(parents=True, exist_ok=True)
        (sys / name).write_text(text)
    return proc, sys


def test_host_ram_is_meminfo_capped_by_every_cgroup_limit(tmp_path):
    gib = 1 << 30
    # cgroup v2: the job's own group has no limit ("max"), its parent 20 GiB of which 4 are used (1 of it page cache
    # the kernel can drop)
    proc, sys = _tree(tmp_path / "v2", "0::/jobs/run1\n", {
        "jobs/run1/memory.max": "max\n", "jobs/run1/memory.current": f"{gib}\n",
        "jobs/memory.max": f"{20 * gib}\n", "jobs/memory.current": f"{4 * gib}\n",
        "jobs/memory.stat": f"anon {3 * gib}\ninactive_file {gib}\n"})
    assert available_host_bytes(proc, sys) == 17 * gib
    # cgroup v1 (in a container: the group is the hierarchy's root), a limit of 8 GiB with 6 GiB used
    proc, sys = _tree(tmp_path / "v1", "4:memory:/docker/abc\n1:cpu:/\n", {
        "memory/memory.limit_in_bytes": f"{8 * gib}\n", "memory/memory.usage_in_bytes": f"{6 * gib}\n"})
    assert available_host_bytes(proc, sys) == 2 * gib
    # no limit (v1 writes a huge number): MemAvailable
    proc, sys = _tree(tmp_path / "none", "4:memory:/\n", {
        "memory/memory.limit_in_bytes": "9223372036854771712\n", "memory/memory.usage_in_bytes": f"{gib}\n"},
        mem_available_kib=3 << 20)
    assert available_host_bytes(proc, sys) == 3 * gib
    assert available_host_bytes(tmp_path / "nothing", tmp_path / "nothing") is None


def test_the_host_room_is_shared_by_the_ranks_of_the_node(monkeypatch):
    monkeypatch.setattr(planner, "available_host_bytes", lambda: 100.0)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert planner.host_room() == pytest.approx(25.0 * (1 - planner.MARGIN))
    monkeypatch.setattr(planner, "available_host_bytes", lambda: None)
    assert planner.host_room() is None


def test_the_runtime_node_is_the_estimates_default_profile():
    """A run plans on `hf-zenflow estimate`'s default profile (and its default tokens per step): what its table
    marks as the default is what such a run does."""
    profile = PROFILES[DEFAULT_HARDWARE]
    node = RUNTIME_NODE
    assert (node.device_tflops, node.mfu, node.device_mem_gbps, node.link_gbps, node.host_cores,
            node.host_mem_gbps) == (profile.device_tflops, profile.mfu, profile.device_mem_gbps, profile.link_gbps,
                                    profile.host_cores, profile.host_mem_gbps)
    from hf_zenflow.cli import build_parser

    args = build_parser().parse_args(["estimate"])
    assert node.tokens_per_step == args.tokens_per_step


class _Matrix:
    """What the planner reads of an offloaded matrix: its parameter's device, dtype and [rows, columns] shape (a meta
    tensor), its selected columns and its share (one rank)."""

    def __init__(self, rows: int, columns: int, k: int) -> None:
        shape = torch.empty((rows, columns), device="meta")
        self.param = SimpleNamespace(device=torch.device("cuda", 0), shape=shape, dtype=torch.bfloat16,
                                     element_size=lambda: 2)
        self.columns, self.k, self.grad_dtype = columns, k, torch.bfloat16

    def matrix(self, param: SimpleNamespace) -> torch.Tensor:
        return param.shape

    def host_part(self, param: SimpleNamespace) -> torch.Tensor:
        return param.shape


class _Whole:
    ranks = 1

    def local(self, matrix: torch.Tensor) -> torch.Tensor:
        return matrix


@pytest.mark.parametrize("host_gb", [1024, 130])
def test_the_engine_chooses_what_the_estimate_marks_as_the_default(host_gb, monkeypatch):
    """A llama-shaped 7B model (its matrices as the engine would hold them) on one H100 of the default profile, with
    the host's RAM `host_gb`: the engine's choice is the estimate's. With 1 TB, host sums (the fastest); with 130 GB,
    too short for host sums' 18 B per parameter (126 GB) within 90 %, device sums (98 GB)."""
    hidden, layers = (round(x) for x in llama_shape(7e9))
    shapes = [(hidden, hidden)] * 4 + [(hidden * 8 // 3, hidden)] * 2 + [(hidden, hidden * 8 // 3)]
    splits = [_Matrix(rows, columns, k=columns // 10) for _ in range(layers) for rows, columns in shapes]
    shares = {id(s): _Whole() for s in splits}
    params = float(sum(s.param.shape.numel() for s in splits))
    gb = 1e9
    # the device's room beside weights, gradients in flight and activations (what the first step measured)
    monkeypatch.setattr(planner, "available_bytes", lambda device, *limits: (80 * gb - 2 * params - 4 * gb, 80 * gb))
    monkeypatch.setattr(planner, "available_host_bytes", lambda: host_gb * gb)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    node = replace(RUNTIME_NODE)
    gpu = CudaTransport()  # (one per device type, as the engine's `Transports` keeps them)
    sizes = planner.RunSizes(splits, shares, lambda split: gpu, params, params, frees_gradients=True)
    engine = planner.plan_accumulation(ZenFlowConfig(), sizes, SimpleNamespace(ranks=1), node)
    profile = replace(PROFILES[DEFAULT_HARDWARE], host_adamw_per_core=node.host_adamw_per_core,
                      host_mem_gb=host_gb * (1 - planner.MARGIN) / HOST_MEMORY_HEADROOM)
    estimate = auto_accumulation(profile, params, node.tokens_per_step)["choice"]
    assert engine == estimate == ("host" if host_gb == 1024 else "device")


def test_a_cpu_device_without_a_budget_takes_host_sums_whatever_its_host(monkeypatch):
    """Nothing is known of a CPU device's memory without a budget: device sums never fit it, so even with the host's
    RAM too short for every option the host sums are taken (the only ones that do not overflow the device)."""
    plan_with_host_ram(monkeypatch, 0)
    split = _Matrix(64, 64, k=6)
    split.param.device = torch.device("cpu")
    sizes = planner.RunSizes([split], {id(split): _Whole()}, lambda s: CudaTransport(), 4096.0, 4096.0)
    assert planner.plan_accumulation(ZenFlowConfig(), sizes, SimpleNamespace(ranks=1)) == "host"
