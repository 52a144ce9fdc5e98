"""SALAForCausalLM: MiniCPM-SALA in plain PyTorch (shared/design/specs/sala-architecture.md).

Layers mix two mixers:
- "minicpm4" (sparse) layers: softmax attention with GQA, no RoPE, sigmoid output gate, a KV cache.
- "lightning-attn" layers: linear attention with per-head decay, QK-norm, RoPE, output norm and
  gate, one fp32 recurrent state per sequence.

Parameter names equal the real checkpoint's. Each attention module splits into `project`
(input -> q, k, v) and `finish` (attention output -> residual branch), so the serving engine
can run its own cache and batching between the two without copying the layer math.

For contexts of at least `sparse_config.dense_len` tokens the official sparse layers switch to
InfLLM-v2 block selection; this implementation always attends densely, which is exact below
that length (tiny-sala's context is far below it) and warns once above it.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from sala import lightning
from sala.config import LIGHTNING, SALAConfig

log = logging.getLogger(__name__)


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


def apply_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half RoPE, computed in fp32 and cast back. x: [B, H, T, D], positions: [B, T]."""
    freqs = positions.float()[..., None] * inv_freq  # [B, T, D/2]
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]  # [B, 1, T, D]
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return (xf * emb.cos() + rotated * emb.sin()).to(x.dtype)


class MLP(nn.Module):
    def __init__(self, config: SALAConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class QKVOProjections(nn.Module):
    """The four projections both mixers share; `heads` splits q, k, v into [B, H, T, D]."""

    def __init__(self, config: SALAConfig, n_heads: int, n_kv: int, head_dim: int):
        super().__init__()
        self.config = config
        self.n_heads, self.n_kv, self.head_dim = n_heads, n_kv, head_dim
        hs, d = config.hidden_size, head_dim
        self.q_proj = nn.Linear(hs, n_heads * d, bias=config.attention_bias)
        self.k_proj = nn.Linear(hs, n_kv * d, bias=config.attention_bias)
        self.v_proj = nn.Linear(hs, n_kv * d, bias=config.attention_bias)
        self.o_proj = nn.Linear(n_heads * d, hs, bias=False)

    def heads(self, x: torch.Tensor):
        b, t, _ = x.shape
        q = self.q_proj(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, self.n_kv, self.head_dim).transpose(1, 2)
        return q, k, v


class SparseAttention(QKVOProjections):
    """The "minicpm4" mixer: GQA softmax attention, NoPE by default, sigmoid output gate."""

    def __init__(self, config: SALAConfig):
        super().__init__(config, config.num_attention_heads, config.num_key_value_heads,
                         config.hidden_size // config.num_attention_heads)
        if config.attn_use_output_gate:
            self.o_gate = nn.Linear(config.hidden_size, self.n_heads * self.head_dim, bias=False)
        self.consts = Fp32Constants(inv_freq=rope_inv_freq(self.head_dim, config.rope_theta))

    def project(self, x: torch.Tensor, positions: torch.Tensor):
        """x: [B, T, hidden] (normalised layer input) -> q [B, Hq, T, D], k, v [B, Hkv, T, D]."""
        q, k, v = self.heads(x)
        if self.config.attn_use_rope:
            inv_freq = self.consts.get("inv_freq", x.device)
            q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        return q, k, v

    def finish(self, attn_out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """attn_out: [B, T, hidden]; the gate reads the normalised layer input x, not the residual."""
        if self.config.attn_use_output_gate:
            attn_out = attn_out * torch.sigmoid(self.o_gate(x))
        return self.o_proj(attn_out)

    def forward(self, x, positions, cache: SALACache | None, layer_idx: int, key_mask: torch.Tensor | None):
        q, k, v = self.project(x, positions)
        past = 0
        if cache is not None:
            past = cache.kv_length(layer_idx)
            k, v = cache.append_kv(layer_idx, k, v)
        if k.shape[2] >= self.config.sparse_config["dense_len"]:
            _warn_dense_fallback(k.shape[2], self.config.sparse_config["dense_len"])
        gqa = self.n_heads != self.n_kv
        if key_mask is None and (past == 0 or q.shape[2] == 1):
            # No padding, and either a fresh prefill or one decode token: the flash path needs no
            # materialised mask (is_causal aligns top-left, which is right only when past == 0).
            o = F.scaled_dot_product_attention(q, k, v, is_causal=past == 0 and q.shape[2] > 1, enable_gqa=gqa)
        else:
            mask = causal_mask(q.shape[2], k.shape[2], past, key_mask, q.device)
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
        o = o.transpose(1, 2).reshape(x.shape[0], x.shape[1], -1)
        return self.finish(o, x)


_warned_dense = False


def _warn_dense_fallback(kv_len: int, dense_len: int) -> None:
    global _warned_dense
    if not _warned_dense:
        log.warning(
            "context of %d tokens reaches sparse_config.dense_len=%d: attending densely, which differs "
            "from the official InfLLM-v2 block selection at this length",
            kv_len,
            dense_len,
        )
        _warned_dense = True


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

    def __init__(self, config: SALAConfig):
        super().__init__(config, config.lightning_nh, config.lightning_nkv, config.lightning_head_dim)
        d = self.head_dim
        if config.use_output_gate:
            self.z_proj = nn.Linear(config.hidden_size, self.n_heads * d, bias=False)
        if config.qk_norm:
            self.q_norm = RMSNorm(d, config.rms_norm_eps)
            self.k_norm = RMSNorm(d, config.rms_norm_eps)
        if config.use_output_norm:
            self.o_norm = RMSNorm(self.n_heads * d, config.rms_norm_eps)
        self.consts = Fp32Constants(inv_freq=rope_inv_freq(d, config.rope_theta), log_decay=lightning.log_decay(self.n_heads))
        self.scale = config.lightning_q_scale

    def project(self, x: torch.Tensor, positions: torch.Tensor, token_mask: torch.Tensor | None = None):
        """x: [B, T, hidden] -> fp32 q, k, v [B, H, T, D] with k, v repeated to the query heads.

        Tokens where token_mask is 0 (left padding) get k = v = 0, so they leave the state untouched.
        """
        q, k, v = self.heads(x)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        if self.config.lightning_use_rope:
            inv_freq = self.consts.get("inv_freq", x.device)
            q, k = apply_rope(q, positions, inv_freq), apply_rope(k, positions, inv_freq)
        rep = self.n_heads // self.n_kv
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        q, k, v = q.float(), k.float(), v.float()
        if token_mask is not None:
            keep = token_mask[:, None, :, None].to(k.dtype)
            k, v = k * keep, v * keep
        return q, k, v

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """o: fp32 [B, H, T, D] -> residual branch [B, T, hidden] in the model dtype."""
        b, _, t, _ = o.shape
        o = o.transpose(1, 2).reshape(b, t, -1).to(x.dtype)
        if self.config.use_output_norm:
            o = self.o_norm(o)
        if self.config.use_output_gate:
            o = o * torch.sigmoid(self.z_proj(x))
        return self.o_proj(o)

    def attend(self, q, k, v, state: torch.Tensor | None):
        """Linear attention from `state`; one-step update for single tokens, chunked form otherwise."""
        g = self.consts.get("log_decay", q.device)
        if q.shape[2] == 1 and state is not None:
            o, s = lightning.step(q[:, :, 0], k[:, :, 0], v[:, :, 0], g, self.scale, state)
            return o[:, :, None], s
        return lightning.chunked(q, k, v, g, self.scale, state)

    def forward(self, x, positions, cache: SALACache | None, layer_idx: int, token_mask: torch.Tensor | None):
        q, k, v = self.project(x, positions, token_mask)
        state = cache.states.get(layer_idx) if cache is not None else None
        o, new_state = self.attend(q, k, v, state)
        if cache is not None:
            cache.states[layer_idx] = new_state
        return self.finish(o, x)


class DecoderLayer(nn.Module):
    def __init__(self, config: SALAConfig, layer_idx: int):
        super().__init__()
        self.layer_idx = layer_idx
        self.is_lightning = config.layer_kinds[layer_idx] == LIGHTNING
        self.self_attn = LightningAttention(config) if self.is_lightning else SparseAttention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.residual_scale = config.residual_scale

    def forward(self, h, positions, cache, mask_2d, t):
        x = self.input_layernorm(h)
        if self.is_lightning:
            token_mask = None if mask_2d is None else mask_2d[:, -t:]
            a = self.self_attn(x, positions, cache, self.layer_idx, token_mask)
        else:
            a = self.self_attn(x, positions, cache, self.layer_idx, mask_2d)
        h = h + a * self.residual_scale
        return h + self.mlp(self.post_attention_layernorm(h)) * self.residual_scale


@dataclass
class SALACache:
    """Per-sequence-batch cache: K/V [B, Hkv, S, D] for sparse layers, an fp32 state per lightning layer."""

    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)
    states: dict[int, torch.Tensor] = field(default_factory=dict)
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

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        for d in (self.keys, self.values, self.states):
            for i in d:
                d[i] = d[i].index_select(0, beam_idx.to(d[i].device))


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
        self.post_init()

    def forward(self, input_ids=None, attention_mask=None, position_ids=None, cache=None, inputs_embeds=None):
        if inputs_embeds is None:
            # muP: the embedding is scaled; embeddings passed in directly are not (as in the reference).
            inputs_embeds = self.embed_tokens(input_ids) * self.config.scale_emb
        h = inputs_embeds
        b, t = h.shape[:2]
        past = cache.get_seq_length() if cache is not None else 0
        if position_ids is None:
            position_ids = positions_from(attention_mask, b, t, past, h.device)
        for layer in self.layers:
            h = layer(h, position_ids, cache, attention_mask, t)
        return self.norm(h)


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
