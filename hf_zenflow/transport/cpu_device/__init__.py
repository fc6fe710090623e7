"""The CPU as the "device": what makes ZenFlow fast when the device is this machine's CPU (tests, CI, `hf-zenflow
compare` here) and that a GPU does not need.

- `kernels` (C source in `csrc/`, compiled on first use, loaded with ctypes): gradient norms with the selected columns
  gathered in the same sweep, the batched scatter, the host accumulation reading bf16 directly. The core calls them
  through `kernels.supports` / `kernels.library`, with torch fallbacks that give the same bits.
- `transport.CpuDeviceTransport`: references and buffer swaps instead of copies (`hf_zenflow.transport`).

`column_major_` (DeepSpeed's transposed weight layout) lives in `hf_zenflow.engine.layout`: it reads the engine's
offload rule.
"""
