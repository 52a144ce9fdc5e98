"""The Hessians the quantize workers compute (sala.quant.layerwise.layer_hessians, which every
worker of pipelines/layer_pool.py runs over all calibration shards): each shard's X^T X from its
own forward, summed in shard order, so which worker computes them cannot change a bit."""
import torch

from sala.quant.layerwise import layer_groups, layer_hessians
from tests.model.test_model import random_model


def test_hessians_sum_every_shard_in_order_and_match_a_float64_reference():
    model = random_model()

    def run(layer, x):
        return layer(x, model.model.rope(torch.arange(x.shape[1]).expand(x.shape[0], -1)), None, None, x.shape[1])

    layer = model.model.layers[1]
    g = torch.Generator().manual_seed(0)
    shards = [torch.randn(3, 16, model.config.hidden_size, generator=g) * 10 ** s for s in range(4)]
    inputs = {}  # site -> every token's input, captured by the test's own hooks
    named = dict(layer.named_modules())
    handles = [named[groups[0][0]].register_forward_pre_hook(lambda _m, a, site=site: inputs.setdefault(site, []).append(a[0]))
               for site, groups in layer_groups(layer).items()]
    with torch.no_grad():
        for x in shards:
            run(layer, x)
    for h in handles:
        h.remove()

    got = layer_hessians(layer, 1, shards, run)
    assert set(got) == set(inputs) == {"attn_in", "attn_out", "mlp_in", "mlp_out"}
    for site, xs in inputs.items():
        x = torch.cat([t.reshape(-1, t.shape[-1]) for t in xs]).double()
        torch.testing.assert_close(got[site].double(), 2.0 * x.T @ x / len(x), rtol=1e-5, atol=1e-3)
    assert all(torch.equal(got[s], again) for s, again in layer_hessians(layer, 1, shards, run).items())
    # The shard order is part of the result in fp32 (the test can tell), so it is fixed.
    reordered = layer_hessians(layer, 1, shards[::-1], run)
    assert not torch.equal(reordered["mlp_out"], got["mlp_out"])
    only = layer_hessians(layer, 1, shards, run, sites=("attn_out",))
    assert set(only) == {"attn_out"} and torch.equal(only["attn_out"], got["attn_out"])
