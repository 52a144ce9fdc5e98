"""W4A16 NVFP4 matmul: y = x @ W^T with W stored as compressed-tensors NVFP4.

W [N, K] arrives as packed E2M1 codes uint8 [N, K/2] (low nibble = even k), FP8 E4M3 group
scales [N, K/16] and an fp32 global scale in the encode direction:
W[n, k] = E2M1[code] * scale[n, k // 16] / global[n].
The global scale is a [1] tensor (one per weight) or an [N] tensor (one per output row), the
latter for fused projections whose parts were quantized with different global scales and
concatenated along N.

The kernel dequantizes a [BLOCK_N, BLOCK_K] tile in registers and feeds ``tl.dot``. It applies
the global scale once to the fp32 accumulator instead of to every weight: E2M1 (2 significant
bits) times FP8 E4M3 (4 bits) is exact in bf16/fp16, so the dot sees the weight without any
rounding and only the final rescale differs from the reference, by fp32 rounding.

Two schedules. Tiled: one program per [BLOCK_M, BLOCK_N] output tile, looping over all of K.
Split-K, for M <= 16 (decode): the tiled grid there is only N / 64 programs (64 at N = 4096,
for 132 SMs on an H100/H200), too few to keep HBM busy, so K is also cut into ``splits``
ranges, each program writes an fp32 partial sum, and a second kernel adds the partials in a
fixed order (deterministic: no atomics), divides by the global scale, adds the bias and casts.
The number of splits depends on N, K and the SM count only, never on M, so a row's result
does not change with how many other rows (up to 16) share the call.

Off CUDA, ``nvfp4_matmul_cpu`` keeps W packed too: it dequantizes W a tile of rows at a time
(at most CPU_TILE_WEIGHTS weights, 512 KiB of fp32) and multiplies each tile in fp32, so a call
never holds more than one tile of W dequantized. A tile decodes both codes of every byte with
one gather (E2M1_PAIRS) and its FP8 scales with another (E4M3_VALUES), then applies the group
scales by a broadcast multiply: the same fp32 operations as the reference, so a tile's weights
are the reference's bit for bit. A weight of more than one tile goes through the custom op
``sala::nvfp4_matmul_tiled``, which a compiled graph calls as one opaque op (its loop over
tiles would otherwise be unrolled into the graph); a weight of one tile is plain torch ops that
inductor fuses into the graph. ``nvfp4_matmul_reference`` (the whole weight dequantized, then
one fp32 matmul) is what both are tested against.
"""
from dataclasses import dataclass

import torch

from kernels import target

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs may lack triton; the torch reference still works
    triton = None

# The format itself, for every user of it (sala.quant.nvfp4 quantizes with these, KV-cache
# formats reuse them): value of every E2M1 code, magnitude from bits 0..2, sign from bit 3
# (0x8 is -0.0); and how many weights share one FP8 scale.
E2M1_VALUES = torch.tensor(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    dtype=torch.float32,
)
GROUP_SIZE = 16
SPLIT_K_MAX_M = 16  # up to here a decode batch fits one 16-row tl.dot tile: the split-K regime
PROGRAMS_PER_SM = 4  # enough resident programs per SM to keep loads in flight


if triton is not None:
    from kernels.target import FP32_DOT

    @triton.jit
    def e2m1_decode(code):
        """fp32 value of 4-bit E2M1 codes (bit 3 = sign; shared by every kernel that reads E2M1).
        Exponent e = bits 1..2, mantissa m = bit 0; e == 0 is subnormal (m / 2), otherwise
        2^(e-1) * (1 + m/2) = (2 + m) * 2^e / 4."""
        e = (code >> 1) & 3
        m = (code & 1).to(tl.float32)
        mag = tl.where(e == 0, m * 0.5, (2.0 + m) * (1 << e).to(tl.float32) * 0.25)
        return tl.where((code & 8) != 0, -mag, mag)

    @triton.jit
    def e4m3_to_float(bits, NATIVE: tl.constexpr):
        """fp32 value of FP8 E4M3 (the "fn" variant: no infinities, NaN at 0x7F / 0xFF) bytes,
        shared by every kernel that reads FP8 scales or pages. NATIVE: the conversion
        instruction (sm_89 and newer). Otherwise integer operations, exact for all 256 codes,
        since older GPUs have no FP8 type: the byte's exponent and mantissa fields, shifted
        into an fp16's (bias 15 instead of 7), are the value times 2^-8, subnormals included
        (fp16 keeps its subnormals, fp32 arithmetic may flush them)."""
        if NATIVE:
            return bits.to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            b = bits.to(tl.uint16)
            h = ((b & 0x7F) << 7) | ((b & 0x80) << 8)
            x = h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
            return tl.where((b & 0x7F) == 0x7F, float("nan"), x)

    @triton.jit(do_not_specialize=["M", "stride_g"])  # any batch, either global scale: one kernel
    def _nvfp4_matmul_kernel(
        x_ptr, w_ptr, s_ptr, g_ptr, b_ptr, y_ptr,
        M, N, K, K_PER_SPLIT,
        stride_xm, stride_xk, stride_wn, stride_sn, stride_ym, stride_ys, stride_g,
        HAS_BIAS: tl.constexpr, DOT_FP32: tl.constexpr, PARTIAL: tl.constexpr, NATIVE_FP8: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """Output tile (pid_m, pid_n) summed over K range pid_k. PARTIAL: store the raw fp32
        sum at y_ptr + pid_k * stride_ys (the reduce kernel finishes it); otherwise divide by
        the global scale, add the bias and store in y's dtype. s_ptr: the FP8 scales' bytes."""
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        k_start = pid_k * K_PER_SPLIT
        k_end = tl.minimum(k_start + K_PER_SPLIT, K)
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(k_start, k_end, BLOCK_K):
            # Each packed byte is loaded once and its two nibbles go to two dots, against the
            # even and the odd columns of x: loading [BLOCK_N, BLOCK_K] codes byte by byte
            # instead (each byte twice) took 255 registers on sm_90, 360 bytes of spills at
            # BLOCK_M = 64; this takes 165 / 225 and none (ptxas, Triton 3.9). K is a multiple
            # of 16 and so is k_end, so a byte's two columns are in range together.
            rj = k0 // 2 + tl.arange(0, BLOCK_K // 2)
            j_ok = 2 * rj < k_end
            x_ok = m_ok[:, None] & j_ok[None, :]
            x_even = tl.load(x_ptr + rm[:, None] * stride_xm + (2 * rj)[None, :] * stride_xk, mask=x_ok, other=0.0)
            x_odd = tl.load(x_ptr + rm[:, None] * stride_xm + (2 * rj + 1)[None, :] * stride_xk, mask=x_ok, other=0.0)
            w_ok = n_ok[:, None] & j_ok[None, :]
            byte = tl.load(w_ptr + rn[:, None] * stride_wn + rj[None, :], w_ok, other=0)
            # Group g = column // 16 = byte // 8.
            scale = e4m3_to_float(tl.load(s_ptr + rn[:, None] * stride_sn + (rj // 8)[None, :], w_ok, other=0), NATIVE_FP8)
            for half in tl.static_range(2):  # low nibble = even column, high = odd
                code = (byte >> (4 * half)) & 0xF
                w = e2m1_decode(code) * scale
                x = x_even if half == 0 else x_odd
                if DOT_FP32:
                    acc = tl.dot(x.to(tl.float32), tl.trans(w), acc, input_precision=FP32_DOT)
                else:
                    acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
        out_ok = m_ok[:, None] & n_ok[None, :]
        if PARTIAL:
            tl.store(y_ptr + pid_k * stride_ys + rm[:, None] * stride_ym + rn[None, :], acc, mask=out_ok)
        else:
            # stride_g is 0 for a [1] global scale, 1 for an [N] one.
            acc = acc / tl.load(g_ptr + rn * stride_g, mask=n_ok, other=1.0)[None, :]
            if HAS_BIAS:
                acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(
                y_ptr + rm[:, None] * stride_ym + rn[None, :],
                acc.to(y_ptr.dtype.element_ty),
                mask=out_ok,
            )

    @triton.jit(do_not_specialize=["SPLITS", "stride_g"])
    def _split_k_reduce_kernel(
        p_ptr, g_ptr, b_ptr, y_ptr,
        N, SPLITS, stride_ps, stride_pm, stride_ym, stride_g,
        HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        """y[m, n] = (sum over splits, in split order, of partial[s, m, n]) / global + bias."""
        pid_m = tl.program_id(0)
        rn = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        n_ok = rn < N
        acc = tl.zeros((BLOCK,), dtype=tl.float32)
        for s in range(0, SPLITS):
            acc += tl.load(p_ptr + s * stride_ps + pid_m * stride_pm + rn, mask=n_ok, other=0.0)
        acc = acc / tl.load(g_ptr + rn * stride_g, mask=n_ok, other=1.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)
        tl.store(y_ptr + pid_m * stride_ym + rn, acc.to(y_ptr.dtype.element_ty), mask=n_ok)


@dataclass(frozen=True)
class Tiles:
    """A schedule's tile: BLOCK_M rows of x, BLOCK_N output columns, BLOCK_K of K an iteration."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int


# By target (kernels/target.pick). Decode (M <= 16, split-K) is bound by reading the weight,
# so its tile is sized for bytes in flight: (programs an SM holds) x (BLOCK_N x BLOCK_K x 9/16
# bytes of codes and scales an iteration) against bandwidth x latency (sala/compile_check.py
# prints both). 64 x 64 covers sm_80 / sm_89 / sm_120 (6 programs of 79 registers, 14 KiB);
# sm_90 / sm_100 need 22 / 38 KiB, and 64 x 128 (4 programs of 112 registers) reaches 18 KiB:
# larger tiles take registers faster than they add bytes. Tiled (M > 16) is prefill's schedule.
DECODE_TILES = {80: Tiles(16, 64, 64, 4), 90: Tiles(16, 64, 128, 4), 120: Tiles(16, 64, 64, 4)}
TILED_TILES = {80: Tiles(64, 64, 64, 4)}


def schedule(m: int, n: int, k: int, device: torch.device) -> tuple[Tiles, int, int]:
    """(tiles, splits, K columns per split) for an [m, k] x [k, n] call on `device`.

    M > 16 keeps the tiled schedule (one split). Below, aim for PROGRAMS_PER_SM programs per
    SM: cut K into as many BLOCK_K-aligned ranges as the N tiles leave room for, never more
    than there are K blocks. Depends on shapes only, so a CUDA graph captures it."""
    if m > SPLIT_K_MAX_M:
        tiles = target.pick(TILED_TILES, device)
        return tiles, 1, _cdiv(k, tiles.block_k) * tiles.block_k
    tiles = target.pick(DECODE_TILES, device)
    want = _cdiv(PROGRAMS_PER_SM * target.sm_count(device), _cdiv(n, tiles.block_n))
    return tiles, *_splits_of(k, tiles.block_k, want)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _splits_of(k: int, block_k: int, want: int) -> tuple[int, int]:
    """At most `want` (>= 1) block_k-aligned ranges of K of equal length, the last maybe shorter:
    (how many, columns each)."""
    k_blocks = _cdiv(k, block_k)
    per_split = _cdiv(k_blocks, max(1, min(want, k_blocks)))
    return _cdiv(k_blocks, per_split), per_split * block_k


def _check_shapes(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor) -> None:
    """x [M, K], packed [N, K/2] and scale [N, K/16] agree."""
    m, k = x.shape
    n = packed.shape[0]
    if k != 2 * packed.shape[1] or scale.shape != (n, k // GROUP_SIZE):
        raise ValueError(
            f"activations [{m}, {k}] do not match packed weight {tuple(packed.shape)} "
            f"and scales {tuple(scale.shape)}"
        )


def _global_scale_stride(global_scale: torch.Tensor, n: int) -> int:
    """0 when one global scale covers the weight ([1]); for one per output row ([N]), its stride."""
    if global_scale.numel() == 1:
        return 0
    if global_scale.shape != (n,):
        raise ValueError(f"global scale of shape {tuple(global_scale.shape)}: expected [1] or [{n}] (one per output row)")
    return global_scale.stride(0)


def nvfp4_matmul_triton(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    split_k: int | None = None,
) -> torch.Tensor:
    """x [M, K] (bf16, fp16 or fp32) -> y [M, N] in x's dtype, through the Triton kernel.

    ``split_k``: None picks the schedule (split-K for M <= 16, see ``schedule``); 1 forces
    one split; s > 1 forces s-way split-K (benchmarks and tests)."""
    m, k = x.shape
    n = packed.shape[0]
    _check_shapes(x, packed, scale)
    stride_g = _global_scale_stride(global_scale, n)
    packed, scale = packed.contiguous(), scale.contiguous().view(torch.uint8)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    tiles, splits, k_per_split = schedule(m, n, k, x.device)
    if split_k is not None:
        splits, k_per_split = _splits_of(k, tiles.block_k, split_k)
    # fp32 activations get an fp32 dot (target.FP32_DOT). Under the interpreter a bf16 dot runs
    # in fp32 too (target.INTERPRETED): the same products (both operands are exact in bf16),
    # summed in fp32 as the tensor cores do.
    dot_fp32 = x.dtype == torch.float32 or (target.INTERPRETED and x.dtype == torch.bfloat16)
    b_arg = bias if bias is not None else y  # never read without HAS_BIAS
    # tl.dot needs at least 16 rows; decode (M = 1) pays for the padding in compute, not in
    # memory traffic, which is what bounds it.
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), splits)
    meta = dict(DOT_FP32=dot_fp32, NATIVE_FP8=target.native_fp8(x.device), BLOCK_M=tiles.block_m,
                BLOCK_N=tiles.block_n, BLOCK_K=tiles.block_k, num_warps=tiles.num_warps)
    if splits == 1:
        _nvfp4_matmul_kernel[grid](
            x, packed, scale, global_scale, b_arg, y,
            m, n, k, k_per_split,
            x.stride(0), x.stride(1), packed.stride(0), scale.stride(0), y.stride(0), 0, stride_g,
            HAS_BIAS=bias is not None, PARTIAL=False, **meta,
        )  # fmt: skip
        return y
    # Sized from shapes only (no host sync), so the call stays CUDA-graph capturable.
    partial = torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    _nvfp4_matmul_kernel[grid](
        x, packed, scale, global_scale, b_arg, partial,
        m, n, k, k_per_split,
        x.stride(0), x.stride(1), packed.stride(0), scale.stride(0), partial.stride(1), partial.stride(0), stride_g,
        HAS_BIAS=False, PARTIAL=True, **meta,
    )  # fmt: skip
    reduce_block = 256
    _split_k_reduce_kernel[(m, triton.cdiv(n, reduce_block))](
        partial, global_scale, b_arg, y,
        n, splits, partial.stride(0), partial.stride(1), y.stride(0), stride_g,
        HAS_BIAS=bias is not None, BLOCK=reduce_block,
    )  # fmt: skip
    return y


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [..., K/2] -> uint8 [..., K] codes 0..15; low nibble = even column."""
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).flatten(-2)


def decode_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """fp32 value of every code."""
    # index_select rather than advanced indexing: on CPU the latter is ~1000x slower here,
    # and GPTQ decodes one column per step.
    table = E2M1_VALUES.to(codes.device)
    return table.index_select(0, codes.flatten().int()).view(codes.shape)


def dequantize_fp4(codes: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """fp32 [N, K] from unpacked codes: E2M1[code] * (scale / global), compressed-tensors'
    order. The global scale is [1] or [N] (one per output row)."""
    g = global_scale.float()
    if g.numel() > 1:  # [N] -> [N, 1]: each row by its own; a [1] one broadcasts as it is
        g = g.reshape(-1, 1)
    step = (scale.float() / g).repeat_interleave(GROUP_SIZE, dim=-1)
    return decode_e2m1(codes) * step


def nvfp4_dequantize_reference(
    packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor
) -> torch.Tensor:
    """fp32 [N, K] weight from the packed checkpoint tensors (global scale [1] or [N])."""
    _global_scale_stride(global_scale, packed.shape[0])
    return dequantize_fp4(unpack_fp4(packed), scale, global_scale)


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


# ---- CPU: W dequantized a tile of rows at a time ----------------------------------------------

# Byte b -> the values of its low and high nibble (columns 2j and 2j + 1), as one int64 holding
# the two fp32s, so that one 1-D gather decodes a byte (a gather of [256, 2] rows is ~10x slower).
E2M1_PAIRS = torch.stack((E2M1_VALUES.repeat(16), E2M1_VALUES.repeat_interleave(16)), dim=1).view(torch.int64).reshape(256)
# fp32 of every FP8 E4M3 byte: a gather, where converting FP8 on CPU is elementwise scalar code.
E4M3_VALUES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
# Weights a tile dequantizes: 512 KiB of fp32, which stays in cache between its dequantization and
# its matmul. Measured on the 9B's shapes at M = 1 and 8 on one core (bench/cpu_nvfp4.py): 0.7-1.1
# ns a weight with 128K-weight tiles, up to 40% more with 256K, 10-110% more with 1M or 4M.
CPU_TILE_WEIGHTS = 1 << 17


def dequantize_rows(packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor) -> torch.Tensor:
    """fp32 [r, K] of r rows of W, equal bit for bit to those rows of nvfp4_dequantize_reference:
    E2M1[code] * (scale / global), global [1] or [r]."""
    r, half = packed.shape
    step = E4M3_VALUES.index_select(0, scale.view(torch.uint8).reshape(-1).int()).view(r, -1, 1)
    step = step / global_scale.float().reshape(-1, 1, 1)
    pairs = E2M1_PAIRS.index_select(0, packed.reshape(-1).int()).view(torch.float32).view(r, -1, GROUP_SIZE)
    return pairs.mul_(step).view(r, 2 * half)


def _tile_product(xf: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                  bias: torch.Tensor | None) -> torch.Tensor:
    """fp32 xf @ W^T (+ bias) for the rows of W given: the reference's fp32 linear on them."""
    b = bias.float() if bias is not None else None
    return torch.nn.functional.linear(xf, dequantize_rows(packed, scale, global_scale), b)


@torch.library.custom_op("sala::nvfp4_matmul_tiled", mutates_args=())
def nvfp4_matmul_tiled(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                       bias: torch.Tensor | None, tile_weights: int = CPU_TILE_WEIGHTS) -> torch.Tensor:
    """x [M, K] -> y [M, N] in x's dtype, W dequantized `tile_weights` weights (whole rows, at
    least one) at a time."""
    _check_shapes(x, packed, scale)
    n, k = packed.shape[0], x.shape[1]
    _global_scale_stride(global_scale, n)
    rows = max(1, tile_weights // k)
    per_row = global_scale.numel() > 1
    xf, y = x.float(), x.new_empty(x.shape[0], n)
    for lo in range(0, n, rows):
        hi = min(lo + rows, n)
        y[:, lo:hi] = _tile_product(xf, packed[lo:hi], scale[lo:hi], global_scale[lo:hi] if per_row else global_scale,
                                    bias[lo:hi] if bias is not None else None)
    return y


@nvfp4_matmul_tiled.register_fake
def _(x, packed, scale, global_scale, bias, tile_weights=CPU_TILE_WEIGHTS):
    return x.new_empty(x.shape[0], packed.shape[0])


def nvfp4_matmul_cpu(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, global_scale: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M, K] -> y [M, N] in x's dtype, never more than CPU_TILE_WEIGHTS weights of W dequantized."""
    if packed.numel() * 2 > CPU_TILE_WEIGHTS:
        return nvfp4_matmul_tiled(x, packed, scale, global_scale, bias)
    # One tile: plain torch ops, which a compiled graph fuses (the gathers and the multiply in one loop).
    _check_shapes(x, packed, scale)
    _global_scale_stride(global_scale, packed.shape[0])
    return _tile_product(x.float(), packed, scale, global_scale, bias).to(x.dtype)


def nvfp4_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    global_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """y [..., N] = x [..., K] @ W^T (+ bias): the Triton kernel on CUDA, the tiled CPU path
    elsewhere. global_scale is [1] or [N]."""
    x2 = x.reshape(-1, x.shape[-1])
    if target.on_gpu(x2):
        y = nvfp4_matmul_triton(x2, packed, scale, global_scale, bias)
    else:
        y = nvfp4_matmul_cpu(x2, packed, scale, global_scale, bias)
    return y.reshape(*x.shape[:-1], packed.shape[0])
