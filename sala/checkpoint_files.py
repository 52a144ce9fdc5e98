"""The files of a checkpoint directory (Hugging Face layout): safetensors only, durable atomic writes, a manifest.

A checkpoint is written into a temporary sibling directory; every file and directory in it is
fsynced, then it takes the target's place in one step: renamed there, or, when replacing an
existing checkpoint, swapped with it (renameat2 RENAME_EXCHANGE on Linux, renamex_np
RENAME_SWAP on macOS), so a reader finds the old checkpoint or the new one, never neither, and
a crash at any point leaves a complete checkpoint under the final name. The parent directory is
fsynced after the rename. A writer killed mid-way leaves only a temporary `.NAME.tmp-PID-*`
beside the target, removed by the next write once that process is gone.

`manifest.json` lists the sha256 of every file. Verification (on by default when loading) reports
a flipped byte or a truncated shard with the file's name, and refuses a weight, config or
tokenizer file the manifest does not list: loading would read it, and nothing vouches for it. A
directory without a manifest (a checkpoint from the Hub) loads, with one warning that nothing
was verified.

This module knows files, not formats: `sala.checkpoint` builds models from them (dense or, through
`sala.quant.load` / `sala.quant.export`, NVFP4), and both read and write through here.
"""
from __future__ import annotations

import contextlib
import ctypes
import datetime as _dt
import errno
import hashlib
import json
import logging
import math
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from sala.config import ConfigError, SALAConfig

MANIFEST = "manifest.json"
INDEX = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
# Files that loading the model or its tokenizer reads: with a manifest, each must be listed in it.
# Others (a README, tiny-sala's held-out text) are not read, so they are not checked.
LOADED_SUFFIXES = (".safetensors", ".json", ".jinja", ".model", ".tiktoken")
LOADED_NAMES = ("vocab.txt", "merges.txt")

log = logging.getLogger(__name__)
_warned_unverified: set[Path] = set()


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


def verify_manifest(directory: Path) -> bool:
    """Check every file against the manifest; False when there is no manifest to check against.

    Raises CheckpointError naming the first file whose size or sha256 differs, that is listed but
    missing, or that loading would read but the manifest does not list."""
    directory = Path(directory)
    path = directory / MANIFEST
    if not path.exists():
        return False
    try:
        listed = json.loads(path.read_text())["files"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: not a valid manifest ({e!r})") from e
    for name, entry in listed.items():
        f = directory / name
        if not f.exists():
            raise CheckpointError(f"{f}: listed in {MANIFEST} but missing")
        if f.stat().st_size != entry["bytes"]:
            raise CheckpointError(f"{f}: {f.stat().st_size} bytes, {MANIFEST} says {entry['bytes']} (truncated?)")
        if sha256_file(f) != entry["sha256"]:
            raise CheckpointError(f"{f}: sha256 differs from {MANIFEST} (corrupted file)")
    for f in sorted(directory.rglob("*")):
        name = str(f.relative_to(directory))
        if f.is_file() and name != MANIFEST and name not in listed and (f.suffix in LOADED_SUFFIXES or f.name in LOADED_NAMES):
            raise CheckpointError(f"{f}: not listed in {MANIFEST} (a file added after the checkpoint was written)")
    return True


def fsync_tree(root: Path) -> None:
    """Flush every file under `root`, then every directory (deepest first, `root` last), to disk."""
    dirs = [root]
    for p in root.rglob("*"):
        if p.is_dir():
            dirs.append(p)
        else:
            _fsync(p)
    for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
        _fsync(d)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` durably: a temporary sibling, fsynced, renamed over it, directory fsynced."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    tmp.replace(path)
    _fsync(path.parent)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2  # linux/fs.h
_RENAME_SWAP = 2  # macOS sys/stdio.h


def exchange_paths(a: Path, b: Path) -> None:
    """Swap two existing paths in one atomic step. OSError where the OS or filesystem cannot."""
    libc = ctypes.CDLL(None, use_errno=True)
    if sys.platform.startswith("linux") and hasattr(libc, "renameat2"):
        rc = libc.renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    elif sys.platform == "darwin" and hasattr(libc, "renamex_np"):
        rc = libc.renamex_np(os.fsencode(a), os.fsencode(b), _RENAME_SWAP)
    else:
        raise OSError(errno.ENOSYS, f"no atomic rename-exchange on {sys.platform}")
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err), str(a), None, str(b))


def _replace_directory(new: Path, target: Path) -> None:
    """Put the complete directory `new` at `target`, an existing directory; afterwards `new`
    holds the old contents (the caller removes them)."""
    try:
        exchange_paths(new, target)
        return
    except OSError as e:
        if e.errno not in (errno.ENOSYS, errno.EINVAL, errno.ENOTSUP, errno.EOPNOTSUPP):
            raise
        log.warning("%s: this filesystem cannot swap directories atomically (%s); replacing by two renames, "
                    "so a reader may briefly find no checkpoint there", target, e.strerror)
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    target.rename(old)
    new.rename(target)
    old.rename(new)


def _remove_stale_temporaries(target: Path) -> None:
    """Temporaries of writers that died (their process is gone) beside `target`."""
    pattern = re.compile(rf"\.{re.escape(target.name)}\.tmp-(\d+)-")
    for p in target.parent.iterdir():
        m = pattern.match(p.name)
        if m and p.is_dir() and not _process_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def atomic_directory(target: str | os.PathLike, overwrite: bool = False, flush: Callable[[Path], None] = fsync_tree):
    """Yield a temporary directory beside `target`; if the block succeeds, flush it to disk and
    put it at `target` in one step (swapping out an existing one when `overwrite`). `flush` may
    trade fsync per file for one system-wide sync where a tree has tens of thousands of files."""
    target = Path(target).absolute()
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} already exists (pass overwrite to replace it)")
    target.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_temporaries(target)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-{os.getpid()}-", dir=target.parent))
    try:
        yield tmp
        flush(tmp)
        if target.exists():
            _replace_directory(tmp, target)  # tmp now holds the old checkpoint
        else:
            tmp.rename(target)
        _fsync(target.parent)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)


def save_state_dict(state: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], directory: Path,
                    max_shard_bytes: int = 4 << 30) -> list[str]:
    """Write model.safetensors, or numbered shards plus the HF index when larger than one shard.
    `state` may be an iterable of (name, tensor) made as it is read: each shard is written once
    it is full and dropped, so at most one shard's tensors are held at a time."""
    items = state.items() if isinstance(state, dict) else state
    written: list[tuple[Path, list[str]]] = []  # shards under temporary names, until their count is known
    shard: dict[str, torch.Tensor] = {}
    size = total = 0

    def flush() -> None:
        path = directory / f".shard-{len(written)}.safetensors"
        save_file(shard, str(path), metadata={"format": "pt"})
        written.append((path, list(shard)))
        shard.clear()

    for name, t in items:
        t = t.detach().contiguous().cpu()
        n = t.numel() * t.element_size()
        if shard and size + n > max_shard_bytes:
            flush()
            size = 0
        shard[name] = t
        size += n
        total += n
    flush()
    if len(written) == 1:
        written[0][0].rename(directory / "model.safetensors")
        return ["model.safetensors"]
    names = [f"model-{i + 1:05d}-of-{len(written):05d}.safetensors" for i in range(len(written))]
    weight_map = {}
    for fname, (path, keys) in zip(names, written):
        path.rename(directory / fname)
        weight_map.update(dict.fromkeys(keys, fname))
    (directory / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    return names


def write_checkpoint(
    target: str | os.PathLike,
    config,
    state: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]],
    generation_config=None,
    tokenizer=None,
    *,
    overwrite: bool = False,
    producer: dict | None = None,
    metrics: dict | None = None,
    max_shard_bytes: int = 4 << 30,
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Write config, weights, generation config, tokenizer, `extra_files` (name -> bytes) and the
    manifest listing them all into `target` atomically."""
    target = Path(target)
    with atomic_directory(target, overwrite=overwrite) as tmp:
        config.save_pretrained(tmp)
        if generation_config is not None:
            generation_config.save_pretrained(tmp)
        save_state_dict(state, tmp, max_shard_bytes)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        for name, data in (extra_files or {}).items():
            (tmp / name).write_bytes(data)
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
    extra_files: dict[str, bytes] | None = None,
) -> Path:
    """Save a SALAForCausalLM (config, weights, tokenizer, generation config, manifest) atomically."""
    state = model.state_dict()
    config = model.config
    if dtype is not None:
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        config = type(config).from_dict({**config.to_dict(), "dtype": dtype})
    return write_checkpoint(target, config, state, getattr(model, "generation_config", None), tokenizer,
                            overwrite=overwrite, producer=producer, metrics=metrics, max_shard_bytes=max_shard_bytes,
                            extra_files=extra_files)


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


class ShardedTensors:
    """A checkpoint's tensors by name, each read from its safetensors shard when asked for
    (safetensors reads one tensor without loading its file): what loads a model one layer at a
    time, so that nothing ever holds the whole checkpoint. Shapes and dtypes come from the
    shards' headers, without reading any tensor."""

    def __init__(self, path: str | os.PathLike, verify: bool = True):
        self.path = Path(path)
        files = weight_files(self.path)  # first: a directory with no usable weights says so, not that it is unverified
        if verify and not verify_manifest(self.path) and self.path.absolute() not in _warned_unverified:
            _warned_unverified.add(self.path.absolute())
            log.warning("%s: no %s, so nothing in it was verified (loading the files as they are)", self.path, MANIFEST)
        self._handles: dict[Path, object] = {}
        self.file_of: dict[str, Path] = {}
        for f in files:
            if not f.exists():
                raise CheckpointError(f"{f}: listed in {INDEX} but missing")
            self.file_of |= dict.fromkeys(self._open(f).keys(), f)

    def _open(self, f: Path):
        if f not in self._handles:
            try:
                self._handles[f] = safe_open(str(f), framework="pt")
            except (SafetensorError, OSError, ValueError) as e:
                raise CheckpointError(f"{f}: unreadable safetensors file ({e})") from e
        return self._handles[f]

    def names(self) -> list[str]:
        return list(self.file_of)

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def _slice(self, name: str):
        return self._open(self.file_of[name]).get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def dtype(self, name: str) -> torch.dtype:
        return _SAFETENSORS_DTYPES[self._slice(name).get_dtype()]

    def nbytes(self, name: str) -> int:
        return math.prod(self.shape(name)) * self.dtype(name).itemsize

    def get(self, name: str) -> torch.Tensor:
        f = self.file_of[name]
        try:
            return self._open(f).get_tensor(name)
        except (SafetensorError, OSError, ValueError) as e:
            raise CheckpointError(f"{f}: unreadable tensor {name} ({e})") from e

    def row_block(self, name: str, lo: int, hi: int) -> torch.Tensor:
        """Rows lo .. hi - 1 of a tensor, reading only those."""
        return self._slice(name)[lo:hi]

    def rows(self, name: str, ids: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
        """Rows `ids` of a 2-D tensor (embedding rows for some token ids), reading it `chunk` rows
        at a time: never the whole tensor at once."""
        flat = ids.reshape(-1)
        wanted = torch.unique(flat)  # sorted
        n = self.shape(name)[0]
        if len(wanted) and not 0 <= int(wanted[0]) <= int(wanted[-1]) < n:
            raise CheckpointError(f"{self.path}: row ids outside [0, {n}) of {name}")
        parts = []
        for lo in range(0, n, chunk):
            inside = wanted[(wanted >= lo) & (wanted < lo + chunk)]
            if len(inside):
                parts.append(self.row_block(name, lo, min(lo + chunk, n))[inside - lo])
        table = torch.cat(parts) if parts else self.get(name)[:0]
        return table[torch.searchsorted(wanted, flat)].reshape(*ids.shape, -1)

    def load_all(self) -> dict[str, torch.Tensor]:
        return {name: self.get(name) for name in self.file_of}


# safetensors' dtype names (the header's "dtype" field) -> torch dtypes
_SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                       "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
                       "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}


def load_state_dict(path: str | os.PathLike, verify: bool = True) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint in memory (small models, tools); models load through ShardedTensors."""
    return ShardedTensors(path, verify).load_all()


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
