"""The engine's memory: a paged K/V pool for the sparse layers, a state pool for lightning layers.

Sparse layers keep K and V for every past token. They live in one flat tensor per layer,
[num_pages * page_size, kv_heads, head_dim], handed out in pages; a request owns a list of
pages, and `slots` maps each of its positions to a row of that tensor. Every layer has its own
storage dtype (the KV plan's hook: bf16 today, fp8 / nvfp4 formats plug in here), converted to
the compute dtype on read.

Lightning layers keep one fp32 state [heads, d_k, d_v] per request per layer, whatever the
sequence length, in [max_seqs, heads, d_k, d_v] tensors; a request owns one index into them.

Admission reserves pages for the prompt plus max_tokens, so a running request never runs out
of memory and nothing needs preempting; finishing or cancelling returns everything at once.
"""
from __future__ import annotations

import torch

from sala.engine.request import Request


class CacheFull(RuntimeError):
    """A request that cannot fit even in an empty cache."""


class CachePool:
    def __init__(self, config, memory_bytes: int, max_seqs: int, page_size: int = 64,
                 compute_dtype: torch.dtype = torch.float32, kv_dtypes: dict[int, torch.dtype] | None = None,
                 device: str | torch.device = "cpu"):
        self.page_size = page_size
        self.compute_dtype = compute_dtype
        self.device = torch.device(device)
        d, n_kv = config.head_dim, config.num_key_value_heads
        dtypes = {i: (kv_dtypes or {}).get(i, compute_dtype) for i in config.sparse_layers}
        h, dl = config.lightning_nh, config.lightning_head_dim
        state_bytes = max_seqs * len(config.lightning_layers) * h * dl * dl * 4
        page_bytes = sum(2 * page_size * n_kv * d * t.itemsize for t in dtypes.values())
        self.num_pages = (memory_bytes - state_bytes) // max(page_bytes, 1)
        if self.num_pages < 1:
            raise CacheFull(f"memory budget of {memory_bytes} bytes holds the states of {max_seqs} sequences "
                            f"({state_bytes} bytes) but not one K/V page ({page_bytes} bytes)")
        rows = self.num_pages * page_size
        self.k = {i: torch.zeros(rows, n_kv, d, dtype=t, device=self.device) for i, t in dtypes.items()}
        self.v = {i: torch.zeros(rows, n_kv, d, dtype=t, device=self.device) for i, t in dtypes.items()}
        self.states = {i: torch.zeros(max_seqs, h, dl, dl, device=self.device) for i in config.lightning_layers}
        self.free_pages = list(range(self.num_pages - 1, -1, -1))
        self.free_state_slots = list(range(max_seqs - 1, -1, -1))

    @property
    def max_tokens(self) -> int:
        return self.num_pages * self.page_size

    def pages_for(self, n_tokens: int) -> int:
        return -(-n_tokens // self.page_size)

    def can_allocate(self, req: Request) -> bool:
        return bool(self.free_state_slots) and len(self.free_pages) >= self.pages_for(req.capacity)

    def allocate(self, req: Request) -> None:
        n = self.pages_for(req.capacity)
        req.pages = [self.free_pages.pop() for _ in range(n)]
        req.state_slot = self.free_state_slots.pop()
        pos = torch.arange(req.capacity, device=self.device)
        pages = torch.tensor(req.pages, device=self.device)
        req.slots = pages[pos // self.page_size] * self.page_size + pos % self.page_size

    def free(self, req: Request) -> None:
        self.free_pages.extend(reversed(req.pages))
        if req.state_slot >= 0:
            self.free_state_slots.append(req.state_slot)
        req.pages, req.state_slot, req.slots = [], -1, None

    def write_kv(self, layer: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots [N]; k, v [N, kv_heads, head_dim]."""
        self.k[layer].index_copy_(0, slots, k.to(self.k[layer].dtype))
        self.v[layer].index_copy_(0, slots, v.to(self.v[layer].dtype))

    def read_kv(self, layer: int, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """slots [B, L] -> k, v [B, kv_heads, L, head_dim] in the compute dtype."""
        k = self.k[layer][slots].to(self.compute_dtype).transpose(1, 2)
        v = self.v[layer][slots].to(self.compute_dtype).transpose(1, 2)
        return k, v

    def read_state(self, layer: int, state_slots: torch.Tensor) -> torch.Tensor:
        return self.states[layer][state_slots]

    def write_state(self, layer: int, state_slots: torch.Tensor, state: torch.Tensor) -> None:
        self.states[layer].index_copy_(0, state_slots, state)
