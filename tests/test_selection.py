"""Column scoring, top-k and the window schedule."""

from __future__ import annotations

import pytest
import torch

from hf_zenflow.selection import WindowSchedule, ZenAutoStats, column_scores, num_selected, top_columns


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


def test_zen_auto_rule_per_column_means():
    stats = ZenAutoStats()
    # k=2 of 10 columns: selected mass 4 per step (2 per column); unselected 0.4 per step (0.05 per column)
    votes = [stats.update(4.0, 4.4, 2, 10) for _ in range(50)]
    assert votes.index(True) == 39  # 40 steps x 0.05 = 2.0 >= mean selected 2.0
    stats.reset()
    assert stats.update(1.0, 100.0, 2, 10)  # heavy unselected mass: the first step already qualifies


def test_window_schedule_fixed_and_auto():
    fixed = WindowSchedule(warm_up=2, update_interval=3, auto_ratio=0.99, auto_max_interval=16, select_period=6)
    assert fixed.in_warm_up()
    fixed.steps = 2
    assert fixed.selection_due() and not fixed.in_warm_up()
    fixed.window_steps = 3
    assert fixed.window_closes([])
    auto = WindowSchedule(warm_up=0, update_interval=None, auto_ratio=0.5, auto_max_interval=4, select_period=100)
    auto.window_steps = 1
    assert not auto.window_closes([True, False, False])
    assert auto.window_closes([True, True, False])
    auto.window_steps = 4
    assert auto.window_closes([False])
