"""This host's figures, measured: the fused CPU AdamW rate at 1..N threads, the memory bandwidth, and ZenFlow's own
host passes (the window's AdamW pass, one step's accumulation, the write-back rounding) against the fused AdamW on one
thread.

`estimate` and `compare` project with the host they run on, not with a published constant: a user who runs them on
their own GPU box gets their own host's figures. `measure_host_rates` takes a second or two (an AdamW over
`ADAMW_PARAMS` fp32 parameters, a few times, at 1, 2, 4, ... and N threads; one large copy for the bandwidth; the
engine's window pass, accumulation and rounding over `PASS_PARAMS` elements on one thread) and is cached per
process. `host_profile` puts the measured AdamW rate per core and the passes' cost in AdamWs into a `HardwareProfile`,
whose device and link stay the profile's. A preset also keeps its host's cores, memory bandwidth and RAM
(`profiles.HOST_MEMORY_SOURCES`, `profiles.HOST_RAM_SOURCES`: a typical server of its class), so the projection is
this machine's per-core rate on that server, capped by that server's memory; a JSON profile keeps the host fields
it sets and takes the others from this machine (its RAM: `this_machine_ram_gb`); ``--host-cores``,
``--host-memory-gbps`` and ``--host-mem-gb`` win over both.

Example:
    >>> rates = HostRates(cores=2, adamw_params_per_s={1: 1.0e9, 2: 1.6e9}, mem_gbps=30.0)
    >>> rates.params_per_s(2), rates.params_per_s(4)
    (1600000000.0, 4000000000.0)
"""

from __future__ import annotations

import functools
import os
import statistics
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from hf_zenflow._base import fused_adamw_, torch_threads
from hf_zenflow.estimate.profiles import (
    ACCUMULATE_VS_ADAMW,
    HOST_ADAMW_BYTES_PER_PARAM,
    HOST_FIELDS,
    HOST_MEMORY_SOURCES,
    HOST_RAM_SOURCES,
    PROFILES,
    PUBLISHED_HOST_CORES,
    PUBLISHED_HOST_PARAMS_PER_S,
    ROUNDING_VS_ADAMW,
    WINDOW_PASS_VS_ADAMW,
)
from hf_zenflow.settings.threads import rank_cpu_count


#: fp32 parameters of the timed AdamW (with grad and moments 16 B each: 128 MiB).
ADAMW_PARAMS = 8 * 1024 * 1024
#: Elements of the timed ZenFlow passes: 448 MiB of host state, sum and gradient, beyond the last-level cache of
#: today's servers (a pass over the whole model streams from memory; a small one would run from cache).
PASS_PARAMS = 32 * 1024 * 1024
#: Bytes of the timed copy (read once, written once).
COPY_BYTES = 256 * 1024 * 1024
REPEATS = 4
PASS_REPEATS = 3
#: Host fields a preset keeps: its typical server's cores, memory bandwidth and RAM (the AdamW rate is measured here).
PRESET_HOST_FIELDS = ("host_cores", "host_mem_gbps", "host_mem_gb")
#: Bytes per parameter of the timed AdamW (`_time_adamw`: fp32 param, grad, exp_avg, exp_avg_sq read; param and
#: moments written).
TIMED_ADAMW_BYTES_PER_PARAM = 28


@dataclass(frozen=True)
class HostRates:
    """Measured on this host: fused AdamW parameters/s by thread count, memory bandwidth (copy: bytes read plus
    written per second), the cores this process may use, and ZenFlow's window pass, one step's accumulation and the
    write-back rounding in fused AdamWs on one thread (their time over the AdamW's per element)."""

    cores: int
    adamw_params_per_s: dict[int, float]
    mem_gbps: float
    seconds: float = 0.0
    window_adamws: float = WINDOW_PASS_VS_ADAMW
    accumulate_adamws: float = ACCUMULATE_VS_ADAMW
    rounding_adamws: float = ROUNDING_VS_ADAMW

    def params_per_s(self, cores: int) -> float:
        """AdamW rate on `cores` threads: measured where measured, linear between measured counts, and beyond this
        host's cores its best per-thread rate (`per_core`) times `cores` (what caps it there is the target's memory
        bandwidth, `HardwareProfile.host_adamw_params_per_s`, not this machine's)."""
        known = sorted(self.adamw_params_per_s)
        if cores in self.adamw_params_per_s:
            return self.adamw_params_per_s[cores]
        if cores > known[-1]:
            return self.per_core() * cores
        lo = max(k for k in known if k < cores) if cores > known[0] else known[0]
        hi = min(k for k in known if k > cores)
        a, b = self.adamw_params_per_s[lo], self.adamw_params_per_s[hi]
        return a + (b - a) * (cores - lo) / (hi - lo) if hi != lo else a * cores / lo

    def per_core(self) -> float:
        """The best per-thread AdamW rate measured: one core's reach. Rates at more threads per thread are lower
        here because the threads share this machine's memory bandwidth (and, on a small VM, perhaps a physical
        core); a projection onto another host's cores caps by that host's bandwidth instead, so this machine's own
        limit is not counted twice."""
        return max(v / k for k, v in self.adamw_params_per_s.items())

    def effective_mem_gbps(self) -> float:
        """The bandwidth AdamW showed (its bytes per parameter at the best rate) or the copy's, whichever is more:
        a capacity no measured rate exceeds."""
        best = max(self.adamw_params_per_s.values())
        return max(self.mem_gbps, best * TIMED_ADAMW_BYTES_PER_PARAM / 1e9)

    def describe(self, cores: int | None = None) -> str:
        per = ", ".join(f"{k} thread{'s' if k > 1 else ''} {v / 1e9:.2f}" for k, v in
                        sorted(self.adamw_params_per_s.items()))
        text = (f"measured on this machine ({self.cores} cores, {self.seconds:.1f} s): fused CPU AdamW, Gparam/s at "
                f"{per}; memory copy {self.mem_gbps:.1f} GB/s; ZenFlow's passes in AdamWs: window "
                f"{self.window_adamws:.2f}, accumulation {self.accumulate_adamws:.2f}, write-back rounding "
                f"{self.rounding_adamws:.2f}")
        if cores is not None:
            text += f"; projected on {cores} host core(s): {self.params_per_s(cores) / 1e9:.2f} Gparam/s"
        return text

    def to_dict(self) -> dict[str, Any]:
        return {"cores": self.cores, "adamw_params_per_s": {str(k): v for k, v in self.adamw_params_per_s.items()},
                "mem_gbps": self.mem_gbps, "seconds": self.seconds, "window_adamws": self.window_adamws,
                "accumulate_adamws": self.accumulate_adamws, "rounding_adamws": self.rounding_adamws}


def _thread_counts(cores: int) -> list[int]:
    counts, n = [], 1
    while n < cores:
        counts.append(n)
        n *= 2
    return [*counts, cores]


def _time_adamw(threads: int) -> float:
    gen = torch.Generator().manual_seed(0)
    param = torch.randn(ADAMW_PARAMS, generator=gen)
    grad = torch.randn(ADAMW_PARAMS, generator=gen)
    exp_avg, exp_avg_sq = torch.zeros_like(param), torch.zeros_like(param)
    step = torch.zeros(())
    group = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    samples = []
    with torch_threads(threads), torch.no_grad():
        for _ in range(REPEATS + 1):
            t0 = time.perf_counter()
            fused_adamw_([param], [grad], [exp_avg], [exp_avg_sq], [step], group)
            samples.append(time.perf_counter() - t0)
    return ADAMW_PARAMS / statistics.median(samples[1:])  # the first call pages the buffers in


def _time_engine_passes() -> tuple[float, float, float]:
    """Seconds per element of ZenFlow's window pass, one step's accumulation and the write-back rounding, on one
    thread: the engine's own code (`engine.host`: the CPU kernels, or torch's operations without a C compiler) on the
    host state of a bf16 matrix of `PASS_PARAMS` elements in the default layout, its window summed on the host. The
    window pass reads the sum, folds in the last gradient, takes the mean and runs AdamW; the rounding writes the
    master into the bf16 write-back buffer."""
    from hf_zenflow.engine.host import HostLayout, HostMatrix, host_adamw_window
    from hf_zenflow.settings.config import ZenFlowConfig

    gen = torch.Generator().manual_seed(0)
    shape = (PASS_PARAMS // 4096, 4096)
    param = torch.randn(shape, generator=gen, dtype=torch.bfloat16).mul_(0.02)
    grad = torch.randn(shape, generator=gen, dtype=torch.bfloat16).mul_(1e-3)
    layout = replace(HostLayout.of(ZenFlowConfig()), writeback="buffer")
    host = HostMatrix.create(param, torch.bfloat16, "host", moments=layout)
    writeback, host.writeback = host.writeback, None  # (the rounding is timed on its own)
    hyper = {"lr": 1e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    window, accumulate, rounding = [], [], []
    with torch_threads(1), torch.no_grad():
        for _ in range(PASS_REPEATS + 1):
            HostMatrix.accumulate_all([(host, grad)], None)  # (the window's first gradient: written, not added)
            t0 = time.perf_counter()
            HostMatrix.accumulate_all([(host, grad)], None)
            t1 = time.perf_counter()
            host_adamw_window([(hyper, [host])], last=[(host, grad)])
            t2 = time.perf_counter()
            writeback.copy_(host.master)
            rounding.append(time.perf_counter() - t2)
            window.append(t2 - t1)
            accumulate.append(t1 - t0)
    def per_element(samples: list[float]) -> float:
        return statistics.median(samples[1:]) / PASS_PARAMS  # (the first round pages the buffers in)

    return per_element(window), per_element(accumulate), per_element(rounding)


def _time_copy(threads: int) -> float:
    src = torch.ones(COPY_BYTES // 4)
    dst = torch.empty_like(src)
    samples = []
    with torch_threads(threads):
        for _ in range(REPEATS + 1):
            t0 = time.perf_counter()
            dst.copy_(src)
            samples.append(time.perf_counter() - t0)
    return 2 * COPY_BYTES / statistics.median(samples[1:]) / 1e9


def this_machine_ram_gb() -> float:
    """This machine's physical memory, GB (the operating system's page count x page size, else psutil's figure);
    a ValueError naming ``--host-mem-gb`` where neither is known."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9
    except (AttributeError, ValueError, OSError):
        pass
    try:
        import psutil

        return psutil.virtual_memory().total / 1e9
    except ImportError:
        raise ValueError("this machine's RAM is unknown here (no sysconf page count, no psutil): pass --host-mem-gb "
                         "or set host_mem_gb in the profile.") from None


@functools.lru_cache(maxsize=1)
def measure_host_rates() -> HostRates:
    """Measure this host (once per process; a second or two)."""
    t0 = time.perf_counter()
    cores = rank_cpu_count()
    rates = {n: _time_adamw(n) for n in _thread_counts(cores)}
    window, accumulate, rounding = (s * rates[1] for s in _time_engine_passes())  # (s per element x elements/s)
    return HostRates(cores, rates, _time_copy(cores), time.perf_counter() - t0, window_adamws=window,
                     accumulate_adamws=accumulate, rounding_adamws=rounding)


def host_profile(profile: Any, rates: HostRates, host_cores: int | None = None,
                 given: tuple[str, ...] = (), host_mem_gbps: float | None = None,
                 host_mem_gb: float | None = None) -> Any:
    """`profile` with this host's measured AdamW rate per core, and ZenFlow's passes in AdamWs measured with it, in
    place of its own. Fields in `given` (a preset's cores, memory bandwidth and RAM, or a JSON profile's own host
    fields) are kept; the others come from this machine (its cores, its measured bandwidth, its RAM).
    `host_cores` / `host_mem_gbps` / `host_mem_gb` (the flags) win over both."""
    if host_cores is not None:
        cores = host_cores
    else:
        cores = profile.host_cores if "host_cores" in given else rates.cores
    values: dict[str, Any] = {"host_cores": cores}
    if "host_adamw_per_core" not in given:
        values["host_adamw_per_core"] = rates.params_per_s(cores) / cores
        values["host_window_adamws"] = rates.window_adamws
        values["host_accumulate_adamws"] = rates.accumulate_adamws
        values["host_rounding_adamws"] = rates.rounding_adamws
    if host_mem_gbps is not None:
        values["host_mem_gbps"] = host_mem_gbps
    elif "host_mem_gbps" not in given:
        values["host_mem_gbps"] = rates.effective_mem_gbps()
    if host_mem_gb is not None:
        values["host_mem_gb"] = host_mem_gb
    elif "host_mem_gb" not in given:
        values["host_mem_gb"] = this_machine_ram_gb()
    return replace(profile, name=profile.name, **values)


def json_host_fields(spec: str | None) -> tuple[str, ...]:
    """The host fields a profile sets itself: a preset its typical server's cores and memory bandwidth
    (`PRESET_HOST_FIELDS`), a JSON file the `HOST_FIELDS` it names."""
    import json
    from pathlib import Path

    if spec in PROFILES:
        return PRESET_HOST_FIELDS
    if not spec or not Path(spec).expanduser().is_file():
        return ()
    keys = json.loads(Path(spec).expanduser().read_text(encoding="utf-8"))
    return tuple(k for k in HOST_FIELDS if k in keys)


def ram_origin(profile: Any, spec: str | None, given: tuple[str, ...], flag: float | None) -> str:
    """Where the host RAM the state must fit in comes from, in words."""
    if flag is not None:
        return "--host-mem-gb"
    if "host_mem_gb" in given:
        return (f"the profile's: {HOST_RAM_SOURCES.get(profile.name, 'a preset figure')}" if spec in PROFILES
                else f"the profile's ({spec})")
    return "this machine's"


def memory_origin(profile: Any, spec: str | None, given: tuple[str, ...], flag: float | str | None) -> str:
    """Where the host memory bandwidth the projection caps by comes from, in words."""
    if flag == "measured":
        return "this machine's, measured (--host-memory-gbps measured)"
    if flag is not None:
        return "--host-memory-gbps"
    if "host_mem_gbps" in given:
        if spec in PROFILES:
            return f"the profile's: {HOST_MEMORY_SOURCES.get(profile.name, 'a preset figure')}"
        return f"the profile's ({spec})"
    return "this machine's, measured"


def cap_line(profile: Any, origin: str) -> str:
    """The host AdamW rate the projection uses and which cap applies: the cores, or the memory bandwidth over the
    bytes of one AdamW pass (synchronous offload's; ZenFlow's passes in the bound model count their own)."""
    cores = profile.host_core_params_per_s()
    memory = profile.host_mem_gbps * 1e9 / HOST_ADAMW_BYTES_PER_PARAM
    which = "memory" if memory < cores else "cores"
    return (f"cores {profile.host_adamw_per_core / 1e9:.3f} Gparam/s x {profile.host_cores} = {cores / 1e9:.2f} "
            f"Gparam/s; memory {profile.host_mem_gbps:g} GB/s ({origin}) / {HOST_ADAMW_BYTES_PER_PARAM} B per "
            f"parameter of an AdamW pass = {memory / 1e9:.2f} Gparam/s: the {which} cap applies, host AdamW "
            f"{min(cores, memory) / 1e9:.2f} Gparam/s")


def published_host_line(profile: Any, origin: str = "the profile's") -> str:
    return (f"Host: the profile's published figure (--host-from-profile): DeepSpeed's CPUAdam rate "
            f"({PUBLISHED_HOST_PARAMS_PER_S / 1e9:.2f} Gparam/s on {PUBLISHED_HOST_CORES} threads) per core; "
            f"{cap_line(profile, origin)}.")


def resolve_host(profile: Any, spec: str | None, host_cores: int | None, from_profile: bool,
                 host_mem_gbps: float | str | None = None, host_mem_gb: float | None = None) -> tuple[Any, str]:
    """The profile to project with and the line that says where its host figures come from and which cap applies.
    `host_mem_gbps`: a number (GB/s) or "measured" (this machine's) in place of the profile's; `host_mem_gb`: the
    host RAM in place of the profile's (a preset's typical server's; a JSON profile's, else this machine's)."""
    given = json_host_fields(spec)
    origin = memory_origin(profile, spec, given, host_mem_gbps)
    ram = ram_origin(profile, spec, given, host_mem_gb)
    if from_profile:
        if host_cores is not None:
            profile = replace(profile, host_cores=host_cores)
        if host_mem_gbps is not None:
            mem = measure_host_rates().effective_mem_gbps() if host_mem_gbps == "measured" else host_mem_gbps
            profile = replace(profile, host_mem_gbps=mem)
        if host_mem_gb is not None:
            profile = replace(profile, host_mem_gb=host_mem_gb)
        return profile, published_host_line(profile, origin) + f" {_ram_line(profile, ram)}"
    rates = measure_host_rates()
    mem = rates.effective_mem_gbps() if host_mem_gbps == "measured" else host_mem_gbps
    resolved = host_profile(profile, rates, host_cores, given, mem, host_mem_gb)
    per_core = ("the profile's own host_adamw_per_core" if "host_adamw_per_core" in given else
                "measured here: its best per-thread rate" if resolved.host_cores > max(rates.adamw_params_per_s)
                else f"measured here on {resolved.host_cores} thread(s)")
    cores_from = ("--host-cores" if host_cores is not None else
                  "the profile's" if "host_cores" in given else "this machine's")
    return resolved, (f"Host: {rates.describe()}. Projected: per-core rate {per_core}, {cores_from} "
                      f"{resolved.host_cores} core(s); {cap_line(resolved, origin)} (--host-from-profile: the "
                      "published per-core rate instead; --host-cores / --host-memory-gbps override). "
                      + _ram_line(resolved, ram))


def _ram_line(profile: Any, origin: str) -> str:
    override = "" if origin == "--host-mem-gb" else "; --host-mem-gb overrides"
    return f"Host RAM {profile.host_mem_gb:.0f} GB ({origin}{override})."
