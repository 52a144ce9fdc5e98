"""Chunked lightning-attention prefill with an initial and a final state (sala/lightning.py's
`chunked` form: per head S_t = exp(g_h) S_{t-1} + k_t v_t^T, o_t = scale q_t^T S_t, fp32).

q, k [B, H, T, Dk], v [B, H, T, Dv], g [H] log-decays, state [B, H, Dk, Dv] (or None: zeros);
`lengths` [B] optional: sequence b is its first lengths[b] tokens (a right-padded batch), its
final state taken there and its outputs past there left zero. Returns (o [B, H, T, Dv], final).

The Triton kernel runs one program per (sequence, head, BLOCK_V columns of the state) over
the whole prompt, C-token chunks streaming through the state slice [Dk, BLOCK_V], as
flash-linear-attention's fused chunk kernels do: per chunk
    o     = scale [ ((q k^T) * D) v + exp(g (i + 1)) (q S) ]        D[i, j] = exp(g (i - j)), j <= i
    S'    = exp(g m) S + (k * exp(g (m - 1 - j)))^T v               m = the chunk's tokens
The products over Dk are summed BLOCK_K columns at a time, and the state slice lives in the
output `final` (where it ends anyway), read and rewritten BLOCK_K rows at a time each chunk: a
program's 32 KiB stays in L2, and no [C, Dk] or [Dk, BLOCK_V] tile has to fit in registers
(held there, Dk = 128 spilled on every target but sm_90 / sm_100). The torch reference below is
the same loop, one chunk at a time (sala/lightning.py batches the chunks instead).
"""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs may lack triton; the torch reference still works
    triton = None

# Tiles (8 warps): from the compile check (sala/compile_check.py), the largest without spills
# on every target at Dk = Dv = 128: about 158 registers, 17 KiB of shared memory.
CHUNK, BLOCK_K, BLOCK_V = 32, 16, 64


def _check(q, k, v, g, state, lengths):
    if q.ndim != 4 or k.shape != q.shape or v.shape[:3] != q.shape[:3] or g.shape != (q.shape[1],):
        raise ValueError(f"expected q, k [B, H, T, Dk], v [B, H, T, Dv], g [H]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}")
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    if state is not None and state.shape != (b, h, dk, dv):
        raise ValueError(f"state {tuple(state.shape)} is not [B, H, Dk, Dv] = {(b, h, dk, dv)}")
    if lengths is not None and (lengths.shape != (b,) or int(lengths.max()) > t or int(lengths.min()) < 1):
        raise ValueError(f"lengths {lengths.tolist()} must be [B] values in 1..{t}")
    return b, h, t, dk, dv


def lightning_prefill_reference(q, k, v, g, scale: float, state=None, lengths=None, chunk: int = CHUNK):
    b, h, t, dk, dv = _check(q, k, v, g, state, lengths)
    s = q.new_zeros(b, h, dk, dv) if state is None else state.float().clone()
    o = q.new_zeros(b, h, t, dv)
    n = torch.full((b,), t, device=q.device) if lengths is None else lengths.to(q.device)
    gh = g.float().view(1, h, 1, 1)
    for start in range(0, t, chunk):
        idx = torch.arange(start, min(start + chunk, t), device=q.device)
        m = (n - start).clamp(0, len(idx)).view(b, 1, 1, 1).float()  # tokens of this chunk in each sequence
        live = (idx[None] < n[:, None]).view(b, 1, -1, 1)  # [B, 1, C, 1]
        i = torch.arange(len(idx), device=q.device, dtype=torch.float32)
        qc, kc, vc = q[:, :, idx].float(), k[:, :, idx].float() * live, v[:, :, idx].float() * live
        dist = i[:, None] - i[None, :]
        decay = torch.exp(torch.where(dist >= 0, gh * dist, torch.full_like(gh * dist, float("-inf"))))
        o_c = ((qc @ kc.transpose(-1, -2)) * decay) @ vc + (qc * torch.exp(gh * (i[:, None] + 1))) @ s
        o[:, :, idx] = scale * o_c * live
        w = torch.exp(torch.where(live, gh * (m - 1 - i[:, None]), torch.full_like(gh * i[:, None], float("-inf"))))
        s = torch.exp(gh * m) * s + (kc * w).transpose(-1, -2) @ vc
    return o, s


if triton is not None:
    from kernels.target import FP32_DOT

    @triton.jit(do_not_specialize=["num_tokens"])
    def _lightning_prefill_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, s0_ptr, o_ptr, sf_ptr, len_ptr, scale, num_tokens,
        sqb, sqh, sqt, skb, skh, skt, svb, svh, svt, sob, soh, sot, ssb, ssh, ssk, sfb, sfh, sfk,
        H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr,
        BLOCK_V: tl.constexpr, HAS_STATE: tl.constexpr, HAS_LENGTHS: tl.constexpr,
    ):  # fmt: skip
        """Program (sequence * head, state column block) over the whole prompt, chunk by chunk."""
        bh = tl.program_id(0)
        b = bh // H
        h = bh % H
        rv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        rc = tl.arange(0, C)
        v_ok = rv < DV
        g = tl.load(g_ptr + h).to(tl.float32)
        state = sf_ptr + b * sfb + h * sfh + rv[None, :]
        for k0 in range(0, DK, BLOCK_K):  # the initial state into `final`
            rk = k0 + tl.arange(0, BLOCK_K)
            s_mask = (rk < DK)[:, None] & v_ok[None, :]
            if HAS_STATE:
                s = tl.load(s0_ptr + b * ssb + h * ssh + rk[:, None] * ssk + rv[None, :], mask=s_mask, other=0.0)
            else:
                s = tl.zeros((BLOCK_K, BLOCK_V), dtype=tl.float32)
            tl.store(state + rk[:, None] * sfk, s, mask=s_mask)
        n = num_tokens
        if HAS_LENGTHS:
            n = tl.load(len_ptr + b)
        i = rc.to(tl.float32)
        dist = i[:, None] - i[None, :]
        # Mask the exponent before exp: above the diagonal it is positive and would overflow.
        decay = tl.exp(tl.where(dist >= 0, g * dist, float("-inf")))
        q_decay = tl.exp(g * (i + 1))
        for start in range(0, n, C):
            t = start + rc
            t_ok = t < n
            v = tl.load(v_ptr + b * svb + h * svh + t[:, None] * svt + rv[None, :], mask=t_ok[:, None] & v_ok[None, :],
                        other=0.0)
            attn = tl.zeros((C, C), dtype=tl.float32)
            inter = tl.zeros((C, BLOCK_V), dtype=tl.float32)
            tl.debug_barrier()  # the state rows other threads stored are visible
            for k0 in range(0, DK, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                qk_mask = t_ok[:, None] & (rk < DK)[None, :]
                q = tl.load(q_ptr + b * sqb + h * sqh + t[:, None] * sqt + rk[None, :], mask=qk_mask, other=0.0)
                k = tl.load(k_ptr + b * skb + h * skh + t[:, None] * skt + rk[None, :], mask=qk_mask, other=0.0)
                s = tl.load(state + rk[:, None] * sfk, mask=(rk < DK)[:, None] & v_ok[None, :], other=0.0)
                attn = tl.dot(q, tl.trans(k), attn, input_precision=FP32_DOT)
                inter = tl.dot(q, s, inter, input_precision=FP32_DOT)
            o = tl.dot(attn * decay, v, input_precision=FP32_DOT) + q_decay[:, None] * inter
            tl.store(o_ptr + b * sob + h * soh + t[:, None] * sot + rv[None, :], o * scale,
                     mask=t_ok[:, None] & v_ok[None, :])
            m = tl.minimum(n - start, C).to(tl.float32)
            w = tl.exp(tl.where(t_ok, g * (m - 1 - i), float("-inf")))
            for k0 in range(0, DK, BLOCK_K):
                rk = k0 + tl.arange(0, BLOCK_K)
                s_mask = (rk < DK)[:, None] & v_ok[None, :]
                k = tl.load(k_ptr + b * skb + h * skh + t[:, None] * skt + rk[None, :], mask=t_ok[:, None] & (rk < DK)[None, :],
                            other=0.0)
                s = tl.load(state + rk[:, None] * sfk, mask=s_mask, other=0.0)
                s = tl.exp(g * m) * s + tl.dot(tl.trans(k * w[:, None]), v, input_precision=FP32_DOT)
                tl.debug_barrier()  # every thread has read these rows before any is rewritten
                tl.store(state + rk[:, None] * sfk, s, mask=s_mask)


def lightning_prefill_triton(q, k, v, g, scale: float, state=None, lengths=None, chunk: int = CHUNK, block_v: int = BLOCK_V):
    b, h, t, dk, dv = _check(q, k, v, g, state, lengths)
    q, k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (q, k, v))
    o = q.new_zeros(b, h, t, dv)
    final = q.new_empty(b, h, dk, dv)
    s0 = final if state is None else state.contiguous()
    lens = torch.empty(0, dtype=torch.int32, device=q.device) if lengths is None else lengths.to(q.device, torch.int32)
    block_v = min(block_v, max(16, triton.next_power_of_2(dv)))
    _lightning_prefill_kernel[(b * h, triton.cdiv(dv, block_v))](
        q, k, v, g.to(q.device, torch.float32), s0, o, final, lens, scale, t,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2), s0.stride(0), s0.stride(1), s0.stride(2),
        final.stride(0), final.stride(1), final.stride(2),
        H=h, DK=dk, DV=dv, C=chunk, BLOCK_K=min(BLOCK_K, max(16, triton.next_power_of_2(dk))), BLOCK_V=block_v,
        HAS_STATE=state is not None, HAS_LENGTHS=lengths is not None, num_warps=8,
    )  # fmt: skip
    return o, final
