"""Optional C kernels for the device path when the device is the CPU (`csrc/zenflow_cpu.c`).

On a CPU device the selected-column gather and scatter are strided sweeps over whole matrices (10% of the columns
touch ~80% of the cache lines). The kernels fold the gather into the gradient-norm pass that happens anyway, batch
the scatter, read bf16 gradients directly in the host accumulation, and run on the caller's intra-op thread count.
(With column-major weights, `hf_zenflow.engine.layout`, columns are contiguous rows and torch moves them as fast.)
Every result is exact (copies; bf16 rounds to nearest even as torch does), except the norms, which are summed in fp64
and serve the non-finite check and Zen-auto only (clipping always uses torch's own norms); the host AdamW pass rounds
bf16 and 8-bit moments stochastically, with the reproducible random bits of `rounding.py`, as its torch fallback does.

The source is compiled with the system C compiler on first use and cached under ``$HF_ZENFLOW_CACHE`` (default
``~/.cache/hf_zenflow``), keyed by source, flags and CPU. Without a compiler, or with ``HF_ZENFLOW_NATIVE=0``, the
optimizer uses torch operations instead (same results, slower); `status()` says which.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import warnings
from pathlib import Path

import torch

from .rounding import RandomStream, random16, round_bf16


_SOURCE = Path(__file__).with_name("csrc") / "zenflow_cpu.c"
# no contraction: zf_window_adamw rounds every product as torch's AdamW does (the other kernels' fmas are explicit,
# and their fp64 sums of fp32 squares are exact products either way); no errno: sqrtf vectorises
_FLAGS = ["-O3", "-march=native", "-fopenmp-simd", "-ffp-contract=off", "-fno-math-errno", "-shared", "-fPIC"]
_NORM_GATHER, _SCATTER, _ACCUMULATE = 0, 1, 3
_KINDS = (torch.float32, torch.bfloat16)

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_state = "not loaded"


def _disabled() -> bool:
    return os.environ.get("HF_ZENFLOW_NATIVE", "").strip().lower() in ("0", "false", "no", "off")


def _cpu_signature() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return os.uname().machine
    keep = [line for line in text.splitlines() if line.startswith(("model name", "flags"))][:2]
    return "\n".join(keep)


def _cache_dir() -> Path:
    if os.environ.get("HF_ZENFLOW_CACHE"):
        return Path(os.environ["HF_ZENFLOW_CACHE"])
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "hf_zenflow"


def _build() -> ctypes.CDLL:
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if compiler is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    source = _SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join([compiler, *_FLAGS]).encode() + _cpu_signature().encode()).hexdigest()
    target = _cache_dir() / f"zenflow_cpu_{key[:16]}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        # compile to a private name, then rename: concurrent processes (accelerate launch) never load a partial file
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
        os.close(fd)
        try:
            result = subprocess.run([compiler, *_FLAGS, str(_SOURCE), "-o", tmp, "-lpthread", "-lm"],
                                    capture_output=True, text=True, timeout=120)
            if result.returncode != 0:
                raise RuntimeError(f"{compiler} failed: {result.stderr.strip()[:2000]}")
            os.replace(tmp, target)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    lib = ctypes.CDLL(str(target))
    p = ctypes.c_void_p
    lib.zf_run.argtypes = [ctypes.c_int, ctypes.c_int64, p, p, p, p, p, p, p, p, p, ctypes.c_int, p,
                           ctypes.c_float, ctypes.c_int]
    lib.zf_run.restype = ctypes.c_int
    d = ctypes.c_double
    lib.zf_window_adamw.argtypes = [ctypes.c_int64, p, p, p, p, p, p, p, p, p, p, d, d, d, d, d, ctypes.c_float,
                                    ctypes.c_int64, ctypes.c_int, p, p, p, p, p, p]
    lib.zf_window_adamw.restype = ctypes.c_int
    # (narrow moments: and the random bits' keys and global index maps)
    lib.zf_window_adamw_bf16.argtypes = [*lib.zf_window_adamw.argtypes, p, p, p, p]
    lib.zf_window_adamw_bf16.restype = ctypes.c_int
    lib.zf_window_adamw_q.argtypes = [ctypes.c_int64, p, p, p, p, p, p, p, p, p, p, p, p, d, d, d, d, d,
                                      ctypes.c_float, ctypes.c_int64, ctypes.c_int, p, p, p, p, p, p, p, p, p, p]
    lib.zf_window_adamw_q.restype = ctypes.c_int
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, building them on first use; None when disabled or unavailable (warned once)."""
    global _lib, _state
    if _disabled():
        return None
    if _state != "not loaded":
        return _lib
    with _lock:
        if _state == "not loaded":
            try:
                _lib = _build()
                _state = "loaded"
            except Exception as exc:  # noqa: BLE001 - any failure means: use the torch fallback
                _lib, _state = None, f"unavailable ({exc})"
                warnings.warn(f"hf_zenflow: CPU kernels unavailable, using torch operations instead: {exc}",
                              RuntimeWarning, stacklevel=3)
    return _lib


def status() -> str:
    """"loaded", "disabled (HF_ZENFLOW_NATIVE=0)", "not loaded" (not needed yet) or "unavailable (why)"."""
    return "disabled (HF_ZENFLOW_NATIVE=0)" if _disabled() else _state


def supports(t: torch.Tensor) -> bool:
    """Whether the kernels can take `t` as the strided [rows, cols] operand (not an empty one: an FSDP2 shard may
    have no rows; torch's own ops take those)."""
    return t.device.type == "cpu" and t.dtype in _KINDS and t.is_contiguous() and t.ndim >= 1 and t.numel() > 0


def _array(ctype: type, values: list) -> ctypes.Array:
    return (ctype * max(1, len(values)))(*values)


def _shape(t: torch.Tensor) -> tuple[int, int]:
    return (t.shape[0], t.numel() // t.shape[0]) if t.ndim >= 2 and t.shape[0] > 0 else (1, t.numel())


def _run(kind: int, big: list[torch.Tensor], small: list[torch.Tensor | None], row_sums: list[torch.Tensor | None],
         index: list[torch.Tensor | None], want_sums: bool, coef: float = 1.0, first: bool = False,
         ) -> list[float] | None:
    lib = library()
    assert lib is not None, "call library() first"
    n = len(big)
    rows, cols = zip(*(_shape(t) for t in big)) if n else ((), ())
    ks = [0 if i is None else i.numel() for i in index]
    for t, s, i, k, r in zip(big, small, index, ks, rows):
        assert supports(t)
        if k:
            # (a bf16 small buffer: the gather output of a bf16 gradient, a bf16 window sum, or a scatter of bf16
            # into bf16)
            narrow = (kind == _NORM_GATHER and t.dtype == torch.bfloat16) or kind == _ACCUMULATE or (
                kind == _SCATTER and t.dtype == torch.bfloat16)
            assert s is not None and s.dtype in ((torch.float32, torch.bfloat16) if narrow else (torch.float32,))
            assert s.is_contiguous() and s.numel() == r * k
            assert i is not None and i.dtype == torch.int64 and i.is_contiguous() and i.device.type == "cpu"
    sums = (ctypes.c_double * max(1, n))() if want_sums else None
    rc = lib.zf_run(
        kind, n,
        _array(ctypes.c_void_p, [t.data_ptr() for t in big]),
        _array(ctypes.c_int32, [int(t.dtype == torch.bfloat16) for t in big]),
        _array(ctypes.c_void_p, [0 if s is None else s.data_ptr() for s in small]),
        _array(ctypes.c_int32, [int(s is not None and s.dtype == torch.bfloat16) for s in small]),
        _array(ctypes.c_void_p, [0 if h is None else h.data_ptr() for h in row_sums]),
        _array(ctypes.c_void_p, [0 if i is None else i.data_ptr() for i in index]),
        _array(ctypes.c_int64, list(rows)), _array(ctypes.c_int64, list(cols)), _array(ctypes.c_int64, ks),
        torch.get_num_threads(), sums, coef, int(first),
    )
    if rc != 0:
        raise MemoryError("hf_zenflow CPU kernel: out of memory for its work list")
    return list(sums)[:n] if sums is not None else None


def norms_and_gather(grads: list[torch.Tensor], outs: list[torch.Tensor | None],
                     index: list[torch.Tensor | None]) -> list[float]:
    """Sum of squares of each gradient and, where `index` is given, its selected columns copied into `outs`
    ([rows, k], fp32, or bf16 for a bf16 gradient) in the same sweep."""
    return _run(_NORM_GATHER, grads, outs, [None] * len(grads), index, want_sums=True)  # type: ignore[return-value]


def row_scores(mats: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each row's sum of squares (summed in fp64, returned as fp32 [rows]): the selection scores of matrices whose
    selectable units are rows, for a whole batch in one threaded pass."""
    scores = [torch.empty(_shape(m)[0], dtype=torch.float32) for m in mats]
    _run(_NORM_GATHER, mats, [None] * len(mats), list(scores), [None] * len(mats), want_sums=True)
    return scores


def scatter(params: list[torch.Tensor], sources: list[torch.Tensor], index: list[torch.Tensor]) -> None:
    """``param[:, index] = source`` (rounded to the parameter dtype) for each matrix: an fp32 source, or a bf16 one
    into a bf16 parameter."""
    _run(_SCATTER, params, list(sources), [None] * len(params), list(index), want_sums=False)


def accumulate(accums: list[torch.Tensor], grads: list[torch.Tensor], coef: float | None, first: bool,
               index: list[torch.Tensor | None] | None = None) -> None:
    """For each pair: ``accum = grad * coef`` (first step of a window) or ``accum += grad * coef`` (fma, as torch's
    vectorised ``add_(grad, alpha=coef)``), fp32 `accum`, fp32 or bf16 `grad` read directly. A bf16 `accum` (a bf16
    window sum): widened, the same fp32 fma, rounded to nearest even. With an `index` (sorted columns of a 2-D
    `grad`) the sum keeps those columns only, ``accum += grad[:, index] * coef`` ([rows, len(index)]), each element
    with the same arithmetic. One call for the batch: ctypes releases the GIL for all of it."""
    index = list(index) if index is not None else [None] * len(grads)
    for accum, grad, i in zip(accums, grads, index):
        assert accum.dtype in _KINDS and accum.is_contiguous() and supports(grad)
        assert accum.shape == grad.shape if i is None else (grad.ndim == 2 and accum.shape == (grad.shape[0],
                                                                                               i.numel()))
    _run(_ACCUMULATE, list(grads), list(accums), [None] * len(grads), index, want_sums=False,
         coef=1.0 if coef is None else float(coef), first=first)


#: torch's `Vectorized<float>::size()` per CPU capability: its fused AdamW runs the last numel % size elements of a
#: tensor through a scalar tail whose rounding `window_adamw` reproduces. Other capabilities: no fused kernel.
_TORCH_VECTOR_FLOATS = {"AVX512": 16, "AVX2": 8, "DEFAULT": 8}


def torch_vector_width() -> int | None:
    """Floats per vector of torch's CPU kernels here, or None where `window_adamw` cannot match them."""
    return _TORCH_VECTOR_FLOATS.get(torch.backends.cpu.get_cpu_capability())


_window_adamw_state: bool | None = None
_window_adamw_bf16_state: bool | None = None


def window_adamw_available() -> bool:
    """Whether `window_adamw` is used: the kernels are loaded and, checked once per process on small tensors with
    every kind of tail and both moment-update forms, give exactly torch's fused AdamW's bits (its rounding depends
    on how torch was compiled; where it differs, the host keeps torch's kernel, with a warning)."""
    global _window_adamw_state
    if library() is None:
        return False
    if _window_adamw_state is None:
        _window_adamw_state = torch_vector_width() is not None and _matches_torch()
        if not _window_adamw_state:
            warnings.warn("hf_zenflow: the fused window AdamW kernel does not reproduce this torch build's fused "
                          "AdamW bit for bit; the host uses torch's kernel (one more pass per window)",
                          RuntimeWarning, stacklevel=2)
    return _window_adamw_state


def window_adamw_bf16_available() -> bool:
    """Whether `window_adamw_bf16` is used (bf16 moments): `window_adamw_available`, and, checked once per process,
    the bf16 kernel gives the bits of widening the moments, torch's fused AdamW and the stochastic rounding back to
    bf16 of `rounding.round_bf16` with `rounding.RandomStream`'s bits (including moments that round into bf16's
    subnormal range, and shares of columns whose global indices cross a multiple of 2**32)."""
    global _window_adamw_bf16_state
    if not window_adamw_available():
        return False
    if _window_adamw_bf16_state is None:
        _window_adamw_bf16_state = _matches_torch(torch.bfloat16)
        if not _window_adamw_bf16_state:
            warnings.warn("hf_zenflow: the fused window AdamW kernel for bf16 moments does not reproduce torch's "
                          "fused AdamW and bf16 rounding bit for bit here; the host uses torch's operations",
                          RuntimeWarning, stacklevel=2)
    return _window_adamw_bf16_state


def _matches_torch(moment_dtype: torch.dtype = torch.float32) -> bool:
    from ..._base import fused_adamw_

    gen = torch.Generator().manual_seed(0)
    for case, (numel, beta1, weight_decay, count) in enumerate(((8, 0.9, 0.1, 3), (25, 0.9, 0.0, 1), (37, 0.3, 0.1, 4),
                                                                (1007, 0.9, 0.1, 3), (4099, 0.95, 0.01, 2))):
        master, accum, grad = (torch.randn(numel, generator=gen) for _ in range(3))
        exp_avg = torch.randn(numel, generator=gen) * 0.01
        exp_avg_sq = torch.rand(numel, generator=gen) * 1e-4
        if moment_dtype == torch.bfloat16:  # a few gradient-free elements whose moments decay into subnormals
            accum[:5], grad[:5] = 0.0, 0.0
            tiny = torch.tensor([1e-38, -3e-39, 2e-45, 5e-39, 1.2e-38])
            exp_avg[:5], exp_avg_sq[:5] = tiny, tiny.abs()
        exp_avg, exp_avg_sq = exp_avg.to(moment_dtype), exp_avg_sq.to(moment_dtype)
        hyper = {"lr": 1e-3, "betas": (beta1, 0.999), "eps": 1e-8, "weight_decay": weight_decay}
        ref = [t.clone() for t in (master, exp_avg, exp_avg_sq)]
        mean = accum.clone()
        accumulate([mean], [grad], 0.5, first=False)  # (checked against torch by its own tests)
        mean.div_(count)
        wide = [t.float() for t in ref[1:]]
        fused_adamw_([ref[0]], [mean], wide[:1], wide[1:], [torch.tensor(2.0)], hyper)
        stream = testing_stream(case, numel)
        if moment_dtype == torch.bfloat16:
            bits = stream.bits(3, 0, numel)
            ref[1].copy_(round_bf16(wide[0], random16(bits, 0)))
            ref[2].copy_(round_bf16(wide[1], random16(bits, 1)))
        else:
            ref[1].copy_(wide[0])
            ref[2].copy_(wide[1])
        mine = [t.clone() for t in (master, exp_avg, exp_avg_sq)]
        with torch.no_grad():
            args = ([mine[0]], [accum], [grad], [False], [count], [mine[1]], [mine[2]], [torch.tensor(2.0)], hyper,
                    0.5)
            if moment_dtype == torch.bfloat16:
                window_adamw_bf16(*args, streams=[stream])
            else:
                window_adamw(*args)
        if not all(torch.equal(a, b) for a, b in zip(ref, mine)):
            return False
    return True


def testing_stream(case: int, key: int) -> RandomStream:
    """The random bits of the self-checks' `case`: in turn a share of 7 of every 11 columns and whole rows, each
    starting just under 2**32 (runs that cross it) or past it (the index's high word in the AdamW loop's bits)."""
    base = (1 << 32) - 5 if case % 2 == 0 else (5 << 32) + 17
    return RandomStream(key=key, base=base, local_cols=7, global_cols=11) if case % 4 < 2 else RandomStream(key, base)


#: Per matrix of a window pass, None or (kept before each column, the columns not kept, axis): `window_adamw`.
KeptSums = list[tuple[torch.Tensor, torch.Tensor, int] | None] | None


def window_adamw(masters: list[torch.Tensor], accums: list[torch.Tensor], grads: list[torch.Tensor | None],
                 firsts: list[bool], counts: list[int], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                 steps: list[torch.Tensor], hyper: dict, coef: float | None,
                 kept: KeptSums = None) -> None:
    """The host AdamW of a window in one pass (`csrc/zenflow_cpu.c`, zf_window_adamw): per matrix the window's
    mean gradient, ``(accum + grad * coef) / count`` with the last step's `grad` folded in (``grad * coef / count``
    when `first`; ``accum / count`` when `grad` is None), then the AdamW update of torch's fused CPU kernel, bit
    for bit; each `steps` tensor is incremented first, as torch does. `accums` are read, never written: fp32, or
    bf16 (a bf16 window sum, ``host_sum_dtype="bfloat16"``: widened as read; with `grad` folded in, the sum is
    rounded to nearest bf16 before the division, as `accumulate` would store it, so that folding gives the bits of
    adding the last gradient into the sum and running the pass on it).

    `kept`: per matrix None, or ``(before, skipped, axis)`` for a sum that keeps some columns (``axis`` 1) or rows
    (0) of the 2-D master only (``host_sum_columns="unselected"``): `before` (int32, one more than the columns or
    rows) counts the kept ones before each, `skipped` (int32, sorted) lists the others; those read a zero sum, the
    kept ones the bits of a full sum (spread block by block in the pass, in runs between the skipped ones)."""
    for t in (*exp_avgs, *exp_avg_sqs):
        assert t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
    _window_adamw(masters, accums, grads, firsts, counts, (exp_avgs, exp_avg_sqs), steps, hyper, coef, kept=kept)


def window_adamw_bf16(masters: list[torch.Tensor], accums: list[torch.Tensor], grads: list[torch.Tensor | None],
                      firsts: list[bool], counts: list[int], exp_avgs: list[torch.Tensor],
                      exp_avg_sqs: list[torch.Tensor], steps: list[torch.Tensor], hyper: dict,
                      coef: float | None, kept: KeptSums = None, streams: list[RandomStream] | None = None) -> None:
    """`window_adamw` with bf16 moments (``host_moment_dtype="bfloat16"``, contiguous, the master's shape): each
    block of the moments is widened into fp32 (exactly), updated as fp32 moments are and rounded back stochastically
    in the same pass, with each matrix's `streams` bits for its new step count (default: `RandomStream()`); the bits
    of widening, torch's fused AdamW in fp32 and `rounding.round_bf16` (a NaN stays a NaN, its payload bits
    aside)."""
    for moment_list in (exp_avgs, exp_avg_sqs):
        for t, master in zip(moment_list, masters):
            assert t.dtype == torch.bfloat16 and t.is_contiguous() and t.device.type == "cpu"
            assert t.numel() == master.numel()
    _window_adamw(masters, accums, grads, firsts, counts, (exp_avgs, exp_avg_sqs), steps, hyper, coef, bf16=True,
                  kept=kept, streams=streams)


def window_adamw_quantized(masters: list[torch.Tensor], accums: list[torch.Tensor],
                           grads: list[torch.Tensor | None], firsts: list[bool], counts: list[int],
                           m_codes: list[torch.Tensor], m_scales: list[torch.Tensor], v_codes: list[torch.Tensor],
                           v_scales: list[torch.Tensor], steps: list[torch.Tensor], hyper: dict,
                           coef: float | None, kept: KeptSums = None,
                           streams: list[RandomStream] | None = None) -> None:
    """`window_adamw` with 8-bit moments (``host_moment_dtype="int8"``): per matrix the int8 codes of exp_avg and
    the uint8 codes of exp_avg_sq (contiguous, the master's shape) and their fp32 per-block scales (one per 256
    elements); each block is dequantised, updated and quantised again (stochastically, with each matrix's `streams`
    bits) in the same pass, with the arithmetic of ``hf_zenflow.engine.quantized_moments`` (checked bit for bit
    against it by the caller)."""
    for kind, codes_list, scales_list in ((torch.int8, m_codes, m_scales), (torch.uint8, v_codes, v_scales)):
        for codes, scales, master in zip(codes_list, scales_list, masters):
            assert codes.dtype == kind and codes.is_contiguous() and codes.numel() == master.numel()
            assert scales.dtype == torch.float32 and scales.is_contiguous()
            assert scales.numel() == -(-master.numel() // 256)
    _window_adamw(masters, accums, grads, firsts, counts, (m_codes, m_scales, v_codes, v_scales), steps, hyper,
                  coef, kept=kept, streams=streams)


def _window_adamw(masters: list[torch.Tensor], accums: list[torch.Tensor], grads: list[torch.Tensor | None],
                  firsts: list[bool], counts: list[int], moments: tuple[list[torch.Tensor], ...],
                  steps: list[torch.Tensor], hyper: dict, coef: float | None, bf16: bool = False,
                  kept: KeptSums = None, streams: list[RandomStream] | None = None) -> None:
    width = torch_vector_width()
    assert width is not None
    kept = list(kept) if kept is not None else [None] * len(masters)
    for t in masters:
        assert t.dtype == torch.float32 and t.is_contiguous() and t.device.type == "cpu"
    for t, master, part in zip(accums, masters, kept):
        assert t.dtype in _KINDS and t.is_contiguous() and t.device.type == "cpu"
        if part is None:
            assert t.numel() == master.numel()
            continue
        before, skipped, axis = part
        units = master.shape[axis]
        assert master.ndim == 2 and t.shape[1 - axis] == master.shape[1 - axis]
        assert before.dtype == skipped.dtype == torch.int32 and before.is_contiguous() and skipped.is_contiguous()
        assert before.numel() == units + 1 and int(before[-1]) == t.shape[axis] == units - skipped.numel()
    for master, grad in zip(masters, grads):
        assert grad is None or (supports(grad) and grad.shape == master.shape)
    for step in steps:
        step.add_(1)
    beta1, beta2 = hyper["betas"]
    lib = library()
    assert lib is not None, "call library() first"
    n = len(masters)
    narrow = len(moments) == 4 or bf16
    call = lib.zf_window_adamw_q if len(moments) == 4 else lib.zf_window_adamw_bf16 if bf16 else lib.zf_window_adamw
    # (narrow moments: each matrix's random bits, keyed by its step count after this pass)
    streams = list(streams) if streams is not None else [RandomStream()] * n
    random_bits = [
        _array(ctypes.c_uint64, [s.pass_key(int(step)) for s, step in zip(streams, steps)]),
        _array(ctypes.c_int64, [s.base for s in streams]), _array(ctypes.c_int64, [s.local_cols for s in streams]),
        _array(ctypes.c_int64, [s.global_cols for s in streams]),
    ] if narrow else []
    rc = call(
        n,
        *(_array(ctypes.c_void_p, [t.data_ptr() for t in ts]) for ts in (masters, accums, *moments)),
        _array(ctypes.c_void_p, [0 if g is None else g.data_ptr() for g in grads]),
        _array(ctypes.c_int32, [int(g is not None and g.dtype == torch.bfloat16) for g in grads]),
        _array(ctypes.c_int32, [int(f) for f in firsts]), _array(ctypes.c_int64, list(counts)),
        _array(ctypes.c_int64, [m.numel() for m in masters]),
        _array(ctypes.c_double, [float(s) for s in steps]),
        float(hyper["lr"]), float(beta1), float(beta2), float(hyper["eps"]), float(hyper["weight_decay"]),
        1.0 if coef is None else float(coef), width, torch.get_num_threads(),
        _array(ctypes.c_int32, [int(a.dtype == torch.bfloat16) for a in accums]),
        _array(ctypes.c_void_p, [0 if part is None else part[0].data_ptr() for part in kept]),
        _array(ctypes.c_void_p, [0 if part is None else part[1].data_ptr() for part in kept]),
        _array(ctypes.c_int32, [int(part is not None and part[2] == 0) for part in kept]),
        _array(ctypes.c_int64, [m.shape[-1] if m.ndim else 1 for m in masters]),
        _array(ctypes.c_int64, [a.shape[-1] if a.ndim else 1 for a in accums]),
        *random_bits,
    )
    if rc != 0:
        raise MemoryError("hf_zenflow CPU kernel: out of memory for its work list")
