"""One sparse layer's K or V pages in its format, and decode attention over them.

`KVPages` holds `data` [pages, page_size, H, D or D/2] and, where the format keeps one per
row, `scale` [pages, page_size, H(, D/16)]. Dense pages in the compute dtype take the exact
paths the engine had before formats existed. On CUDA, writes quantize with the Triton kernels
of kernels/kv_quant.py and decode attention reads FP8 / NVFP4 pages with the Triton kernel of
kernels/paged_attention.py, dequantizing in registers; elsewhere (CPU) writes quantize with the
codec's torch code and decode attention dequantizes the batch's pages into the compute dtype
before the dense torch reference. Both store the same bits (tests/kernels/test_kv_kernels.py).
"""
from __future__ import annotations

import torch

from kernels import kv_quant, target
from kernels.paged_attention import (
    PagedKV,
    paged_decode_attention,
    paged_decode_attention_pages_triton,
    paged_decode_attention_reference,
)
from sala.kv.formats import FP8, NVFP4, KVCodec


class KVPages:
    def __init__(self, codec: KVCodec, num_pages: int, page_size: int, n_kv: int, head_dim: int, device):
        self.codec, self.n_kv, self.head_dim = codec, n_kv, head_dim
        self.data = torch.zeros(num_pages, page_size, *codec.data_shape(n_kv, head_dim), dtype=codec.data_dtype(),
                                device=device)
        shape = codec.scale_shape(n_kv, head_dim)
        self.scale = None if shape is None else torch.ones(num_pages, page_size, *shape, dtype=codec.scale_dtype(),
                                                           device=device)
        # Per-layer constants on the pool's device, once.
        if isinstance(codec, FP8) and codec.head_scale is not None:
            codec.head_scale = codec.head_scale.to(device)
        if isinstance(codec, NVFP4):
            codec.global_scale = codec.global_scale.to(device)

    @staticmethod
    def _rows(t: torch.Tensor) -> torch.Tensor:
        return t.view(-1, *t.shape[2:])

    def write(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        """x [N, H, D] into pool rows (page * page_size + offset) `rows` [N]."""
        if target.on_gpu(self.data) and self.codec.dense_dtype is None:
            return self.write_triton(rows, x)
        data, scale = self.codec.encode(x)
        _copy_rows(self._rows(self.data), rows, data)
        if scale is not None:
            _copy_rows(self._rows(self.scale), rows, scale)

    def write_triton(self, rows: torch.Tensor, x: torch.Tensor) -> None:
        """`write` by the Triton kernels (any device Triton runs on; the interpreter on CPU)."""
        c = self.codec
        if isinstance(c, FP8):
            kv_quant.fp8_write_triton(x, rows, self.data, self.scale, c.head_scale)
        elif isinstance(c, NVFP4):
            kv_quant.nvfp4_write_triton(x, rows, self.data, self.scale, c.global_scale, c.scale_rule == "4over6")
        else:
            raise ValueError(f"no Triton write for {c.name} pages")

    def kernel_view(self) -> PagedKV:
        """The pages as the Triton decode kernel reads them."""
        c = self.codec
        if isinstance(c, FP8):
            return PagedKV(self.data, "fp8", self.scale, c.head_scale)
        if isinstance(c, NVFP4):
            return PagedKV(self.data, "nvfp4", self.scale, c.global_scale)
        return PagedKV(self.data)

    def read(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[N, H, D] dequantized values of pool rows `rows`."""
        scale = None if self.scale is None else _select(self._rows(self.scale), rows)
        return self.codec.decode(_select(self._rows(self.data), rows), scale, dtype)

    def gather_pages(self, pages: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """[len(pages), page_size, H, D] dequantized."""
        scale = None if self.scale is None else _select(self.scale, pages)
        return self.codec.decode(_select(self.data, pages), scale, dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return self.codec.decode(self.data, self.scale, dtype)


def _copy_rows(dst: torch.Tensor, rows: torch.Tensor, src: torch.Tensor) -> None:
    # FP8 tensors go through their bytes: CPU index_copy_ / index_select lack float8 kernels.
    if dst.dtype.itemsize == 1:
        dst, src = dst.view(torch.uint8), src.view(torch.uint8)
    dst.index_copy_(0, rows, src.to(dst.dtype))


def _select(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if src.dtype.itemsize == 1:
        return src.view(torch.uint8).index_select(0, index).view(src.dtype)
    return src.index_select(0, index)


def decode_attention(q, k: KVPages, v: KVPages, block_tables, context_lens, scale: float) -> torch.Tensor:
    """`paged_decode_attention` over pages in any format: q [B, Hq, D] -> [B, Hq, D]."""
    if k.codec.lossless_for(q.dtype) and v.codec.lossless_for(q.dtype):
        return paged_decode_attention(q, k.data, v.data, block_tables, context_lens, scale)
    if target.on_gpu(q) and all(p.codec.dense_dtype in (None, q.dtype) for p in (k, v)):
        return paged_decode_attention_pages_triton(q, k.kernel_view(), v.kernel_view(), block_tables, context_lens, scale)
    return decode_attention_reference(q, k, v, block_tables, context_lens, scale)


def decode_attention_reference(q, k: KVPages, v: KVPages, block_tables, context_lens, scale: float) -> torch.Tensor:
    """Dequantize the batch's pages into q's dtype, then the dense reference over them."""
    b = block_tables.shape[0]
    pages = block_tables.reshape(-1).long()
    kd, vd = k.gather_pages(pages, q.dtype), v.gather_pages(pages, q.dtype)
    tables = torch.arange(pages.numel(), device=q.device).view(b, -1)
    return paged_decode_attention_reference(q, kd, vd, tables, context_lens, scale)
