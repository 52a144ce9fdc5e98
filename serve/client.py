"""The engine client: one Engine driven from a replica's event loop, through the public surface
of `sala.engine` only. Queues a request's choices (all or none), merges their streams, aborts,
and reads the engine's settings and stats, between two steps where the step thread owns them.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace
from typing import AsyncIterator, Callable

from sala.engine import AsyncEngine, Engine, EngineStats, InvalidParam, RequestOutput, RequestStream, SamplingParams
from serve.metrics import Metrics
from serve.protocol import Choice, TokenText

MAX_N = 16


@dataclass
class Queued:
    """One choice queued in the engine: its stream, its prompt's token ids, its parameters."""

    stream: RequestStream
    prompt_ids: list[int]
    params: SamplingParams


class EngineClient:
    def __init__(self, engine: Engine, metrics: Metrics, max_tokens_limit: int):
        self.engine, self.metrics, self.max_tokens_limit = engine, metrics, max_tokens_limit
        self.async_engine = AsyncEngine(engine)
        self.info = engine.info()
        self.tokenizer = engine.tokenizer
        self.text_of = TokenText(engine.tokenizer)

    @property
    def alive(self) -> bool:
        return self.async_engine.alive

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids, refused as the engine refuses a prompt (InvalidParam("prompt"): text no
        tokenizer takes, such as a lone surrogate)."""
        return self.engine.encode(text, add_special_tokens)

    def max_tokens(self, requested: int | None, default: int | None, prompt_len: int, param: str = "max_tokens") -> int:
        if requested is None:
            return max(1, min(default or self.max_tokens_limit, self.max_tokens_limit, self.info.max_model_len - prompt_len))
        if isinstance(requested, int) and requested > self.max_tokens_limit:
            raise InvalidParam(param, f"{param}={requested} exceeds this server's limit of {self.max_tokens_limit}")
        return requested

    async def submit(self, prompts: list[str | list[int]], n: int, params_for: Callable[[list[int]], SamplingParams],
                     rids: list[str] | None = None, on_prompt: Callable[[list[int]], None] | None = None) -> list[Queued]:
        """Queue n requests per prompt (seeded choices get seed + j); all or none. With rids (one per
        prompt), choice j of prompt i has request id rids[i] (n = 1) or f"{rids[i]}-{j}". on_prompt
        gets the first prompt's token ids once its choices are queued. A structured-output
        constraint is compiled first, off the event loop (AsyncEngine.prepare): a bad one is
        refused before anything is queued."""
        if not 1 <= n <= MAX_N:
            raise InvalidParam("n", f"n must be between 1 and {MAX_N}, got {n}")
        planned = []
        for prompt in prompts:
            ids = self.engine.encode(prompt)
            planned.append((ids, params_for(ids)))
        for _, params in planned:  # one compile per distinct constraint: the engine caches them
            await self.async_engine.prepare(params)
        ids_of = [[rid if n == 1 else f"{rid}-{j}" for j in range(n)] for rid in rids] if rids else None
        if busy := [i for group in ids_of or [] for i in group if i in self.async_engine.streams]:
            raise InvalidParam("rid", f"rid {busy[0]!r} belongs to a request still running")
        queued: list[Queued] = []
        try:
            for k, (ids, params) in enumerate(planned):
                for j in range(n):
                    seeded = replace(params, seed=params.seed + j) if params.seed is not None else params
                    queued.append(Queued(self.async_engine.submit(ids, seeded, ids_of[k][j] if ids_of else None), ids, seeded))
                if k == 0 and on_prompt is not None:
                    on_prompt(ids)
        except BaseException:
            for q in queued:
                q.stream.cancel()
            raise
        return queued

    @staticmethod
    def choices(queued: list[Queued]) -> list[Choice]:
        return [Choice(i, stop_token_ids=tuple(q.params.stop_token_ids)) for i, q in enumerate(queued)]

    async def merged(self, queued: list[Queued], start: float) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) from all streams as they come; records TTFT and inter-token
        latency. Leaving early (the caller went away) cancels every choice, freeing its cache."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream):
            try:
                async for out in s.outputs():
                    queue.put_nowait((i, out))
            except Exception as e:
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, q.stream)) for i, q in enumerate(queued)]
        last = [None] * len(queued)
        unfinished = len(queued)
        try:
            while unfinished:
                i, out = await queue.get()
                if isinstance(out, Exception):
                    raise out
                if out.token_ids:
                    now = time.perf_counter()
                    (self.metrics.ttft if last[i] is None else self.metrics.itl).observe(now - (last[i] or start))
                    last[i] = now
                unfinished -= out.finished
                yield i, out
        finally:
            for t in tasks:
                t.cancel()
            for q in queued:
                q.stream.cancel()

    def running(self) -> list[str]:
        return self.async_engine.running()

    def abort(self, request_id: str) -> bool:
        return self.async_engine.abort(request_id)

    async def stats(self) -> EngineStats:
        # A stopped step thread takes no calls; with no step running the snapshot is taken here.
        return await self.async_engine.stats() if self.alive else self.engine.stats()

    def between_steps(self, fn: Callable):
        """Await fn() on the step thread between two steps (the engine's own calls: flush_prefix_cache, ...)."""
        return self.async_engine.between_steps(fn)

    async def flush_prefix_cache(self) -> int:
        """Drop every cached prefix page no running request holds; how many went."""
        return await self.between_steps(self.engine.flush_prefix_cache)

    async def cached_prefix_lens(self, pick: Callable[[int], dict[str, list[int]]]) -> tuple[int, dict[str, int]]:
        """Between two steps: the prefix cache's evicted-page count (0 without a prefix cache), and
        for each token list that `pick(evicted)` chooses, how many of its leading tokens a request
        could take from the prefix cache now."""
        def look_up() -> tuple[int, dict[str, int]]:
            prefix = self.engine.stats().prefix
            evicted = 0 if prefix is None else prefix.evicted_pages
            return evicted, {k: self.engine.cached_prefix_len(ids) for k, ids in pick(evicted).items()}

        return await self.between_steps(look_up)
