"""The cache plan in a compressed-tensors checkpoint.

compressed-tensors declares one KV-cache scheme for every attention module
(`quantization_config.kv_cache_scheme`) and keeps its scales on the attention module as
`<layer>.self_attn.k_scale` / `v_scale`. Ours: FP8 E4M3, symmetric, static, one scale per kv
head (strategy `attn_head`, shape [Hkv, 1, 1], fp32), scale = amax / 448, the dequantize
direction, as our FP8 codec uses it. Every sparse layer gets its scales, NVFP4 ones included,
so a loader that knows only that scheme runs the whole cache at FP8 (more precise than the
plan, never less); the per-layer formats and the lightning state dtypes travel in
kv_plan.json beside config.json, which our loader and engine read.
"""
from __future__ import annotations

import torch

from sala.kv.formats import FP8_MAX
from sala.kv.plan import KVPlan, KVPlanError

SCALE_NAMES = ("k_scale", "v_scale")


def kv_cache_scheme() -> dict:
    """The scheme, produced by compressed-tensors' own QuantizationArgs."""
    from compressed_tensors.quantization import QuantizationArgs

    args = QuantizationArgs(num_bits=8, type="float", strategy="attn_head", symmetric=True, dynamic=False,
                            scale_dtype=torch.float32)
    return args.model_dump(mode="json")


def is_our_scheme(scheme: dict) -> bool:
    from compressed_tensors.quantization import QuantizationArgs

    try:
        args = QuantizationArgs.model_validate(scheme)
    except ValueError:
        return False
    return (args.num_bits, args.type, args.strategy, args.symmetric, args.dynamic) == (8, "float", "attn_head", True, False)


def scale_key(layer: int, name: str) -> str:
    return f"model.layers.{layer}.self_attn.{name}"


def kv_scale_tensors(plan: KVPlan, config) -> dict[str, torch.Tensor]:
    """{key: fp32 [Hkv, 1, 1]} for every sparse layer; the plan must hold calibrated amax for each
    (scales computed on write have nothing static to export)."""
    missing = [i for i in config.sparse_layers if i not in plan.amax]
    if missing:
        raise KVPlanError(f"kv plan: sparse layer(s) {missing} have no calibrated k_amax / v_amax; static FP8 scales "
                          "cannot be exported without them (calibrate with sala.kv.measure.calibrate_amax)")
    out = {}
    for i in config.sparse_layers:
        for side, name in zip("kv", SCALE_NAMES):
            amax = torch.tensor(plan.amax[i][side], dtype=torch.float32)
            out[scale_key(i, name)] = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax)).reshape(-1, 1, 1)
    return out


def pop_kv_scales(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Take the KV-cache scales out of a loaded state dict (they are not model parameters)."""
    return {k: state.pop(k) for k in [k for k in state if k.rsplit(".", 1)[-1] in SCALE_NAMES]}
