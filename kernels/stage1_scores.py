"""InfLLM-v2 stage-1 scores: for query t and compressed key window j (K1) visible to it, the
sum over the query heads of its kv group of exp(scale * q.k1_j - lse), lse = the log-sum-exp of
scale * q.k2 over the K2 windows visible to it (sala/sparse.py turns the scores into blocks).

The Triton kernel runs one program per (query, kv head), the group's heads as the rows of the
``tl.dot`` tiles: a first loop over the visible K2 windows keeps an online log-sum-exp per
head, a second over the K1 windows writes the group sums. Hidden windows score 0.
"""
import torch

from kernels import target

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs may lack triton; the torch reference still works
    triton = None

BLOCK_N = 64  # compressed windows per loop iteration


def stage1_scores_reference(q, k1, k2, vis1, vis2, scale: float) -> torch.Tensor:
    """q [T, Hq, D]; k1 [n1, Hkv, D], k2 [n2, Hkv, D]; vis1 / vis2 [T] windows visible to each query.
    Returns fp32 [Hkv, T, n1]."""
    t, hq, d = q.shape
    hkv = k1.shape[1]
    qg = q.float().permute(1, 0, 2).reshape(hkv, hq // hkv, t, d)
    l2 = torch.einsum("hgtd,nhd->hgtn", qg, k2.float()) * scale
    l2 = l2.masked_fill(torch.arange(k2.shape[0], device=q.device) >= vis2[:, None], float("-inf"))
    lse = l2.logsumexp(-1, keepdim=True)
    hidden = torch.arange(k1.shape[0], device=q.device) >= vis1[:, None]
    s = torch.exp(torch.einsum("hgtd,nhd->hgtn", qg, k1.float()) * scale - lse)
    return s.masked_fill(hidden, 0.0).sum(1)


if triton is not None:
    from kernels.target import FP32_DOT

    @triton.jit(do_not_specialize=["n1"])
    def _stage1_kernel(
        q_ptr, k1_ptr, k2_ptr, vis1_ptr, vis2_ptr, o_ptr, scale, n1,
        stride_qt, stride_qh, stride_k1n, stride_k1h, stride_k2n, stride_k2h, stride_oh, stride_ot,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
    ):  # fmt: skip
        t = tl.program_id(0)
        kvh = tl.program_id(1)
        rh = tl.arange(0, BLOCK_H)
        h_ok = rh < GROUP
        rd = tl.arange(0, BLOCK_D)
        d_ok = rd < HEAD_DIM
        rn = tl.arange(0, BLOCK_N)
        q = tl.load(q_ptr + t * stride_qt + (kvh * GROUP + rh)[:, None] * stride_qh + rd[None, :],
                    mask=h_ok[:, None] & d_ok[None, :], other=0.0).to(tl.float32)
        vis2 = tl.load(vis2_ptr + t)
        vis1 = tl.load(vis1_ptr + t)
        m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        for j0 in range(0, vis2, BLOCK_N):
            j = j0 + rn
            ok = j < vis2
            k = tl.load(k2_ptr + j[:, None] * stride_k2n + kvh * stride_k2h + rd[None, :],
                        mask=ok[:, None] & d_ok[None, :], other=0.0)
            s = tl.where(ok[None, :], tl.dot(q, tl.trans(k), input_precision=FP32_DOT) * scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s - m_new[:, None]), axis=1)
            m_i = m_new
        lse = m_i + tl.log(l_i)  # -inf when no K2 window is visible (l_i = 0)
        for j0 in range(0, n1, BLOCK_N):
            j = j0 + rn
            ok = j < vis1
            k = tl.load(k1_ptr + j[:, None] * stride_k1n + kvh * stride_k1h + rd[None, :],
                        mask=ok[:, None] & d_ok[None, :], other=0.0)
            p = tl.exp(tl.dot(q, tl.trans(k), input_precision=FP32_DOT) * scale - lse[:, None])
            p = tl.where(h_ok[:, None] & ok[None, :], p, 0.0)
            tl.store(o_ptr + kvh * stride_oh + t * stride_ot + j, tl.sum(p, axis=0), mask=j < n1)


def stage1_scores_triton(q, k1, k2, vis1, vis2, scale: float) -> torch.Tensor:
    t, hq, d = q.shape
    hkv = k1.shape[1]
    q, k1, k2 = q.contiguous(), k1.float().contiguous(), k2.float().contiguous()
    out = torch.empty(hkv, t, k1.shape[0], dtype=torch.float32, device=q.device)
    if not k1.shape[0] or not t:
        return out
    group = hq // hkv
    _stage1_kernel[(t, hkv)](
        q, k1, k2, vis1, vis2, out, scale, k1.shape[0],
        q.stride(0), q.stride(1), k1.stride(0), k1.stride(1), k2.stride(0), k2.stride(1), out.stride(0), out.stride(1),
        GROUP=group, HEAD_DIM=d, BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(d)),
        BLOCK_N=BLOCK_N,
    )  # fmt: skip
    return out


def stage1_scores(q, k1, k2, vis1, vis2, scale: float) -> torch.Tensor:
    """Triton kernel on CUDA, torch reference elsewhere; see stage1_scores_reference."""
    if target.on_gpu(q):
        return stage1_scores_triton(q, k1, k2, vis1, vis2, scale)
    return stage1_scores_reference(q, k1, k2, vis1, vis2, scale)
