"""Which drafted tokens a verify step keeps: one accepted root-to-node path per request.

Node i (i >= 1) of a request's tree is acceptable given its parent's logits:
- greedy requests (temperature 0): its token is the argmax of the parent's logits, so the
  accepted path is exactly what greedy decoding would produce (lossless);
- sampled requests, Medusa's typical acceptance: its token's probability under the parent's
  distribution (the request's temperature, top-k and top-p applied) exceeds
  min(threshold, alpha * exp(-entropy)); not distribution-preserving, as in Medusa.
A path is accepted up to its first unacceptable node; the longest wins, ties (sampled
requests only: a greedy chain is unique) broken by the accepted tokens' summed log-probability.
The root is always kept (the base model chose it). The bonus token, sampled from the last
accepted node's logits, becomes the next step's root.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch

from sala.medusa.tree import MedusaTree
from sala.sampling import SamplingParams, filtered_probs

TYPICAL_THRESHOLD = 0.09  # Medusa's posterior_threshold (epsilon)
TYPICAL_ALPHA = 0.3  # Medusa's posterior_alpha (delta ~ sqrt(epsilon))


@dataclass
class Accepted:
    paths: torch.Tensor  # [R, P] node indices of the chosen root-to-leaf row, root first
    lengths: torch.Tensor  # [R] nodes kept, root included (1 .. P)

    def last_nodes(self) -> torch.Tensor:
        return self.paths.gather(1, (self.lengths - 1)[:, None])[:, 0]


class TreeIndices(NamedTuple):
    """What acceptance reads of a tree (MedusaTree has the same fields): a compiled verify step
    takes these tensors as inputs, so that one graph serves trees of every size."""

    parents: torch.Tensor
    retrieve_indices: torch.Tensor


class Settled(NamedTuple):
    """A verify step's outcome per request once its path is committed: [R, 2 + P] its accepted
    length, its path's tokens root first, its bonus token; [R, heads, topk] the heads' drafts at
    its last accepted node."""

    emitted: torch.Tensor
    drafts: torch.Tensor


def tempered_probs(logits: torch.Tensor, temperature: torch.Tensor) -> torch.Tensor:
    """logits [R, ..., V] -> each request's distribution at its temperature [R] (a greedy row's,
    temperature 0, at 1: read by no one), in tensor ops alone."""
    t = torch.where(temperature > 0, temperature, torch.ones_like(temperature))
    return torch.softmax(logits / t.view(-1, *[1] * (logits.dim() - 1)), dim=-1)  # as filtered_probs with no cut


def node_acceptable(tree: MedusaTree, tokens: torch.Tensor, logits: torch.Tensor, params: list[SamplingParams],
                    threshold: float = TYPICAL_THRESHOLD, alpha: float = TYPICAL_ALPHA) -> tuple[torch.Tensor, torch.Tensor]:
    """tokens [R, T], logits [R, T, V] fp32 -> (ok [R, T] bool, logp [R, T]: each node token's
    log-probability under its parent's distribution; the root's entries are True and 0)."""
    r, t, _ = logits.shape
    parents = tree.parents.clamp(min=0)
    ok = greedy_acceptable(tree, tokens, logits)
    logp = torch.zeros(r, t, device=logits.device)
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        rows = torch.tensor(sampled, device=logits.device)
        parent_logits = logits[rows][:, parents]  # [S, T, V]
        probs = filtered_probs(parent_logits.flatten(0, 1), [params[i] for i in sampled for _ in range(t)])
        ok[rows], logp[rows] = typical_acceptable(probs.view(len(sampled), t, -1), tokens[rows], threshold, alpha)
        ok[:, 0] = True
        logp[:, 0] = 0
    return ok, logp


def typical_acceptable(probs: torch.Tensor, tokens: torch.Tensor, threshold: float, alpha: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """Typical acceptance of tokens [S, T] under their parents' distributions probs [S, T, V]:
    (ok, the tokens' log-probabilities)."""
    p_tok = probs.gather(-1, tokens[..., None])[..., 0]
    entropy = -(probs * torch.log(probs.clamp(min=1e-30))).sum(-1)
    ok = p_tok > torch.minimum(torch.full_like(entropy, threshold), alpha * torch.exp(-entropy))
    return ok, torch.log(p_tok.clamp(min=1e-30))


def greedy_acceptable(tree: MedusaTree | TreeIndices, tokens: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """ok [R, T]: each node's token is the argmax of its parent's logits (the root always is).
    The argmax is taken once per node, then gathered by parent: no [R, T, V] copy."""
    ok = tokens == logits.argmax(-1)[:, tree.parents.clamp(min=0)]
    ok[:, 0] = True
    return ok


def accept(tree: MedusaTree, tokens: torch.Tensor, logits: torch.Tensor, params: list[SamplingParams],
           max_nodes: torch.Tensor | None = None, threshold: float = TYPICAL_THRESHOLD,
           alpha: float = TYPICAL_ALPHA) -> Accepted:
    """The accepted path of every request. `max_nodes` [R] caps the nodes kept (a request near
    its max_tokens cannot use a longer path)."""
    ok, logp = node_acceptable(tree, tokens, logits, params, threshold, alpha)
    return longest_path(tree, ok, logp, max_nodes)


def accept_greedy(tree: MedusaTree | TreeIndices, tokens: torch.Tensor, logits: torch.Tensor,
                  max_nodes: torch.Tensor | None = None) -> Accepted:
    """`accept` for a batch of greedy requests only, in tensor ops alone (no host sync, no
    per-request Python): what the compiled verify step runs. A greedy chain is unique (siblings
    carry distinct tokens, at most one of them is the argmax), so no score breaks ties."""
    return longest_path(tree, greedy_acceptable(tree, tokens, logits), None, max_nodes)


def accept_tempered(tree: MedusaTree | TreeIndices, tokens: torch.Tensor, logits: torch.Tensor, temperature: torch.Tensor,
                    max_nodes: torch.Tensor, threshold: float, alpha: float) -> Accepted:
    """`accept` in tensor ops alone for requests whose only sampling control is their
    temperature [R] (0: greedy, accepted as `accept_greedy`): what the compiled verify step of
    a batch with sampled requests runs."""
    greedy = (temperature == 0)[:, None]
    ok, logp = typical_acceptable(tempered_probs(logits[:, tree.parents.clamp(min=0)], temperature), tokens, threshold,
                                  alpha)
    ok = torch.where(greedy, greedy_acceptable(tree, tokens, logits), ok)
    ok[:, 0] = True
    logp = torch.where(greedy, torch.zeros_like(logp), logp)
    logp[:, 0] = 0
    return longest_path(tree, ok, logp, max_nodes)


def longest_path(tree: MedusaTree | TreeIndices, ok: torch.Tensor, logp: torch.Tensor | None,
                 max_nodes: torch.Tensor | None) -> Accepted:
    """The retrieve row with the longest acceptable prefix per request (ok [R, T]); ties broken
    by the summed log-probability `logp` [R, T] of the kept nodes (None: the first row)."""
    retrieve = tree.retrieve_indices  # [L, P], -1 padded
    valid = retrieve >= 0
    idx = retrieve.clamp(min=0)
    path_ok = ok[:, idx] & valid  # [R, L, P]
    if max_nodes is not None:
        path_ok &= torch.arange(retrieve.shape[1], device=ok.device)[None, None] < max_nodes[:, None, None]
    kept = path_ok.long().cumprod(-1)
    lengths = kept.sum(-1)  # [R, L] >= 1: the root is always acceptable
    if logp is None:
        best = lengths.argmax(-1)  # the first longest row
    else:
        score = (logp[:, idx] * kept).sum(-1)
        longest = lengths == lengths.max(-1, keepdim=True).values
        best = torch.where(longest, score, torch.full_like(score, float("-inf"))).argmax(-1)
    return Accepted(retrieve[best], lengths.gather(1, best[:, None])[:, 0])
