"""`hf-zenflow estimate` on the command line: its flags, the scenario they describe (a preset, explicit figures or a
hardware profile), and the run that prints the bound model and the emulator's report."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

from hf_zenflow.estimate.emulator_report import format_estimate
from hf_zenflow.estimate.emulator_scenario import LINK_BYTES_PER_PARAM, SCENARIOS, EmulatorScenario
from hf_zenflow.estimate.emulator_schedules import run_estimate
from hf_zenflow.estimate.ranks import PARALLEL_MODES, check_ranks
from hf_zenflow.settings.cli_types import _number, fraction, positive_float, positive_int


def add_estimate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--scenario", choices=sorted(SCENARIOS), default=None,
                   help="a calibrated preset; other flags given explicitly override its values")
    p.add_argument("--params", "--model-params", dest="params", type=positive_float, default=None,
                   help="model parameters (e.g. 7e9) [7e9]")
    add_hardware_arguments(p)
    p.add_argument("--device-step-ms", type=positive_float, default=None,
                   help="forward+backward time of one step on the device [2045]")
    p.add_argument("--link-gbps", type=positive_float, default=None,
                   help="host<->device bandwidth per direction, GB/s; sets the offload/upload times for bf16 "
                        "gradients/parameters [28, i.e. 500 ms for 7B]")
    p.add_argument("--host-cores", type=positive_int, default=None,
                   help="host cores of the target machine: without --cpu-update-ms the host AdamW time is this "
                        "machine's measured rate on these cores (beyond its own cores: its best per-thread rate x "
                        "cores, capped by the memory bandwidth: the --hardware profile's, else this machine's), or "
                        "with --host-from-profile the published rate (7e9 params in 4.6 s on 128 threads) scaled "
                        "linearly to them [with --hardware: the profile's host cores; else this machine's cores; "
                        "128 with --host-from-profile]")
    p.add_argument("--cpu-update-ms", type=positive_float, default=None,
                   help="host AdamW time for the whole model on the target machine (else extrapolated)")
    p.add_argument("--device-optimizer-ms", type=positive_float, default=None,
                   help="AdamW over the whole model on the device (else params x 28 B / --device-mem-gbps)")
    p.add_argument("--device-mem-gbps", type=positive_float, default=None, help="device memory bandwidth, GB/s [8000]")
    p.add_argument("--topk-ratio", type=fraction, default=None, help="[0.1]")
    p.add_argument("--update-interval", type=positive_int, default=None, help="[4]")
    p.add_argument("--emulated-params", type=positive_float, default=None,
                   help="real parameters the host code runs on (the scaled-down model; ~4 GB of host memory at "
                        "the default) [1e8]")
    p.add_argument("--steps", type=positive_int, default=None, help="steps per schedule [14]")
    p.add_argument("--host-threads", type=positive_int, default=None,
                   help="host worker threads here (cpu_threads; default: the cores in this process's affinity "
                        "minus one, as the training thread runs one thread: docs/threads.md)")
    p.add_argument("--ranks", type=rank_count, default=None,
                   help="data-parallel ranks (one GPU each) on the node: every figure becomes one rank's, with 1/N "
                        "of the offloaded host work, host memory and link bytes on 1/N of the host cores and memory "
                        "bandwidth, and for DDP an all-gather of the updated rows at each write-back [1]")
    p.add_argument("--parallel", choices=PARALLEL_MODES, default=None,
                   help="with --ranks: how the ranks split the offloaded part: ddp (1/N of every matrix's rows, "
                        "all-gather at write-back) or fsdp2 (each rank's shard, no weight collective) [ddp]")
    p.add_argument("--interconnect-gbps", type=positive_float, default=None,
                   help="GPU<->GPU bandwidth per GPU and direction, GB/s, for DDP's all-gather [the profile's; "
                        "else 25, a PCIe Gen4 node]")
    p.add_argument("--output", default=None, help="write the result as JSON to this file")


def rank_count(text: str) -> int:
    """argparse type of --ranks: an integer >= 1, else an error naming the flag, the value and what is allowed."""
    try:
        value: Any = int(text)
    except ValueError:
        value = text
    try:
        return check_ranks(value, "--ranks")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def host_memory_gbps(text: str) -> float | str:
    """argparse type of --host-memory-gbps: a number > 0 or "measured"."""
    if text.strip().lower() == "measured":
        return "measured"
    return _memory_number(text)


_memory_number = _number(float, 0.0, None, True, 'a number > 0 or "measured"')


def add_hardware_arguments(p: argparse.ArgumentParser) -> None:
    from hf_zenflow.estimate.profiles import PROFILES

    p.add_argument("--hardware", default=None,
                   help=f"a hardware profile: a preset ({', '.join(sorted(PROFILES))}) or a JSON file with the fields "
                        "of hf_zenflow.estimate.hardware.HardwareProfile (device_tflops, device_mem_gb, "
                        "device_mem_gbps, link_gbps, host_cores, host_mem_gbps, mfu, interconnect_gbps). Prints "
                        "the bound model (where "
                        "each schedule is bound and which setting moves the bound), then runs the emulator on the "
                        "profile's figures; explicit flags override them")
    p.add_argument("--tokens-per-step", type=positive_float, default=4096,
                   help="with --hardware: tokens per optimizer step (forward+backward = 6 x params x tokens FLOPs)")
    p.add_argument("--model-only", action="store_true",
                   help="with --hardware: print the bound model only, do not run the emulator")
    p.add_argument("--host-from-profile", action="store_true",
                   help="take the host AdamW rate from the profile's published figure (DeepSpeed's CPUAdam rate per "
                        "core) instead of measuring this machine's (default: measured here, a second or two)")
    p.add_argument("--host-memory-gbps", type=host_memory_gbps, default=None,
                   help="with --hardware: the host's sustained memory bandwidth in GB/s (STREAM-like) that caps the "
                        'host passes, or "measured" for this machine\'s [a preset: its typical server\'s '
                        "(hf_zenflow.estimate.hardware.HOST_MEMORY_SOURCES); a JSON profile: its host_mem_gbps, else "
                        "this machine's]")


def scenario_from_profile(profile: Any, params: float, tokens_per_step: float, ranks: int = 1,
                          parallel: str = "ddp", host_source: str | None = None) -> EmulatorScenario:
    """The emulator scenario of a `hardware.HardwareProfile`: its forward+backward, link and host AdamW times (of the
    whole model: the emulator takes one rank's share of them), for `ranks` data-parallel ranks on its node."""
    from hf_zenflow.estimate.hardware import schedule_model

    rows = schedule_model(profile, params, tokens_per_step)
    link_ms = rows["sync_offload"]["link_ms"] / 2
    return EmulatorScenario(
        name=f"hardware:{profile.name}", params=params, forward_ms=0.0, backward_ms=rows["no_offload"]["compute_ms"],
        grad_offload_ms=link_ms, param_upload_ms=link_ms, cpu_update_ms=rows["sync_offload"]["host_ms"],
        device_mem_gbps=profile.device_mem_gbps, host_cores=profile.host_cores, ranks=ranks, parallel=parallel,
        interconnect_gbps=profile.interconnect_gbps,
        notes=f"hardware profile {profile.name}: forward+backward = 6 x params x {tokens_per_step:.0f} tokens at "
              f"{profile.mfu:g} of {profile.device_tflops:g} TFLOP/s; "
              + (host_source or f"host AdamW at the published per-core CPUAdam rate x {profile.host_cores} cores "
                                f"(capped by {profile.host_mem_gbps:g} GB/s)"))


def _profile(args: argparse.Namespace) -> Any:
    """The --hardware profile with its host resolved (`host_rates.resolve_host`: measured here unless
    --host-from-profile); the line saying which is its ``host_source``."""
    from hf_zenflow.estimate.host_rates import resolve_host
    from hf_zenflow.estimate.profiles import load_profile

    profile = load_profile(args.hardware)
    if args.interconnect_gbps is not None:
        profile = replace(profile, interconnect_gbps=args.interconnect_gbps)
    cached = getattr(args, "_resolved_profile", None)
    if cached is not None:
        return cached
    profile, line = resolve_host(profile, args.hardware, args.host_cores, getattr(args, "host_from_profile", False),
                                 getattr(args, "host_memory_gbps", None))
    args._resolved_profile, args._host_source = profile, line
    return profile


#: Flags that set the scenario field of the same name when given, in both paths.
_RANK_FIELDS = ("ranks", "parallel", "interconnect_gbps")


def scenario_from_args(args: argparse.Namespace) -> EmulatorScenario:
    hardware = getattr(args, "hardware", None)
    memory = getattr(args, "host_memory_gbps", None)
    if memory is not None and not hardware:
        # without a profile the host is this machine, capped by its measured bandwidth: the flag would do nothing
        raise ValueError(f"--host-memory-gbps={memory!r} is invalid without --hardware: allowed only with a "
                         "hardware profile, whose host passes it caps.")
    if hardware:
        profile = _profile(args)
        sc = scenario_from_profile(profile, args.params or EmulatorScenario.params, args.tokens_per_step,
                                   host_source=args._host_source)
        for attr in ("topk_ratio", "update_interval", "emulated_params", "steps", "host_threads", "cpu_update_ms",
                     "device_optimizer_ms", "device_mem_gbps") + _RANK_FIELDS:
            if getattr(args, attr) is not None:
                setattr(sc, attr, getattr(args, attr))
        if args.device_step_ms is not None:
            sc.backward_ms = args.device_step_ms
        if args.link_gbps is not None:
            sc.grad_offload_ms = sc.param_upload_ms = sc.params * LINK_BYTES_PER_PARAM / (args.link_gbps * 1e9) * 1e3
        return sc
    sc = SCENARIOS[args.scenario]() if args.scenario else EmulatorScenario(cpu_update_ms=None)
    if args.params is not None:
        sc.params = args.params
        if args.scenario and args.cpu_update_ms is None:
            sc.cpu_update_ms = None  # a different model size: the calibrated CPU time no longer applies
    if args.device_step_ms is not None:
        sc.forward_ms, sc.backward_ms = 0.0, args.device_step_ms
    if args.link_gbps is not None:
        ms = sc.params * LINK_BYTES_PER_PARAM / (args.link_gbps * 1e9) * 1e3
        sc.grad_offload_ms = sc.param_upload_ms = ms
    for attr in ("host_cores", "cpu_update_ms", "device_optimizer_ms", "device_mem_gbps", "topk_ratio",
                 "update_interval", "emulated_params", "steps", "host_threads") + _RANK_FIELDS:
        value = getattr(args, attr)
        if value is not None:
            setattr(sc, attr, value)
    sc.host_from_profile = bool(getattr(args, "host_from_profile", False))
    if not args.scenario:
        sc.name = "custom"
        if args.host_cores is None and not sc.host_from_profile:
            sc.host_cores = None  # the measured host: this machine's cores
        if args.link_gbps is None:
            # default link: 28 GB/s per direction (the published 500 ms for 7B bf16 gradients)
            sc.grad_offload_ms = sc.param_upload_ms = sc.params * LINK_BYTES_PER_PARAM / 28e9 * 1e3
    return sc


def estimate_from_args(args: argparse.Namespace) -> dict[str, Any]:
    sc = scenario_from_args(args)
    if getattr(args, "hardware", None):
        from hf_zenflow.estimate.advice import format_schedule_model

        print(format_schedule_model(_profile(args), sc.params, args.tokens_per_step, sc.topk_ratio,
                                    sc.update_interval, device_step_ms=args.device_step_ms, ranks=sc.ranks,
                                    parallel=sc.parallel), flush=True)
        print(args._host_source + "\n", flush=True)
        if args.model_only:
            return {"scenario": asdict(sc)}
    res = run_estimate(sc)
    print(format_estimate(res), flush=True)
    if getattr(args, "hardware", None):
        from hf_zenflow.estimate.hardware import auto_accumulation

        auto = auto_accumulation(_profile(args), sc.params, args.tokens_per_step, sc.topk_ratio, sc.ranks, sc.parallel)
        key = {"device": "zenflow_device_accumulation", "host": "zenflow"}.get(auto["choice"])
        s = res["summary"]
        res["auto_accumulation"] = {**auto, "row": key}
        if key is None:  # the emulator runs fp32 sums only
            print(f'ZenFlow with the defaults: accumulate_on="auto" chooses "{auto["choice"]}" on this profile, '
                  "which the emulator does not run (fp32 sums only): see the bound model's row.", flush=True)
        else:
            print(f'ZenFlow with the defaults (accumulate_on="auto" chooses "{auto["choice"]}" on this profile, see '
                  f"the bound model): **{s[f'{key}_speedup_vs_sync']:.2f}x** faster per step than synchronous "
                  f"offload, {s[f'{key}_step_vs_no_offload']:.2f}x the no-offload step (emulated).", flush=True)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(res, indent=2, default=str), encoding="utf-8")
    return res
