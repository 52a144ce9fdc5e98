"""Medusa heads: the block at init, save/load round trip, and the load-time errors."""
import json
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from sala.checkpoint import CheckpointError
from sala.medusa.heads import MedusaConfig, MedusaHeads, load_heads
from sala.medusa.tree import InvalidTree


def lm_head(hidden=16, vocab=50):
    return torch.nn.Linear(hidden, vocab, bias=False)


@pytest.mark.parametrize("shared", [True, False])
def test_untrained_head_is_lm_head_after_a_zero_weight_block(shared):
    head = lm_head()
    heads = MedusaHeads(MedusaConfig(16, 50, num_heads=4, shared_lm_head=shared), head)
    x = torch.randn(3, 16)
    out = heads(x, head)
    assert out.shape == (4, 3, 50)
    for k in range(4):
        bias = heads.b1[k, 0]
        torch.testing.assert_close(out[k], head(x + F.silu(bias)))  # W1 = 0: x + SiLU(b)
    assert (heads.proj is None) == shared
    drafts = heads.draft_tokens(x, head)
    assert drafts.shape == (3, 4, 10) and torch.equal(drafts[:, 0], out[0].topk(10).indices)


@pytest.mark.parametrize("shared", [True, False])
def test_heads_compute_each_head_as_its_own_blocks_and_projection(shared):
    """The stacked heads against a naive loop over each head's tensors as heads.safetensors names
    them: block l of head k is x + SiLU(x W^T + b), then the head's projection (or lm_head)."""
    torch.manual_seed(0)
    head = lm_head()
    heads = MedusaHeads(MedusaConfig(16, 50, num_heads=3, num_layers=2, shared_lm_head=shared, tree=[[0], [0, 0], [1]]), head)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.3)
    tensors = heads.disk_state()
    x = torch.randn(2, 5, 16)
    out = heads(x, head)
    for k in range(3):
        h = x
        for layer in range(2):
            w, b = tensors[f"blocks.{k}.{layer}.linear.weight"], tensors[f"blocks.{k}.{layer}.linear.bias"]
            h = h + F.silu(h @ w.T + b)
        expected = h @ (head.weight if shared else tensors[f"proj.{k}.weight"]).T
        torch.testing.assert_close(out[k], expected, rtol=1e-5, atol=1e-5)


def test_save_load_round_trip_and_mismatches(tmp_path):
    head = lm_head()
    heads = MedusaHeads(MedusaConfig(16, 50, num_heads=4, num_layers=2, shared_lm_head=False), head)
    with torch.no_grad():
        for p in heads.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    heads.save(tmp_path)
    assert sorted(p.name for p in (tmp_path / "medusa").iterdir()) == ["config.json", "heads.safetensors", "manifest.json"]
    model_config = SimpleNamespace(hidden_size=16, vocab_size=50)
    loaded = load_heads(tmp_path, model_config)
    x = torch.randn(2, 16)
    torch.testing.assert_close(loaded(x, head), heads(x, head))
    assert loaded.tree.num_nodes == 64 and not torch.equal(loaded.w1[0, 0], loaded.w1[0, 1])  # independent layers
    with pytest.raises(CheckpointError, match="hidden_size=16, but the model has hidden_size=32"):
        load_heads(tmp_path, SimpleNamespace(hidden_size=32, vocab_size=50))
    with pytest.raises(CheckpointError, match="vocab_size=50, but the model has vocab_size=64"):
        load_heads(tmp_path, SimpleNamespace(hidden_size=16, vocab_size=64))
    with pytest.raises(InvalidTree, match="prefix"):
        load_heads(tmp_path, model_config, tree=[[0], [1, 1]])
    cfg = json.loads((tmp_path / "medusa/config.json").read_text())
    (tmp_path / "medusa/config.json").write_text(json.dumps({**cfg, "tree": [[0, 0, 0, 0, 0]]}))
    with pytest.raises(CheckpointError, match="manifest.json says"):  # the manifest catches an edited file
        load_heads(tmp_path, model_config)
    (tmp_path / "medusa/manifest.json").unlink()
    with pytest.raises(InvalidTree, match="5 deep but there are only 4 heads"):
        load_heads(tmp_path, model_config)
    heads.save(tmp_path / "short")  # a tensor of another shape than the config's: refused, not broadcast
    weights = load_file(str(tmp_path / "short/medusa/heads.safetensors"))
    save_file({**weights, "proj.1.weight": weights["proj.1.weight"][:1]}, str(tmp_path / "short/medusa/heads.safetensors"))
    (tmp_path / "short/medusa/manifest.json").unlink()
    with pytest.raises(CheckpointError, match=r"proj.1.weight has shape \[1, 16\] but the config makes it \[50, 16\]"):
        load_heads(tmp_path / "short", model_config)
    with pytest.raises(CheckpointError, match="no Medusa heads"):
        load_heads(tmp_path / "elsewhere", model_config)


def test_path_acceptance_round_trips_and_older_heads_get_an_estimate(tmp_path):
    """Measured path acceptance is saved and loaded with the heads; heads saved when only per-rank
    accuracy was measured load with each tree path's acceptance estimated from it (the product)."""
    acceptance = [[[0], 0.5], [[0, 0], 0.25], [[1], 0.125]]
    MedusaHeads(MedusaConfig(16, 50, tree=[[0], [1], [0, 0]], path_acceptance=acceptance), lm_head()).save(tmp_path / "new")
    assert load_heads(tmp_path / "new", SimpleNamespace(hidden_size=16, vocab_size=50)).config.acceptance == {
        (0,): 0.5, (0, 0): 0.25, (1,): 0.125}
    MedusaHeads(MedusaConfig(16, 50, num_heads=2, topk=2, tree=[[0], [1], [0, 1]]), lm_head()).save(tmp_path / "old")
    cfg = json.loads((tmp_path / "old/medusa/config.json").read_text())
    del cfg["path_acceptance"]
    (tmp_path / "old/medusa/config.json").write_text(json.dumps({**cfg, "rank_accuracy": [[0.6, 0.2], [0.5, 0.3]]}))
    (tmp_path / "old/medusa/manifest.json").unlink()
    old = load_heads(tmp_path / "old", SimpleNamespace(hidden_size=16, vocab_size=50)).config.acceptance
    assert old == pytest.approx({(0,): 0.6, (1,): 0.2, (0, 1): 0.18})


def test_fewer_heads_or_ranks_get_the_reference_tree_they_can_draft():
    """Heads with fewer than MC_SIM_7B_63's depth or ranks take its paths they can draft, which
    still form a tree (every prefix in it); the named tree itself is refused by the trainer's
    flags for heads that cannot draft it, before anything runs."""
    from pipelines.train_medusa import parse_args
    from sala.medusa.tree import MC_SIM_7B_63

    assert MedusaConfig(16, 50).tree == [list(p) for p in MC_SIM_7B_63]
    for heads, topk, expect in ((1, 10, [[r] for r in range(10)]), (3, 1, [[0], [0, 0], [0, 0, 0]])):
        config = MedusaConfig(16, 50, num_heads=heads, topk=topk)
        assert sorted(config.tree) == expect
        assert MedusaHeads(config, lm_head()).tree.num_nodes == 1 + len(expect)  # built: a valid tree
    config = MedusaConfig(16, 50, num_heads=2, topk=3)
    assert config.tree == [list(p) for p in MC_SIM_7B_63 if len(p) <= 2 and max(p) < 3] and len(config.tree) > 3
    MedusaHeads(config, lm_head())
    with pytest.raises(SystemExit):
        parse_args(["--tree", "mc_sim_7b_63", "--num-heads", "3"])
    with pytest.raises(SystemExit):
        parse_args(["--tree", "mc_sim_7b_63", "--topk", "9"])
    assert parse_args(["--tree", "mc_sim_7b_63"]).tree == "mc_sim_7b_63"


def test_heads_trained_through_a_bf16_lm_head_get_its_gradient():
    """Shared heads on a bf16 lm_head on CPU (whose input gradient is taken a block of columns at a
    time): every head parameter's gradient matches the same heads' through an fp64
    copy of lm_head, to bf16's precision, with hidden wider than one block."""
    hidden, vocab = 600, 70
    torch.manual_seed(0)
    head = lm_head(hidden, vocab).to(torch.bfloat16).requires_grad_(False)
    reference = lm_head(hidden, vocab).double().requires_grad_(False)
    reference.weight.copy_(head.weight)
    heads = MedusaHeads(MedusaConfig(hidden, vocab, num_heads=2, num_layers=1), head)
    with torch.no_grad():
        heads.w1.normal_(std=hidden**-0.5)
    x, target = torch.randn(3, 5, hidden), torch.randint(vocab, (2, 3, 5))
    grads = []
    for projection in (head, reference):
        heads.zero_grad()
        logits = heads(x, projection)
        F.cross_entropy(logits.reshape(-1, vocab), target.reshape(-1)).backward()
        grads.append([p.grad.clone() for p in (heads.w1, heads.b1)])
    for ours, exact in zip(*grads):
        assert ours.abs().max() > 0
        torch.testing.assert_close(ours, exact.float(), rtol=0.05, atol=0.02 * exact.abs().max().item())
