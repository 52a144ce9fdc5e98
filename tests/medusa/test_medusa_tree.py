"""Medusa tree buffers from index paths, checked against a definition written out node by node,
plus the validation errors and the greedy builder."""
import pytest
import torch

from sala.medusa.tree import MC_SIM_7B_63, InvalidTree, build_tree, greedy_tree


def test_mc_sim_7b_63_buffers():
    tree = build_tree(MC_SIM_7B_63)
    assert tree.num_nodes == 64 and tree.max_depth == 4
    assert torch.bincount(tree.depths).tolist() == [1, 10, 28, 23, 2]
    assert tuple(tree.retrieve_indices.shape) == (42, 5)
    paths = [()] + list(tree.choices)
    assert sorted(paths, key=lambda p: (len(p), p)) == paths  # BFS order
    for i, p in enumerate(paths):
        assert tree.depths[i] == len(p)
        if i:
            assert paths[tree.parents[i]] == p[:-1] and tree.parents[i] < i
            assert tree.candidate_indices[i] == 1 + 10 * (len(p) - 1) + p[-1]
        ancestors = {j for j, a in enumerate(paths) if p[: len(a)] == a}
        assert set(tree.ancestor_mask[i].nonzero()[:, 0].tolist()) == ancestors
    # Retrieve rows: every leaf exactly once, each row its root-to-leaf chain.
    leaves = {i for i, p in enumerate(paths) if not any(q[: len(p)] == p and len(q) > len(p) for q in paths)}
    rows = [[n for n in r if n >= 0] for r in tree.retrieve_indices.tolist()]
    assert {r[-1] for r in rows} == leaves and len(rows) == len(leaves)
    for r in rows:
        assert r[0] == 0 and all(tree.parents[b] == a for a, b in zip(r, r[1:]))


@pytest.mark.parametrize("choices, kwargs, message", [
    ([[0], [1, 0]], {}, "prefix [1] is not in the tree"),
    ([[0], [0, 10]], {}, "outside the heads' top-10"),
    ([[0], [0, 0], [0, 0, 0]], {"num_heads": 2}, "only 2 heads"),
    (MC_SIM_7B_63, {"max_nodes": 32}, "63 nodes, more than the budget of 32"),
    ([[0], [0]], {}, "more than once"),
    ([], {}, "no paths"),
])
def test_invalid_trees_name_the_problem(choices, kwargs, message):
    with pytest.raises(InvalidTree, match=message.replace("[", r"\[").replace("]", r"\]")):
        build_tree(choices, **kwargs)


def test_greedy_tree_takes_the_best_paths_by_product_accuracy():
    acc = torch.tensor([[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]])
    paths = greedy_tree(acc, 6)
    build_tree(paths, topk=3, num_heads=3)  # prefix-closed and within the heads
    score = {tuple(p): torch.tensor([acc[d, r] for d, r in enumerate(p)]).prod().item() for p in paths}
    # The 6 best prefix-closed paths by product: 0.6, 0.3, 0.2, 0.12 ([0,0,0]), 0.12 ([0,1]), 0.1 ([1,0]).
    assert sorted(score.values(), reverse=True) == pytest.approx([0.6, 0.3, 0.2, 0.12, 0.12, 0.1])
    assert [0] in paths and [0, 0] in paths and [1] in paths and [0, 0, 0] in paths
    with pytest.raises(InvalidTree, match="at least one node"):
        greedy_tree(acc, 0)
