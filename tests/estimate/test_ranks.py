"""The rank split behind `estimate --ranks`: each rank's shares, the all-gather of DDP's write-back, and the validation
of the rank count and engine."""

from __future__ import annotations

import pytest

from hf_zenflow.estimate.ranks import RankSplit, check_parallel, check_ranks


@pytest.mark.parametrize(("ranks", "parallel", "host", "device", "allgather_ms"), [
    # 8 GB of offloaded bf16 weights at 100 GB/s: a ring all-gather moves (N-1)/N of them per GPU
    (1, "ddp", 1.0, 1.0, 0.0),
    (2, "ddp", 0.5, 1.0, 40.0),
    (4, "ddp", 0.25, 1.0, 60.0),
    (8, "ddp", 0.125, 1.0, 70.0),
    (1, "fsdp2", 1.0, 1.0, 0.0),
    (4, "fsdp2", 0.25, 0.25, 0.0),  # each rank writes back its own shard: no weight collective
    (8, "fsdp2", 0.125, 0.125, 0.0),
])
def test_shares_and_allgather(ranks: int, parallel: str, host: float, device: float, allgather_ms: float) -> None:
    split = RankSplit(ranks, parallel)
    assert split.host_share == host and split.link_share == host and split.core_share == host
    assert split.device_share == device
    assert split.allgather_ms(8e9, 100.0) == pytest.approx(allgather_ms)
    assert split.cores_per_rank(64) == pytest.approx(64 / ranks)
    # 1/N of the work on 1/N of the cores and memory bandwidth: as long as the whole step on the whole node
    assert split.host_ms(4600.0) == pytest.approx(4600.0)


def test_one_rank_changes_nothing_exactly() -> None:
    split = RankSplit(1)
    for whole in (4600.0, 1234.567, 1e-3):
        assert split.host_ms(whole) == whole and whole * split.link_share == whole


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2", None])
def test_rank_count_is_an_int_of_at_least_one(bad: object) -> None:
    with pytest.raises(ValueError, match=rf"ranks={bad!r} is invalid: allowed is an integer >= 1"):
        check_ranks(bad)
    with pytest.raises(ValueError, match="ranks="):
        RankSplit(bad)  # type: ignore[arg-type]
    assert check_ranks(8) == 8


def test_parallel_is_ddp_or_fsdp2() -> None:
    with pytest.raises(ValueError, match=r"parallel='zero3' is invalid: allowed are ddp, fsdp2"):
        check_parallel("zero3")
    with pytest.raises(ValueError, match="parallel="):
        RankSplit(2, "fsdp")
    assert "all-gathers" in RankSplit(4).describe() and "no weight collective" in RankSplit(4, "fsdp2").describe()
