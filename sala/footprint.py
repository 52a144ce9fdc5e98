"""What a process needs in host memory, worked out before it loads anything, and what the host has.

A stage states its need as a `Need` and prints it before loading, so that a run that cannot fit
is refused with the figures instead of being killed part-way. A need has two kinds of bytes:

- mapped: the checkpoint's tensors that load in the dtype they are stored in. safetensors maps
  its files, so such a tensor is a view of the page cache: one copy per host however many
  processes there load the checkpoint (`CheckpointFootprint.mapped`).
- own: what the process allocates itself: tensors converted to another dtype, the engine's
  fused projections (copies of q/k/v/gate and gate/up), caches, the tensors its work holds at
  its peak, and the runtime (Python with torch, transformers and sala imported).

So n processes loading one checkpoint on a host need mapped + n x own there (`Need.host_bytes`).

`host_memory` is what this machine can give now: /proc/meminfo's MemAvailable (which counts the
page cache, the checkpoint's cached pages included, as available), at most SALA_HOST_MEMORY_GIB
when that is set, to leave room for other work.
"""
from __future__ import annotations

import copy
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import torch

GIB = 1 << 30
# Python with torch, transformers and sala imported, Ray too in a worker: measured 0.33 GiB of
# anonymous memory without Ray.
RUNTIME_BYTES = GIB // 2
HOST_MEMORY_VAR = "SALA_HOST_MEMORY_GIB"


class MemoryShortfall(RuntimeError):
    """A stage that needs more memory than the host (or every Ray node) has; the message says
    what it needs, what there is, and which setting would fit."""


def gib(n: float) -> str:
    return f"{n / GIB:.2f} GiB"


@dataclass(frozen=True)
class Need:
    """What one process of a stage holds at its peak: `mapped` checkpoint bytes (shared by the
    processes of a host that load the same checkpoint) and its `own` bytes by part."""

    what: str
    mapped: int
    own: dict[str, int] = field(default_factory=dict)

    @property
    def own_bytes(self) -> int:
        return sum(self.own.values())

    @property
    def total(self) -> int:
        return self.mapped + self.own_bytes

    def host_bytes(self, processes: int) -> int:
        """What `processes` of these need on one host: the mapped checkpoint once, their own bytes each."""
        return self.mapped + processes * self.own_bytes

    def describe(self) -> str:
        parts = " + ".join(f"{name} {gib(b)}" for name, b in self.own.items() if b >= GIB // 200)  # shown as 0.00 otherwise
        return f"{self.what}: {gib(self.total)} (checkpoint pages {gib(self.mapped)}, one copy per host; own: {parts})"


def host_memory() -> int:
    """Bytes this machine can give now: MemAvailable, at most SALA_HOST_MEMORY_GIB."""
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return min(int(line.split()[1]) * 1024, memory_cap() or math.inf)
    raise MemoryShortfall("/proc/meminfo has no MemAvailable: cannot tell what memory this host has")


def memory_cap() -> int | None:
    """SALA_HOST_MEMORY_GIB in bytes, or None when unset."""
    value = os.environ.get(HOST_MEMORY_VAR)
    if not value:
        return None
    try:
        cap = float(value)
    except ValueError:
        cap = -1.0
    if not cap > 0:
        raise MemoryShortfall(f"{HOST_MEMORY_VAR}={value!r}: give a positive number of GiB")
    return int(cap * GIB)


class CheckpointFootprint:
    """A checkpoint's bytes as `load_model(path, dtype)` and an Engine on it hold them, from the
    shards' headers and the model built on the meta device: no tensor is read."""

    def __init__(self, path: str | os.PathLike, dtype: torch.dtype | None = None):
        from sala.checkpoint import CheckpointReader

        self.path = Path(path)
        self.reader = CheckpointReader(self.path, verify=False)
        self.config = self.reader.config
        self.dtype = self.reader.dtype(dtype)
        stored = self.reader.tensors
        keeps = self.reader.quantized.keeps_dtype if self.reader.quantized else lambda name: False
        self.mapped = self.copied = 0
        for name in stored.names():
            if keeps(name) or stored.dtype(name) == self.dtype:
                self.mapped += stored.nbytes(name)
            else:
                self.copied += math.prod(stored.shape(name)) * self.dtype.itemsize

    def describe(self) -> str:
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{self.path.name} ({gib(self.mapped + self.copied)} in {dtype})"

    def own(self) -> dict[str, int]:
        """The part of a loaded model that is the process's own: tensors converted from their stored dtype."""
        return {f"tensors converted to {str(self.dtype).removeprefix('torch.')}": self.copied} if self.copied else {}

    def meta_model(self):
        """The model on the meta device in the dtype it loads: shapes and dtypes, no storage."""
        return copy.deepcopy(self.reader.skeleton).to(self.dtype)

    def fused_bytes(self) -> int:
        """What an Engine's fused projections copy (sala.model.concat_linears): the parameters
        and buffers (packed NVFP4) that fusing adds, counted on the meta model."""
        def tensors(model) -> dict:  # an NVFP4 Linear's packed weight and scales are buffers
            return dict(model.named_parameters()) | dict(model.named_buffers())

        model = self.meta_model()
        before = tensors(model)
        model.model.fuse_projections()
        return sum(t.numel() * t.element_size() for name, t in tensors(model).items() if name not in before)

    def engine_need(self, what: str, own: dict[str, int], engines: int = 1, tree_rows: int | None = None,
                    **settings) -> Need:
        """What a process holds that serves this checkpoint in `engines` Engines sharing the model
        (EngineConfig `settings`; `tree_rows`: a Medusa tree's nodes), `own` added: the fused
        projections are its own copies, no longer mapped pages; each engine's cache pool as the
        settings resolve it (K/V pages and states; on CPU the prefix cache's snapshot budget on
        top); a step's logits (max_batch_tokens rows of the vocabulary in the model's dtype and
        in fp32) and activations."""
        from sala.engine.config import EngineConfig
        from sala.kv import PLAN_FILE

        if "kv_plan" not in settings and (self.path / PLAN_FILE).is_file():
            settings["kv_plan"] = self.path / PLAN_FILE
        resolved = EngineConfig(**settings).resolve(self.meta_model(), tree_rows)
        cache = resolved.memory_bytes + (resolved.prefix_snapshot_bytes if resolved.prefix_cache else 0)
        rows = resolved.max_batch_tokens
        step = rows * self.config.vocab_size * (self.dtype.itemsize + 4) + forward_bytes(self.config, 1, rows, self.dtype)
        fused = self.fused_bytes()
        return Need(what, max(self.mapped - fused, 0), own | self.own() | {
            "fused projections": fused, "engine cache" if engines == 1 else f"{engines} engine caches": engines * cache,
            "engine step": step})


def forward_bytes(config, rows: int, tokens: int, dtype: torch.dtype) -> int:
    """Activations of a forward of `rows` x `tokens` through the model, which holds one layer's
    at a time: the MLP's gate, up and product and the attention's projections (a quarter over,
    as measured at the 9B's width) and the attention scores of a sparse layer's dense path."""
    n = rows * tokens
    per_token = (4 * config.hidden_size + 3 * config.intermediate_size) * dtype.itemsize * 5 // 4
    return n * per_token + rows * config.num_attention_heads * tokens * tokens * 4
