"""The host path: per-matrix host state, gradient accumulation and the host AdamW of a window (the worker that runs
them is `worker.py`).

Host memory per offloaded parameter element (the rules of ``host_state``, `settings.rules`; the defaults'): fp32
master (4 B) + bf16 exp_avg and exp_avg_sq (4 B, ``host_moment_dtype="bfloat16"``) + the window sum: summed on the
host, a bf16 sum of the columns not on the device (``host_sum_dtype="bfloat16"``, ``host_sum_columns="unselected"``:
1.8 B at topk_ratio=0.1, plus the kept columns' indices, `HostMatrix.keep_sum_columns`; each add computed in fp32 and
rounded to nearest bf16, the rule of ``accumulate_on="device_bf16"``, `accumulate_into`; the one-pass kernel widens
it as it reads), or, summed on the device, the accumulator it lands in once per window in its own dtype (fp32 4 B, bf16
2 B; ordinary memory, which the sum reaches through the transport's receive ring of pinned chunks where copies are
asynchronous, and then keeps only the columns not on the device, gathered on the device: 1.8 B in bf16); then
the write-back (``host_writeback="auto"``): on one process from the master itself (copied into the weight,
`HostMatrix.writes_back_master`: nothing more; on CUDA rounded piece by piece into the transport's ring of pinned
chunks), with a host state shared by several ranks from a buffer in the parameter dtype that the worker fills
(2 B for bf16 weights, ordinary memory), and on CUDA a copy of the gradient per in-flight step
when the host sums the window (ordinary memory, reached through the transport's ring of pinned chunks; `grad_slots`: 2
slots with a write-back one step after the close, ``writeback_lag`` + 1 with a later one, x the gradient dtype).
``host_writeback="master"`` says so where it does not apply (several ranks). With fp32
device sums on a CPU device and fp32 weights the write-back buffer is the accumulator itself
(`HostMatrix.shares_writeback`). One moment set (DeepSpeed keeps two).
The bf16 moments are widened, updated in fp32 and rounded back in the same pass (`kernels.window_adamw_bf16`, or
torch's operations in pieces, `_adamw_narrow_moments`); ``"float32"`` keeps them in fp32 (torch's AdamW arithmetic for
every element), ``"int8"`` in 8-bit codes with an fp32 scale per block of 256 (2.03 B; decoded, updated and encoded
in the same pass: `quantized_moments.py`). ``host_state="lean"``: 8-bit moments, bf16 sums of the unselected columns
and the master written back everywhere: 4 + 2.03 + 1.8 = 7.83 B.

The host state keeps the parameter's own memory layout: its `storage_matrix`, [out, in] for a row-major weight,
[in, out] for a column-major one (`column_major_`), so copies between the two sides are contiguous streams. Every
step but the window's last, the whole gradient is added into the accumulator (a contiguous streaming add on the
worker; the window's first step writes it; with ``accumulate_on="device"`` the device sums the window and it lands
here once), and every window the host AdamW updates the whole matrix in one pass that also adds the last step's
gradient and divides by the window's length (`host_adamw_window`); the columns currently on the device are carried
along and simply ignored (their host values are refreshed from the device at re-selection; with
``host_sum_columns="unselected"`` their sum is not kept, and the pass reads a zero one). That
keeps every per-step and per-window host operation contiguous (but the indexed reads of that rule); the only
column moves are the selected columns (device side, every step) and the migration at re-selection, strided for
row-major weights and whole rows for column-major ones.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from .._base import fused_adamw_
from ..settings.config import sums_on_device
from ..transport.cpu_device import kernels
from ..transport.cpu_device.rounding import RandomStream, moment_random16, round_bf16
from ..transport.link import Transport
from .quantized_moments import QuantizedMoment, adamw_pass, kernel_matches


if TYPE_CHECKING:
    from ..settings.config import ZenFlowConfig

logger = logging.getLogger("hf_zenflow")

#: The fewest in-flight gradient hand-offs between the caller and the worker: two let the caller hand over step t+1
#: while the worker still folds step t into the accumulator (a write-back one step after the window's close).
GRAD_SLOTS = 2


def grad_slots(lag: int) -> int:
    """Hand-off slots for a schedule that writes a window's host result back `lag` steps after its close (1 when
    the write-back follows at once): the window's host AdamW job keeps the closing step's slot until it has run,
    and each of the next steps' jobs queues behind it on the in-order worker with its own slot, so the `lag` steps
    up to the write-back (which waits for that AdamW, in `step()`) need `lag` slots beside it; with fewer, a backward
    hook of one of them would wait in `take_slot` for the AdamW while the device idles. Each slot costs a landing
    buffer of every offloaded gradient where the transport stages them (`HostMatrix.staging`).

    Example:
        >>> grad_slots(1), grad_slots(3)
        (2, 4)
    """
    return max(GRAD_SLOTS, lag + 1)

_scratch = threading.local()


def _fp32_scratch(like: torch.Tensor, name: str = "buf") -> torch.Tensor:
    """A reused fp32 buffer shaped (and laid out) like `like`, one per thread and `name`. Adding a bf16 tensor into
    an fp32 one directly is several times slower on CPU than converting into a warm fp32 buffer first and adding
    that; a fresh conversion each time pays page faults instead."""
    buf = getattr(_scratch, name, None)
    if buf is None or buf.numel() < like.numel():
        buf = torch.empty(like.numel(), dtype=torch.float32)
        setattr(_scratch, name, buf)
    return buf[: like.numel()].view(like.shape)


def moment_dtype(setting: str) -> torch.dtype:
    """The storage dtype of the host moments under the rule ``host_moment_dtype=setting`` (int8: the codes of
    `QuantizedMoment`, with their per-block scales)."""
    return {"bfloat16": torch.bfloat16, "int8": torch.int8}.get(setting, torch.float32)


@dataclass(frozen=True)
class HostLayout:
    """How a matrix's host state is stored: the moments' dtype (``host_moment_dtype``), the window sum's when the
    window is summed on the host (``host_sum_dtype``), and where the write-back reads the host result from
    (``host_writeback``: ``"buffer"``, ``"master"``, or ``"auto"``, which `applied` resolves to one of them over a
    transport)."""

    moments: torch.dtype = torch.float32
    sums: torch.dtype = torch.float32
    #: ``host_writeback``: "buffer", "master", or "auto" until resolved (`applied`)
    writeback: str = "buffer"
    #: ``host_sum_columns="unselected"``: the host's window sum keeps only the columns not on the device (summed on
    #: the device, where the sum is copied to the host: `HostMatrix.keeps_unselected_sums`)
    unselected_sums: bool = False
    #: Whether ``host_writeback="master"`` was asked for by `ZenFlowConfig.with_rules` (where it does not apply, a
    #: warning) rather than by a preset (``host_state="lean"``, which cannot be wrong: logged at info level)
    writeback_asked: bool = field(default=False, compare=False)

    @classmethod
    def of(cls, config: ZenFlowConfig) -> HostLayout:
        rules = config.rules
        return cls(moments=moment_dtype(rules.host_moment_dtype),
                   sums=torch.bfloat16 if rules.host_sum_dtype == "bfloat16" else torch.float32,
                   writeback=rules.host_writeback,
                   unselected_sums=rules.host_sum_columns == "unselected",
                   writeback_asked="host_writeback" in config.changed_rules())

    @property
    def writeback_from_master(self) -> bool:
        """Whether the write-back reads the fp32 master itself instead of a buffer in the weight's dtype (a resolved
        layout: `applied`; an unresolved ``"auto"`` reads False)."""
        return self.writeback == "master"

    @staticmethod
    def master_writeback_applies(transport: Transport, ranks: int) -> bool:
        """Whether ``host_writeback="master"`` applies over `transport` with the host state shared by `ranks` ranks
        (`on_link`): on one rank, over every transport (a copy from the master on a CPU device; through the pinned
        ring where copies are asynchronous, `transport.ring`)."""
        return ranks == 1

    def applied(self, transport: Transport, ranks: int) -> HostLayout:
        """The layout as it applies over `transport` with the host state shared by `ranks` ranks (`on_link`, which
        also says so when ``"master"`` does not apply)."""
        if self.writeback == "buffer":
            return self
        master = self.master_writeback_applies(transport, ranks)
        return replace(self, writeback="master" if master else "buffer")

    def on_link(self, transport: Transport, ranks: int) -> HostLayout:
        """The layout as it applies over `transport` with the host state shared by `ranks` ranks: the write-back
        reads the master (``"master"``, and ``"auto"``) only where one rank writes back its whole result (several
        ranks all-gather write-back buffers in the weight's dtype). On a CPU device the master is then copied into
        the weight instead of a buffer being swapped in; where copies are asynchronous each piece of it is rounded
        into a chunk of the transport's ring instead of a buffer's piece being copied there, and the worker no longer
        rounds the master into a buffer after each host step. Where ``"master"`` was set and does not apply, the
        buffer stays, said once: a warning when `with_rules` asked for it, at info level when a preset did
        (``host_state="lean"`` takes the smallest state that applies)."""
        resolved = self.applied(transport, ranks)
        if resolved.writeback == self.writeback or self.writeback == "auto":
            return resolved
        global _warned_writeback
        if not _warned_writeback:
            _warned_writeback = True
            logger.log(logging.WARNING if self.writeback_asked else logging.INFO,
                       'hf_zenflow: host_writeback="master" does not apply here (a host state shared by %d ranks): '
                       "the write-back buffer stays", ranks)
        return resolved


_warned_writeback = False


def accumulate_into(accum: torch.Tensor, grad2d: torch.Tensor, coef: float | None, first: bool) -> None:
    """``accum = grad * coef`` (first step of a window) or ``accum += grad * coef``, in fp32. The one rule for both
    places a window is summed (the host worker, or the device with ``accumulate_on="device"``), so the two give
    the same bits.

    A bf16 `accum` (``accumulate_on="device_bf16"``, or ``host_sum_dtype="bfloat16"`` on the host): the fp32 rule
    on the widened sum, rounded to nearest bf16 after every add (the kernel, or `_accumulate_bf16`): the running
    sum keeps bf16's 8 significant bits."""
    if kernels.supports(grad2d) and accum.device.type == "cpu" and kernels.library() is not None:
        # one pass that reads a bf16 gradient directly (torch needs a conversion pass first), and widens and
        # rounds a bf16 sum in the same loop; same arithmetic
        kernels.accumulate([accum], [grad2d], coef, first)
        return
    if accum.dtype == torch.bfloat16:
        _accumulate_bf16(accum, grad2d, coef, first)
        return
    if first:
        accum.copy_(grad2d)
        if coef is not None:
            accum.mul_(coef)
        return
    if grad2d.dtype != torch.float32 and widens_before_add(grad2d.device):
        grad2d = _fp32_scratch(grad2d).copy_(grad2d)
    if coef is None:
        accum.add_(grad2d)
    else:
        accum.add_(grad2d, alpha=coef)


def widens_before_add(device: torch.device) -> bool:
    """Whether `accumulate_into` widens a narrow gradient into an fp32 scratch before adding it (the CPU, where
    torch's mixed-dtype add is slow; an accelerator adds it as it is, in one kernel: the same exact widening)."""
    return device.type == "cpu"


def _accumulate_bf16(accum: torch.Tensor, grad2d: torch.Tensor, coef: float | None, first: bool) -> None:
    """``accum = round_bf16(widen(accum) + grad * coef)`` for a bf16 window sum, by pieces (`bf16_sum_piece_elems`):
    each piece is widened exactly into an fp32 scratch on the sum's device, gets the fp32 rule of `accumulate_into`
    (the same arithmetic as an fp32 sum, so a bf16 sum is an fp32 sum rounded after every add, bit for bit) and is
    rounded back to nearest. Not torch's in-place bf16 add: on CPU it rounds ``alpha`` (the clip coefficient) to
    bf16 first, a systematic error in the whole step's gradient. The scratch bounds the extra memory to one piece,
    taken once per call (CPU: a per-thread buffer kept between calls)."""
    rows = max(1, bf16_sum_piece_elems(accum.device) // max(1, accum.shape[-1]))
    on_cpu = accum.device.type == "cpu"
    scratch = None if on_cpu else torch.empty(min(rows, accum.shape[0]) * accum.shape[-1], dtype=torch.float32,
                                              device=accum.device)
    for start in range(0, accum.shape[0], rows):
        part = accum[start:start + rows]
        wide = _fp32_scratch(part, "bf16_sum") if scratch is None else scratch[:part.numel()].view(part.shape)
        if not first:
            wide.copy_(part)
        accumulate_into(wide, grad2d[start:start + rows], coef, first)
        part.copy_(wide)


#: Elements per piece of a bf16 window sum added on an accelerator (`_accumulate_bf16`): each piece costs three
#: kernel launches, so pieces are larger than on the CPU (`NARROW_CHUNK`, a cache-friendly 16 MiB of fp32), at most
#: 64 MiB of fp32 scratch: a 4096 x 11008 sum in 3 pieces, not 11.
DEVICE_BF16_PIECE_ELEMS = 1 << 24


def bf16_sum_piece_elems(device: torch.device) -> int:
    """Elements per piece of `_accumulate_bf16` on `device`."""
    return NARROW_CHUNK if device.type == "cpu" else DEVICE_BF16_PIECE_ELEMS


def _scratch_of(shape: tuple[int, ...], dtype: torch.dtype, name: str) -> torch.Tensor:
    """A reused buffer of `shape` and `dtype`, one per thread, `name` and dtype: a piece of a sum that keeps only
    the unselected columns, gathered (at most `NARROW_CHUNK` elements)."""
    key = f"{name}_{str(dtype).rsplit('.', 1)[-1]}"
    numel = 1
    for n in shape:
        numel *= n
    buf = getattr(_scratch, key, None)
    if buf is None or buf.numel() < numel:
        buf = torch.empty(numel, dtype=dtype)
        setattr(_scratch, key, buf)
    return buf[:numel].view(shape)


def _gathers_natively(host: HostMatrix, grad2d: torch.Tensor) -> bool:
    """Whether the CPU kernels add `grad2d`'s kept columns into `host`'s sum directly (`kernels.accumulate` with an
    index: columns of a contiguous matrix)."""
    return (host.sum_index is not None and host.sum_axis == 1 and kernels.supports(grad2d) and grad2d.ndim == 2
            and kernels.library() is not None)


def _accumulate_columns(host: HostMatrix, grad2d: torch.Tensor, coef: float | None) -> None:
    """``host_sum_columns="unselected"``: a step's gradient into a sum that keeps only the columns `sum_index`, each
    kept element by the rule of `accumulate_into` (the bits of a full sum). The CPU kernels read the kept columns in
    place; otherwise (or for kept rows of a column-major matrix: contiguous) they are gathered piece by piece
    (`NARROW_CHUNK` elements of the sum) into a reused buffer in the gradient's dtype and added from there."""
    index, accum, first = host.sum_index, host.accum, host.accum_count == 0
    assert index is not None
    if _gathers_natively(host, grad2d):
        kernels.accumulate([accum], [grad2d], coef, first, [index])
        return
    rows = max(1, NARROW_CHUNK // max(1, accum.shape[1]))
    for start in range(0, accum.shape[0], rows):
        part = accum[start:start + rows]
        gathered = _scratch_of(tuple(part.shape), grad2d.dtype, "gathered")
        if host.sum_axis == 1:  # (rows of the sum are rows of the matrix, fewer columns)
            torch.index_select(grad2d[start:start + rows], 1, index, out=gathered)
        else:  # (rows of the sum are the kept rows of the storage matrix)
            torch.index_select(grad2d, 0, index[start:start + rows], out=gathered)
        accumulate_into(part, gathered, coef, first)


@dataclass
class HostMatrix:
    """Host-side AdamW state of one matrix, as [out, in] tensors: the fp32 master, the moments and the window sum in
    the dtypes of its `HostLayout`."""

    master: torch.Tensor
    exp_avg: torch.Tensor | QuantizedMoment
    exp_avg_sq: torch.Tensor | QuantizedMoment
    step: torch.Tensor
    accum: torch.Tensor
    accum_count: int = 0
    # the dtype each step's gradient reaches the host in (the gradient's own): the staging buffers' on a transport
    # that copies
    grad_dtype: torch.dtype = torch.float32
    # CUDA only: landing buffers for the device->host gradient copy (one per slot; ordinary memory, which the
    # gradient reaches through the transport's ring of pinned chunks, `transport.lander`).
    staging: list[torch.Tensor] = field(default_factory=list)
    # Where the write-back reads the host result: the fp32 master itself (`writes_back_master`), or a buffer in the
    # parameter dtype that the worker fills after each host step: on CUDA copied from through the transport's ring
    # or, under several ranks, into the all-gather (and the event after which every copy has read it); on a CPU
    # device a spare storage for the weight that the write-back swaps in, instead of copying (the weight's old
    # storage becomes the spare). `writeback_fresh`: filled since the last write-back.
    writeback: torch.Tensor | None = None
    writeback_free: object | None = None
    writeback_fresh: bool = False
    # host_sum_columns="unselected": `accum` keeps only the columns `sum_index` (sorted, along `sum_axis` of the
    # storage matrix: the columns not on the device); None while it keeps every column (`keep_sum_columns`)
    unselected_sums: bool = False
    sum_index: torch.Tensor | None = None
    sum_axis: int = 1
    # ... and what the one-pass kernel reads the kept sum through: the kept columns before each column (int32,
    # columns + 1) and the device columns (int32, sorted)
    sum_before: torch.Tensor | None = None
    sum_skipped: torch.Tensor | None = None
    # where the random bits that round bf16 and 8-bit moments come from (the optimizer's seed, the parameter, and
    # this share's place in it: `rounding.RandomStream`)
    stream: RandomStream = field(default_factory=RandomStream)

    @classmethod
    def create(cls, param2d: torch.Tensor, grad_dtype: torch.dtype, accumulate_on: str = "host",
               transport: Transport | None = None, moments: torch.dtype | HostLayout = torch.float32,
               stream: RandomStream | None = None, slots: int = GRAD_SLOTS) -> HostMatrix:
        """Host state for `param2d`, all of it ordinary memory. The write-back buffer crosses to the weight through
        the transport's ring on CUDA (`CopyTransport.put_weights`); the gradient landing buffers, where the transport
        copies each step's gradient (one per hand-off slot), are reached through its lander's ring
        (`transport.lander`). A window summed on the device
        (``accumulate_on="device"`` or ``"device_bf16"``) lands once per window in the accumulator, which is ordinary
        host memory like the master and the moments (the sums cross through the transport's receive ring,
        `CopyTransport.ship_window_sums`). `moments`: the moments' dtype (fp32, or bf16 with
        ``host_moment_dtype="bfloat16"``, int8 for 8-bit codes), or the whole `HostLayout` (the window sum's dtype when
        it is summed on the host; the write-back from the master, where `HostLayout.on_link` kept it). `grad_dtype`:
        the dtype gradients cross the link in. `stream`: where the random bits that round narrow moments come from
        (default: `RandomStream()`, seed 0, the matrix alone). `slots`: the hand-off slots (`grad_slots`; `add_staging`
        adds landing buffers when a later write-back lag needs more)."""
        transport = transport if transport is not None else Transport()  # (references, no pinning)
        layout = moments if isinstance(moments, HostLayout) else HostLayout(moments=moments)
        moments = layout.moments
        on_device = sums_on_device(accumulate_on)
        shape = param2d.shape
        master = torch.empty(shape, dtype=torch.float32).copy_(param2d.detach())
        quantized = moments == torch.int8
        # a window summed on the host, in bf16 with host_sum_dtype="bfloat16" (the device's sums keep their dtype)
        sum_dtype = torch.float32 if on_device else layout.sums
        state = cls(
            master=master,
            exp_avg=QuantizedMoment.zeros(master, signed=True) if quantized else torch.zeros(shape, dtype=moments),
            exp_avg_sq=(QuantizedMoment.zeros(master, signed=False) if quantized
                        else torch.zeros(shape, dtype=moments)),
            step=torch.zeros((), dtype=torch.float32),
            # a device sum lands in the accumulator once per window, in its own dtype (bf16 with "device_bf16":
            # the window's pass widens it as it reads, exactly), through the transport's receive ring where copies
            # are asynchronous: ordinary memory, like a sum made on the host
            accum=torch.zeros(shape, dtype=torch.bfloat16 if accumulate_on == "device_bf16" else torch.float32)
            if on_device else torch.zeros(shape, dtype=sum_dtype),
            grad_dtype=grad_dtype,
            unselected_sums=HostMatrix.keeps_unselected_sums(layout, accumulate_on, param2d.dtype, transport),
            stream=stream if stream is not None else RandomStream(),
        )
        if transport.stages_gradients and not on_device:
            # (ordinary memory: the gradients land here from the transport's ring of pinned chunks)
            state.staging = [torch.empty(shape, dtype=grad_dtype) for _ in range(slots)]
        if HostMatrix.shares_writeback(param2d.dtype, accumulate_on, transport):
            # the window sum is read by the host AdamW pass, after which the buffer is free until the next window's
            # sum lands at the next close (after the write-back: `HostWindows.close_window`): the rounded master
            # goes into the same buffer, 4 B per element less
            state.writeback = state.accum.copy_(param2d.detach())
        elif layout.writeback_from_master:
            # host_writeback="master": no buffer; the write-back copies the master itself (`writes_back_master`:
            # through the transport's pinned ring where copies are asynchronous), which the worker's next pass
            # writes only after the write-back has read it
            state.writeback = state.master
        else:
            # initialised: a matrix that gets no gradient in a window is written back from it unchanged. Ordinary
            # memory: where copies are asynchronous it crosses through the transport's ring of pinned chunks
            state.writeback = torch.empty(shape, dtype=param2d.dtype).copy_(param2d.detach())
        return state

    @staticmethod
    def shares_writeback(param_dtype: torch.dtype, accumulate_on: str, transport: Transport) -> bool:
        """Whether the write-back buffer is the accumulator itself: with the window summed on the device, the host
        accumulator only holds a landed sum from its arrival at a window's close to the end of that window's host
        AdamW pass, and the write-back buffer only a result from then to the write-back, which comes before the
        next close. One fp32 buffer serves both when the weights are fp32 (other dtypes keep their own) and the
        copies are synchronous (a CPU device, CPU FSDP2 shards). With asynchronous copies (CUDA) the next sum's
        device->host copy would be ordered after the write-back's host->device copy by stream order, but that is
        not tested against the asynchronous double (whose buffers read as NaN from the enqueue on): the
        two buffers stay separate there."""
        return accumulate_on == "device" and param_dtype == torch.float32 and not transport.pins_host_memory

    @staticmethod
    def keeps_unselected_sums(layout: HostLayout, accumulate_on: str, param_dtype: torch.dtype,
                              transport: Transport) -> bool:
        """Whether the window sum keeps only the columns not on the device (``host_sum_columns="unselected"``,
        `keep_sum_columns`): a sum made on the host, always; a device sum's accumulator where the sum is copied into
        it (`Transport.copies_window_sums`: CUDA, the kept columns gathered on the device; on a CPU device it is
        swapped in whole) and the accumulator is not also the write-back buffer (`shares_writeback`)."""
        if not layout.unselected_sums:
            return False
        if not sums_on_device(accumulate_on):
            return True
        return transport.copies_window_sums and not HostMatrix.shares_writeback(param_dtype, accumulate_on, transport)

    def add_staging(self, slots: int) -> int:
        """Landing buffers up to `slots` (`grad_slots`) where the transport stages gradients (`staging`); returns
        how many were added."""
        if not self.staging:
            return 0
        missing = slots - len(self.staging)
        first = self.staging[0]
        self.staging += [torch.empty(first.shape, dtype=first.dtype) for _ in range(missing)]
        return max(0, missing)

    @staticmethod
    def writeback_bytes(param2d: torch.Tensor, accumulate_on: str, transport: Transport,
                        layout: HostLayout | None = None) -> int:
        """Bytes of the write-back buffer `create` makes for `param2d` (none where the write-back reads the
        accumulator or the master), under `layout` as it applies over `transport` (`HostLayout.applied`)."""
        shared = HostMatrix.shares_writeback(param2d.dtype, accumulate_on, transport)
        from_master = layout is not None and layout.writeback_from_master
        return 0 if shared or from_master else param2d.numel() * param2d.element_size()

    def keep_sum_columns(self, unselected: torch.Tensor | None, axis: int) -> None:
        """``host_sum_columns="unselected"``: the window sum keeps the columns `unselected` (sorted indices along
        `axis` of the storage matrix; None: every column). Called when the device columns change, which the
        scheduled re-selection does between windows (the sum is empty); a matrix's first selection may come
        mid-window, and then the kept columns' partial sums move along (the newly selected ones are dropped: the
        host's result for them is never read)."""
        if not self.unselected_sums:
            return
        if unselected is not None and unselected.numel() == self.master.shape[axis]:
            unselected = None  # (nothing on the device)
        if unselected is None and self.sum_index is None:
            return
        if (unselected is not None and self.sum_index is not None and self.sum_axis == axis
                and torch.equal(unselected, self.sum_index)):
            return
        index = None if unselected is None else unselected.to("cpu", torch.long)
        if self.accum_count:
            # (rare: one transient full-width copy of this matrix's sum)
            full = self.full_sum()
            self.accum = full if index is None else full.index_select(axis, index)
        else:
            shape = list(self.master.shape)
            if index is not None:
                shape[axis] = index.numel()
            self.accum = torch.zeros(shape, dtype=self.accum.dtype)
        self.sum_index, self.sum_axis, self.sum_before, self.sum_skipped = index, axis, None, None
        if index is not None:
            kept = torch.zeros(self.master.shape[axis] + 1, dtype=torch.int32)
            kept[index + 1] = 1
            self.sum_before = kept.cumsum(0, dtype=torch.int32)
            self.sum_skipped = (kept[1:] == 0).nonzero().squeeze(1).to(torch.int32)

    def full_sum(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The window sum over every column, as a new tensor when `accum` keeps only the unselected ones (zeros in
        the device columns) or `dtype` differs; `accum` itself otherwise."""
        dtype = dtype or self.accum.dtype
        if self.sum_index is None:
            return self.accum if self.accum.dtype == dtype else self.accum.to(dtype)
        full = torch.zeros(self.master.shape, dtype=dtype)
        return full.index_copy_(self.sum_axis, self.sum_index, self.accum.to(dtype))

    def accumulate(self, grad2d: torch.Tensor, coef: float | None) -> None:
        """Fold one step's gradient (times the clip coefficient) into the window sum, in fp32."""
        if self.sum_index is not None:
            _accumulate_columns(self, grad2d, coef)
        else:
            accumulate_into(self.accum, grad2d, coef, first=self.accum_count == 0)
        self.accum_count += 1

    @staticmethod
    def accumulate_all(pairs: list[tuple[HostMatrix, torch.Tensor]], coef: float | None) -> None:
        """`accumulate` for one step's batch of (matrix, gradient) pairs. CPU tensors go through the kernels in one
        call per window position (first step or not) instead of one per matrix: fewer Python steps on the worker
        thread, which shares the GIL with the training thread."""
        native: dict[bool, list[tuple[HostMatrix, torch.Tensor]]] = {True: [], False: []}
        for host, g2d in pairs:
            if (_gathers_natively(host, g2d) if host.sum_index is not None else (
                    kernels.supports(g2d) and host.accum.device.type == "cpu" and kernels.library() is not None)):
                native[host.accum_count == 0].append((host, g2d))
            else:
                host.accumulate(g2d, coef)
        for first, batch in native.items():
            if batch:
                kernels.accumulate([h.accum for h, _ in batch], [g for _, g in batch], coef, first,
                                   [h.sum_index for h, _ in batch])
                for host, _ in batch:
                    host.accum_count += 1

    @property
    def writes_back_master(self) -> bool:
        """Whether the write-back reads the fp32 master itself (``host_writeback="master"``): the transport copies it
        into the weight, rounded to the weight's dtype, and never takes it as the weight's storage."""
        return self.writeback is self.master

    @property
    def quantized(self) -> bool:
        """Whether the moments are stored in 8 bits (``host_moment_dtype="int8"``)."""
        return isinstance(self.exp_avg, QuantizedMoment)

    def nbytes(self) -> int:
        tensors = [self.master, self.accum, *self.staging]
        for moment in (self.exp_avg, self.exp_avg_sq):
            tensors += [moment.codes, moment.scales] if isinstance(moment, QuantizedMoment) else [moment]
        if self.sum_index is not None:
            # (8 B per kept column, 4 per column and 4 per device column: about 12 / rows B per element)
            tensors += [self.sum_index, self.sum_before, self.sum_skipped]
        # (no buffer of its own: the accumulator, `shares_writeback`, or the master, `writes_back_master`)
        if self.writeback is not None and self.writeback is not self.accum and self.writeback is not self.master:
            tensors.append(self.writeback)
        return sum(t.numel() * t.element_size() for t in tensors)


#: Elements per piece of a matrix whose moments are stored narrow: bounds the fp32 scratch (two buffers of this
#: many fp32 per worker thread, 32 MiB) whatever the largest matrix (a 7B model's embedding: 131 M elements).
NARROW_CHUNK = 1 << 22
#: Elements per piece of the torch pass over bf16 moments: its twenty-odd passes over one piece (the update, the
#: random bits, the rounding) stay in the cache (1 MiB per fp32 buffer) instead of streaming through memory.
ROUNDING_PIECE = 1 << 18


def _adamw_narrow_moments(m: HostMatrix, hyper: dict) -> None:
    """The host AdamW of a matrix whose moments are stored narrow (bf16) through torch's operations (where the
    one-pass kernel does not run: no C compiler, or tensors it does not take): torch's fused kernel wants one dtype per
    call, so each piece of the moments is widened into two per-thread fp32 scratch buffers, updated by the same
    fp32 kernel as fp32 moments (against the fp32 master and window mean), and rounded back stochastically with the
    matrix's random bits for its new step count (`rounding.round_bf16`; the kernel's bits). AdamW is elementwise,
    so pieces give the bits of one call; each piece steps a copy of the step count, which then becomes the
    matrix's."""
    tensors = (m.master, m.accum, m.exp_avg, m.exp_avg_sq)
    if not all(t.is_contiguous() for t in tensors):
        tensors = tuple(t.t() for t in tensors)  # column-major (`column_major_`): contiguous as transposes
    flat = [t.view(-1) for t in tensors]  # (raises rather than copy, should a layout ever not be contiguous)
    step, pass_step = m.step, int(m.step) + 1
    for start in range(0, flat[0].numel(), ROUNDING_PIECE):
        master, accum, exp_avg, exp_avg_sq = (t[start:start + ROUNDING_PIECE] for t in flat)
        avg = _fp32_scratch(exp_avg, "avg").copy_(exp_avg)
        avg_sq = _fp32_scratch(exp_avg_sq, "avg_sq").copy_(exp_avg_sq)
        step = m.step.clone()
        fused_adamw_([master], [accum], [avg], [avg_sq], [step], hyper)
        random_m, random_v = moment_random16(m.stream, pass_step, start, start + exp_avg.numel())
        round_bf16(avg, random_m, out=exp_avg)
        round_bf16(avg_sq, random_v, out=exp_avg_sq)
    m.step.copy_(step)


#: The window sums the one-pass kernel reads: fp32, or bf16 (``host_sum_dtype="bfloat16"``), widened as it reads.
_SUM_DTYPES = (torch.float32, torch.bfloat16)


def _moment_kind(m: HostMatrix) -> torch.dtype:
    """How `m`'s moments are stored: torch.float32, torch.bfloat16 or torch.int8 (codes and scales)."""
    return torch.int8 if m.quantized else m.exp_avg.dtype  # type: ignore[union-attr]


def _fusable(m: HostMatrix, grad2d: torch.Tensor | None) -> bool:
    """Whether `m`'s window can run through the one-pass kernel (`kernels.window_adamw`), with fp32 moments, bf16
    ones (widened and rounded back block by block) or 8-bit ones (the kernel reads and writes their codes and
    scales)."""
    if m.quantized:
        tensors = (m.master, m.accum, m.exp_avg.codes, m.exp_avg_sq.codes)  # type: ignore[union-attr]
        return (all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
                and m.master.dtype == torch.float32 and m.accum.dtype in _SUM_DTYPES and m.master.numel() > 0
                and (grad2d is None or (kernels.supports(grad2d) and grad2d.shape == m.master.shape))
                and kernels.window_adamw_available() and kernel_matches())
    tensors = (m.master, m.accum, m.exp_avg, m.exp_avg_sq)
    narrow = m.exp_avg.dtype == torch.bfloat16
    moment_dtype = torch.bfloat16 if narrow else torch.float32
    return (all(t.device.type == "cpu" and t.is_contiguous() for t in tensors)
            and m.master.dtype == torch.float32 and m.accum.dtype in _SUM_DTYPES
            and m.exp_avg.dtype == m.exp_avg_sq.dtype == moment_dtype
            and m.master.numel() > 0
            and (grad2d is None or (kernels.supports(grad2d) and grad2d.shape == m.master.shape))
            and (kernels.window_adamw_bf16_available() if narrow else kernels.window_adamw_available()))


def _plain_adamw(plain: list[HostMatrix], hyper: dict) -> None:
    """The host AdamW of `plain` (fp32 window sums, not through the one-pass kernel): the sum divided by the window's
    length in place, then torch's fused AdamW (fp32 moments, in one call) or its narrow-moment passes."""
    for m in plain:
        if m.accum_count > 1:
            m.accum.div_(m.accum_count)
    # fp32 moments in one call; bf16 and 8-bit moments piece by piece below
    wide = [m for m in plain if not m.quantized and m.exp_avg.dtype == torch.float32]
    fused_adamw_(
        [m.master for m in wide], [m.accum for m in wide], [m.exp_avg for m in wide],
        [m.exp_avg_sq for m in wide], [m.step for m in wide], hyper,
    )
    for m in plain:
        if m.quantized:
            adamw_pass(m.master, m.accum, m.exp_avg, m.exp_avg_sq, m.step, hyper, m.stream)
        elif m.exp_avg.dtype != torch.float32:
            _adamw_narrow_moments(m, hyper)


def host_adamw_window(groups: list[tuple[dict, list[HostMatrix]]],
                      last: list[tuple[HostMatrix, torch.Tensor]] | None = None, coef: float | None = None) -> None:
    """The host AdamW step of one window: mean gradient of the window, one fused call per param group.

    `last`: the window's last step's (matrix, gradient) pairs, not yet summed (times `coef`, the clip coefficient):
    they are folded into the AdamW pass. With the CPU kernels (`kernels.window_adamw`) that is one pass over the
    state per matrix (sum, mean and AdamW together), bit-identical to summing, dividing by the window's length and
    running torch's fused AdamW, which is what the fallback does. A window summed on the device (``last`` empty)
    gets the division folded in the same way.

    Matrices that received no gradient during the window are left alone, as torch's AdamW skips parameters
    without a gradient.
    """
    pending = {id(m): g for m, g in (last or [])}
    for hyper, matrices in groups:
        fused: list[tuple[HostMatrix, torch.Tensor | None]] = []
        plain: list[HostMatrix] = []
        for m in matrices:
            g = pending.pop(id(m), None)
            if (g is not None or m.accum_count > 0) and _fusable(m, g):
                fused.append((m, g))
                continue
            if g is not None:
                m.accumulate(g, coef)
            if m.accum_count > 0:
                plain.append(m)
        for kind in (torch.float32, torch.bfloat16, torch.int8):  # (one kernel call per kind of moments)
            batch = [(m, g) for m, g in fused if _moment_kind(m) == kind]
            if not batch:
                continue
            common = ([m.master for m, _ in batch], [m.accum for m, _ in batch], [g for _, g in batch],
                      [m.accum_count == 0 for m, _ in batch], [m.accum_count + (g is not None) for m, g in batch])
            # (a sum of the unselected columns only is spread by the kernel, block by block: zeros elsewhere)
            kept = [None if m.sum_before is None else (m.sum_before, m.sum_skipped, m.sum_axis) for m, _ in batch]
            if kind == torch.int8:
                kernels.window_adamw_quantized(
                    *common, [m.exp_avg.codes for m, _ in batch], [m.exp_avg.scales for m, _ in batch],
                    [m.exp_avg_sq.codes for m, _ in batch], [m.exp_avg_sq.scales for m, _ in batch],
                    [m.step for m, _ in batch], hyper, coef, kept=kept, streams=[m.stream for m, _ in batch])
            elif kind == torch.bfloat16:
                kernels.window_adamw_bf16(*common, [m.exp_avg for m, _ in batch], [m.exp_avg_sq for m, _ in batch],
                                          [m.step for m, _ in batch], hyper, coef, kept=kept,
                                          streams=[m.stream for m, _ in batch])
            else:
                kernels.window_adamw(*common, [m.exp_avg for m, _ in batch], [m.exp_avg_sq for m, _ in batch],
                                     [m.step for m, _ in batch], hyper, coef, kept=kept)
        _plain_adamw([m for m in plain if m.accum.dtype == torch.float32 and m.sum_index is None], hyper)
        for m in plain:
            if m.accum.dtype != torch.float32 or m.sum_index is not None:
                # a bf16 window sum, or one of the unselected columns only, without the kernel: widened into a
                # full fp32 copy of this one matrix (transient), then the pass of an fp32 sum (the kernel widens
                # it block by block instead: the same bits)
                summed, m.accum = m.accum, m.full_sum(torch.float32)
                try:
                    _plain_adamw([m], hyper)
                finally:
                    m.accum = summed
        for m in [m for m, _ in fused] + plain:
            m.accum_count = 0
            if m.writeback is not None:
                if not m.writes_back_master:
                    # Sync point (worker waits on the device): the previous host->device copy of this buffer,
                    # enqueued at the last window boundary, must have finished reading it before we overwrite it.
                    if m.writeback_free is not None:
                        m.writeback_free.synchronize()  # type: ignore[attr-defined]
                    m.writeback.copy_(m.master)
                m.writeback_fresh = True
    for m, g in (last or []):  # (a matrix in no group: summed, as an accumulate job would)
        if id(m) in pending:
            m.accumulate(g, coef)
