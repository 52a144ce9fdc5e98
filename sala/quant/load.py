"""Loading NVFP4 checkpoints (sala/quant/format.py): what sala.checkpoint.load_model dispatches
to for a compressed-tensors quantization_config."""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from sala.checkpoint_files import CheckpointError, check_state_dict, load_state_dict, read_config
from sala.kv.export import kv_scale_tensors, pop_kv_scales, scheme_strategy
from sala.kv.plan import PLAN_FILE, load_plan
from sala.quant.format import TENSOR_SUFFIXES, check_quantization_config


def load_quantized_model(path: str | os.PathLike, dtype: torch.dtype | None = None, device="cpu",
                         verify: bool = True, packed: bool = True):
    """Load an NVFP4 checkpoint: quantized Linears become NVFP4Linear (packed weights on the
    W4A16 path), or, with packed=False, ordinary Linears holding the dequantized weights."""
    from compressed_tensors.utils import match_named_modules

    from sala.model import SALAForCausalLM
    from sala.quant.linear import NVFP4Linear
    from sala.quant.nvfp4 import dequantize, unpack_fp4

    path = Path(path)
    config = read_config(path)
    parsed = check_quantization_config(config.quantization_config, path / "config.json")
    state = load_state_dict(path, verify=verify)
    check_kv_scales(pop_kv_scales(state), scheme_strategy(config.quantization_config.get("kv_cache_scheme")), path, config)
    dtype = dtype or torch.bfloat16
    with torch.device("meta"):
        model = SALAForCausalLM(config)
    # The modules the config declares quantized (targets minus ignore, matched as
    # compressed-tensors and vLLM match them) must be exactly those with packed tensors.
    declared = {n for scheme in parsed.config_groups.values()
                for n, _ in match_named_modules(model, scheme.targets, parsed.ignore)}
    names = sorted({k.rsplit(".", 1)[0] for k in state if k.endswith(".weight_packed")})
    mismatched = sorted(declared.symmetric_difference(names))
    if mismatched:
        name = mismatched[0]
        which = "has no weight_packed" if name in declared else "has weight_packed but is not a target"
        raise CheckpointError(f"{path}: {name} {which} of quantization_config (targets minus ignore)")
    for name in names:
        missing = [s for s in TENSOR_SUFFIXES if f"{name}.{s}" not in state]
        if missing:
            raise CheckpointError(f"{path}: {name} has weight_packed but no {missing[0]}")
        old = model.get_submodule(name)
        if not isinstance(old, nn.Linear):
            raise CheckpointError(f"{path}: {name} is packed but is a {type(old).__name__}, not a Linear")
        if packed:
            parent, _, child = name.rpartition(".")
            model.get_submodule(parent).register_module(child, NVFP4Linear(old.in_features, old.out_features,
                                                                          old.bias is not None, device="meta"))
        else:
            p = state.pop(f"{name}.weight_packed")
            state[f"{name}.weight"] = dequantize(unpack_fp4(p), state.pop(f"{name}.weight_scale"),
                                                 state.pop(f"{name}.weight_global_scale"), torch.float32)
    check_state_dict(model, state, path)
    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() and not _is_quant(k) else v
                           for k, v in state.items()}, assign=True)
    return model.to(device).eval()


def check_kv_scales(scales: dict[str, torch.Tensor], strategy: str | None, path: Path, config) -> None:
    """k_scale / v_scale exactly when a KV-cache scheme (of `strategy`) is declared, and equal to
    the scales of the kv_plan.json beside them (which the engine uses)."""
    if strategy is None:
        if scales:
            raise CheckpointError(f"{path}: tensor {next(iter(scales))} but no kv_cache_scheme in quantization_config")
        return
    if not (path / PLAN_FILE).is_file():
        raise CheckpointError(f"{path}: kv_cache_scheme declared but no {PLAN_FILE} beside config.json")
    want = kv_scale_tensors(load_plan(path / PLAN_FILE, config), config, strategy)
    for key in sorted(set(want) | set(scales)):
        if key not in scales or key not in want or not torch.equal(scales[key].float(), want[key]):
            raise CheckpointError(f"{path}: KV-cache scale {key} is missing, unexpected or differs from {PLAN_FILE}")


def _is_quant(key: str) -> bool:
    return key.endswith(TENSOR_SUFFIXES)
