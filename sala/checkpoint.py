"""Loading and saving SALA models as checkpoint directories: the one place that picks the format.

`load_model` dispatches on config.json's quantization_config: none is a dense (BF16/FP32)
checkpoint, loaded here; compressed-tensors is our NVFP4 format, loaded by sala/quant/load.py
(the writer, sala/quant/export.py, is not involved). All sit on `sala.checkpoint_files`
(manifest, atomic writes, shards, config.json), whose public names this module also exports,
so callers import one module.
"""
from __future__ import annotations

import os
from pathlib import Path

import torch

from sala.checkpoint_files import (  # noqa: F401  (re-exported: the checkpoint API callers import from here)
    INDEX,
    MANIFEST,
    CheckpointError,
    atomic_directory,
    check_state_dict,
    load_state_dict,
    read_config,
    save_checkpoint,
    sha256_file,
    verify_manifest,
    weight_files,
    write_checkpoint,
    write_file_atomic,
    write_manifest,
)


class DeviceUnavailable(RuntimeError):
    """GPUs were asked for where torch sees none."""


def gpu_device(num_gpus: float) -> str:
    """The device for a process that reserved `num_gpus` GPUs: "cuda" (Ray points
    CUDA_VISIBLE_DEVICES at the reserved ones), or "cpu" for none."""
    if not num_gpus:
        return "cpu"
    if not torch.cuda.is_available():
        raise DeviceUnavailable(f"{num_gpus:g} GPU(s) asked for, but torch {torch.__version__} sees no CUDA device "
                                f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); ask for 0 GPUs to run on the CPU")
    return "cuda"


def load_model(path: str | os.PathLike, dtype: torch.dtype | None = None, device: str | torch.device = "cpu", verify: bool = True):
    """Load a SALA checkpoint directory into SALAForCausalLM (eval mode); a quantized one with
    packed weights on the W4A16 path."""
    path = Path(path)
    config = read_config(path)
    model = _loader(config)(path, dtype=dtype, device=device, verify=verify)
    if (path / "generation_config.json").exists():
        # As from_pretrained does: its eos ids may name end-of-turn tokens that config.json lacks.
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(path)
    return model


def _loader(config):
    """The loader of the checkpoint's weight format."""
    if not getattr(config, "quantization_config", None):
        return load_dense_model
    from sala.quant.load import load_quantized_model  # it names a quant_method or format it cannot load

    return load_quantized_model


def load_dense_model(path: Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu", verify: bool = True):
    """A dense checkpoint, in its stored dtype unless `dtype` is given."""
    from sala.model import SALAForCausalLM

    state = load_state_dict(path, verify=verify)
    with torch.device("meta"):
        model = SALAForCausalLM(read_config(path))
    check_state_dict(model, state, path)
    dtype = dtype or next(iter(state.values())).dtype
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, assign=True)
    return model.to(device).eval()
