"""The resource model of `compare` and `tune` on a CPU device: D cores are "the device", H cores "the host".

On a GPU box the device (forward, backward, the device-side optimizer work) and the host (host AdamW, gradient
accumulation, the host side of the copies) are separate resources. The CPU stand-in models that the same way for
every run: the training thread gets D intra-op threads (``torch.set_num_threads``) and every host step, synchronous
offload's as well as ZenFlow's worker, gets H (``cpu_threads``). ``adamw_torch`` has no host work; its training thread
still gets only D, so that all three runs have the same device. Default D = H = half the cores this process may use.

On CUDA the device is the GPU: D is not applied (the training thread keeps torch's setting) and H is the host's cores
given to the host step.

Example:
    >>> split = CoreSplit.resolve(device_cores=None, host_cores=None, cuda=False, cores=2)
    >>> (split.device, split.host)
    (1, 1)
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch

from hf_zenflow.settings.threads import rank_cpu_count


@dataclass(frozen=True)
class CoreSplit:
    """D device cores (None on CUDA: the GPU) and H host cores of one comparison, the same for every run."""

    device: int | None
    host: int
    cores: int
    cuda: bool

    @classmethod
    def resolve(cls, device_cores: int | None, host_cores: int | None, cuda: bool, cores: int | None = None,
                ) -> CoreSplit:
        cores = cores if cores is not None else rank_cpu_count()
        for name, value in (("device_cores", device_cores), ("host_cores", host_cores)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} {value!r} is invalid: allowed is an integer >= 1.")
        half = max(1, cores // 2)
        host = host_cores if host_cores is not None else half
        if cuda:
            return cls(None, host, cores, True)
        return cls(device_cores if device_cores is not None else half, host, cores, False)

    def apply_device(self) -> None:
        """Give the training thread D intra-op threads (before a run's first forward; a CPU device only)."""
        if self.device is not None and torch.get_num_threads() != self.device:
            torch.set_num_threads(self.device)

    def describe(self) -> str:
        if self.cuda:
            return f"device: the GPU; host: {self.host} of {self.cores} cores (host AdamW of both offloading runs)"
        over = (f" (together {self.device + self.host} > {self.cores} cores: the two sides share cores)"
                if self.device + self.host > self.cores else "")
        return (f"device = {self.device} core(s) (forward, backward, device-side optimizer work), host = {self.host} "
                f"core(s) (host AdamW, accumulation, copies' host side), of {self.cores}; the same for every run"
                f"{over}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)
