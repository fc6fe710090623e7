"""The `hf-zenflow convert-checkpoint` and `hf-zenflow reshard-checkpoint` commands: their flags and their runs.

Importing this module is quick (the heavy work is imported when a command runs): `hf_zenflow.cli` builds a command's
parser only when that command is named. A refusal is one line on stderr and exit status 2, before anything is
written; a file-system error (a full disk, no permission) is one line too.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from ..settings.cli_types import positive_int
from .checkpoint_paths import missing_folder_message, world_size_problem


def add_convert(sub: argparse._SubParsersAction, summary: str) -> None:
    p = sub.add_parser(
        "convert-checkpoint",
        help=summary,
        allow_abbrev=False,
        description="Rewrite CHECKPOINT's optimizer.pt as a torch.optim.AdamW state dict (moments, step counts) and "
        "its safetensors weights as ZenFlow's fp32 masters (what ZenFlow had not yet written into the weights is "
        "applied, as flush() would). The original optimizer file is kept as optimizer.zenflow.pt. The converted "
        "folder is built beside the original and swapped in only when complete: an interrupted conversion leaves "
        "the original as it was. The other direction needs no conversion: ZenFlowTrainer resumes a plain "
        "Trainer's checkpoint as it is.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("checkpoint", help="a checkpoint folder (optimizer.pt + model.safetensors or adapter weights)")
    p.add_argument("--output-dir", default=None, help="write a converted copy here instead of converting in place")
    p.set_defaults(func=run_convert)


def _os_error(command: str, exc: OSError) -> int:
    print(f"hf-zenflow {command}: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
    return 2


def _refuse(command: str, problem: str | None) -> bool:
    """Print `problem` (one line) and say so; False when there is none."""
    if problem is not None:
        print(f"hf-zenflow {command}: {problem}", file=sys.stderr)
    return problem is not None


def run_convert(args: argparse.Namespace) -> int:
    if _refuse("convert-checkpoint", missing_folder_message(Path(args.checkpoint))):  # before torch is imported
        return 2
    from ..checkpoint.format import CheckpointError
    from .convert import convert_checkpoint

    try:
        summary = convert_checkpoint(args.checkpoint, args.output_dir)
    except CheckpointError as exc:
        print(f"hf-zenflow convert-checkpoint: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        return _os_error("convert-checkpoint", exc)
    print(f"converted {summary['folder']}: {summary['parameters']} parameters' AdamW state, "
          f"{summary['weights_rewritten']} weights set to their fp32 masters; the ZenFlow state is kept in "
          f"{summary['backup']}")
    return 0


def add_reshard(sub: argparse._SubParsersAction, summary: str) -> None:
    p = sub.add_parser(
        "reshard-checkpoint",
        help=summary,
        allow_abbrev=False,
        description="Merge the ZenFlow optimizer files of CHECKPOINT (one per rank: "
        "zenflow_optimizer_rank{r}_of_{N}.pt, or the one-process optimizer.pt / optimizer.bin) and cut them again "
        "for --world-size ranks, so that a ZenFlowTrainer or ZenFlowPlugin run resumes on another number of GPUs. "
        "Each new rank then reads only its own file. "
        "The replaced files are kept with the suffix .before_reshard (.before_reshard.2, ... on later runs, so no "
        "earlier backup is overwritten); the new files are complete on disk before any old one is set aside. Runs "
        "on the host, one process.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("checkpoint", help="a checkpoint folder (Trainer checkpoint-N or accelerate save_state folder)")
    p.add_argument("--world-size", type=positive_int, required=True, help="the number of ranks that will resume")
    p.add_argument("--parallel", choices=["ddp", "fsdp2"], default=None,
                   help="how the new ranks share the state (default: as saved; ddp for a one-process checkpoint)")
    p.set_defaults(func=run_reshard)


def run_reshard(args: argparse.Namespace) -> int:
    folder = Path(args.checkpoint)
    # before torch is imported and anything is read: the folder, and a world size its weights can be split into
    if _refuse("reshard-checkpoint", missing_folder_message(folder) or world_size_problem(folder, args.world_size)):
        return 2
    from ..checkpoint.format import CheckpointError
    from .rank_checkpoint import reshard_checkpoint

    try:
        reshard_checkpoint(args.checkpoint, args.world_size, args.parallel)
    except (CheckpointError, ValueError) as exc:  # (ValueError: a world size the optimizer state cannot be cut into)
        print(f"hf-zenflow reshard-checkpoint: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        return _os_error("reshard-checkpoint", exc)
    return 0


__all__ = ["add_convert", "add_reshard", "run_convert", "run_reshard"]
