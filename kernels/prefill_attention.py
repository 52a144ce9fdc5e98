"""Dense causal GQA attention of one prompt chunk (the sparse layers below dense_len), flash-style.

q [Hq, T, D] holds the chunk's queries at positions L - T .. L - 1; k, v [Hkv, L, D] hold every
key up to the chunk's last (the cached prefix, then the chunk itself); query i attends keys
0 .. L - T + i. SDPA's layout without the batch dimension, so the torch reference is exactly the
call the engine makes on CPU.

The Triton kernel runs one program per (BLOCK_M queries, query head): the query tile stays in
registers while BLOCK_N-key tiles of its kv head stream past with an fp32 online softmax
(FlashAttention-2's loop); tiles beyond the tile's last query position are never loaded.
"""
import torch
import torch.nn.functional as F

from kernels import target

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs may lack triton; the torch reference still works
    triton = None


# (BLOCK_M, BLOCK_N, warps) by target.pick, from the compile check (sala/compile_check.py): the
# largest tiles without spills at head_dim 128 whose shared memory fits the target (99 KiB a
# block on sm_89 / sm_120).
TILES = {80: (128, 64, 8), 89: (128, 32, 8), 90: (128, 64, 8), 120: (128, 32, 8)}


def _check(q, k, v):
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape:
        raise ValueError(f"expected q [Hq, T, D], k/v [Hkv, L, D]; got q {tuple(q.shape)}, k {tuple(k.shape)}, "
                         f"v {tuple(v.shape)}")
    hq, t, d = q.shape
    hkv, length = k.shape[:2]
    if k.shape[2] != d or hq % hkv or length < t:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)} do not fit (Hq a multiple of Hkv, L >= T)")
    return hq, t, d, hkv, length


def causal_mask(t: int, length: int, device) -> torch.Tensor:
    """[T, L] True where query i (at position L - T + i) may see key j."""
    return torch.arange(length, device=device)[None] <= torch.arange(length - t, length, device=device)[:, None]


def prefill_attention_reference(q, k, v, scale: float | None = None) -> torch.Tensor:
    hq, t, _, hkv, length = _check(q, k, v)
    mask = None if length == t else causal_mask(t, length, q.device)[None, None]
    return F.scaled_dot_product_attention(q[None], k[None], v[None], attn_mask=mask, is_causal=mask is None,
                                          scale=scale, enable_gqa=hq != hkv)[0]


if triton is not None:
    from kernels.target import FP32_DOT

    @triton.jit(do_not_specialize=["num_q", "num_keys"])
    def _prefill_kernel(
        q_ptr, k_ptr, v_ptr, o_ptr, scale, num_q, num_keys,
        stride_qh, stride_qt, stride_kh, stride_kl, stride_vh, stride_vl, stride_oh, stride_ot,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr, UPCAST: tl.constexpr,
    ):  # fmt: skip
        """Program (query tile, query head) over the keys its tile can see."""
        tile = tl.program_id(0)
        h = tl.program_id(1)
        kvh = h // GROUP
        rm = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        rd = tl.arange(0, BLOCK_D)
        d_ok = rd < HEAD_DIM
        m_ok = rm < num_q
        q = tl.load(q_ptr + h * stride_qh + rm[:, None] * stride_qt + rd[None, :], mask=m_ok[:, None] & d_ok[None, :],
                    other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        past = num_keys - num_q
        q_pos = past + rm
        m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
        rn = tl.arange(0, BLOCK_N)
        end = tl.minimum(num_keys, past + (tile + 1) * BLOCK_M)  # keys past the tile's last query: never seen
        for start in range(0, end, BLOCK_N):
            kp = start + rn
            kv_ok = (kp < num_keys)[:, None] & d_ok[None, :]
            k = tl.load(k_ptr + kvh * stride_kh + kp[:, None] * stride_kl + rd[None, :], mask=kv_ok, other=0.0)
            v = tl.load(v_ptr + kvh * stride_vh + kp[:, None] * stride_vl + rd[None, :], mask=kv_ok, other=0.0)
            if UPCAST:
                k, v = k.to(tl.float32), v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision=FP32_DOT) * scale
            s = tl.where((kp[None, :] <= q_pos[:, None]) & (kp < num_keys)[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))  # finite: key 0 is visible to every query
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=FP32_DOT)
            m_i = m_new
        o = acc / l_i[:, None]
        tl.store(o_ptr + h * stride_oh + rm[:, None] * stride_ot + rd[None, :], o.to(o_ptr.dtype.element_ty),
                 mask=m_ok[:, None] & d_ok[None, :])


def prefill_attention_triton(q, k, v, scale: float | None = None, block_m: int | None = None,
                             block_n: int | None = None) -> torch.Tensor:
    """The Triton kernel; tiles from TILES unless given (tests vary them)."""
    hq, t, d, hkv, length = _check(q, k, v)
    tile_m, tile_n, num_warps = target.pick(TILES, q.device)
    block_m, block_n = block_m or tile_m, block_n or tile_n
    scale = d**-0.5 if scale is None else scale
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (x.contiguous() for x in (q, k, v))
    o = q.new_empty(q.shape)
    _prefill_kernel[(triton.cdiv(t, block_m), hq)](
        q, k, v, o, scale, t, length,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        GROUP=hq // hkv, HEAD_DIM=d, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=max(16, triton.next_power_of_2(d)),
        UPCAST=target.INTERPRETED,  # on a GPU bf16 tiles go to the tensor cores as they are
        num_warps=num_warps,
    )  # fmt: skip
    return o


def prefill_attention(q, k, v, scale: float | None = None) -> torch.Tensor:
    """q [Hq, T, D] at the last T of the L positions of k, v [Hkv, L, D]; causal; scale by default
    1/sqrt(D), as SDPA's. Returns [Hq, T, D] in q's dtype. Triton kernel on CUDA, torch SDPA elsewhere."""
    if target.on_gpu(q):
        return prefill_attention_triton(q, k, v, scale)
    return prefill_attention_reference(q, k, v, scale)
