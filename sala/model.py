"""SALAForCausalLM: MiniCPM-SALA in plain PyTorch (docs/design/architecture.md).

Layers mix two mixers:
- "minicpm4" (sparse) layers: softmax attention with GQA, no RoPE, sigmoid output gate, a KV cache.
- "lightning-attn" layers: linear attention with per-head decay, QK-norm, RoPE, output norm and
  gate, one fp32 recurrent state per sequence.

Parameter names equal the real checkpoint's. There is one forward for two callers: transformers
(batches [B, T] with a contiguous SALACache: the reference the tests compare against) and the
serving engine, which passes a step (`Step`: all of a step's tokens as one row) to which each
mixer hands its q, k, v for the paged attention over the engine's pools (sala/engine/paged.py;
nothing here knows the page formats). For serving, `fuse_projections` turns q/k/v/gate and
gate/up into one GEMM each.

From `sparse_config.dense_len` tokens on, the sparse layers switch to InfLLM-v2 block-sparse
attention (sala/sparse.py), decided once per forward call as the official code does; below
it they attend densely, which is exactly the official computation there.

The modules are plain `nn.Module`s: importing transformers' model and generation code costs
seconds in every process that builds an engine (a Serve replica, a quantize worker). The same
modules as transformers' model (`generate()`, the Auto classes) are sala/hf.py's.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_outputs import CausalLMOutputWithPast

from sala import lightning, sparse
from sala.config import LIGHTNING, SALAConfig, default_generation_config


class Step(Protocol):
    """One serving-engine step as the layers see it (sala/engine/context.py StepContext): its
    tokens' positions, and the paged attention of each mixer kind over the engine's pools."""

    positions: torch.Tensor  # [N]

    def sparse(self, mixer: SparseAttention, q, k, v) -> torch.Tensor:
        """q [1, Hq, N, D], k, v [1, Hkv, N, D] -> o [1, Hq, N, D]."""

    def lightning(self, mixer: LightningAttention, q, k, v, g) -> torch.Tensor:
        """fp32 q, k, v [1, H, N, D], log-decays g [H] -> o [1, H, N, D]."""


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
    # Built on the meta device and given the concatenations: the fused weight is the only copy made.
    fused = nn.Linear(w.shape[1], sum(p.weight.shape[0] for p in parts), bias=has_bias, device="meta", dtype=w.dtype)
    with torch.no_grad():
        fused.weight = nn.Parameter(torch.cat([p.weight for p in parts]))
        if has_bias:
            fused.bias = nn.Parameter(torch.cat([p.bias for p in parts]))
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

    def forward(self, x, rope, cache: SALACache | None, key_mask: torch.Tensor | None, step: Step | None = None):
        q, k, v, gate = self.heads(x)
        if self.config.attn_use_rope:
            q, k = apply_rope(q, rope), apply_rope(k, rope)
        if step is not None:
            o = step.sparse(self, q, k, v)
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

def causal_mask(t_q: int, t_k: int, past: int, key_mask: torch.Tensor | None, device) -> torch.Tensor:
    """Boolean [B or 1, 1, Tq, Tk] mask: query i (absolute past + i) sees keys j <= past + i."""
    qi = torch.arange(t_q, device=device)[:, None] + past
    kj = torch.arange(t_k, device=device)[None, :]
    mask = (kj <= qi)[None, None]
    if key_mask is not None:
        mask = mask & key_mask[:, None, None, :t_k].bool()
    return mask


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

    def forward(self, x, rope, cache: SALACache | None, token_mask: torch.Tensor | None, step: Step | None = None):
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
        if step is not None:
            o = step.lightning(self, q, k, v, g)
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

    def forward(self, h, rope, cache, mask_2d, t, step: Step | None = None):
        x = self.input_layernorm(h)
        mask = mask_2d if mask_2d is None or not self.is_lightning else mask_2d[:, -t:]
        h = h + self.self_attn(x, rope, cache, mask, step) * self.residual_scale
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


def init_module(m: nn.Module, std: float) -> None:
    """One module's initial weights (its own, not its children's): a Linear's or an embedding's
    drawn from N(0, std), a bias zero, a norm's one. A module on the meta device (a skeleton: names
    and shapes) has no values to draw, and torch's meta normal_ imports dynamo (1.3 s of CPU in a
    process that never compiles, such as a quantize worker)."""
    if getattr(m, "weight", None) is not None and m.weight.is_meta:
        return
    if isinstance(m, nn.Linear):
        nn.init.normal_(m.weight, mean=0.0, std=std)
        if m.bias is not None:
            nn.init.zeros_(m.bias)
    elif isinstance(m, nn.Embedding):
        nn.init.normal_(m.weight, mean=0.0, std=std)
    elif isinstance(m, RMSNorm):
        nn.init.ones_(m.weight)


def embedding(num: int, dim: int) -> nn.Embedding:
    """nn.Embedding(num, dim); on the meta device without torch's own initialization (see
    init_module), elsewhere with it, so that a model built from a seed draws the same weights."""
    if torch.get_default_device().type == "meta":
        return nn.Embedding.from_pretrained(torch.empty(num, dim), freeze=False)
    return nn.Embedding(num, dim)


def init_weights(module: nn.Module, std: float) -> None:
    """The initial weights of a model built from its config (the training recipe's), module by
    module in the order they were built."""
    for m in module.modules():
        init_module(m, std)


class SALAModel(nn.Module):
    def __init__(self, config: SALAConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        # Both mixers rotate head_dim-wide heads with one theta (SALAConfig checks it): one table.
        self.rope_consts = Fp32Constants(inv_freq=rope_inv_freq(config.head_dim, config.rope_theta))
        self.uses_rope = config.attn_use_rope or config.lightning_use_rope
        init_weights(self, config.initializer_range)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None,
                step: Step | None = None):
        """[B, T] batches with an optional SALACache (transformers' path), or, with a step
        `step` (Step), one engine step's tokens as a single row [1, N]."""
        if inputs_embeds is None:
            # muP: the embedding is scaled; embeddings passed in directly are not (as in the reference).
            inputs_embeds = self.embed_tokens(input_ids) * self.config.scale_emb
        h = inputs_embeds
        b, t = h.shape[:2]
        if step is not None:
            position_ids = step.positions[None]
        elif position_ids is None:
            past = cache.get_seq_length() if cache is not None else 0
            position_ids = positions_from(attention_mask, b, t, past, h.device)
        if step is None and t and int(position_ids.max()) >= self.config.max_position_embeddings:
            raise ValueError(f"position {int(position_ids.max())} is past max_position_embeddings="
                             f"{self.config.max_position_embeddings} (prompt plus cache too long for this model)")
        rope = self.rope(position_ids)
        for layer in self.layers:
            h = layer(h, rope, cache, attention_mask, t, step)
        return self.norm(h)

    def rope(self, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cos/sin tables every layer of one forward reads (None when no layer rotates)."""
        return rope_tables(position_ids, self.rope_consts.get("inv_freq", position_ids.device)) if self.uses_rope else None

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


class SALAForCausalLM(nn.Module):
    def __init__(self, config: SALAConfig):
        super().__init__()
        self.config = config
        self.model = SALAModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        init_weights(self.lm_head, config.initializer_range)
        self._generation_config = None

    @property
    def generation_config(self):
        """The checkpoint's generation_config.json once set by its loader, else the one derived from
        the config (as transformers' models start from)."""
        if self._generation_config is None:
            self._generation_config = default_generation_config(self.config)
        return self._generation_config

    @generation_config.setter
    def generation_config(self, value) -> None:
        self._generation_config = value

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the embeddings (a quantized model's unquantized tensors' dtype)."""
        return self.model.embed_tokens.weight.dtype

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
