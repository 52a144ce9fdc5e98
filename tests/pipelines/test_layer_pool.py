"""The driver's Hessian reduction (pipelines/layer_pool.py) sums per-shard X^T X in shard order,
so how shards are spread over workers cannot change a bit of the result."""
import torch

from pipelines.layer_pool import LayerPool


def test_hessians_do_not_depend_on_how_shards_are_spread_over_workers():
    g = torch.Generator().manual_seed(0)
    sums = {s: {"attn_in": ((x := torch.randn(300, 32, generator=g) * 10 ** s).T @ x, 300)} for s in range(4)}
    one_worker = [{s: sums[s] for s in range(4)}]
    two_workers = [{1: sums[1], 3: sums[3]}, {0: sums[0], 2: sums[2]}]  # as replies arrive: any order
    a, b = LayerPool._reduce(None, one_worker)["attn_in"], LayerPool._reduce(None, two_workers)["attn_in"]
    assert torch.equal(a, b)
    in_reply_order = sum(p[s]["attn_in"][0] for p in two_workers for s in p) * (2.0 / 1200)
    assert not torch.equal(in_reply_order, a)  # the order does matter in fp32: the test can tell
    expected = sum(sums[s]["attn_in"][0].double() for s in range(4)) * (2.0 / 1200)
    torch.testing.assert_close(a.double(), expected, rtol=1e-6, atol=0)
