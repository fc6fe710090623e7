"""An NCCL-like process group over gloo, for the CPU test suite: collectives refuse host tensors, as NCCL refuses
CPU tensors.

On a CPU stand-in the "device" and the host are the same memory, so a collective handed host state runs fine on
gloo and nothing shows that NCCL would refuse it. This double, installed in a rank process (`install`), tells them
apart:

- **roles**: a tensor is *host* when its memory belongs to the optimizer's host state (masters, moments,
  accumulators, write-back and landing buffers: every tensor of every `HostMatrix`, read afresh from the optimizers
  given to `watch`), or when it was computed from a host tensor, moved with ``.cpu()``, or created with the host as
  its device (``device="cpu"``, or no device: torch's default device is the host). Everything else (parameters,
  gradients, DDP's buckets, tensors created on a parameter's device) is a *device* tensor;
- **devices**: ``tensor.device`` reads ``cpu:0`` (`DEVICE`, the declared collective device, as ``cuda:<rank>``
  under NCCL) for a device tensor and ``cpu`` (`HOST`) for a host tensor, so code that takes the collective device
  from a host tensor's ``.device`` allocates its buffer on the host, exactly as it would on a GPU;
- **backend**: ``dist.get_backend`` says ``"nccl"``, so the engine takes its device-backend branch;
- **collectives** (``all_reduce``, ``all_gather_into_tensor``, ...) raise `HostTensorRefused` for any host tensor
  (`refusals` lists them), then run on gloo.

``install(roles=False)`` keeps only the refusal of the optimizer's host state itself (for FSDP2, whose own buffers
are created on ``torch.device(mesh.device_type)``, the host on a CPU mesh, which would read as host tensors).

The roles are tracked by a `TorchFunctionMode` on the training thread (the host worker's threads run without it,
and their tensors are host state anyway); ops that torch runs in C++ (autograd, DDP's reducer) make device tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary


HOST = torch.device("cpu")
DEVICE = torch.device("cpu", 0)
COLLECTIVES = ("all_reduce", "all_gather_single", "all_gather_into_tensor", "all_gather", "reduce_scatter_tensor",
               "broadcast", "reduce", "all_to_all_single")
_FACTORIES = {"empty", "zeros", "ones", "full", "arange", "tensor", "as_tensor", "linspace", "eye", "rand", "randn",
              "randint", "empty_strided", "scalar_tensor"}
_DEVICE_PROPERTY = torch.Tensor.device


class HostTensorRefused(RuntimeError):
    """A collective was handed a host tensor (NCCL: "Tensors must be CUDA and dense")."""


def host_tensors(opt: Any) -> list[torch.Tensor]:
    """Every tensor the optimizer holds as host state (`HostMatrix` fields, lists of them included)."""
    out: list[torch.Tensor] = []
    host_side = getattr(opt, "_host", None)
    for split in getattr(host_side, "splits", {}).values():
        host = split.host
        if host is None:
            continue
        for f in dataclasses.fields(host):
            value = getattr(host, f.name)
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor):
                    out.append(t)
    return out


class NcclDouble:
    """Roles and refusals (see the module docstring)."""

    def __init__(self) -> None:
        self.derived = WeakTensorKeyDictionary()  # tensors computed from host tensors
        self.watched: list[Callable[[], list[torch.Tensor]]] = []
        self.refusals: list[str] = []
        self.checked = 0  # tensors that went through a collective

    def watch(self, opt: Any) -> None:
        """Treat `opt`'s host state as host memory."""
        self.watched.append(lambda: host_tensors(opt))

    def _ranges(self) -> list[tuple[int, int]]:
        ranges = []
        for get in self.watched:
            for t in get():
                storage = t.untyped_storage()
                ranges.append((storage.data_ptr(), storage.data_ptr() + storage.nbytes()))
        return ranges

    def is_host(self, t: torch.Tensor) -> bool:
        with torch._C.DisableTorchFunction():
            if t in self.derived:
                return True
            storage = t.untyped_storage()
            start, end = storage.data_ptr(), storage.data_ptr() + storage.nbytes()
            return end > start and any(start < e and s < end for s, e in self._ranges())

    def check(self, what: str, args: tuple, kwargs: dict) -> None:
        for t in tree_flatten((args, kwargs))[0]:
            if isinstance(t, torch.Tensor):
                self.checked += 1
                if self.is_host(t):
                    message = (f"NCCL-like double: {what} got a host tensor {tuple(t.shape)} {t.dtype}: collectives "
                               "take tensors on the collective device only")
                    self.refusals.append(message)
                    raise HostTensorRefused(message)


def _device_role(device: Any) -> bool | None:
    """True: the host; False: the device; None: not a device."""
    if isinstance(device, str):
        try:
            device = torch.device(device)
        except RuntimeError:
            return None
    if isinstance(device, torch.device):
        return device.type == "cpu" and device.index is None
    return None


class _Roles(TorchFunctionMode):
    def __init__(self, double: NcclDouble) -> None:
        super().__init__()
        self.double = double

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__self__", None) is _DEVICE_PROPERTY:
            return HOST if self.double.is_host(args[0]) else DEVICE
        out = func(*args, **kwargs)
        host = self._host_result(func, args, kwargs)
        if host is not None:
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    if host:
                        self.double.derived[t] = True
                    else:
                        self.double.derived.pop(t, None)
        return out

    def _host_result(self, func: Any, args: tuple, kwargs: dict) -> bool | None:
        name = getattr(func, "__name__", "")
        if name == "cpu":
            return True
        if "device" in kwargs and kwargs["device"] is not None:
            return _device_role(kwargs["device"])
        if name in ("to", "_to_copy"):
            for a in args[1:]:
                role = _device_role(a)
                if role is not None:
                    return role
        if name in _FACTORIES:
            return True  # no device given: torch's default device, the host
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        if not tensors or name.endswith("_"):  # in place: the tensor keeps its role
            return None
        return self.double.is_host(tensors[0])


def install(watch: Iterable[Any] = (), roles: bool = True) -> NcclDouble:
    """Install the double in this (rank) process: the backend reads "nccl", collectives refuse host tensors, and the
    training thread tracks roles from here on (`uninstall` ends it). `watch`: optimizers whose host state is host;
    `roles=False`: only that host state is refused (no role tracking)."""
    double = NcclDouble()
    for opt in watch:
        double.watch(opt)
    double.mode = _Roles(double) if roles else None
    double.originals = {"get_backend": dist.get_backend}
    dist.get_backend = lambda group=None: "nccl"
    for name in COLLECTIVES:
        real = getattr(dist, name, None)
        if real is None:  # (all_gather_single: newer torch only)
            continue
        double.originals[name] = real

        def wrapped(*args, _real=real, _name=name, **kwargs):
            double.check(_name, args, kwargs)
            return _real(*args, **kwargs)

        setattr(dist, name, wrapped)
    if double.mode is not None:
        double.mode.__enter__()
    return double


def uninstall(double: NcclDouble) -> None:
    if double.mode is not None:
        double.mode.__exit__(None, None, None)
    for name, real in double.originals.items():
        setattr(dist, name, real)
