"""`ZenFlowPlugin`: settings from HF_ZENFLOW_* env vars, optimizer construction, `prepare`, save/load_state
round-trip, fail-fast checks and the thread trap."""

from __future__ import annotations

import copy
import re
from types import SimpleNamespace

import pytest
import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType
from hf_helpers import ByteLMDataset, corpus_text, tiny_llama
from transformers import Trainer, TrainingArguments

from hf_zenflow import ZenFlowAdamW, ZenFlowConfig, ZenFlowPlugin
from hf_zenflow.hf.accelerate_plugin import ENV_PREFIX


ENV_NAMES = [f"{ENV_PREFIX}{name.upper()}" for name in (
    "topk_ratio", "update_interval", "select_strategy", "select_interval", "full_warm_up_rounds", "overlap_step",
    "auto_ratio", "cpu_threads")]


@pytest.fixture(autouse=True)
def clean_env(monkeypatch):
    for name in ENV_NAMES:
        monkeypatch.delenv(name, raising=False)


def test_defaults_without_env():
    assert ZenFlowPlugin().to_config() == ZenFlowConfig()


def test_settings_from_env(monkeypatch):
    monkeypatch.setenv("HF_ZENFLOW_TOPK_RATIO", "0.3")
    monkeypatch.setenv("HF_ZENFLOW_UPDATE_INTERVAL", "auto")
    monkeypatch.setenv("HF_ZENFLOW_OVERLAP_STEP", "false")
    monkeypatch.setenv("HF_ZENFLOW_CPU_THREADS", "2")
    monkeypatch.setenv("HF_ZENFLOW_SELECT_STRATEGY", "step")
    monkeypatch.setenv("HF_ZENFLOW_SELECT_INTERVAL", "25")
    monkeypatch.setenv("HF_ZENFLOW_FULL_WARM_UP_ROUNDS", "2")
    plugin = ZenFlowPlugin()
    assert plugin.to_config() == ZenFlowConfig(topk_ratio=0.3, update_interval="auto", overlap_step=False,
                                               cpu_threads=2, select_strategy="step", select_interval=25,
                                               full_warm_up_rounds=2)


def test_explicit_arguments_win_over_env(monkeypatch):
    monkeypatch.setenv("HF_ZENFLOW_TOPK_RATIO", "0.3")
    monkeypatch.setenv("HF_ZENFLOW_UPDATE_INTERVAL", "8")
    plugin = ZenFlowPlugin(topk_ratio=0.05)
    assert plugin.topk_ratio == 0.05 and plugin.to_config().update_interval == 8


@pytest.mark.parametrize(("name", "closest"), [("HF_ZENFLOW_UPDATE_INTERVALL", "HF_ZENFLOW_UPDATE_INTERVAL"),
                                               ("HF_ZENFLOW_XYZZY", None)])
def test_a_variable_under_the_prefix_that_names_no_setting_is_refused(monkeypatch, name, closest):
    """A misspelt or removed setting's variable fails at construction, naming itself, the closest setting's
    variable where one is close, and the variables allowed; the package's other variables pass."""
    monkeypatch.setenv("HF_ZENFLOW_HOST_WAIT_LIMIT_S", "60")
    monkeypatch.setenv("HF_ZENFLOW_NATIVE", "0")
    assert ZenFlowPlugin().to_config() == ZenFlowConfig()
    monkeypatch.setenv(name, "4")
    with pytest.raises(ValueError, match=f"^{name} is not a ZenFlow setting") as raised:
        ZenFlowPlugin()
    message = str(raised.value)
    assert "allowed are HF_ZENFLOW_" in message and "HF_ZENFLOW_TOPK_RATIO" in message
    assert (f"did you mean {closest}?" in message) if closest else ("did you mean" not in message)


def test_every_variable_the_project_reads_under_the_prefix_is_accepted(monkeypatch):
    """Each ``HF_ZENFLOW_*`` name in the package, the scripts and the test suite's conftest files, set at once: the
    plugin refuses none of them (a variable the project reads is never taken for a misspelt setting)."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    files = [*(root / "hf_zenflow").rglob("*.py"), *(root / "scripts").glob("*"), *(root / "tests").glob("*.py")]
    # (whole names: not a prefix such as the test suite's, followed by more of a name or a wildcard)
    name = re.compile(r"HF_ZENFLOW_[A-Z0-9_]*[A-Z0-9](?![A-Z0-9_<*])")
    names = {m for f in files if f.is_file() for m in name.findall(f.read_text())}
    assert {"HF_ZENFLOW_NATIVE", "HF_ZENFLOW_TEST_FREE_GRADIENTS", "HF_ZENFLOW_TOPK_RATIO"} <= names
    for variable in names:
        monkeypatch.setenv(variable, "")  # (an empty value is not read as a setting)
    ZenFlowPlugin()


@pytest.mark.parametrize(("name", "value"), [("HF_ZENFLOW_TOPK_RATIO", "lots"), ("HF_ZENFLOW_TOPK_RATIO", "3"),
                                             ("HF_ZENFLOW_UPDATE_INTERVAL", "0"), ("HF_ZENFLOW_OVERLAP_STEP", "maybe"),
                                             ("HF_ZENFLOW_CPU_THREADS", "two")])
def test_bad_env_values_name_the_variable(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        ZenFlowPlugin()


def test_bad_argument_names_the_field():
    with pytest.raises(ValueError, match="ZenFlowPlugin.topk_ratio"):
        ZenFlowPlugin(topk_ratio=2.0)


def test_create_optimizer_uses_the_trainers_groups(tmp_path):
    model = tiny_llama()
    opt = ZenFlowPlugin().create_optimizer(model, lr=1e-3, weight_decay=0.05)
    assert isinstance(opt, ZenFlowAdamW)
    decay_names = Trainer(model=model, args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True,
                                                              report_to="none")).get_decay_parameter_names(model)
    names = {id(p): n for n, p in model.named_parameters()}
    decay, no_decay = opt.param_groups
    assert decay["weight_decay"] == 0.05 and no_decay["weight_decay"] == 0.0
    assert {names[id(p)] for p in decay["params"]} == set(decay_names)
    assert {names[id(p)] for p in no_decay["params"]} == set(names.values()) - set(decay_names)
    # Parameters and groups are taken as given.
    linear = torch.nn.Linear(4, 4)
    assert len(ZenFlowPlugin().create_optimizer(linear.parameters()).param_groups) == 1


def test_fail_fast_on_unsupported_setups():
    plugin = ZenFlowPlugin()
    with pytest.raises(ValueError, match="DeepSpeed"):
        plugin.check_accelerator(SimpleNamespace(distributed_type=DistributedType.DEEPSPEED, mixed_precision="no"))
    # accelerate's FSDP1 is refused naming it and the setting to change; FSDP2 passes (test_plugin_fsdp.py trains it)
    with pytest.raises(ValueError, match=r"FSDP1 \(fsdp_version 1.*fsdp_version: 2"):
        plugin.check_accelerator(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=False,
                                                 mixed_precision="no"))
    plugin.check_accelerator(SimpleNamespace(distributed_type=DistributedType.FSDP, is_fsdp2=True,
                                             mixed_precision="no"))
    plugin.check_accelerator(SimpleNamespace(distributed_type=DistributedType.NO, mixed_precision="fp16"))
    plugin.check_accelerator(SimpleNamespace(distributed_type=DistributedType.NO, mixed_precision="bf16"))


def _loop(accelerator, model, optimizer, batches, max_grad_norm=1.0):
    losses = []
    for batch in batches:
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                optimizer.optimizer.clip_grad_norm_(max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _batches(n, start=0, batch_size=4):
    data = ByteLMDataset(corpus_text(), num_samples=(start + n) * batch_size)
    return [{k: torch.stack([data[i][k] for i in range(s * batch_size, (s + 1) * batch_size)]) for k in data[0]}
            for s in range(start, start + n)]


def test_prepare_and_steps_per_epoch():
    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=2)
    loader = torch.utils.data.DataLoader(ByteLMDataset(corpus_text(), num_samples=40), batch_size=4)
    model, optimizer, prepared_loader = ZenFlowPlugin(cpu_threads=1).prepare(accelerator, tiny_llama(), loader,
                                                                             lr=1e-3)
    opt = optimizer.optimizer
    assert isinstance(opt, ZenFlowAdamW)
    assert opt.steps_per_epoch == 5  # 10 batches / 2 accumulation steps
    assert len(prepared_loader) == 10
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}


def test_topk_1_loop_matches_torch_adamw():
    batches = _batches(8)
    accelerator = Accelerator(cpu=True)
    reference = tiny_llama()
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=3e-3, weight_decay=0.0)
    ref_losses = []
    for batch in batches:
        loss = reference(**batch).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        ref_losses.append(loss.item())
    model, optimizer = ZenFlowPlugin(topk_ratio=1.0, cpu_threads=1).prepare(accelerator, tiny_llama(), lr=3e-3,
                                                                            weight_decay=0.0)
    losses = _loop(accelerator, model, optimizer, batches)
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(ref_losses), rtol=1e-5, atol=0)


def test_save_state_load_state_round_trip(tmp_path, monkeypatch):
    """Save mid-window (overlap on), continue; a fresh process-like setup loads the state and continues identically."""
    batches = _batches(12)
    synced = []
    original = ZenFlowAdamW.synchronize

    def spy(self):
        synced.append(self)
        return original(self)

    monkeypatch.setattr(ZenFlowAdamW, "synchronize", spy)
    plugin = ZenFlowPlugin(topk_ratio=0.1, update_interval=4, overlap_step=True, cpu_threads=1)

    accelerator = Accelerator(cpu=True)
    model, optimizer = plugin.prepare(accelerator, tiny_llama(), lr=3e-3)
    _loop(accelerator, model, optimizer, batches[:6])  # window 2 (steps 5-8) is open
    synced.clear()
    accelerator.save_state(str(tmp_path / "state"))
    assert synced  # the pre-hook (and state_dict) waited for the host worker
    continued = _loop(accelerator, model, optimizer, batches[6:])
    ZenFlowPlugin.flush(optimizer)
    final = copy.deepcopy(accelerator.unwrap_model(model).state_dict())

    accelerator2 = Accelerator(cpu=True)
    model2, optimizer2 = plugin.prepare(accelerator2, tiny_llama(seed=99), lr=3e-3)  # different init: overwritten
    accelerator2.load_state(str(tmp_path / "state"))
    resumed = _loop(accelerator2, model2, optimizer2, batches[6:])
    ZenFlowPlugin.flush(optimizer2)
    assert resumed == continued  # bit for bit
    for name, value in accelerator2.unwrap_model(model2).state_dict().items():
        assert torch.equal(value, final[name]), name


def test_thread_trap_worker_keeps_its_threads():
    """The training thread at 1 thread (what OMP_NUM_THREADS=1 gives) does not limit the host worker."""
    assert torch.get_num_threads() == 1  # conftest: the training thread runs single-threaded
    accelerator = Accelerator(cpu=True)
    # (min_offload_numel=0: the tiny model's matrices are offloaded; with nothing offloaded no worker would start)
    model, optimizer = ZenFlowPlugin(cpu_threads=2, overlap_step=True, min_offload_numel=0).prepare(accelerator,
                                                                                                   tiny_llama())
    _loop(accelerator, model, optimizer, _batches(1))
    report = ZenFlowPlugin.thread_report(optimizer)
    assert report["training_threads"] == 1
    assert report["zenflow_cpu_threads"] == 2
    assert report["host_worker_threads"] == 2
    assert torch.get_num_threads() == 1  # and the worker's setting did not leak into the training thread
    optimizer.optimizer.close()


def test_flush_at_the_end_of_a_loop_leaves_no_host_thread():
    accelerator = Accelerator(cpu=True)
    model, optimizer = ZenFlowPlugin(update_interval=2, overlap_step=True, cpu_threads=1, min_offload_numel=0).prepare(
        accelerator, tiny_llama(), lr=1e-3)
    _loop(accelerator, model, optimizer, _batches(3))
    thread = optimizer.optimizer.host_windows.worker._thread
    assert thread.is_alive()
    ZenFlowPlugin.flush(optimizer)
    assert not thread.is_alive()
    _loop(accelerator, model, optimizer, _batches(1, start=3))  # training on starts a new worker
    assert optimizer.optimizer.host_windows.worker._thread.is_alive()
    ZenFlowPlugin.flush(optimizer)
    assert optimizer.optimizer.host_windows.worker is None
