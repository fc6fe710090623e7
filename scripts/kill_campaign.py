"""Kill campaign: `ZenFlowTrainer` checkpoints under ``kill -9``, in one process and in two DDP ranks (gloo, CPU).

For each setting, one uninterrupted run (the reference) and then N trials. A trial starts the same run, kills it with
SIGKILL (every process of the job: the ranks, then the launcher) at a chosen moment during its saves,
then starts it again with ``resume_from_checkpoint=True`` and lets it finish. Half the trials kill right after a
given file appears in a checkpoint folder (its k-th new name, temporary names included: the moments right after
each file of a save is created), the others at a random moment (a uniform delay after the s-th checkpoint folder
appears). Each trial checks that

- the resume picker chose the newest checkpoint that was complete when the job died (the newest folder whose
  manifest had been written: a manifest is written only after every file of its checkpoint is on disk), and
- the resumed run ends with weights bit-identical (`torch.equal`) to the reference's.

The runs are `tests/hf/hf_ddp_worker.py trainer` (a tiny Llama, ZenFlow with overlapped windows of 4 steps, a save
every 2 steps: most saves mid-window), launched under ``torchrun --nproc_per_node 1`` or ``2``.

    python scripts/kill_campaign.py --trials 20 --out /tmp/kill_campaign          # both settings; a JSON-lines log
    python scripts/kill_campaign.py --trials 2 --ranks 1                          # a quick look

Prints a table per setting; the figures go in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path


REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # this checkout's hf_zenflow, as the launched runs use
WORKER = REPO / "tests" / "hf" / "hf_ddp_worker.py"
LAUNCH_LIMIT_S = 600


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(out: Path, ranks: int, max_steps: int, save_steps: int, resume: bool) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")])))
    worker = [str(WORKER), "trainer", "--max-steps", str(max_steps), "--save-steps", str(save_steps), "--out",
              str(out), "--device", "cpu", *(["--resume", "newest"] if resume else [])]
    # (one process too under torchrun: the worker's arguments name the gloo backend, which needs the launcher's
    # environment; a world of one saves as one process does: optimizer.pt)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(ranks), "--master_addr",
           "127.0.0.1", "--master_port", str(free_port()), *worker]
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / f"launch_{int(time.time() * 1e3)}.log", "w")  # noqa: SIM115 - closed with the process
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def checkpoint_names(run_dir: Path) -> list[str]:
    """Every name in the run's checkpoint folders now (``checkpoint-N/name``)."""
    names = []
    try:
        folders = [e for e in os.scandir(run_dir) if e.name.startswith("checkpoint-") and e.is_dir()]
    except FileNotFoundError:
        return names
    for folder in folders:
        names.append(folder.name + "/")
        try:
            names += [f"{folder.name}/{e.name}" for e in os.scandir(folder.path)]
        except FileNotFoundError:
            pass
    return names


def kill_tree(pid: int) -> None:
    """SIGKILL the launcher `pid` and every process under it, the ranks first (torchrun starts each rank in a
    process group of its own (setsid): a signal to the launcher's process group does not reach them)."""
    import psutil

    try:
        procs = psutil.Process(pid).children(recursive=True) + [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=30)


def watch(proc: subprocess.Popen, run_dir: Path, kill_at_name: int | None = None,
          kill_at_folder: tuple[int, float] | None = None) -> dict:
    """Follow `proc`'s checkpoint folders (polled every 0.5 ms) until it ends, or SIGKILL its process group when the
    `kill_at_name`-th new name appears, or `kill_at_folder[1]` s after the `kill_at_folder[0]`-th folder does."""
    seen: list[str] = []
    known: set[str] = set()
    folder_times: list[float] = []
    killed = False
    start = time.monotonic()
    while proc.poll() is None:
        for name in checkpoint_names(run_dir):
            if name not in known:
                known.add(name)
                seen.append(name)
                if name.endswith("/"):
                    folder_times.append(time.monotonic())
        due = (kill_at_name is not None and len(seen) >= kill_at_name) or (
            kill_at_folder is not None and len(folder_times) >= kill_at_folder[0]
            and time.monotonic() - folder_times[kill_at_folder[0] - 1] >= kill_at_folder[1])
        if due:
            kill_tree(proc.pid)
            killed = True
            break
        if time.monotonic() - start > LAUNCH_LIMIT_S:
            kill_tree(proc.pid)
            raise TimeoutError(f"{run_dir}: the run took over {LAUNCH_LIMIT_S} s")
        time.sleep(0.0005)
    proc.wait()
    return {"names": seen, "killed": killed, "returncode": proc.returncode, "last": seen[-1] if seen else None}


def complete_folders(run_dir: Path) -> list[int]:
    """Steps of the checkpoint folders whose manifest is on disk."""
    from hf_zenflow.hf.checkpoint_manifest import MANIFEST_NAME

    return sorted(int(p.name.split("-")[1]) for p in run_dir.glob("checkpoint-*") if (p / MANIFEST_NAME).is_file())


def final_weights(out: Path):
    import torch

    return torch.load(out / "rank0.pt", weights_only=True)["weights"]


def same(a: dict, b: dict) -> bool:
    import torch

    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def campaign(ranks: int, trials: int, root: Path, max_steps: int, save_steps: int, seed: int, log) -> list[dict]:
    from hf_zenflow.hf.resume import newest_complete_checkpoint

    rng = random.Random(seed + ranks)
    ref_out = root / f"ranks{ranks}_reference"
    shutil.rmtree(ref_out, ignore_errors=True)
    reference = watch(launch(ref_out, ranks, max_steps, save_steps, resume=False), ref_out / "run")
    assert reference["returncode"] == 0, (ref_out, reference)
    ref_weights = final_weights(ref_out)
    total_names = len(reference["names"])
    saves = max_steps // save_steps
    rows = []
    for trial in range(trials):
        out = root / f"ranks{ranks}_trial{trial:02d}"
        shutil.rmtree(out, ignore_errors=True)
        if trial % 2 == 0:  # right after the k-th name appears, k spread over every name of every save
            # (the polls see fewer short-lived temporary names in some runs than in the reference: stay below its
            # count, so that the kill comes before the run ends)
            span = max(1, total_names * 9 // 10)
            kills = max(1, (trials + 1) // 2)
            k = 1 + (trial // 2) * span // kills + rng.randrange(max(1, span // kills))
            how = {"kind": "after file", "k": min(k, span)}
            killed = watch(launch(out, ranks, max_steps, save_steps, False), out / "run", kill_at_name=how["k"])
        else:  # a random moment: a uniform delay after the s-th checkpoint folder appears
            how = {"kind": "random", "save": rng.randint(1, saves), "delay_s": round(rng.uniform(0.0, 0.4), 3)}
            killed = watch(launch(out, ranks, max_steps, save_steps, False), out / "run",
                           kill_at_folder=(how["save"], how["delay_s"]))
        complete = complete_folders(out / "run")
        expected = max(complete) if complete else None
        chosen = newest_complete_checkpoint(str(out / "run"))
        chosen_step = int(Path(chosen).name.split("-")[1]) if chosen else None
        start = time.monotonic()
        resumed = watch(launch(out, ranks, max_steps, save_steps, resume=chosen is not None), out / "run")
        row = {"ranks": ranks, "trial": trial, **how, "killed": killed["killed"], "last_name": killed["last"],
               "names_at_kill": len(killed["names"]), "complete_at_kill": complete, "expected": expected,
               "chosen": chosen_step, "resume_rc": resumed["returncode"],
               "resume_s": round(time.monotonic() - start, 1)}
        row["identical"] = resumed["returncode"] == 0 and same(final_weights(out), ref_weights)
        row["ok"] = row["identical"] and chosen_step == expected and killed["killed"]
        rows.append(row)
        log.write(json.dumps(row) + "\n")
        log.flush()
        print(f"ranks {ranks} trial {trial:2d}: {how} killed after {row['last_name']} -> complete {complete}, "
              f"chose {chosen_step}, {'bit-identical' if row['identical'] else 'DIFFERENT'}"
              f"{'' if row['ok'] else '  <-- FAIL'}", flush=True)
        if row["ok"]:
            shutil.rmtree(out, ignore_errors=True)
    return rows


def table(rows: list[dict]) -> str:
    lines = ["| ranks | trials | killed right after a file | killed at a random moment | ended before its kill "
             "| no complete checkpoint yet | chose the newest complete | bit-identical to the uninterrupted run |",
             "|---|---|---|---|---|---|---|---|"]
    for ranks in sorted({r["ranks"] for r in rows}):
        mine = [r for r in rows if r["ranks"] == ranks]
        lines.append(f"| {ranks} | {len(mine)} | {sum(r['kind'] == 'after file' and r['killed'] for r in mine)} | "
                     f"{sum(r['kind'] == 'random' and r['killed'] for r in mine)} | "
                     f"{sum(not r['killed'] for r in mine)} | {sum(r['expected'] is None for r in mine)} | "
                     f"{sum(r['chosen'] == r['expected'] for r in mine)} / {len(mine)} | "
                     f"{sum(r['identical'] for r in mine)} / {len(mine)} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=20, help="kills per setting (default: %(default)s)")
    parser.add_argument("--ranks", type=int, nargs="+", default=[1, 2], help="settings (default: 1 2)")
    parser.add_argument("--max-steps", type=int, default=8)
    parser.add_argument("--save-steps", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="kill_campaign", help="work folder; the log is trials.jsonl there")
    opts = parser.parse_args()
    root = Path(opts.out).resolve()
    root.mkdir(parents=True, exist_ok=True)
    rows = []
    with open(root / "trials.jsonl", "a") as log:
        for ranks in opts.ranks:
            rows += campaign(ranks, opts.trials, root, opts.max_steps, opts.save_steps, opts.seed, log)
    print("\n" + table(rows))
    failed = [r for r in rows if not r["ok"]]
    print(f"\n{len(rows) - len(failed)} of {len(rows)} trials passed" + (f"; failed: {failed}" if failed else ""))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
