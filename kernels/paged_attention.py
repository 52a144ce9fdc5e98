"""Decode attention over a paged K/V pool: one query token per sequence, GQA.

K/V live in pages of ``page_size`` tokens, ``[num_pages, page_size, Hkv, D]``; a sequence's
block table row lists its pages in order, so token t sits at page ``block_tables[b, t //
page_size]``, row ``t % page_size``. Only keys 0..context_len-1 count.

The Triton kernel (flash decoding) runs one program per (sequence, kv head, context split):

- per kv head, not per query head, because all Hq/Hkv query heads of a group read the same
  K/V: one program loads each K/V tile once for the whole group (16 query heads per kv head
  in the 9B model) instead of once per query head, and the group's queries form the rows of a
  ``tl.dot`` tile (padded to 16, the least tl.dot takes) rather than 16 separate GEMVs;
- split over the context because B * Hkv programs alone is 2 at batch 1 in the 9B model, for
  132 SMs: each program covers ``split_len`` tokens with an fp32 online softmax and writes its
  unnormalised output, running max and sum; a second kernel merges the splits of each query
  head in split order. The split length is a fixed number of tokens, not a function of the
  batch, so a sequence's result does not depend on what else is in the batch
  (docs/design/batch-invariance.md). A context of one split goes through the merge too.

Quantized pages (sala/kv formats) go through the same kernel, dequantized in registers: FP8
E4M3 bytes, or NVFP4 (two E2M1 codes a byte, one FP8 scale per 16 elements of head_dim). A
tile's values are exact in the compute dtype (an FP8 value, or E2M1 x an FP8 group scale: at
most 6 significant bits), so the tensor-core dots see the stored K/V unrounded; the scales that
remain are applied to the scores and the output instead of to every element: a per-key FP8
scale (computed on write) multiplies the key's score (K) or its softmax weight (V), and a
per-head FP8 scale or an NVFP4 global scale multiplies all of the program's scores (K) or its
output (V). Reading 1 or 0.5625 bytes an element instead of 2 is what the formats are for:
decode attention is bound by reading K/V.

The grid is sized from shapes only (block_tables' width), never from context_lens' values, so
the call is CUDA-graph capturable; programs whose split starts past their sequence's context do
nothing, and the loop inside a program stops at the context, so a block table far wider than
the contexts costs only empty programs.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels import target

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU installs may lack triton; the torch reference still works
    triton = None

# How a side (K or V) of the pool is stored, as the kernel's K_FMT / V_FMT see it.
DENSE, FP8_HEAD, FP8_ROW, NVFP4 = 0, 1, 2, 3
BLOCK_N = 64  # keys per loop iteration: a [64, 128] bf16 K tile is 16 KiB
SPLIT_LEN = 256  # tokens per program: 128 KiB of K+V per kv head at D = 128, vs 8 KiB of partials (16 heads)


def _check(q, k_cache, v_cache, block_tables, context_lens) -> tuple[int, int, int, int, int]:
    if q.ndim != 3 or k_cache.ndim != 4 or v_cache.shape != k_cache.shape:
        raise ValueError(f"expected q [B, Hq, D] and k/v caches [pages, page_size, Hkv, D], got q {tuple(q.shape)}, "
                         f"k {tuple(k_cache.shape)}, v {tuple(v_cache.shape)}")
    b, hq, d = q.shape
    _, page_size, hkv, dk = k_cache.shape
    if dk != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit caches {tuple(k_cache.shape)}: head dims must match "
                         "and Hq must be a multiple of Hkv")
    if block_tables.ndim != 2 or block_tables.shape[0] != b or context_lens.shape != (b,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
                         f"must be [B, max_pages] and [B] for B = {b}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"q is {q.dtype} but the caches are {k_cache.dtype} / {v_cache.dtype}")
    return b, hq, d, page_size, hkv


@dataclass
class PagedKV:
    """One side (K or V) of a paged pool in any of the formats sala/kv stores:

    - "dense": `data` [pages, page_size, Hkv, D] in q's dtype;
    - "fp8": `data` float8_e4m3fn (or its uint8 bytes) [pages, page_size, Hkv, D], value =
      data * scale with `row_scale` fp32 [pages, page_size, Hkv] (one per token and head,
      computed on write) or `head_scale` fp32 [Hkv] (calibrated);
    - "nvfp4": `data` uint8 [pages, page_size, Hkv, D/2] (low nibble = even element),
      `row_scale` float8_e4m3fn [pages, page_size, Hkv, D/16] group scales and `head_scale`
      fp32 [1] the global scale in the encode direction: value = E2M1[code] * scale / global.
    """

    data: torch.Tensor
    fmt: str = "dense"
    row_scale: torch.Tensor | None = None
    head_scale: torch.Tensor | None = None

    def code(self) -> int:
        if self.fmt == "dense":
            return DENSE
        if self.fmt == "fp8":
            if (self.row_scale is None) == (self.head_scale is None):
                raise ValueError("fp8 pages need exactly one of row_scale (per token) and head_scale (per head)")
            return FP8_ROW if self.row_scale is not None else FP8_HEAD
        if self.fmt == "nvfp4":
            if self.row_scale is None or self.head_scale is None:
                raise ValueError("nvfp4 pages need row_scale (group scales) and head_scale (the global scale)")
            return NVFP4
        raise ValueError(f"unknown page format {self.fmt!r}; expected dense, fp8 or nvfp4")


def paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    """The torch reference: gather each sequence's pages into [B, max_pages * page_size, Hkv, D],
    mask keys at or past its context length, and attend in fp32 (cast back to q's dtype at the
    end, so bf16 results are as accurate as bf16 can hold). Shapes are static and there is no
    host sync, so it compiles (the engine's CPU decode step runs it under torch.compile)."""
    b, hq, d, _, hkv = _check(q, k_cache, v_cache, block_tables, context_lens)
    pages = block_tables.reshape(-1).long()
    # index_select, not advanced indexing, which is much slower on CPU.
    k = k_cache.index_select(0, pages).view(b, -1, hkv, d)
    v = v_cache.index_select(0, pages).view(b, -1, hkv, d)
    valid = torch.arange(k.shape[1], device=q.device) < context_lens.reshape(b, 1)
    o = F.scaled_dot_product_attention(
        q.float().unsqueeze(2),  # [B, Hq, 1, D]
        k.float().transpose(1, 2),  # [B, Hkv, L, D]
        v.float().transpose(1, 2),
        attn_mask=valid[:, None, None, :],
        scale=scale,
        enable_gqa=True,  # query head h reads kv head h // (Hq // Hkv)
    )
    return o.squeeze(2).to(q.dtype)


if triton is not None:
    from kernels.nvfp4_gemm import e2m1_decode, e4m3_to_float
    from kernels.target import FP32_DOT

    @triton.jit
    def _load_tile(rows, srow, t_ok, s_ptr, stride_d, FMT: tl.constexpr, HEAD_DIM: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, NATIVE_FP8: tl.constexpr):
        """[BLOCK_N, BLOCK_D] values of the keys whose rows start at the pointers `rows` (pool
        row srow, the index of its scales; t_ok the keys to read) with the per-key and per-head
        scales left out, exact in fp32. Dense tiles come back as stored."""
        if FMT == 3:
            # NVFP4: each byte read once, its nibbles interleaved into elements 2j (low) and 2j + 1
            # (high), each FP8 group scale read once and spread over its 16 elements.
            rj = tl.arange(0, BLOCK_D // 2)
            byte = tl.load(rows[:, None] + rj[None, :] * stride_d, mask=t_ok[:, None] & (rj < HEAD_DIM // 2)[None, :],
                           other=0)
            code = tl.reshape(tl.join(byte & 0xF, byte >> 4), (BLOCK_N, BLOCK_D))
            rg = tl.arange(0, BLOCK_D // 16)
            gs = tl.load((s_ptr + srow * (HEAD_DIM // 16))[:, None] + rg[None, :],
                         mask=t_ok[:, None] & (rg < HEAD_DIM // 16)[None, :], other=0)
            scale = tl.broadcast_to(e4m3_to_float(gs, NATIVE_FP8)[:, :, None], (BLOCK_N, BLOCK_D // 16, 16))
            return e2m1_decode(code) * tl.reshape(scale, (BLOCK_N, BLOCK_D))
        else:
            rd = tl.arange(0, BLOCK_D)
            x = tl.load(rows[:, None] + rd[None, :] * stride_d, mask=t_ok[:, None] & (rd < HEAD_DIM)[None, :], other=0)
            if FMT != 0:  # FP8 bytes
                x = e4m3_to_float(x, NATIVE_FP8)
            return x

    # Strides that follow the batch's page-table width and split count are not specialised on
    # (a one-page table, one split, an odd head count): one kernel serves every step.
    @triton.jit(do_not_specialize=["stride_btb", "stride_mb", "stride_mh"])
    def _paged_decode_kernel(
        q_ptr, k_ptr, v_ptr, bt_ptr, len_ptr, o_ptr, m_ptr, l_ptr,
        ks_ptr, kf_ptr, vs_ptr, vf_ptr,
        scale, split_len,
        stride_qb, stride_qh, stride_qd,
        stride_kp, stride_kt, stride_kh, stride_kd,
        stride_vp, stride_vt, stride_vh, stride_vd,
        stride_btb, stride_btp,
        stride_ob, stride_oh, stride_os, stride_od,
        stride_mb, stride_mh,
        GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
        DOT_FP32: tl.constexpr, UPCAST: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr,
        NATIVE_FP8: tl.constexpr,
    ):  # fmt: skip
        """Program (b, kv head, split): the GROUP query heads of that kv head over tokens
        [split * split_len, min(context, (split + 1) * split_len)): stores the unnormalised
        output at o_ptr + split * stride_os and the running max / sum at m_ptr / l_ptr, which
        _merge_splits_kernel turns into the output (one split included). K_FMT / V_FMT: DENSE,
        FP8_HEAD, FP8_ROW or NVFP4 (PagedKV); ks/vs_ptr the per-row scales (FP8_ROW: fp32 a
        row, NVFP4: FP8 group scales, both as contiguous [pool rows * Hkv(, D/16)]) and
        kf/vf_ptr the per-head FP8 scales [Hkv] or the NVFP4 global scale [1]."""
        b = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(len_ptr + b)
        start = split * split_len
        end = tl.minimum(ctx, start + split_len)
        rh = tl.arange(0, BLOCK_H)
        h_ok = rh < GROUP
        heads = kvh * GROUP + rh
        rd = tl.arange(0, BLOCK_D)
        d_ok = rd < HEAD_DIM
        q = tl.load(
            q_ptr + b * stride_qb + heads[:, None] * stride_qh + rd[None, :] * stride_qd,
            mask=h_ok[:, None] & d_ok[None, :],
            other=0.0,
        )
        if UPCAST:
            q = q.to(tl.float32)
        # Scalar K scales fold into the score scale (scalar V scales into the output, below).
        if K_FMT == 1:
            scale = scale * tl.load(kf_ptr + kvh)
        elif K_FMT == 3:
            scale = scale / tl.load(kf_ptr)
        hkv = tl.num_programs(1)
        m_i = tl.full((BLOCK_H,), float("-inf"), dtype=tl.float32)
        l_i = tl.zeros((BLOCK_H,), dtype=tl.float32)
        acc = tl.zeros((BLOCK_H, BLOCK_D), dtype=tl.float32)
        for t0 in range(start, end, BLOCK_N):
            t = t0 + tl.arange(0, BLOCK_N)
            t_ok = t < end
            # 64-bit offsets of each key's row, one per key: pools of any size, and the [BLOCK_N,
            # BLOCK_D] tiles add only 32-bit column offsets to these row pointers.
            page = tl.load(bt_ptr + b * stride_btb + (t // PAGE_SIZE) * stride_btp, mask=t_ok, other=0).to(tl.int64)
            row = t % PAGE_SIZE
            srow = (page * PAGE_SIZE + row) * hkv + kvh  # the row's index in per-row scale tensors
            k = _load_tile(k_ptr + (page * stride_kp + row * stride_kt + kvh * stride_kh), srow, t_ok, ks_ptr, stride_kd,
                           K_FMT, HEAD_DIM, BLOCK_N, BLOCK_D, NATIVE_FP8)
            # V's load is issued before the QK dot so both tiles are in flight at once.
            v = _load_tile(v_ptr + (page * stride_vp + row * stride_vt + kvh * stride_vh), srow, t_ok, vs_ptr, stride_vd,
                           V_FMT, HEAD_DIM, BLOCK_N, BLOCK_D, NATIVE_FP8)
            if UPCAST:
                k = k.to(tl.float32)
            elif K_FMT != 0:
                k = k.to(q.dtype)  # exact: see the module docstring
            if DOT_FP32:
                s = tl.dot(q, tl.trans(k), input_precision=FP32_DOT)
            else:
                s = tl.dot(q, tl.trans(k))
            if K_FMT == 2:
                s = s * tl.load(ks_ptr + srow, mask=t_ok, other=1.0)[None, :]
            s = tl.where(t_ok[None, :], s * scale, float("-inf"))
            # Every block holds at least one valid key (t0 < end), so m_new is finite and no
            # exp(-inf - -inf) arises; the first block's alpha is exp(-inf) = 0.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if V_FMT == 2:  # a per-key V scale weighs the key's softmax weight
                p = p * tl.load(vs_ptr + srow, mask=t_ok, other=0.0)[None, :]
            if UPCAST:
                # The GPU rounds p to the compute dtype for the tensor-core dot; keep that rounding.
                p = p.to(q_ptr.dtype.element_ty).to(tl.float32)
                v = v.to(tl.float32)
            elif V_FMT != 0:
                v = v.to(q.dtype)
            if DOT_FP32:
                pv = tl.dot(p, v, input_precision=FP32_DOT)
            else:
                pv = tl.dot(p.to(v.dtype), v)
            acc = acc * alpha[:, None] + pv
            m_i = m_new
        # The merge is linear in acc, so partials may carry the scalar V scale too.
        if V_FMT == 1:
            acc = acc * tl.load(vf_ptr + kvh)
        elif V_FMT == 3:
            acc = acc / tl.load(vf_ptr)
        out = o_ptr + b * stride_ob + heads[:, None] * stride_oh + rd[None, :] * stride_od
        # Splits starting past the context store nothing: the merge never reads them. (A
        # per-head vector, not a scalar: the interpreter rejects a scalar bool & a block.)
        live = h_ok & (start + rh * 0 < ctx)
        tl.store(out + split * stride_os, acc, mask=live[:, None] & d_ok[None, :])
        ml = b * stride_mb + heads * stride_mh + split
        tl.store(m_ptr + ml, m_i, mask=live)
        tl.store(l_ptr + ml, l_i, mask=live)

    @triton.jit(do_not_specialize=["stride_mb", "stride_mh"])
    def _merge_splits_kernel(
        acc_ptr, m_ptr, l_ptr, len_ptr, o_ptr, split_len,
        stride_ab, stride_ah, stride_as, stride_mb, stride_mh, stride_ob, stride_oh, stride_od,
        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        """Program (b, query head): o = sum_s e^(m_s - M) acc_s / sum_s e^(m_s - M) l_s over the
        splits that hold keys, merged in split order."""
        b = tl.program_id(0)
        h = tl.program_id(1)
        rd = tl.arange(0, BLOCK_D)
        d_ok = rd < HEAD_DIM
        live = (tl.load(len_ptr + b) + split_len - 1) // split_len
        ml = m_ptr + b * stride_mb + h * stride_mh
        ll = l_ptr + b * stride_mb + h * stride_mh
        aa = acc_ptr + b * stride_ab + h * stride_ah + rd
        # Split 0 always holds a key (context >= 1): start from it, so every m is finite.
        m_run = tl.load(ml)
        l_run = tl.load(ll)
        acc = tl.load(aa, mask=d_ok, other=0.0)
        for s in range(1, live):
            m_s = tl.load(ml + s)
            m_new = tl.maximum(m_run, m_s)
            c_run = tl.exp(m_run - m_new)
            c_s = tl.exp(m_s - m_new)
            acc = acc * c_run + tl.load(aa + s * stride_as, mask=d_ok, other=0.0) * c_s
            l_run = l_run * c_run + tl.load(ll + s) * c_s
            m_run = m_new
        tl.store(o_ptr + b * stride_ob + h * stride_oh + rd * stride_od, (acc / l_run).to(o_ptr.dtype.element_ty), mask=d_ok)


def paged_decode_attention_triton(
    q, k_cache, v_cache, block_tables, context_lens, scale: float, *, split_len: int = SPLIT_LEN
) -> torch.Tensor:
    """The Triton flash-decoding kernel; same contract as ``paged_decode_attention``.
    ``split_len``: tokens per program (tests and benchmarks vary it; results depend on it only
    through summation order)."""
    _check(q, k_cache, v_cache, block_tables, context_lens)
    return paged_decode_attention_pages_triton(q, PagedKV(k_cache), PagedKV(v_cache), block_tables, context_lens,
                                               scale, split_len=split_len)


def _check_pages(q, k: PagedKV, v: PagedKV, block_tables, context_lens) -> tuple[int, int, int, int, int]:
    b, hq, d = q.shape
    for side, pk in (("k", k), ("v", v)):
        code = pk.code()
        width = d // 2 if code == NVFP4 else d
        if pk.data.ndim != 4 or pk.data.shape[3] != width or pk.data.shape[:3] != k.data.shape[:3]:
            raise ValueError(f"{side} pages {tuple(pk.data.shape)} ({pk.fmt}) do not fit q {tuple(q.shape)} and "
                             f"k pages {tuple(k.data.shape)}: expected [pages, page_size, Hkv, {width}]")
        if code == DENSE and pk.data.dtype != q.dtype:
            raise ValueError(f"q is {q.dtype} but the dense {side} pages are {pk.data.dtype}")
        if code != DENSE and pk.data.dtype.itemsize != 1:
            raise ValueError(f"{pk.fmt} {side} pages hold bytes, got {pk.data.dtype}")
        if code == NVFP4 and d % 16:
            raise ValueError(f"nvfp4 pages need head_dim divisible by 16, got {d}")
        if pk.row_scale is not None and not pk.row_scale.is_contiguous():
            raise ValueError(f"{side} row scales must be contiguous")
    _, page_size, hkv, _ = k.data.shape
    if hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} does not fit pages {tuple(k.data.shape)}: Hq must be a multiple of Hkv")
    if block_tables.ndim != 2 or block_tables.shape[0] != b or context_lens.shape != (b,):
        raise ValueError(f"block_tables {tuple(block_tables.shape)} and context_lens {tuple(context_lens.shape)} "
                         f"must be [B, max_pages] and [B] for B = {b}")
    return b, hq, d, page_size, hkv


def _kernel_view(pk: PagedKV, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(data, row scales, head scales) as the kernel takes them: bytes for FP8 (the interpreter
    and older GPUs read the bits), `like` standing in for an absent pointer."""
    data = pk.data.view(torch.uint8) if pk.code() != DENSE else pk.data
    rows = like if pk.row_scale is None else pk.row_scale
    if rows.dtype == torch.float8_e4m3fn:
        rows = rows.view(torch.uint8)
    heads = like if pk.head_scale is None else pk.head_scale.float()
    return data, rows, heads


def paged_decode_attention_pages_triton(
    q, k: PagedKV, v: PagedKV, block_tables, context_lens, scale: float, *, split_len: int = SPLIT_LEN
) -> torch.Tensor:
    """The Triton flash-decoding kernel over pages in any format (PagedKV), dequantized in
    registers; otherwise the contract of ``paged_decode_attention``."""
    b, hq, d, page_size, hkv = _check_pages(q, k, v, block_tables, context_lens)
    if split_len < 1:
        raise ValueError(f"split_len must be positive, got {split_len}")
    group = hq // hkv
    o = torch.empty(b, hq, d, dtype=q.dtype, device=q.device)
    splits = triton.cdiv(block_tables.shape[1] * page_size, split_len)
    k_data, k_rows, k_heads = _kernel_view(k, o)
    v_data, v_rows, v_heads = _kernel_view(v, o)
    # fp32 caches get fp32 dots (target.FP32_DOT). Under the interpreter bf16 and fp16 operands
    # are widened to fp32 first (target.INTERPRETED): q and K exactly, p after rounding to the
    # cache dtype as the GPU does, summed in fp32 as the tensor cores do.
    upcast = q.dtype != torch.float32 and target.INTERPRETED
    meta = dict(
        GROUP=group, HEAD_DIM=d, PAGE_SIZE=page_size,
        BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_D=max(16, triton.next_power_of_2(d)), BLOCK_N=BLOCK_N,
        DOT_FP32=q.dtype == torch.float32 or upcast, UPCAST=upcast, K_FMT=k.code(), V_FMT=v.code(),
        NATIVE_FP8=target.native_fp8(q.device),
        # 4 warps unless that spills: fp32 tiles take 8 (the compile check,
        # sala/compile_check.py, holds every format to no spills on every target).
        num_warps=8 if q.dtype == torch.float32 else 4,
    )  # fmt: skip
    # Sized from shapes only (no host sync), so the call stays CUDA-graph capturable. One split
    # goes through the merge too: one kernel to build, and the merge of one split is its
    # normalised output (acc / l in fp32), a small kernel's launch.
    acc = torch.empty(b, hq, splits, d, dtype=torch.float32, device=q.device)
    m = torch.empty(b, hq, splits, dtype=torch.float32, device=q.device)
    l_ = torch.empty_like(m)
    _paged_decode_kernel[(b, hkv, splits)](
        q, k_data, v_data, block_tables, context_lens, acc, m, l_, k_rows, k_heads, v_rows, v_heads, scale, split_len,
        q.stride(0), q.stride(1), q.stride(2), *k_data.stride(), *v_data.stride(), block_tables.stride(0),
        block_tables.stride(1), acc.stride(0), acc.stride(1), acc.stride(2), acc.stride(3), m.stride(0), m.stride(1),
        **meta,
    )  # fmt: skip
    _merge_splits_kernel[(b, hq)](
        acc, m, l_, context_lens, o, split_len,
        acc.stride(0), acc.stride(1), acc.stride(2), m.stride(0), m.stride(1), o.stride(0), o.stride(1), o.stride(2),
        HEAD_DIM=d, BLOCK_D=meta["BLOCK_D"],
    )  # fmt: skip
    return o


def paged_decode_attention(q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
    """q: [B, Hq, D] (fp32, bf16 or fp16); k_cache, v_cache: [num_pages, page_size, Hkv, D] (same dtype as q);
    block_tables: [B, max_pages] int32 or int64 (entry j = page holding tokens j*page_size .. (j+1)*page_size-1;
    entries past a sequence's last page are arbitrary valid page ids, e.g. 0);
    context_lens: [B] int32/int64, >= 1: keys 0..len-1 are valid.
    Hq is a multiple of Hkv (query head h reads kv head h // (Hq // Hkv)).
    Returns o [B, Hq, D] in q's dtype, softmax(q k^T * scale) v over each sequence's valid keys, fp32 accumulation.

    Triton kernel on CUDA, torch reference elsewhere."""
    if target.on_gpu(q):
        return paged_decode_attention_triton(q, k_cache, v_cache, block_tables, context_lens, scale)
    return paged_decode_attention_reference(q, k_cache, v_cache, block_tables, context_lens, scale)
