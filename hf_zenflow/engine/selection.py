"""Which columns go to the device: the selectable units of a matrix (its layout), their scores and the top k.

Column importance is the squared L2 norm of each input column of the gradient viewed as ``[out, in]``: the
gradient's energy is concentrated on a few input channels, and those channels are stable over many steps
(ZenFlow §2), so a selection made on one step's gradient is reused until the next re-selection.
"""

from __future__ import annotations

import math

import torch


#: Elements per piece when scoring columns on the CPU: a slice of ~1M elements keeps the squared temporary cache-sized
#: instead of materialising a full-size fp32 copy of the gradient (a 4096 x 4096 matrix: 48 ms -> 8 ms with 256-row
#: slices); counted in elements so that narrow matrices (a 30522 x 384 embedding: 9.4 -> 4.8 ms) get taller
#: slices rather than thousands of tiny ones.
SCORE_CHUNK_ELEMS = 1 << 20
#: Elements per piece on an accelerator, where each piece costs kernel launches (three or four) and caches do not
#: set the size: at most 64 MiB of fp32 temporary, so a 4096 x 11008 gradient is scored in 3 pieces, not 43.
DEVICE_SCORE_CHUNK_ELEMS = 1 << 24


def score_chunk_elems(device: torch.device) -> int:
    """Elements per piece of `column_scores` on `device`."""
    return SCORE_CHUNK_ELEMS if device.type == "cpu" else DEVICE_SCORE_CHUNK_ELEMS


def selection_axis(t: torch.Tensor) -> int | None:
    """Where a matrix's input columns lie in memory. 1: `t` is row-major, its ``[out, in]`` view's columns are
    strided. 0: `t` is a column-major 2-D matrix, stored as the contiguous ``[in, out]`` transpose (DeepSpeed
    ZenFlow's transposed layout, see `column_major_`), so an input column is a contiguous row. None: any other
    layout (such a tensor is updated densely on the device)."""
    if t.is_contiguous():
        return 1
    if t.ndim == 2 and t.t().is_contiguous():
        return 0
    return None


def storage_matrix(t: torch.Tensor, axis: int) -> torch.Tensor:
    """`t` as a contiguous matrix whose dimension `axis` indexes the input columns: the ``[out, in]`` view
    (axis 1) or the ``[in, out]`` transpose (axis 0). A view when `t` has the parameter's layout (autograd gives
    gradients the parameter's strides); a copy otherwise."""
    if axis == 1:
        return (t if t.is_contiguous() else t.contiguous()).flatten(1)  # (flatten: an FSDP2 shard may have 0 rows)
    m = t.t()
    return m if m.is_contiguous() else m.contiguous()


def num_selected(topk_ratio: float, columns: int) -> int:
    """k for a matrix with `columns` input columns: floor(ratio * columns), at least 1 when the ratio is positive."""
    if topk_ratio <= 0.0:
        return 0
    return min(columns, max(1, math.floor(topk_ratio * columns + 1e-9)))


def column_scores(matrix: torch.Tensor, axis: int = 1) -> torch.Tensor:
    """Squared L2 norm of each input column (dimension `axis` of a `storage_matrix`), in fp32, in row pieces of
    `score_chunk_elems` elements. The first piece's sums are written straight into the scores (the same bits as
    adding them to zeros), so a matrix of one piece costs two or three launches."""
    scores = torch.empty(matrix.shape[axis], dtype=torch.float32, device=matrix.device)
    if matrix.shape[0] == 0 or matrix.shape[1] == 0:  # (an empty FSDP2 shard)
        return scores.zero_()
    rows = max(1, score_chunk_elems(matrix.device) // matrix.shape[1])
    # one scratch buffer for the squares: a fresh allocation per piece page-faults on every piece (~4x slower here)
    scratch = torch.empty(min(rows, matrix.shape[0]) * matrix.shape[1], dtype=torch.float32, device=matrix.device)
    for start in range(0, matrix.shape[0], rows):
        chunk = matrix[start:start + rows]
        squares = scratch[: chunk.numel()].view(chunk.shape)
        if chunk.dtype == torch.float32:
            torch.mul(chunk, chunk, out=squares)
        else:
            squares.copy_(chunk).square_()
        if axis == 0:
            torch.sum(squares, 1, out=scores[start:start + rows])
        elif start == 0:
            torch.sum(squares, 0, out=scores)
        else:
            scores.add_(squares.sum(0))
    return scores


def top_columns(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Indices of the k largest scores, sorted ascending (sorted indices keep gathers cache-friendly)."""
    if k >= scores.numel():
        return torch.arange(scores.numel(), device=scores.device)
    return torch.topk(scores, k, sorted=False).indices.sort().values


def indices_on_host(indices: list[torch.Tensor]) -> list[torch.Tensor]:
    """`indices` (1-D index tensors) on the host, with one device->host copy per device for all of them (a copy
    each would be a blocking sync each)."""
    out: list[torch.Tensor | None] = [None] * len(indices)
    by_device: dict[torch.device, list[int]] = {}
    for i, index in enumerate(indices):
        by_device.setdefault(index.device, []).append(i)
    for device, members in by_device.items():
        if device.type == "cpu":
            for i in members:
                out[i] = indices[i]
            continue
        landed = torch.cat([indices[i] for i in members]).cpu().split([indices[i].numel() for i in members])
        for i, index in zip(members, landed):
            out[i] = index
    return out  # type: ignore[return-value]
