"""`ZenFlowTrainer` checkpoints are complete or ignored: the manifest written last, the resume picker that checks it,
the rotation that waits for it, and a plain `nn.Module` (column-major live weights) saved and resumed."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from hf_helpers import logged, tiny_llama, zenflow_args

from hf_zenflow import CheckpointError, ZenFlowTrainer
from hf_zenflow.hf import checkpoint_manifest
from hf_zenflow.hf import trainer as trainer_module
from hf_zenflow.hf.checkpoint_manifest import MANIFEST_NAME, manifest_problems


RESUME = dict(max_steps=6, zenflow_update_interval=2, save_strategy="steps", save_steps=3)


def run(tmp_path, train_dataset, name, resume=None, model=None, **overrides) -> ZenFlowTrainer:
    args = zenflow_args(tmp_path / name, **{**RESUME, **overrides})
    trainer = ZenFlowTrainer(model=model if model is not None else tiny_llama(), args=args,
                             train_dataset=train_dataset)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def weights(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


@pytest.fixture(scope="module")
def full(tmp_path_factory, train_dataset):
    """An uninterrupted 6-step run saving at steps 3 and 6, and its final weights and losses."""
    tmp = tmp_path_factory.mktemp("full")
    torch.set_num_threads(1)
    trainer = run(tmp, train_dataset, "run")
    return tmp / "run", logged(trainer), weights(trainer)


def test_every_checkpoint_has_a_manifest_of_its_files(full):
    out, _, _ = full
    for step in (3, 6):
        folder = out / f"checkpoint-{step}"
        manifest = json.loads((folder / MANIFEST_NAME).read_text())
        names = {p.name for p in folder.iterdir()} - {MANIFEST_NAME}
        assert set(manifest["files"]) == names
        assert {"trainer_state.json", "model.safetensors", "optimizer.pt", "rng_state.pth"} <= names
        assert all(e["size"] == (folder / rel).stat().st_size for rel, e in manifest["files"].items())
        assert manifest_problems(folder) == []
        assert not [p.name for p in folder.iterdir() if p.name.startswith(".")]  # no temporary names left


def _copy_run(full_out, to):
    shutil.copytree(full_out, to)
    return to


@pytest.mark.parametrize("damage", ["empty", "cut"])
@pytest.mark.parametrize("name", ["trainer_state.json", "model.safetensors", "scheduler.pt", "rng_state.pth",
                                  "config.json", "optimizer.pt"])
def test_resume_true_skips_a_newest_checkpoint_with_a_damaged_file(full, tmp_path, train_dataset, name, damage,
                                                                    caplog):
    """Regression: kill -9 right after trainer_state.json was created left it empty or cut; resume_from_checkpoint=
    True picked that folder and died with JSONDecodeError (SafetensorError, EOFError, OSError for the other files)
    at every restart. Repro: truncate a file of the newest checkpoint, resume_from_checkpoint=True."""
    out, losses, final = full
    copy = _copy_run(out, tmp_path / "run")
    target = copy / "checkpoint-6" / name
    data = target.read_bytes()
    target.write_bytes(b"" if damage == "empty" else data[: len(data) // 2])
    with caplog.at_level("WARNING", logger="hf_zenflow"):
        resumed = run(tmp_path, train_dataset, "run", resume=True)
    assert "checkpoint-6" in caplog.text and name in caplog.text and "resuming from" in caplog.text
    assert logged(resumed)[3:] == losses[3:]  # steps 4-6 trained again from checkpoint-3
    assert_same(weights(resumed), final)


def test_a_flipped_byte_in_the_newest_checkpoint_is_caught_by_the_hash(full, tmp_path, train_dataset, caplog):
    """A file of the right size with one byte changed (a damaged disk block): only the hash tells."""
    out, losses, final = full
    copy = _copy_run(out, tmp_path / "run")
    target = copy / "checkpoint-6" / "model.safetensors"
    data = bytearray(target.read_bytes())
    data[-5] ^= 0x40
    target.write_bytes(bytes(data))
    with caplog.at_level("WARNING", logger="hf_zenflow"):
        resumed = run(tmp_path, train_dataset, "run", resume=True)
    assert "model.safetensors differs from the manifest" in caplog.text
    assert_same(weights(resumed), final)


def test_a_newest_folder_without_its_manifest_is_skipped(full, tmp_path, train_dataset, caplog):
    """A save killed after its last file but before the manifest: the folder is not vouched for, and skipped."""
    out, losses, final = full
    copy = _copy_run(out, tmp_path / "run")
    (copy / "checkpoint-6" / MANIFEST_NAME).unlink()
    with caplog.at_level("WARNING", logger="hf_zenflow"):
        resumed = run(tmp_path, train_dataset, "run", resume=True)
    assert MANIFEST_NAME in caplog.text and "checkpoint-6" in caplog.text
    assert logged(resumed)[3:] == losses[3:]
    assert_same(weights(resumed), final)


def test_no_complete_checkpoint_is_one_clear_error(full, tmp_path, train_dataset):
    out, _, _ = full
    copy = _copy_run(out, tmp_path / "run")
    for step in (3, 6):
        (copy / f"checkpoint-{step}" / "trainer_state.json").write_bytes(b"")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        run(tmp_path, train_dataset, "run", resume=True)


def test_an_explicit_damaged_checkpoint_is_refused_naming_the_file(full, tmp_path, train_dataset):
    """Regression: a cut model.safetensors in the folder named by resume_from_checkpoint raised a bare
    SafetensorError."""
    out, _, _ = full
    copy = _copy_run(out, tmp_path / "run")
    target = copy / "checkpoint-3" / "model.safetensors"
    target.write_bytes(target.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"checkpoint-3.*model\.safetensors"):
        run(tmp_path, train_dataset, "other", resume=str(copy / "checkpoint-3"))


def test_a_first_checkpoint_interrupted_before_its_manifest_is_not_taken(full, tmp_path, train_dataset):
    """The first checkpoint of a run has no older one with a manifest: its in-progress mark tells that the save
    did not finish, though each file it holds is whole (under several ranks another rank's file may be missing)."""
    out, _, _ = full
    copy = tmp_path / "run"
    shutil.copytree(out / "checkpoint-3", copy / "checkpoint-3")
    (copy / "checkpoint-3" / MANIFEST_NAME).unlink()
    (copy / "checkpoint-3" / checkpoint_manifest.SAVING_MARKER).write_text("{}")
    with pytest.raises(CheckpointError, match="no complete checkpoint"):
        run(tmp_path, train_dataset, "run", resume=True)


def test_a_plain_trainer_checkpoint_without_manifest_still_resumes(full, tmp_path, train_dataset):
    """Folders of a plain Trainer (or of a run before manifests) have none: their files are checked one by one."""
    out, losses, final = full
    copy = _copy_run(out, tmp_path / "run")
    for step in (3, 6):
        (copy / f"checkpoint-{step}" / MANIFEST_NAME).unlink()
    (copy / "checkpoint-6" / "trainer_state.json").write_bytes(b"{")
    resumed = run(tmp_path, train_dataset, "run", resume=True)
    assert logged(resumed)[3:] == losses[3:]
    assert_same(weights(resumed), final)


def test_old_checkpoints_are_rotated_out_only_after_the_new_one_is_complete(tmp_path, train_dataset, monkeypatch):
    """Regression: with save_total_limit=1 the stock save deleted the previous checkpoint before the new one was
    complete: a save that failed (or was killed) at its end left no complete checkpoint at all."""
    calls = []

    def failing_manifest(folder):
        calls.append(str(folder))
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return checkpoint_manifest.finish_saving(folder)

    monkeypatch.setattr(trainer_module, "finish_saving", failing_manifest)
    with pytest.raises(OSError, match="No space left"):
        run(tmp_path, train_dataset, "run", save_total_limit=1)
    assert manifest_problems(tmp_path / "run" / "checkpoint-3") == []  # still there, complete
    monkeypatch.undo()
    resumed = run(tmp_path, train_dataset, "run", resume=True, save_total_limit=1)
    assert resumed.state.global_step == 6
    assert sorted(p.name for p in (tmp_path / "run").glob("checkpoint-*")) == ["checkpoint-6"]


class TwoBranches(torch.nn.Module):
    """Two branches of Linear layers chosen per batch: on a step that takes one branch the other's parameters have
    no gradient. Its matrices are big enough for the default `min_offload_numel`, so that they are offloaded and,
    with the default layout, column-major."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = torch.nn.Linear(8, 512)
        self.left = torch.nn.Linear(512, 512)
        self.right = torch.nn.Linear(512, 512)
        self.head = torch.nn.Linear(512, 1)

    def forward(self, x: torch.Tensor, branch: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        h = torch.tanh(self.embed(x))
        h = torch.tanh(self.left(h) if int(branch[0]) == 0 else self.right(h))
        return {"loss": torch.nn.functional.mse_loss(self.head(h).squeeze(-1), y)}


class BranchData(torch.utils.data.Dataset):
    def __init__(self, n: int = 48) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(n, 8, generator=g)
        self.y = torch.randn(n, generator=g)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        # batches of 4 in order: the branch changes every 3 batches (steps 1-3 left, 4-6 right, ...)
        return {"x": self.x[i], "branch": torch.tensor((i // 12) % 2), "y": self.y[i]}


def _plain_run(tmp_path, name, resume=None):
    from hf_zenflow import ZenFlowTrainingArguments

    args = ZenFlowTrainingArguments(
        output_dir=str(tmp_path / name), max_steps=10, per_device_train_batch_size=4, learning_rate=1e-3,
        save_strategy="steps", save_steps=5, report_to="none", use_cpu=True, dataloader_num_workers=0, seed=0,
        disable_tqdm=True, logging_steps=1, zenflow_cpu_threads=1)
    trainer = ZenFlowTrainer(model=TwoBranches(), args=args, train_dataset=BranchData())
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def test_a_plain_module_with_two_branches_saves_and_resumes_bit_identically(tmp_path):
    """Regression: with the default layout the live weights stay column-major, and the Trainer's save path for a
    model that is not a PreTrainedModel (safetensors.save_file) refused them: "ValueError: You are trying to save a
    non contiguous tensor". Repro: a plain nn.Module under ZenFlowTrainer with defaults and save_steps."""
    full = _plain_run(tmp_path, "full")
    assert not full.model.left.weight.is_contiguous()  # the default layout: column-major live weights
    saved = tmp_path / "full" / "checkpoint-5" / "model.safetensors"
    assert manifest_problems(saved.parent) == []
    resumed = _plain_run(tmp_path, "full", resume=str(saved.parent))
    assert logged(resumed)[5:] == logged(full)[5:]
    assert_same(weights(resumed), weights(full))
