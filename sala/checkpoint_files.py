"""The files of a checkpoint directory (Hugging Face layout): safetensors only, atomic writes, a manifest.

A checkpoint is written into a temporary sibling directory and renamed into place once every
file is complete, so a crash never leaves a half-written checkpoint under the final name.
`manifest.json` lists the sha256 of every file; loading verifies it, so a flipped byte or a
truncated shard is reported with the file's name instead of surfacing as garbage logits.

This module knows files, not formats: `sala.checkpoint` builds models from them (dense or, through
`sala.quant.export`, NVFP4), and both read and write through here.
"""
from __future__ import annotations

import contextlib
import datetime as _dt
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from sala.config import ConfigError, SALAConfig

MANIFEST = "manifest.json"
INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")


class CheckpointError(ValueError):
    """A checkpoint that cannot be read as asked: the message names the file or key."""


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def write_manifest(directory: Path, producer: dict | None = None, metrics: dict | None = None) -> dict:
    directory = Path(directory)
    files = {}
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files[str(p.relative_to(directory))] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
    manifest = {
        "format": "sala-manifest/1",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "producer": producer or {},
        "metrics": metrics or {},
        "files": files,
    }
    (directory / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return manifest


def verify_manifest(directory: Path) -> None:
    """Raise CheckpointError naming the first file whose size or sha256 differs from the manifest."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.exists():
        return
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from e
    for name, entry in manifest.get("files", {}).items():
        f = directory / name
        if not f.exists():
            raise CheckpointError(f"{f}: listed in {MANIFEST} but missing")
        if f.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"{f}: {f.stat().st_size} bytes, {MANIFEST} says {entry['bytes']} (truncated?)")
        if sha256_file(f) != entry["sha256"]:
            raise CheckpointError(f"{f}: sha256 differs from {MANIFEST} (corrupted file)")


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, overwrite: bool = False):
    """Yield a temporary directory beside `target`; rename it to `target` if the block succeeds."""
    target = Path(target).absolute()
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists (pass overwrite to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        yield tmp
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            target.rename(old)
            tmp.rename(target)
            shutil.rmtree(old)
        else:
            tmp.rename(target)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def save_state_dict(state: dict[str, torch.Tensor], directory: Path, max_shard_bytes: int = 4 << 30) -> list[str]:
    """Write model.safetensors, or numbered shards plus the HF index when larger than one shard."""
    state = {k: v.detach().contiguous().cpu() for k, v in state.items()}
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in state.items():
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    if len(shards) == 1:
        save_file(shards[0], str(directory / "model.safetensors"), metadata={"format": "pt"})
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map = {}
    for fname, shard in zip(names, shards):
        save_file(shard, str(directory / fname), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, fname))
    total = sum(t.numel() * t.element_size() for t in state.values())
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


def write_checkpoint(
    target: str | os.PathLike,
    config,
    state: dict[str, torch.Tensor],
    generation_config=None,
    tokenizer=None,
    *,
    overwrite: bool = False,
    producer: dict | None = None,
    metrics: dict | None = None,
    max_shard_bytes: int = 4 << 30,
) -> Path:
    """Write config, weights, generation config, tokenizer and manifest into `target` atomically."""
    target = Path(target)
    with atomic_directory(target, overwrite=overwrite) as tmp:
        config.save_pretrained(tmp)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        save_state_dict(state, tmp, max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        write_manifest(tmp, producer, metrics)
    return target.absolute()


def save_checkpoint(
    model,
    target: str | os.PathLike,
    tokenizer=None,
    *,
    dtype: torch.dtype | None = None,
    overwrite: bool = False,
    producer: dict | None = None,
    metrics: dict | None = None,
    max_shard_bytes: int = 4 << 30,
) -> Path:
    """Save a SALAForCausalLM (config, weights, tokenizer, generation config, manifest) atomically."""
    state = model.state_dict()
    config = model.config
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        config = type(config).from_dict({**config.to_dict(), "dtype": dtype})
    return write_checkpoint(target, config, state, getattr(model, "generation_config", None), tokenizer,
                            overwrite=overwrite, producer=producer, metrics=metrics, max_shard_bytes=max_shard_bytes)


def read_config(path: str | os.PathLike) -> SALAConfig:
    """Config of a checkpoint directory, with errors that name the directory or file."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"{path}: no such model directory")
    if not path.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    cfg_file = path / "config.json"
    if not cfg_file.exists():
        raise CheckpointError(f"{path}: no config.json (not a Hugging Face model directory)")
    try:
        raw = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{cfg_file}: not valid JSON ({e})") from e
    if raw.get("model_type") != SALAConfig.model_type:
        raise CheckpointError(f"{cfg_file}: model_type is {raw.get('model_type')!r}, expected 'minicpm_sala'")
    try:
        return SALAConfig.from_dict(raw)
    except ConfigError as e:
        raise CheckpointError(f"{cfg_file}: {e}") from e


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint; pickled weights are refused, never unpickled."""
    index = path / INDEX
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in path.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise CheckpointError(f"{path}: only pickle weights ({', '.join(pickles)}); sala loads safetensors only")
    raise CheckpointError(f"{path}: no *.safetensors weights")


def load_state_dict(path: str | os.PathLike, verify: bool = True) -> dict[str, torch.Tensor]:
    path = Path(path)
    if verify:
        verify_manifest(path)
    state: dict[str, torch.Tensor] = {}
    for f in weight_files(path):
        if not f.exists():
            raise CheckpointError(f"{f}: listed in {INDEX} but missing")
        try:
            state.update(load_file(str(f)))
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from e
    return state


def check_state_dict(model: torch.nn.Module, state: dict[str, torch.Tensor], source: Path, allow_extra: bool = False):
    """Every parameter present with its exact shape; extra tensors are errors unless allowed."""
    expected = model.state_dict()
    missing = [k for k in expected if k not in state]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{source}: missing tensor {missing[0]}{more}")
    for k, v in expected.items():
        if tuple(state[k].shape) != tuple(v.shape):
            raise CheckpointError(f"{source}: tensor {k} has shape {tuple(state[k].shape)}, model expects {tuple(v.shape)}")
    extra = [k for k in state if k not in expected]
    if extra and not allow_extra:
        raise CheckpointError(f"{source}: unexpected tensor {extra[0]} (not a parameter of this config)")
