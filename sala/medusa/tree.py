"""A Medusa draft tree: index paths (Medusa's `medusa_choices` format) and the buffers one
verify step needs.

A path [i0, i1, ..., i_{d-1}] is a node at depth d whose token is the i0-th ranked token of
head 0 at depth 1, the i1-th of head 1 at depth 2, and so on; node 0 is the root (the token
the base model chose). Heads all read the same hidden state, so a node's token depends only on
(depth, rank): the tree is a pruned Cartesian product of per-head top-k lists.

Nodes are kept in BFS order (sorted by length, then lexicographically), so every parent index
is smaller than its children's: the topological order the depth-wise scans rely on.

Buffers (T = nodes + 1 root):
- parents [T]: parent node of each node (-1 for the root);
- depths [T]: 0 for the root; also the position offset of the node (siblings share a position);
- ancestor_mask [T, T] bool: row i marks i's ancestors and i itself (Medusa's tree attention mask);
- candidate_indices [T]: index of each node's token in the flat candidate vector
  [root, head0 top-k, head1 top-k, ...], i.e. 1 + topk * (depth - 1) + rank;
- retrieve_indices [leaves, max_depth + 1]: one row per root-to-leaf path, node indices root
  first, padded with -1.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

# Medusa's default tree (FasterDecoding/Medusa, medusa_choices.py `mc_sim_7b_63`): 63 nodes,
# depth 4, ranks up to 9, measured on Vicuna-7B heads.
MC_SIM_7B_63 = [
    [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4], [2, 0], [0, 5], [0, 0, 1],
    [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8], [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0],
    [0, 2, 0], [1, 2], [0, 0, 3], [4, 0], [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6],
    [0, 3, 0], [5, 0], [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
    [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0], [0, 6, 0],
    [0, 0, 0, 1], [1, 6], [0, 7, 0],
]


class InvalidTree(ValueError):
    """A tree that cannot be verified: a path whose prefix is missing, a rank beyond the heads'
    top-k, a depth beyond the number of heads, a duplicate, or more nodes than the budget."""


@dataclass(frozen=True)
class MedusaTree:
    choices: tuple[tuple[int, ...], ...]  # the paths, in BFS order (node i + 1 is choices[i])
    topk: int
    parents: torch.Tensor
    depths: torch.Tensor
    ancestor_mask: torch.Tensor
    candidate_indices: torch.Tensor
    retrieve_indices: torch.Tensor

    @property
    def num_nodes(self) -> int:
        """Tokens verified per step: the root plus every path."""
        return len(self.choices) + 1

    @property
    def max_depth(self) -> int:
        return max((len(c) for c in self.choices), default=0)

    @property
    def levels(self) -> list[list[int]]:
        """Node indices at each depth, root first."""
        return [[0]] + [[i + 1 for i, c in enumerate(self.choices) if len(c) == d] for d in range(1, self.max_depth + 1)]

    def to(self, device) -> MedusaTree:
        moved = {k: getattr(self, k).to(device) for k in ("parents", "depths", "ancestor_mask", "candidate_indices",
                                                           "retrieve_indices")}
        return MedusaTree(self.choices, self.topk, **moved)


def build_tree(choices, topk: int = 10, num_heads: int | None = None, max_nodes: int | None = None) -> MedusaTree:
    """Validate `choices` and build the verify buffers. `num_heads` bounds the depth, `max_nodes`
    the number of paths (the root is not counted, as in Medusa's "63")."""
    paths = [tuple(int(i) for i in p) for p in choices]
    if not paths:
        raise InvalidTree("the tree has no paths: give at least one, e.g. [[0]]")
    if len(set(paths)) != len(paths):
        dup = next(p for p in paths if paths.count(p) > 1)
        raise InvalidTree(f"path {list(dup)} appears more than once")
    if max_nodes is not None and len(paths) > max_nodes:
        raise InvalidTree(f"the tree has {len(paths)} nodes, more than the budget of {max_nodes}")
    known = set(paths)
    for p in paths:
        if not p:
            raise InvalidTree("an empty path: the root is implicit, list only the nodes below it")
        if any(r < 0 or r >= topk for r in p):
            raise InvalidTree(f"path {list(p)} has rank {max(p) if max(p) >= topk else min(p)} outside the heads' "
                              f"top-{topk} (ranks 0 .. {topk - 1})")
        if num_heads is not None and len(p) > num_heads:
            raise InvalidTree(f"path {list(p)} is {len(p)} deep but there are only {num_heads} heads")
        if len(p) > 1 and p[:-1] not in known:
            raise InvalidTree(f"path {list(p)} has no parent: its prefix {list(p[:-1])} is not in the tree")
    paths.sort(key=lambda p: (len(p), p))
    index = {p: i + 1 for i, p in enumerate(paths)}
    t = len(paths) + 1
    parents = torch.full((t,), -1, dtype=torch.long)
    depths = torch.zeros(t, dtype=torch.long)
    cand = torch.zeros(t, dtype=torch.long)
    mask = torch.eye(t, dtype=torch.bool)
    mask[:, 0] = True
    for p, i in index.items():
        parents[i] = index.get(p[:-1], 0)
        depths[i] = len(p)
        cand[i] = 1 + topk * (len(p) - 1) + p[-1]
        for j in range(1, len(p)):
            mask[i, index[p[:j]]] = True
    # One row per maximal path (a leaf): longest first, skipping paths that are a prefix of one taken.
    leaves = [p for p in paths if not any(q[: len(p)] == p and len(q) > len(p) for q in paths)]
    leaves.sort(key=lambda p: (-len(p), p))
    width = max(len(p) for p in paths) + 1
    retrieve = torch.full((len(leaves), width), -1, dtype=torch.long)
    for row, p in enumerate(leaves):
        retrieve[row, : len(p) + 1] = torch.tensor([0] + [index[p[:j]] for j in range(1, len(p) + 1)])
    return MedusaTree(tuple(paths), topk, parents, depths, mask, cand, retrieve)


def independent_acceptance(rank_accuracy, paths) -> dict[tuple[int, ...], float]:
    """How often a greedy verify keeps each of `paths`, estimated from per-rank accuracy
    [heads][topk] alone (heads taken as independent, so an underestimate where they agree): the
    product of its ranks' accuracies. For heads whose config records only rank accuracy."""
    return {tuple(p): math.prod(max(rank_accuracy[d][r], 0.0) for d, r in enumerate(p)) for p in paths}


def expected_accept_length(acceptance: dict[tuple[int, ...], float], paths) -> float:
    """Tokens a verify step of the tree `paths` yields on average, bonus included: 1 + the sum of
    its paths' acceptance. Exact for prefix-closed trees: the paths a step keeps are the prefixes
    of one chain (the model's own continuation), one per depth while it stays in the tree, so the
    accepted length is 1 + the number of tree paths that are right."""
    return 1 + sum(acceptance.get(tuple(p), 0.0) for p in paths)


def by_acceptance(paths, acceptance: dict[tuple[int, ...], float]) -> list[list[int]]:
    """`paths` (a prefix-closed tree) most often right first: a path is right no more often than
    its prefix and ties go to the shorter, so every prefix of the result is a prefix-closed tree,
    and the one with the most expected accepted tokens of its size among those within `paths`.
    Paths `acceptance` does not know come last, in BFS order."""
    return [list(p) for p in sorted(map(tuple, paths), key=lambda p: (-acceptance.get(p, 0.0), len(p), p))]


def top_paths(acceptance: dict[tuple[int, ...], float], num_nodes: int) -> list[list[int]]:
    """The tree of `num_nodes` paths with the most expected accepted tokens (by_acceptance over
    every path measured)."""
    if num_nodes < 1:
        raise InvalidTree(f"a tree needs at least one node, got a budget of {num_nodes}")
    return by_acceptance(acceptance, acceptance)[:num_nodes]
