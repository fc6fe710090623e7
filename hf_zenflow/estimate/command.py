"""`hf-zenflow estimate` on the command line: its flags, the check of every input before any work (the profile, the
flags that go together, the output path), and the run: the bound model's tables (`advice`) with the host resolved
(`host_rates.resolve_host`: this machine's measured AdamW rate on the profile's host unless ``--host-from-profile``),
and the file of ``--output`` (JSON or Markdown, by its suffix).
"""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path
from typing import Any

from hf_zenflow.atomic import write_text
from hf_zenflow.estimate.profiles import PROFILES, HardwareProfile, load_profile
from hf_zenflow.estimate.ranks import PARALLEL_MODES, check_ranks
from hf_zenflow.settings.cli_types import _number, fraction, parameter_count, positive_float, positive_int


#: The profile `estimate` models when ``--hardware`` is not given.
DEFAULT_HARDWARE = "h100-80gb-pcie5"
#: The model size of the tables when neither ``--params`` nor ``--max-params`` is given.
DEFAULT_PARAMS = 7e9
#: What ``--output`` writes, by the file's suffix.
OUTPUT_FORMATS = {".json": "every figure, as JSON", ".md": "the tables and sentences as printed, Markdown"}


def add_estimate_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--hardware", default=DEFAULT_HARDWARE,
                   help=f"a hardware profile: a preset ({', '.join(sorted(PROFILES))}) or a JSON file with the fields "
                        "of hf_zenflow.estimate.profiles.HardwareProfile: device_tflops, device_mem_gb, "
                        "device_mem_gbps, link_gbps, mfu and interconnect_gbps are required; host_cores, "
                        "host_mem_gbps, host_adamw_per_core and host_mem_gb may be left out (then they are this "
                        "machine's; required with --host-from-profile, except host_adamw_per_core) "
                        "(default: %(default)s)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--params", type=parameter_count, default=None,
                      help=f"model parameters, e.g. 7e9, 7B or 350M (default: {DEFAULT_PARAMS:g})")
    size.add_argument("--max-params", action="store_true",
                      help="print the largest model each schedule trains on the profile's device and host RAM, with "
                           "its step time there, instead of the tables for one size (default: off)")
    p.add_argument("--tokens-per-step", type=positive_float, default=4096,
                   help="tokens per optimizer step and rank (forward+backward = 6 x params x tokens FLOPs) "
                        "(default: %(default)s)")
    p.add_argument("--topk-ratio", type=fraction, default=0.1,
                   help="ZenFlow: share of each matrix's columns updated on the device (default: %(default)s)")
    p.add_argument("--update-interval", type=positive_int, default=4,
                   help="ZenFlow: steps per host window (default: %(default)s)")
    p.add_argument("--device-step-ms", type=positive_float, default=None,
                   help="measured forward+backward ms of one step at --params, in place of the FLOP count "
                        "(default: from the profile's FLOP/s)")
    p.add_argument("--ranks", type=rank_count, default=1,
                   help="data-parallel ranks (one GPU each) on the node: every figure becomes one rank's, with 1/N "
                        "of the offloaded host work, host memory and link bytes on 1/N of the host cores and memory "
                        "bandwidth, and for DDP an all-gather of the updated rows at each write-back; host RAM is the "
                        "node's, shared by the ranks (default: %(default)s)")
    p.add_argument("--parallel", choices=PARALLEL_MODES, default="ddp",
                   help="with --ranks: how the ranks split the offloaded part: ddp (1/N of every matrix's rows, "
                        "all-gather at write-back) or fsdp2 (each rank's shard, no weight collective) "
                        "(default: %(default)s)")
    p.add_argument("--interconnect-gbps", type=positive_float, default=None,
                   help="GPU<->GPU bandwidth per GPU and direction, GB/s, for DDP's all-gather (default: the "
                        "profile's)")
    p.add_argument("--host-cores", type=positive_int, default=None,
                   help="host cores of the node (default: the profile's; a JSON profile without host_cores: this "
                        "machine's)")
    p.add_argument("--host-memory-gbps", type=host_memory_gbps, default=None,
                   help="the host's sustained memory bandwidth in GB/s (STREAM-like) that caps the host passes, or "
                        '"measured" for this machine\'s (default: a preset\'s typical server\'s, '
                        "hf_zenflow.estimate.profiles.HOST_MEMORY_SOURCES; a JSON profile's host_mem_gbps, else "
                        "this machine's)")
    p.add_argument("--host-mem-gb", type=positive_float, default=None,
                   help="the node's host RAM in GB, which the offloaded optimizer state must fit in (default: a "
                        "preset's typical server's, hf_zenflow.estimate.profiles.HOST_RAM_SOURCES; a JSON profile's "
                        "host_mem_gb, else this machine's)")
    p.add_argument("--host-from-profile", action="store_true",
                   help="take the host AdamW rate from the profile's published figure (DeepSpeed's CPUAdam rate per "
                        "core) instead of measuring this machine's (default: measured here, a second or two)")
    p.add_argument("--output", default=None,
                   help="also write to this file, in the format its suffix names: .json (every figure) or .md (the "
                        "tables and sentences as printed, Markdown) (default: none)")


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


def check_output_path(path: str, flag: str = "--output") -> Path:
    """`path` if a file can be written there (its folder, or the nearest existing folder above it, writable; the
    path itself not a folder, and writable when it exists), else a ValueError naming the flag and the reason."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise ValueError(f"{flag} {path}: is a folder; a file path is allowed.")
    folder = target.parent
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: {folder} is not a folder, so no file can be written there.")
    if not os.access(folder, os.W_OK | os.X_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable (permission denied in {folder}).")
    return target


def check_inputs(args: argparse.Namespace) -> HardwareProfile:
    """Every input checked before any work (no measurement, nothing written): the profile (a JSON profile complete,
    `load_profile`), the flags that go together and the output path. Returns the profile as loaded."""
    if args.output is not None:
        check_output_path(args.output)
        suffix = Path(args.output).suffix.lower()
        if suffix not in OUTPUT_FORMATS:
            allowed = ", ".join(f"{k} ({v})" for k, v in OUTPUT_FORMATS.items())
            raise ValueError(f"--output {args.output}: the suffix {suffix or '(none)'!r} names no format: allowed are "
                             f"{allowed}.")
    if args.max_params and args.device_step_ms is not None:
        raise ValueError("--device-step-ms is invalid with --max-params: a measured forward+backward is of one model "
                         "size; allowed with --params.")
    if args.interconnect_gbps is not None and args.parallel != "ddp":
        raise ValueError(f"--interconnect-gbps is invalid with --parallel {args.parallel}: only DDP's all-gather "
                         "uses it; allowed with --parallel ddp.")
    return load_profile(args.hardware, published_host=args.host_from_profile)


def write_output(path: Path, payload: dict[str, Any], printed: str) -> None:
    """Write `payload` (.json) or the `printed` tables (.md) to `path`, whole or not at all (`hf_zenflow.atomic`: a
    temporary sibling renamed over it); an error names `path`, not the temporary file."""
    text = json.dumps(payload, indent=2, default=str) if path.suffix.lower() == ".json" else printed
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_text(path, text)
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, str(path)) from None


def estimate_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """Check the inputs, resolve the host, print the tables; returns (and with --output writes) the figures."""
    profile = check_inputs(args)  # before the model's imports (torch) and the host measurement: a refusal at once
    from dataclasses import replace

    from hf_zenflow.estimate.advice import format_max_params, format_schedule_model, format_what_fits
    from hf_zenflow.estimate.fits import FIT_SCHEDULES, max_params, what_fits
    from hf_zenflow.estimate.host_rates import resolve_host
    from hf_zenflow.estimate.memory import GRADIENTS_FREED_IN_BACKWARD

    output = Path(args.output).expanduser() if args.output is not None else None
    if args.interconnect_gbps is not None:
        profile = replace(profile, interconnect_gbps=args.interconnect_gbps)
    profile, host_line = resolve_host(profile, args.hardware, args.host_cores, args.host_from_profile,
                                      args.host_memory_gbps, args.host_mem_gb)
    setting = {"tokens_per_step": args.tokens_per_step, "topk_ratio": args.topk_ratio,
               "update_interval": args.update_interval, "ranks": args.ranks, "parallel": args.parallel}
    payload: dict[str, Any] = {"profile": asdict(profile), "host": host_line, **setting,
                               "gradients_freed_in_backward": GRADIENTS_FREED_IN_BACKWARD}
    printed: list[str] = []

    def say(text: str) -> None:
        print(text, flush=True)
        printed.append(text)

    if args.max_params:
        largest = {s: max_params(profile, s, **setting) for s in FIT_SCHEDULES}
        say(format_max_params(profile, largest, args.ranks, args.parallel))
        payload["max_params"] = largest
    else:
        params = args.params or DEFAULT_PARAMS
        say(format_schedule_model(profile, params, args.tokens_per_step, args.topk_ratio, args.update_interval,
                                  args.device_step_ms, args.ranks, args.parallel))
        fits = what_fits(profile, params, **setting, device_step_ms=args.device_step_ms)
        say(format_what_fits(profile, fits, args.ranks))
        payload.update(params=params, device_step_ms=args.device_step_ms, what_fits=fits)
    say(host_line + "\n")
    if output is not None:
        write_output(output, payload, "\n".join(printed))
    return payload


__all__ = ["DEFAULT_HARDWARE", "OUTPUT_FORMATS", "add_estimate_arguments", "check_inputs", "check_output_path",
           "estimate_from_args", "write_output"]
