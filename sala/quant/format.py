"""The compressed-tensors `nvfp4-pack-quantized` format (W4A16) our NVFP4 checkpoints use, both
directions: the `quantization_config` written (sala/quant/export.py) and what loading accepts
(sala/quant/load.py).

Every quantized Linear stores `weight_packed` (uint8 [N, K/2], low nibble = even column),
`weight_scale` (float8_e4m3fn [N, K/16]) and `weight_global_scale` (float32 [1], encode
direction); lm_head, embeddings and norms stay BF16 and lm_head is in the ignore list. The
`quantization_config` in config.json is built and validated with compressed-tensors' own
schema, so vLLM, SGLang and compressed-tensors' decompressor read the checkpoint as it is.
FourOverSix needs no format change: its output is plain NVFP4.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sala.checkpoint_files import CheckpointError
from sala.kv.export import kv_cache_scheme, scheme_strategy

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
