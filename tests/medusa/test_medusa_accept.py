"""Acceptance against a naive loop over every root-to-leaf path, written from Medusa's rules."""
import math
from types import SimpleNamespace

import torch

from sala.medusa.accept import accept, accept_tempered, tempered_probs
from sala.medusa.tree import MC_SIM_7B_63, build_tree
from sala.sampling import SamplingParams, filtered_probs, inverse_cdf, sample, uniforms


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


def drafted():
    """A 63-node tree's tokens and logits for six requests, requests 0 and 3 often drafting their argmax."""
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
    return tree, tokens, logits


def test_accept_matches_naive_paths():
    tree, tokens, logits = drafted()
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


def test_tempered_acceptance_keeps_the_naive_paths_and_draws_what_the_sampler_draws():
    """What the compiled sampled verify step runs, in tensor ops with each request's temperature
    as a tensor (0: greedy): the naive loop's paths, and the bonus token at the last accepted
    node that `sample` draws from the same generator state."""
    tree, tokens, logits = drafted()
    temperatures = [0, 0.7, 1.0, 0.5, 0, 1.3]
    params = [SamplingParams(temperature=t) for t in temperatures]
    max_nodes = [5, 5, 3, 5, 2, 5]
    temperature = torch.tensor(temperatures)
    got = accept_tempered(tree, tokens, logits, temperature, torch.tensor(max_nodes), 0.09, 0.3)
    want = naive(tree, tokens, logits, params, max_nodes)
    lengths = got.lengths.tolist()
    assert lengths == [w[0] for w in want] and max(lengths) >= 3
    for i, w in enumerate(want):
        assert got.paths[i, : lengths[i]].tolist() == w[2]

    def requests():
        return [SimpleNamespace(params=p, generator=torch.Generator().manual_seed(i), output_ids=[], prompt_ids=[])
                for i, p in enumerate(params)]

    last = logits[torch.arange(len(params)), got.last_nodes()]
    reqs = requests()
    u = torch.tensor([0.0 if p.greedy else uniforms([r]).item() for p, r in zip(params, reqs)], dtype=torch.float64)
    drawn = torch.where(temperature == 0, last.argmax(-1), inverse_cdf(tempered_probs(last, temperature), u))
    assert drawn.tolist() == sample(last, requests())
