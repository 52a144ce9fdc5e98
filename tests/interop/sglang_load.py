"""Our checkpoints through SGLang's own loading code, run in SGLang's environment
(tests/interop/sglang_env.py) by tests/interop/test_sglang.py: what `python -m sglang.launch_server
--model-path DIR` does with a checkpoint before it touches a GPU.

    <sglang env>/bin/python tests/interop/sglang_load.py OUT CHECKPOINT...

Per checkpoint: ServerArgs resolution (with SGLang's MiniCPM-SALA overrides), ModelConfig, the
quantization config, the model class named by `architectures`, that model built on the CPU,
DefaultModelLoader's choice of weight files and its iterator through the model's own
load_weights, then each attention layer's K/V-scale post-processing (what the attention
backends read). Writes OUT/<n>/state.safetensors, every parameter SGLang holds, and
OUT/<n>/report.json; an error SGLang raises is reported (one line and the traceback) and the
next checkpoint is loaded. Not run: the linear layers' post-processing (repacking for the Marlin
or FlashInfer GEMM, CUDA only) and any forward.

Stand-ins, each where SGLang's import or build path reaches CUDA-only code that loading never
runs:
- torch.cuda.get_device_capability reports (9, 0), a Hopper GPU: CompressedTensorsConfig checks
  each weight scheme's minimum capability against it (the NVFP4 weight-only scheme needs sm_80;
  its parameters are the same on every GPU, only the post-processing differs).
- `torchvision`: `sglang.srt.configs` imports it for multimodal image transforms; its wheel
  needs torch's CUDA build. A module whose every name is a placeholder that raises if called,
  with a version (0.0.0+standin) so transformers' version checks take it as too old to use.
- `vllm._custom_ops`: RotaryEmbedding takes its fallback kernel from there when torch sees no
  GPU; it is stored, never called, as loading runs no forward. Same placeholders.
- ServerArgs(device="cuda"): the device the server is configured for (without it SGLang looks
  for an accelerator and stops).
"""
import importlib.abc
import importlib.machinery
import json
import sys
import traceback
import types
from pathlib import Path

import torch

STAND_INS = ("torchvision", "vllm")


class _Placeholder:
    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        raise RuntimeError(f"{self._name}: a stand-in (tests/interop/sglang_load.py), not the real package")


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in STAND_INS:
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = types.ModuleType(spec.name)
        module.__path__, module.__version__ = [], "0.0.0+standin"
        module.__getattr__ = _Placeholder(spec.name).__getattr__
        return module

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _StandInFinder())
torch.cuda.get_device_capability = lambda device=None: (9, 0)


def load(checkpoint: str) -> tuple[dict, dict]:
    """(report, {parameter name: tensor}) of one checkpoint loaded as SGLang loads it."""
    from sglang.srt.arg_groups.model_override_base import resolved_view
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.layers.quantization.kv_cache import BaseKVCacheMethod
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.model_runner_components.load_model_utils import build_load_config
    from sglang.srt.model_loader.loader import DefaultModelLoader, _get_quantization_config, _initialize_model, get_model_loader
    from sglang.srt.model_loader.utils import set_default_torch_dtype
    from sglang.srt.runtime_context import SpawnRanks, publish, reset_context
    from sglang.srt.server_args import ServerArgs

    # The flags of the launch command in docs/sglang.md.
    server_args = ServerArgs(model_path=checkpoint, device="cuda", dtype="bfloat16", kv_cache_dtype="fp8_e4m3")
    reset_context()
    publish(server_args, role="test", ranks=SpawnRanks(world_rank=0))
    model_config = ModelConfig.from_server_args(server_args)
    load_config = build_load_config(server_args=server_args, tp_rank=0, remote_instance_weight_transporter_engine=None,
                                    remote_instance_weight_transporter_session_id="", draft_model_idx=None,
                                    weight_cache_mode="off", weight_cache_socket=None)
    loader = get_model_loader(load_config, model_config)
    assert type(loader) is DefaultModelLoader, type(loader)
    quant_config = _get_quantization_config(model_config, load_config)
    with set_default_torch_dtype(model_config.dtype), torch.device("cpu"):
        model = _initialize_model(model_config, load_config, quant_config)
    _, files, _ = loader._prepare_weights(checkpoint, None, True)
    loader.load_weights_only(model, loader._get_all_weights(model_config, model), torch.device("cpu"))
    kv_scales = {}
    for name, module in model.named_modules():
        if isinstance(module, RadixAttention) and isinstance(module.quant_method, BaseKVCacheMethod):
            module.quant_method.process_weights_after_loading(module)
            kv_scales[name] = [module.k_scale_float, module.v_scale_float]
    report = {
        "server_args": {k: getattr(resolved_view(server_args), k) for k in (
            "disable_radix_cache", "attention_backend", "page_size", "kv_cache_dtype")},
        "architectures": model_config.hf_config.architectures,
        "config_class": type(model_config.hf_config).__name__,
        "config": json.loads(model_config.hf_config.to_json_string(use_diff=False)),
        "dtype": str(model_config.dtype).removeprefix("torch."),
        "model_class": type(model).__name__,
        "quant_config": type(quant_config).__name__ if quant_config else None,
        "kv_cache_quant_algo": getattr(quant_config, "kv_cache_quant_algo", None),  # what --kv-cache-dtype auto follows
        "weight_files": sorted(str(Path(f).relative_to(checkpoint)) for f in files),
        "linear_schemes": {name: type(m.scheme).__name__ for name, m in model.named_modules()
                           if getattr(m, "scheme", None) is not None},
        "kv_methods": {name: type(m.quant_method).__name__ for name, m in model.named_modules()
                       if isinstance(m, RadixAttention) and m.quant_method is not None},
        "kv_scales": kv_scales,
    }
    return report, {name: p.detach().contiguous() for name, p in model.named_parameters()}


def main(out: str, checkpoints: list[str]) -> None:
    from safetensors.torch import save_file

    for i, checkpoint in enumerate(checkpoints):
        d = Path(out, str(i))
        d.mkdir(parents=True)
        try:
            report, state = load(checkpoint)
            save_file(state, str(d / "state.safetensors"))
        except Exception as e:  # reported per checkpoint: the test names SGLang's own error
            report = {"error": f"{type(e).__name__}: {e}".splitlines()[0], "traceback": traceback.format_exc()}
        (d / "report.json").write_text(json.dumps({"checkpoint": checkpoint, **report}, indent=1, default=str))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2:])
