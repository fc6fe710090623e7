"""Switching optimizers across a resume under the Trainer (issue 10.5) and a damaged optimizer file (10.6)."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import logged, tiny_llama, zenflow_args
from safetensors.torch import load_file as load_weights
from transformers import Trainer

from hf_zenflow import CheckpointError, ZenFlowTrainer, to_torch_adamw
from hf_zenflow.cli import main
from hf_zenflow.hf.convert import saved_weights


#: ZenFlow settings under which it is exactly AdamW (fp32 host moments), so that a switch can be compared with an
#: uninterrupted run
EXACT = dict(zenflow_topk_ratio=0.1, zenflow_update_interval=1, zenflow_overlap_step=False,
             zenflow_host_state="fp32")
COMMON = dict(max_steps=10, save_strategy="steps", save_steps=6, weight_decay=0.01)


def plain(tmp_path, train_dataset, name: str, resume=None) -> Trainer:
    trainer = Trainer(model=tiny_llama(), args=zenflow_args(tmp_path / name, zenflow=False, **COMMON),
                      train_dataset=train_dataset)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def zenflow(tmp_path, train_dataset, name: str, resume=None, **settings) -> ZenFlowTrainer:
    trainer = ZenFlowTrainer(model=tiny_llama(), args=zenflow_args(tmp_path / name, **{**COMMON, **settings}),
                             train_dataset=train_dataset)
    trainer.train(resume_from_checkpoint=resume)
    return trainer


def assert_same_run(resumed, reference) -> None:
    # (the first 6 logged steps come from the checkpoint's trainer state)
    assert logged(resumed)[6:] == pytest.approx(logged(reference)[6:], rel=1e-5)
    for (name, p), q in zip(resumed.model.named_parameters(), reference.model.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-4, atol=1e-6, msg=name)


def test_plain_trainer_checkpoint_resumes_under_zenflow_trainer(tmp_path, train_dataset):
    """Regression (issue 10.5): ZenFlowTrainer resumed a plain Trainer (adamw_torch) checkpoint by silently dropping
    the AdamW moments and restarting the step count."""
    reference = plain(tmp_path, train_dataset, "plain")
    resumed = zenflow(tmp_path, train_dataset, "switched", resume=str(tmp_path / "plain" / "checkpoint-6"), **EXACT)
    assert resumed.zenflow_optimizer.stats()["selected_fraction"] < 0.5  # the host path really is in use
    assert_same_run(resumed, reference)


def test_converted_zenflow_checkpoint_resumes_under_plain_trainer(tmp_path, train_dataset, capsys):
    """Regression (issue 10.5): a plain Trainer resuming a ZenFlow checkpoint failed with a bare `KeyError: 'step'`
    inside torch; `hf-zenflow convert-checkpoint` turns the folder into one it resumes exactly."""
    reference = plain(tmp_path, train_dataset, "plain")
    zenflow(tmp_path, train_dataset, "zen", **EXACT)
    checkpoint = tmp_path / "zen" / "checkpoint-6"
    assert main(["convert-checkpoint", str(checkpoint)]) == 0
    assert "optimizer.zenflow.pt" in capsys.readouterr().out
    resumed = plain(tmp_path, train_dataset, "resumed", resume=str(checkpoint))
    assert_same_run(resumed, reference)
    assert main(["convert-checkpoint", str(checkpoint)]) == 2  # already converted: says so, changes nothing


def test_conversion_writes_the_masters_into_the_weights(tmp_path, train_dataset):
    """With overlap the saved weights lag the masters (a pending host result): the converted folder's weights are
    the masters."""
    # library defaults: U=4, overlap; saved when the first window closes, its host result not yet written back
    zenflow(tmp_path, train_dataset, "zen", max_steps=4, save_steps=4)
    checkpoint = tmp_path / "zen" / "checkpoint-4"
    state = torch.load(checkpoint / "optimizer.pt", weights_only=True)
    _, masters = to_torch_adamw(state, weights=saved_weights(checkpoint, state))
    out = tmp_path / "converted"
    assert main(["convert-checkpoint", str(checkpoint), "--output-dir", str(out)]) == 0
    weights = load_weights(str(out / "model.safetensors"))
    before = load_weights(str(checkpoint / "model.safetensors"))
    differed = 0
    for index, master in masters.items():
        name = state["state"][index]["name"]
        assert torch.equal(weights[name], master.view(weights[name].shape)), name
        differed += not torch.equal(before[name], weights[name])
    assert differed > 0  # the saved weights really lagged


def test_an_empty_optimizer_file_names_the_file(tmp_path, train_dataset):
    """Regression (issue 10.6): resuming with an empty optimizer.pt raised a bare `EOFError`."""
    zenflow(tmp_path, train_dataset, "zen", max_steps=6, save_steps=6)
    checkpoint = tmp_path / "zen" / "checkpoint-6"
    (checkpoint / "optimizer.pt").write_bytes(b"")
    # (refused before loading by the checkpoint's manifest, naming the file and its size)
    with pytest.raises(CheckpointError, match=r"checkpoint-6.*optimizer\.pt has 0 bytes"):
        zenflow(tmp_path, train_dataset, "again", max_steps=8, resume=str(checkpoint))


def test_a_conversion_that_fails_midway_leaves_the_checkpoint_as_it_was(tmp_path, train_dataset, monkeypatch,
                                                                        capsys):
    """Regression: convert-checkpoint rewrote model.safetensors in place with no backup: a crash or ENOSPC after the
    weights were written left them changed (or cut), and a re-run failed. Repro: fail the write of the new
    optimizer.pt (after the weights)."""
    zenflow(tmp_path, train_dataset, "zen", max_steps=4, save_steps=4)
    checkpoint = tmp_path / "zen" / "checkpoint-4"
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}

    def full_disk(obj, f, *args, **kwargs):
        raise OSError(28, "No space left on device", str(getattr(f, "name", f)))

    monkeypatch.setattr(torch, "save", full_disk)  # the new optimizer.pt, written after the weights
    assert main(["convert-checkpoint", str(checkpoint)]) == 2
    assert "No space left on device" in capsys.readouterr().err
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == before
    assert sorted(p.name for p in checkpoint.parent.iterdir()) == sorted(
        p.name for p in checkpoint.parent.iterdir() if not p.name.startswith("."))  # no staging folder left
    monkeypatch.undo()
    assert main(["convert-checkpoint", str(checkpoint)]) == 0  # the re-run converts it
    assert (checkpoint / "optimizer.zenflow.pt").read_bytes() == before["optimizer.pt"]
    from hf_zenflow.hf.checkpoint_manifest import manifest_problems

    assert manifest_problems(checkpoint) == []  # the converted folder is vouched for anew


def test_convert_refuses_bad_inputs_before_copying(tmp_path, capsys):
    """Regression: --output-dir on an unwritable path raised a bare OSError; a checkpoint with rank files only said
    "no such optimizer checkpoint file" and left the copy behind."""
    checkpoint = tmp_path / "checkpoint-6"
    checkpoint.mkdir()
    for rank in range(2):
        (checkpoint / f"zenflow_optimizer_rank{rank}_of_2.pt").write_bytes(b"x")
    (tmp_path / "afile").write_text("")
    assert main(["convert-checkpoint", str(checkpoint), "--output-dir", str(tmp_path / "copy")]) == 2
    assert "reshard-checkpoint" in capsys.readouterr().err
    assert main(["convert-checkpoint", str(checkpoint), "--output-dir", str(tmp_path / "afile" / "copy")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    (checkpoint / "optimizer.pt").write_bytes(b"x")
    assert main(["convert-checkpoint", str(checkpoint), "--output-dir", str(tmp_path / "afile" / "copy")]) == 2
    assert "afile" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "checkpoint-6"]


@pytest.mark.parametrize("inside", ["sub", "a/b", "link/sub", "."])
def test_convert_refuses_an_output_dir_inside_the_checkpoint(tmp_path, capsys, inside):
    """Regression: `convert-checkpoint CKPT --output-dir CKPT/sub` wrote the converted copy inside the checkpoint it
    converted. Refused in one line naming both folders (through a symbolic link too), before anything is written."""
    checkpoint = tmp_path / "checkpoint-6"
    checkpoint.mkdir()
    (checkpoint / "optimizer.pt").write_bytes(b"x")  # (the paths are checked before the file is read)
    (tmp_path / "link").symlink_to(checkpoint)
    output = tmp_path / inside if inside.startswith("link") else checkpoint / inside
    assert main(["convert-checkpoint", str(checkpoint), "--output-dir", str(output)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--output-dir {output} is inside the checkpoint {checkpoint}" in err, err
    assert [p.name for p in checkpoint.iterdir()] == ["optimizer.pt"]


def test_reshard_of_a_converted_checkpoint_says_what_its_optimizer_file_is(tmp_path, train_dataset, capsys):
    """Regression: `reshard-checkpoint` on the output of `convert-checkpoint` called its (valid) torch.optim.AdamW
    state "damaged". It says what the file is and what to do instead, in one line, and changes nothing."""
    zenflow(tmp_path, train_dataset, "zen", max_steps=4, save_steps=4)
    checkpoint = tmp_path / "zen" / "checkpoint-4"
    assert main(["convert-checkpoint", str(checkpoint)]) == 0
    before = {p.name: p.read_bytes() for p in checkpoint.iterdir()}
    capsys.readouterr()
    assert main(["reshard-checkpoint", str(checkpoint), "--world-size", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "is a torch.optim.AdamW state dict" in err and "nothing to re-shard" in err, err
    assert "damaged" not in err
    assert {p.name: p.read_bytes() for p in checkpoint.iterdir()} == before
