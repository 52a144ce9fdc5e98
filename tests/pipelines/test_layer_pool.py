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


def test_calls_complete_layer_by_layer(tiny_sala_dir, local_ray):
    """LayerPool.run on tiny-sala, RTN on 2 workers: the calls go out the lowest layer first, so a
    layer with some of its results in the driver and others still to come is one of the two in
    flight or the next to start: at most 3 at once, where costliest-first across all layers has
    every layer part-done (the driver would hold part of every layer until the last finished)."""
    import torch

    from pipelines.layer_pool import Job, LayerPool
    from sala.checkpoint import read_config
    from sala.model import SALAForCausalLM
    from sala.quant.layerwise import layer_groups
    from sala.quant.memory import quantize_memory

    config = read_config(tiny_sala_dir)
    with torch.device("meta"):
        layers = SALAForCausalLM(config).model.layers
    jobs = []
    for i, layer in enumerate(layers):
        named = dict(layer.named_modules())
        jobs += [Job(layer=i, group=g, module=m, site=site, cost=named[m].out_features * named[m].in_features)
                 for site, groups in layer_groups(layer).items() for g in groups for m in g]
    per_layer = {i: sum(j.layer == i for j in jobs) for i in range(len(layers))}
    need = quantize_memory(config, 2, 16, 2, "rtn", 1 << 30, 64)
    pool = LayerPool(tiny_sala_dir, torch.zeros(2, 16, dtype=torch.long), 2, 2, 0, need)
    done, most_part_done = {}, 0

    def on_done(job, out):
        nonlocal most_part_done
        done[job.layer] = done.get(job.layer, 0) + 1
        most_part_done = max(most_part_done, sum(0 < n < per_layer[i] for i, n in done.items()))

    pool.run(jobs, {"method": "rtn", "scale_rule": "4over6", "act_order": False, "damp": 0.01}, on_done)
    assert done == per_layer and len(layers) >= 6
    assert most_part_done <= 3, most_part_done


def test_sequential_calls_put_each_layer_once_and_hold_none_every_actor_is_past(tiny_sala_dir, local_ray):
    """LayerPool.run in sequential mode, GPTQ on tiny-sala with 2 workers, layer by layer as the
    main job runs it: a finished layer's results go into the object store once, when a call first
    goes through them, and the driver's reference is dropped once both actors are past the layer,
    so it holds at most one layer's results at any time, whatever the depth (holding every finished
    layer for the run grows with it)."""
    from collections import Counter

    import torch

    from pipelines.layer_pool import Job, LayerPool, results_from_bytes, results_to_bytes
    from sala.checkpoint import read_config
    from sala.model import SALAForCausalLM
    from sala.quant.layerwise import layer_groups
    from sala.quant.memory import quantize_memory

    config = read_config(tiny_sala_dir)
    with torch.device("meta"):
        layers = SALAForCausalLM(config).model.layers
    stored, loads, held = {}, Counter(), []

    def finished(j):
        loads[j] += 1
        return stored[j]

    seqs = torch.randint(3, config.vocab_size, (4, 16), generator=torch.Generator().manual_seed(0))
    need = quantize_memory(config, 4, 16, 2, "gptq", 1 << 30, 64)
    pool = LayerPool(tiny_sala_dir, seqs, 2, 2, 0, need, finished=finished)
    opts = {"method": "gptq", "scale_rule": "4over6", "act_order": False, "damp": 0.01}
    for i, layer in enumerate(layers):
        named = dict(layer.named_modules())
        jobs = [Job(layer=i, group=g, module=m, site=site, cost=named[m].in_features)
                for site, groups in layer_groups(layer).items() for g in groups for m in g]
        results = {}

        def on_done(job, out):
            results.update(results_from_bytes(*out))
            held.append(len(pool.applied))

        pool.run(jobs, opts, on_done)
        stored[i] = results_to_bytes(dict(sorted(results.items())))
    assert len(layers) >= 6 and len(pool.live) == 2
    assert loads == Counter(range(len(layers) - 1)), loads
    assert max(held) <= 1, held
