"""`SplitMatrix`: one weight matrix under ZenFlow, its selected columns on the device and its host state.

Either side may be absent: no device columns before the first selection (or with ``topk_ratio=0``), no host state
when every column lives on the device (``topk_ratio=1``). The device columns are whole (every row); the host state
covers this rank's `Share` of the matrix (all of it with one rank, `distributed/sharding.py`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..distributed.sharding import RankGroup, Share
from ..settings.config import DEVICE_SUM_DTYPES, sums_on_device
from ..transport.cpu_device import kernels
from ..transport.cpu_device.rounding import RESELECTION_SALT, RandomStream, random16
from ..transport.link import Transport
from .device_state import DenseDeviceState, DeviceColumns
from .host import GRAD_SLOTS, HostLayout, HostMatrix
from .quantized_moments import QuantizedMoment
from .schedule import ZenAutoStats
from .selection import column_scores, selection_axis, storage_matrix


class SplitMatrix:
    """One matrix: its device columns and its host state (either may be absent)."""

    __slots__ = ("param", "rows", "axis", "k", "columns", "device", "host", "auto", "window_sum", "window_count",
                 "window_sum_free", "share", "owner", "selected_share")

    def __init__(self, param: torch.Tensor, k: int, rows: bool = False, owner: torch.Tensor | None = None) -> None:
        self.param = param
        # the parameter whose `.grad` holds the gradient: `param` itself, or under FSDP2 the DTensor whose local
        # shard `param` is (`distributed/fsdp.py`)
        self.owner = param if owner is None else owner
        # rows: the param group's `select_rows` (an embedding table, whose input channels are its rows: tokens)
        self.rows = rows
        self.axis = 0 if rows else selection_axis(param)
        assert self.axis is not None
        shape = self.matrix(param).shape
        self.columns = shape[self.axis]
        # the host state's part of the matrix: a range of the dimension that does not index columns (all of it
        # until `attach_host` is given this rank's share)
        self.share = Share(1 - self.axis, shape[1 - self.axis])
        self.k = k
        self.device: DeviceColumns | None = None
        self.host: HostMatrix | None = None
        self.auto = ZenAutoStats()
        # accumulate_on="device" / "device_bf16": the open window's fp32 / bf16 gradient sum on the parameter's
        # device, the steps in it,
        # and (CUDA) the event after which its last device->host copy has read it
        self.window_sum: torch.Tensor | None = None
        self.window_count = 0
        self.window_sum_free: Any = None
        # the device columns' share of the matrix's squared gradient norm at its last selection (None: not selected
        # from a gradient yet; `stats()["selected_grad_share"]`)
        self.selected_share: float | None = None

    def matrix(self, t: torch.Tensor) -> torch.Tensor:
        """The parameter, or its gradient, as this matrix's contiguous `storage_matrix` (host state has its shape):
        dimension `axis` indexes the selectable units."""
        return storage_matrix(t, 1) if self.rows else storage_matrix(t, self.axis)

    def unmatrix(self, m: torch.Tensor) -> torch.Tensor:
        """Inverse of `matrix`: a storage matrix viewed in the parameter's shape and layout."""
        return m.view(self.param.shape) if self.rows or self.axis == 1 else m.t()

    def host_part(self, t: torch.Tensor) -> torch.Tensor:
        """This rank's share of the parameter or its gradient as a storage matrix: what the host state covers."""
        return self.share.local(self.matrix(t))

    def random_stream(self, key: int, share: Share, first_row: int = 0) -> RandomStream:
        """Where the random bits of the host state of `share` come from: the parameter's `key`
        (`rounding.matrix_key`) and its elements' places in the whole parameter's storage matrix, of which this
        process holds the rows from `first_row` on (an FSDP2 shard's offset; 0 otherwise)."""
        cols = self.matrix(self.param).shape[1]
        if share.dim == 0:  # (a range of whole rows)
            return RandomStream(key, (first_row + share.start) * cols)
        return RandomStream(key, first_row * cols + share.start, share.length, cols)

    def attach_host(self, accumulate_on: str, transport: Transport | None = None, share: Share | None = None,
                    grad_dtype: torch.dtype | None = None, layout: torch.dtype | HostLayout = torch.float32,
                    stream: RandomStream | None = None, slots: int = GRAD_SLOTS) -> None:
        """Create the host state of `share` (default: the whole matrix), its link buffers from `transport` (and,
        accumulating on the device, the device-side window sum of that share). `grad_dtype`: the dtype gradients
        cross the link in (default: the gradient's); `layout`: how the host state is stored (`HostLayout`), or the
        host moments' storage dtype alone; `stream`: the random bits that round narrow moments
        (`random_stream`); `slots`: the hand-off slots (`host.grad_slots`)."""
        self.share = share if share is not None else Share(1 - self.axis, self.matrix(self.param).shape[1 - self.axis])
        part = self.host_part(self.param)
        if isinstance(layout, HostLayout):
            layout = layout.on_link(transport if transport is not None else Transport(), self.share.ranks)
        self.host = HostMatrix.create(part, grad_dtype or self.grad_dtype, accumulate_on, transport, layout, stream,
                                      slots)
        if sums_on_device(accumulate_on):
            self.window_sum = torch.zeros(part.shape, dtype=DEVICE_SUM_DTYPES[accumulate_on], device=self.param.device)
            self.window_count = 0

    @property
    def grad_dtype(self) -> torch.dtype:
        return self.param.dtype if self.owner.grad is None else self.owner.grad.dtype

    def detach_host(self) -> None:
        self.host, self.window_sum, self.window_count, self.window_sum_free = None, None, 0, None

    @property
    def offloaded(self) -> bool:
        """True when some columns live on the host (k < in)."""
        return self.k < self.columns

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of this matrix, as it is held, under the keys of its entry: the selection (``k``,
        Zen-auto's statistics, the layout), the device columns (``device_*``), this rank's host state (``host_*``;
        8-bit moments as their codes and per-block scales) with the open window's sum wherever it is kept and the
        steps in it (``accum``: None when empty), and the rank's ``share`` with several. The tensors are the live
        state (the open window's host sum, when held in parts, a new one)."""
        state: dict[str, Any] = {"k": self.k, "auto": self.auto.to_list(), "axis": self.axis, "rows": self.rows}
        if self.device is not None:
            d = self.device
            state.update(device_index=d.index, device_master=d.master, device_exp_avg=d.exp_avg,
                         device_exp_avg_sq=d.exp_avg_sq, device_step=d.step)
        if self.host is not None:
            h = self.host
            # the open window's sum, wherever it is kept (the caller has drained the host worker), in the dtype it is
            # kept in; a sum of the unselected columns only (host_sum_columns="unselected") over every column
            accum, count = (self.window_sum, self.window_count) if self.window_sum is not None else (
                h.full_sum() if h.accum_count else h.accum, h.accum_count)
            state.update(host_master=h.master, host_exp_avg=h.exp_avg, host_exp_avg_sq=h.exp_avg_sq,
                         host_step=h.step, accum=accum if count else None, accum_count=count)
            if h.quantized:
                state.update(host_exp_avg=h.exp_avg.codes, host_exp_avg_sq=h.exp_avg_sq.codes,
                             host_exp_avg_scale=h.exp_avg.scales, host_exp_avg_sq_scale=h.exp_avg_sq.scales)
            if self.share.ranks > 1:
                state["share"] = [self.share.start, self.share.length, self.share.size]
        return state

    @torch.no_grad()
    def load(self, state: dict[str, Any], writeback_fresh: bool = False) -> None:
        """Restore what `state()` gave (a checked checkpoint entry) into this matrix, made for the settings in force
        with `k` the entry's and, where the entry has host state, its own host state (`attach_host`). The entry may
        come from a parameter in the other layout (`column_major_`: every matrix transposed), hold the whole matrix
        where this rank holds a share (it takes its share), 8-bit or wider moments (8-bit ones into 8-bit ones of
        the same blocks as saved; any other pair as their fp32 values, stored as this matrix stores them) and its
        window sum kept on either side; a master left to the fp32 weights (None: loaded before this state) comes
        from the parameter, the device columns' host values beside it. `writeback_fresh`: a host result awaits its
        write-back (the host master is what it writes)."""
        self.auto = ZenAutoStats.from_list(state["auto"])
        # saved from a parameter in the other layout (see `column_major_`): every matrix here is transposed
        flip = not self.rows and int(state.get("axis", 1)) != self.axis

        def fit(t: torch.Tensor) -> torch.Tensor:
            return t.t() if flip and t.ndim == 2 else t

        p = self.param
        if "host_master" in state:
            host = self.host
            # a one-process state dict loaded under several ranks: each takes its share
            mine = (lambda t: self.share.local(fit(t))) if "share" not in state else fit
            whole = "share" in state or self.share.ranks == 1
            if "host_exp_avg_scale" in state and host.quantized and whole and not flip:
                # 8-bit moments into 8-bit moments of the same blocks: the codes and scales as saved (exact)
                for name in ("exp_avg", "exp_avg_sq"):
                    getattr(host, name).copy_codes_(state[f"host_{name}"], state[f"host_{name}_scale"])
            else:
                # any other pair of settings, layout or share: the fp32 values, stored as this matrix stores them
                for name in ("exp_avg", "exp_avg_sq"):
                    getattr(host, name).copy_(mine(_saved_moment(state, name)))
            if state["host_master"] is not None:
                host.master.copy_(mine(state["host_master"]))
            else:
                # the fp32 weights hold the master of every column the host owns (saved with the model, loaded
                # before this state); the device columns' host values are saved beside
                host.master.copy_(self.host_part(p.detach()))
                if "host_master_columns" in state:
                    host.master.index_copy_(self.axis, state["device_index"].long().cpu(),
                                            mine(state["host_master_columns"]).to(host.master.dtype))
            host.step.copy_(state["host_step"])
            # the open window's sum goes wherever this matrix keeps it (either setting can load either)
            target = self.window_sum if self.window_sum is not None else host.accum
            if self.window_sum is not None:
                self.window_count = int(state["accum_count"])
            else:
                host.accum_count = int(state["accum_count"])
            if state["accum"] is not None:
                target.copy_(mine(state["accum"]))
            host.writeback.copy_(host.master)  # a pending write-back reads this buffer
            host.writeback_fresh = writeback_fresh
        if "device_master" in state:
            index = state["device_index"].long()
            # (None: the fp32 weights hold the device columns' master values)
            master = fit(state["device_master"]) if state["device_master"] is not None else \
                self.matrix(p.detach()).index_select(self.axis, index.to(p.device))
            self.device = DeviceColumns.from_columns(
                index, master, fit(state["device_exp_avg"]),
                fit(state["device_exp_avg_sq"]), step=state["device_step"], device=p.device, axis=self.axis,
                grad_dtype=self.grad_dtype,
            )
            self.fit_host_sum()  # (the restored sum, saved over every column, keeps the unselected ones)

    @torch.no_grad()
    def full_state(self, ranks: RankGroup | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """fp32 master, exp_avg and exp_avg_sq of every column, as host `storage_matrix` tensors (new tensors): the
        host state with the device columns on top. Before any state exists: the weights and zero moments. With a
        host state shared by several ranks (`ranks`), a collective: every rank must call it."""
        if self.host is not None:
            host = self.host
            parts = [(self.share, t.float()) for t in (host.master, host.exp_avg, host.exp_avg_sq)]  # (bf16 moments)
            # (a collective on the parameter's device, the full matrices back on the host)
            master, m, v = (ranks or RankGroup()).gather(parts, "full-state all-gather", self.param.device,
                                                         torch.device("cpu"))
        else:
            master = self.matrix(self.param.detach()).float().cpu().clone()
            m, v = torch.zeros_like(master), torch.zeros_like(master)
        if self.device is not None:
            cols = self.device
            index = cols.host_index()
            for full, part in ((master, cols.master), (m, cols.exp_avg), (v, cols.exp_avg_sq)):
                full.index_copy_(self.axis, index, part.cpu())
        return master, m, v

    def release_columns(self, attach_host: Callable[[list[SplitMatrix]], None]) -> bool:
        """The first half of a (re-)selection: the device columns' master values and moments go into this rank's
        host share (creating the host state from the weights when every column was on the device so far: a resumed
        run with a lower topk_ratio). False when no columns are to be chosen: none live on the device (k=0) or all
        of them already do. The caller has drained the host worker."""
        if self.host is None and self.offloaded:
            attach_host([self])
        host = self.host
        # Sync point (re-selection only, every `select_period` steps): the outgoing device columns are copied to the
        # host with one blocking copy (master and moments together).
        if self.device is not None and host is not None:
            idx = self.device.host_index()
            parts = [self.share.local(t) for t in (self.device.master, self.device.exp_avg, self.device.exp_avg_sq)]
            landed = torch.cat([t.reshape(-1) for t in parts]).cpu().split([t.numel() for t in parts])
            # (8-bit moments: the blocks the columns land in are quantised again, stochastically with bits of their
            # own, keyed like a host pass's: exp_avg the low 16, exp_avg_sq the high 16)
            step, stream = int(host.step), host.stream
            for moment, (full, part, flat) in enumerate(zip((host.master, host.exp_avg, host.exp_avg_sq), parts,
                                                            landed), start=-1):
                source = flat.view(part.shape).to(full.dtype)  # (bf16 moments: rounded to nearest, once)
                if moment >= 0 and host.quantized:
                    full.index_copy_(self.axis, idx, source, lambda lo, hi, moment=moment: random16(
                        stream.bits(step, lo, hi, RESELECTION_SALT), moment))
                else:
                    full.index_copy_(self.axis, idx, source)
            if self.k == 0:
                self.device = None  # (topk_ratio now 0) every column lives on the host
                self.fit_host_sum()
        return not (self.k == 0 or (self.device is not None and self.device.k == self.k == self.columns))

    def local_scores(self, grad: torch.Tensor) -> torch.Tensor:
        """Each column's squared L2 norm over this rank's share of `grad` (summed across ranks by the caller)."""
        return column_scores(self.host_part(grad), self.axis)

    def install_columns(self, index: torch.Tensor, cols: list[torch.Tensor] | None,
                        index_on_host: torch.Tensor | None = None) -> None:
        """The second half: the columns `index` move to the device with their whole master values and moments
        `cols` (gathered from the host shares; None: no host state, from the weights with zero moments);
        `index_on_host`: `index` on the host, when the caller has it."""
        if self.device is not None:
            step = self.device.step  # most device columns stay: keep the device path's count
        elif self.host is not None:
            step = self.host.step
        else:
            step = torch.zeros(())
        if cols is None:
            master = self.matrix(self.param).detach().index_select(self.axis, index).float()
            cols = [master, torch.zeros_like(master), torch.zeros_like(master)]
        self.device = DeviceColumns.from_columns(index, *cols, step=step, device=self.param.device, axis=self.axis,
                                                 grad_dtype=self.grad_dtype, index_on_host=index_on_host)
        if not self.offloaded:
            self.detach_host()  # every column on the device (topk_ratio=1): the host keeps nothing
        self.fit_host_sum()
        self.auto.reset()

    def fit_host_sum(self) -> None:
        """``host_sum_columns="unselected"``: the host's window sum keeps the columns that are not on the device
        (`HostMatrix.keep_sum_columns`); called whenever the device columns change."""
        if self.host is None or not self.host.unselected_sums:
            return
        if self.device is None:
            self.host.keep_sum_columns(None, self.axis)
            return
        kept = torch.ones(self.columns, dtype=torch.bool)
        kept[self.device.host_index()] = False
        self.host.keep_sum_columns(kept.nonzero().squeeze(1), self.axis)

def selection_scores(split: SplitMatrix, grad: torch.Tensor) -> torch.Tensor:
    """`split`'s column scores of `grad` on one rank, as `reselection.select_columns` computes them: the CPU
    kernels' row pass for contiguous row-scored matrices (column-major weights, `select_rows`), else
    `SplitMatrix.local_scores`."""
    m = split.matrix(grad)
    if split.axis == 0 and m.ndim == 2 and kernels.supports(m) and kernels.library() is not None:
        return kernels.row_scores([m])[0]
    return split.local_scores(grad)


def master_value(param: torch.Tensor, splits: dict[torch.Tensor, SplitMatrix],
                 dense: dict[torch.Tensor, DenseDeviceState], ranks: RankGroup | None = None) -> torch.Tensor:
    """The fp32 master value of `param` on the host, in its shape: host columns from the host master, device columns
    from the device, a parameter without optimizer state from its weights. With the host state shared by several
    `ranks`, a collective for a split matrix (`SplitMatrix.full_state`)."""
    if param in dense:
        return dense[param].master_of(param).detach().float().cpu().clone()
    split = splits.get(param)
    if split is None:
        return param.detach().float().cpu().clone()
    return split.unmatrix(split.full_state(ranks)[0])


def _saved_moment(state: dict[str, Any], name: str) -> torch.Tensor:
    """A saved host moment (``"exp_avg"`` or ``"exp_avg_sq"``) as its values: 8-bit codes decoded with their
    per-block scales, other dtypes as saved."""
    scales = state.get(f"host_{name}_scale")
    codes = state[f"host_{name}"]
    return codes if scales is None else QuantizedMoment(codes, scales.float()).float()
