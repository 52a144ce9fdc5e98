"""The step context: what one engine step's tokens need from the cache, read by every mixer.

The engine runs all of a step's tokens as one row of N tokens: first one decode token for each
of `num_decode` requests, then the prompt chunks (`prefills`), then padding rows that only
round the batch up (to a multiple of 8 in the batch-invariant mode, to a captured batch size
for CUDA graphs). Each mixer reads the context, as nano-vllm's attention reads its Context:

- sparse layers write every row's K/V at `slot_mapping` (padding rows write a scratch page),
  then attend: decode rows through `block_tables` / `context_lens` in one batched call, prompt
  chunks over their request's cached K/V (`kv_rows`) plus the chunk, causally;
- lightning layers update the state pool in place: decode rows by `state_slots` with the
  one-step form, prompt chunks from their slot's state with the chunked form (several chunks
  as one padded batch, with `prefill_state_slots` / `prefill_lengths`).

A tree-verify step (Medusa, `tree`) puts R draft trees of T nodes each in rows 0 .. R*T - 1
instead of decode rows (num_decode is 0), prompt chunks after them. Sparse layers attend from
each node to its request's committed K/V plus the node's ancestors; lightning layers run the
tree-masked parallel form from the slot's state. Neither writes the pools (tree rows' slot
mapping is the scratch row): both keep the tree's K/V in `tree.saved`, and `commit_tree`
writes the accepted path's K/V into the pages and advances the states along it.

`cache` is the engine's CachePool: `k[layer]`, `v[layer]` [pages, page_size, kv_heads, head_dim]
and `states[layer]` [slots, heads, d_k, d_v], each with one scratch page / slot at the end; when
a request can reach sparse_config.dense_len, also the InfLLM-v2 compressed keys `k1[layer]`,
`k2[layer]` [pages * page_size / stride, kv_heads, head_dim] (sala/sparse.py), which sparse
layers extend with the windows each step completes and read in the rows that attend sparsely.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Span:
    """Consecutive rows of one request: `length` tokens from position `past` on, at rows
    start .. start + length - 1."""

    start: int
    length: int
    past: int  # tokens of this request already in the cache
    state_slot: int = -1
    kv_rows: torch.Tensor | None = None  # [past + length] pool rows of positions 0 .. past + length - 1
    prompt_len: int = 0  # the request's prompt length: InfLLM-v2 treats its prompt rows as one prefill call


@dataclass
class TreeStep:
    """R draft trees of the same shape (sala/medusa/tree.py), one per request, at rows 0 .. R*T - 1."""

    num_requests: int
    depths: torch.Tensor  # [T]
    ancestor_mask: torch.Tensor  # [T, T] bool, ancestor-or-self
    # [R, W] pool rows of positions 0 .. W - 1, W >= committed + the deepest path (the scratch row where a request has
    # no page): attention reads the first kv_lens, the commit writes the accepted path's after them (path_rows)
    kv_rows: torch.Tensor
    kv_lens: torch.Tensor  # [R] committed tokens
    state_slots: torch.Tensor  # [R]
    saved: dict = field(default_factory=dict)  # layer -> what commit_tree needs ((k, v), or node states), filled by the forward
    parents: torch.Tensor | None = None  # [T]
    levels: list[list[int]] | None = None  # node indices at each depth

    @property
    def num_nodes(self) -> int:
        return self.depths.shape[0]

    def path_rows(self, lengths: torch.Tensor, width: int, scratch_row: int) -> torch.Tensor:
        """[R, width] pool rows of each request's next `width` positions, the scratch row from its
        accepted length (lengths [R]) on: where commit_tree writes an accepted path's K/V."""
        j = torch.arange(width, device=lengths.device)
        rows = self.kv_rows.gather(1, self.kv_lens[:, None] + j)
        return torch.where(j < lengths[:, None], rows, torch.full_like(rows, scratch_row))

    @property
    def num_rows(self) -> int:
        return self.num_requests * self.num_nodes


@dataclass
class StepContext:
    cache: object
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N] K/V pool row each token writes
    num_decode: int = 0
    block_tables: torch.Tensor | None = None  # [num_decode, max_pages]
    context_lens: torch.Tensor | None = None  # [num_decode], including the decode token
    state_slots: torch.Tensor | None = None  # [num_decode]
    prefills: list[Span] = field(default_factory=list)
    prefill_state_slots: torch.Tensor | None = None  # [len(prefills)]
    prefill_lengths: torch.Tensor | None = None  # [len(prefills)]
    batch_invariant: bool = False  # lightning layers run prompt chunks one at a time
    tree: TreeStep | None = None  # draft trees to verify, in place of decode rows
    decode_prompt_lens: list[int] | None = None  # per decode row, when the pool keeps InfLLM-v2 compressed keys
