"""Stochastic rounding of narrow host moments (`transport/cpu_device/rounding.py`): the random bits are the hash they
are specified to be, in torch as in the kernel; the rounding is exact in expectation; and the bits of an element
are those of its place in the whole parameter, whatever share of it a process holds."""

from __future__ import annotations

import pytest
import torch

from hf_zenflow.distributed.sharding import Share
from hf_zenflow.engine.host import HostLayout, HostMatrix, host_adamw_window
from hf_zenflow.engine.split_matrix import SplitMatrix
from hf_zenflow.transport.cpu_device import kernels
from hf_zenflow.transport.cpu_device.rounding import RandomStream, matrix_key, mix32, random16, round_bf16, splitmix64


HYPER = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}


def test_the_bits_are_the_specified_hash():
    """`RandomStream.bits` is mix32((index mod 2**32) ^ k), k from the pass key and the index's high word, also for
    a share of columns whose global indices cross a multiple of 2**32 (in plain Python integers here)."""
    stream = RandomStream(key=matrix_key(7, 3), base=(1 << 32) - 6, local_cols=5, global_cols=9)
    step = 11
    key = stream.pass_key(step)
    assert key == splitmix64(stream.key ^ splitmix64(step))
    expected = []
    for e in range(23):
        g = stream.base + (e // 5) * 9 + e % 5
        k = (key & 0xFFFFFFFF) ^ mix32(((g >> 32) + (key >> 32)) & 0xFFFFFFFF)
        expected.append(mix32((g & 0xFFFFFFFF) ^ k))
    def unsigned(bits: torch.Tensor) -> list[int]:
        return [b & 0xFFFFFFFF for b in bits.tolist()]

    assert unsigned(stream.bits(step, 0, 23)) == expected
    assert unsigned(stream.bits(step, 7, 19)) == expected[7:19]  # (a piece: the bits of its elements)
    whole = RandomStream(key=stream.key, base=(1 << 32) - 6)  # (whole rows: one run each side of 2**32)
    assert unsigned(whole.bits(step, 0, 12)) == [
        mix32(((stream.base + e) & 0xFFFFFFFF) ^ (key & 0xFFFFFFFF) ^ mix32((((stream.base + e) >> 32) + (key >> 32))
                                                                        & 0xFFFFFFFF)) for e in range(12)]
    assert random16(stream.bits(step, 0, 23), 1).tolist() == [b >> 16 for b in expected]
    assert random16(stream.bits(step, 0, 23), 0).tolist() == [b & 0xFFFF for b in expected]
    assert unsigned(stream.bits(step + 1, 0, 23)) != expected  # (another step, other bits)
    assert RandomStream(key=matrix_key(7, 4)).bits(step, 0, 23).tolist() != RandomStream(
        key=matrix_key(7, 3)).bits(step, 0, 23).tolist()  # (another parameter, other bits)


def test_rounding_is_exact_in_expectation_and_exact_on_representable_values():
    x = torch.tensor([1.0 + 2.0 ** -9, -(3.0 + 2.0 ** -7), 1e-3, 2.0 ** -130, 1.0])
    draws = torch.arange(1 << 16, dtype=torch.int32)  # every 16-bit value once: the exact mean
    rounded = round_bf16(x.repeat(1 << 16, 1).T.contiguous(), draws.repeat(5, 1)).float()
    assert torch.equal(rounded.double().mean(dim=1).float(), x)
    assert torch.equal(rounded[-1], torch.ones(1 << 16))  # (a bf16 value stays itself)
    for row, value in zip(rounded, x.tolist()):  # (the two bf16 values around it, never further)
        seen = sorted(set(row.tolist()))
        assert len(seen) <= 2 and seen[0] <= value <= seen[-1]
        assert torch.equal(torch.tensor(seen).bfloat16().float(), torch.tensor(seen))
    special = torch.tensor([float("inf"), -float("inf"), float("nan")])
    out = round_bf16(special, torch.full((3,), 0xFFFF, dtype=torch.int32)).float()
    assert out[0] == float("inf") and out[1] == -float("inf") and out[2].isnan()
    # a NaN whose payload would carry into the sign (0x7FFFFFFF + 0xFFFF) becomes bf16's quiet NaN, as in the kernel,
    # among finite values alone (their sum is then NaN through the NaN only)
    payload = torch.tensor([0x7FFFFFFF, 0x3F800000, -0x40800000], dtype=torch.int32).view(torch.float32)
    out = round_bf16(payload, torch.full((3,), 0xFFFF, dtype=torch.int32))
    assert out.view(torch.int16).tolist() == [0x7FC0, 0x3F80, -0x4080]  # (1.0 and -1.0: no carry)


@pytest.mark.parametrize("moments", [torch.bfloat16, torch.int8])
@pytest.mark.parametrize("dim", [0, 1])
def test_ranks_shares_round_as_the_whole_matrix(moments, dim):
    """Two ranks' shares of a matrix (rows, or a strided range of columns) take the random bits of their elements'
    places in the whole matrix: bf16 moments are then the one-process moments bit for bit. 8-bit moments are
    quantised by blocks of each share's own storage (their scales differ), so there the bits are compared: each
    share's bits are the whole matrix's at its elements."""
    gen = torch.Generator().manual_seed(0)
    full, grad = torch.randn(20, 33, generator=gen), torch.randn(20, 33, generator=gen)
    split = SplitMatrix(torch.nn.Parameter(full.clone()), 0)
    whole_stream = split.random_stream(12345, Share(dim, full.shape[dim]))
    whole_bits = whole_stream.bits(1, 0, full.numel()).view(full.shape)
    results = {}
    for ranks in (1, 2):
        parts = []
        for rank in range(ranks):
            share = Share(dim, full.shape[dim], ranks, rank)
            stream = split.random_stream(12345, share)
            assert torch.equal(stream.bits(1, 0, share.local(full).numel()).view(share.local(full).shape),
                               share.local(whole_bits))
            host = HostMatrix.create(share.local(full).contiguous(), torch.float32,
                                     moments=HostLayout(moments=moments), stream=stream)
            for _ in range(3):
                host_adamw_window([(HYPER, [host])], last=[(host, share.local(grad).contiguous())])
            parts.append(host.exp_avg_sq.float())
        results[ranks] = torch.cat(parts, dim=dim)
    if moments == torch.bfloat16:
        assert torch.equal(results[1], results[2])


def test_the_kernels_round_with_the_streams_bits():
    """The bf16 pass through the kernel takes each matrix's own stream (another stream: other moments), and its
    bits are the torch pass's (`kernels.window_adamw_bf16_available` checks that once per process)."""
    if not kernels.window_adamw_bf16_available():
        pytest.skip("no CPU kernels here")
    gen = torch.Generator().manual_seed(2)
    master, grad = torch.randn(64, 48, generator=gen), torch.randn(64, 48, generator=gen)
    results = []
    for key in (1, 1, 2):
        host = HostMatrix.create(master, torch.float32, moments=torch.bfloat16, stream=RandomStream(key))
        host.exp_avg_sq.copy_(torch.rand(64, 48, generator=torch.Generator().manual_seed(3)) * 1e-2)
        host_adamw_window([(HYPER, [host])], last=[(host, grad)])
        results.append(host.exp_avg_sq.clone())
    assert torch.equal(results[0], results[1]) and not torch.equal(results[0], results[2])
