"""Continuous batching with chunked prefill, pages on demand, preemption and a bounded queue.

Each step runs every running request that is decoding (one token each), then spends what is
left of the token budget on prompt chunks: first requests already part-way through their
prompt, then waiting requests in arrival order, admitted while a state slot and the pages of
their first chunk are free. A waiting request that does not fit right now is passed over, so
it never blocks smaller ones behind it. A long prompt is spread over several steps and never
stalls the decoders.

Pages are taken as sequences grow. When a running request needs a page and none is free, the
most recently admitted request is preempted: its pages and state slot are freed and it goes
back to the front of the queue, to recompute its prompt and the tokens it already generated
(a lightning state cannot be rebuilt any other way) and continue exactly where it was. With
`batch_invariant` (the evaluation mode) only the prompt is prefilled again and the
generated tokens are recomputed by one decode step each, as they were first computed, so the
recomputed cache is bitwise the one that was freed.

With a prefix cache (sala/engine/prefix.py, inside the cache pool) a waiting request is
admitted from the deepest snapshot it matches, and a chunk never runs past the next snapshot
interval, so that the lightning state there exists to be snapshotted. Cached pages count as free.

What a decoding request costs is the step's decoding's (sala/engine/decoding.py): one row and
its next position for plain decoding; for a Medusa verify step its tree's nodes in rows of the
budget and pages for the deepest path it may accept.

In the evaluation mode a chunk ends only at a multiple of the config's `granule` (or at the
end of the tokens), so where a prompt is cut never depends on the load.

The waiting queue is bounded: `add` raises QueueFull instead of growing without limit (the
server answers 503 with Retry-After). `add` and `cancel` may be called from any thread; all
other methods belong to the engine's step thread.
"""
from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, NamedTuple

from sala.engine.cache import CachePool
from sala.engine.config import EngineConfig
from sala.engine.memory import CacheFull
from sala.engine.request import Request

if TYPE_CHECKING:
    from sala.engine.decoding import DecodeStep, Decoding


class QueueFull(RuntimeError):
    """The waiting queue is at its limit; try again later."""


class Chunk(NamedTuple):
    """Prompt positions start .. end - 1 of a request, run in one step."""

    request: Request
    start: int
    end: int


@dataclass
class Schedule:
    decoding: DecodeStep  # how this step decodes `decodes`
    decodes: list[Request] = field(default_factory=list)
    prefills: list[Chunk] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes) + sum(end - start for _, start, end in self.prefills)


class Scheduler:
    def __init__(self, config: EngineConfig, cache: CachePool, decoding: Decoding):
        self.config, self.cache, self.decoding = config, cache, decoding
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order: the last one is preempted first
        self.num_preemptions = 0
        self.lock = threading.Lock()

    def add(self, req: Request) -> None:
        if req.capacity > self.cache.max_tokens:
            raise CacheFull(f"prompt + max_tokens = {req.capacity} tokens exceeds the cache ({self.cache.max_tokens} tokens)")
        with self.lock:
            if len(self.waiting) >= self.config.max_waiting:
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
        decoding = [r for r in self.running if not r.prefilling]
        # Whether prompt chunks may join the step (a prompt part-way, or one waiting with a seat free).
        prompts = len(decoding) < len(self.running) or self._seat_for_waiting()
        step = self.decoding.for_step(decoding, prompts)
        batch = Schedule(step)
        for r in decoding:  # in admission order; a request preempted for an earlier one's pages is gone from running
            if r in self.running and self._grow_or_preempt(r, min(r.num_computed + 1 + step.lookahead, r.capacity)):
                batch.decodes.append(r)
        if not batch.decodes:
            batch.decoding = self.decoding.for_step([])
        budget = self.config.max_batch_tokens - len(batch.decodes) * step.rows
        for r in self.running:
            if r.prefilling and budget > 0:
                # Prompt chunks take only free pages: preempting here could evict a request already scheduled.
                room = (len(r.pages) + self.cache.num_free_pages) * self.cache.page_size - r.num_computed
                end = self._chunk_end(r, min(budget, room))
                if end > r.num_computed:
                    self.cache.grow(r, end)
                    batch.prefills.append(Chunk(r, r.num_computed, end))
                    budget -= end - r.num_computed
        with self.lock:
            passed_over = deque()
            while budget > 0 and self._seat_for_waiting():
                r = self.waiting.popleft()
                hit = self.cache.match(r)
                r.num_computed = hit.length if hit else 0
                end = self._chunk_end(r, budget)
                if end == r.num_computed or not self.cache.can_admit(end, hit):
                    r.num_computed = 0
                    passed_over.append(r)
                    continue
                self.cache.admit(r, hit)
                self.cache.grow(r, end)
                self.running.append(r)
                batch.prefills.append(Chunk(r, r.num_computed, end))
                budget -= end - r.num_computed
            self.waiting.extendleft(reversed(passed_over))
        if not batch.num_tokens and self.running:
            # Every running request is part-way through a prompt and the pages are gone: free some.
            self.preempt(self.running[-1])
            return self.schedule()
        return batch

    def _seat_for_waiting(self) -> bool:
        """Whether a request waits and a seat is free for it."""
        return bool(self.waiting) and len(self.running) < self.config.max_seqs

    def _chunk_end(self, r: Request, budget: int) -> int:
        total = r.prefill_end
        end = min(total, r.num_computed + budget)
        if prefix := self.cache.prefix:  # stop at the next snapshot position
            end = min(end, (r.num_computed // prefix.interval + 1) * prefix.interval)
        if end < total:
            end -= end % self.config.granule
        return max(end, r.num_computed)

    def _grow_or_preempt(self, r: Request, n_tokens: int) -> bool:
        """Pages for r's first n_tokens, preempting the most recently admitted requests as needed
        (r itself, when it is the most recent: then False). Called for decodes in admission
        order, so a victim is never one already scheduled this step."""
        while not self.cache.grow(r, n_tokens):
            victim = self.running[-1]
            self.preempt(victim)
            if victim is r:
                return False
        return True

    def preempt(self, r: Request) -> None:
        self.running.remove(r)
        self.cache.free(r)
        r.num_computed = 0
        r.recompute_by_decode = self.config.batch_invariant and bool(r.output_ids)
        self.num_preemptions += 1
        with self.lock:
            self.waiting.appendleft(r)

    def finish(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self.cache.free(req)
