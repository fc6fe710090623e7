"""8-bit host moments (``host_moment_dtype="int8"``): blockwise quantised AdamW moments, 1 byte per element plus one
fp32 scale per block of `BLOCK` elements (2.03 B per parameter for both moments, against 8 B in fp32).

Each block of 256 consecutive elements (in the tensor's storage order) keeps its largest magnitude ``A`` as an fp32
scale, and every element ``x`` as ``y = |x| * (1 / A)`` on an 8-bit floating-point code with 3 mantissa bits (as
torchao's fp8 AdamW, with the exponent range set by the code's width): ``y``'s fp32 bits rounded at bit 20, less a
bias that makes 1.0 the top code. Every element keeps a relative error under 1/8 (1/16 at the top of each binade)
wherever it falls in the block's range, where a linear code would round everything under ``A / 254`` to zero:

- ``exp_avg`` (int8): the sign and codes 0..127, 16 binades under ``A`` (smaller magnitudes read as 0);
- ``exp_avg_sq`` (uint8): codes 1..255, 32 binades under ``A`` (16 in ``sqrt(v)``, the quantity AdamW divides by);
  the floor of 1 keeps every element of a non-zero block above zero, so that no element is divided by ``eps`` alone
  (a ``v`` rounded to zero under a non-zero ``m`` is how 8-bit moments diverge).

The host AdamW pass rounds the codes stochastically (`transport.cpu_device.rounding`: up with probability the
remainder's share of the code step, with the reproducible random bits of the pass, placed at bits 4..19): a code's
step is 6-12 % of the value, and one AdamW update moves ``exp_avg_sq`` by about 0.1 % (beta2 = 0.999), so rounded to
nearest every update is lost and an element's stored value follows its block's scale instead of its own average.
Rounded stochastically it is the exact value in expectation after every update. Other writes of whole moments
(`QuantizedMoment.copy_`: re-selection, restoring fp32 values) happen once per re-selection or load, not per update,
and round to nearest.

Decoding puts the code plus the bias back at bit 20 and multiplies by ``A``. Both directions are integer steps and
one fp32 product (no square roots, no divisions but one reciprocal per block), the same here and in the CPU kernel
(`kernels.window_adamw` with quantised moments), so the two give the same bits. The host AdamW reads a block's
codes, updates the block in fp32 (torch's fused AdamW arithmetic) and stores new codes with the block's new maximum,
in one pass (`host.host_adamw_window`). Quantisation is the only difference from fp32 moments; the master weights and
the window sums stay fp32.
"""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .._base import fused_adamw_
from ..transport.cpu_device import kernels
from ..transport.cpu_device.rounding import RandomStream, moment_random16


#: Elements per quantisation block (one fp32 scale each).
BLOCK = 256

#: Elements per piece of the torch (no-compiler) pass: a multiple of `BLOCK`; bounds its fp32 scratch (two buffers of
#: 1 MiB per thread, and the temporaries of the codes) whatever the matrix.
PIECE = 1024 * BLOCK

#: The top code of each moment: 1.0 of the block's maximum.
_SIGNED_TOP, _UNSIGNED_TOP = 127, 255
#: The fp32 bits of 1.0, shifted right by 20 (8 exponent bits and the 3 mantissa bits a code keeps).
_ONE_BITS20 = 0x3F800000 >> 20
#: An int32's sign bit.
_SIGN_BIT = -(1 << 31)


def _flat(t: torch.Tensor) -> torch.Tensor:
    """`t` as a 1-D view in storage order: a host matrix is contiguous, or the transpose of a contiguous one."""
    return t.view(-1) if t.is_contiguous() else t.t().view(-1)


def blocks(numel: int) -> int:
    return -(-numel // BLOCK)


@dataclass
class QuantizedMoment:
    """One moment tensor of a host matrix, quantised by blocks: `codes` has the matrix's shape and memory layout
    (int8 for ``exp_avg``, uint8 for ``exp_avg_sq``), `scales` one fp32 per block of its storage order.

    It stands in for an fp32 tensor where the host state is read or written whole or by columns (re-selection,
    checkpoints, conversion): `float()` dequantises, `copy_` and `index_copy_` quantise (a block that is written
    gets a new scale)."""

    codes: torch.Tensor
    scales: torch.Tensor

    @classmethod
    def zeros(cls, like: torch.Tensor, signed: bool) -> QuantizedMoment:
        codes = torch.zeros_like(like, dtype=torch.int8 if signed else torch.uint8)  # (keeps `like`'s strides)
        return cls(codes, torch.zeros(blocks(like.numel()), dtype=torch.float32))

    @property
    def signed(self) -> bool:
        return self.codes.dtype == torch.int8

    @property
    def shape(self) -> torch.Size:
        return self.codes.shape

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the moment is read and written in (its values are fp32)."""
        return torch.float32

    def numel(self) -> int:
        return self.codes.numel()

    def nbytes(self) -> int:
        return self.codes.numel() * self.codes.element_size() + self.scales.numel() * self.scales.element_size()

    def float(self) -> torch.Tensor:
        """The fp32 values (a new tensor with the codes' shape and memory layout)."""
        out = torch.empty_like(self.codes, dtype=torch.float32)
        dequantize_into(_flat(out), _flat(self.codes), self.scales)
        return out

    def copy_(self, src: torch.Tensor) -> QuantizedMoment:
        """Quantise `src` (any dtype, the moment's shape) into the codes and scales."""
        src = src.to(torch.float32)
        if src.shape != self.codes.shape:
            src = src.view(self.codes.shape)
        if src.stride() != self.codes.stride():
            src = torch.empty_like(self.codes, dtype=torch.float32).copy_(src)
        quantize_into(_flat(self.codes), self.scales, _flat(src))
        return self

    def copy_codes_(self, codes: torch.Tensor, scales: torch.Tensor) -> None:
        """Take saved codes and scales as they are (an exact restore)."""
        self.codes.copy_(codes)
        self.scales.copy_(scales)

    def index_select(self, dim: int, index: torch.Tensor) -> torch.Tensor:
        return self.float().index_select(dim, index)

    def index_copy_(self, dim: int, index: torch.Tensor, source: torch.Tensor,
                    random16: Callable[[int, int], torch.Tensor] | None = None) -> QuantizedMoment:
        """Write the columns (or rows) `index`: the moment is dequantised, written and quantised again (every block
        keeps its codes and scale unless one of its elements changed: `quantize_into` of `dequantize_into`'s values
        gives back the same codes and scales).

        `random16`: ``random16(start, end)``, the random 16-bit values of storage elements ``[start, end)``
        (`rounding.random16`): the blocks holding a written element are then quantised stochastically and the others
        are left as they are. A re-selection writes its device columns this way: a written element that moves its
        block's scale re-rounds every element of the block, and rounded to nearest a small move of the scale keeps
        their codes, so that their values follow the scale (the bias of nearest rounding in the AdamW pass, once
        per re-selection)."""
        full = self.float()
        full.index_copy_(dim, index, source.to(torch.float32))
        if random16 is None:
            return self.copy_(full)
        written = torch.zeros(self.codes.shape, dtype=torch.bool)
        written.index_fill_(dim, index, True)
        marks, values, codes = _flat(written), _flat(full), _flat(self.codes)
        n = marks.numel()
        touched = torch.nn.functional.pad(marks, (0, blocks(n) * BLOCK - n)).view(-1, BLOCK).any(dim=1).tolist()
        b = 0
        while b < len(touched):  # (runs of consecutive touched blocks)
            if not touched[b]:
                b += 1
                continue
            end = b
            while end < len(touched) and touched[end]:
                end += 1
            lo, hi = b * BLOCK, min(end * BLOCK, n)
            quantize_into(codes[lo:hi], self.scales[b:end], values[lo:hi], random16(lo, hi))
            b = end
        return self


def dequantize_into(out: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """``out`` (fp32, 1-D) = the values of the 1-D `codes` with their per-block `scales`."""
    n = codes.numel()
    whole = n // BLOCK * BLOCK
    for lo, hi in ((0, whole), (whole, n)):
        if hi > lo:
            c = codes[lo:hi].view(-1, min(BLOCK, hi - lo))
            s = scales[lo // BLOCK:blocks(hi)].view(-1, 1)
            _dequantize(out[lo:hi].view(c.shape), c, s)


def _dequantize(out: torch.Tensor, codes: torch.Tensor, scale: torch.Tensor) -> None:
    code = codes.to(torch.int32)
    signed = codes.dtype == torch.int8
    top = _SIGNED_TOP if signed else _UNSIGNED_TOP
    magnitude = code.abs() if signed else code
    # (torch's shift functions: the operators with a Python int take a slow path)
    bits = torch.bitwise_left_shift(magnitude + (_ONE_BITS20 - top), 20)
    if signed:
        # the kernel's ``(c ? value : 0) * scale``, negated for ``c < 0``, in integer passes (torch.where takes
        # several times as long): a code 0 masks its bits to 0.0, and a negative code's sign bit flips the product's
        bits.bitwise_and_(magnitude.clamp_(max=1).neg_())
    value = bits.view(torch.float32).mul_(scale)
    if signed:
        value.view(torch.int32).bitwise_xor_(code.bitwise_and_(_SIGN_BIT))
    out.copy_(value)


def quantize_into(codes: torch.Tensor, scales: torch.Tensor, values: torch.Tensor,
                  random_bits: torch.Tensor | None = None) -> None:
    """The codes (1-D, int8 or uint8) and per-block `scales` of the fp32 1-D `values`: rounded to nearest, or, with
    `random_bits` (one random 16-bit value per element, `rounding.random16`), stochastically as the kernel does."""
    n = values.numel()
    whole = n // BLOCK * BLOCK
    for lo, hi in ((0, whole), (whole, n)):
        if hi > lo:
            x = values[lo:hi].view(-1, min(BLOCK, hi - lo))
            r = None if random_bits is None else random_bits[lo:hi].view(x.shape)
            _quantize(codes[lo:hi].view(x.shape), scales[lo // BLOCK:blocks(hi)], x, r)


def _quantize(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor, random_bits: torch.Tensor | None) -> None:
    signed = codes.dtype == torch.int8
    magnitude = x.abs() if signed else x
    peak = magnitude.amax(dim=1)
    scales.copy_(peak)
    # (an all-zero block takes 1 / 1: its codes are 0, or the unsigned floor 1 that reads back as 1 x 0)
    inverse = torch.where(peak > 0, peak, torch.ones_like(peak)).reciprocal_().view(-1, 1)
    bits = (magnitude * inverse).view(torch.int32)
    top = _SIGNED_TOP if signed else _UNSIGNED_TOP
    if random_bits is None:
        odd = torch.bitwise_right_shift(bits, 20).bitwise_and_(1)  # (nearest even, at bit 20)
        code = torch.bitwise_right_shift(bits + odd + 0x7FFFF, 20).sub_(_ONE_BITS20 - top)
    else:  # (stochastic, at bit 20: y <= 1 + 2**-23 may reach one past the top code, which the clamps cap)
        code = torch.bitwise_right_shift(bits + torch.bitwise_left_shift(random_bits, 4), 20).sub_(_ONE_BITS20 - top)
    if signed:
        code.clamp_(0, top)
        sign = torch.bitwise_right_shift(x.view(torch.int32), 31)  # (0, or -1 where x's sign bit is set)
        code.bitwise_xor_(sign).sub_(sign)  # (the kernel's ``(c ^ sign) - sign``)
    else:
        code.clamp_(1, top)
    codes.copy_(code)


_scratch = threading.local()


def _piece_scratch(name: str, numel: int) -> torch.Tensor:
    """A reused fp32 buffer of `numel` elements, one per thread and `name`."""
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=torch.float32)
        setattr(_scratch, name, buf)
    return buf[:numel]


def adamw_pass(master: torch.Tensor, mean_grad: torch.Tensor, exp_avg: QuantizedMoment,
               exp_avg_sq: QuantizedMoment, step: torch.Tensor, hyper: dict,
               stream: RandomStream | None = None) -> None:
    """The host AdamW of a matrix with 8-bit moments without the CPU kernel: piece by piece (`PIECE` elements,
    whole blocks), the moments are dequantised into fp32 scratch, updated by torch's fused AdamW against the fp32
    `master` and the window's `mean_grad`, and quantised again, stochastically with `stream`'s bits for the new step
    count (low 16 bits: exp_avg, high 16: exp_avg_sq); the bits of `kernels.window_adamw_quantized`. Each piece
    steps a copy of `step`, which then becomes the count."""
    stream = stream if stream is not None else RandomStream()
    pass_step = int(step) + 1
    flat = [_flat(t) for t in (master, mean_grad, exp_avg.codes, exp_avg_sq.codes)]
    stepped = step
    for start in range(0, flat[0].numel(), PIECE):
        end = min(start + PIECE, flat[0].numel())
        p, g, m_codes, v_codes = (t[start:end] for t in flat)
        m, v = _piece_scratch("exp_avg", end - start), _piece_scratch("exp_avg_sq", end - start)
        first, last = start // BLOCK, blocks(end)
        dequantize_into(m, m_codes, exp_avg.scales[first:last])
        dequantize_into(v, v_codes, exp_avg_sq.scales[first:last])
        stepped = step.clone()
        fused_adamw_([p], [g], [m], [v], [stepped], hyper)
        random_m, random_v = moment_random16(stream, pass_step, start, end)
        quantize_into(m_codes, exp_avg.scales[first:last], m, random_m)
        quantize_into(v_codes, exp_avg_sq.scales[first:last], v, random_v)
    step.copy_(stepped)


_kernel_state: bool | None = None


def kernel_matches() -> bool:
    """Whether `kernels.window_adamw_quantized` gives the bits of `adamw_pass` here (checked once per process on
    small matrices with every kind of tail and partial block; where it does not, the torch pass is used)."""
    global _kernel_state
    if _kernel_state is None:
        _kernel_state = kernels.library() is not None and _kernel_check()
        if not _kernel_state and kernels.library() is not None:
            warnings.warn("hf_zenflow: the CPU kernel for 8-bit host moments does not reproduce the torch pass bit "
                          "for bit here; the host uses the torch pass", RuntimeWarning, stacklevel=2)
    return _kernel_state


def _kernel_check() -> bool:
    hyper = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    for case, (rows, cols, count) in enumerate(((3, 7, 1), (5, 300, 3), (17, 1031, 2), (64, 1024, 4))):
        gen = torch.Generator().manual_seed(rows)
        master, accum, grad, m, v = (torch.randn(rows, cols, generator=gen) for _ in range(5))
        runs = []
        for _ in range(2):
            state = [master.clone(), QuantizedMoment.zeros(master, signed=True),
                     QuantizedMoment.zeros(master, signed=False), torch.tensor(2.0)]
            state[1].copy_(m * 1e-2)
            state[2].copy_(v.square() * 1e-4)
            runs.append(state)
        (p1, m1, v1, s1), (p2, m2, v2, s2) = runs
        stream = kernels.testing_stream(case, rows)
        kernels.window_adamw_quantized([p1], [accum], [grad], [count == 1], [count], [m1.codes], [m1.scales],
                                       [v1.codes], [v1.scales], [s1], hyper, 0.5, streams=[stream])
        mean = grad * 0.5 if count == 1 else accum.clone()
        if count > 1:
            kernels.accumulate([mean], [grad], 0.5, first=False)  # (the kernels' fma, as the window sum has it)
            mean.div_(count)
        adamw_pass(p2, mean, m2, v2, s2, hyper, stream)
        pairs = [(p1, p2), (s1, s2), (m1.codes, m2.codes), (m1.scales, m2.scales), (v1.codes, v2.codes),
                 (v1.scales, v2.scales)]
        if not all(torch.equal(a, b) for a, b in pairs):
            return False
    return True


__all__ = ["BLOCK", "PIECE", "QuantizedMoment", "adamw_pass", "blocks", "dequantize_into", "kernel_matches",
           "quantize_into"]
