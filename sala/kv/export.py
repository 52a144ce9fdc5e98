"""The cache plan in a compressed-tensors checkpoint.

compressed-tensors declares one KV-cache scheme for every attention module
(`quantization_config.kv_cache_scheme`). We declare what other engines accept: static,
symmetric FP8 E4M3 with one scale per tensor (strategy `tensor`; SGLang 0.5.23 ignores any other
scheme), and give every sparse layer a K and a V scale, amax / 448 over all its kv heads, the
dequantize direction, fp32 [1]. They are named `model.layers.N.self_attn.attn.k_scale` /
`v_scale`, the parameters SGLang's MiniCPM-SALA loader fills: it remaps no scale name, and
one it does not know (`self_attn.k_scale`) is a KeyError. NVFP4 layers get scales too, so a
loader that knows only compressed-tensors runs every sparse layer's K/V at FP8 with scales
that cover every head.

What only our engine reads stays in kv_plan.json beside config.json: each layer's K/V format,
each lightning layer's state dtype, and the per-head amax our FP8 and NVFP4 codecs scale by.
Checkpoints of ours written before (strategy `attn_head`, per-head [Hkv, 1, 1] scales at
`self_attn.k_scale`) still load: their scales are checked the same way.
"""
from __future__ import annotations

import torch

from sala.kv.formats import FP8_MAX
from sala.kv.plan import KVPlan, KVPlanError

SCALE_NAMES = ("k_scale", "v_scale")
STRATEGY = "tensor"
# strategy -> where each layer's scales sit under model.layers.N.self_attn
SCALE_PARENTS = {"tensor": "attn.", "attn_head": ""}


def kv_cache_scheme() -> dict:
    """The scheme, produced by compressed-tensors' own QuantizationArgs."""
    from compressed_tensors.quantization import QuantizationArgs

    args = QuantizationArgs(num_bits=8, type="float", strategy=STRATEGY, symmetric=True, dynamic=False,
                            scale_dtype=torch.float32)
    return args.model_dump(mode="json")


def scheme_strategy(scheme: dict | None) -> str | None:
    """"tensor" or "attn_head" for a static symmetric FP8 scheme we can check, else (no scheme,
    or another one) None."""
    from compressed_tensors.quantization import QuantizationArgs

    if scheme is None:
        return None
    try:
        args = QuantizationArgs.model_validate(scheme)
    except ValueError:
        return None
    if (args.num_bits, args.type, args.symmetric, args.dynamic) != (8, "float", True, False):
        return None
    return args.strategy if args.strategy in SCALE_PARENTS else None


def scale_key(layer: int, name: str, strategy: str = STRATEGY) -> str:
    return f"model.layers.{layer}.self_attn.{SCALE_PARENTS[strategy]}{name}"


def kv_scale_tensors(plan: KVPlan, config, strategy: str = STRATEGY) -> dict[str, torch.Tensor]:
    """{key: fp32 scale} for every sparse layer, [1] per tensor or [Hkv, 1, 1] per head; the plan
    must hold calibrated amax for each (scales computed on write have nothing static to export)."""
    missing = [i for i in config.sparse_layers if i not in plan.amax]
    if missing:
        raise KVPlanError(f"kv plan: sparse layer(s) {missing} have no calibrated k_amax / v_amax; static FP8 scales "
                          "cannot be exported without them (calibrate with sala.kv.measure.calibrate_amax)")
    out = {}
    for i in config.sparse_layers:
        for side, name in zip("kv", SCALE_NAMES):
            amax = torch.tensor(plan.amax[i][side], dtype=torch.float32)
            amax = amax.max().reshape(1) if strategy == "tensor" else amax.reshape(-1, 1, 1)
            out[scale_key(i, name, strategy)] = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    return out


def pop_kv_scales(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Take the KV-cache scales out of a loaded state dict (they are not model parameters)."""
    return {k: state.pop(k) for k in [k for k in state if k.rsplit(".", 1)[-1] in SCALE_NAMES]}
