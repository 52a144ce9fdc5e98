"""NVFP4 checkpoints in the compressed-tensors `nvfp4-pack-quantized` format (W4A16).

Every quantized Linear stores `weight_packed` (uint8 [N, K/2], low nibble = even column),
`weight_scale` (float8_e4m3fn [N, K/16]) and `weight_global_scale` (float32 [1], encode
direction); lm_head, embeddings and norms stay BF16 and lm_head is in the ignore list. The
`quantization_config` in config.json is built and validated with compressed-tensors' own
schema, so vLLM, SGLang and compressed-tensors' decompressor read the checkpoint as it is.
FourOverSix needs no format change: its output is plain NVFP4.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from sala.checkpoint import (
    CheckpointError, atomic_directory, check_state_dict, load_state_dict, read_config, save_state_dict, write_manifest,
)
from sala.quant.nvfp4 import NVFP4Tensor

FORMAT = "nvfp4-pack-quantized"
TENSOR_SUFFIXES = ("weight_packed", "weight_scale", "weight_global_scale")


def quantization_config(ignore: list[str], act_order: bool = False) -> dict:
    """The compressed-tensors NVFP4A16 config, produced by the library's own classes."""
    import compressed_tensors
    from compressed_tensors.quantization import QuantizationConfig, QuantizationStatus, preset_name_to_scheme

    scheme = preset_name_to_scheme("NVFP4A16", ["Linear"])
    scheme.format = FORMAT
    if act_order:
        scheme.weights.actorder = "static"  # columns permuted inside GPTQ only: no g_idx stored
    qc = QuantizationConfig(config_groups={"group_0": scheme}, format=FORMAT, ignore=ignore,
                            quantization_status=QuantizationStatus.COMPRESSED)
    out = qc.model_dump(mode="json")
    out |= {"sparsity_config": {}, "transform_config": {}, "version": compressed_tensors.__version__}
    return out


def check_quantization_config(qc: dict, source: Path) -> None:
    """Accept exactly the format we can load: NVFP4 weights (4-bit float, groups of 16), no
    activation quantization. Anything else is named, not half-loaded."""
    from compressed_tensors.quantization import QuantizationConfig

    if qc.get("quant_method") != "compressed-tensors":
        raise CheckpointError(f"{source}: quant_method {qc.get('quant_method')!r} is not supported (need compressed-tensors)")
    if qc.get("format") != FORMAT:
        raise CheckpointError(f"{source}: quantization format {qc.get('format')!r} is not supported (need {FORMAT!r})")
    try:
        parsed = QuantizationConfig.model_validate({k: v for k, v in qc.items() if k in QuantizationConfig.model_fields})
    except ValueError as e:
        raise CheckpointError(f"{source}: invalid quantization_config ({e})") from e
    for name, scheme in parsed.config_groups.items():
        w = scheme.weights
        if w is None or (w.num_bits, w.type, w.group_size) != (4, "float", 16):
            raise CheckpointError(f"{source}: config group {name} is not NVFP4 weights (num_bits 4, float, group 16)")
        if scheme.input_activations is not None:
            raise CheckpointError(f"{source}: config group {name} quantizes activations (W4A4); only W4A16 is supported")


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
) -> Path:
    """Write `model` with the Linears named in `quantized` (full module names) as packed NVFP4."""
    state = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v) for k, v in model.state_dict().items()}
    for name, q in quantized.items():
        if f"{name}.weight" not in state:
            raise KeyError(f"{name}: not a Linear of this model")
        del state[f"{name}.weight"]
        state[f"{name}.weight_packed"] = q.packed()
        state[f"{name}.weight_scale"] = q.scale
        state[f"{name}.weight_global_scale"] = q.global_scale.reshape(1).float()
    linears = [n for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    ignore = sorted(n for n in linears if n not in quantized)
    config = model.config.to_dict()
    config["quantization_config"] = quantization_config(ignore, act_order)
    config["torch_dtype"] = config["dtype"] = "bfloat16"
    target = Path(target)
    with atomic_directory(target, overwrite=overwrite) as tmp:
        type(model.config).from_dict(config).save_pretrained(tmp)
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp)
        save_state_dict(state, tmp, max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_manifest(tmp, {"name": "sala.quant", "format": FORMAT, "scale_rule": scale_rule, "method": method,
                             **(producer or {})}, metrics)
    return target.absolute()


def load_quantized_model(path: str | os.PathLike, dtype: torch.dtype | None = None, device="cpu",
                         verify: bool = True, packed: bool = True):
    """Load an NVFP4 checkpoint: quantized Linears become NVFP4Linear (packed weights on the
    W4A16 path), or, with packed=False, ordinary Linears holding the dequantized weights."""
    from sala.model import SALAForCausalLM
    from sala.quant.linear import NVFP4Linear
    from sala.quant.nvfp4 import dequantize, unpack_fp4

    path = Path(path)
    config = read_config(path)
    check_quantization_config(config.quantization_config, path / "config.json")
    state = load_state_dict(path, verify=verify)
    dtype = dtype or torch.bfloat16
    with torch.device("meta"):
        model = SALAForCausalLM(config)
    names = sorted({k.rsplit(".", 1)[0] for k in state if k.endswith(".weight_packed")})
    for name in names:
        missing = [s for s in TENSOR_SUFFIXES if f"{name}.{s}" not in state]
        if missing:
            raise CheckpointError(f"{path}: {name} has weight_packed but no {missing[0]}")
        parent, _, child = name.rpartition(".")
        try:
            old = model.get_submodule(name)
        except AttributeError as e:
            raise CheckpointError(f"{path}: unexpected tensor {name}.weight_packed (no such module)") from e
        if packed:
            model.get_submodule(parent).register_module(child, NVFP4Linear(old.in_features, old.out_features, device="meta"))
        else:
            p = state.pop(f"{name}.weight_packed")
            state[f"{name}.weight"] = dequantize(unpack_fp4(p), state.pop(f"{name}.weight_scale"),
                                                 state.pop(f"{name}.weight_global_scale"), torch.float32)
    check_state_dict(model, state, path)
    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() and not _is_quant(k) else v
                           for k, v in state.items()}, assign=True)
    return model.to(device).eval()


def _is_quant(key: str) -> bool:
    return key.endswith(TENSOR_SUFFIXES)
