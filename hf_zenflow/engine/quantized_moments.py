"""8-bit host moments (``host_moment_dtype="int8"``): blockwise quantised AdamW moments, 1 byte per element plus one
fp32 scale per block of `BLOCK` elements (2.03 B per parameter for both moments, against 8 B in fp32).

Each block of 256 consecutive elements (in the tensor's storage order) keeps an fp32 scale (its largest magnitude)
and every element as an 8-bit code on a power-law scale, which spends the codes where AdamW needs them:

- ``exp_avg`` (signed, int8): ``q = round(127 * sqrt(|m| / A))`` with m's sign; ``m = c * |c| * A``, ``c = q / 127``.
  The square-root code keeps relative steps small across four decades (level 1 is ``A / 16129``), where a linear
  code would round every element under ``A / 254`` to zero.
- ``exp_avg_sq`` (unsigned, uint8), coded by its square root ``r = sqrt(v)``, the quantity AdamW divides by (and
  computes anyway): the scale is the block's largest ``r``, ``R``, and ``q = round(255 * sqrt(r / R))``, at least 1;
  ``v = ((c * c) * R) ** 2`` for ``c = q / 255``. In ``v`` that is a fourth-root code: level 1 is ``R / 65025`` in
  ``r``; the floor of 1 keeps every element of a non-zero block above zero, so that no element is divided by ``eps``
  alone (a ``v`` rounded to zero under a non-zero ``m`` is how 8-bit moments diverge).

Divisions are products by reciprocals (``1 / A`` once per block, ``1 / 127`` and ``1 / 255`` once). Rounding is to
nearest even; every operation (reciprocal, square root, product) is one IEEE fp32 operation, in the same order here
and in the CPU kernel (`kernels.window_adamw` with quantised moments), so both give the same bits.
The host AdamW reads a block's codes, updates the block in fp32 (torch's fused AdamW arithmetic) and stores new
codes with the block's new maximum, in one pass (`host.host_adamw_window`). Quantisation is the only difference
from fp32 moments; the master weights and the window sums stay fp32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


#: Elements per quantisation block (one fp32 scale each).
BLOCK = 256

#: Elements per piece of the torch (no-compiler) pass: a multiple of `BLOCK`, small enough for the fp32 pieces of the
#: pass to stay in the cache.
PIECE = 64 * BLOCK

_SIGNED_LEVELS = 127.0
_UNSIGNED_LEVELS = 255.0
# the reciprocals, rounded to fp32 once (as the kernel's constants): a product per element instead of a division
_INV_SIGNED = torch.tensor(1.0, dtype=torch.float32) / _SIGNED_LEVELS
_INV_UNSIGNED = torch.tensor(1.0, dtype=torch.float32) / _UNSIGNED_LEVELS


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

    def index_copy_(self, dim: int, index: torch.Tensor, source: torch.Tensor) -> QuantizedMoment:
        """Write the columns (or rows) `index`: the moment is dequantised, written and quantised again (every block
        keeps its codes and scale unless one of its elements changed: `quantize_into` of `dequantize_into`'s values
        gives back the same codes and scales)."""
        full = self.float()
        full.index_copy_(dim, index, source.to(torch.float32))
        return self.copy_(full)


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
    out.copy_(codes)
    if codes.dtype == torch.int8:
        out.mul_(_INV_SIGNED)
        out.mul_(out.abs()).mul_(scale)  # c * |c| * A
    else:
        out.mul_(_INV_UNSIGNED)
        out.mul_(out).mul_(scale)  # sqrt(v) = (c * c) * R
        out.mul_(out)


def quantize_into(codes: torch.Tensor, scales: torch.Tensor, values: torch.Tensor) -> None:
    """The codes (1-D, int8 or uint8) and per-block `scales` of the fp32 1-D `values`."""
    n = values.numel()
    whole = n // BLOCK * BLOCK
    for lo, hi in ((0, whole), (whole, n)):
        if hi > lo:
            x = values[lo:hi].view(-1, min(BLOCK, hi - lo))
            _quantize(codes[lo:hi].view(x.shape), scales[lo // BLOCK:blocks(hi)], x)


def _sqrt(x: torch.Tensor) -> torch.Tensor:
    """The correctly rounded fp32 square root (the kernel's sqrtf): torch's vectorised fp32 sqrt is not always
    (SLEEF, within 0.5001 ulp: one element in six differs by an ulp), the fp64 one rounded to fp32 is."""
    return x.double().sqrt_().float()


def _quantize(codes: torch.Tensor, scales: torch.Tensor, x: torch.Tensor) -> None:
    signed = codes.dtype == torch.int8
    magnitude = x.abs() if signed else _sqrt(x)  # (exp_avg_sq: coded by its square root, as AdamW divides by it)
    peak = magnitude.amax(dim=1)
    scales.copy_(peak)
    # (an all-zero block takes 1 / 1: its codes are 0, or the unsigned floor 1 that reads back as 0 x 0)
    inverse = torch.where(peak > 0, peak, torch.ones_like(peak)).reciprocal_().view(-1, 1)
    r = _sqrt(magnitude * inverse)
    if signed:
        r.mul_(_SIGNED_LEVELS).round_().copysign_(x)
    else:
        r.mul_(_UNSIGNED_LEVELS).round_().clamp_(1.0, _UNSIGNED_LEVELS)
    codes.copy_(r)


__all__ = ["BLOCK", "PIECE", "QuantizedMoment", "blocks", "dequantize_into", "quantize_into"]
