"""NVFP4 weight format: E2M1 codes in 16-element groups, FP8 E4M3 group scales, FP32 global scale.

Conventions follow compressed-tensors, whose checkpoint format we write:

- the global scale is stored in the *encode* direction, ``global = S * 6 / amax`` (S = 448 for
  standard NVFP4, 256 for FourOverSix), and a weight dequantizes as
  ``w = E2M1[code] * (scale / global)``;
- a group scale is ``fp8(amax_group / 6 * global)``, clamped to 448 before the cast and with
  a zero scale replaced by the FP8 eps 0.125, exactly as ``calculate_qparams`` does;
- an element is rounded as ``RNE_E2M1(w / (scale / global))``. The fp32 operation order
  matters: ties (|x| = 0.25, 0.75, ..., 5.0) are rare but real, and the FourOverSix reference
  computes ``w * (1 / (scale / global))`` instead, which lands differently on ~0.3% of blocks.
  We keep compressed-tensors' order for both scale rules, so our codes are the ones its own
  compressor would produce from our scales.

Codes are kept unpacked (one uint8 per weight, values 0..15, bit 3 = sign) while quantizing;
``pack_fp4`` puts two per byte, low nibble = even column, as in the checkpoint.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

# The E2M1 table, the group size, unpacking and dequantization have one home, beside the GEMM
# kernel that decodes the same bits (sala may import kernels, never the reverse).
from kernels.nvfp4_gemm import CPU_TILE_WEIGHTS, E2M1_VALUES, GROUP_SIZE, decode_e2m1, dequantize_fp4, unpack_fp4  # noqa: F401  (public here too)

FP4_MAX = 6.0
FP8_MAX = 448.0
# compressed-tensors replaces a zero FP8 group scale by this value (``_get_dtype_eps``) so
# that dequantization never divides by zero; codes of such a group are then mostly 0.
FP8_ZERO_SCALE_EPS = 0.125
# FP8 maximum the global scale normalizes to. FourOverSix uses 256 so that the group holding
# the tensor maximum can still take the 1.5x larger "scale to 4" (256 * 1.5 = 384 <= 448).
SCALE_RULES = {"6": 448.0, "4over6": 256.0}
FOUR_OVER_SIX_EXPANSION = 1.5


@dataclass
class NVFP4Tensor:
    """A quantized [N, K] weight: what a checkpoint stores, plus which groups chose M=4."""

    codes: torch.Tensor  # uint8 [N, K], 0..15, unpacked
    scale: torch.Tensor  # float8_e4m3fn [N, K / 16]
    global_scale: torch.Tensor  # float32 [1], encode direction
    m4_mask: torch.Tensor  # bool [N, K / 16], True where FourOverSix scaled the group to 4

    @property
    def m4_share(self) -> float:
        return self.m4_mask.float().mean().item()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.codes, self.scale, self.global_scale, dtype)

    def packed(self) -> torch.Tensor:
        return pack_fp4(self.codes)


def check_weight(w: torch.Tensor) -> None:
    """Reject what NVFP4 cannot represent, before any arithmetic hides it."""
    if w.ndim != 2:
        raise ValueError(f"NVFP4 quantizes 2-D [out, in] weights, got shape {tuple(w.shape)}")
    if w.shape[1] % GROUP_SIZE != 0:
        raise ValueError(
            f"in-features {w.shape[1]} is not a multiple of the NVFP4 group size {GROUP_SIZE}"
        )
    if not torch.isfinite(w).all():
        raise ValueError("weight contains NaN or Inf; NVFP4 cannot represent it")


def _check_scale_rule(scale_rule: str) -> float:
    if scale_rule not in SCALE_RULES:
        raise ValueError(f"unknown scale rule {scale_rule!r}; expected one of {list(SCALE_RULES)}")
    return SCALE_RULES[scale_rule]


def global_scale(amax: torch.Tensor | float, scale_rule: str = "6") -> torch.Tensor:
    """Encode-direction global scale S * 6 / amax as float32 [1] (``generate_gparam``).

    ``amax`` is max |w| over the tensor, or over a fused group (q/k/v, gate/up) whose members
    must share one global scale. A zero amax gives 1.0, as in compressed-tensors.
    """
    fp8_max = _check_scale_rule(scale_rule)
    amax = torch.as_tensor(amax, dtype=torch.float32).reshape(1)
    amax = amax.clamp(min=torch.finfo(torch.float32).tiny)
    # generate_gparam writes ``S * 6 / amax`` with a Python float over a tensor, which torch
    # evaluates as reciprocal-then-multiply; spelled out so the bits stay the same.
    gscale = amax.reciprocal() * (fp8_max * FP4_MAX)
    return torch.nan_to_num(gscale, nan=1.0, posinf=1.0, neginf=1.0)


def to_fp8_scale(s: torch.Tensor) -> torch.Tensor:
    """Round a high-precision group scale to FP8 E4M3 (RNE), saturating and avoiding zero."""
    s8 = s.clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()
    # Selected in fp32 and cast back (exact: both sides are FP8 values), since inductor
    # cannot compile a where over float8 operands (the engine compiles K/V writes).
    return torch.where(s8 == 0, FP8_ZERO_SCALE_EPS, s8).to(torch.float8_e4m3fn)


def round_to_e2m1(x: torch.Tensor) -> torch.Tensor:
    """Codes of the nearest E2M1 values, ties to even, saturating at 6.

    Each comparison adds one step; inclusive bounds are the ties that go up to an even
    mantissa (0.75 -> 1, 1.75 -> 2, 3.5 -> 4), exclusive ones the ties that stay down
    (0.25 -> 0, 1.25 -> 1, 2.5 -> 2, 5 -> 4). The sign bit is ``x < 0`` as in
    compressed-tensors: small negatives become 0x8 (-0), an exact -0.0 input becomes 0x0.
    """
    a = x.abs()
    mag = (
        (a > 0.25).to(torch.uint8)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    )
    return mag | ((x < 0).to(torch.uint8) << 3)


def _encode(w: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Codes of ``w`` on the grid ``step * E2M1``, step = scale / global.

    The one place elements are rounded: RTN and GPTQ both come through here, so an identical
    frame gives identical codes.
    """
    return round_to_e2m1(w / step)


def quantize_column(
    w_col: torch.Tensor, scale_col: torch.Tensor, gscale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes and dequantized values of one weight column [N], given each row's group scale [N]
    (GPTQ's inner step)."""
    step = scale_col.float() / gscale
    codes = _encode(w_col.float(), step)
    return codes, decode_e2m1(codes) * step


def block_scales(
    w: torch.Tensor, gscale: torch.Tensor, scale_rule: str = "6"
) -> tuple[torch.Tensor, torch.Tensor]:
    """FP8 group scales [N, K/16] and the M=4 mask for weight ``w`` under global ``gscale``.

    Standard NVFP4 scales each group's max to 6. FourOverSix also tries scaling it to 4
    (1.5x the *unrounded* scale, then the FP8 cast) and keeps, per group, the candidate with
    the lower squared error on the weights themselves; ties keep 6.
    """
    _check_scale_rule(scale_rule)
    groups = w.float().unflatten(-1, (-1, GROUP_SIZE))
    # Same order as compressed-tensors' calculate_qparams: amax / 6 first, then * global.
    unrounded = (groups.abs().amax(dim=-1) / FP4_MAX) * gscale
    scale6 = to_fp8_scale(unrounded)
    if scale_rule == "6":
        return scale6, torch.zeros_like(unrounded, dtype=torch.bool)

    scale4 = to_fp8_scale(FOUR_OVER_SIX_EXPANSION * unrounded)

    def group_sq_error(scale: torch.Tensor) -> torch.Tensor:
        step = (scale.float() / gscale).unsqueeze(-1)
        values = decode_e2m1(_encode(groups, step)) * step
        return (values - groups).square().sum(dim=-1)

    m4 = group_sq_error(scale4) < group_sq_error(scale6)
    return torch.where(m4, scale4.float(), scale6.float()).to(torch.float8_e4m3fn), m4


def resolve_amax(w: torch.Tensor, global_amax: torch.Tensor | float | None) -> torch.Tensor:
    """The amax the global scale is built on: the fused group's if given, else the weight's."""
    own = w.detach().abs().amax().float()
    if global_amax is None:
        return own
    given = torch.as_tensor(global_amax, dtype=torch.float32, device=w.device).reshape(())
    if not torch.isfinite(given) or given < own:
        raise ValueError(
            f"global_amax {given.item():g} does not cover this weight's max |w| {own.item():g}; "
            "compute it over every member of the fused group"
        )
    return given


def quantize_rtn(
    w: torch.Tensor,
    scale_rule: str = "6",
    global_amax: torch.Tensor | float | None = None,
) -> NVFP4Tensor:
    """Round-to-nearest NVFP4 quantization of a [N, K] weight.

    ``global_amax`` is the max |w| over the fused group this weight belongs to; it must cover
    the weight's own max, since a smaller one would saturate group scales silently.
    """
    check_weight(w)
    amax = resolve_amax(w, global_amax)
    gscale = global_scale(amax, scale_rule)
    # On CPU a tile of rows at a time, as the W4A16 matmul dequantizes them: FourOverSix's dozen
    # elementwise passes then stay in cache (3-4x faster at the 9B's widths on one core). Every pass
    # is per element or per 16-group, so the tiles give the whole weight's bytes.
    rows = max(1, CPU_TILE_WEIGHTS // w.shape[-1]) if w.device.type == "cpu" else w.shape[0]
    tiles = [quantize_groups(w[i : i + rows], gscale, scale_rule) for i in range(0, w.shape[0], rows)]
    codes, scale, m4 = (torch.cat(parts) for parts in zip(*tiles))
    return NVFP4Tensor(codes, scale, gscale, m4)


def quantize_groups(
    x: torch.Tensor, gscale: torch.Tensor, scale_rule: str = "6"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes [..., K], FP8 group scales and M=4 mask [..., K/16] of any tensor whose last dim
    is cut into 16-groups, under a given global scale (weights here, K/V heads in sala/kv)."""
    scale, m4 = block_scales(x, gscale, scale_rule)
    step = (scale.float() / gscale).unsqueeze(-1)
    codes = _encode(x.float().unflatten(-1, (-1, GROUP_SIZE)), step)
    return codes.flatten(-2), scale, m4


def dequantize(
    codes: torch.Tensor,
    scale: torch.Tensor,
    gscale: torch.Tensor,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """E2M1[code] * (scale / global), in fp32 like compressed-tensors, then cast to ``dtype``."""
    return dequantize_fp4(codes, scale, gscale).to(dtype)


def pack_fp4(codes: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] codes -> uint8 [N, K/2], two per byte, low nibble = even column."""
    if codes.shape[-1] % 2:
        raise ValueError(f"cannot pack an odd number of columns ({codes.shape[-1]})")
    return codes[..., 0::2] | (codes[..., 1::2] << 4)
