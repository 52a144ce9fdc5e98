"""Lightning attention: linear attention with a constant per-head decay ("Simple GLA").

Per head h with log-decay g_h = -slope_h and state S (d_k x d_v, fp32):

    S_t = exp(g_h) * S_{t-1} + k_t v_t^T
    o_t = (scale * q_t)^T S_t            # the current token is included; no normaliser

Three forms compute this and must agree: `recurrent` (the reference, one token at a time),
`chunked` (prefill: matmuls inside chunks, the recurrence only across chunks) and `step`
(decode: one token). Each takes an initial state and returns the final one, so a prompt can be
prefilled in pieces and decoding continues from wherever prefill stopped.

Shapes: q, k, v are [B, H, T, D] (k/v already repeated to H heads), state is [B, H, Dk, Dv],
g is [H]. Everything is fp32: the decay products span many orders of magnitude.
"""
from __future__ import annotations

import math

import torch

from kernels import target
from kernels.lightning_prefill import lightning_prefill_triton


def decay_slopes(n_heads: int) -> torch.Tensor:
    """ALiBi slope schedule, including its fallback for head counts that are not powers of two."""

    def power_of_two(n: int) -> list[float]:
        start = 2 ** (-(2 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    if math.log2(n_heads).is_integer():
        slopes = power_of_two(n_heads)
    else:
        closest = 2 ** math.floor(math.log2(n_heads))
        slopes = power_of_two(closest) + power_of_two(2 * closest)[0::2][: n_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32, device="cpu")


def log_decay(n_heads: int) -> torch.Tensor:
    """Per-head log-decay g_h = -slope_h (not scaled by layer index: SALA has no layer-wise decay)."""
    return -decay_slopes(n_heads)


def _zero_state(q: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    b, h, _, dk = q.shape
    return q.new_zeros(b, h, dk, v.shape[-1])


def recurrent(q, k, v, g, scale: float, state: torch.Tensor | None = None):
    """Naive recurrence, token by token. The reference the other forms are tested against."""
    s = _zero_state(q, v) if state is None else state.clone()
    decay = torch.exp(g).view(1, -1, 1, 1)
    out = []
    for t in range(q.shape[2]):
        s = decay * s + k[:, :, t, :, None] * v[:, :, t, None, :]
        out.append(torch.einsum("bhd,bhde->bhe", q[:, :, t] * scale, s))
    return torch.stack(out, dim=2), s


def step(q, k, v, g, scale: float, state: torch.Tensor):
    """One decode token: q, k, v are [B, H, D]. Returns (o [B, H, Dv], new state)."""
    s = torch.exp(g).view(1, -1, 1, 1) * state + k[..., :, None] * v[..., None, :]
    return torch.einsum("bhd,bhde->bhe", q * scale, s), s


def _intra_chunk_decay(g: torch.Tensor, c: int) -> torch.Tensor:
    """D[h, i, j] = exp(g_h (i - j)) for j <= i, else 0: the causal decay inside one chunk."""
    idx = torch.arange(c, device=g.device)
    dist = (idx[:, None] - idx[None, :]).to(g.dtype)
    # Mask the exponent before exp: above the diagonal (i - j) < 0 and exp would overflow.
    expo = torch.where(dist >= 0, g.view(-1, 1, 1) * dist, torch.full_like(dist, float("-inf")))
    return torch.exp(expo)


CHUNK_SIZE = 64


def chunked(q, k, v, g, scale: float, state: torch.Tensor | None = None, chunk_size: int = CHUNK_SIZE,
            lengths: torch.Tensor | None = None):
    """`chunked_torch`, or on CUDA the same chunks in one fused Triton kernel
    (kernels/lightning_prefill.py; no backward: used where no gradient is wanted)."""
    if target.on_gpu(q) and chunk_size == CHUNK_SIZE and q.shape[2] and not (
            torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)):
        return lightning_prefill_triton(q, k, v, g, scale, state, lengths)
    return chunked_torch(q, k, v, g, scale, state, chunk_size, lengths)


def chunked_torch(q, k, v, g, scale: float, state: torch.Tensor | None = None, chunk_size: int = CHUNK_SIZE,
                  lengths: torch.Tensor | None = None):
    """Chunk-parallel form: within a chunk of C tokens starting from state S, with b_i = (i+1) g,

    o_i = scale * [ exp(b_i) q_i^T S + sum_{j<=i} exp(b_i - b_j) (q_i . k_j) v_j ]
    S'  = exp(b_{C-1}) S + sum_j exp(b_{C-1} - b_j) k_j v_j^T

    The intra-chunk terms of all chunks are batched matmuls; only the state hand-off from
    chunk to chunk is a loop (T / C small steps). The sequence is zero-padded to whole chunks:
    padding adds nothing to outputs, and the final state is taken at the true last token.
    `lengths` [B] (a batch of right-padded sequences of different lengths, each with k = v = 0
    past its end): the final state of sequence b is taken after its own lengths[b] tokens.
    """
    s0 = _zero_state(q, v) if state is None else state
    b, h, t_total, dk = q.shape
    dv = v.shape[-1]
    if t_total == 0:
        return q.new_zeros(b, h, 0, dv), s0
    c = min(chunk_size, t_total)
    n = -(-t_total // c)
    pad = n * c - t_total
    if pad:
        q, k, v = (torch.nn.functional.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    qc = q.view(b, h, n, c, dk) * scale
    kc = k.view(b, h, n, c, dk)
    vc = v.view(b, h, n, c, dv)
    gh = g.view(1, h, 1, 1)
    pos = torch.arange(1, c + 1, device=q.device, dtype=q.dtype)
    intra = ((qc @ kc.transpose(-1, -2)) * _intra_chunk_decay(g, c)[None, :, None]) @ vc
    # Weight of token j in the state at its chunk's end: exp(g (C-1-j)).
    kv = (kc * torch.exp(gh[..., None] * (c - pos)[:, None])).transpose(-1, -2) @ vc  # [B, H, N, Dk, Dv]
    chunk_decay = torch.exp(g * c).view(1, h, 1, 1)
    starts = [s0]
    for i in range(n - 1):
        starts.append(chunk_decay * starts[-1] + kv[:, :, i])
    start_states = torch.stack(starts, dim=2)  # state entering each chunk
    inter = (qc * torch.exp(gh[..., None] * pos[:, None])) @ start_states
    out = (intra + inter).reshape(b, h, n * c, dv)[:, :, :t_total]
    if lengths is not None:
        return out, _final_state_at(lengths, start_states, kc, vc, g)
    # Final state after the true last token (the last chunk may be shorter than C).
    last = c - pad
    w = torch.exp(gh * (last - pos[:last]).view(1, 1, -1, 1))  # [1, H, last, 1]
    final = torch.exp(g * last).view(1, h, 1, 1) * starts[-1] + (kc[:, :, -1, :last] * w).transpose(-1, -2) @ vc[:, :, -1, :last]
    return out, final


def _final_state_at(lengths, start_states, kc, vc, g):
    """State after token lengths[b] - 1 of each sequence: from the state entering that token's
    chunk, plus the chunk's tokens up to it (later tokens weighted 0)."""
    b, h, _, c, _ = kc.shape
    rows = torch.arange(b, device=kc.device)
    chunk = (lengths - 1) // c
    used = ((lengths - 1) % c + 1).to(kc.dtype)  # tokens of that chunk up to the last one
    dist = used[:, None] - 1 - torch.arange(c, device=kc.device, dtype=kc.dtype)  # [B, C]
    gh = g.view(1, h, 1)
    expo = torch.where(dist[:, None] >= 0, gh * dist[:, None], torch.full_like(gh * dist[:, None], float("-inf")))
    w = torch.exp(expo)[..., None]  # [B, H, C, 1]
    k_last, v_last = kc[rows, :, chunk], vc[rows, :, chunk]  # [B, H, C, D]
    s_in = start_states[rows, :, chunk]  # [B, H, Dk, Dv]
    return torch.exp(gh[..., None] * used.view(b, 1, 1, 1)) * s_in + (k_last * w).transpose(-1, -2) @ v_last
