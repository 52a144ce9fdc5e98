"""Loading and saving SALA models as checkpoint directories: the one place that picks the format.

`CheckpointReader` builds a checkpoint's modules one at a time from its shards
(`sala.checkpoint_files.ShardedTensors` reads a tensor without loading its file): a decoder
layer alone (the quantize workers, the streamed gate), the embedding rows of some tokens, or the
whole model (`load_model`), which it fills a module at a time, so that loading never holds the
checkpoint twice. It dispatches on config.json's quantization_config: none is a dense
(BF16/FP32) checkpoint; compressed-tensors is our NVFP4 format, whose checks and quantized
Linears sala/quant/load.py owns (the writer, sala/quant/export.py, is not involved). All sit on
`sala.checkpoint_files` (manifest, atomic writes, shards, config.json), whose public names this
module also exports, so callers import one module.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import torch
from torch import nn

from sala.checkpoint_files import (  # noqa: F401  (re-exported: the checkpoint API callers import from here)
    INDEX,
    MANIFEST,
    CheckpointError,
    ShardedTensors,
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
from sala.config import default_generation_config


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


class CheckpointReader:
    """A SALA checkpoint read a module at a time, each in `dtype` on `device`.

    dtype None keeps a dense checkpoint's stored dtype and gives an NVFP4 one's unquantized
    tensors (embeddings, norms, lm_head) in BF16; quantized tensors never change dtype. Every
    tensor is checked against the model's names and shapes on opening (from the shards'
    headers, reading no tensor), so a bad checkpoint fails before any weight is read.
    `packed`: an NVFP4 checkpoint's quantized Linears as NVFP4Linear (the W4A16 path), or as
    Linears holding the dequantized weights."""

    def __init__(self, path: str | os.PathLike, verify: bool = True, packed: bool = True):
        from sala.model import SALAForCausalLM

        self.path = Path(path)
        self.config = read_config(self.path)
        self.tensors = ShardedTensors(self.path, verify)
        with torch.device("meta"):
            self.skeleton = SALAForCausalLM(self.config)  # the modules as built: names, shapes, no storage
        self.quantized = None
        if getattr(self.config, "quantization_config", None):
            from sala.quant.load import NVFP4Checkpoint  # it names a quant_method or format it cannot load

            self.quantized = NVFP4Checkpoint(self, packed)
        # What the shards must hold: the model's tensors (quantized Linears in their stored form),
        # checked by name and shape; an NVFP4 checkpoint's KV-cache scales are checked by their own rule.
        stored = self.quantized.stored if self.quantized else self.skeleton
        extra = self.quantized.kv_scales if self.quantized else {}
        check_state_dict(stored, {n: torch.empty(self.tensors.shape(n), device="meta")
                                  for n in self.tensors.names() if n not in extra}, self.path)

    def dtype(self, dtype: torch.dtype | None) -> torch.dtype:
        """The dtype unquantized tensors load in when `dtype` is None or given."""
        if dtype is not None:
            return dtype
        return torch.bfloat16 if self.quantized else self.tensors.dtype("model.embed_tokens.weight")

    def tensor(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """One tensor of the model as its module holds it (a quantized one as stored)."""
        if not self.quantized:
            return self.tensors.get(name).to(self.dtype(dtype))
        t = self.quantized.tensor(name)
        if t is None:
            t = self.tensors.get(name)
        return t if self.quantized.keeps_dtype(name) else t.to(self.dtype(dtype))

    def module(self, name: str, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> nn.Module:
        """The model's submodule `name` (e.g. "model.layers.3"), alone, with its tensors."""
        module = copy.deepcopy(self.skeleton.get_submodule(name))
        self._fill(module, name, dtype, device)
        return module

    def layer(self, idx: int, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> nn.Module:
        return self.module(f"model.layers.{idx}", dtype, device).eval()

    def embeddings(self, ids: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        """embed_tokens(ids), reading only the rows of the tokens in `ids`."""
        return self.tensors.rows("model.embed_tokens.weight", ids).to(self.dtype(dtype))

    def model(self, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
        """The whole SALAForCausalLM (eval mode), filled and moved to `device` a module at a time."""
        model = self.skeleton
        self.skeleton = copy.deepcopy(model)  # this reader stays usable
        names = ["model.embed_tokens", *(f"model.layers.{i}" for i in range(self.config.num_hidden_layers)),
                 "model.norm", "lm_head"]
        for name in names:
            self._fill(model.get_submodule(name), name, dtype, device)
        model.generation_config = self.generation_config
        return model.eval()

    @property
    def generation_config(self):
        """generation_config.json's, as from_pretrained reads it (its eos ids may name end-of-turn
        tokens that config.json lacks), else the one the model derives from its config."""
        if (self.path / "generation_config.json").exists():
            from transformers import GenerationConfig

            return GenerationConfig.from_pretrained(self.path)
        return default_generation_config(self.config)

    def _fill(self, module: nn.Module, prefix: str, dtype, device) -> None:
        state = {key: self.tensor(f"{prefix}.{key}", dtype) for key in module.state_dict()}
        module.load_state_dict(state, assign=True)
        module.to(device)


# The tokenizer classes tokenizer_config.json names for transformers' tokenizers-backed class (its
# PreTrainedTokenizerFast), the one this project writes.
TOKENIZERS_BACKEND = {"TokenizersBackend", "PreTrainedTokenizerFast"}


def load_tokenizer(path: str | os.PathLike):
    """A checkpoint's tokenizer, as AutoTokenizer loads it. The tokenizers-backed class is loaded
    directly: importing AutoTokenizer brings every tokenizer class and transformers' generation
    code, seconds in each process that serves or quantizes. Another class, or no
    tokenizer_config.json, goes through AutoTokenizer (with SALA registered)."""
    try:
        named = json.loads((Path(path) / "tokenizer_config.json").read_text()).get("tokenizer_class")
    except (OSError, ValueError):
        named = None
    if named in TOKENIZERS_BACKEND:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(path)
    import sala

    sala.register()
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def load_model(path: str | os.PathLike, dtype: torch.dtype | None = None, device: str | torch.device = "cpu", verify: bool = True,
               packed: bool = True):
    """Load a SALA checkpoint directory into SALAForCausalLM (eval mode); a quantized one with
    packed weights on the W4A16 path (CheckpointReader says how dtype and packed apply)."""
    return CheckpointReader(path, verify, packed).model(dtype, device)
