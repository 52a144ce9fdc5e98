"""Lightning attention over a draft tree: three exact forms and the commit after acceptance.

A tree node's state is its parent's, decayed, plus its own k v^T (the root's parent is the
committed state S); a plain causal scan over the flattened tree would leak siblings into
every later node. Forms (shapes as in sala/lightning.py, T tree nodes in BFS order):

- `tree_parallel`: the tree-masked parallel form (kernels/lightning_tree.py): decay by depth
  difference on the ancestor mask plus the committed-state term; no per-node state. The
  engine's verify path.
- `tree_scan`: the depth-wise parent-index scan: all nodes of one depth at once from their
  parents' states (max_depth + 1 steps); returns every node's state. The cross-check, and the
  engine's verify path for a layer whose cache keeps BF16 states (rounded node by node as
  plain decoding rounds them token by token; the commit then takes the last accepted node's).
- `path_recurrent`: the plain recurrence run along each root-to-leaf path (retrieve_indices
  rows) from S. The test oracle.

`commit_path` advances S along an accepted path in closed form,
    S' = a^(m+1) S + sum_{t=0..m} a^(m-t) k_{p_t} v_{p_t}^T,
one weighted K^T V per request; paths of different lengths in one batch.
"""
from __future__ import annotations

import torch

from kernels.lightning_tree import lightning_tree_verify
from sala import lightning

tree_parallel = lightning_tree_verify


def tree_scan(q, k, v, g, scale: float, state, parents: torch.Tensor, depths: torch.Tensor,
              state_dtype: torch.dtype | None = None, levels: list[list[int]] | None = None):
    """Returns (o [B, H, T, Dv], node states [B, H, T, Dk, Dv]).

    `state_dtype`: the dtype the cache keeps states in, when it is narrower than fp32. Plain
    decoding rounds the state to it after every token (each token's output uses the unrounded
    state), so here each node's state is rounded before its children read it: then every node
    sees what decoding its path token by token would, which the closed-form commit (one rounding
    per verify step) does not give. `levels`: the node indices of each depth, when known in
    advance (a compiled step cannot read them from `depths`)."""
    b, h, t, dk = q.shape
    a = torch.exp(g).view(1, -1, 1, 1, 1)
    states = q.new_zeros(b, h, t, dk, v.shape[-1])
    prev = torch.cat([state[:, :, None], states], dim=2)  # index 0: the committed state, node i at i + 1
    if levels is None:
        levels = [(depths == d).nonzero()[:, 0].tolist() for d in range(int(depths.max()) + 1)]
    for level in levels:
        nodes = torch.tensor(level, device=q.device)
        parent_states = prev[:, :, parents[nodes] + 1]  # the root's parent (-1) reads the committed state
        new = a * parent_states + k[:, :, nodes, :, None] * v[:, :, nodes, None, :]
        states[:, :, nodes] = new
        prev[:, :, nodes + 1] = new if state_dtype is None else new.to(state_dtype).float()
    o = torch.einsum("bhtd,bhtde->bhte", q * scale, states)
    return o, states


def path_recurrent(q, k, v, g, scale: float, state, retrieve_indices: torch.Tensor):
    """Each root-to-leaf path run through the sequential recurrence on its own. Returns
    {node: output [B, H, Dv]} and {node: state [B, H, Dk, Dv]}; a node shared by several paths is
    checked to get the same result from each."""
    outs, states = {}, {}
    for row in retrieve_indices.tolist():
        path = [i for i in row if i >= 0]
        o, _ = lightning.recurrent(q[:, :, path], k[:, :, path], v[:, :, path], g, scale, state)
        s = state
        for j, node in enumerate(path):
            _, s = lightning.recurrent(q[:, :, node : node + 1], k[:, :, node : node + 1], v[:, :, node : node + 1],
                                       g, scale, s)
            outs.setdefault(node, o[:, :, j])
            states.setdefault(node, s)
    return outs, states


def commit_path(k, v, g, state, paths: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """The state after each request's accepted path. k, v [B, H, T, D]; paths [B, P] node
    indices root first (entries past a request's length are ignored); lengths [B] >= 1 nodes
    accepted (root included). Returns the new states [B, H, Dk, Dv]; `state` is not modified."""
    b, h = k.shape[:2]
    p = paths.shape[1]
    idx = paths.clamp(min=0)[:, None, :, None]
    kp = k.gather(2, idx.expand(b, h, p, k.shape[-1]))
    vp = v.gather(2, idx.expand(b, h, p, v.shape[-1]))
    m = (lengths - 1).to(g.dtype)  # index of the last accepted node
    dist = m[:, None] - torch.arange(p, device=k.device, dtype=g.dtype)  # [B, P]
    gh = g.view(1, h, 1)
    expo = torch.where(dist[:, None] >= 0, gh * dist[:, None], torch.full_like(gh * dist[:, None], float("-inf")))
    kv = (kp * torch.exp(expo)[..., None]).transpose(-1, -2) @ vp
    return torch.exp(gh[..., None] * (m + 1).view(b, 1, 1, 1)) * state + kv
