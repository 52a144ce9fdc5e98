"""The engine's memory: a paged K/V pool for the sparse layers, a state pool for lightning layers.

Sparse layers keep K and V for every past token, in one tensor per layer
[num_pages + 1, page_size, kv_heads, head_dim] handed out a page at a time as a sequence grows;
a request owns a list of pages. Each layer stores its pages in the format the KV plan gives it
(sala/kv: bf16, fp8, nvfp4; with no plan, the model's dtype), quantized on write and
dequantized on read by the layer's `KVPages`.

Lightning layers keep one state [heads, d_k, d_v] per request per layer (fp32, or bf16 where
the plan says so), whatever the sequence length, in [max_seqs + 1, heads, d_k, d_v] tensors; a
request owns one slot.

When a request can reach sparse_config.dense_len, sparse layers also keep InfLLM-v2's
compressed keys (sala/sparse.py), fp32, stored by page: compressed window j lives beside the
page holding its first key, at row (pool row of key j * stride) // stride, so the windows come
and go with the K/V pages and need no allocation of their own (page_size must then be a
multiple of the K2 stride).

The last page and the last state slot are scratch: padding rows of a step (added to round a
batch up) write there, so every row of a step is a valid write and a captured CUDA graph
needs no branches.

This pool is the one owner of pages and slots, as nano-vllm's block manager is: the free lists
change only here, and the prefix cache (sala/engine/prefix.py) lives inside it, handing back
the pages it evicts rather than writing the free list. A request's page list is the one record
of its pages; the tensors a step needs are made from it.
"""
from __future__ import annotations

import torch

from sala import sparse
from sala.engine.config import EngineConfig
from sala.engine.prefix import Hit, PrefixCache
from sala.engine.request import Request
from sala.kv import KVPages


class CachePool:
    def __init__(self, engine: EngineConfig):
        """The pools `engine.memory` plans, in the formats of `engine.kv_plan`, with a prefix
        cache when `engine.prefix_cache`."""
        config, plan, kv_plan, device = engine.model, engine.memory, engine.kv_plan, engine.device
        self.plan, self.page_size, self.device = plan, plan.page_size, device
        n_kv, d = config.num_key_value_heads, config.head_dim

        def pages(i: int, side: str) -> KVPages:
            return KVPages(kv_plan.codec(i, side), plan.num_pages + 1, plan.page_size, n_kv, d, device)

        self.k = {i: pages(i, "k") for i in config.sparse_layers}
        self.v = {i: pages(i, "v") for i in config.sparse_layers}
        h, dl = config.lightning_nh, config.lightning_head_dim
        self.states = {i: torch.zeros(plan.max_seqs + 1, h, dl, dl, dtype=kv_plan.state_dtype(i), device=device)
                       for i in config.lightning_layers}
        k1_stride, k2_stride = (st for _, st in sparse.SparseSettings.of(config).levels)
        rows = (plan.num_pages + 1) * plan.page_size
        self.k1 = {i: torch.zeros(rows // k1_stride, n_kv, d, device=device) for i in config.sparse_layers if self.compressed}
        self.k2 = {i: torch.zeros(rows // k2_stride, n_kv, d, device=device) for i in config.sparse_layers if self.compressed}
        self.scratch_page, self.scratch_slot = plan.num_pages, plan.max_seqs
        self.free_pages = list(range(plan.num_pages - 1, -1, -1))
        self.free_state_slots = list(range(plan.max_seqs - 1, -1, -1))
        self.prefix = PrefixCache(engine, self.states) if engine.prefix_cache else None

    @property
    def compressed(self) -> bool:
        return self.plan.compressed_bytes_per_page > 0

    @property
    def max_tokens(self) -> int:
        return self.plan.max_kv_tokens

    @property
    def scratch_row(self) -> int:
        return self.scratch_page * self.page_size

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    @property
    def num_free_pages(self) -> int:
        """Free pages plus cached ones no request holds (the prefix cache gives those back when asked)."""
        return len(self.free_pages) + (self.prefix.num_evictable if self.prefix else 0)

    # ---------------------------------------------------------------- admission and growth
    def match(self, req: Request) -> Hit | None:
        """Where req can resume from the prefix cache, if anywhere."""
        return self.prefix.match(req) if self.prefix else None

    def can_admit(self, n_tokens: int, hit: Hit | None = None) -> bool:
        """A state slot and pages for req's first n_tokens, resumed at `hit`: its shared pages
        are no longer free to take, nor is the tail it copies from."""
        if not self.free_state_slots:
            return False
        if hit is None:
            return self.num_free_pages >= self.pages_for(n_tokens)
        return self.num_free_pages - hit.pages_held_back >= self.pages_for(n_tokens) - len(hit.nodes)

    def admit(self, req: Request, hit: Hit | None = None) -> None:
        """A state slot: zeroed so that a prompt starts from the empty state, or, resumed at a
        prefix hit, the shared pages and the snapshot's states."""
        req.state_slot = self.free_state_slots.pop()
        for s in self.states.values():
            s[req.state_slot].zero_()
        if self.prefix:
            self.prefix.admit(req, hit, self)

    def grow(self, req: Request, n_tokens: int) -> bool:
        """Pages for positions 0 .. n_tokens - 1; False (and nothing taken) if too few are free."""
        need = self.pages_for(n_tokens) - len(req.pages)
        if need <= 0:  # most calls: a decode step within its last page
            return True
        if need > self.num_free_pages:
            return False
        if need > len(self.free_pages):
            self.free_pages += self.prefix.evict(need - len(self.free_pages))
        req.pages += [self.free_pages.pop() for _ in range(need)]
        return True

    def take_page(self) -> int | None:
        """One free page (evicting a cached one if need be), or None."""
        if not self.free_pages and self.prefix and self.prefix.num_evictable:
            self.free_pages += self.prefix.evict(1)
        return self.free_pages.pop() if self.free_pages else None

    def give_back(self, pages: list[int]) -> None:
        self.free_pages.extend(pages)

    def free(self, req: Request) -> None:
        if self.prefix:
            self.prefix.release(req)  # its shared pages stay cached; the rest are freed here
        self.free_pages.extend(reversed(req.pages))
        if req.state_slot >= 0:
            self.free_state_slots.append(req.state_slot)
        req.pages, req.state_slot = [], -1

    def after_step(self, reqs: list[Request]) -> None:
        """The step advanced `reqs` (before any is finished): the prefix cache takes in their new pages."""
        if self.prefix:
            self.prefix.after_step(reqs, self)

    def flush_prefix(self) -> int:
        """Evict every cached page no request holds (SGLang's /flush_cache); how many went."""
        if not self.prefix:
            return 0
        pages = self.prefix.evict(self.prefix.num_evictable)
        self.free_pages += pages
        return len(pages)

    # ---------------------------------------------------------------- what a step reads
    def copy_page(self, src: int, dst: int) -> None:
        """Page dst's K/V := page src's, in every sparse layer (a prefix tail copied for a new request)."""
        for pages in (*self.k.values(), *self.v.values()):
            for t in (pages.data, pages.scale):  # the stored format as it is: codes and their scales
                if t is not None:
                    t[dst].copy_(t[src])

    def rows(self, req: Request, start: int, end: int) -> torch.Tensor:
        """Pool rows (page * page_size + offset) of positions start .. end - 1."""
        first = start // self.page_size
        pages = torch.tensor(req.pages[first : self.pages_for(end)], device=self.device)
        pos = torch.arange(start, end, device=self.device)
        return pages[pos // self.page_size - first] * self.page_size + pos % self.page_size

    def row(self, req: Request, pos: int) -> int:
        return req.pages[pos // self.page_size] * self.page_size + pos % self.page_size
