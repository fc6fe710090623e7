"""The parts of a ZenFlow step, which `hf_zenflow.optimizer.ZenFlowAdamW` orchestrates.

- the device path: `device_state.py` (selected columns and dense state, fp32; column gather/scatter) and
  `device_step.py` (the fused AdamW on them every step); reading each gradient as backward produces it:
  `gradients.py`;
- the host path: `host.py` (`HostMatrix`: host state, window accumulation, the window's AdamW in one pass),
  `quantized_moments.py` (8-bit host moments, ``host_moment_dtype="int8"``), `worker.py` (`HostAdamWorker`, the
  background thread, its life: `WorkerKeeper`, and `bounded_wait`);
- between them: `backward.py` (`BackwardHandOff`: a gradient from its backward hook to the step's hand-off, its copy
  to the host started in backward or the gradient freed there, and what a GradScaler sees of them); `windows.py`
  (`HostWindows`: the windows' state, the host state attached, the window's close and its result written back
  ``writeback_lag`` steps later); `accumulation.py` (host or device window sums), `host_lr.py` (the host step's
  learning-rate multiplier), `host_guard.py` (`host_step_guard`);
- the schedule, decisions without tensors: `schedule.py` (step kinds, windows, Zen-auto votes), `step_plan.py`
  (`StepPlan`: those decisions for one step, which `_step` follows), `writeback_lag.py` ("auto"'s choice from the
  host columns' sizes), `run_start.py` (what a run decides and logs once, at its first step);
- one matrix's two sides and its columns: `split_matrix.py`, `selection.py`, `reselection.py`; the optimizer's
  arguments made into state: `params.py`, the run's schedule and the first step's state made in its backward
  hooks: `state_maker.py`; the optimizer's state in one object, which the checkpoint code saves and restores:
  `engine_state.py`; weights changed from outside: `weight_marks.py`; the storage layout:
  `layout.py` (`column_major_`); AMP: `amp.py` (the GradScaler wraps); per-step telemetry: `telemetry.py`; what
  the hooks and `step()` refuse to run under (compiled autograd, CUDA graphs): `graph_guard.py`.

May import: `distributed`, `transport`, `settings`, `hf_zenflow._base`. Not `checkpoint` or `optimizer` (above it).
"""
