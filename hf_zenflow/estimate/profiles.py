"""Hardware profiles: the figures of one node that `hf-zenflow estimate` and compare's projection model (device
FLOP/s and memory, link bandwidth, host cores, host AdamW rate, memory bandwidth and RAM), the presets (`PROFILES`,
where their host figures come from: `HOST_MEMORY_SOURCES`, `HOST_RAM_SOURCES`) and a JSON profile's loader, which
refuses a file that leaves out a device field. The bound model over them is `hardware.py`.

Example:
    >>> from hf_zenflow.estimate.profiles import PROFILES
    >>> PROFILES["a100-40gb-pcie4"].host_limit(), PROFILES["a100-40gb-pcie4"].host_mem_gb
    ('cores', 512.0)
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields
from pathlib import Path

# ZenFlow's host passes in host AdamWs of core work, where they are not measured on this machine: the engine's step
# model's (`hf_zenflow.engine.step_model`)
from hf_zenflow.engine.step_model import ACCUMULATE_VS_ADAMW, ROUNDING_VS_ADAMW, WINDOW_PASS_VS_ADAMW


#: The published Llama-2-7B host figure: DeepSpeed's CPUAdam over 7e9 parameters in 4600 ms on 128 threads
#: (`--host-from-profile`'s per-core rate).
PUBLISHED_HOST_PARAMS_PER_S = 7e9 / 4.6
PUBLISHED_HOST_CORES = 128
#: Host memory bytes per parameter of synchronous offload's host step (ZeRO-Offload's CPUAdam: the fp32 gradient
#: read (4), the fp32 master, exp_avg and exp_avg_sq read and written (24), the bf16 parameter written in the same
#: pass (2)).
#: Its gradient lands and its parameter leaves while the host waits (the link phases), so no DMA overlaps the pass.
HOST_ADAMW_BYTES_PER_PARAM = 30
#: Fields that may be 0 (a pass with no core work counted); every other field must be > 0.
ZERO_ALLOWED_FIELDS = ("host_rounding_adamws",)


#: Fields a JSON profile must give: the device, its link, the GPU-to-GPU interconnect and the fraction of peak FLOP/s
#: a step reaches. No default stands in for them.
DEVICE_FIELDS = ("device_tflops", "device_mem_gb", "device_mem_gbps", "link_gbps", "mfu", "interconnect_gbps")
#: The host fields of a profile; a JSON profile may leave them out (they are then this machine's, measured), except
#: with ``--host-from-profile``, which projects the profile's own host and so needs the ones it cannot measure.
HOST_FIELDS = ("host_cores", "host_mem_gbps", "host_adamw_per_core", "host_mem_gb")
PUBLISHED_HOST_REQUIRED = ("host_cores", "host_mem_gbps", "host_mem_gb")


@dataclass
class HardwareProfile:
    """One node's figures, per GPU for the device, link and interconnect, for the whole node for the host. Presets in
    `PROFILES` are nominal datasheet values (dense bf16 tensor-core TFLOP/s, HBM bandwidth, a PCIe x16 link's
    practical bandwidth); measure your own and pass a JSON file for real decisions.

    `interconnect_gbps` is the GPU-to-GPU bandwidth per GPU and direction that an all-gather reaches (nccl-tests'
    "bus bandwidth"). Defaults: on a PCIe node the peer traffic crosses the same x16 links, so it is the link figure
    (25 GB/s Gen4, 50 GB/s Gen5; cards without peer-to-peer, such as the RTX 4090, stage through host memory and get
    less); on an NVLink node half the datasheet's bidirectional NVLink figure (A100 SXM4 600 GB/s -> 300, H100 SXM5
    900 GB/s -> 450). A JSON profile must give it (`DEVICE_FIELDS`).

    `host_mem_gb` is the node's RAM, which every rank's offloaded optimizer state together must fit in.

    Example:
        >>> HardwareProfile(name="mine", device_tflops=100, device_mem_gb=24, device_mem_gbps=900, link_gbps=25,
        ...                 host_cores=16, host_mem_gbps=60).host_adamw_params_per_s() > 0
        True
    """

    name: str = "custom"
    device_tflops: float = 312.0  # dense bf16 FLOP/s of the device, in TFLOP/s
    device_mem_gb: float = 40.0
    device_mem_gbps: float = 1555.0
    link_gbps: float = 25.0  # host<->device, per direction
    host_cores: int = 64
    host_mem_gbps: float = 200.0
    mfu: float = 0.4  # fraction of the peak FLOP/s a training step reaches
    interconnect_gbps: float = 25.0  # GPU<->GPU per GPU and direction, for the all-gather of several ranks
    # host AdamW parameters/s per core: the published CPUAdam rate unless measured (`host_rates.host_profile`)
    host_adamw_per_core: float = PUBLISHED_HOST_PARAMS_PER_S / PUBLISHED_HOST_CORES
    host_mem_gb: float = 256.0  # the node's host RAM, GB: what the offloaded optimizer state must fit in
    # ZenFlow's window pass, one step's accumulation and the write-back rounding, in host AdamWs of core work
    # (measured: `host_rates`)
    host_window_adamws: float = WINDOW_PASS_VS_ADAMW
    host_accumulate_adamws: float = ACCUMULATE_VS_ADAMW
    host_rounding_adamws: float = ROUNDING_VS_ADAMW

    def __post_init__(self) -> None:
        for f in fields(self):
            if f.name == "name":
                continue
            value, zero_ok = getattr(self, f.name), f.name in ZERO_ALLOWED_FIELDS
            if (isinstance(value, bool) or not isinstance(value, (int, float)) or math.isinf(value)
                    or not (value >= 0 if zero_ok else value > 0)):  # (NaN fails both comparisons)
                raise ValueError(f"HardwareProfile.{f.name}={value!r} is invalid: allowed is a finite number "
                                 f"{'>= 0' if zero_ok else '> 0'}.")
        if self.mfu > 1:
            raise ValueError(f"HardwareProfile.mfu={self.mfu!r} is invalid: allowed is a fraction in (0, 1].")

    def host_core_params_per_s(self, core_share: float = 1.0) -> float:
        """What the cores alone would reach: the per-core AdamW rate times the cores (on `core_share` of them)."""
        return self.host_adamw_per_core * self.host_cores * core_share

    def host_adamw_params_per_s(self, core_share: float = 1.0,
                                bytes_per_param: float = HOST_ADAMW_BYTES_PER_PARAM) -> float:
        """Host AdamW rate: the per-core rate (published, or this host's measured one) times the cores, capped by
        the memory bandwidth over the pass's `bytes_per_param` (synchronous offload's by default); on `core_share`
        of the node's cores and memory bandwidth (one of several ranks on the node)."""
        return min(self.host_core_params_per_s(core_share),
                   self.host_mem_gbps * core_share * 1e9 / bytes_per_param)

    def host_limit(self, bytes_per_param: float = HOST_ADAMW_BYTES_PER_PARAM) -> str:
        """Which bounds a host AdamW pass of `bytes_per_param`: "memory" or "cores"."""
        memory = self.host_mem_gbps * 1e9 / bytes_per_param
        return "memory" if memory < self.host_core_params_per_s() else "cores"

    @classmethod
    def from_json(cls, path: str | Path, required: tuple[str, ...] = DEVICE_FIELDS) -> HardwareProfile:
        """The profile a JSON file describes. Every field of `required` must be in it (a missing one is refused by
        name, never filled with a default); the host fields may be left out: the caller takes them from this machine
        (`host_rates.resolve_host`)."""
        try:
            values = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"hardware profile {path}: not a readable JSON file ({exc}).") from None
        if not isinstance(values, dict):
            raise ValueError(f"hardware profile {path}: a JSON object of HardwareProfile's fields is needed, not "
                             f"{type(values).__name__}.")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"hardware profile {path}: unknown key(s) {unknown}: allowed are {sorted(known)}.")
        missing = [name for name in required if name not in values]
        if missing:
            raise ValueError(f"hardware profile {path}: missing field(s) {', '.join(missing)}: a profile file must "
                             f"give {', '.join(required)} (host fields it leaves out are this machine's).")
        values.setdefault("name", Path(path).stem)
        return cls(**values)


#: Sustained fraction of the memory channels' peak assumed for the presets' hosts (STREAM-triad-like). Two-socket
#: servers of these generations are commonly measured at 70-85 % of peak; 0.75 is the low end of that, an assumption:
#: measure yours (STREAM) and pass ``--host-memory-gbps`` or a JSON profile. It also assumes the host state is spread
#: over both sockets' memory; pages all on one socket (first touch by one thread, no interleaving) get about half.
SUSTAINED_FRACTION = 0.75
#: GB/s of one DDR channel at its peak: 8 bytes x the transfer rate.
DDR4_3200_GBPS, DDR5_4800_GBPS, DDR5_5200_GBPS = 25.6, 38.4, 41.6


def _sustained(channels: int, channel_gbps: float) -> float:
    return round(channels * channel_gbps * SUSTAINED_FRACTION, 1)


#: Where each preset's host figures (cores, host_mem_gbps) come from: the typical host of a server of that class.
HOST_MEMORY_SOURCES: dict[str, str] = {
    "a100-40gb-pcie4": "a typical A100 PCIe server: 2 x 32-core CPUs (e.g. EPYC 7543), 2 x 8 channels DDR4-3200 "
                       "= 16 x 25.6 = 409.6 GB/s peak, x 0.75 sustained",
    "a100-80gb-pcie4": "a typical A100 PCIe server: 2 x 32-core CPUs (e.g. EPYC 7543), 2 x 8 channels DDR4-3200 "
                       "= 16 x 25.6 = 409.6 GB/s peak, x 0.75 sustained",
    "h100-80gb-pcie5": "a typical H100 PCIe server: 2 x 48-core Sapphire Rapids (e.g. Xeon Platinum 8468), 2 x 8 "
                       "channels DDR5-4800 = 16 x 38.4 = 614.4 GB/s peak, x 0.75 sustained",
    "rtx4090-pcie4": "a 16-core desktop (e.g. Ryzen 9 7950X), 2 channels DDR5-5200 = 2 x 41.6 = 83.2 GB/s peak, "
                     "x 0.75 sustained",
    "l4-pcie4": "a 16-core single-socket server (e.g. EPYC 7313P), 8 channels DDR4-3200 = 8 x 25.6 = 204.8 GB/s "
                "peak, x 0.75 sustained",
    "a100-80gb-sxm4-nvlink": "DGX A100: 2 x 64-core EPYC 7742, 2 x 8 channels DDR4-3200 = 409.6 GB/s peak, x 0.75 "
                             "sustained",
    "h100-80gb-sxm5-nvlink": "DGX H100: 2 x 56-core Xeon Platinum 8480C, 2 x 8 channels DDR5-4800 = 614.4 GB/s "
                             "peak, x 0.75 sustained",
}

#: Where each preset's host RAM (``host_mem_gb``) comes from: the DGX datasheets, else one DIMM per memory channel of
#: the typical server in `HOST_MEMORY_SOURCES` (an assumption: measure yours, ``--host-mem-gb``).
HOST_RAM_SOURCES: dict[str, str] = {
    "a100-40gb-pcie4": "16 channels x one 32 GB DDR4 DIMM = 512 GB",
    "a100-80gb-pcie4": "16 channels x one 32 GB DDR4 DIMM = 512 GB",
    "h100-80gb-pcie5": "16 channels x one 64 GB DDR5 DIMM = 1024 GB",
    "rtx4090-pcie4": "2 channels x one 32 GB DDR5 DIMM = 64 GB",
    "l4-pcie4": "8 channels x one 32 GB DDR4 DIMM = 256 GB",
    "a100-80gb-sxm4-nvlink": "DGX A100 640 GB datasheet: 2 TB of system memory",
    "h100-80gb-sxm5-nvlink": "DGX H100 datasheet: 2 TB of system memory",
}

# Device and link: nominal datasheet figures. Host: `HOST_MEMORY_SOURCES` (cores and sustained memory bandwidth) and
# `HOST_RAM_SOURCES` (RAM).
PROFILES: dict[str, HardwareProfile] = {
    "a100-40gb-pcie4": HardwareProfile("a100-40gb-pcie4", 312.0, 40.0, 1555.0, 25.0, 64,
                                       _sustained(16, DDR4_3200_GBPS), interconnect_gbps=25.0, host_mem_gb=512.0),
    "a100-80gb-pcie4": HardwareProfile("a100-80gb-pcie4", 312.0, 80.0, 1935.0, 25.0, 64,
                                       _sustained(16, DDR4_3200_GBPS), interconnect_gbps=25.0, host_mem_gb=512.0),
    "h100-80gb-pcie5": HardwareProfile("h100-80gb-pcie5", 756.0, 80.0, 2000.0, 50.0, 96,
                                       _sustained(16, DDR5_4800_GBPS), interconnect_gbps=50.0, host_mem_gb=1024.0),
    "rtx4090-pcie4": HardwareProfile("rtx4090-pcie4", 165.0, 24.0, 1008.0, 25.0, 16, _sustained(2, DDR5_5200_GBPS),
                                     interconnect_gbps=25.0, host_mem_gb=64.0),
    "l4-pcie4": HardwareProfile("l4-pcie4", 121.0, 24.0, 300.0, 25.0, 16, _sustained(8, DDR4_3200_GBPS),
                                interconnect_gbps=25.0, host_mem_gb=256.0),
    "a100-80gb-sxm4-nvlink": HardwareProfile("a100-80gb-sxm4-nvlink", 312.0, 80.0, 2039.0, 25.0, 128,
                                             _sustained(16, DDR4_3200_GBPS), interconnect_gbps=300.0,
                                             host_mem_gb=2048.0),
    "h100-80gb-sxm5-nvlink": HardwareProfile("h100-80gb-sxm5-nvlink", 989.0, 80.0, 3350.0, 50.0, 112,
                                             _sustained(16, DDR5_4800_GBPS), interconnect_gbps=450.0,
                                             host_mem_gb=2048.0),
}


def load_profile(spec: str, published_host: bool = False) -> HardwareProfile:
    """A preset name from `PROFILES` or the path of a JSON file with `HardwareProfile`'s fields: its `DEVICE_FIELDS`
    always, and with `published_host` (``--host-from-profile``: the profile's own host, nothing measured here) also
    `PUBLISHED_HOST_REQUIRED`."""
    if spec in PROFILES:
        return PROFILES[spec]
    path = Path(spec).expanduser()
    if path.is_file():
        return HardwareProfile.from_json(path, DEVICE_FIELDS + (PUBLISHED_HOST_REQUIRED if published_host else ()))
    raise ValueError(f"--hardware {spec!r} is neither a preset ({', '.join(sorted(PROFILES))}) nor a JSON file.")


__all__ = ["ACCUMULATE_VS_ADAMW", "DEVICE_FIELDS", "HOST_ADAMW_BYTES_PER_PARAM", "HOST_FIELDS", "HOST_MEMORY_SOURCES",
           "HOST_RAM_SOURCES", "PROFILES", "PUBLISHED_HOST_CORES", "PUBLISHED_HOST_PARAMS_PER_S", "ROUNDING_VS_ADAMW",
           "WINDOW_PASS_VS_ADAMW", "ZERO_ALLOWED_FIELDS", "HardwareProfile", "load_profile"]
