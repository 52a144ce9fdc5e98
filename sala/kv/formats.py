"""K/V cache formats: how one sparse layer's K (or V) is held in the pages.

A codec turns K or V rows [..., kv_heads, head_dim] into what a page stores and back:

- dense (bf16; fp32 / fp16 only as the engine's no-plan default): the values themselves;
- fp8: E4M3 with one dequantization scale per kv head, ``k = k_fp8 * k_scale``, as vLLM and
  compressed-tensors define it (docs/design/nvfp4-format.md, K/V in pages). Scales
  come from calibration (``amax / 448`` per head) or, without it, are computed on write: one
  fp32 scale per token and head, stored beside the page row (4 bytes per head_dim values);
- nvfp4: two E2M1 codes a byte, one FP8 scale per 16 elements along head_dim and a per-layer
  fp32 global scale (encode direction, ``S * 6 / amax`` from calibration, 1.0 without it),
  the weight format of sala/quant/nvfp4.py applied to K/V rows; ``nvfp4_4over6`` picks each
  group's scale by FourOverSix (docs/design/nvfp4-format.md), the same physical layout.

Rows are quantized independently (per token, per head), so a token's stored K/V do not depend
on what else is written with it: the engine's pages and a full forward that quantizes its K/V
the same way (`fake`) hold the same values.
"""
from __future__ import annotations

import torch

from sala.quant import nvfp4

FP8_MAX = 448.0
DENSE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


class KVCodec:
    """One layer's K or V format. `encode` gives (data, row_scale or None) for rows
    [..., H, D]; `decode` inverts it into `dtype`."""

    name: str
    dense_dtype: torch.dtype | None = None  # set for formats that store the values themselves

    def data_shape(self, n_kv: int, head_dim: int) -> tuple[int, ...]:
        return (n_kv, head_dim)

    def data_dtype(self) -> torch.dtype:
        raise NotImplementedError

    def scale_shape(self, n_kv: int, head_dim: int) -> tuple[int, ...] | None:
        """Per-row scale storage beside the data, or None."""
        return None

    def scale_dtype(self) -> torch.dtype:
        return torch.float32

    def bytes_per_token(self, n_kv: int, head_dim: int) -> int:
        """Bytes one token's K (or V) takes in one layer, scales included."""
        n = torch.Size(self.data_shape(n_kv, head_dim)).numel() * self.data_dtype().itemsize
        if (s := self.scale_shape(n_kv, head_dim)) is not None:
            n += torch.Size(s).numel() * self.scale_dtype().itemsize
        return n

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        raise NotImplementedError

    def decode(self, data: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def fake(self, x: torch.Tensor) -> torch.Tensor:
        """x as the cache gives it back: encode then decode, in x's dtype."""
        return self.decode(*self.encode(x), x.dtype)

    def lossless_for(self, dtype: torch.dtype) -> bool:
        return self.dense_dtype == dtype


class Dense(KVCodec):
    def __init__(self, name: str):
        self.name, self.dense_dtype = name, DENSE_DTYPES[name]

    def data_dtype(self) -> torch.dtype:
        return self.dense_dtype

    def encode(self, x):
        return x.to(self.dense_dtype), None

    def decode(self, data, scale, dtype):
        return data.to(dtype)


class FP8(KVCodec):
    """E4M3 with a per-head scale ([H] fp32, dequantization direction) or, when `head_scale`
    is None, a per-token-and-head scale computed on write and stored with the row."""

    name = "fp8"

    def __init__(self, head_scale: torch.Tensor | None = None):
        self.head_scale = None if head_scale is None else head_scale.float().reshape(-1)

    def data_dtype(self):
        return torch.float8_e4m3fn

    def scale_shape(self, n_kv, head_dim):
        return None if self.head_scale is not None else (n_kv,)

    def encode(self, x):
        xf = x.float()
        if self.head_scale is None:
            scale = xf.abs().amax(-1) / FP8_MAX
            scale = torch.where(scale > 0, scale, torch.ones_like(scale))
            stored = scale
        else:
            scale, stored = self.head_scale.to(x.device), None
        # Clamp before the cast: torch saturates today, older versions gave NaN on overflow.
        data = (xf / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return data, stored

    def decode(self, data, scale, dtype):
        s = self.head_scale.to(data.device) if scale is None else scale
        return (data.float() * s[..., None]).to(dtype)


class NVFP4(KVCodec):
    """Packed E2M1 [.., H, D/2], FP8 group scales [.., H, D/16], one global scale a layer."""

    def __init__(self, global_scale: torch.Tensor | None = None, scale_rule: str = "6"):
        self.name = "nvfp4" if scale_rule == "6" else "nvfp4_4over6"
        self.scale_rule = scale_rule
        self.global_scale = torch.ones(1) if global_scale is None else global_scale.float().reshape(1)

    def data_shape(self, n_kv, head_dim):
        if head_dim % nvfp4.GROUP_SIZE:
            raise ValueError(f"NVFP4 K/V needs head_dim divisible by {nvfp4.GROUP_SIZE}, got {head_dim}")
        return (n_kv, head_dim // 2)

    def data_dtype(self):
        return torch.uint8

    def scale_shape(self, n_kv, head_dim):
        return (n_kv, head_dim // nvfp4.GROUP_SIZE)

    def scale_dtype(self):
        return torch.float8_e4m3fn

    def encode(self, x):
        codes, scale, _ = nvfp4.quantize_groups(x, self.global_scale.to(x.device), self.scale_rule)
        return nvfp4.pack_fp4(codes), scale

    def decode(self, data, scale, dtype):
        return nvfp4.dequantize(nvfp4.unpack_fp4(data), scale, self.global_scale.to(data.device), dtype)


def make_codec(name: str, amax: list[float] | torch.Tensor | None = None) -> KVCodec:
    """The codec for a plan's format name; `amax` (max |x| per kv head, from calibration)
    fixes FP8 scales and the NVFP4 global scale, otherwise they are computed on write / 1.0."""
    amax = None if amax is None else torch.as_tensor(amax, dtype=torch.float32).reshape(-1)
    if name in DENSE_DTYPES:
        return Dense(name)
    if name == "fp8":
        if amax is None:
            return FP8()
        return FP8(torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)))
    if name in ("nvfp4", "nvfp4_4over6"):
        rule = "6" if name == "nvfp4" else "4over6"
        return NVFP4(None if amax is None else nvfp4.global_scale(amax.max(), rule), rule)
    raise ValueError(f"unknown K/V format {name!r}")
