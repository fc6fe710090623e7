"""Column scoring, top-k and the window schedule."""

from __future__ import annotations

import pytest
import torch

from hf_zenflow.engine.selection import column_scores, num_selected, top_columns


@pytest.mark.parametrize(("ratio", "columns", "k"), [(0.0, 10, 0), (0.1, 10, 1), (0.1, 5, 1), (0.3, 10, 3),
                                                     (0.29, 100, 29), (1.0, 7, 7), (0.7, 10, 7)])
def test_num_selected(ratio, columns, k):
    assert num_selected(ratio, columns) == k


def test_column_scores_match_dense_computation_across_chunks():
    g = torch.randn(600, 33, dtype=torch.bfloat16)  # 600 rows: three chunks, the last one partial
    expected = g.float().square().sum(0)
    torch.testing.assert_close(column_scores(g), expected)


def test_top_columns_sorted_and_largest():
    scores = torch.tensor([0.1, 5.0, 0.2, 3.0, 9.0])
    assert top_columns(scores, 2).tolist() == [1, 4]
    assert top_columns(scores, 5).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_column_scores_are_the_bits_of_adding_each_piece_to_zeros(monkeypatch, axis, dtype):
    """The first piece's sums written straight into the scores are the bits of adding them to zeros: the same
    scores, piece by piece, as a sum started from zeros."""
    from hf_zenflow.engine import selection

    monkeypatch.setattr(selection, "SCORE_CHUNK_ELEMS", 33 * 64)  # 64-row pieces: 10 of them, the last partial
    g = torch.randn(600, 33, dtype=dtype)
    expected = torch.zeros(g.shape[axis])
    for start in range(0, 600, 64):
        squares = g[start:start + 64].float().square()
        if axis == 1:
            expected.add_(squares.sum(0))
        else:
            expected[start:start + 64] = squares.sum(1)
    assert torch.equal(column_scores(g, axis), expected)
    assert torch.equal(column_scores(torch.empty(0, 33, dtype=dtype), 1), torch.zeros(33))  # (an empty shard)
