"""Medusa tree buffers from index paths, checked against a definition written out node by node,
plus the validation errors and the trees chosen by measured acceptance."""
import pytest
import torch

from sala.medusa.tree import (
    MC_SIM_7B_63,
    InvalidTree,
    build_tree,
    by_acceptance,
    expected_accept_length,
    independent_acceptance,
    top_paths,
)


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


def test_trees_by_acceptance_are_nested_prefix_closed_and_best_of_their_size():
    acceptance = {(0,): 0.6, (1,): 0.2, (0, 0): 0.3, (0, 1): 0.12, (1, 0): 0.1, (0, 0, 0): 0.12, (2,): 0.05}
    order = by_acceptance(list(acceptance), acceptance)
    # Most often right first; a tie goes to the shorter path ([0, 1] before [0, 0, 0]), then the lower ranks.
    assert order == [[0], [0, 0], [1], [0, 1], [0, 0, 0], [1, 0], [2]]
    for n in range(1, len(order) + 1):
        build_tree(order[:n], topk=3, num_heads=3)  # every prefix is a tree
        assert top_paths(acceptance, n) == order[:n]
    assert expected_accept_length(acceptance, order[:3]) == pytest.approx(2.1)
    # A stored tree's paths the measurement does not know come last, in BFS order.
    assert by_acceptance([[0], [3], [0, 2], [1]], acceptance) == [[0], [1], [3], [0, 2]]
    # Heads that recorded only per-rank accuracy: each path's acceptance the product of its ranks'.
    estimate = independent_acceptance([[0.6, 0.2, 0.1], [0.5, 0.2, 0.1], [0.4, 0.1, 0.05]], [[0], [0, 0], [1, 0], [0, 0, 0]])
    assert estimate == pytest.approx({(0,): 0.6, (0, 0): 0.3, (1, 0): 0.1, (0, 0, 0): 0.12})
    with pytest.raises(InvalidTree, match="at least one node"):
        top_paths(acceptance, 0)
