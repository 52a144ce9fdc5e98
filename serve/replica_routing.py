"""The prefix router's side in each SalaServer replica (serve/router.py is the ingress's side):
running a request the routing ingress relays through the replica's own HTTP app, and the
record of the prompts relayed here, from which the replica tells the router which of them its
prefix cache still holds.
"""
from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from typing import AsyncIterator

from ray import serve
from starlette.types import ASGIApp

from serve.client import EngineClient
from serve.router import REPLICA_HEADER, RoutedRequest, block_hashes


async def relay(app: ASGIApp, request: RoutedRequest, served: ServedPrompts) -> AsyncIterator[dict]:
    """An HTTP request relayed by PrefixRoutingIngress, run through `app`: its ASGI messages, the
    response's headers naming this replica. The prompt key goes to the route in the request's
    state (Starlette's `request.state`), and from there to the server method that queues the
    prompt, which records its tokens under it. Closing the generator (the client left) is a
    disconnect to the app, which cancels the engine requests."""
    messages: asyncio.Queue = asyncio.Queue()
    left = asyncio.Event()
    body = [{"type": "http.request", "body": request.body, "more_body": False}]
    scope = {**request.scope, "state": {"prompt_key": request.prompt_key}}

    async def receive() -> dict:
        if body:
            return body.pop()
        await left.wait()
        return {"type": "http.disconnect"}

    async def run():
        try:
            await app(scope, receive, messages.put)
        finally:
            messages.put_nowait(None)

    replica = serve.get_replica_context().replica_id.unique_id.encode()
    if request.prompt_key is not None:
        served.begin(request.prompt_key)
    task = asyncio.create_task(run())
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, replica)]}
            yield message
        await task
    finally:
        left.set()
        if not task.done():
            task.cancel()
        if request.prompt_key is not None:
            served.end(request.prompt_key)


class ServedPrompts:
    """A replica's record of the prompt keys relayed to it (the `max_keys` most recent), each with
    its tokens, to tell the router which it still holds. How much of each its prefix cache could
    resume from is looked up again only for new keys, or for all once the cache has evicted."""

    def __init__(self, max_keys: int = 1024):
        self.max_keys = max_keys
        self.tokens: OrderedDict[str, list[int]] = OrderedDict()
        self.in_flight: Counter[str] = Counter()  # keys with a request running here: about to be held
        self.depth: dict[str, int] = {}  # resumable tokens of each key at the last look-up
        self.evictions_seen = -1  # the prefix cache's evicted-page count at the last look-up
        self.hashes: dict[tuple[str, int], list[int]] = {}  # block_hashes, once per key

    def begin(self, key: str) -> None:
        self.in_flight[key] += 1

    def end(self, key: str) -> None:
        self.in_flight[key] -= 1
        if not self.in_flight[key]:
            del self.in_flight[key]

    def add(self, key: str, token_ids: list[int]) -> None:
        self.tokens[key] = token_ids
        self.tokens.move_to_end(key)
        self.depth.pop(key, None)
        while len(self.tokens) > self.max_keys:
            self._drop(next(iter(self.tokens)))

    def to_look_up(self, tokens: dict[str, list[int]], num_evicted: int) -> dict[str, list[int]]:
        """Of `tokens` (a copy of self.tokens), those whose depth may have changed."""
        return tokens if num_evicted != self.evictions_seen else {k: v for k, v in tokens.items() if k not in self.depth}

    def held_blocks(self, looked_up: dict[str, int], num_evicted: int, block_chars: int) -> list[int]:
        """The blocks still held, given `looked_up` (key -> how many of its tokens the prefix
        cache could resume from, counted at `num_evicted` evicted pages): of each key the
        characters in proportion to those tokens, all of it while a request for it runs here or
        when it came after the look-up. Keys with nothing held are forgotten."""
        self.evictions_seen = num_evicted
        self.depth.update({k: d for k, d in looked_up.items() if k in self.tokens and k not in self.in_flight})
        held = []
        for key in list(self.tokens) + [k for k in self.in_flight if k not in self.tokens]:
            depth = self.depth.get(key) if key not in self.in_flight else None
            chars = len(key) if depth is None else len(key) * depth // max(len(self.tokens[key]), 1)
            if not chars:
                self._drop(key)
                continue
            if (key, block_chars) not in self.hashes:
                self.hashes[key, block_chars] = block_hashes(key, block_chars)
            held += self.hashes[key, block_chars][: chars // block_chars]
        return held

    def _drop(self, key: str) -> None:
        self.tokens.pop(key, None)
        self.depth.pop(key, None)
        for k in [k for k in self.hashes if k[0] == key]:
            del self.hashes[k]

    async def summary(self, client: EngineClient, block_chars: int) -> list[int]:
        """held_blocks, from what the engine's prefix cache could resume now."""
        tokens = dict(self.tokens)
        evicted, looked_up = await client.cached_prefix_lens(lambda evicted: self.to_look_up(tokens, evicted))
        return self.held_blocks(looked_up, evicted, block_chars)
