"""GPTQ on NVFP4 groups (Frantar et al., 2022; structure of IST-DASLab/gptq).

The quantization frame (global scale, FP8 group scales and FourOverSix's per-group 4-or-6
choice) is fixed from the original weight before any column is touched, like llm-compressor's
static groups: NVFP4 has no g_idx, so a group's scale cannot follow the updated weights or a
permutation. GPTQ then only chooses codes inside that frame, column by column, pushing each
column's rounding error onto the columns not yet quantized through the inverse Hessian.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from sala.quant.nvfp4 import GROUP_SIZE, NVFP4Tensor, block_scales, check_weight, global_scale, quantize_column, resolve_amax

# Dampening retries: 1x, 10x, 100x, 1000x the requested fraction of the mean diagonal.
DAMP_ATTEMPTS = 4


class HessianAccumulator:
    """Running sum of x^T x over calibration tokens for one Linear's inputs.

    Keeps the raw sum and the token count rather than a running mean so that partial sums from
    shards merge exactly (up to fp32 addition order) whatever their sizes.
    """

    def __init__(self, in_features: int, device: torch.device | str | None = None):
        self.in_features = in_features
        self.xtx = torch.zeros(in_features, in_features, dtype=torch.float32, device=device)
        self.tokens = 0

    def add(self, x: torch.Tensor) -> None:
        """Add inputs of shape [..., in_features]; every leading position counts as a token."""
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected inputs [..., {self.in_features}], got {tuple(x.shape)}")
        x = x.reshape(-1, self.in_features).to(self.xtx.device, torch.float32)
        self.xtx.addmm_(x.T, x)
        self.tokens += x.shape[0]

    def merge(self, other: HessianAccumulator) -> HessianAccumulator:
        if other.in_features != self.in_features:
            raise ValueError(
                f"cannot merge Hessians of {other.in_features} and {self.in_features} features"
            )
        self.xtx += other.xtx.to(self.xtx.device)
        self.tokens += other.tokens
        return self

    def hessian(self, name: str = "linear") -> torch.Tensor:
        """H = 2/n sum x x^T (the scale is irrelevant to GPTQ: dampening is relative)."""
        if self.tokens == 0:
            raise ValueError(f"{name}: empty calibration, no tokens reached this module")
        if not torch.isfinite(self.xtx).all():
            raise ValueError(f"{name}: calibration inputs contain NaN or Inf")
        return self.xtx * (2.0 / self.tokens)


@dataclass
class GPTQStats:
    weight_error: float  # ||Q - W||^2 / ||W||^2
    # tr(dW H dW^T) / tr(W H W^T): relative squared error of the layer output on calibration
    output_error: float
    m4_share: float  # share of groups FourOverSix scaled to 4
    damp: float  # dampening fraction of the mean diagonal that made H invertible
    seconds: float  # the quantization itself, without computing these statistics


def relative_weight_error(weight: torch.Tensor, dequantized: torch.Tensor) -> float:
    """||dW||^2 / ||W||^2."""
    w = weight.float()
    den = w.square().sum().item()
    return torch.sub(dequantized.float(), w).square_().sum().item() / den if den > 0 else 0.0


def relative_output_error(
    weight: torch.Tensor, dequantized: torch.Tensor, hessian: torch.Tensor
) -> float:
    """tr(dW H dW^T) / tr(W H W^T); with H = 2/n X^T X this is ||X dW^T||^2 / ||X W^T||^2.
    Products in place: one [N, K] temporary at a time besides dW."""
    w = weight.float()
    h = hessian.to(w.device, torch.float32)
    den = (w @ h).mul_(w).sum().item()
    dw = torch.sub(dequantized.float(), w)
    return (dw @ h).mul_(dw).sum().item() / den if den > 0 else 0.0


def _inverse_hessian_cholesky(
    h: torch.Tensor, damp: float, name: str
) -> tuple[torch.Tensor, float]:
    """Upper Cholesky factor of (H + damp * mean(diag H) * I)^-1, raising dampening on failure.

    The dampening goes onto H's diagonal in place and comes off again (restored from a copy, not
    subtracted), and each factor is dropped once the next is made: at most two K x K matrices
    besides H at a time (a 16384-wide down_proj's are 1 GiB each)."""
    diag = h.diagonal()
    mean_diag = diag.mean()
    if not mean_diag > 0:
        raise ValueError(
            f"{name}: Hessian has a non-positive mean diagonal; it is not a Gram matrix"
        )
    undamped = diag.clone()
    for _ in range(DAMP_ATTEMPTS):
        diag.add_(damp * mean_diag)
        chol, info = torch.linalg.cholesky_ex(h)
        diag.copy_(undamped)
        if info == 0:
            inverse = torch.cholesky_inverse(chol)
            del chol
            u, info = torch.linalg.cholesky_ex(inverse, upper=True)
            if info == 0:
                return u, damp
        damp *= 10
    raise ValueError(
        f"{name}: Hessian is not positive definite even with dampening {damp / 10:g} of its mean "
        "diagonal; the calibration inputs are degenerate or the Hessian is corrupt"
    )


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    *,
    scale_rule: str = "6",
    global_amax: torch.Tensor | float | None = None,
    damp: float = 0.01,
    block_size: int = 128,
    act_order: bool = False,
    name: str = "linear",
) -> tuple[NVFP4Tensor, GPTQStats]:
    """Quantize a [N, K] weight to NVFP4 with GPTQ, given the Hessian [K, K] of its inputs."""
    start = time.perf_counter()
    check_weight(weight)
    n_cols = weight.shape[1]
    if hessian.shape != (n_cols, n_cols):
        raise ValueError(
            f"{name}: Hessian shape {tuple(hessian.shape)} does not match in-features {n_cols}"
        )
    if not torch.isfinite(hessian).all():
        raise ValueError(f"{name}: Hessian contains NaN or Inf")
    if not (hessian.diagonal() > 0).any():
        raise ValueError(f"{name}: Hessian is zero, the calibration inputs carry no signal")

    w = weight.float().clone()
    gscale = global_scale(resolve_amax(weight, global_amax), scale_rule)
    scale, m4 = block_scales(w, gscale, scale_rule)
    scale_f = scale.float()
    group_of = torch.arange(n_cols, device=w.device) // GROUP_SIZE

    # H itself where nothing changes it but the dampening, which comes off again exactly: a copy
    # of a 16384-wide Hessian is 1 GiB.
    h = hessian.to(w.device, torch.float32)
    # A column no calibration token touched has no say in the output on calibration data.
    # The reference implementations zero its weights; we keep them (plain RTN): nothing
    # argues for zero, and the feature may well be active at inference.
    dead = h.diagonal() == 0
    if dead.any():
        h = h.clone()
        h[dead, dead] = 1.0

    if act_order:
        # Quantize the columns with the largest activations first, while the most columns are
        # still free to absorb their error. Each column keeps its original group's scale.
        perm = torch.argsort(h.diagonal(), descending=True, stable=True)
        w, h, group_of = w[:, perm], h[perm][:, perm], group_of[perm]

    u, damp_used = _inverse_hessian_cholesky(h, damp, name)

    group_of = group_of.tolist()
    codes = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    for i1 in range(0, n_cols, block_size):
        i2 = min(i1 + block_size, n_cols)
        # A contiguous copy: rank-1 updates on a column slice of the full [N, K] weight are
        # ~50x slower on CPU (rows a power-of-two apart fight over the same cache sets).
        w1 = w[:, i1:i2].clone()
        u1 = u[i1:i2, i1:i2]
        err1 = torch.empty_like(w1)
        for i in range(i2 - i1):
            col, q = quantize_column(w1[:, i], scale_f[:, group_of[i1 + i]], gscale)
            codes[:, i1 + i] = col
            err = (w1[:, i] - q) / u1[i, i]
            # Within the block: update the remaining columns now (they are quantized next).
            w1[:, i + 1 :].addr_(err, u1[i, i + 1 :], alpha=-1)
            err1[:, i] = err
        # Beyond the block: one lazy matmul instead of i2 - i1 rank-1 updates.
        w[:, i2:] -= err1 @ u[i1:i2, i2:]
    del u, u1, w, w1, err1, h  # the statistics below need neither the factor (K x K, u1 a view of it) nor the working copy

    if act_order:
        codes = codes[:, torch.argsort(perm)]
    result = NVFP4Tensor(codes, scale, gscale, m4)
    seconds = time.perf_counter() - start

    dequantized = result.dequantize()
    stats = GPTQStats(
        weight_error=relative_weight_error(weight, dequantized),
        output_error=relative_output_error(weight, dequantized, hessian),
        m4_share=result.m4_share,
        damp=damp_used,
        seconds=seconds,
    )
    return result, stats
