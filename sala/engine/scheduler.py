"""Continuous batching with chunked prefill and a bounded queue.

Each step runs every running request that is decoding (one token each), then spends what is
left of the token budget on prompt chunks: first requests already part-way through their
prompt, then new requests in arrival order, admitted while a state slot and their pages are
free. A long prompt is thus spread over several steps and never stalls the decoders.

The waiting queue is bounded: `add` raises QueueFull instead of growing without limit (the
server answers 503 with Retry-After). `add` and `cancel` may be called from any thread; all
other methods belong to the engine's step thread.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field

from sala.engine.cache import CacheFull, CachePool
from sala.engine.request import Request


class QueueFull(RuntimeError):
    """The waiting queue is at its limit; try again later."""


@dataclass
class Schedule:
    decodes: list[Request] = field(default_factory=list)
    prefills: list[tuple[Request, int, int]] = field(default_factory=list)  # (request, start, end)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(end - start for _, start, end in self.prefills)


class Scheduler:
    def __init__(self, cache: CachePool, max_batch_tokens: int, max_seqs: int, max_waiting: int):
        if max_batch_tokens < max_seqs:
            raise ValueError(f"max_batch_tokens={max_batch_tokens} must be at least max_seqs={max_seqs}")
        self.cache = cache
        self.max_batch_tokens = max_batch_tokens
        self.max_seqs = max_seqs
        self.max_waiting = max_waiting
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.lock = threading.Lock()

    def add(self, req: Request) -> None:
        if req.capacity > self.cache.max_tokens:
            raise CacheFull(f"prompt + max_tokens = {req.capacity} tokens exceeds the cache ({self.cache.max_tokens} tokens)")
        with self.lock:
            if len(self.waiting) >= self.max_waiting:
                raise QueueFull(f"{len(self.waiting)} requests are already waiting")
            self.waiting.append(req)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def pop_cancelled(self) -> list[Request]:
        with self.lock:
            gone = [r for r in self.waiting if r.cancelled]
            self.waiting = deque(r for r in self.waiting if not r.cancelled)
        gone += [r for r in self.running if r.cancelled]
        for r in gone:
            self.finish(r)
        return gone

    def schedule(self) -> Schedule:
        batch = Schedule(decodes=[r for r in self.running if not r.prefilling])
        budget = self.max_batch_tokens - len(batch.decodes)
        for r in self.running:
            if r.prefilling and budget > 0:
                budget -= self._add_chunk(batch, r, budget)
        with self.lock:
            while budget > 0 and self.waiting and len(self.running) < self.max_seqs:
                if not self.cache.can_allocate(self.waiting[0]):
                    break
                r = self.waiting.popleft()
                self.cache.allocate(r)
                self.running.append(r)
                budget -= self._add_chunk(batch, r, budget)
        return batch

    @staticmethod
    def _add_chunk(batch: Schedule, r: Request, budget: int) -> int:
        n = min(len(r.prompt_ids) - r.num_computed, budget)
        batch.prefills.append((r, r.num_computed, r.num_computed + n))
        return n

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self.cache.free(req)
