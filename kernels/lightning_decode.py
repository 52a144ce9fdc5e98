"""One decode token of lightning attention for a batch of requests, each updating its own slot
of a state pool in place (sala/lightning.py `step`, per head h with log-decay g_h):

    S[slot] <- exp(g_h) S[slot] + k v^T        o = scale q^T S[slot]      (fp32 arithmetic)

q, k [B, H, Dk], v [B, H, Dv] fp32; states [slots, H, Dk, Dv] fp32 or bf16 (a cache plan may
keep a layer's states in bf16: they are rounded once, when stored); slots [B] distinct.
Returns o [B, H, Dv] fp32.

Decode is bound by the state: at Dk = Dv = 128 a head's state is 64 KiB in fp32 against 1.5
KiB of q, k, v. The torch form (the reference) gathers the batch's states, updates them and
scatters them back: five reads and four writes of every state. The Triton kernel reads
each state once and writes it once, one program per (request, head, BLOCK_V columns): the
[Dk, BLOCK_V] slice is loaded, updated and stored BLOCK_K rows at a time, with q^T S summed
over the row blocks.
"""
import torch

from kernels import target

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs may lack triton; the torch reference still works
    triton = None

# (BLOCK_K rows x BLOCK_V columns of the state a program updates per iteration, warps) by
# target.pick: from the compile check (sala/compile_check.py), 16-32 KiB of state in flight
# per program and 6-7 programs an SM on every target, over twice the bytes in flight an H200
# or B200 needs; bench/tune_kernels.py times the alternatives on a GPU.
TILES = {80: (64, 64, 4)}


def _check(q, k, v, g, states, slots) -> None:
    b, h, dk = q.shape
    if k.shape != q.shape or v.shape[:2] != (b, h) or g.shape != (h,) or slots.shape != (b,):
        raise ValueError(f"expected q, k [B, H, Dk], v [B, H, Dv], g [H], slots [B]; got q {tuple(q.shape)}, "
                         f"k {tuple(k.shape)}, v {tuple(v.shape)}, g {tuple(g.shape)}, slots {tuple(slots.shape)}")
    if states.ndim != 4 or states.shape[1:] != (h, dk, v.shape[-1]):
        raise ValueError(f"states {tuple(states.shape)} are not [slots, H, Dk, Dv] = [slots, {h}, {dk}, {v.shape[-1]}]")


def lightning_decode_reference(q, k, v, g, scale: float, states, slots) -> torch.Tensor:
    """Gather the slots' states in fp32, update, scatter back in the pool's dtype."""
    _check(q, k, v, g, states, slots)
    s = torch.exp(g.float()).view(1, -1, 1, 1) * states.index_select(0, slots).float() + k[..., :, None] * v[..., None, :]
    states.index_copy_(0, slots, s.to(states.dtype))
    return torch.einsum("bhd,bhde->bhe", q * scale, s)


if triton is not None:

    @triton.jit
    def _lightning_decode_kernel(
        q_ptr, k_ptr, v_ptr, g_ptr, s_ptr, slot_ptr, o_ptr, scale,
        stride_qb, stride_qh, stride_kb, stride_kh, stride_vb, stride_vh, stride_ob, stride_oh,
        stride_ss, stride_sh, stride_sk,
        H: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    ):  # fmt: skip
        """Program (request * head, column block)."""
        bh = tl.program_id(0)
        b = bh // H
        h = bh % H
        rv = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
        v_ok = rv < DV
        decay = tl.exp(tl.load(g_ptr + h))
        v = tl.load(v_ptr + b * stride_vb + h * stride_vh + rv, mask=v_ok, other=0.0)
        state = s_ptr + tl.load(slot_ptr + b).to(tl.int64) * stride_ss + h * stride_sh + rv[None, :]
        o = tl.zeros((BLOCK_V,), dtype=tl.float32)
        for k0 in range(0, DK, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < DK
            mask = k_ok[:, None] & v_ok[None, :]
            s = tl.load(state + rk[:, None] * stride_sk, mask=mask, other=0.0).to(tl.float32)
            kk = tl.load(k_ptr + b * stride_kb + h * stride_kh + rk, mask=k_ok, other=0.0)
            qq = tl.load(q_ptr + b * stride_qb + h * stride_qh + rk, mask=k_ok, other=0.0)
            s = decay * s + kk[:, None] * v[None, :]
            tl.store(state + rk[:, None] * stride_sk, s.to(s_ptr.dtype.element_ty), mask=mask)
            o += tl.sum((qq * scale)[:, None] * s, axis=0)
        tl.store(o_ptr + b * stride_ob + h * stride_oh + rv, o, mask=v_ok)


def lightning_decode_triton(q, k, v, g, scale: float, states, slots) -> torch.Tensor:
    _check(q, k, v, g, states, slots)
    b, h, dk = q.shape
    dv = v.shape[-1]
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q, k, v = (x.contiguous() for x in (q, k, v))
    if not states.is_contiguous():
        raise ValueError("the state pool must be contiguous: it is updated in place")
    o = torch.empty(b, h, dv, dtype=torch.float32, device=q.device)
    block_k, block_v, num_warps = target.pick(TILES, q.device)
    block_k, block_v = min(block_k, max(16, triton.next_power_of_2(dk))), min(block_v, max(16, triton.next_power_of_2(dv)))
    _lightning_decode_kernel[(b * h, triton.cdiv(dv, block_v))](
        q, k, v, g.float(), states, slots, o, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), o.stride(0), o.stride(1),
        states.stride(0), states.stride(1), states.stride(2),
        H=h, DK=dk, DV=dv, BLOCK_K=block_k, BLOCK_V=block_v, num_warps=num_warps,
    )  # fmt: skip
    return o


def lightning_decode(q, k, v, g, scale: float, states, slots) -> torch.Tensor:
    """o [B, H, Dv] of one token per request, states updated in place at `slots` (see the module
    docstring). Triton kernel on CUDA, torch reference elsewhere."""
    if target.on_gpu(q):
        return lightning_decode_triton(q, k, v, g, scale, states, slots)
    return lightning_decode_reference(q, k, v, g, scale, states, slots)
