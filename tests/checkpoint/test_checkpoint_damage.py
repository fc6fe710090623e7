"""Damaged or foreign optimizer states (issue 22): every refusal is a `CheckpointError` and changes nothing (the
optimizer's `state_dict()` is bit-identical to before the call); the checksums cover the non-tensor fields and
their own presence; random byte flips in ``data.pkl`` never load a different state silently."""

from __future__ import annotations

import copy
import io
import random
import zipfile
from typing import Any

import pytest
import torch

from hf_zenflow import CheckpointError, ZenFlowAdamW
from hf_zenflow.checkpoint.format import load_file
from hf_zenflow.checkpoint.seal import seal
from tests.conftest import batches, make_model, param_groups, roundtrip, train, zenflow_adamw


LR = 1e-2
SETTINGS = dict(topk_ratio=0.1, update_interval="auto", auto_max_interval=5, writeback_lag="auto",
                min_offload_numel=0)


def _trained(steps: int = 6, seed: int = 0) -> tuple[torch.nn.Module, ZenFlowAdamW]:
    model = make_model(seed)
    opt = zenflow_adamw(param_groups(model), lr=LR, **SETTINGS)
    opt.name_parameters(model)
    train(model, opt, batches(steps, seed=seed + 1))
    return model, opt


@pytest.fixture(scope="module")
def saved() -> dict[str, Any]:
    _, opt = _trained()
    state = roundtrip(opt.state_dict())
    opt.close()
    return state


@pytest.fixture
def target():
    """An optimizer with a state of its own (another run), so that a half-done load would show."""
    _, opt = _trained(steps=3, seed=5)
    yield opt
    opt.close()


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dtype == b.dtype
                and a.shape == b.shape and torch.equal(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _refused_and_unchanged(opt: ZenFlowAdamW, state: dict[str, Any], match: str) -> None:
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(CheckpointError, match=match):
        opt.load_state_dict(state)
    assert same(opt.state_dict(), before)


def _split_entry(state: dict[str, Any]) -> dict[str, Any]:
    return next(e for e in state["state"].values() if e["kind"] == "split" and "host_master" in e)


# ---- a missing key, a wrong type, an out-of-range value, a removed checksum ----------------------------------------
@pytest.mark.parametrize("where, key", [("entry", "auto"), ("entry", "k"), ("entry", "host_step"),
                                        ("entry", "accum_count"), ("zenflow", "window_steps"),
                                        ("zenflow", "unapplied_steps"), ("group", "betas")])
@pytest.mark.parametrize("resealed", [False, True])
def test_a_missing_key_is_refused_and_changes_nothing(saved, target, where, key, resealed):
    """Regression: a key missing from an entry and its checksums raised a bare KeyError from `_restore_split` after
    79 entries were overwritten."""
    state = copy.deepcopy(saved)
    holder = {"entry": _split_entry(state), "zenflow": state["zenflow"], "group": state["param_groups"][0]}[where]
    del holder[key]
    if where == "entry":
        holder["checksums"].pop(key, None)
    if resealed:  # the checksums agree: the schema itself must refuse it
        seal(state)
    _refused_and_unchanged(target, state, key)


@pytest.mark.parametrize("where, key, value", [
    ("entry", "accum_count", "2"), ("entry", "k", 2.5), ("entry", "auto", "x"), ("entry", "rows", 1),
    ("zenflow", "steps", 6.0), ("zenflow", "force_select", "yes"), ("zenflow", "writeback_lag_pending", None),
    ("zenflow", "unapplied_steps", 3), ("group", "betas", "0.9"), ("group", "lr", "1e-2"),
])
def test_a_wrong_typed_field_is_refused_and_changes_nothing(saved, target, where, key, value):
    state = copy.deepcopy(saved)
    holder = {"entry": _split_entry(state), "zenflow": state["zenflow"], "group": state["param_groups"][0]}[where]
    holder[key] = value
    seal(state)
    _refused_and_unchanged(target, state, key)


@pytest.mark.parametrize("where, key, value", [
    ("entry", "accum_count", -1), ("entry", "accum_count", 10**6), ("entry", "k", 10**6),
    ("entry", "auto", [float("nan"), 0.0, 1.0]), ("entry", "auto", [1.0, -2.0, 1.0]), ("entry", "axis", 3),
    ("zenflow", "steps", -1), ("zenflow", "window_steps", 10**6), ("zenflow", "writeback_lag", 0),
    ("zenflow", "skipped_steps", -3), ("zenflow", "unapplied_steps", [-1]),
    ("group", "betas", (1.5, 0.999)), ("group", "lr", -1.0), ("group", "eps", -1e-8),
    ("group", "weight_decay", float("nan")),
])
def test_an_out_of_range_field_is_refused_and_changes_nothing(saved, target, where, key, value):
    state = copy.deepcopy(saved)
    holder = {"entry": _split_entry(state), "zenflow": state["zenflow"], "group": state["param_groups"][0]}[where]
    holder[key] = value
    seal(state)
    _refused_and_unchanged(target, state, key)


@pytest.mark.parametrize("where, key, value", [
    ("entry", "accum_count", 3), ("zenflow", "steps", 1000), ("zenflow", "window_steps", lambda n: (n + 1) % 3),
    ("group", "lr", 0.5), ("group", "betas", (0.8, 0.99)), ("zenflow", "force_select", True),
])
def test_an_edited_non_tensor_field_fails_its_checksum(saved, target, where, key, value):
    """Regression: accum_count 2->7, steps->1e6, lr, betas ... loaded silently (only tensors were checksummed)."""
    state = copy.deepcopy(saved)
    holder = {"entry": _split_entry(state), "zenflow": state["zenflow"], "group": state["param_groups"][0]}[where]
    value = value(holder[key]) if callable(value) else value  # (window_steps: where the saved run stopped varies)
    assert holder[key] != value
    holder[key] = value
    _refused_and_unchanged(target, state, "checksum")


@pytest.mark.parametrize("where", ["entry", "zenflow"])
def test_a_removed_checksum_entry_is_refused(saved, target, where):
    """Regression: with the ``checksums`` entry deleted, scaled masters loaded."""
    state = copy.deepcopy(saved)
    if where == "entry":
        entry = _split_entry(state)
        entry["host_master"] = entry["host_master"] * 2
        del entry["checksums"]
    else:
        state["zenflow"]["steps"] += 1
        del state["zenflow"]["checksum"]
    _refused_and_unchanged(target, state, "checksum")


def test_a_saved_parameter_name_that_differs_is_refused_naming_both(saved, target):
    """Regression: saved names were never compared: two same-shape layers swapped loaded silently."""
    state = copy.deepcopy(saved)
    entries = state["state"]
    first, second = sorted(entries, key=int)[:2]
    entries[first]["name"], entries[second]["name"] = entries[second]["name"], entries[first]["name"]
    seal(state)
    names = (saved["state"][first]["name"], saved["state"][second]["name"])
    _refused_and_unchanged(target, state, rf"{names[1]}.*{names[0]}|{names[0]}.*{names[1]}")


# ---- older formats ----------------------------------------------------------------------------------------------
def test_format_3_checksums_claimed_by_an_older_version_are_refused(saved, target):
    """A flipped format_version must not switch the new checks off."""
    state = copy.deepcopy(saved)
    state["zenflow"]["format_version"] = 2
    _refused_and_unchanged(target, state, "format_version")


# ---- random byte flips in data.pkl -------------------------------------------------------------------------------
def _flip_in_data_pkl(raw: bytes, rng: random.Random) -> bytes:
    with zipfile.ZipFile(io.BytesIO(raw)) as z:
        info = next(i for i in z.infolist() if i.filename.endswith("data.pkl"))
    start = info.header_offset + 30 + int.from_bytes(raw[info.header_offset + 26:info.header_offset + 28], "little") \
        + int.from_bytes(raw[info.header_offset + 28:info.header_offset + 30], "little")
    at = start + rng.randrange(info.file_size)
    out = bytearray(raw)
    out[at] ^= rng.randrange(1, 256)
    return bytes(out)


def test_random_byte_flips_in_data_pkl_never_load_a_different_state(saved, tmp_path):
    """Regression: 4 of 60 single-byte flips inside data.pkl loaded a different state silently."""
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    raw = buffer.getvalue()
    reference = zenflow_adamw(param_groups(make_model()), lr=LR, **SETTINGS)
    reference.load_state_dict(saved)
    expected = copy.deepcopy(reference.state_dict())
    reference.close()
    rng = random.Random(22)
    outcomes = {"refused": 0, "equal": 0}
    for trial in range(60):
        path = tmp_path / f"optimizer{trial}.pt"
        path.write_bytes(_flip_in_data_pkl(raw, rng))
        opt = zenflow_adamw(param_groups(make_model()), lr=LR, **SETTINGS)
        try:
            opt.load_state_dict(load_file(path))
        except CheckpointError:
            outcomes["refused"] += 1
        else:
            assert same(opt.state_dict(), expected), f"flip {trial} loaded a different state"
            outcomes["equal"] += 1
        finally:
            opt.close()
    assert outcomes["refused"] > 0


@pytest.mark.parametrize("n", [8, 300])  # one weight per element below 65536 elements, per 64-element block above
def test_the_tensor_digest_changes_when_values_move(n):
    """A plain sum of the bits keeps its value when a flipped stride transposes a square tensor or a shifted offset
    rotates it; the digest does not."""
    from hf_zenflow.checkpoint.seal import tensor_digest

    x = torch.randn(n, n, generator=torch.Generator().manual_seed(n))
    plain_sum = lambda t: int(t.contiguous().view(torch.int32).sum(dtype=torch.int64))  # noqa: E731
    assert plain_sum(x.t()) == plain_sum(x)  # the blind spot of a plain sum
    assert tensor_digest(x.t()) != tensor_digest(x)
    assert tensor_digest(x.roll(1)) != tensor_digest(x)
    assert tensor_digest(x.clone()) == tensor_digest(x)


def test_a_state_of_another_model_with_the_same_shapes_is_refused_and_wrapper_prefixes_are_not(saved):
    """Regression: a same-shape state of another model loaded silently (saved names were never compared)."""

    class Renamed(torch.nn.Module):  # the same shapes as TinyNet under other names
        def __init__(self) -> None:
            super().__init__()
            tiny = make_model()
            self.emb, self.w1, self.ln, self.w2 = tiny.embed, tiny.up, tiny.norm, tiny.down

    other = Renamed()
    opt = zenflow_adamw(param_groups(other), lr=LR, **SETTINGS)
    opt.name_parameters(other)
    _refused_and_unchanged(opt, saved, r"saved for parameter 'embed.weight'.*'emb.weight'")
    opt.close()
    wrapped = torch.nn.Module()
    wrapped.module = make_model()  # (DDP's "module." prefix: the same parameters)
    opt = zenflow_adamw(param_groups(wrapped.module), lr=LR, **SETTINGS)
    opt.name_parameters(wrapped)
    opt.load_state_dict(saved)
    opt.close()


def test_a_checkpoint_holding_a_removed_setting_is_refused_naming_it(saved, target):
    """A state written while `host_grad_dtype` was a setting: one message names it and says that it no longer
    exists here (not a list of every field allowed)."""
    state = copy.deepcopy(saved)
    state["zenflow"]["config"]["host_grad_dtype"] = "auto"
    seal(state)
    _refused_and_unchanged(target, state, r"written by an earlier version of hf_zenflow: its setting host_grad_dtype "
                                          r"no longer exists in this version, so it cannot be loaded")
