"""How much cache an engine gets and how it is split: the byte budget and the memory plan.

`default_budget`: on CUDA, like vLLM's gpu_memory_utilization, that fraction of the device less
what is in use and room for the largest step's activations and logits; on CPU room for
`max_seqs` sequences of min(max_model_len, 4096) tokens, at most a quarter of the machine's
memory. `plan_memory` splits a budget: the state pool first takes what `max_seqs` sequences
need (for the 9B model 48 MiB a sequence, so at short contexts states, not K/V, bound
concurrency), after keeping room for one request of `max_model_len` tokens; the rest is K/V
pages (and, when a request can reach sparse_config.dense_len, InfLLM-v2's compressed keys,
stored by page).
"""
from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from sala import sparse
from sala.kv import KVPlan


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


def default_budget(config, device: torch.device, utilization: float, max_seqs: int, max_model_len: int, page_size: int,
                    kv_plan) -> int:
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return cuda_cache_budget(config, total, free, utilization, max_seqs)
    states = max_seqs * state_bytes_per_seq(config, kv_plan)
    want = max(max_seqs * min(max_model_len, 4096) * kv_bytes_per_token(config, kv_plan),
               full_request_kv_bytes(config, max_model_len, page_size, kv_plan)) + states
    try:
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        ram = 16 << 30
    return int(min(want, ram // 4))


def cuda_cache_budget(config, total: int, free: int, utilization: float, max_seqs: int) -> int:
    """Like vLLM's gpu_memory_utilization: that fraction of the whole device, less what is in use
    (weights, other processes), less room for the largest step's activations and logits."""
    activations = 2048 * (4 * config.hidden_size + 3 * config.intermediate_size) * 4 + max_seqs * config.vocab_size * 4 * 3
    budget = int(total * utilization) - (total - free) - activations
    if budget <= 0:
        raise CacheFull(f"gpu_memory_utilization={utilization} of {total / 2**30:.1f} GiB leaves no room for the cache: "
                        f"{(total - free) / 2**30:.1f} GiB are in use")
    return budget
