"""The model's W4A16 Linear: NVFP4 weights stored as compressed-tensors names them."""
from __future__ import annotations

import torch
from torch import nn

from kernels.nvfp4_gemm import nvfp4_linear
from sala.quant.nvfp4 import GROUP_SIZE, NVFP4Tensor

QUANTIZED_BUFFERS = ("weight_packed", "weight_scale", "weight_global_scale")


class NVFP4Linear(nn.Module):
    """y = x @ W^T (+ bias) with W held as ``weight_packed`` uint8 [N, K/2], ``weight_scale``
    float8_e4m3fn [N, K/16] and ``weight_global_scale`` float32 [1], so a checkpoint's
    tensors load straight into it. These are all it holds, on every device: the CUDA kernel
    reads them packed, and on CPU each call dequantizes one tile of rows at a time
    (kernels/nvfp4_gemm.py).
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = False,
        *,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if in_features % GROUP_SIZE:
            raise ValueError(
                f"in-features {in_features} is not a multiple of the NVFP4 group size {GROUP_SIZE}"
            )
        self.in_features = in_features
        self.out_features = out_features
        self.register_buffer(
            "weight_packed",
            torch.zeros(out_features, in_features // 2, dtype=torch.uint8, device=device),
        )
        self.register_buffer(
            "weight_scale",
            torch.zeros(out_features, in_features // GROUP_SIZE, device=device).to(
                torch.float8_e4m3fn
            ),
        )
        self.register_buffer("weight_global_scale", torch.ones(1, device=device))
        self.register_buffer(
            "bias", torch.zeros(out_features, device=device) if bias else None
        )

    @classmethod
    def from_quantized(cls, q: NVFP4Tensor, bias: torch.Tensor | None = None) -> NVFP4Linear:
        out_features, in_features = q.codes.shape
        layer = cls(in_features, out_features, bias is not None, device=q.codes.device)
        layer.weight_packed.copy_(q.packed())
        layer.weight_scale.copy_(q.scale)
        layer.weight_global_scale.copy_(q.global_scale)
        if bias is not None:
            layer.bias.copy_(bias)
        return layer

    @classmethod
    def concat(cls, parts: list[NVFP4Linear]) -> NVFP4Linear:
        """One Linear whose outputs are the parts' side by side (fused projections). Parts that
        share a global scale keep one; otherwise the fused layer has one per output row."""
        first = parts[0]
        fused = cls(first.in_features, sum(p.out_features for p in parts), first.bias is not None,
                    device="meta")  # every tensor is replaced below: allocate none
        fused.weight_packed = torch.cat([p.weight_packed for p in parts])
        fused.weight_scale = torch.cat([p.weight_scale for p in parts])
        scales = [p.weight_global_scale.reshape(-1) for p in parts]
        # On the meta device (what a footprint estimate fuses) the values are unknown: one per row,
        # the larger of the two.
        if not first.weight_packed.is_meta and all(torch.equal(s, scales[0]) and s.numel() == 1 for s in scales):
            fused.weight_global_scale = scales[0].clone()
        else:
            fused.weight_global_scale = torch.cat([s.expand(p.out_features) for s, p in zip(scales, parts)])
        if first.bias is not None:
            fused.bias = torch.cat([p.bias for p in parts])
        return fused

    def _apply(self, fn, recurse=True):
        # model.to(torch.bfloat16) must not round the fp32 global scale or re-type the FP8
        # scales: the quantized tensors follow the module's device, never its dtype.
        kept = {name: self._buffers[name] for name in QUANTIZED_BUFFERS}
        super()._apply(fn, recurse)
        for name, tensor in kept.items():
            self._buffers[name] = tensor.to(self._buffers[name].device)
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nvfp4_linear(
            x, self.weight_packed, self.weight_scale, self.weight_global_scale, self.bias
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"bias={self.bias is not None}"
        )
