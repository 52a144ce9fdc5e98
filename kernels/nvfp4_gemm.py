"""W4A16 NVFP4 matmul: y = x @ W^T with W stored as compressed-tensors NVFP4.

W [N, K] arrives as packed E2M1 codes uint8 [N, K/2] (low nibble = even k), FP8 E4M3 group
scales [N, K/16] and an fp32 global scale in the encode direction:
W[n, k] = E2M1[code] * scale[n, k // 16] / global.

The kernel dequantizes a [BLOCK_N, BLOCK_K] tile in registers and feeds ``tl.dot``. It applies
the global scale once to the fp32 accumulator instead of to every weight: E2M1 (2 significant
bits) times FP8 E4M3 (4 bits) is exact in bf16/fp16, so the dot sees the weight without any
rounding and only the final rescale differs from the reference, by fp32 rounding.
"""
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs may lack triton; the torch reference still works
    triton = None

E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
GROUP_SIZE = 16


if triton is not None:

    @triton.jit
    def _nvfp4_matmul_kernel(
        x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, y_ptr,
        M, N, K,
        stride_xm, stride_xk, stride_wn, stride_sn, stride_ym,
        HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            k_ok = rk < K
            x = tl.load(
                x_ptr + rm[:, None] * stride_xm + rk[None, :] * stride_xk,
                mask=m_ok[:, None] & k_ok[None, :],
                other=0.0,
            )
            w_ok = n_ok[:, None] & k_ok[None, :]
            # Each byte is loaded for both of its columns; the second load hits cache.
            byte = tl.load(w_ptr + rn[:, None] * stride_wn + (rk // 2)[None, :], w_ok, other=0)
            code = (byte >> ((rk % 2) * 4)[None, :]) & 0xF
            scale = tl.load(s_ptr + rn[:, None] * stride_sn + (rk // 16)[None, :], w_ok, other=0.0)
            # E2M1 decode: exponent e = bits 1..2, mantissa m = bit 0; e == 0 is subnormal (m / 2),
            # otherwise 2^(e-1) * (1 + m/2) = (2 + m) * 2^e / 4.
            e = (code >> 1) & 3
            m = (code & 1).to(tl.float32)
            mag = tl.where(e == 0, m * 0.5, (2.0 + m) * (1 << e).to(tl.float32) * 0.25)
            w = tl.where((code & 8) != 0, -mag, mag) * scale.to(tl.float32)
            if DOT_FP32:
                acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
            else:
                acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        acc = acc / tl.load(g_ptr)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(
            y_ptr + rm[:, None] * stride_ym + rn[None, :],
            acc.to(y_ptr.dtype.element_ty),
            mask=m_ok[:, None] & n_ok[None, :],
        )


def nvfp4_matmul_triton(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32) -> y [M, N] in x's dtype, through the Triton kernel."""
    m, k = x.shape
    n = packed.shape[0]
    if k != 2 * packed.shape[1] or scale.shape != (n, k // GROUP_SIZE):
        raise ValueError(
            f"activations [{m}, {k}] do not match packed weight {tuple(packed.shape)} "
            f"and scales {tuple(scale.shape)}"
        )
    packed, scale = packed.contiguous(), scale.contiguous()
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    # tl.dot needs at least 16 rows; decode (M = 1) pays for the padding in compute, not in
    # memory traffic, which is what bounds it.
    block_m = 16 if m <= 16 else 64
    block_n, block_k = 64, 64
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    # fp32 activations get an exact fp32 dot (not TF32). Triton's interpreter multiplies bf16
    # operands of tl.dot as raw uint16 bit patterns (triton-lang/triton#11584), so under it a
    # bf16 dot runs in fp32 too: the same products (both operands are exact in bf16), summed
    # in fp32 as the tensor cores do.
    interpreted = os.environ.get("TRITON_INTERPRET") == "1"
    dot_fp32 = x.dtype == torch.float32 or (interpreted and x.dtype == torch.bfloat16)
    _nvfp4_matmul_kernel[grid](
        x, packed, scale, global_scale, bias if bias is not None else y, y,
        m, n, k,
        x.stride(0), x.stride(1), packed.stride(0), scale.stride(0), y.stride(0),
        HAS_BIAS=bias is not None, DOT_FP32=dot_fp32,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
    )  # fmt: skip
    return y


def nvfp4_dequantize_reference(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """fp32 [N, K] weight: E2M1[code] * (scale / global), compressed-tensors' order."""
    codes = torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)
    step = (scale.float() / global_scale.float()).repeat_interleave(GROUP_SIZE, dim=-1)
    # index_select, not advanced indexing, which is orders of magnitude slower on CPU.
    values = E2M1_VALUES.to(packed.device).index_select(0, codes.flatten().int())
    return values.view(codes.shape) * step


def nvfp4_matmul_reference(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """Dequantize to fp32 and matmul in fp32; the result is cast to x's dtype."""
    w = nvfp4_dequantize_reference(packed, scale, global_scale)
    b = bias.float() if bias is not None else None
    return torch.nn.functional.linear(x.float(), w, b).to(x.dtype)


def nvfp4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T (+ bias): Triton kernel on CUDA, torch reference elsewhere."""
    x2 = x.reshape(-1, x.shape[-1])
    if x.is_cuda and triton is not None:
        y = nvfp4_matmul_triton(x2, packed, scale, global_scale, bias)
    else:
        y = nvfp4_matmul_reference(x2, packed, scale, global_scale, bias)
    return y.reshape(*x.shape[:-1], packed.shape[0])
