"""Lightning (constant-decay linear attention) over a draft tree: the tree-masked parallel form.

Every tree node must see the recurrent state obtained along its own root-to-node path, never
the previous node of the flattened order. With per-head decay a = exp(g), depth d_i and the
ancestor-or-self mask M (Medusa's tree attention mask), from the committed state S:

    o_i = scale * [ a^(d_i + 1) q_i^T S + sum_{j : M[i, j]} a^(d_i - d_j) (q_i . k_j) v_j ]

i.e. causal linear attention with the causal mask replaced by the ancestor mask and the
position distance by the depth distance. Nothing is written to S: after acceptance the
state is advanced along the accepted path (sala/lightning_tree.py, commit_path).

The Triton kernel runs one program per (request, head, Dv block): the tree's T <= 64-ish
nodes fit one tile, so it is one Q K^T, one masked decay, two dots. The exponent is computed
only where the mask is set: elsewhere d_i - d_j can be negative and exp would overflow.
Tiles (BLOCK_K x BLOCK_V, 8 warps, per target): from the compile check (sala/compile_check.py),
the largest without spills at Dk = 128 and 64 nodes: sm_90 / sm_100's warpgroup MMAs hold a
[16, 64] state block in 140 registers, the older MMAs of sm_80 / sm_89 / sm_120 [16, 32] in 231.

Shapes: q, k [B, H, T, Dk], v [B, H, T, Dv], state [B, H, Dk, Dv] fp32, g [H], depths [T]
(long), ancestor_mask [T, T] bool. Output [B, H, T, Dv] fp32.
"""
import torch

from kernels import target

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs may lack triton; the torch reference still works
    triton = None


TILES = {80: (16, 32), 90: (16, 64), 120: (16, 32)}  # (BLOCK_K, BLOCK_V) by target.pick

def _check(q, k, v, state, g, depths, ancestor_mask) -> None:
    b, h, t, dk = q.shape
    if k.shape != q.shape or v.shape[:3] != (b, h, t) or state.shape != (b, h, dk, v.shape[-1]):
        raise ValueError(f"expected q, k [B, H, T, Dk], v [B, H, T, Dv], state [B, H, Dk, Dv]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, state {tuple(state.shape)}")
    if g.shape != (h,) or depths.shape != (t,) or ancestor_mask.shape != (t, t):
        raise ValueError(f"expected g [H={h}], depths [T={t}], ancestor_mask [T, T]; got {tuple(g.shape)}, "
                         f"{tuple(depths.shape)}, {tuple(ancestor_mask.shape)}")


def tree_decay(g: torch.Tensor, depths: torch.Tensor, ancestor_mask: torch.Tensor) -> torch.Tensor:
    """D[h, i, j] = exp(g_h (d_i - d_j)) where j is an ancestor of i (or i), else 0."""
    dist = (depths[:, None] - depths[None, :]).to(g.dtype)
    expo = torch.where(ancestor_mask, g.view(-1, 1, 1) * dist, torch.full_like(dist, float("-inf")))
    return torch.exp(expo)


def tree_verify_reference(q, k, v, g, scale: float, state, depths, ancestor_mask) -> torch.Tensor:
    """The torch form: two batched matmuls and the masked decay."""
    _check(q, k, v, state, g, depths, ancestor_mask)
    intra = ((q @ k.transpose(-1, -2)) * tree_decay(g, depths, ancestor_mask)) @ v
    root = torch.exp(g.view(-1, 1) * (depths + 1).to(g.dtype)).view(1, -1, depths.shape[0], 1)
    return scale * (intra + root * (q @ state))


if triton is not None:
    from kernels.target import FP32_DOT

    @triton.jit(do_not_specialize=["T"])
    def _tree_verify_kernel(
        q_ptr, k_ptr, v_ptr, s_ptr, g_ptr, d_ptr, m_ptr, o_ptr, scale, T, DK, DV,
        sq_b, sq_h, sq_t, sk_b, sk_h, sk_t, sv_b, sv_h, sv_t, ss_b, ss_h, ss_k, so_b, so_h, so_t, sm_i,
        BLOCK_T: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        """Program (request, head, Dv block). The two products over Dk (q k^T and q S) are summed
        BLOCK_K columns at a time, so no [T, Dk] or [Dk, Dv] tile has to fit in registers."""
        b, h, vb = tl.program_id(0), tl.program_id(1), tl.program_id(2)
        rt = tl.arange(0, BLOCK_T)
        rv = vb * BLOCK_V + tl.arange(0, BLOCK_V)
        t_ok, v_ok = rt < T, rv < DV
        scores = tl.zeros((BLOCK_T, BLOCK_T), dtype=tl.float32)
        qs = tl.zeros((BLOCK_T, BLOCK_V), dtype=tl.float32)
        for k0 in range(0, DK, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            tk_ok = t_ok[:, None] & (rk < DK)[None, :]
            q = tl.load(q_ptr + b * sq_b + h * sq_h + rt[:, None] * sq_t + rk[None, :], mask=tk_ok, other=0.0)
            k = tl.load(k_ptr + b * sk_b + h * sk_h + rt[:, None] * sk_t + rk[None, :], mask=tk_ok, other=0.0)
            s = tl.load(s_ptr + b * ss_b + h * ss_h + rk[:, None] * ss_k + rv[None, :],
                        mask=(rk < DK)[:, None] & v_ok[None, :], other=0.0)
            scores = tl.dot(q, tl.trans(k), scores, input_precision=FP32_DOT)
            qs = tl.dot(q, s, qs, input_precision=FP32_DOT)
        v = tl.load(v_ptr + b * sv_b + h * sv_h + rt[:, None] * sv_t + rv[None, :], mask=t_ok[:, None] & v_ok[None, :], other=0.0)
        gh = tl.load(g_ptr + h)
        depth = tl.load(d_ptr + rt, mask=t_ok, other=0).to(tl.float32)
        anc = tl.load(m_ptr + rt[:, None] * sm_i + rt[None, :], mask=t_ok[:, None] & t_ok[None, :], other=0) != 0
        expo = tl.where(anc, gh * (depth[:, None] - depth[None, :]), float("-inf"))
        out = tl.dot(scores * tl.exp(expo), v, input_precision=FP32_DOT) + tl.exp(gh * (depth + 1.0))[:, None] * qs
        tl.store(o_ptr + b * so_b + h * so_h + rt[:, None] * so_t + rv[None, :], out * scale, mask=t_ok[:, None] & v_ok[None, :])


def tree_verify_triton(q, k, v, g, scale: float, state, depths, ancestor_mask) -> torch.Tensor:
    """The Triton kernel; fp32 inputs (lightning runs in fp32), same contract as the reference."""
    _check(q, k, v, state, g, depths, ancestor_mask)
    q, k, v, state = (x.float().contiguous() for x in (q, k, v, state))
    b, h, t, dk = q.shape
    dv = v.shape[-1]
    o = torch.empty(b, h, t, dv, dtype=torch.float32, device=q.device)
    mask = ancestor_mask.to(torch.int8).contiguous()
    block_k, block_v = target.pick(TILES, q.device)
    block_k, block_v = min(block_k, max(16, triton.next_power_of_2(dk))), min(block_v, max(16, triton.next_power_of_2(dv)))
    _tree_verify_kernel[(b, h, triton.cdiv(dv, block_v))](
        q, k, v, state, g.float().contiguous(), depths.contiguous(), mask, o, scale, t, dk, dv,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2), v.stride(0), v.stride(1),
        v.stride(2), state.stride(0), state.stride(1), state.stride(2), o.stride(0), o.stride(1), o.stride(2),
        mask.stride(0),
        BLOCK_T=max(16, triton.next_power_of_2(t)), BLOCK_K=block_k, BLOCK_V=block_v, num_warps=8,
    )  # fmt: skip
    return o


def lightning_tree_verify(q, k, v, g, scale: float, state, depths, ancestor_mask) -> torch.Tensor:
    """Outputs of every tree node (see the module docstring). Triton on CUDA, torch elsewhere."""
    if target.on_gpu(q):
        return tree_verify_triton(q, k, v, g, scale, state, depths, ancestor_mask)
    return tree_verify_reference(q, k, v, g, scale, state, depths, ancestor_mask)
