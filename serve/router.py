"""Prefix-aware routing across SalaServer replicas: a request whose prompt shares a prefix with
earlier ones goes to the replica that served them, whose prefix cache holds that prefix's K/V
pages and lightning-state snapshots (SGLang's cache-aware router, Ray Serve LLM's
PrefixCacheAffinityRouter).

Serve's HTTP proxy hands the ingress replica the request's ASGI scope and streams the body after
routing, so no router of the ingress deployment ever sees a prompt. Hence, with
`prefix_routing` on, the app is two deployments: `PrefixRoutingIngress` (no model, no CPU
reserved) reads each body, takes the prompt out of it and passes the whole HTTP request, its
prompt beside it, through a DeploymentHandle to `SalaServer.routed`, which runs it through its
own FastAPI app; SalaServer's handle routes with `PrefixAffinityRouter`, a Serve
`RequestRouter` (`RequestRouterConfig(request_router_class=...)`) that reads the prompt.

The router's view of each replica's cache is its own record of where it sent which prompts,
in blocks of `block_chars` characters, least recently used dropped past `max_blocks`; a replica
evicting its cache is not seen (as SGLang's router, whose tree also only approximates).
"""
from __future__ import annotations

import asyncio
import json
import logging
import random
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, Iterable

from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

log = logging.getLogger("sala.serve")
REPLICA_HEADER = b"x-sala-replica"  # on every response through the router: which replica answered
SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "root_path", "query_string",
              "headers", "client", "server")  # what of an HTTP scope crosses to the replica (all picklable)


@dataclass
class RoutedRequest:
    """One HTTP request on its way from the ingress to a SalaServer replica. The router reads
    `prompt_key`; the replica runs `scope` and `body` through its FastAPI app."""
    scope: dict
    body: bytes
    prompt_key: str | None


def prompt_key(path: str, body: bytes) -> str | None:
    """What of a request decides which cache can serve it: the prompt of /v1/completions and
    /generate (text, or token ids one character each; of a batch, the first), the messages of
    /v1/chat/completions as JSON (content first, so a shared leading message is a shared prefix).
    None for other endpoints and for bodies the replica will refuse anyway."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return None
    if not isinstance(data, dict):
        return None
    if path == "/v1/chat/completions":
        messages = data.get("messages")
        return json.dumps(messages, sort_keys=True, ensure_ascii=False) if isinstance(messages, list) else None
    if path == "/v1/completions":
        prompt = data.get("prompt")
    elif path == "/generate":
        prompt = data.get("text") if data.get("text") is not None else data.get("input_ids")
    else:
        return None
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(isinstance(t, int) and 0 <= t < 0x110000 for t in prompt):
        return "".join(map(chr, prompt))
    return None


class PrefixMap:
    """Which replicas were sent which prompt prefixes, as chained hashes of `block_chars`-character
    blocks (a block's hash covers everything before it, as the engine's page trie keys pages by
    their whole prefix). Only whole blocks count. Least recently used blocks go past `max_blocks`,
    deepest first (a block is touched after the ones below it), so what is kept stays reachable."""

    def __init__(self, block_chars: int = 256, max_blocks: int = 1 << 16):
        self.block_chars, self.max_blocks = block_chars, max_blocks
        self.holders: OrderedDict[int, set[Hashable]] = OrderedDict()
        self.num_held: Counter[Hashable] = Counter()  # blocks each replica holds

    def hashes(self, key: str) -> list[int]:
        out, h, b = [], 0, self.block_chars
        for i in range(0, len(key) - b + 1, b):
            h = hash((h, key[i : i + b]))
            out.append(h)
        return out

    def match(self, key: str, replicas: Iterable[Hashable]) -> dict[Hashable, int]:
        """Characters of `key`'s longest recorded prefix, for each of `replicas`."""
        matched = dict.fromkeys(replicas, 0)
        alive = set(matched)
        for h in self.hashes(key):
            alive &= self.holders.get(h, set())
            if not alive:
                break
            for r in alive:
                matched[r] += self.block_chars
        return matched

    def insert(self, key: str, replica: Hashable) -> None:
        hashes = self.hashes(key)
        for h in hashes:
            holders = self.holders.setdefault(h, set())
            if replica not in holders:
                holders.add(replica)
                self.num_held[replica] += 1
        for h in reversed(hashes):  # the root block becomes the most recent: eviction takes leaves first
            self.holders.move_to_end(h)
        while len(self.holders) > self.max_blocks:
            _, holders = self.holders.popitem(last=False)
            self.num_held.subtract(holders)

    def remove(self, replica: Hashable) -> None:
        for h in [h for h, holders in self.holders.items() if replica in holders]:
            self.holders[h].discard(replica)
            if not self.holders[h]:
                del self.holders[h]
        self.num_held.pop(replica, None)


@dataclass(frozen=True)
class RoutingOptions:
    """PrefixAffinityRouter's settings (serve/config.yaml's prefix_routing_options)."""
    block_chars: int = 256  # the granularity of a match
    max_blocks: int = 1 << 16  # blocks remembered over all replicas (16M characters at 256)
    imbalanced_threshold: int = 4  # queue length over the shortest past which affinity gives way to load
    min_match_rate: float = 0.1  # the least fraction of a prompt a match must cover to count

    def __post_init__(self):
        if self.block_chars < 1 or self.max_blocks < 1:
            raise ValueError(f"block_chars and max_blocks must be >= 1, got {self.block_chars} and {self.max_blocks}")
        if self.imbalanced_threshold < 0 or not 0 <= self.min_match_rate <= 1:
            raise ValueError(f"imbalanced_threshold must be >= 0 and min_match_rate in [0, 1], got "
                             f"{self.imbalanced_threshold} and {self.min_match_rate}")


class PrefixAffinityRouter(RequestRouter):
    """Sends a request to the replica holding the longest prefix of its prompt when that match is
    at least `min_match_rate` of the prompt and that replica's queue is at most
    `imbalanced_threshold` requests longer than the shortest; otherwise, so that distinct prefixes
    spread, to the replica holding the fewest cached blocks among those within the threshold.
    Requests without a prompt (GET /metrics, /tokenize, ...) take the power of two choices. Each
    choice is a ranking: when the preferred replicas are full, Serve tries the rest."""

    def initialize_state(self, **options):
        self.options = RoutingOptions(**options)
        self.prefixes = PrefixMap(self.options.block_chars, self.options.max_blocks)

    @staticmethod
    def _key(pending_request: PendingRequest | None) -> str | None:
        args = pending_request.args if pending_request is not None else None
        return getattr(args[0], "prompt_key", None) if args else None

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        key = self._key(pending_request)
        if not key or len(candidate_replicas) < 2:
            return [random.sample(candidate_replicas, min(2, len(candidate_replicas)))]
        queue = {r.replica_id: self.replica_queue_len_cache.get(r.replica_id) or 0 for r in candidate_replicas}
        shortest = min(queue.values())
        balanced = [r for r in candidate_replicas if queue[r.replica_id] - shortest <= self.options.imbalanced_threshold]
        matched = self.prefixes.match(key, [r.replica_id for r in balanced])
        best = max(matched.values())
        if best and best >= self.options.min_match_rate * len(key):
            first = [r for r in balanced if matched[r.replica_id] == best]
        else:
            fewest = min(self.prefixes.num_held[r.replica_id] for r in balanced)
            first = [r for r in balanced if self.prefixes.num_held[r.replica_id] == fewest]
        return [first, [r for r in candidate_replicas if r not in first]]

    def on_request_routed(self, pending_request: PendingRequest, replica_id: ReplicaID, result: Any) -> None:
        if key := self._key(pending_request):
            self.prefixes.insert(key, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        self.prefixes.remove(replica_id)


class RelayedResponse(Response):
    """A response made of a replica's ASGI messages, sent on as they come. Cancelled (the client
    left), it cancels the replica's call, which the replica's app sees as a disconnect."""

    def __init__(self, messages: DeploymentResponseGenerator):
        self.messages, self.background = messages, None

    async def __call__(self, scope, receive, send) -> None:
        started = False
        try:
            async for message in self.messages:
                started = started or message["type"] == "http.response.start"
                await send(message)
        except asyncio.CancelledError:
            self.messages.cancel()
            raise
        except Exception as e:  # no replica could take it (backpressure), or one died mid-request
            log.warning("relay to a replica failed: %r", e)
            if started:
                raise
            await JSONResponse({"error": {"message": f"no replica could serve the request: {type(e).__name__}",
                                          "type": "server_error", "param": None, "code": "unavailable"}}, 503)(scope, receive, send)


@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0})
class PrefixRoutingIngress:
    """The app's HTTP ingress when prefix routing is on: reads the body (at most one byte past the
    replicas' limit, which is then theirs to refuse), finds the prompt, and relays the request to
    the SalaServer replica PrefixAffinityRouter picks. Not a FastAPI ingress: Serve allows one per
    app, and SalaServer is it."""

    def __init__(self, server: DeploymentHandle, max_body_bytes: int = 1 << 20):
        self.server = server.options(method_name="routed", stream=True)
        self.max_body_bytes = max_body_bytes

    async def __call__(self, request: Request) -> Response:
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                break
        scope = request.scope
        path, root = scope["path"], scope.get("root_path", "")
        endpoint = path[len(root) :] if root and path.startswith(root) else path  # the app's own path, under any route_prefix
        routed = RoutedRequest({k: scope[k] for k in SCOPE_KEYS if k in scope}, body, prompt_key(endpoint, body))
        return RelayedResponse(self.server.remote(routed))
