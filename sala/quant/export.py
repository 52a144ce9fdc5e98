"""Writing NVFP4 checkpoints in the compressed-tensors format of sala/quant/format.py."""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from torch import nn

from sala.checkpoint_files import write_checkpoint
from sala.kv.export import kv_scale_tensors
from sala.kv.plan import PLAN_FILE, load_plan
from sala.quant.format import FORMAT, quantization_config
from sala.quant.nvfp4 import NVFP4Tensor


def export_checkpoint(
    model,
    quantized: dict[str, NVFP4Tensor],
    target: str | os.PathLike,
    tokenizer=None,
    *,
    scale_rule: str,
    method: str,
    act_order: bool = False,
    overwrite: bool = False,
    producer: dict | None = None,
    metrics: dict | None = None,
    max_shard_bytes: int = 4 << 30,
    kv_plan=None,
) -> Path:
    """Write `model` with the Linears named in `quantized` (full module names) as packed NVFP4;
    every other Linear (lm_head) goes to the ignore list and stays BF16. A `kv_plan` (with
    calibrated amax) adds the compressed-tensors KV-cache scheme, each sparse layer's k_scale /
    v_scale and kv_plan.json."""
    modules = dict(model.named_modules())
    if not quantized:
        raise ValueError("no quantized modules to export")
    for name, q in quantized.items():
        if not isinstance(modules.get(name), nn.Linear):
            raise ValueError(f"{name}: not a Linear of this model")
        if q.codes.shape != modules[name].weight.shape:
            raise ValueError(f"{name}: quantized shape {tuple(q.codes.shape)} != weight shape "
                             f"{tuple(modules[name].weight.shape)}")
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    for name, q in quantized.items():
        del state[f"{name}.weight"]
        state[f"{name}.weight_packed"] = q.packed()
        state[f"{name}.weight_scale"] = q.scale
        state[f"{name}.weight_global_scale"] = q.global_scale.reshape(1).float()
    extra_files = {}
    if kv_plan is not None:
        kv_plan = load_plan(kv_plan, model.config)
        state |= kv_scale_tensors(kv_plan, model.config)
        extra_files[PLAN_FILE] = json.dumps(kv_plan.to_json(), indent=1).encode()
    ignore = sorted(n for n, m in modules.items() if isinstance(m, nn.Linear) and n not in quantized)
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config(ignore, act_order, kv_cache=kv_plan is not None)
    config["dtype"] = "bfloat16"
    return write_checkpoint(target, type(model.config).from_dict(config), state, getattr(model, "generation_config", None),
                            tokenizer, overwrite=overwrite, max_shard_bytes=max_shard_bytes, metrics=metrics,
                            extra_files=extra_files,
                            producer={"name": "sala.quant", "format": FORMAT, "scale_rule": scale_rule, "method": method,
                                      "act_order": act_order, **(producer or {})})
