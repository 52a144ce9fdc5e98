"""NVFP4 checkpoints in the compressed-tensors `nvfp4-pack-quantized` format (W4A16).

Every quantized Linear stores `weight_packed` (uint8 [N, K/2], low nibble = even column),
`weight_scale` (float8_e4m3fn [N, K/16]) and `weight_global_scale` (float32 [1], encode
direction); lm_head, embeddings and norms stay BF16 and lm_head is in the ignore list. The
`quantization_config` in config.json is built and validated with compressed-tensors' own
schema, so vLLM, SGLang and compressed-tensors' decompressor read the checkpoint as it is.
FourOverSix needs no format change: its output is plain NVFP4.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from sala.checkpoint_files import CheckpointError, check_state_dict, load_state_dict, read_config, write_checkpoint
from sala.kv.export import kv_cache_scheme, kv_scale_tensors, pop_kv_scales, scheme_strategy
from sala.kv.plan import PLAN_FILE, load_plan
from sala.quant.nvfp4 import NVFP4Tensor

if TYPE_CHECKING:
    from compressed_tensors.quantization import QuantizationConfig

FORMAT = "nvfp4-pack-quantized"
TENSOR_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")


def quantization_config(ignore: list[str], act_order: bool = False, kv_cache: bool = False) -> dict:
    """The compressed-tensors NVFP4A16 config, produced by the library's own classes."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    scheme.format = FORMAT
    if act_order:
        scheme.weights.actorder = "static"  # columns permuted inside GPTQ only: no g_idx stored
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=FORMAT, ignore=ignore,
                            quantization_status=QuantizationStatus.COMPRESSED,
                            kv_cache_scheme=kv_cache_scheme() if kv_cache else None)
    out = qc.model_dump(mode="json")
    out |= {"sparsity_config": {}, "transform_config": {}, "version": compressed_tensors.__version__}
    return out


def check_quantization_config(qc: dict, source: Path) -> QuantizationConfig:
    """Accept exactly the format we can load: compressed NVFP4 weights (4-bit float, groups of
    16 sharing an FP8 scale, one global scale per tensor), no activation quantization, no KV-cache
    scheme but static symmetric FP8 (sala/kv/export.py), no sparsity. Anything else is named, not
    half-loaded. Returns the parsed compressed-tensors QuantizationConfig."""
    from compressed_tensors.quantization import QuantizationConfig

    if qc.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{source}: quant_method {qc.get('quant_method')!r} is not supported (need compressed-tensors)")
    if qc.get("format") != FORMAT:
        raise CheckpointError(f"{source}: quantization format {qc.get('format')!r} is not supported (need {FORMAT!r})")
    if qc.get("sparsity_config"):
        raise CheckpointError(f"{source}: sparse checkpoints (sparsity_config) are not supported")
    try:
        parsed = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k in QuantizationConfig.model_fields})
    except ValueError as e:
        raise CheckpointError(f"{source}: invalid quantization_config ({e})") from e
    if parsed.quantization_status != "compressed":
        raise CheckpointError(f"{source}: quantization_status {parsed.quantization_status.value!r}; only packed "
                              "('compressed') weights are supported")
    if qc.get("kv_cache_scheme") is not None and scheme_strategy(qc["kv_cache_scheme"]) is None:
        raise CheckpointError(f"{source}: KV-cache quantization (kv_cache_scheme) {qc['kv_cache_scheme']} is not supported "
                              "(only static symmetric FP8, strategy tensor or attn_head)")
    for name, scheme in parsed.config_groups.items():
        w = scheme.weights
        if scheme.format not in (None, FORMAT):
            raise CheckpointError(f"{source}: config group {name} has format {scheme.format!r}, not {FORMAT!r}")
        if w is None or (w.num_bits, w.type, w.group_size, w.strategy, w.symmetric) != (4, "float", 16, "tensor_group", True):
            raise CheckpointError(f"{source}: config group {name} is not NVFP4 weights "
                                  "(num_bits 4, float, symmetric, tensor_group, group 16)")
        if scheme.input_activations is not None or scheme.output_activations is not None:
            raise CheckpointError(f"{source}: config group {name} quantizes activations (W4A4); only W4A16 is supported")
    return parsed


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
