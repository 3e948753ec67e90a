"""The broadcast buckets alone (the broadcasts themselves run in test_distributed.py)."""

import torch

from llmsys.sharded_optim import resync
from llmsys.sharded_optim.resync import make_buckets


def layout(buckets, params):
    """Each bucket as (owner, in place, the names of its tensors in ``params``, a dict)."""
    name_of = {id(p): name for name, p in params.items()}
    return [(b.owner, b.in_place, [name_of[id(p)] for p in b.params]) for b in buckets]


def test_owners_send_in_rank_order_large_tensors_alone_small_ones_packed():
    sizes = {"big0": 64, "s1": 3, "s2": 5, "big3": 100, "s4": 2}
    params = {name: torch.randn(n) for name, n in sizes.items()}  # float32
    owners = [1, 0, 1, 0, 1]
    buckets = make_buckets(list(params.values()), owners, bucket_bytes=64 * 4)
    assert layout(buckets, params) == [
        (0, True, ["big3"]),
        (0, True, ["s1"]),  # alone in its bucket: no flat buffer needed
        (1, True, ["big0"]),
        (1, False, ["s2", "s4"]),
    ]
    assert [b.numel for b in buckets] == [100, 3, 64, 7]


def test_a_bucket_is_closed_when_the_next_tensor_would_pass_the_cap():
    params = {f"p{i}": torch.randn(10) for i in range(5)}  # 40 bytes each
    buckets = make_buckets(list(params.values()), [0] * 5, bucket_bytes=100)
    assert layout(buckets, params) == [
        (0, False, ["p0", "p1"]),
        (0, False, ["p2", "p3"]),
        (0, True, ["p4"]),
    ]


def test_dtypes_are_packed_apart():
    params = {"f32": torch.randn(3), "f64": torch.randn(3).double(), "f32b": torch.randn(2)}
    buckets = make_buckets(list(params.values()), [0, 0, 0], bucket_bytes=1000)
    assert layout(buckets, params) == [(0, False, ["f32", "f32b"]), (0, True, ["f64"])]


def test_cap_zero_sends_every_contiguous_tensor_in_place():
    params = {"a": torch.randn(2), "t": torch.randn(4, 3).t(), "b": torch.randn(5)}
    buckets = make_buckets(list(params.values()), [0, 0, 0], bucket_bytes=0)
    assert layout(buckets, params) == [(0, True, ["a"]), (0, True, ["b"]), (0, False, ["t"])]
    assert not buckets[2].in_place  # non-contiguous: through a flat buffer


def test_the_default_cap_is_read_when_called(monkeypatch):
    params = [torch.randn(8), torch.randn(8)]
    assert len(make_buckets(params, [0, 0])) == 1
    monkeypatch.setattr(resync, "BUCKET_BYTES", 0)
    assert len(make_buckets(params, [0, 0])) == 2


def test_no_parameters_no_buckets():
    assert make_buckets([], []) == []
