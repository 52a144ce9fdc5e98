"""InfLLM-v2: the block-sparse attention MiniCPM-SALA's "minicpm4" layers use at long context.

From kv_len >= sparse_config.dense_len on (decided once per forward call, as the official code
does), each query attends only to `topk + window_size // block_size` selected blocks of
`block_size` keys (spec §3.4, with the corrections read from the official CUDA kernels):

1. compressed keys, per kv head, from the keys as cached: K1 = means of `kernel_size`-key
   windows every `kernel_stride` keys, K2 = the same at 4x both (128/64 for the release);
   windows start at 0 and only complete ones exist;
2. stage-1 score of K1 window j for query t: the sum over the query heads of its kv group of
   exp(scale * q.k1_j - lse), lse = the log-sum-exp of scale * q.k2 over the K2 windows visible
   to t (K2 stands in for the softmax normaliser; it is not a softmax over K1);
3. block b takes the max over the K1 windows that overlap it ([4b - 1, 4b + 4) for the
   release: kernel 5, stride 4, padding 1), -inf if none is visible;
4. the first `init_blocks` blocks and the local window (window_size // block_size blocks
   before the query's own block, plus its own) score +inf;
5. the k best blocks (k = topk + window_size // block_size), exact ties going to the lower
   block index as the CUDA top-k fills them, those past the query's own block dropped;
6. attention over the selected blocks' keys at positions <= t, scale 1/sqrt(d).

Visibility: a window is visible to query t when it ends at or before t, except that in the
rows of a one-shot prefill of P tokens every query sees one window fewer when
P % stride == stride - 1 (a quirk of the official kernel, kept because the official output has
it). Decode rows see every window. Callers say which rows are prefill rows with `prefill_len`:
the transformers path passes the call's length for a prefill call and 0 for a decode step; the
engine passes the request's prompt length, so prompt rows behave as one prefill call however
the prompt is cut into chunks, and generated tokens as decode steps.

Queries whose every causal block fits in the selection (position < k * block_size) see all of
them, which is dense causal attention; only later queries attend sparsely. Everything here
runs in fp32 and in bounded memory: the stage-1 logits are made a tile of queries at a time,
and the attention gathers, per tile of queries in one block, only the union of their blocks.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import block_sparse_attention as kernel
from kernels import target
from kernels.stage1_scores import stage1_scores

SPARSE_KEYS = ("block_size", "dense_len", "init_blocks", "kernel_size", "kernel_stride", "topk", "window_size")
STAGE1_ELEMENTS = 1 << 24  # fp32 stage-1 logits per tile (64 MiB): bounds activation memory at any length


@dataclass(frozen=True)
class SparseSettings:
    block_size: int
    dense_len: int
    init_blocks: int
    kernel_size: int
    kernel_stride: int
    topk: int
    window_size: int

    @classmethod
    def of(cls, config) -> SparseSettings:
        return cls(*(int(config.sparse_config[k]) for k in SPARSE_KEYS))

    @property
    def local_blocks(self) -> int:
        return self.window_size // self.block_size

    @property
    def num_selected(self) -> int:
        return self.topk + self.local_blocks

    @property
    def levels(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """(window, stride) of K1 and of K2."""
        return (self.kernel_size, self.kernel_stride), (4 * self.kernel_size, 4 * self.kernel_stride)


def validate(sparse_config: dict) -> str | None:
    """What is wrong with a sparse_config, or None (SALAConfig raises it as a ConfigError)."""
    missing = [k for k in SPARSE_KEYS if not isinstance(sparse_config.get(k), int) or isinstance(sparse_config.get(k), bool)]
    if missing:
        return f"sparse_config: {', '.join(missing)} must be integers, got {[sparse_config.get(k) for k in missing]}"
    s = SparseSettings(*(sparse_config[k] for k in SPARSE_KEYS))
    if min(s.block_size, s.kernel_size, s.kernel_stride) < 1:
        return f"sparse_config: block_size, kernel_size and kernel_stride must be positive, got {s}"
    if s.kernel_stride > s.kernel_size:
        return f"sparse_config: kernel_stride={s.kernel_stride} is larger than kernel_size={s.kernel_size} (windows would skip keys)"
    if s.kernel_size % s.kernel_stride or s.block_size % s.kernel_stride:
        return (f"sparse_config: kernel_size={s.kernel_size} and block_size={s.block_size} must be multiples of "
                f"kernel_stride={s.kernel_stride} (compressed windows are pooled onto blocks)")
    if s.window_size < 0 or s.window_size % s.block_size:
        return f"sparse_config: window_size={s.window_size} is not a multiple of block_size={s.block_size}"
    if s.topk < 1:
        return f"sparse_config: topk={s.topk} must be at least 1"
    if s.init_blocks < 0 or s.dense_len < 0:
        return f"sparse_config: init_blocks={s.init_blocks} and dense_len={s.dense_len} must not be negative"
    return None


def sparse_reachable(config, max_len: int) -> bool:
    """Whether a sequence of max_len tokens reaches the sparse path (so compressed keys are needed)."""
    return bool(config.sparse_layers) and max_len >= int(config.sparse_config["dense_len"])


# ---------------------------------------------------------------- compressed keys
def num_windows(length: int, size: int, stride: int) -> int:
    return max((length - size) // stride + 1, 0)


def window_means(windows: torch.Tensor) -> torch.Tensor:
    """[n, size, Hkv, D] keys -> [n, Hkv, D] fp32 means. Every caller goes through this one
    reduction, so a window computed alone during decode equals the one a full pass computes."""
    return windows.float().mean(1)


def compress(keys: torch.Tensor, size: int, stride: int, first: int = 0) -> torch.Tensor:
    """Means of the complete windows first, first + 1, ... of keys [L, Hkv, D]: [n - first, Hkv, D]."""
    n = num_windows(keys.shape[0], size, stride)
    starts = torch.arange(first, max(n, first), device=keys.device) * stride
    return window_means(keys[starts[:, None] + torch.arange(size, device=keys.device)])


class CompressedKeys:
    """K1 and K2 of one sequence in one layer, extended by the windows its new keys complete."""

    def __init__(self, settings: SparseSettings):
        self.settings = settings
        self.levels: list[torch.Tensor | None] = [None, None]

    def copy(self) -> CompressedKeys:
        """An independent copy (beam search reorders sequences; extending never writes in place)."""
        twin = CompressedKeys(self.settings)
        twin.levels = list(self.levels)
        return twin

    def extend(self, keys: torch.Tensor) -> list[torch.Tensor]:
        """keys: every key of the sequence so far, [L, Hkv, D]; returns [K1, K2]."""
        for i, (size, stride) in enumerate(self.settings.levels):
            have = 0 if self.levels[i] is None else self.levels[i].shape[0]
            new = compress(keys, size, stride, have)
            self.levels[i] = new if self.levels[i] is None else torch.cat([self.levels[i], new])
        return self.levels


# ---------------------------------------------------------------- block selection
def visible_windows(pos: torch.Tensor, n: int, size: int, stride: int, prefill_len: int) -> torch.Tensor:
    """How many of the first windows each query sees: those ending at or before its position,
    one fewer in the rows (pos < prefill_len) of a one-shot prefill whose length is
    stride - 1 modulo stride (the official kernel's count), at most the n that exist."""
    vis = torch.div(pos + 1 - size, stride, rounding_mode="floor") + 1
    if prefill_len % stride == stride - 1:
        vis = vis - (pos < prefill_len).long()
    return vis.clamp(0, n)


def causal_blocks(pos: torch.Tensor, nb: int, block_size: int) -> torch.Tensor:
    """[T, nb]: blocks at or before each query's own."""
    return torch.arange(nb, device=pos.device) <= (pos // block_size)[:, None]


def select_blocks(q: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor, pos: torch.Tensor, prefill_len: int,
                  s: SparseSettings, scale: float) -> torch.Tensor:
    """Selected blocks [Hkv, T, nb] (bool) for queries q [Hq, T, D] at positions pos [T], from
    compressed keys k1 / k2 [n, Hkv, D]; nb covers the blocks up to the last query's."""
    hq, t, d = q.shape
    hkv = k1.shape[1]
    nb = int(pos[-1]) // s.block_size + 1
    mask = causal_blocks(pos, nb, s.block_size)[None].expand(hkv, t, nb).clone()
    # Queries with at most k causal blocks keep all of them: only later ones need scores.
    todo = (pos // s.block_size >= s.num_selected).nonzero().flatten()
    if not len(todo):
        return mask
    (size1, stride1), (size2, stride2) = s.levels
    blocks = torch.arange(nb, device=q.device)
    pool_kernel = size1 // stride1 + s.block_size // stride1 - 1  # K1 windows that overlap one block
    pool_pad = size1 // stride1 - 1
    pool_len = (nb - 1) * (s.block_size // stride1) + pool_kernel
    tile = max(1, STAGE1_ELEMENTS // (hq * max(k1.shape[0], 1)))
    for i in range(0, len(todo), tile):
        rows = todo[i : i + tile]
        p = pos[rows]
        vis1 = visible_windows(p, k1.shape[0], size1, stride1, prefill_len)
        vis2 = visible_windows(p, k2.shape[0], size2, stride2, prefill_len)
        score = stage1_scores(q[:, rows].transpose(0, 1), k1, k2, vis1, vis2, scale)  # [Hkv, Tc, n1]
        hidden1 = torch.arange(k1.shape[0], device=q.device) >= vis1[:, None]
        score.masked_fill_(hidden1, float("-inf"))
        padded = score.new_full((hkv, len(rows), pool_len), float("-inf"))
        n_in = min(score.shape[-1], pool_len - pool_pad)
        padded[..., pool_pad : pool_pad + n_in] = score[..., :n_in]
        pooled = padded.unfold(-1, pool_kernel, s.block_size // stride1).amax(-1)  # [Hkv, Tc, nb]
        own = (p // s.block_size)[:, None]
        forced = (blocks < s.init_blocks) | ((blocks >= own - s.local_blocks) & (blocks <= own))
        pooled.masked_fill_(forced, float("inf"))
        # Stable descending sort: among equal scores the lower block index comes first.
        top = pooled.sort(dim=-1, descending=True, stable=True).indices[..., : s.num_selected]
        chosen = torch.zeros_like(pooled, dtype=torch.bool).scatter_(-1, top, True)
        mask[:, rows] = chosen & (blocks <= own)
    return mask


# ---------------------------------------------------------------- attention over the selection
def block_sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, mask: torch.Tensor,
                           block_size: int, scale: float) -> torch.Tensor:
    """q [Hq, T, D] at positions pos; k, v [L, Hkv, D]; mask [Hkv, T, nb] selected blocks.
    Each query attends to the keys of its selected blocks at positions <= its own; fp32, [Hq, T, D]."""
    hq, t, d = q.shape
    hkv = k.shape[1]
    out = torch.empty(hq, t, d, dtype=torch.float32, device=q.device)
    offsets = torch.arange(block_size, device=q.device)
    own = pos // block_size
    starts = [0] + (torch.nonzero(own[1:] != own[:-1]).flatten() + 1).tolist() + [t]
    for a, b in zip(starts[:-1], starts[1:]):  # queries of one block share their forced blocks
        sel = mask[:, a:b]
        union = sel.any(1).any(0).nonzero().flatten()
        kpos = (union[:, None] * block_size + offsets).flatten()
        kpos_c = kpos.clamp(max=k.shape[0] - 1)
        kt = k[kpos_c].float().permute(1, 2, 0)[:, None]  # [Hkv, 1, D, Lk]
        vt = v[kpos_c].float().permute(1, 0, 2)[:, None]  # [Hkv, 1, Lk, D]
        allowed = sel[:, :, union].repeat_interleave(block_size, -1) & (kpos <= pos[a:b, None])  # [Hkv, Tc, Lk]
        qg = q[:, a:b].float().reshape(hkv, hq // hkv, b - a, d)
        scores = (qg @ kt) * scale
        scores.masked_fill_(~allowed[:, None], float("-inf"))
        out[:, a:b] = (scores.softmax(-1) @ vt).reshape(hq, b - a, d)
    return out


def infllm_v2_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k1: torch.Tensor, k2: torch.Tensor,
                        start: int, prefill_len: int, s: SparseSettings, scale: float,
                        dense_rows: torch.Tensor | None = None) -> torch.Tensor:
    """One sequence's queries q [Hq, T, D] at positions start .. start + T - 1 over its keys
    k, v [>= start + T, Hkv, D] (cached layout) and compressed keys k1 / k2; rows where
    `dense_rows` is true attend to every causal key. Returns [Hq, T, D] in q's dtype."""
    pos = torch.arange(start, start + q.shape[1], device=q.device)
    mask = select_blocks(q, k1, k2, pos, prefill_len, s, scale)
    if dense_rows is not None and bool(dense_rows.any()):
        mask[:, dense_rows] = causal_blocks(pos[dense_rows], mask.shape[-1], s.block_size)
    if target.on_gpu(q):  # the Triton kernel takes each query's block list (-1 padded) instead of the mask
        width = int(mask.sum(-1).max())
        ids = torch.where(mask, torch.arange(mask.shape[-1], device=q.device), -1)
        ids = ids.sort(-1, descending=True).values[..., :width].contiguous()
        return kernel.block_sparse_attention(q.transpose(0, 1), k, v, pos, ids, s.block_size, scale).transpose(0, 1)
    return block_sparse_attention(q, k, v, pos, mask, s.block_size, scale).to(q.dtype)


def call_length(pos: int, prompt_len: int) -> int:
    """The kv_len that decides dense or sparse for an engine row: prompt rows (pos < prompt_len)
    belong to one prefill call of prompt_len tokens, every later row to a decode step of pos + 1."""
    return prompt_len if pos < prompt_len else pos + 1


def dense_rows(pos: torch.Tensor, prompt_len: int, s: SparseSettings) -> torch.Tensor:
    """call_length < dense_len for a tensor of positions."""
    return torch.where(pos < prompt_len, torch.full_like(pos, prompt_len), pos + 1) < s.dense_len
