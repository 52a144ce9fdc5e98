"""The step context: what one engine step's tokens need from the cache, read by every mixer.

The engine runs all of a step's tokens as one row of N tokens: first one decode token for each
decoding request, then the prompt chunks (`prefills`), then padding rows that only round the
batch up (to a multiple of 16 in the batch-invariant mode, to a captured batch size for CUDA
graphs). The model's mixers hand their q, k, v to the context (`sparse`, `lightning`), which
runs the paged step of that mixer over the engine's pools (sala/engine/paged.py), as
nano-vllm's attention reads its Context:

- sparse layers write every row's K/V at `slot_mapping` (padding rows write a scratch page),
  then attend: decode rows through `block_tables` / `context_lens` in one batched call, prompt
  chunks over their request's cached K/V (`kv_rows`) plus the chunk, causally;
- lightning layers update the state pool in place: decode rows by `state_slots` with the
  one-step form, prompt chunks from their slot's state with the chunked form (several chunks
  as one padded batch, from `prefill_state_slots`).

A tree-verify step (Medusa, `tree`) puts R draft trees of T nodes each in rows 0 .. R*T - 1
instead of decode rows, prompt chunks after them. Sparse layers attend from each node to its
request's committed K/V plus the node's ancestors; lightning layers run the tree-masked
parallel form from the slot's state. Neither writes the pools (tree rows' slot mapping is the
scratch row): both keep the tree's K/V in `tree.saved`, and `paged.commit_tree` writes the
accepted path's K/V into the pages and advances the states along it.

What can be derived is: the decode row count is `state_slots`' length, a tree's request count
its `kv_lens`' length, the prompt chunks' state slots and lengths their spans'. The compiled
and CUDA-graph decode steps take a context as their one input (`padded` makes the compiled
step's, `decode_padding` and `rows` the graphs' persistent one), never tensors in a positional
order.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

import torch
from torch.utils import _pytree as pytree


class PagedCache(Protocol):
    """The pools a step reads and writes (sala/engine/cache.py's CachePool): each sparse layer's
    K and V pages in its format (sala/kv/pages.py KVPages), each lightning layer's states
    [slots, H, Dk, Dv]; with InfLLM-v2 the compressed keys k1 / k2 [rows / stride, Hkv, D]
    (empty dicts otherwise); the scratch page, row and slot padding rows use."""

    k: dict
    v: dict
    states: dict[int, torch.Tensor]
    k1: dict[int, torch.Tensor]
    k2: dict[int, torch.Tensor]
    page_size: int
    device: torch.device
    scratch_page: int
    scratch_row: int
    scratch_slot: int

    @property
    def compressed(self) -> bool: ...


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
    def num_requests(self) -> int:
        return self.kv_lens.shape[0]

    @property
    def num_nodes(self) -> int:
        return self.depths.shape[0]

    @property
    def num_rows(self) -> int:
        return self.num_requests * self.num_nodes

    def path_rows(self, lengths: torch.Tensor, width: int, scratch_row: int) -> torch.Tensor:
        """[R, width] pool rows of each request's next `width` positions, the scratch row from its
        accepted length (lengths [R]) on: where commit_tree writes an accepted path's K/V."""
        j = torch.arange(width, device=lengths.device)
        rows = self.kv_rows.gather(1, self.kv_lens[:, None] + j)
        return torch.where(j < lengths[:, None], rows, torch.full_like(rows, scratch_row))


@dataclass
class StepContext:
    cache: PagedCache
    positions: torch.Tensor  # [N]
    slot_mapping: torch.Tensor  # [N] K/V pool row each token writes
    block_tables: torch.Tensor | None = None  # [decode rows, max_pages]
    context_lens: torch.Tensor | None = None  # [decode rows], including the decode token
    state_slots: torch.Tensor | None = None  # [decode rows]
    prefills: list[Span] = field(default_factory=list)
    batch_invariant: bool = False  # lightning layers run prompt chunks one at a time
    tree: TreeStep | None = None  # draft trees to verify, in place of decode rows
    decode_prompt_lens: list[int] | None = None  # per decode row, when the pool keeps InfLLM-v2 compressed keys

    @property
    def num_decode(self) -> int:
        return 0 if self.state_slots is None else self.state_slots.shape[0]

    @cached_property
    def prefill_state_slots(self) -> torch.Tensor:
        return torch.tensor([s.state_slot for s in self.prefills], device=self.positions.device)

    @cached_property
    def prefill_lengths(self) -> torch.Tensor:
        return torch.tensor([s.length for s in self.prefills], device=self.positions.device)

    # What the model's mixers call (sala/model.py Step): their paged step over this context.
    def sparse(self, mixer, q, k, v) -> torch.Tensor:
        from sala.engine import paged

        return paged.sparse_step(mixer, q, k, v, self)

    def lightning(self, mixer, q, k, v, g) -> torch.Tensor:
        from sala.engine import paged

        return paged.lightning_step(mixer, q, k, v, g, self)

    # The decode step's fast paths (sala/engine/graphs.py).
    def rows(self, n: int) -> StepContext:
        """A decode context's first n rows: views, so a persistent context filled in place can
        be read by a graph captured over them."""
        return dataclasses.replace(self, **{f: getattr(self, f)[:n] for f in padding_values(self.cache)})

    def padded(self, rows: int, width: int) -> StepContext:
        """This decode context with padding rows up to `rows` and scratch-page columns up to
        `width` (a new context; only the tensors short of them are copied)."""
        out = {}
        for name, value in padding_values(self.cache).items():
            t = getattr(self, name)
            if name == "block_tables" and t.shape[1] < width:
                t = torch.cat([t, t.new_full((t.shape[0], width - t.shape[1]), value)], 1)
            if t.shape[0] < rows:
                t = torch.cat([t, t.new_full((rows - t.shape[0], *t.shape[1:]), value)])
            out[name] = t
        return dataclasses.replace(self, **out)

    def copy_into(self, dst: StepContext) -> None:
        """This decode context into the first rows and page-table columns of a larger one,
        padding in the rest."""
        for name, value in padding_values(dst.cache).items():
            d, s = getattr(dst, name), getattr(self, name)
            d.fill_(value)
            d[tuple(slice(0, n) for n in s.shape)] = s


def padding_values(cache: PagedCache) -> dict[str, int]:
    """A decode context's tensors and what a padding row holds in each: it reads and writes only
    the scratch page and state slot, so rows added to round a batch up change nothing."""
    return {"positions": 0, "slot_mapping": cache.scratch_row, "block_tables": cache.scratch_page, "context_lens": 1,
            "state_slots": cache.scratch_slot}


def decode_padding(cache: PagedCache, rows: int, width: int) -> StepContext:
    """A decode context of `rows` padding rows with page tables `width` wide."""
    return StepContext(cache, **{name: torch.full((rows, width) if name == "block_tables" else (rows,), value,
                                                  dtype=torch.long, device=cache.device)
                                 for name, value in padding_values(cache).items()})


# Contexts as pytrees: a compiled step takes a context as flat tensors and rebuilds it inside
# the graph (sala/engine/graphs.py), the static fields (the pool, the spans, the tree's levels)
# in the spec.
pytree.register_pytree_node(
    TreeStep,
    lambda t: ([t.depths, t.ancestor_mask, t.kv_rows, t.kv_lens, t.state_slots, t.saved, t.parents], t.levels),
    lambda children, levels: TreeStep(*children[:6], parents=children[6], levels=levels),
)
pytree.register_pytree_node(
    StepContext,
    lambda c: ([c.positions, c.slot_mapping, c.block_tables, c.context_lens, c.state_slots, c.tree],
               (c.cache, c.prefills, c.batch_invariant, c.decode_prompt_lens)),
    lambda children, static: StepContext(static[0], *children[:5], prefills=static[1], batch_invariant=static[2],
                                         tree=children[5], decode_prompt_lens=static[3]),
)
