"""SALAForCausalLM: the forward pass against a naive reference written from the spec, and the
cached decode against the full forward."""
import math

import pytest
import torch

from sala.config import SALAConfig
from sala.hf import MiniCPMSALAForCausalLM
from sala.model import SALAForCausalLM


def tiny_random_config(**over) -> SALAConfig:
    kw = dict(
        vocab_size=101, hidden_size=64, intermediate_size=96, num_hidden_layers=5, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, lightning_nkv=2, rms_norm_eps=1e-3, max_position_embeddings=256,
        mixer_types=["minicpm4", "lightning-attn", "lightning", "minicpm4", "lightning_attn"],
        scale_emb=12.0, scale_depth=1.4, dim_model_base=16, initializer_range=0.05,
    )
    kw.update(over)
    return SALAConfig(**kw)


def random_model(seed=0, **over) -> SALAForCausalLM:
    torch.manual_seed(seed)
    m = SALAForCausalLM(tiny_random_config(**over)).eval()
    with torch.no_grad():  # random norm weights: an ignored or misplaced norm then changes the output
        for name, p in m.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.5 * torch.randn_like(p))
    return m


# ---------------------------------------------------------------- naive reference from the spec
def ref_rms(x, w, eps):
    xf = x.double()
    return w.double() * (xf / torch.sqrt((xf * xf).mean(-1, keepdim=True) + eps))


def ref_rope(x, pos, theta):
    d = x.shape[-1]
    out = torch.empty_like(x)
    for i in range(d // 2):  # pair (i, i + d/2) rotated by angle pos * theta^(-2i/d)
        ang = pos.double() * theta ** (-2 * i / d)
        a, b = x[..., i], x[..., i + d // 2]
        out[..., i] = a * torch.cos(ang) - b * torch.sin(ang)
        out[..., i + d // 2] = b * torch.cos(ang) + a * torch.sin(ang)
    return out


def reference_logits(model: SALAForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """One sequence, float64, loops over tokens: embedding * scale_emb, pre-norm layers with the
    scale_depth/sqrt(L) residual, dense GQA softmax attention with output gate (sparse layers),
    per-head QK-norm + RoPE + decayed recurrence + output norm + z-gate (lightning layers),
    SwiGLU MLP, final norm, logits of h / (hidden / dim_model_base)."""
    c = model.config
    sd = {k: v.double() for k, v in model.state_dict().items()}
    T, H, D = len(ids), c.num_attention_heads, c.head_dim
    pos = torch.arange(T)
    h = sd["model.embed_tokens.weight"][ids] * c.scale_emb
    res = c.scale_depth / math.sqrt(c.num_hidden_layers)
    slopes = {4: [0.25, 0.0625, 0.015625, 0.00390625]}[H]
    for i, kind in enumerate(c.mixer_types):
        p = f"model.layers.{i}."
        x = ref_rms(h, sd[p + "input_layernorm.weight"], c.rms_norm_eps)
        W = lambda n: sd[p + "self_attn." + n + ".weight"]  # noqa: E731
        q = (x @ W("q_proj").T).view(T, H, D)
        if kind == "minicpm4":
            nkv = c.num_key_value_heads
            k = (x @ W("k_proj").T).view(T, nkv, D)
            v = (x @ W("v_proj").T).view(T, nkv, D)
            o = torch.zeros(T, H, D, dtype=torch.float64)
            for head in range(H):
                kv_h = head // (H // nkv)
                for t in range(T):
                    sc = (k[: t + 1, kv_h] @ q[t, head]) / math.sqrt(D)
                    o[t, head] = torch.softmax(sc, 0) @ v[: t + 1, kv_h]
            o = o.reshape(T, H * D) * torch.sigmoid(x @ W("o_gate").T)
        else:
            nkv = c.lightning_nkv
            k = (x @ W("k_proj").T).view(T, nkv, D)
            v = (x @ W("v_proj").T).view(T, nkv, D)
            q = ref_rope(ref_rms(q, W("q_norm"), c.rms_norm_eps), pos[:, None], c.rope_theta)
            k = ref_rope(ref_rms(k, W("k_norm"), c.rms_norm_eps), pos[:, None], c.rope_theta)
            o = torch.zeros(T, H, D, dtype=torch.float64)
            for head in range(H):
                kv_h = head // (H // nkv)
                S = torch.zeros(D, D, dtype=torch.float64)
                for t in range(T):
                    S = math.exp(-slopes[head]) * S + torch.outer(k[t, kv_h], v[t, kv_h])
                    o[t, head] = (q[t, head] / math.sqrt(D)) @ S
            o = ref_rms(o.reshape(T, H * D), W("o_norm"), c.rms_norm_eps)
            o = o * torch.sigmoid(x @ W("z_proj").T)
        h = h + (o @ W("o_proj").T) * res
        x = ref_rms(h, sd[p + "post_attention_layernorm.weight"], c.rms_norm_eps)
        m = p + "mlp."
        g, u = x @ sd[m + "gate_proj.weight"].T, x @ sd[m + "up_proj.weight"].T
        h = h + ((torch.nn.functional.silu(g) * u) @ sd[m + "down_proj.weight"].T) * res
    h = ref_rms(h, sd["model.norm.weight"], c.rms_norm_eps)
    return (h / (c.hidden_size / c.dim_model_base)) @ sd["lm_head.weight"].T


def test_forward_matches_naive_reference():
    m = random_model()
    ids = torch.randint(0, 101, (1, 23), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = m(ids, use_cache=False).logits[0].double()
    ref = reference_logits(m, ids[0])
    err = (ours - ref).abs().max().item()
    print(f"max |model - reference| = {err:.2e} (logit scale {ref.abs().max().item():.2f})")
    assert err < 1e-4


def test_prefill_then_decode_equals_full_forward():
    m = random_model()
    ids = torch.randint(0, 101, (3, 90), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        full = m(ids, use_cache=False).logits
        out = m(ids[:, :37])  # prefill crosses the 64-token chunk boundary later in decode
        pieces = [out.logits]
        cache = out.past_key_values
        out = m(ids[:, 37:71], past_key_values=cache)  # a second prefill chunk from the cached state
        pieces.append(out.logits)
        for t in range(71, 90):
            pieces.append(m(ids[:, t : t + 1], past_key_values=cache).logits)
    inc = torch.cat(pieces, 1)
    err = (full - inc).abs().max().item()
    print(f"max |full - (prefill + decode)| = {err:.2e}")
    torch.testing.assert_close(inc, full, rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == 90
    assert set(cache.states) == {1, 2, 4}
    assert all(s.dtype == torch.float32 and s.shape == (3, 4, 16, 16) for s in cache.states.values())


def test_left_padding_does_not_change_real_tokens():
    m = random_model()
    a = torch.randint(3, 101, (1, 12), generator=torch.Generator().manual_seed(3))
    b = torch.randint(3, 101, (1, 7), generator=torch.Generator().manual_seed(4))
    batch = torch.cat([a, torch.cat([torch.full((1, 5), 2), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :5] = 0
    with torch.no_grad():
        both = m(batch, attention_mask=mask, use_cache=False).logits
        solo_a = m(a, use_cache=False).logits
        solo_b = m(b, use_cache=False).logits
    torch.testing.assert_close(both[0], solo_a[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(both[1, 5:], solo_b[0], rtol=1e-5, atol=1e-5)


def test_generate_equals_greedy_full_forward_loop():
    m = random_model()
    ids = torch.randint(3, 101, (1, 9), generator=torch.Generator().manual_seed(5))
    out = MiniCPMSALAForCausalLM.sharing(m).generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False, eos_token_id=None)
    seq = ids
    with torch.no_grad():
        for _ in range(12):
            nxt = m(seq, use_cache=False).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], 1)
    assert torch.equal(out, seq)


@pytest.mark.parametrize("flag", ["qk_norm", "use_output_norm", "use_output_gate", "attn_use_output_gate", "lightning_use_rope"])
def test_flags_off_still_decode_consistently(flag):
    m = random_model(**{flag: False})
    ids = torch.randint(0, 101, (2, 20), generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        full = m(ids, use_cache=False).logits
        out = m(ids[:, :15])
        pieces = [out.logits] + [m(ids[:, t : t + 1], past_key_values=out.past_key_values).logits for t in range(15, 20)]
    torch.testing.assert_close(torch.cat(pieces, 1), full, rtol=1e-5, atol=1e-5)


def test_fused_projections_equal_unfused():
    """fuse_projections (the engine's q/k/v/gate and gate/up GEMMs) leaves the forward as it was,
    up to the rounding of a wider GEMM (measured: none on this CPU)."""
    m = random_model()
    ids = torch.randint(0, 101, (2, 30), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        before = m(ids, use_cache=False).logits
        m.model.fuse_projections()
        after = m(ids, use_cache=False).logits
    assert m.model.layers[1].self_attn.qkvg_proj.out_features == 64 + 32 + 32 + 64  # q, k, v (2 kv heads), z
    assert not hasattr(m.model.layers[0].self_attn, "q_proj") and m.model.layers[0].mlp.gate_up_proj is not None
    print(f"max |fused - unfused| = {(after - before).abs().max():.2e}")
    torch.testing.assert_close(after, before, rtol=1e-5, atol=1e-5)


def test_fused_nvfp4_linears_equal_the_parts():
    """Packed NVFP4 Linears with different global scales concatenate into one with a per-row
    global scale; its output is the parts' outputs side by side."""
    from sala.quant.linear import NVFP4Linear
    from sala.quant.nvfp4 import quantize_rtn

    g = torch.Generator().manual_seed(8)
    parts = [NVFP4Linear.from_quantized(quantize_rtn(torch.randn(n, 64, generator=g) * s)) for n, s in [(32, 0.1), (16, 3.0), (16, 1.0)]]
    fused = NVFP4Linear.concat(parts)
    assert fused.weight_global_scale.shape == (64,)
    x = torch.randn(5, 64, generator=g)
    want = torch.cat([p(x) for p in parts], -1)
    print(f"max |fused - parts| = {(fused(x) - want).abs().max():.2e}")
    torch.testing.assert_close(fused(x), want, rtol=1e-6, atol=1e-6)
    same = NVFP4Linear.concat([parts[1], parts[1]])
    assert same.weight_global_scale.shape == (1,)  # one shared scale stays one
