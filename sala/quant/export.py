"""Writing NVFP4 checkpoints in the compressed-tensors format of sala/quant/format.py."""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable, Mapping

import torch
from torch import nn

from sala.checkpoint_files import write_checkpoint
from sala.kv.export import kv_scale_tensors
from sala.kv.plan import PLAN_FILE, load_plan
from sala.quant.format import FORMAT, quantization_config
from sala.quant.layerwise import quantized_module_names
from sala.quant.nvfp4 import NVFP4Tensor

# A shard is built in memory before it is written: this bounds what writing holds.
MAX_SHARD_BYTES = 2 << 30


def export_checkpoint(
    model,
    quantized: Mapping[str, NVFP4Tensor] | Callable[[int], Mapping[str, NVFP4Tensor]],
    target: str | os.PathLike,
    tokenizer=None,
    *,
    scale_rule: str,
    method: str,
    act_order: bool = False,
    overwrite: bool = False,
    producer: dict | None = None,
    metrics: dict | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    kv_plan=None,
) -> Path:
    """Write `model` with the Linears named in `quantized` (full module names) as packed NVFP4;
    every other Linear (lm_head) goes to the ignore list and stays BF16. A `kv_plan` (with
    calibrated amax) adds the compressed-tensors KV-cache scheme, each sparse layer's k_scale /
    v_scale and kv_plan.json.

    `model` is the unquantized model in memory (SALAForCausalLM), or a CheckpointReader of it,
    read a tensor at a time as the shards are written; `quantized` may then be a function that
    gives one decoder layer's results (by layer index) when the writing reaches that layer, in
    which case every Linear the quantize pipeline quantizes must be in them. Either way at most
    one shard is held at a time."""
    reader = not isinstance(model, nn.Module)
    structure = model.skeleton if reader else model
    if callable(quantized):
        names, layer_results = quantized_module_names(structure), quantized
    else:
        names = list(quantized)
        layer_results = lambda i: {k: q for k, q in quantized.items() if k.startswith(f"model.layers.{i}.")}  # noqa: E731
    modules = dict(structure.named_modules())
    if not names:
        raise ValueError("no quantized modules to export")
    for name in names:
        if not isinstance(modules.get(name), nn.Linear):
            raise ValueError(f"{name}: not a Linear of this model")
    if not callable(quantized):
        for name, q in quantized.items():
            check_shape(name, q, modules[name])
    if kv_plan is not None:
        kv_plan = load_plan(kv_plan, model.config)
    if reader:
        read = lambda key: model.tensor(key, torch.bfloat16)  # noqa: E731
    else:
        state = model.state_dict()
        read = lambda key: state[key].to(torch.bfloat16) if state[key].is_floating_point() else state[key]  # noqa: E731

    def tensors():
        packed, layer, results = set(names), None, {}
        for key in structure.state_dict():
            module, _, leaf = key.rpartition(".")
            if module not in packed or leaf != "weight":
                yield key, read(key)
                continue
            idx = int(module.split(".")[2])
            if idx != layer:
                layer, results = idx, layer_results(idx)
            if module not in results:
                raise ValueError(f"{module}: no quantized result to export")
            q = check_shape(module, results[module], modules[module])
            yield f"{module}.weight_packed", q.packed()
            yield f"{module}.weight_scale", q.scale
            yield f"{module}.weight_global_scale", q.global_scale.reshape(1).float()
        if kv_plan is not None:
            yield from kv_scale_tensors(kv_plan, model.config).items()

    extra_files = {PLAN_FILE: json.dumps(kv_plan.to_json(), indent=1).encode()} if kv_plan is not None else {}
    ignore = sorted(n for n, m in modules.items() if isinstance(m, nn.Linear) and n not in set(names))
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config(ignore, act_order, kv_cache=kv_plan is not None)
    config["dtype"] = "bfloat16"
    return write_checkpoint(target, type(model.config).from_dict(config), tensors(), model.generation_config,
                            tokenizer, overwrite=overwrite, max_shard_bytes=max_shard_bytes, metrics=metrics,
                            extra_files=extra_files,
                            producer={"name": "sala.quant", "format": FORMAT, "scale_rule": scale_rule, "method": method,
                                      "act_order": act_order, **(producer or {})})


def check_shape(name: str, q: NVFP4Tensor, linear: nn.Module) -> NVFP4Tensor:
    if q.codes.shape != linear.weight.shape:
        raise ValueError(f"{name}: quantized shape {tuple(q.codes.shape)} != weight shape {tuple(linear.weight.shape)}")
    return q
