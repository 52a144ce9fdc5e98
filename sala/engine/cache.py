"""The engine's memory: a paged K/V pool for the sparse layers, a state pool for lightning layers.

Sparse layers keep K and V for every past token, in one tensor per layer
[num_pages + 1, page_size, kv_heads, head_dim] handed out a page at a time as a sequence grows;
a request owns a list of pages (its page table). Each layer stores its pages in the format the
KV plan gives it (sala/kv: bf16, fp8, nvfp4; with no plan, the model's dtype), quantized on
write and dequantized on read by the layer's `KVPages`.

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

`plan_memory` sizes both pools from a byte budget: the state pool first takes what
`max_seqs` sequences need (for the 9B model 48 MiB a sequence, so at short contexts states,
not K/V, bound concurrency), after keeping room for one request of `max_model_len` tokens.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from sala import sparse
from sala.engine.request import Request
from sala.kv import KVPages, KVPlan


class CacheFull(RuntimeError):
    """A budget that cannot hold one request of full length, or a request larger than the cache."""


def kv_bytes_per_token(config, kv_plan: KVPlan) -> int:
    """K and V of one token across all sparse layers, in each layer's format."""
    return sum(kv_plan.kv_bytes_per_token(config).values())


def compressed_bytes_per_page(config, max_model_len: int, page_size: int) -> int:
    """InfLLM-v2 compressed keys of one page across all sparse layers (0 when no request of
    max_model_len tokens reaches dense_len, so none are kept)."""
    if not sparse.sparse_reachable(config, max_model_len):
        return 0
    windows = sum(page_size // stride for _, stride in sparse.SparseSettings.of(config).levels)
    return len(config.sparse_layers) * windows * config.num_key_value_heads * config.head_dim * 4


def state_bytes_per_seq(config, kv_plan: KVPlan | None = None) -> int:
    """The recurrent states of one sequence across all lightning layers (fp32 without a plan)."""
    if kv_plan is None:
        return len(config.lightning_layers) * config.lightning_nh * config.lightning_head_dim**2 * 4
    return sum(kv_plan.state_bytes_per_seq(config).values())


@dataclass(frozen=True)
class MemoryPlan:
    budget_bytes: int
    page_size: int
    num_pages: int
    max_seqs: int
    kv_bytes_per_token: int
    state_bytes_per_seq: int
    max_model_len: int
    compressed_bytes_per_page: int = 0

    @property
    def page_bytes(self) -> int:
        return self.page_size * self.kv_bytes_per_token + self.compressed_bytes_per_page

    def request_bytes(self, n_tokens: int) -> int:
        """What one request of n_tokens holds: pages of K/V (sparse layers only) and the constant state."""
        return -(-n_tokens // self.page_size) * self.page_bytes + self.state_bytes_per_seq

    @property
    def max_kv_tokens(self) -> int:
        return self.num_pages * self.page_size

    def describe(self) -> str:
        return (f"cache budget {self.budget_bytes / 2**20:.0f} MiB: {self.max_kv_tokens} K/V tokens "
                f"({self.kv_bytes_per_token} B a token) in {self.num_pages} pages of {self.page_size}, "
                f"states for {self.max_seqs} sequences ({self.state_bytes_per_seq / 2**20:.2f} MiB each)")


def full_request_kv_bytes(config, max_model_len: int, page_size: int, kv_plan: KVPlan) -> int:
    """K/V pages (and compressed keys) of one request of max_model_len tokens: the least a cache must hold."""
    return -(-max_model_len // page_size) * (page_size * kv_bytes_per_token(config, kv_plan)
                                             + compressed_bytes_per_page(config, max_model_len, page_size))


def plan_memory(config, budget_bytes: int, max_seqs: int, max_model_len: int, page_size: int,
                kv_plan: KVPlan) -> MemoryPlan:
    kv_token, state = kv_bytes_per_token(config, kv_plan), state_bytes_per_seq(config, kv_plan)
    compressed = compressed_bytes_per_page(config, max_model_len, page_size)
    k2_stride = sparse.SparseSettings.of(config).levels[1][1]
    if compressed and page_size % k2_stride:
        raise ValueError(f"page_size={page_size} must be a multiple of {k2_stride} (4 x sparse_config.kernel_stride) "
                         f"when requests can reach sparse_config.dense_len: compressed keys are stored by page")
    page = page_size * kv_token + compressed
    one_full = full_request_kv_bytes(config, max_model_len, page_size, kv_plan)
    if budget_bytes < one_full + state:
        raise CacheFull(f"a cache budget of {budget_bytes / 2**20:.1f} MiB cannot hold one request of max_model_len="
                        f"{max_model_len} tokens ({(one_full + state) / 2**20:.1f} MiB of K/V and state): raise the "
                        f"budget (memory_bytes / gpu_memory_utilization) or lower max_model_len")
    seqs = int(min(max_seqs, (budget_bytes - one_full) // state)) if state else max_seqs
    pages = int((budget_bytes - seqs * state) // max(page, 1))
    return MemoryPlan(budget_bytes, page_size, pages, seqs, kv_token, state, max_model_len, compressed)


class CachePool:
    def __init__(self, config, plan: MemoryPlan, kv_plan: KVPlan, device: torch.device):
        self.plan, self.kv_plan, self.page_size, self.device = plan, kv_plan, plan.page_size, device
        n_kv, d = config.num_key_value_heads, config.head_dim

        def pages(i: int, side: str) -> KVPages:
            return KVPages(kv_plan.codec(i, side), plan.num_pages + 1, plan.page_size, n_kv, d, device)

        self.k = {i: pages(i, "k") for i in config.sparse_layers}
        self.v = {i: pages(i, "v") for i in config.sparse_layers}
        h, dl = config.lightning_nh, config.lightning_head_dim
        self.states = {i: torch.zeros(plan.max_seqs + 1, h, dl, dl, dtype=kv_plan.state_dtype(i), device=device)
                       for i in config.lightning_layers}
        self.compressed = plan.compressed_bytes_per_page > 0
        k1_stride, k2_stride = (st for _, st in sparse.SparseSettings.of(config).levels)
        rows = (plan.num_pages + 1) * plan.page_size
        self.k1 = {i: torch.zeros(rows // k1_stride, n_kv, d, device=device) for i in config.sparse_layers if self.compressed}
        self.k2 = {i: torch.zeros(rows // k2_stride, n_kv, d, device=device) for i in config.sparse_layers if self.compressed}
        self.scratch_page, self.scratch_slot = plan.num_pages, plan.max_seqs
        self.free_pages = list(range(plan.num_pages - 1, -1, -1))
        self.free_state_slots = list(range(plan.max_seqs - 1, -1, -1))
        self.prefix = None  # a PrefixCache (sala/engine/prefix.py): pages it caches count as free, taken back on demand

    @property
    def max_tokens(self) -> int:
        return self.plan.max_kv_tokens

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    @property
    def num_free_pages(self) -> int:
        """Free pages plus cached ones no request holds (the prefix cache gives those back when asked)."""
        return len(self.free_pages) + (self.prefix.num_evictable if self.prefix else 0)

    def can_admit(self, n_tokens: int) -> bool:
        return bool(self.free_state_slots) and self.num_free_pages >= self.pages_for(n_tokens)

    def admit(self, req: Request) -> None:
        """A state slot, zeroed so that a prompt starts from the empty state."""
        req.state_slot = self.free_state_slots.pop()
        for s in self.states.values():
            s[req.state_slot].zero_()

    def grow(self, req: Request, n_tokens: int) -> bool:
        """Pages for positions 0 .. n_tokens - 1; False (and nothing taken) if too few are free."""
        need = self.pages_for(n_tokens) - len(req.pages)
        if need > self.num_free_pages:
            return False
        if need > len(self.free_pages):
            self.prefix.evict(need - len(self.free_pages))
        if need > 0:
            req.pages += [self.free_pages.pop() for _ in range(need)]
            req.page_table = torch.tensor(req.pages, device=self.device)
        return True

    def free(self, req: Request) -> None:
        if self.prefix:
            self.prefix.release(req)  # its shared pages stay cached; the rest are freed here
        self.free_pages.extend(reversed(req.pages))
        if req.state_slot >= 0:
            self.free_state_slots.append(req.state_slot)
        req.pages, req.page_table, req.state_slot = [], None, -1

    def copy_page(self, src: int, dst: int) -> None:
        """Page dst's K/V := page src's, in every sparse layer (a prefix tail copied for a new request)."""
        for pages in (*self.k.values(), *self.v.values()):
            for t in (pages.data, pages.scale):  # the stored format as it is: codes and their scales
                if t is not None:
                    t[dst].copy_(t[src])

    def rows(self, req: Request, start: int, end: int) -> torch.Tensor:
        """Pool rows (page * page_size + offset) of positions start .. end - 1."""
        pos = torch.arange(start, end, device=self.device)
        return req.page_table[pos // self.page_size] * self.page_size + pos % self.page_size

    def row(self, req: Request, pos: int) -> int:
        return req.pages[pos // self.page_size] * self.page_size + pos % self.page_size

    @property
    def scratch_row(self) -> int:
        return self.scratch_page * self.page_size
