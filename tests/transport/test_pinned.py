"""Page-locked host memory (`hf_zenflow.transport.pinned`), through a fake CUDA runtime: registration is portable to
every device, a refused registration leaves CUDA's error state clean and falls back to pageable memory with a warning,
and the pinned blocks are released on `close()` and when a reloaded state replaces them (issue 20, defect 5)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from hf_zenflow import ZenFlowAdamW
from hf_zenflow.transport import CudaTransport
from hf_zenflow.transport.pinned import HOST_REGISTER_PORTABLE, HostRegistrar, PinnedArena
from tests.conftest import DEVICE, batches, make_model, param_groups, train
from tests.doubles.async_device import AsyncCopies


if DEVICE.type != "cpu":
    pytest.skip("replaces the CUDA runtime with a fake", allow_module_level=True)

#: cudaErrorHostMemoryAlreadyRegistered
ALREADY_REGISTERED = 712


class FakeCudart:
    """The runtime calls `HostRegistrar` makes, recorded; `refuse`: every registration fails as CUDA's does,
    leaving its code as the runtime's last error until `cudaGetLastError` reads it."""

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.calls: list[tuple] = []
        self.pinned: dict[int, int] = {}
        self.last_error = 0

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        self.calls.append(("register", nbytes, flags))
        if self.refuse:
            self.last_error = ALREADY_REGISTERED
            return ALREADY_REGISTERED
        self.pinned[ptr] = nbytes
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister",))
        del self.pinned[ptr]
        return 0

    def cudaGetLastError(self) -> int:  # noqa: N802
        self.calls.append(("get_last_error",))
        error, self.last_error = self.last_error, 0
        return error


def test_blocks_are_registered_for_every_device():
    cudart = FakeCudart()
    arena = PinnedArena(pin=True, registrar=HostRegistrar(cudart))
    arena.reserve(4096)
    buf = arena.take((16, 8), torch.float32)
    assert cudart.calls == [("register", 4096, HOST_REGISTER_PORTABLE)]
    assert HOST_REGISTER_PORTABLE == 1  # cudaHostRegisterPortable
    assert arena.pinned_bytes == 4096 and list(cudart.pinned.values()) == [4096]
    assert buf.data_ptr() in cudart.pinned
    arena.release()
    assert cudart.pinned == {} and arena.pinned_bytes == 0


def test_a_refused_registration_clears_the_error_and_falls_back_to_pageable_memory(caplog):
    cudart = FakeCudart(refuse=True)
    arena = PinnedArena(pin=True, registrar=HostRegistrar(cudart))
    with caplog.at_level(logging.WARNING, logger="hf_zenflow.transport.pinned"):
        arena.reserve(4096)
        arena.reserve(1024)
    assert cudart.last_error == 0  # read (and so reset) right after each failure: no later CUDA call reports it
    assert cudart.calls == [("register", 4096, 1), ("get_last_error",), ("register", 1024, 1), ("get_last_error",)]
    assert arena.pinned_bytes == 0 and arena.nbytes == 5120
    assert len([r for r in caplog.records if "page-locking" in r.getMessage()]) == 1  # warned once
    buf = arena.take((4, 4), torch.float32)
    buf.fill_(2.0)  # ordinary memory, usable
    assert float(buf.sum()) == 32.0
    arena.release()
    assert ("unregister",) not in cudart.calls  # nothing was registered


def test_close_and_a_reload_release_the_pinned_blocks(monkeypatch):
    """Before: the blocks were unregistered only when the transport was garbage-collected, so `close()` kept them
    locked and `load_state_dict()` (which builds new host state) locked a second copy next to the first."""
    cudart = FakeCudart()
    transports: list[CudaTransport] = []

    def make(device):
        transports.append(CudaTransport(streams=AsyncCopies(), registrar=HostRegistrar(cudart)))
        return transports[-1]

    monkeypatch.setattr("hf_zenflow.transport.transport_for", make)
    model = make_model()
    opt = ZenFlowAdamW(param_groups(model), lr=1e-2, topk_ratio=0.1, update_interval=4, min_offload_numel=0)
    train(model, opt, batches(6))
    assert len(cudart.pinned) == 2  # one block for the write-back's ring, one for the gradients' ring
    locked = opt.stats()["pinned_host_bytes"]
    assert locked == sum(cudart.pinned.values()) > 0
    opt.load_state_dict(opt.state_dict())
    old, new = transports
    assert old.pinned_bytes == 0, "a reload kept the old blocks locked next to the new ones"
    assert sum(cudart.pinned.values()) == new.pinned_bytes == opt.stats()["pinned_host_bytes"]
    train(model, opt, batches(6, seed=4))  # (the new transport's rings are locked at their first use)
    assert sum(cudart.pinned.values()) == new.pinned_bytes == opt.stats()["pinned_host_bytes"] == locked
    opt.close()
    assert cudart.pinned == {}, "close() left blocks locked"
    calls = [c[0] for c in cudart.calls]
    assert calls.count("unregister") == calls.count("register")


def test_take_on_an_empty_share_before_any_block():
    """A rank or FSDP2 shard with no rows of a matrix asks for an empty buffer, possibly before any block exists
    (attached first, e.g. on resume). Before: ``TypeError: 'NoneType' object is not subscriptable``."""
    cudart = FakeCudart()
    arena = PinnedArena(pin=True, registrar=HostRegistrar(cudart))
    empty = arena.take((0, 8), torch.float32)
    assert empty.shape == (0, 8) and empty.dtype == torch.float32
    assert cudart.calls == [] and arena.nbytes == 0  # nothing reserved, nothing registered
    buf = arena.take((4, 8), torch.bfloat16)  # the next take carves a block as usual
    assert buf.shape == (4, 8) and arena.pinned_bytes == arena.nbytes > 0
    arena.release()


class RuntimeWithoutGetLastError(FakeCudart):
    """torch's bindings (``torch.cuda.cudart()``): cudaHostRegister/Unregister, but no cudaGetLastError."""

    cudaGetLastError = None  # noqa: N815 - CUDA's name


@pytest.mark.parametrize("mapped", [True, False])
def test_the_error_is_reset_in_torchs_own_runtime_never_one_loaded_by_name(mapped, tmp_path, monkeypatch, caplog):
    """torch's bindings lack cudaGetLastError: the reset goes through the libcudart already mapped into the process
    (torch's), opened with RTLD_NOLOAD. Before: `ctypes.CDLL` by name ("libcudart.so", ...), which may load a
    second runtime whose error state is not torch's."""
    import hf_zenflow.transport.pinned as pinned

    path = "/opt/venv/lib/python3/site-packages/nvidia/cuda_runtime/lib/libcudart.so.12"
    maps = tmp_path / "maps"
    maps.write_text("7f0000000000-7f0000001000 r-xp 00000000 08:01 42    /usr/lib/libc.so.6\n"
                    + (f"7f0000002000-7f0000003000 r-xp 00000000 08:01 43    {path}\n" if mapped else ""))
    monkeypatch.setattr(pinned, "PROCESS_MAPS", str(maps))
    opened: list[tuple[str, int]] = []
    resets: list[int] = []

    class Library:
        def cudaGetLastError(self) -> int:  # noqa: N802 - CUDA's name
            resets.append(1)
            return 0

    def cdll(name, mode=0):
        opened.append((name, mode))
        return Library()

    monkeypatch.setattr(pinned.ctypes, "CDLL", cdll)
    arena = PinnedArena(pin=True, registrar=HostRegistrar(RuntimeWithoutGetLastError(refuse=True)))
    with caplog.at_level(logging.WARNING, logger="hf_zenflow.transport.pinned"):
        arena.reserve(4096)
    assert all(name == path and mode & os.RTLD_NOLOAD for name, mode in opened), opened
    if mapped:
        assert opened and resets == [1]
        assert not any("could not reset" in r.getMessage() for r in caplog.records)
    else:
        assert opened == [] and resets == []
        assert any("could not reset" in r.getMessage() for r in caplog.records)


def test_a_refused_unregister_is_reported_and_its_error_reset(caplog):
    """cudaHostUnregister's status is checked: a failure warns with CUDA's code and resets the runtime's error
    (before: ignored, the error left for torch's next kernel launch to raise)."""
    cudart = FakeCudart()
    arena = PinnedArena(pin=True, registrar=HostRegistrar(cudart))
    arena.reserve(4096)
    not_registered = 713  # cudaErrorHostMemoryNotRegistered

    def refuse(ptr: int) -> int:
        cudart.calls.append(("unregister",))
        cudart.last_error = not_registered
        return not_registered

    cudart.cudaHostUnregister = refuse
    with caplog.at_level(logging.WARNING, logger="hf_zenflow.transport.pinned"):
        arena.release()
    assert cudart.calls[-2:] == [("unregister",), ("get_last_error",)]
    assert cudart.last_error == 0
    assert any("cudaHostUnregister returned 713" in r.getMessage() for r in caplog.records)
    assert arena.pinned_bytes == 0
