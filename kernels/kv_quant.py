"""Quantize K/V rows into FP8 or NVFP4 pages on write (the engine's cache write, one per step
and layer), bit for bit what sala/kv/formats.py's torch codecs store.

x [N, Hkv, D] (any float dtype, any strides) goes to pool rows ``rows`` [N] (page * page_size
+ offset) of contiguous pages:

- FP8 E4M3: ``data`` [pool rows, Hkv, D] bytes, value = data * scale, the scale either one
  calibrated fp32 per kv head (``head_scale`` [Hkv], read) or one per row, amax / 448,
  computed here (``row_scale`` [pool rows, Hkv] fp32, written);
- NVFP4: ``data`` [pool rows, Hkv, D/2] (two E2M1 codes a byte, low nibble = even element),
  ``group_scale`` [pool rows, Hkv, D/16] FP8 E4M3, under the layer's global scale (encode
  direction, [1] fp32); ``four_over_six`` picks each group's scale between max/6 and max/4 by
  the squared error of the group's values (FourOverSix), else max/6.

One program per (row, kv head). The arithmetic follows the torch codec step by step in fp32,
divisions correctly rounded (``div_rn``: Triton's plain ``/`` is an approximate division on
the GPU) and the FP8 rounding to nearest, ties to even, after clamping to +-448, so codes and scales
are the ones the torch codec stores. The one exception is FourOverSix's choice, which compares
two sums of 16 squares: summed in another order, a near-tie may go the other way (as between
any two implementations of it).
"""
import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs may lack triton; the torch codecs still work
    triton = None

from kernels import target
from kernels.nvfp4_gemm import GROUP_SIZE

if triton is not None:
    from kernels.nvfp4_gemm import e2m1_decode, e4m3_to_float

    FP8_MAX = tl.constexpr(448.0)
    FP4_MAX = tl.constexpr(6.0)
    # A zero FP8 group scale becomes this (compressed-tensors; sala/quant/nvfp4.py).
    FP8_ZERO_SCALE_EPS = tl.constexpr(0.125)

    @triton.jit
    def _e4m3_bits(y):
        """FP8 E4M3 bits of fp32 y clamped to +-448, rounded to nearest, ties to even, sign
        kept (-0.0 included), by integer arithmetic on y's bits. (The interpreter's
        ``.to(tl.float8e4nv)`` drops the carry when rounding crosses a power of two, 31.99 ->
        16; a GPU's conversion instruction would be right, but one code path serves both.)"""
        a = tl.minimum(tl.abs(y), FP8_MAX)
        bits = a.to(tl.uint32, bitcast=True)
        # Normal range (a >= 2^-6): round the fp32 mantissa to 3 bits, a carry moving into the
        # exponent, then rebias the exponent from 127 to 7.
        normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) >> 20) - (120 << 3)
        # Subnormal range: a multiple of 2^-9, the code is the multiple (8 is the least normal).
        m = a * 512.0
        whole = m.to(tl.uint32)
        frac = m - whole.to(tl.float32)
        sub = whole + ((frac > 0.5) | ((frac == 0.5) & ((whole & 1) == 1))).to(tl.uint32)
        code = tl.where(a >= 0.015625, normal, sub)
        sign = (y.to(tl.uint32, bitcast=True) >> 24) & 0x80
        return (code | sign).to(tl.uint8)

    @triton.jit
    def _fp8_write_kernel(
        x_ptr, rows_ptr, data_ptr, rs_ptr, hs_ptr,
        stride_xn, stride_xh, stride_xd,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, ROW_SCALE: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0)
        h = tl.program_id(1)
        hkv = tl.num_programs(1)
        rd = tl.arange(0, BLOCK_D)
        d_ok = rd < HEAD_DIM
        x = tl.load(x_ptr + n * stride_xn + h * stride_xh + rd * stride_xd, mask=d_ok, other=0.0).to(tl.float32)
        dest = tl.load(rows_ptr + n).to(tl.int64) * hkv + h
        if ROW_SCALE:
            s = tl.math.div_rn(tl.max(tl.abs(x), axis=0), FP8_MAX)
            s = tl.where(s > 0, s, 1.0)
            tl.store(rs_ptr + dest, s)
        else:
            s = tl.load(hs_ptr + h)
        tl.store(data_ptr + dest * HEAD_DIM + rd, _e4m3_bits(tl.math.div_rn(x, s)), mask=d_ok)

    @triton.jit
    def _e2m1_codes(y):
        """Codes of the nearest E2M1 values, ties to even, saturating at 6 (sign: y < 0), by
        the comparisons of sala.quant.nvfp4.round_to_e2m1."""
        a = tl.abs(y)
        mag = ((a > 0.25).to(tl.uint8) + (a >= 0.75).to(tl.uint8) + (a > 1.25).to(tl.uint8)
               + (a >= 1.75).to(tl.uint8) + (a > 2.5).to(tl.uint8) + (a >= 3.5).to(tl.uint8)
               + (a > 5.0).to(tl.uint8))  # fmt: skip
        return mag | ((y < 0).to(tl.uint8) << 3)

    @triton.jit
    def _fp8_scale(s, NATIVE_FP8: tl.constexpr):
        """fp32 value of the FP8 group scale for unrounded scale s (RNE, saturating, never 0)."""
        s8 = e4m3_to_float(_e4m3_bits(s), NATIVE_FP8)
        return tl.where(s8 == 0, FP8_ZERO_SCALE_EPS, s8)

    @triton.jit
    def _sq_error(x_even, x_odd, step):
        """Per group: the squared error of its values quantized with step (scale / global)."""
        de = e2m1_decode(_e2m1_codes(tl.math.div_rn(x_even, step))) * step - x_even
        do = e2m1_decode(_e2m1_codes(tl.math.div_rn(x_odd, step))) * step - x_odd
        return tl.sum(de * de, axis=1) + tl.sum(do * do, axis=1)

    @triton.jit(do_not_specialize=["four_over_six"])  # a branch, not a second kernel
    def _nvfp4_write_kernel(
        x_ptr, rows_ptr, data_ptr, gs_ptr, g_ptr, four_over_six,
        stride_xn, stride_xh, stride_xd,
        GROUPS: tl.constexpr, BLOCK_G: tl.constexpr, NATIVE_FP8: tl.constexpr,
    ):  # fmt: skip
        n = tl.program_id(0)
        h = tl.program_id(1)
        hkv = tl.num_programs(1)
        rg = tl.arange(0, BLOCK_G)
        rj = tl.arange(0, 8)  # byte j of a group holds elements 2j (low nibble) and 2j + 1
        ok = (rg < GROUPS)[:, None] & (rj < 8)[None, :]
        col = rg[:, None] * 16 + 2 * rj[None, :]
        base = x_ptr + n * stride_xn + h * stride_xh
        x_even = tl.load(base + col * stride_xd, mask=ok, other=0.0).to(tl.float32)
        x_odd = tl.load(base + (col + 1) * stride_xd, mask=ok, other=0.0).to(tl.float32)
        g = tl.load(g_ptr)
        amax = tl.maximum(tl.max(tl.abs(x_even), axis=1), tl.max(tl.abs(x_odd), axis=1))
        unrounded = tl.math.div_rn(amax, FP4_MAX) * g  # amax / 6 first, then * global, as the codec
        scale = _fp8_scale(unrounded, NATIVE_FP8)
        if four_over_six:
            scale4 = _fp8_scale(1.5 * unrounded, NATIVE_FP8)
            m4 = _sq_error(x_even, x_odd, tl.math.div_rn(scale4, g)[:, None]) < _sq_error(
                x_even, x_odd, tl.math.div_rn(scale, g)[:, None])
            scale = tl.where(m4, scale4, scale)
        step = tl.math.div_rn(scale, g)[:, None]
        byte = _e2m1_codes(tl.math.div_rn(x_even, step)) | (_e2m1_codes(tl.math.div_rn(x_odd, step)) << 4)
        dest = tl.load(rows_ptr + n).to(tl.int64) * hkv + h
        tl.store(data_ptr + dest * (GROUPS * 8) + rg[:, None] * 8 + rj[None, :], byte, mask=ok)
        tl.store(gs_ptr + dest * GROUPS + rg, _e4m3_bits(scale), mask=rg < GROUPS)


def _check(x: torch.Tensor, rows: torch.Tensor, data: torch.Tensor, width: int, name: str) -> tuple[int, int, int]:
    if x.ndim != 3 or rows.shape != (x.shape[0],):
        raise ValueError(f"expected x [N, Hkv, D] and rows [N], got x {tuple(x.shape)}, rows {tuple(rows.shape)}")
    n, hkv, d = x.shape
    if data.ndim != 4 or data.shape[2:] != (hkv, width) or data.dtype.itemsize != 1 or not data.is_contiguous():
        raise ValueError(f"{name} pages must be contiguous bytes [pages, page_size, {hkv}, {width}], got "
                         f"{tuple(data.shape)} {data.dtype}")
    return n, hkv, d


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def fp8_write_triton(x, rows, data, row_scale=None, head_scale=None) -> None:
    """x [N, Hkv, D] into FP8 pages `data` at pool rows `rows`; exactly one of `row_scale`
    (written, [pages, page_size, Hkv] fp32) and `head_scale` (read, [Hkv] fp32)."""
    n, hkv, d = _check(x, rows, data, x.shape[-1], "fp8")
    if (row_scale is None) == (head_scale is None):
        raise ValueError("fp8 pages take exactly one of row_scale (computed on write) and head_scale (calibrated)")
    if row_scale is not None and (row_scale.shape != data.shape[:3] or row_scale.dtype != torch.float32
                                  or not row_scale.is_contiguous()):
        raise ValueError(f"row_scale must be contiguous fp32 {tuple(data.shape[:3])}, got {tuple(row_scale.shape)}")
    if n == 0:
        return
    data = _bytes(data)  # the interpreter and GPUs before sm_89 have no FP8 type
    rs = data if row_scale is None else row_scale  # never read
    hs = data if head_scale is None else head_scale
    _fp8_write_kernel[(n, hkv)](
        x, rows, data, rs, hs, x.stride(0), x.stride(1), x.stride(2),
        HEAD_DIM=d, BLOCK_D=triton.next_power_of_2(d), ROW_SCALE=row_scale is not None,
    )  # fmt: skip


def nvfp4_write_triton(x, rows, data, group_scale, global_scale, four_over_six: bool = False) -> None:
    """x [N, Hkv, D] into NVFP4 pages: codes `data` [pages, page_size, Hkv, D/2] uint8, group
    scales `group_scale` [pages, page_size, Hkv, D/16] FP8, under `global_scale` [1] fp32."""
    if x.ndim == 3 and x.shape[-1] % GROUP_SIZE:
        raise ValueError(f"NVFP4 K/V needs head_dim divisible by {GROUP_SIZE}, got {x.shape[-1]}")
    n, hkv, d = _check(x, rows, data, x.shape[-1] // 2, "nvfp4")
    groups = d // GROUP_SIZE
    if group_scale.shape != (*data.shape[:3], groups) or group_scale.dtype.itemsize != 1 or not group_scale.is_contiguous():
        raise ValueError(f"group_scale must be contiguous FP8 {(*data.shape[:3], groups)}, got {tuple(group_scale.shape)}")
    if n == 0:
        return
    _nvfp4_write_kernel[(n, hkv)](
        x, rows, data, _bytes(group_scale), global_scale.float(), int(four_over_six), x.stride(0), x.stride(1), x.stride(2),
        GROUPS=groups, BLOCK_G=triton.next_power_of_2(groups), NATIVE_FP8=target.native_fp8(x.device),
    )  # fmt: skip
