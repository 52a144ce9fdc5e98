"""The engine's configuration: every setting in one frozen record, validated once.

`EngineConfig(**settings)` checks what the settings alone decide (ranges, the snapshot
interval's alignment, the Medusa settings' forms). `resolve` then fills in what depends on the
model and the device: the cache plan, the memory plan, and the sizes whose defaults follow
from them. The engine hands the resolved record whole to the cache pool, the scheduler, the
runner and the decoding strategy; none of them takes a setting any other way.
"""
from __future__ import annotations

import argparse
import dataclasses
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from sala import lightning
from sala.engine.memory import MemoryPlan, default_budget, plan_memory
from sala.kv import KVPlan, default_plan, load_plan
from sala.medusa.accept import TYPICAL_ALPHA, TYPICAL_THRESHOLD

# Defaults by device type: the CUDA ones are what the GPU kernels are built and checked for
# (sala/compile_check.py).
MAX_SEQS = {"cuda": 256, "cpu": 32}
MAX_BATCH_TOKENS = {"cuda": 2048, "cpu": 512}
PAGE_SIZE = 64  # InfLLM-v2's block


class SpeculationSettingError(ValueError):
    """medusa_nodes or medusa_max_batch is not one of the forms it takes."""


def _count(value):
    """An integer given as a string (a command line, YAML) as an integer; anything else as is."""
    if isinstance(value, str):
        try:
            return int(value)
        except ValueError:
            pass
    return value


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def parse_max_batch(value) -> int | None:
    """medusa_max_batch as given (an integer >= 0 or None), or SpeculationSettingError naming it."""
    if value is None:
        return None
    if value == "auto":
        raise SpeculationSettingError("medusa_max_batch='auto': Medusa now chooses from measured step costs by default "
                                      "(medusa_nodes='auto'); medusa_max_batch only caps the batch sizes that verify")
    if not _is_count(value := _count(value)):
        raise SpeculationSettingError(f"medusa_max_batch={value!r}: give an integer >= 0 (0 never verifies) or None "
                                      "(no cap)")
    return value


def parse_nodes(value) -> int | str:
    """medusa_nodes as given ("auto" or None for it, or an integer >= 0), or SpeculationSettingError naming it."""
    if value is None or value == "auto":
        return "auto"
    if not _is_count(value := _count(value)):
        raise SpeculationSettingError(f"medusa_nodes={value!r}: give 'auto' (each batch size's tree chosen from measured "
                                      "step costs), a node count (that subtree of the heads' tree at every step) or 0 "
                                      "(never verify)")
    return value


def add_medusa_arguments(ap) -> None:
    """The Medusa flags of a command line that serves or runs an engine (argparse parser `ap`):
    --medusa / --no-medusa, --medusa-nodes, --medusa-max-batch, parsed by parse_nodes and
    parse_max_batch once the caller has them."""
    ap.add_argument("--medusa", action=argparse.BooleanOptionalAction, default=None,
                    help="decode with the checkpoint's medusa/ heads (default: when it has them)")
    ap.add_argument("--medusa-nodes", metavar="auto|N",
                    help="draft tree nodes a verify step checks: auto (default) picks per batch size the subtree of "
                         "the heads' tree, or none, that decodes fastest by step costs measured at start-up; N: that "
                         "many at every step; 0: never verify")
    ap.add_argument("--medusa-max-batch", metavar="N",
                    help="verify draft trees only while at most N requests decode (default: no cap)")


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """The keywords `Engine` and `Engine.from_pretrained` take:

    - memory_bytes: the K/V + state budget; default on CUDA `gpu_memory_utilization` of the
      device's memory minus what is already in use, on CPU room for `max_seqs` sequences of
      min(max_model_len, 4096) tokens (at most a quarter of the machine's memory).
    - max_seqs (CUDA 256, CPU 32), cut to what the state pool can hold; max_batch_tokens (the
      step's token budget); max_model_len (default the model's); max_waiting (queue bound);
      page_size (tokens a K/V page holds).
    - batch_invariant: the evaluation mode, bitwise-reproducible logprobs whatever else runs
      (docs/design/batch-invariance.md); compile: the compiled (CPU) or CUDA-graph decode
      step (never in the evaluation mode).
    - kv_plan: the cache plan (sala/kv/plan.py; a KVPlan, its JSON dict, or a kv_plan.json
      path): each sparse layer's K/V format and each lightning layer's state dtype. Default:
      K/V in the model's dtype, fp32 states.
    - prefix_cache: reuse the K/V pages and lightning states of shared prefixes
      (sala/engine/prefix.py); prefix_snapshot_interval: tokens between state snapshots (a
      multiple of the page size and of lightning.CHUNK_SIZE); prefix_snapshot_bytes: the
      snapshots' own budget (default an eighth of memory_bytes; on CUDA taken out of the
      default budget, on CPU on top of it).
    - Medusa (an engine given heads): typical_threshold and typical_alpha, typical acceptance
      for sampled requests (Medusa's posterior_threshold and alpha); medusa_nodes: which draft
      tree a step verifies ("auto": per batch size the subtree of the heads' tree, or none, that
      decodes fastest by the step costs warmup measures and the acceptance the heads were
      measured at, corrected by what recent steps accepted; N: the N-node subtree at every
      step; 0: never; sala/engine/medusa_decoding.py); medusa_max_batch: verify only while at
      most this many requests decode (None: no cap).

    Resolved (`resolve`): device, model (the model's config), kv_plan as a KVPlan, memory (the
    MemoryPlan), and every None size above as the engine uses it.
    """

    memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    max_seqs: int | None = None
    max_batch_tokens: int | None = None
    max_model_len: int | None = None
    max_waiting: int = 256
    page_size: int = PAGE_SIZE
    batch_invariant: bool = False
    compile: bool = True
    kv_plan: KVPlan | dict | str | Path | None = None
    prefix_cache: bool = True
    prefix_snapshot_interval: int = 512
    prefix_snapshot_bytes: int | None = None
    typical_threshold: float = TYPICAL_THRESHOLD
    typical_alpha: float = TYPICAL_ALPHA
    medusa_nodes: int | str = "auto"
    medusa_max_batch: int | None = None
    # Filled in by `resolve`.
    device: torch.device | None = None
    model: object = None  # the model's config (SALAConfig)
    memory: MemoryPlan | None = None

    def __post_init__(self):
        for name in ("max_seqs", "max_batch_tokens", "max_model_len", "memory_bytes", "prefix_snapshot_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"{name}={value!r} must be a positive integer (or None for the default)")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        if self.max_waiting <= 0 or self.page_size <= 0:
            raise ValueError(f"max_waiting={self.max_waiting} and page_size={self.page_size} must be positive")
        unit = math.lcm(self.page_size, lightning.CHUNK_SIZE)
        if self.prefix_cache and (self.prefix_snapshot_interval <= 0 or self.prefix_snapshot_interval % unit):
            raise ValueError(f"prefix_snapshot_interval={self.prefix_snapshot_interval} must be a positive multiple of "
                             f"{unit} (the page size {self.page_size} and the lightning chunk {lightning.CHUNK_SIZE})")
        object.__setattr__(self, "medusa_max_batch", parse_max_batch(self.medusa_max_batch))
        object.__setattr__(self, "medusa_nodes", parse_nodes(self.medusa_nodes))

    @property
    def granule(self) -> int:
        """Where a prompt chunk may end short of its prompt: anywhere, or in the evaluation mode
        only at multiples of the lightning chunk, so that where a prompt is cut never depends on the load."""
        return lightning.CHUNK_SIZE if self.batch_invariant else 1

    @property
    def compiled(self) -> bool:
        """Whether the decode step runs compiled (CPU) or from CUDA graphs."""
        return self.compile and not self.batch_invariant

    def resolve(self, model, tree_rows: int | None = None) -> EngineConfig:
        """This configuration for `model` (its parameters' device and dtype): the cache plan
        checked against the model, the memory planned, every default size filled in.
        `tree_rows`: the nodes of a Medusa tree (a verifying request's rows in a step), or None."""
        config, param = model.config, next(model.parameters())
        device = param.device
        kind = "cuda" if device.type == "cuda" else "cpu"
        max_model_len = min(self.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
        max_seqs = self.max_seqs or MAX_SEQS[kind]
        # Checked against the model before anything is allocated: a bad plan fails at start-up.
        kv_plan = default_plan(config, param.dtype) if self.kv_plan is None else load_plan(self.kv_plan, config)
        memory_bytes, snapshot_bytes = self.memory_bytes, self.prefix_snapshot_bytes
        if memory_bytes is None:
            memory_bytes = default_budget(config, device, self.gpu_memory_utilization, max_seqs, max_model_len,
                                          self.page_size, kv_plan)
        if self.prefix_cache and snapshot_bytes is None:
            snapshot_bytes = memory_bytes // 8
            if self.memory_bytes is None and kind == "cuda":
                memory_bytes -= snapshot_bytes
        memory = plan_memory(config, memory_bytes, max_seqs, max_model_len, self.page_size, kv_plan)
        max_batch_tokens = self.max_batch_tokens or max(MAX_BATCH_TOKENS[kind], memory.max_seqs + self.granule,
                                                        min(memory.max_seqs, 16) * (tree_rows or 1) + self.granule)
        if max_batch_tokens < memory.max_seqs + self.granule - 1:
            raise ValueError(f"max_batch_tokens={max_batch_tokens} must be at least max_seqs={memory.max_seqs}"
                             + (f" + {self.granule - 1} (one prefill granule)" if self.granule > 1 else ""))
        return dataclasses.replace(self, device=device, model=config, kv_plan=kv_plan, memory=memory,
                                   memory_bytes=memory_bytes, prefix_snapshot_bytes=snapshot_bytes,
                                   max_model_len=max_model_len, max_seqs=memory.max_seqs, max_batch_tokens=max_batch_tokens)
