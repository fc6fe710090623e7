"""Stochastic rounding of the narrow host moments: reproducible random bits, and the torch form of the rounding that
the CPU kernel (`csrc/zenflow_cpu.c`) applies in its pass.

A moment stored in bf16 or in 8-bit codes is rounded after every host AdamW update. Rounded to nearest, an update
smaller than half a step of the stored format is lost every time: with beta2 = 0.999 each update moves
``exp_avg_sq`` by 0.1 % of itself, under half a bf16 step (0.2-0.4 %) and far under half an 8-bit code's (3-6 %),
so the stored value stops following its own average and ratchets (bf16: only increases are kept; 8-bit: the element
follows its block's scale). Rounded stochastically, up with probability equal to the remainder's share of the step,
the stored value is the exact one in expectation after every update.

The random bits of an element come from a counter-based hash, never from a generator's state: 32 bits per element
and pass, ``mix32((index mod 2**32) ^ k)`` with `mix32` a bijective 32-bit integer hash (lowbias32) and ``k``
derived from the pass's 64-bit key and the index's high 32 bits; the low 16 bits round ``exp_avg``, the high 16 bits
``exp_avg_sq``. The pass's key (`RandomStream.pass_key`) mixes the optimizer's seed, the parameter's position in its
param groups and the matrix's host step count, and ``index`` is the element's index in the whole parameter's storage
matrix (not in this rank's share of it). So the same seed gives the same bits, a resumed run the bits of an
uninterrupted one (the seed is in the checkpoint; the step count is state anyway), and a matrix shared by several
ranks the bits one process would use. A column-major weight (`column_major_`) orders its storage otherwise, so it
draws other bits than the same weight row-major: the two layouts agree bit for bit with fp32 moments only.

Example:
    >>> import torch
    >>> stream = RandomStream(key=matrix_key(seed=0, ordinal=3))
    >>> bits = stream.bits(step=1, start=0, end=4)
    >>> bits.dtype
    torch.int32
    >>> x = torch.full((4,), 1.0 + 2.0 ** -9)  # a quarter of a bf16 step above 1.0
    >>> set(round_bf16(x, random16(bits, 0)).tolist()) <= {1.0, 1.0078125}
    True
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch


_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF
# lowbias32's multipliers (in int32 the second is its negative complement: `_signed32`)
_MUL1, _MUL2 = 0x7FEB352D, 0x846CA68B


def splitmix64(x: int) -> int:
    """A bijective 64-bit mix of a Python int (SplitMix64's finaliser, with its increment)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def mix32(x: int) -> int:
    """lowbias32 of a Python int (0 <= x < 2**32): the hash the kernel applies to every element."""
    x ^= x >> 16
    x = (x * _MUL1) & _MASK32
    x ^= x >> 15
    x = (x * _MUL2) & _MASK32
    return x ^ (x >> 16)


def _signed32(v: int) -> int:
    """The int32 value with the bits of the 32-bit unsigned `v`."""
    return v - (1 << 32) if v >= 1 << 31 else v


def _as_int32(v: torch.Tensor) -> torch.Tensor:
    """The low 32 bits of the int64 `v` as int32 bit patterns."""
    v = torch.bitwise_and(v, _MASK32)
    return (v - torch.bitwise_left_shift(torch.bitwise_right_shift(v, 31), 32)).to(torch.int32)


_scratch = threading.local()


def _buffer(name: str, like: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A reused per-thread buffer of `like`'s size (a new tensor of several MiB costs its page faults every time)."""
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < like.numel() or buf.dtype != dtype:
        buf = torch.empty(like.numel(), dtype=dtype)
        setattr(_scratch, name, buf)
    return buf[:like.numel()].view(like.shape)


def _shifted(x: torch.Tensor, bits: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The logical right shift of int32 `x` by `bits` (`torch.bitwise_right_shift`: ``x >> n`` with a Python int takes
    a slow path), into `out` when given."""
    shifted = torch.bitwise_right_shift(x, bits) if out is None else torch.bitwise_right_shift(x, bits, out=out)
    return shifted.bitwise_and_((1 << (32 - bits)) - 1)


#: The longest run `_counted` adds to a kept count instead of counting afresh (larger runs: `torch.arange`).
_COUNT_KEPT = 1 << 22


def _counted(length: int, first: int, out: torch.Tensor) -> torch.Tensor:
    """``first, first + 1, ...`` (int32, wrapping) into `out`'s `length` elements: one addition to this thread's
    kept ``0, 1, ...``, where `torch.arange` costs three additions' time."""
    if length > _COUNT_KEPT:
        return torch.arange(length, dtype=torch.int32, out=out).add_(first)
    count = getattr(_scratch, "count", None)
    if count is None or count.numel() < length:
        count = _scratch.count = torch.arange(min(_COUNT_KEPT, max(length, 1 << 18)), dtype=torch.int32)
    return torch.add(count[:length], first, out=out)


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """`mix32` of an int32 tensor holding 32-bit patterns, in place: int32 products wrap around as the kernel's
    uint32 products do (their low 32 bits)."""
    tmp = _buffer("shift", x, torch.int32)
    x.bitwise_xor_(_shifted(x, 16, tmp))
    x.mul_(_MUL1)
    x.bitwise_xor_(_shifted(x, 15, tmp))
    x.mul_(_signed32(_MUL2))
    return x.bitwise_xor_(_shifted(x, 16, tmp))


#: The `salt` of the bits that round 8-bit moments written at a re-selection (`QuantizedMoment.index_copy_`).
RESELECTION_SALT = 0x5E1EC7105A17ED01


def matrix_key(seed: int, ordinal: int) -> int:
    """The 64-bit key of a parameter's random bits: the optimizer's seed and the parameter's position in its param
    groups (so that two matrices of one optimizer never share bits)."""
    return splitmix64((seed & _MASK64) ^ splitmix64(ordinal))


@dataclass(frozen=True)
class RandomStream:
    """Where a host matrix's random bits come from: its parameter's `matrix_key`, and where its elements sit in the
    whole parameter's storage matrix. Local element ``e`` (storage order) of a host share with rows of `local_cols`
    elements is global element ``base + (e // local_cols) * global_cols + e % local_cols``; ``local_cols == 0``:
    the share's rows are whole rows, ``base + e``."""

    key: int = 0
    base: int = 0
    local_cols: int = 0
    global_cols: int = 0

    def pass_key(self, step: int, salt: int = 0) -> int:
        """The 64-bit key of the host AdamW pass that brings the matrix to host step `step` (`salt` 0), or of
        another rounding at that step (a `salt` of its own, e.g. `RESELECTION_SALT`)."""
        return splitmix64(self.key ^ splitmix64(int(step)) ^ salt)

    def global_index(self, start: int, end: int) -> torch.Tensor:
        """The global indices (int64) of local elements ``[start, end)``."""
        e = torch.arange(start, end, dtype=torch.int64)
        if self.local_cols and self.local_cols != self.global_cols:
            e = torch.div(e, self.local_cols, rounding_mode="floor") * self.global_cols + e % self.local_cols
        return e + self.base

    def bits(self, step: int, start: int, end: int, salt: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
        """The 32 random bits of local elements ``[start, end)`` in the pass to host step `step` (the kernel's bits;
        another `salt`: the bits of another rounding, see `pass_key`), as an int32 tensor of their bit patterns
        (`random16` takes the 16 bits of one moment), written into `out` when given."""
        key = self.pass_key(step, salt)
        n = end - start
        out = torch.empty(n, dtype=torch.int32) if out is None else out.view(-1)[:n]
        if self.local_cols and self.local_cols != self.global_cols:  # (a share of columns: runs per row)
            index = self.global_index(start, end)
            mixed = _mix32_(_as_int32(torch.bitwise_right_shift(index, 32) + (key >> 32)))
            return _mix32_(out.copy_(_as_int32(index)).bitwise_xor_(mixed).bitwise_xor_(_signed32(key & _MASK32)))
        g, i = self.base + start, 0
        while i < n:  # (runs of one high word of the index)
            length = min(n - i, (1 << 32) - (g & _MASK32))
            k = (key & _MASK32) ^ mix32(((g >> 32) + (key >> 32)) & _MASK32)
            run = _counted(length, _signed32(g & _MASK32), out[i:i + length])
            _mix32_(run.bitwise_xor_(_signed32(k)))
            i, g = i + length, g + length
        return out


def random16(bits: torch.Tensor, moment: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """The 16 random bits of ``exp_avg`` (`moment` 0: the low half) or ``exp_avg_sq`` (1: the high half) in
    `RandomStream.bits`' int32 bit patterns (int32 values in [0, 2**16)), written into `out` when given."""
    if moment:
        return _shifted(bits, 16, out)
    return torch.bitwise_and(bits, 0xFFFF) if out is None else torch.bitwise_and(bits, 0xFFFF, out=out)


def moment_random16(stream: RandomStream, step: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The random 16-bit values of ``exp_avg`` and of ``exp_avg_sq`` for local elements ``[start, end)`` in the pass
    to host step `step` (`RandomStream.bits`' two halves): views of this thread's buffers, valid until its next
    call."""
    like = torch.empty(end - start, dtype=torch.int32, device="meta")
    bits = stream.bits(step, start, end, out=_buffer("bits", like, torch.int32))
    return (random16(bits, 0, _buffer("random_m", like, torch.int32)),
            random16(bits, 1, _buffer("random_v", like, torch.int32)))


def round_bf16(x: torch.Tensor, r16: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 `x` rounded to bf16 stochastically with the random 16-bit values `r16` (one per element, `random16`):
    ``r16`` added to the low half of x's bits, which are then dropped (a NaN becomes bf16's quiet NaN, as in
    `csrc/zenflow_cpu.c`). Up with probability (the dropped half) / 2**16: the exact value in expectation. Written
    into the bf16 `out` when given. (In int32: the sum stays in range for every value but a NaN, whose result is
    replaced, and its arithmetic shift by 16 is the bf16 bit pattern as an int16. Whether there is a NaN to replace
    is asked of `x`'s sum, NaN when an element is, and far cheaper than a mask of every element.)"""
    x = x.contiguous()
    summed = torch.add(x.view(torch.int32), r16, out=_buffer("summed", x, torch.int32))
    torch.bitwise_right_shift(summed, 16, out=summed)
    out = torch.empty(x.shape, dtype=torch.bfloat16) if out is None else out
    out.view(torch.int16).copy_(summed)
    if torch.isnan(x.sum()):
        out.view(torch.int16).masked_fill_(torch.isnan(x), 0x7FC0)
    return out


__all__ = ["RESELECTION_SALT", "RandomStream", "matrix_key", "mix32", "moment_random16", "random16", "round_bf16",
           "splitmix64"]
