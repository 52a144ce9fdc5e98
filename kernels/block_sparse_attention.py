"""Block-sparse attention over selected key blocks (InfLLM-v2's attention step), GQA.

Query t (at absolute position pos[t]) attends, for its kv head h, to the keys of the blocks
listed in ``block_idx[h, t]`` (block b = keys b * block_size .. (b + 1) * block_size - 1;
entries < 0 are unused) at positions <= pos[t], softmax with ``scale``, fp32 accumulation.

The Triton kernel runs one program per (query, kv head): the GROUP query heads of that kv head
share the selected blocks (the selection is made per GQA group), so each block's K/V tile is
loaded once for the whole group and the group's queries form the rows of one ``tl.dot`` tile,
as in kernels/paged_attention.py; the loop over the selected blocks keeps an fp32 online
softmax.
"""
import torch

from kernels import target

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs may lack triton; the torch reference still works
    triton = None


def _check(q, k, v, pos, block_idx):
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape or block_idx.ndim != 3:
        raise ValueError(f"expected q [T, Hq, D], k/v [L, Hkv, D], block_idx [Hkv, T, K]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, block_idx {tuple(block_idx.shape)}")
    t, hq, d = q.shape
    hkv = k.shape[1]
    if k.shape[2] != d or hq % hkv or block_idx.shape[:2] != (hkv, t) or pos.shape != (t,):
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)}, pos {tuple(pos.shape)} and block_idx "
                         f"{tuple(block_idx.shape)} do not fit (Hq a multiple of Hkv, one position per query)")
    return t, hq, d, hkv


def block_sparse_attention_reference(q, k, v, pos, block_idx, block_size: int, scale: float) -> torch.Tensor:
    """Gather each query's selected blocks ([Hkv, T, K * block_size] keys) and attend in fp32."""
    t, hq, d, hkv = _check(q, k, v, pos, block_idx)
    kpos = (block_idx.clamp(min=0)[..., None] * block_size + torch.arange(block_size, device=q.device)).flatten(2)
    ok = (block_idx >= 0).repeat_interleave(block_size, -1) & (kpos <= pos[None, :, None]) & (kpos < k.shape[0])
    kpos = kpos.clamp(max=k.shape[0] - 1)
    heads = torch.arange(hkv, device=q.device)[:, None, None]
    kk, vv = k[kpos, heads].float(), v[kpos, heads].float()  # [Hkv, T, Lk, D]
    qg = q.float().permute(1, 0, 2).reshape(hkv, hq // hkv, t, d)
    scores = torch.einsum("hgtd,htkd->hgtk", qg, kk) * scale
    scores = scores.masked_fill(~ok[:, None], float("-inf"))
    o = torch.einsum("hgtk,htkd->hgtd", scores.softmax(-1), vv)
    return o.reshape(hq, t, d).permute(1, 0, 2).to(q.dtype)


if triton is not None:
    from kernels.target import FP32_DOT

    @triton.jit(do_not_specialize=["num_keys", "num_sel"])
    def _block_sparse_kernel(
        q_ptr, k_ptr, v_ptr, pos_ptr, idx_ptr, o_ptr, scale, num_keys, num_sel,
        stride_qt, stride_qh, stride_kl, stride_kh, stride_vl, stride_vh, stride_ih, stride_it, stride_ot, stride_oh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        """Program (query t, kv head): the GROUP query heads over the selected blocks, in list
        order (num_sel of them: a runtime bound, or every selection width would compile anew)."""
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        rh = tl.arange(0, BLOCK_H)
        h_ok = rh < GROUP
        heads = kvh * GROUP + rh
        rd = tl.arange(0, BLOCK_D)
        d_ok = rd < HEAD_DIM
        q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + rd[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        p_t = tl.load(pos_ptr + t)
        m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        rn = tl.arange(0, BLOCK_SIZE)
        for i in range(num_sel):
            b = tl.load(idx_ptr + kvh * stride_ih + t * stride_it + i)
            kp = b * BLOCK_SIZE + rn
            # (b + rn * 0: a block, since the interpreter rejects a scalar bool & a block)
            ok = (b + rn * 0 >= 0) & (kp <= p_t) & (kp < num_keys)
            kv_ok = ok[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kp[:, None] * stride_kl + kvh * stride_kh + rd[None, :], mask=kv_ok, other=0.0)
            v = tl.load(v_ptr + kp[:, None] * stride_vl + kvh * stride_vh + rd[None, :], mask=kv_ok, other=0.0)
            if UPCAST:
                k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=FP32_DOT) * scale
            s = tl.where(ok[None, :], s, float("-inf"))
            # A block with no valid key leaves the state as it is (its row max is -inf).
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp(m_i - m_safe)
            p = tl.exp(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=FP32_DOT)
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(o_ptr + t * stride_ot + heads[:, None] * stride_oh + rd[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=h_ok[:, None] & d_ok[None, :])


def block_sparse_attention_triton(q, k, v, pos, block_idx, block_size: int, scale: float) -> torch.Tensor:
    t, hq, d, hkv = _check(q, k, v, pos, block_idx)
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or block_idx.stride(-1) != 1:
        q, k, v, block_idx = (x.contiguous() for x in (q, k, v, block_idx))
    o = torch.empty_like(q)
    group = hq // hkv
    _block_sparse_kernel[(t, hkv)](
        q, k, v, pos, block_idx, o, scale, k.shape[0], block_idx.shape[2],
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        block_idx.stride(0), block_idx.stride(1), o.stride(0), o.stride(1),
        GROUP=group, HEAD_DIM=d, BLOCK_SIZE=block_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(d)),
        UPCAST=target.INTERPRETED,  # on a GPU bf16 tiles go to the tensor cores as they are
    )  # fmt: skip
    return o


def block_sparse_attention(q, k, v, pos, block_idx, block_size: int, scale: float) -> torch.Tensor:
    """q [T, Hq, D]; k, v [L, Hkv, D]; pos [T] query positions; block_idx [Hkv, T, K] selected
    blocks (< 0: unused; every query needs one valid key, e.g. its own block). Returns [T, Hq, D]
    in q's dtype. Triton kernel on CUDA, torch reference elsewhere."""
    if target.on_gpu(q):
        return block_sparse_attention_triton(q, k, v, pos, block_idx, block_size, scale)
    return block_sparse_attention_reference(q, k, v, pos, block_idx, block_size, scale)
