"""Acceptance against a naive loop over every root-to-leaf path, written from Medusa's rules."""
import math

import torch

from sala.medusa.accept import accept
from sala.medusa.tree import MC_SIM_7B_63, build_tree
from sala.sampling import SamplingParams, filtered_probs


def naive(tree, tokens, logits, params, max_nodes, eps=0.09, alpha=0.3):
    """Per request: walk each path while its tokens pass (greedy: argmax of the parent; sampled:
    p > min(eps, alpha * exp(-H))); the longest wins, then the highest summed log-probability."""
    out = []
    for r, p in enumerate(params):
        best = None
        for row in tree.retrieve_indices.tolist():
            path = [n for n in row if n >= 0][: max_nodes[r]]
            n, score = 1, 0.0
            for parent, node in zip(path, path[1:]):
                if p.greedy:
                    ok = int(logits[r, parent].argmax()) == int(tokens[r, node])
                    lp = 0.0
                else:
                    probs = filtered_probs(logits[r, parent][None], [p])[0]
                    h = -(probs * probs.clamp(min=1e-30).log()).sum()
                    pt = probs[tokens[r, node]]
                    ok = bool(pt > min(eps, alpha * math.exp(-h)))
                    lp = math.log(max(float(pt), 1e-30))
                if not ok:
                    break
                n, score = n + 1, score + lp
            if best is None or n > best[0] or (n == best[0] and score > best[1] + 1e-6):
                best = (n, score, path[:n])
        out.append(best)
    return out


def test_accept_matches_naive_paths():
    tree = build_tree(MC_SIM_7B_63)
    gen = torch.Generator().manual_seed(0)
    r, t, v = 6, tree.num_nodes, 12  # a small vocabulary, so tokens often match
    logits = torch.randn(r, t, v, generator=gen) * 3
    tokens = torch.randint(0, v, (r, t), generator=gen)
    # Make request 0's tree follow its own argmax along part of the tree, so long paths are accepted.
    for node in range(1, t):
        if torch.rand(1, generator=gen) < 0.7:
            tokens[0, node] = logits[0, tree.parents[node]].argmax()
            tokens[3, node] = logits[3, tree.parents[node]].argmax()
    params = [SamplingParams(temperature=0), SamplingParams(temperature=0.7), SamplingParams(temperature=1.0, top_p=0.8),
              SamplingParams(temperature=0.5, top_k=3), SamplingParams(temperature=0), SamplingParams(temperature=1.3)]
    max_nodes = [5, 5, 3, 5, 2, 5]
    got = accept(tree, tokens, logits, params, torch.tensor(max_nodes))
    want = naive(tree, tokens, logits, params, max_nodes)
    lengths = got.lengths.tolist()
    assert lengths == [w[0] for w in want]
    for i, w in enumerate(want):
        assert got.paths[i, : lengths[i]].tolist() == w[2]
    assert max(lengths) >= 3 and lengths[4] <= 2  # long paths happen; the cap holds
