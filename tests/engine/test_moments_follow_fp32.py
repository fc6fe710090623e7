"""bf16 and 8-bit host moments, and bf16 window sums, follow fp32's over thousands of steps.

The synthetic: one 256x512 matrix, ``ZenFlowAdamW([w], lr=1e-3, weight_decay=0.0, min_offload_numel=0)``, gradients
``randn * 1.0`` for 1,000 steps, then ``* 0.1`` ("drop"); and a variant whose gradients fall further and grow back
("fall and rise": ``* 0.1`` to step 4,000, ``* 0.01`` to 6,000, ``* 1.0`` after). At every 1,000 steps up to 8,000,
each reduced-precision setting's moments (device columns on top of the host state, as `to_torch_adamw` reads them)
are compared with the same run's under fp32 host moments and sums:

- ``exp_avg_sq``: its mean within 3 % of fp32's, and the median of the elementwise ratio within 5 % of 1;
- ``exp_avg`` (signed, and about as often near zero as not, so that an elementwise ratio says nothing): the mean
  of ``|exp_avg|`` within 3 % and the median of the elementwise ratio of magnitudes within 5 % (the size of the
  numerator of every step), and the least-squares slope of ``exp_avg`` on fp32's ``exp_avg`` within 3 % of 1 (a
  momentum that shrinks, grows or turns away from fp32's direction shows there even where magnitudes agree).

Rounded to nearest after every update, bf16 ``exp_avg_sq`` ratchets upward once the gradients shrink, and 8-bit
moments sit under fp32's from the start: these tests fail on that arithmetic. The bf16 window sums are rounded to
nearest and pass: a sum starts afresh every window and each add moves it by about a window's share of itself, far
more than half a bf16 step, so there is nothing for the rounding to ratchet.

Speed: through the whole optimizer, whose per-step cost is its Python path, not this arithmetic, the 64,000 steps of
the two synthetics under four settings take minutes. The moments are driven here by `MomentsDriver` instead, which
runs the engine's own pieces on the optimizer's schedule for these settings: the device columns' fused AdamW on the
gathered columns, `HostMatrix.accumulate` and `host_adamw_window` for every window of 4 steps (the last gradient
folded in), and every 100 steps the re-selection of `reselection.select_columns` (`SplitMatrix.release_columns`,
`top_columns` of the gradient's column scores, the host's columns gathered, `install_columns`). The gradients do not
depend on the weights, so nothing else reaches the moments. `test_the_driver_is_the_optimizer_bit_for_bit` checks
that claim: 204 steps (three selections) through `ZenFlowAdamW` and through the driver give the same moments bit
for bit under every setting.
"""

from __future__ import annotations

import pytest
import torch

from hf_zenflow import to_torch_adamw
from hf_zenflow._base import fused_adamw_
from hf_zenflow.engine.host import HostLayout, host_adamw_window
from hf_zenflow.engine.selection import num_selected, top_columns
from hf_zenflow.engine.split_matrix import SplitMatrix
from hf_zenflow.settings.config import DEFAULT_SELECT_STEPS, ZenFlowConfig
from hf_zenflow.transport.cpu_device.rounding import matrix_key
from tests.conftest import DEVICE, zenflow_adamw, zenflow_config


pytestmark = pytest.mark.skipif(DEVICE.type != "cpu", reason="the CPU device's host passes")

SHAPE = (256, 512)
HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
WINDOW = ZenFlowConfig().update_interval  # (the default: 4)
SETTINGS = {
    "fp32": dict(host_moment_dtype="float32"),
    "bf16 moments": dict(host_moment_dtype="bfloat16"),
    "int8 moments": dict(host_moment_dtype="int8"),
    "bf16 sums": dict(host_moment_dtype="float32", host_sum_dtype="bfloat16"),
}
CHECK_EVERY, STEPS = 1000, 8000
VARIANTS = ("drop", "fall and rise")


def gradient_scale(step: int, variant: str) -> float:
    """The gradients' scale at `step` (1-based)."""
    if step <= 1000:
        return 1.0
    if variant == "drop" or step <= 4000:
        return 0.1
    return 0.01 if step <= 6000 else 1.0


class MomentsDriver:
    """One 256x512 matrix under ZenFlowAdamW's default schedule (10 % of the columns on the device, windows of 4
    steps, a re-selection every 100), through the engine's own pieces, for the moments only (see the module
    docstring). `seed`: the optimizer's rounding seed."""

    def __init__(self, settings: dict, seed: int) -> None:
        config = zenflow_config(**settings)
        self.split = SplitMatrix(torch.nn.Parameter(torch.zeros(SHAPE)), 0)
        self.split.k = num_selected(config.topk_ratio, self.split.columns)
        layout = HostLayout.of(config)
        self.attach = lambda splits: [s.attach_host("host", layout=layout,
                                                    stream=s.random_stream(matrix_key(seed, 0), s.share))
                                      for s in splits]
        self.steps, self.window_steps = 0, 0

    def step(self, grad: torch.Tensor) -> None:
        split = self.split
        if self.steps % DEFAULT_SELECT_STEPS == 0:  # (`reselection.reselect`: the open window closes first)
            if self.window_steps:
                host_adamw_window([(HYPER, [split.host])])
                self.window_steps = 0
            split.release_columns(self.attach)
            index = top_columns(split.local_scores(grad), split.k)
            host = split.host
            split.install_columns(index, [t.index_select(split.axis, index).float()
                                          for t in (host.master, host.exp_avg, host.exp_avg_sq)])
        cols = split.device
        fused_adamw_([cols.master], [cols.gather_grad(grad)], [cols.exp_avg], [cols.exp_avg_sq], [cols.step], HYPER)
        self.window_steps += 1
        if self.window_steps == WINDOW:
            host_adamw_window([(HYPER, [split.host])], last=[(split.host, grad)])
            self.window_steps = 0
        else:
            split.host.accumulate(grad, None)
        self.steps += 1

    def moments(self) -> tuple[torch.Tensor, torch.Tensor]:
        """exp_avg and exp_avg_sq of every column (the device's on top of the host's), at a window's end."""
        assert self.window_steps == 0
        _, m, v = self.split.full_state()
        return m, v


def test_the_driver_is_the_optimizer_bit_for_bit():
    steps = 2 * DEFAULT_SELECT_STEPS + WINDOW  # (the first selection and two re-selections, then a whole window)
    for name, settings in SETTINGS.items():
        w = torch.nn.Parameter(torch.zeros(SHAPE))
        opt = zenflow_adamw([w], lr=1e-3, weight_decay=0.0, min_offload_numel=0, cpu_threads=1, **settings)
        driver = MomentsDriver(settings, opt.host_windows.state()["rounding_seed"])
        gen = torch.Generator().manual_seed(1)
        for step in range(1, steps + 1):
            grad = torch.randn(SHAPE, generator=gen).mul_(gradient_scale(step, "drop"))
            w.grad = grad.clone()
            opt.step()
            driver.step(grad)
        opt.flush()
        state = to_torch_adamw(opt.state_dict(), weights=[w])[0]["state"][0]
        opt.close()
        assert opt.stats()["reselections"] == 3
        m, v = driver.moments()
        assert torch.equal(state["exp_avg"], m) and torch.equal(state["exp_avg_sq"], v), name


def moment_gaps(m: torch.Tensor, v: torch.Tensor, m_ref: torch.Tensor, v_ref: torch.Tensor) -> dict[str, float]:
    """How far `m`, `v` are from fp32's `m_ref`, `v_ref`: each statistic's relative distance from agreement."""
    return {
        "exp_avg_sq mean": float(v.mean() / v_ref.mean()) - 1,
        "exp_avg_sq median ratio": float((v / v_ref).median()) - 1,
        "|exp_avg| mean": float(m.abs().mean() / m_ref.abs().mean()) - 1,
        "|exp_avg| median ratio": float((m.abs() / m_ref.abs()).median()) - 1,
        "exp_avg slope": float((m * m_ref).sum() / (m_ref * m_ref).sum()) - 1,
    }


#: Each statistic's bar (`moment_gaps`).
BARS = {"exp_avg_sq mean": 0.03, "exp_avg_sq median ratio": 0.05, "|exp_avg| mean": 0.03,
        "|exp_avg| median ratio": 0.05, "exp_avg slope": 0.03}


def follow(steps: int = STEPS, every: int = CHECK_EVERY) -> dict[tuple[str, str], dict[int, dict[str, float]]]:
    """Every (variant, setting)'s `moment_gaps` from the variant's fp32 run at every `every` steps (the two
    variants in step, on one draw of gradients per step)."""
    drivers = {(variant, name): MomentsDriver(settings, seed=0) for variant in VARIANTS
               for name, settings in SETTINGS.items()}
    gaps: dict[tuple[str, str], dict[int, dict[str, float]]] = {key: {} for key in drivers if key[1] != "fp32"}
    gen = torch.Generator().manual_seed(1)
    for step in range(1, steps + 1):
        draw = torch.randn(SHAPE, generator=gen)
        grads = {variant: draw * gradient_scale(step, variant) for variant in VARIANTS}
        for (variant, _), driver in drivers.items():
            driver.step(grads[variant])
        if step % every == 0:
            for variant, name in gaps:
                m_ref, v_ref = drivers[variant, "fp32"].moments()
                gaps[variant, name][step] = moment_gaps(*drivers[variant, name].moments(), m_ref, v_ref)
    return gaps


@pytest.mark.slow
def test_reduced_precision_moments_follow_fp32_for_8000_steps():
    gaps = follow()
    failures = [f"{name}, {variant}, step {step}: {stat} {gap:+.3f} (bar {BARS[stat]:.2f})"
                for (variant, name), by_step in gaps.items() for step, stats in by_step.items()
                for stat, gap in stats.items() if abs(gap) > BARS[stat]]
    assert not failures, "\n".join(failures)
