"""SALAForCausalLM: MiniCPM-SALA in plain PyTorch (shared/design/specs/sala-architecture.md).

Layers mix two mixers:
- "minicpm4" (sparse) layers: softmax attention with GQA, no RoPE, sigmoid output gate, a KV cache.
- "lightning-attn" layers: linear attention with per-head decay, QK-norm, RoPE, output norm and
  gate, one fp32 recurrent state per sequence.

Parameter names equal the real checkpoint's. There is one forward for two callers: transformers
(batches [B, T] with a contiguous SALACache) and the serving engine, which passes a step context
(sala/context.py: slot mapping, page tables, state slots, prompt spans) with all of a step's
tokens as one row; each mixer then reads and writes the engine's K/V and state pools itself.
For serving, `fuse_projections` turns q/k/v/gate and gate/up into one GEMM each.

From `sparse_config.dense_len` tokens on, the sparse layers switch to InfLLM-v2 block-sparse
attention (sala/sparse.py), decided once per forward call as the official code does; below
it they attend densely, which is exactly the official computation there.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.utils.rnn import pad_sequence
from transformers import AutoModelForCausalLM, GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from kernels.lightning_decode import lightning_decode
from kernels.prefill_attention import prefill_attention
from sala import lightning, lightning_tree, sparse
from sala.config import LIGHTNING, SALAConfig
from sala.kv.pages import decode_attention


class RMSNorm(nn.Module):
    """Llama numerics: variance in fp32, normalised value cast back, then times the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


def rope_inv_freq(head_dim: int, theta: float) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))


class Fp32Constants:
    """Small fp32 tables (RoPE frequencies, decays) kept out of the module's buffers, so that
    `model.to(torch.bfloat16)` cannot round them; copied once per device on first use."""

    def __init__(self, **tables: torch.Tensor):
        self._cpu = {k: v.to("cpu", torch.float32) for k, v in tables.items()}
        self._by_device: dict[torch.device, dict[str, torch.Tensor]] = {}

    def get(self, name: str, device: torch.device) -> torch.Tensor:
        if device not in self._by_device:
            self._by_device[device] = {k: v.to(device) for k, v in self._cpu.items()}
        return self._by_device[device][name]


def rope_tables(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 cos and sin [B, 1, T, D] for positions [B, T]: computed once a forward, read by every layer."""
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def apply_rope(x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """NeoX rotate-half RoPE, computed in fp32 and cast back. x: [B, H, T, D]."""
    cos, sin = rope
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    return (xf * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


def concat_linears(parts: list[nn.Module]) -> nn.Module | None:
    """One Linear computing all of `parts` side by side (outputs concatenated), or None when
    they are of different kinds. Packed NVFP4 Linears bring their own `concat`."""
    kind = type(parts[0])
    if any(type(p) is not kind for p in parts):
        return None
    if hasattr(kind, "concat"):
        return kind.concat(parts)
    w = parts[0].weight
    has_bias = parts[0].bias is not None
    fused = nn.Linear(w.shape[1], sum(p.weight.shape[0] for p in parts), bias=has_bias, device=w.device, dtype=w.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([p.weight for p in parts]))
        if has_bias:
            fused.bias.copy_(torch.cat([p.bias for p in parts]))
    return fused.requires_grad_(w.requires_grad)


class MLP(nn.Module):
    def __init__(self, config: SALAConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.gate_up_proj = None

    def fuse(self) -> None:
        """gate and up as one GEMM (the serving engine calls this at load); a no-op once fused."""
        if self.gate_up_proj is not None:
            return
        fused = concat_linears([self.gate_proj, self.up_proj])
        if fused is not None:
            self.gate_up_proj = fused
            del self.gate_proj, self.up_proj

    def forward(self, x):
        if self.gate_up_proj is not None:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class QKVOProjections(nn.Module):
    """The projections both mixers share: q, k, v, an optional output gate (`gate_name`) read
    from the layer input, and o. `heads` returns q, k, v as [B, H, T, D] and the gate's logits."""

    gate_name = ""

    def __init__(self, config: SALAConfig, layer_idx: int, n_heads: int, n_kv: int, head_dim: int, gated: bool):
        super().__init__()
        self.config, self.layer_idx = config, layer_idx
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        hs, d = config.hidden_size, head_dim
        self.q_proj = nn.Linear(hs, n_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(hs, n_kv * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(hs, n_kv * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(n_heads * d, hs, bias=False)
        self.gated = gated
        if gated:
            setattr(self, self.gate_name, nn.Linear(hs, n_heads * d, bias=False))
        self.qkvg_proj = None
        self.split_sizes = [n_heads * d, n_kv * d, n_kv * d] + ([n_heads * d] if gated else [])

    def fuse(self) -> None:
        """q, k, v and the gate as one GEMM (the serving engine calls this at load); a no-op once fused."""
        if self.qkvg_proj is not None:
            return
        names = ["q_proj", "k_proj", "v_proj"] + ([self.gate_name] if self.gated else [])
        fused = concat_linears([getattr(self, n) for n in names])
        if fused is not None:
            self.qkvg_proj = fused
            for n in names:
                delattr(self, n)

    def heads(self, x: torch.Tensor):
        b, t, _ = x.shape
        if self.qkvg_proj is not None:
            q, k, v, *gate = self.qkvg_proj(x).split(self.split_sizes, dim=-1)
            gate = gate[0] if gate else None
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
            gate = getattr(self, self.gate_name)(x) if self.gated else None
        q = q.reshape(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.reshape(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.reshape(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return q, k, v, gate


class SparseAttention(QKVOProjections):
    """The "minicpm4" mixer: GQA softmax attention, NoPE by default, sigmoid output gate."""

    gate_name = "o_gate"
    # sala.kv.apply_to_model sets a callable (k, v) -> (k, v) as the cache stores them, so the
    # batch path attends over the same quantized K/V the engine's pages hold.
    kv_quant = None

    def __init__(self, config: SALAConfig, layer_idx: int):
        super().__init__(config, layer_idx, config.num_attention_heads, config.num_key_value_heads,
                         config.hidden_size // config.num_attention_heads, config.attn_use_output_gate)
        self.sparse = sparse.SparseSettings.of(config)

    def forward(self, x, rope, cache: SALACache | None, key_mask: torch.Tensor | None, context=None):
        q, k, v, gate = self.heads(x)
        if self.config.attn_use_rope:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if context is not None:
            o = self.attend_step(q, k, v, context)
        else:
            o = self.attend_batch(q, k, v, cache, key_mask)
        o = o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        if gate is not None:  # the gate reads the normalised layer input, not the residual
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    def attend_batch(self, q, k, v, cache: SALACache | None, key_mask: torch.Tensor | None):
        """[B, T] batches with a contiguous per-batch cache (the transformers path)."""
        past = 0
        if self.kv_quant is not None:
            k, v = self.kv_quant(k, v)
        if cache is not None:
            past = cache.kv_length(self.layer_idx)
            k, v = cache.append_kv(self.layer_idx, k, v)
        # The official switch: kv_len = max(position_ids) + 1 of this call (the longest sequence).
        if k.shape[2] >= self.sparse.dense_len:
            kv_len = k.shape[2] if key_mask is None else int(key_mask[:, : k.shape[2]].sum(-1).max())
            if kv_len >= self.sparse.dense_len:
                return self.attend_batch_sparse(q, k, v, cache, key_mask, past)
        gqa = self.n_heads != self.n_kv
        if key_mask is None and (past == 0 or q.shape[2] == 1):
            # No padding, and either a fresh prefill or one decode token: the flash path needs no
            # materialised mask (is_causal aligns top-left, which is right only when past == 0).
            return F.scaled_dot_product_attention(q, k, v, is_causal=past == 0 and q.shape[2] > 1, enable_gqa=gqa)
        mask = causal_mask(q.shape[2], k.shape[2], past, key_mask, q.device)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)

    def attend_batch_sparse(self, q, k, v, cache: SALACache | None, key_mask: torch.Tensor | None, past: int):
        """InfLLM-v2 for a [B, T] call, one sequence at a time over its real (unpadded) tokens.
        A call of one token after the first is a decode step; any other call is a prefill."""
        t = q.shape[2]
        prefill = t > 1 or past == 0
        out = q.new_zeros(q.shape)
        for b in range(q.shape[0]):
            keys, values = k[b].transpose(0, 1), v[b].transpose(0, 1)  # [S, Hkv, D]: the cached layout
            rows = slice(None)
            if key_mask is not None:
                real = key_mask[b, : k.shape[2]].bool()
                keys, values, rows = keys[real], values[real], real[-t:]
            qb = q[b][:, rows]
            n = keys.shape[0]
            compressed = (cache.compressed_keys(self.layer_idx, b, self.sparse) if cache is not None
                          else sparse.CompressedKeys(self.sparse)).extend(keys)
            out[b][:, rows] = sparse.infllm_v2_attention(qb, keys, values, *compressed, n - qb.shape[1],
                                                         n if prefill else 0, self.sparse, self.head_dim**-0.5)
        return out

    def attend_step(self, q, k, v, ctx):
        """One engine step's flat rows (q [1, Hq, N, D]) over the paged K/V pool (sala/kv/pages.py:
        each layer's pages in its own format); see sala/context.py."""
        k_pages, v_pages = ctx.cache.k[self.layer_idx], ctx.cache.v[self.layer_idx]
        k_pages.write(ctx.slot_mapping, k[0].transpose(0, 1))
        v_pages.write(ctx.slot_mapping, v[0].transpose(0, 1))
        compressed = self.layer_idx in ctx.cache.k1
        if compressed:
            self.compress_step(ctx, k_pages, q.dtype)
        # A quantized cache: prompt chunks attend over what decode will read, not the exact K/V.
        lossless = k_pages.codec.lossless_for(q.dtype) and v_pages.codec.lossless_for(q.dtype)
        scale = self.head_dim**-0.5
        outs = [self.attend_tree(q, k, v, k_pages, v_pages, ctx.tree)] if ctx.tree else []
        if ctx.num_decode:
            q_dec = q[0, :, : ctx.num_decode].transpose(0, 1)
            sparse_rows = [i for i, (n, p) in enumerate(zip(ctx.context_lens.tolist(), ctx.decode_prompt_lens))
                           if sparse.call_length(n - 1, p) >= self.sparse.dense_len] if ctx.decode_prompt_lens else []
            if sparse_rows:
                o = self.decode_sparse(q_dec, ctx, k_pages, v_pages, sparse_rows)
            else:
                o = decode_attention(q_dec, k_pages, v_pages, ctx.block_tables, ctx.context_lens, scale)
            outs.append(o.transpose(0, 1))  # [Hq, n_decode, D]
        for span in ctx.prefills:
            end = span.start + span.length
            qs = q[:, :, span.start : end]
            pos = torch.arange(span.past, span.past + span.length, device=q.device)
            dense = sparse.dense_rows(pos, span.prompt_len, self.sparse) if compressed else None
            if dense is not None and not bool(dense.all()):
                keys, values, k1, k2 = self.request_keys(ctx, k_pages, v_pages, span.kv_rows, q.dtype)
                outs.append(sparse.infllm_v2_attention(qs[0], keys, values, k1, k2, span.past, span.prompt_len,
                                                       self.sparse, scale, dense))
                continue
            if span.past == 0 and lossless:  # a fresh prompt: its own K/V, causal flash path
                ks, vs = k[:, :, span.start : end], v[:, :, span.start : end]
            else:
                rows = span.kv_rows if span.past else ctx.slot_mapping[span.start : end]
                ks = k_pages.read(rows, q.dtype).transpose(0, 1)[None]
                vs = v_pages.read(rows, q.dtype).transpose(0, 1)[None]
            if ctx.batch_invariant:  # fixed blocks of absolute positions: cut-independent bits
                outs.append(prefill_attention_in_blocks(qs, ks, vs, span.past, self.n_heads != self.n_kv))
            else:
                outs.append(prefill_attention(qs[0], ks[0], vs[0]))  # Triton on CUDA, SDPA elsewhere
        return _rows_with_padding(outs, q)

    def compress_step(self, ctx, k_pages, dtype: torch.dtype) -> None:
        """Add the InfLLM-v2 compressed-key windows this step's keys complete to the pool. Decode
        rows in tensor ops only (a compiled or captured decode step runs this too): each computes
        the window ending at its token and writes it where it belongs, or to scratch if incomplete."""
        cache, ps, nd = ctx.cache, ctx.cache.page_size, ctx.num_decode
        for pool, (size, stride) in zip((cache.k1[self.layer_idx], cache.k2[self.layer_idx]), self.sparse.levels):
            if nd:
                length = ctx.positions[:nd] + 1
                tok = torch.minimum((length - size).clamp(min=0)[:, None] + torch.arange(size, device=length.device),
                                    length[:, None] - 1)  # [nd, size] positions, clamped while incomplete
                rows = ctx.block_tables.gather(1, tok // ps) * ps + tok % ps
                complete = (length >= size) & ((length - size) % stride == 0)
                target = torch.where(complete, rows[:, 0] // stride, cache.scratch_row // stride)
                pool.index_copy_(0, target, sparse.window_means(_read_rows(k_pages, rows, dtype)))
            for span in ctx.prefills:
                first = sparse.num_windows(span.past, size, stride)
                n = sparse.num_windows(span.past + span.length, size, stride)
                if n > first:
                    starts = torch.arange(first, n, device=span.kv_rows.device) * stride
                    rows = span.kv_rows[starts[:, None] + torch.arange(size, device=starts.device)]
                    pool.index_copy_(0, rows[:, 0] // stride, sparse.window_means(_read_rows(k_pages, rows, dtype)))

    def attend_tree(self, q, k, v, k_pages, v_pages, tree):
        """Each tree node over its request's committed K/V and its own ancestors -> [Hq, R*T, D].
        The tree's K/V stay out of the pool (kept in tree.saved for commit_tree)."""
        r, t = tree.num_requests, tree.num_nodes
        qt, kt, vt = (x[0, :, : r * t].unflatten(1, (r, t)).transpose(0, 1) for x in (q, k, v))  # [R, H, T, D]
        tree.saved[self.layer_idx] = (kt, vt)
        # The committed K/V as decode reads them (dequantized from the layer's format).
        kc = k_pages.read(tree.kv_rows.flatten(), q.dtype).unflatten(0, tree.kv_rows.shape).transpose(1, 2)  # [R, Hkv, W, D]
        vc = v_pages.read(tree.kv_rows.flatten(), q.dtype).unflatten(0, tree.kv_rows.shape).transpose(1, 2)
        # The nodes' own K/V as plain decode would read them back: through the layer's format.
        kt, vt = (_through_format(x, pages, q.dtype) for x, pages in ((kt, k_pages), (vt, v_pages)))
        committed = torch.arange(tree.kv_rows.shape[1], device=q.device)[None] < tree.kv_lens[:, None]  # [R, W]
        mask = torch.cat([committed[:, None].expand(r, t, -1), tree.ancestor_mask.expand(r, t, t)], dim=-1)
        # In fp32, as the decode path's paged attention is, so that the verified logits are the decoded ones.
        o = F.scaled_dot_product_attention(qt.float(), torch.cat([kc, kt], 2).float(), torch.cat([vc, vt], 2).float(),
                                           attn_mask=mask[:, None], enable_gqa=self.n_heads != self.n_kv)
        return o.to(q.dtype).transpose(0, 1).flatten(1, 2)

    def commit_tree(self, ctx, nodes: torch.Tensor, dest_rows: torch.Tensor) -> None:
        """Write nodes' K/V (nodes [M] flat indices r * T + i) at pool rows dest_rows [M] (the scratch row for
        nodes not accepted)."""
        kt, vt = ctx.tree.saved.pop(self.layer_idx)
        for saved, pages in ((kt, ctx.cache.k[self.layer_idx]), (vt, ctx.cache.v[self.layer_idx])):
            pages.write(dest_rows, saved.transpose(1, 2).flatten(0, 1)[nodes])  # [M, Hkv, D], quantized by the format

    def request_keys(self, ctx, k_pages, v_pages, kv_rows: torch.Tensor, dtype):
        """One request's keys and values [L, Hkv, D] and compressed keys K1 / K2 from the pools."""
        cache, n = ctx.cache, kv_rows.shape[0]
        k1, k2 = (pool[kv_rows[torch.arange(sparse.num_windows(n, size, stride), device=kv_rows.device) * stride] // stride]
                  for pool, (size, stride) in zip((cache.k1[self.layer_idx], cache.k2[self.layer_idx]), self.sparse.levels))
        return k_pages.read(kv_rows, dtype), v_pages.read(kv_rows, dtype), k1, k2

    def decode_sparse(self, q_dec, ctx, k_pages, v_pages, sparse_rows: list[int]) -> torch.Tensor:
        """Decode rows [n_decode, Hq, D]: the sparse ones one request at a time, the rest batched."""
        o = torch.empty_like(q_dec)
        scale = self.head_dim**-0.5
        dense = [i for i in range(q_dec.shape[0]) if i not in set(sparse_rows)]
        if dense:
            idx = torch.tensor(dense, device=q_dec.device)
            o[idx] = decode_attention(q_dec[idx], k_pages, v_pages, ctx.block_tables[idx], ctx.context_lens[idx], scale)
        ps = ctx.cache.page_size
        for i in sparse_rows:
            n = int(ctx.context_lens[i])
            pos = torch.arange(n, device=q_dec.device)
            kv_rows = ctx.block_tables[i, pos // ps] * ps + pos % ps
            keys, values, k1, k2 = self.request_keys(ctx, k_pages, v_pages, kv_rows, q_dec.dtype)
            o[i] = sparse.infllm_v2_attention(q_dec[i][:, None], keys, values, k1, k2, n - 1, ctx.decode_prompt_lens[i],
                                              self.sparse, scale)[:, 0]
        return o


def _read_rows(pages, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Pool rows of any shape [...] -> their dequantized values [..., H, D]."""
    return pages.read(rows.reshape(-1), dtype).unflatten(0, rows.shape)


def _through_format(x: torch.Tensor, pages, dtype: torch.dtype) -> torch.Tensor:
    """x [R, H, T, D] quantized and dequantized by a KVPages' codec (unchanged for a lossless one)."""
    if pages.codec.lossless_for(dtype):
        return x
    rows = x.transpose(1, 2).flatten(0, 1)  # [R*T, H, D]
    return pages.codec.decode(*pages.codec.encode(rows), dtype).unflatten(0, x.shape[::2]).transpose(1, 2)


def causal_mask(t_q: int, t_k: int, past: int, key_mask: torch.Tensor | None, device) -> torch.Tensor:
    """Boolean [B or 1, 1, Tq, Tk] mask: query i (absolute past + i) sees keys j <= past + i."""
    qi = torch.arange(t_q, device=device)[:, None] + past
    kj = torch.arange(t_k, device=device)[None, :]
    mask = (kj <= qi)[None, None]
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :t_k].bool()
    return mask


def prefill_attention_in_blocks(q, k, v, past: int, gqa: bool) -> torch.Tensor:
    """Causal attention of prompt positions past .. past + Tq (q [1, Hq, Tq, D]) over keys 0 ..
    past + Tq (k, v [1, Hkv, past + Tq, D]), one call per block of lightning.CHUNK_SIZE absolute
    positions, each over the keys up to its block's end -> [Hq, Tq, D].

    The evaluation mode's attention: SDPA's CPU kernel tiles queries and keys by sizes it picks
    from the call's lengths (query tiles of 32 below 192 queries, 64 above; a key tile of
    min(512, keys)), so a position's output changed with how long its chunk was: a 300-token
    prompt prefilled in one chunk and in chunks of 256 + 44 differed from position 128 on.
    Here a block's call depends only on its absolute positions, and the scheduler cuts prompts
    only at multiples of CHUNK_SIZE, so every cut computes each position with the same call."""
    block = lightning.CHUNK_SIZE
    outs = []
    for a in range(past, past + q.shape[2], block):
        b = min((a // block + 1) * block, past + q.shape[2])
        mask = causal_mask(b - a, b, a, None, q.device)
        o = F.scaled_dot_product_attention(q[:, :, a - past : b - past], k[:, :, :b], v[:, :, :b], attn_mask=mask,
                                           enable_gqa=gqa)
        outs.append(o[0])
    return torch.cat(outs, 1)


def _rows_with_padding(outs: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """Per-part outputs [H, rows, D] in row order -> [1, H, N, D]; rows past the last part are
    padding (rows added only to round the batch up) and get zeros."""
    covered = sum(o.shape[1] for o in outs)
    n = like.shape[2]
    if covered < n:
        outs.append(like.new_zeros(like.shape[1], n - covered, like.shape[3]))
    return torch.cat(outs, dim=1)[None] if len(outs) > 1 else outs[0][None]


class LightningAttention(QKVOProjections):
    """The "lightning-attn" mixer: QK-norm, RoPE, fp32 decayed linear attention, output norm and gate."""

    gate_name = "z_proj"
    state_dtype = torch.float32  # what the cache keeps the state in (a KV plan may say bf16); computed in fp32

    def __init__(self, config: SALAConfig, layer_idx: int):
        super().__init__(config, layer_idx, config.lightning_nh, config.lightning_nkv, config.lightning_head_dim,
                         config.use_output_gate)
        d = self.head_dim
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        if config.use_output_norm:
            self.o_norm = RMSNorm(self.n_heads * d, config.rms_norm_eps)
        self.consts = Fp32Constants(log_decay=lightning.log_decay(self.n_heads))
        self.scale = config.lightning_q_scale

    def forward(self, x, rope, cache: SALACache | None, token_mask: torch.Tensor | None, context=None):
        """Tokens where token_mask is 0 (left padding) get k = v = 0, so they leave the state untouched."""
        q, k, v, gate = self.heads(x)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.config.lightning_use_rope:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        rep = self.n_heads // self.n_kv
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        q, k, v = q.float(), k.float(), v.float()
        if token_mask is not None:
            keep = token_mask[:, None, :, None].to(k.dtype)
            k, v = k * keep, v * keep
        g = self.consts.get("log_decay", q.device)
        if context is not None:
            o = self.attend_step(q, k, v, g, context)
        else:
            state = cache.states.get(self.layer_idx) if cache is not None else None
            state = state.float() if state is not None else None
            if q.shape[2] == 1 and state is not None:
                o, state = lightning.step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g, self.scale, state)
                o = o[:, :, None]
            else:
                o, state = lightning.chunked(q, k, v, g, self.scale, state)
            if cache is not None:
                cache.states[self.layer_idx] = state.to(self.state_dtype)
        b, _, t, _ = o.shape
        o = o.transpose(1, 2).reshape(b, t, -1).to(x.dtype)
        if self.config.use_output_norm:
            o = self.o_norm(o)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o)

    def attend_step(self, q, k, v, g, ctx):
        """One engine step's flat rows (fp32 q, k, v [1, H, N, D]) against the state pool, updated in place by slot."""
        states = ctx.cache.states[self.layer_idx]  # [slots, H, Dk, Dv]
        outs = []
        if tree := ctx.tree:  # read the slots' states, never write them (commit_tree does)
            qt, kt, vt = (x[0, :, : tree.num_rows].unflatten(1, (tree.num_requests, -1)).transpose(0, 1) for x in (q, k, v))
            committed = states.index_select(0, tree.state_slots).float()
            if states.dtype == torch.float32:
                tree.saved[self.layer_idx] = (kt, vt)
                o = lightning_tree.tree_parallel(qt, kt, vt, g, self.scale, committed, tree.depths, tree.ancestor_mask)
            else:  # states rounded node by node, as decoding rounds them token by token (lightning_tree.tree_scan)
                o, node_states = lightning_tree.tree_scan(qt, kt, vt, g, self.scale, committed, tree.parents, tree.depths,
                                                          states.dtype, tree.levels)
                tree.saved[self.layer_idx] = (node_states,)
            outs.append(o.transpose(0, 1).flatten(1, 2))
        nd = ctx.num_decode
        if nd:
            q_dec, k_dec, v_dec = (t[0, :, :nd].transpose(0, 1) for t in (q, k, v))  # [n_decode, H, D]
            o = lightning_decode(q_dec, k_dec, v_dec, g, self.scale, states, ctx.state_slots)  # states updated in place
            outs.append(o.transpose(0, 1))
        spans = ctx.prefills
        if len(spans) == 1 or (spans and ctx.batch_invariant):
            # One span at a time: the exact shapes a request would see alone.
            for span in spans:
                part = slice(span.start, span.start + span.length)
                o, s = lightning.chunked(q[:, :, part], k[:, :, part], v[:, :, part], g, self.scale,
                                         states[span.state_slot][None].float())
                states[span.state_slot] = s[0]
                outs.append(o[0])
        elif spans:
            # Several prompt chunks as one zero-padded batch, each from its own state.
            first, lengths = spans[0].start, [s.length for s in spans]
            padded = [pad_sequence(t[0, :, first : first + sum(lengths)].transpose(0, 1).split(lengths), batch_first=True)
                      .transpose(1, 2) for t in (q, k, v)]  # [R, H, T_max, D]
            o, s = lightning.chunked(*padded, g, self.scale, states.index_select(0, ctx.prefill_state_slots).float(),
                                     lengths=ctx.prefill_lengths)
            states.index_copy_(0, ctx.prefill_state_slots, s.to(states.dtype))
            outs += [o[i, :, :n] for i, n in enumerate(lengths)]
        return _rows_with_padding(outs, q)

    def commit_tree(self, ctx, paths: torch.Tensor, lengths: torch.Tensor) -> None:
        """Advance each request's state along its accepted path (paths [R, P] node indices, root
        first; lengths [R] nodes accepted): in closed form, or, for a BF16-state layer, to the
        last accepted node's state from the verify's scan."""
        saved = ctx.tree.saved.pop(self.layer_idx)
        states, slots = ctx.cache.states[self.layer_idx], ctx.tree.state_slots
        if len(saved) == 1:  # every node's state (a BF16-state layer): the last accepted node's
            last = paths.gather(1, (lengths - 1)[:, None])[:, 0]
            new = saved[0][torch.arange(paths.shape[0], device=paths.device), :, last]
        else:
            kt, vt = saved
            g = self.consts.get("log_decay", kt.device)
            new = lightning_tree.commit_path(kt, vt, g, states.index_select(0, slots).float(), paths, lengths)
        states.index_copy_(0, slots, new.to(states.dtype))


class DecoderLayer(nn.Module):
    def __init__(self, config: SALAConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_lightning = config.layer_kinds[layer_idx] == LIGHTNING
        self.self_attn = LightningAttention(config, layer_idx) if self.is_lightning else SparseAttention(config, layer_idx)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_scale = config.residual_scale

    def forward(self, h, rope, cache, mask_2d, t, context=None):
        x = self.input_layernorm(h)
        mask = mask_2d if mask_2d is None or not self.is_lightning else mask_2d[:, -t:]
        h = h + self.self_attn(x, rope, cache, mask, context) * self.residual_scale
        return h + self.mlp(self.post_attention_layernorm(h)) * self.residual_scale


@dataclass
class SALACache:
    """Per-sequence-batch cache: K/V [B, Hkv, S, D] for sparse layers, an fp32 state per lightning layer."""

    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    states: dict[int, torch.Tensor] = field(default_factory=dict)
    compressed: dict[int, list[sparse.CompressedKeys]] = field(default_factory=dict)  # InfLLM-v2 K1/K2 per sequence
    first_sparse: int = 0

    def kv_length(self, layer_idx: int) -> int:
        k = self.keys.get(layer_idx)
        return 0 if k is None else k.shape[2]

    def get_seq_length(self, layer_idx: int | None = None) -> int:
        return self.kv_length(self.first_sparse if layer_idx is None else layer_idx)

    def append_kv(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor):
        if layer_idx in self.keys:
            k = torch.cat([self.keys[layer_idx], k], dim=2)
            v = torch.cat([self.values[layer_idx], v], dim=2)
        self.keys[layer_idx], self.values[layer_idx] = k, v
        return k, v

    def compressed_keys(self, layer_idx: int, row: int, settings: sparse.SparseSettings) -> sparse.CompressedKeys:
        """Sequence `row`'s compressed keys in a layer, made on its first sparse call and then extended."""
        rows = self.compressed.setdefault(layer_idx, [])
        while len(rows) <= row:
            rows.append(sparse.CompressedKeys(settings))
        return rows[row]

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for d in (self.keys, self.values, self.states):
            for i in d:
                d[i] = d[i].index_select(0, beam_idx.to(d[i].device))
        for i, rows in self.compressed.items():
            self.compressed[i] = [rows[j].copy() for j in beam_idx.tolist()] if rows else rows


class SALAPreTrainedModel(PreTrainedModel):
    config_class = SALAConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = False
    _no_split_modules = ["DecoderLayer"]
    _supports_sdpa = True

    def _init_weights(self, module):
        std = self.config.initializer_range
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=std)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=std)
        elif isinstance(module, RMSNorm):
            nn.init.ones_(module.weight)


class SALAModel(SALAPreTrainedModel):
    def __init__(self, config: SALAConfig):
        super().__init__(config)
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Both mixers rotate head_dim-wide heads with one theta (SALAConfig checks it): one table.
        self.rope_consts = Fp32Constants(inv_freq=rope_inv_freq(config.head_dim, config.rope_theta))
        self.uses_rope = config.attn_use_rope or config.lightning_use_rope
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None, context=None):
        """[B, T] batches with an optional SALACache (transformers' path), or, with a step
        `context` (sala/context.py), one engine step's tokens as a single row [1, N]."""
        if inputs_embeds is None:
            # muP: the embedding is scaled; embeddings passed in directly are not (as in the reference).
            inputs_embeds = self.embed_tokens(input_ids) * self.config.scale_emb
        h = inputs_embeds
        b, t = h.shape[:2]
        if context is not None:
            position_ids = context.positions[None]
        elif position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = positions_from(attention_mask, b, t, past, h.device)
        if context is None and t and int(position_ids.max()) >= self.config.max_position_embeddings:
            raise ValueError(f"position {int(position_ids.max())} is past max_position_embeddings="
                             f"{self.config.max_position_embeddings} (prompt plus cache too long for this model)")
        rope = self.rope(position_ids)
        for layer in self.layers:
            h = layer(h, rope, cache, attention_mask, t, context)
        return self.norm(h)

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cos/sin tables every layer of one forward reads (None when no layer rotates)."""
        return rope_tables(position_ids, self.rope_consts.get("inv_freq", position_ids.device)) if self.uses_rope else None

    def commit_tree(self, ctx, paths: torch.Tensor, lengths: torch.Tensor, dest_rows: torch.Tensor) -> None:
        """After a tree-verify forward with step context `ctx`: commit each request's accepted path (paths [R, P] node
        indices root first, lengths [R]) into the pools; dest_rows [R, P] are the pool rows of the path's positions,
        the scratch row past each request's length (TreeStep.path_rows). Fixed shapes, no host sync: the compiled
        verify step commits in its own graph."""
        t = ctx.tree.num_nodes
        nodes = (paths.clamp(min=0) + t * torch.arange(paths.shape[0], device=paths.device)[:, None]).flatten()
        for layer in self.layers:
            if layer.is_lightning:
                layer.self_attn.commit_tree(ctx, paths, lengths)
            else:
                layer.self_attn.commit_tree(ctx, nodes, dest_rows.flatten())

    def fuse_projections(self) -> None:
        """Fuse q/k/v/gate and gate/up into one GEMM each, in place. Parameter names change, so
        this is for serving; checkpoints are written from unfused models."""
        for layer in self.layers:
            layer.self_attn.fuse()
            layer.mlp.fuse()


def positions_from(attention_mask, b: int, t: int, past: int, device) -> torch.Tensor:
    """Absolute positions of the current tokens; left padding does not advance the position."""
    if attention_mask is None:
        return (torch.arange(t, device=device) + past).expand(b, t)
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)[:, -t:]


class SALAForCausalLM(SALAPreTrainedModel, GenerationMixin):
    _tied_weights_keys: dict = {}

    def __init__(self, config: SALAConfig):
        super().__init__(config)
        self.model = SALAModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        # Lightning layers keep a recurrent state, not K/V: the model brings its own cache.
        return False

    def get_input_embeddings(self):
        return self.model.embed_tokens

    def set_input_embeddings(self, value):
        self.model.embed_tokens = value

    def new_cache(self) -> SALACache:
        return SALACache(first_sparse=self.config.sparse_layers[0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final hidden -> fp32 logits; muP divides by hidden_size / dim_model_base first."""
        return self.lm_head(hidden / self.config.logit_divisor).float()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        past_key_values: SALACache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        use_cache = self.config.use_cache if use_cache is None else use_cache
        if use_cache and past_key_values is None:
            past_key_values = self.new_cache()
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # no padding: skip the masking work
        hidden = self.model(input_ids, attention_mask, position_ids, past_key_values if use_cache else None, inputs_embeds)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.logits(hidden)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100)
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=past_key_values if use_cache else None)


AutoModelForCausalLM.register(SALAConfig, SALAForCausalLM, exist_ok=True)  # config and tokenizer: sala/config.py
