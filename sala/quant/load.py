"""Reading NVFP4 checkpoints (sala/quant/format.py): what sala.checkpoint.CheckpointReader
hands a compressed-tensors quantization_config to."""
from __future__ import annotations

import copy

import torch
from torch import nn

from sala.checkpoint_files import CheckpointError
from sala.kv.export import SCALE_NAMES, kv_scale_tensors, scheme_strategy
from sala.kv.plan import PLAN_FILE, load_plan
from sala.quant.format import TENSOR_SUFFIXES, check_quantization_config


class NVFP4Checkpoint:
    """An NVFP4 checkpoint's format, checked once when opened: its quantization_config, that the
    modules it declares quantized (targets minus ignore, matched as compressed-tensors and vLLM
    match them) are exactly those with packed tensors, each a Linear with all three tensors, and
    its KV-cache scales. Then the reader's skeleton gets NVFP4Linear modules where packed (the
    W4A16 path: the tensors load as stored), and `tensor` dequantizes the weights of the Linears
    otherwise."""

    def __init__(self, reader, packed: bool):
        from compressed_tensors.utils import match_named_modules

        from sala.quant.linear import NVFP4Linear

        config, path, tensors = reader.config, reader.path, reader.tensors
        parsed = check_quantization_config(config.quantization_config, path / "config.json")
        self.kv_scales = {n: tensors.get(n) for n in tensors.names() if n.rsplit(".", 1)[-1] in SCALE_NAMES}
        check_kv_scales(self.kv_scales, scheme_strategy(config.quantization_config.get("kv_cache_scheme")), path, config)
        model = reader.skeleton
        declared = {n for scheme in parsed.config_groups.values()
                    for n, _ in match_named_modules(model, scheme.targets, parsed.ignore)}
        self.names = {k.rsplit(".", 1)[0] for k in tensors.names() if k.endswith(".weight_packed")}  # the packed Linears
        mismatched = sorted(declared.symmetric_difference(self.names))
        if mismatched:
            name = mismatched[0]
            which = "has no weight_packed" if name in declared else "has weight_packed but is not a target"
            raise CheckpointError(f"{path}: {name} {which} of quantization_config (targets minus ignore)")
        self.stored = copy.deepcopy(model)  # the modules as stored: what the shards are checked against
        for name in sorted(self.names):
            missing = [s for s in TENSOR_SUFFIXES if f"{name}.{s}" not in tensors]
            if missing:
                raise CheckpointError(f"{path}: {name} has weight_packed but no {missing[0]}")
            old = model.get_submodule(name)
            if not isinstance(old, nn.Linear):
                raise CheckpointError(f"{path}: {name} is packed but is a {type(old).__name__}, not a Linear")
            parent, _, child = name.rpartition(".")
            new = NVFP4Linear(old.in_features, old.out_features, old.bias is not None, device="meta")
            self.stored.get_submodule(parent).register_module(child, new)
            if packed:
                model.get_submodule(parent).register_module(child, copy.deepcopy(new))
        self.packed, self.tensors = packed, tensors

    def tensor(self, key: str) -> torch.Tensor | None:
        """The dequantized fp32 weight where a quantized Linear loads unpacked; None for every other
        tensor (the reader reads it as stored)."""
        from sala.quant.nvfp4 import dequantize, unpack_fp4

        module, _, leaf = key.rpartition(".")
        if self.packed or leaf != "weight" or module not in self.names:
            return None
        t = self.tensors
        return dequantize(unpack_fp4(t.get(f"{module}.weight_packed")), t.get(f"{module}.weight_scale"),
                          t.get(f"{module}.weight_global_scale"), torch.float32)

    @staticmethod
    def keeps_dtype(key: str) -> bool:
        """Packed weights and their scales load as stored, whatever dtype the model is asked in."""
        return key.endswith(TENSOR_SUFFIXES)


def check_kv_scales(scales: dict[str, torch.Tensor], strategy: str | None, path, config) -> None:
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
