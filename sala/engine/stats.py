"""What the engine reports: its fixed settings, and a snapshot of its counters and queues.

Servers, batch jobs and benchmarks read these, never the scheduler, cache or prefix cache
behind them. `Engine.info()` does not change while the engine lives; `Engine.stats()` is taken
on the step thread (`AsyncEngine.stats()` from an event loop: between two steps), so every
field of one snapshot belongs to the same moment.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from sala.medusa.accept import accept_length


@dataclass(frozen=True)
class LayerBytes:
    """One layer's cache cost as the loaded plan stores it: K/V a token (sparse) or state a sequence (lightning)."""

    layer: int
    kind: str  # "sparse" | "lightning"
    format: str  # bf16 / fp8 / nvfp4 / nvfp4_4over6, or the state dtype fp32 / bf16
    per: str  # "token" | "sequence"
    bytes: int


@dataclass(frozen=True)
class EngineInfo:
    device: str
    max_model_len: int
    vocab_size: int
    max_seqs: int  # sequences the state pool holds
    num_pages: int
    page_size: int
    max_batch_tokens: int  # a step's token budget (chunked prefill)
    max_waiting: int  # the queue's bound
    compiled_decode: bool  # the compiled (CPU) or CUDA-graph decode step is on
    kv_bytes_per_token: int  # all sparse layers
    state_bytes_per_seq: int  # all lightning layers
    layers: tuple[LayerBytes, ...] = ()

    @property
    def max_kv_tokens(self) -> int:
        return self.num_pages * self.page_size


@dataclass(frozen=True)
class PrefixStats:
    queried_tokens: int  # prompt tokens of admitted requests
    hit_tokens: int  # of which were taken from the cache
    evictable_pages: int  # cached pages no request holds
    evicted_pages: int
    snapshot_bytes: int  # memory holding lightning-state snapshots now
    snapshot_capacity_bytes: int

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0


@dataclass(frozen=True)
class ChosenTree:
    """What a Medusa engine verifies now at one batch size class (1, 2, 4, ...: a batch of n
    requests is in the largest class <= n) for one kind of batch, once its steps are timed."""

    batch: int
    kind: str  # "greedy", "tempered" (sampled by temperature alone) or "eager" (any other)
    nodes: int  # tree nodes verified a request (0: plain decoding)
    accept_length: float  # expected tokens a verify step of it yields now (1.0 for plain decoding)
    speedup: float  # expected tokens/s over plain decoding, by the running estimates (1.0 for plain decoding)


@dataclass(frozen=True)
class SpeculationStats:
    verify_steps: int
    draft_tokens: int  # tree nodes verified, the roots not counted
    accepted_tokens: int  # drafts kept, bonus tokens not counted
    trees: tuple[ChosenTree, ...]  # the choice per batch size class now (empty until its steps are timed)

    @property
    def accept_length(self) -> float:
        """Tokens per verify step, bonus included."""
        return accept_length(self.verify_steps, self.accepted_tokens)


@dataclass(frozen=True)
class EngineStats:
    waiting: int
    running: int
    free_pages: int  # pages no request and no cached prefix holds
    prompt_tokens: int  # of accepted requests
    generated_tokens: int
    preemptions: int
    finished: dict[str, int] = field(default_factory=dict)  # by finish reason
    prefix: PrefixStats | None = None  # with a prefix cache
    speculation: SpeculationStats | None = None  # with Medusa
