"""Prefix-aware routing across SalaServer replicas: a request whose prompt shares a prefix with
earlier ones goes to the replica that served them, whose prefix cache holds that prefix's K/V
pages and lightning-state snapshots (SGLang's cache-aware router, Ray Serve LLM's
PrefixCacheAffinityRouter).

Serve's HTTP proxy hands the ingress replica the request's ASGI scope and streams the body after
routing, so no router of the ingress deployment ever sees a prompt. Hence, with
`prefix_routing` on, the app is two deployments: `PrefixRoutingIngress` (no model, no CPU
reserved) reads each body, takes the prompt out of it and passes the whole HTTP request, its
prompt beside it, through a DeploymentHandle to `SalaServer.routed`, which runs it through its
own FastAPI app (serve/replica_routing.py: the replica's side); SalaServer's handle routes with
`PrefixAffinityRouter`, a Serve `RequestRouter` (`RequestRouterConfig(request_router_class=...)`)
that reads the prompt.

The router's view of each replica's cache is its own record of where it sent which prompts,
in blocks of `block_chars` characters, least recently used dropped past `max_blocks`. Replicas
evict on their own, so every `refresh_interval_s` the ingress asks each replica which of the
prompts it served it still holds (`SalaServer.prefix_summary`: the blocks of each, up to what its
prefix cache could resume from now) and the router forgets the blocks a replica no longer holds,
those routed since the question excepted.

What concerns every replica goes to every replica: the ingress fans GET /metrics out (one
exposition, each replica's series under a `replica` label, as Prometheus scrapes a Serve
deployment's replicas as separate targets and vLLM labels its data-parallel engines) and
POST /abort_request (the replica holding the rid aborts it, the others find nothing). Each copy
is addressed to one replica (`RoutedRequest.replica`), which the router honours.
"""
from __future__ import annotations

import asyncio
import contextvars
import hashlib
import importlib
import json
import logging
import random
import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from typing import Any, Callable, Hashable, Iterable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from ray import serve
from ray.serve.handle import DeploymentHandle, DeploymentResponseGenerator
from ray.serve.request_router import PendingRequest, ReplicaID, RequestRouter, RunningReplica
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from serve.errors import APIError, error_body

log = logging.getLogger("sala.serve")
REPLICA_HEADER = b"x-sala-replica"  # on every response through the router: which replica answered
SCOPE_KEYS = ("type", "asgi", "http_version", "method", "scheme", "path", "raw_path", "root_path", "query_string",
              "headers", "client", "server")  # what of an HTTP scope crosses to the replica (all picklable)


@dataclass
class RoutedRequest:
    """One HTTP request on its way from the ingress to a SalaServer replica. The router reads
    `prompt_key` and `replica` (the unique id of the replica it must go to, or None); the replica
    runs `scope` and `body` through its FastAPI app."""
    scope: dict
    body: bytes
    prompt_key: str | None
    replica: str | None = None


@dataclass
class SummaryRequest:
    """The ingress asking replica `replica` which blocks of the prompts it served it still holds."""
    replica: str
    block_chars: int


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


def block_hashes(key: str, block_chars: int) -> list[int]:
    """Chained hashes of key's whole `block_chars`-character blocks: a block's hash covers
    everything before it, as the engine's page trie keys pages by their whole prefix. The same in
    every process (replicas report blocks by these)."""
    out, h = [], b""
    for i in range(0, len(key) - block_chars + 1, block_chars):
        h = hashlib.blake2b(h + key[i : i + block_chars].encode("utf-8", "surrogatepass"), digest_size=8).digest()
        out.append(int.from_bytes(h, "little"))
    return out


class PrefixMap:
    """Which replicas were sent which prompt prefixes, as `block_hashes`. Only whole blocks count.
    Least recently used blocks go past `max_blocks`, deepest first (a block is touched after the
    ones below it), so what is kept stays reachable. Each holder of a block keeps the time it was
    last sent that block, so a replica's report of what it still holds (`forget_unheld`) spares
    what was routed after it was asked."""

    def __init__(self, block_chars: int = 256, max_blocks: int = 1 << 16):
        self.block_chars, self.max_blocks = block_chars, max_blocks
        self.holders: OrderedDict[int, dict[Hashable, float]] = OrderedDict()  # block -> {replica: last sent}
        self.num_held: Counter[Hashable] = Counter()  # blocks each replica holds

    def hashes(self, key: str) -> list[int]:
        return block_hashes(key, self.block_chars)

    def match(self, key: str, replicas: Iterable[Hashable]) -> dict[Hashable, int]:
        """Characters of `key`'s longest recorded prefix, for each of `replicas`."""
        matched = dict.fromkeys(replicas, 0)
        alive = set(matched)
        for h in self.hashes(key):
            alive &= self.holders.get(h, {}).keys()
            if not alive:
                break
            for r in alive:
                matched[r] += self.block_chars
        return matched

    def insert(self, key: str, replica: Hashable, now: float | None = None) -> None:
        hashes, now = self.hashes(key), time.monotonic() if now is None else now
        for h in hashes:
            holders = self.holders.setdefault(h, {})
            if replica not in holders:
                self.num_held[replica] += 1
            holders[replica] = now
        for h in reversed(hashes):  # the root block becomes the most recent: eviction takes leaves first
            self.holders.move_to_end(h)
        while len(self.holders) > self.max_blocks:
            _, holders = self.holders.popitem(last=False)
            self.num_held.subtract(holders.keys())

    def remove(self, replica: Hashable) -> None:
        self.forget_unheld(replica, set(), float("inf"))
        self.num_held.pop(replica, None)

    def forget_unheld(self, replica: Hashable, held: set[int], asked_at: float) -> int:
        """Drop `replica` from the blocks it was last sent before `asked_at` and does not hold
        (`held`: its report, asked for at `asked_at`); how many it lost."""
        gone = [h for h, holders in self.holders.items() if holders.get(replica, asked_at) < asked_at and h not in held]
        for h in gone:
            del self.holders[h][replica]
            if not self.holders[h]:
                del self.holders[h]
        self.num_held[replica] -= len(gone)
        return len(gone)


@dataclass(frozen=True)
class RoutingOptions:
    """PrefixAffinityRouter's settings (serve/config.yaml's prefix_routing_options)."""
    block_chars: int = 256  # the granularity of a match
    max_blocks: int = 1 << 16  # blocks remembered over all replicas (16M characters at 256)
    imbalanced_threshold: int = 4  # queue length over the shortest past which affinity gives way to load
    min_match_rate: float = 0.1  # the least fraction of a prompt a match must cover to count
    refresh_interval_s: float = 5.0  # how often replicas report what they hold (0: never; evictions go unseen)

    def __post_init__(self):
        if self.block_chars < 1 or self.max_blocks < 1:
            raise ValueError(f"block_chars and max_blocks must be >= 1, got {self.block_chars} and {self.max_blocks}")
        if not self.refresh_interval_s >= 0:
            raise ValueError(f"refresh_interval_s must be >= 0, got {self.refresh_interval_s}")
        if self.imbalanced_threshold < 0 or not 0 <= self.min_match_rate <= 1:
            raise ValueError(f"imbalanced_threshold must be >= 0 and min_match_rate in [0, 1], got "
                             f"{self.imbalanced_threshold} and {self.min_match_rate}")


ROUTERS: dict[tuple[str, str], PrefixAffinityRouter] = {}  # this process's, by (app, deployment)


def routers_in_process() -> dict[tuple[str, str], PrefixAffinityRouter]:
    """ROUTERS of the imported module, not of the caller's globals: Serve unpickles the router
    class by value, with its own copies of the globals it uses, so only the module is shared."""
    return importlib.import_module(__name__).ROUTERS


class PrefixAffinityRouter(RequestRouter):
    """Sends a request to the replica holding the longest prefix of its prompt when that match is
    at least `min_match_rate` of the prompt and that replica's queue is at most
    `imbalanced_threshold` requests longer than the shortest; otherwise, so that distinct prefixes
    spread, to the replica holding the fewest cached blocks among those within the threshold.
    Requests without a prompt (GET /metrics, /tokenize, ...) take the power of two choices. Each
    choice is a ranking: when the preferred replicas are full, Serve tries the rest. A request
    addressed to one replica goes there (to any, if that one is gone: the answer names who took it).

    Serve runs a handle's router in the process holding the handle, so the ingress finds its
    router there (`routers_in_process`) to list the replicas it fans out to and to report what
    they hold."""

    def initialize_state(self, **options):
        self.options = RoutingOptions(**options)
        self.prefixes = PrefixMap(self.options.block_chars, self.options.max_blocks)
        self.lock = threading.Lock()  # the ingress's loop reports and reads while Serve's routes
        routers_in_process()[self._deployment_id.app_name, self._deployment_id.name] = self

    def replica_ids(self) -> list[str]:
        """The replicas requests can go to now (unique ids; Serve replaces the dict, never edits it)."""
        return [r.unique_id for r in self.curr_replicas]

    def report(self, replica: str, held: set[int], asked_at: float) -> int:
        """A replica's answer to `prefix_summary`, asked for at `asked_at` (time.monotonic):
        forget what it no longer holds; how many blocks that was."""
        ids = [r for r in self.curr_replicas if r.unique_id == replica]
        with self.lock:
            return self.prefixes.forget_unheld(ids[0], held, asked_at) if ids else 0

    def blocks_held(self) -> dict[str, int]:
        """Blocks this router believes each current replica holds, by unique id."""
        with self.lock:
            return {r.unique_id: self.prefixes.num_held.get(r, 0) for r in self.curr_replicas}

    @staticmethod
    def _key(pending_request: PendingRequest | None) -> str | None:
        args = pending_request.args if pending_request is not None else None
        return getattr(args[0], "prompt_key", None) if args else None

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        args = pending_request.args if pending_request is not None else None
        if args and (target := getattr(args[0], "replica", None)) is not None:
            return [[r for r in candidate_replicas if r.replica_id.unique_id == target] or candidate_replicas]
        with self.lock:
            return self._choose(candidate_replicas, self._key(pending_request))

    def _choose(self, candidate_replicas: list[RunningReplica], key: str | None) -> list[list[RunningReplica]]:
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
            with self.lock:
                self.prefixes.insert(key, replica_id)

    def on_replica_actor_died(self, replica_id: ReplicaID):
        super().on_replica_actor_died(replica_id)
        with self.lock:
            self.prefixes.remove(replica_id)


class RelayedResponse(Response):
    """A response made of a replica's ASGI messages, sent on as they come. Cancelled (the client
    left), it cancels the replica's call, which the replica's app sees as a disconnect.

    A replica lost before the response has started (its first body bytes, which carry the first
    output: a stream's first event holds a token) costs the client nothing: the request goes
    again, to a live replica, up to `attempts` times. A stream lost after that ends as the
    protocol ends a failed stream, an error event then `[DONE]`, never a silent cut; a
    non-streaming response has no "after that" (its one body is the whole answer). A replica
    lost after the response's last body (before its call's end reached here) costs nothing
    either: the client has its whole answer, and nothing more may be sent on its connection,
    which by then carries its next request. Nor does one lost after a stream's `[DONE]` (a body of
    its own, the empty last body still to come): the response ends there, nothing after `[DONE]`."""

    def __init__(self, call: Callable[[], DeploymentResponseGenerator], attempts: int = 3):
        self.call, self.attempts, self.background = call, attempts, None

    async def __call__(self, scope, receive, send) -> None:
        for attempt in range(1, self.attempts + 1):
            messages, held, streaming, complete, done = self.call(), [], False, False, False
            try:
                async for message in messages:
                    if held is None:
                        await send(message)
                    else:
                        held.append(message)
                        if message["type"] == "http.response.start":
                            streaming = dict(message.get("headers", [])).get(b"content-type", b"").startswith(
                                b"text/event-stream")
                        elif message.get("body") or not message.get("more_body", False):
                            for m in held:  # the response starts: from here on it cannot go elsewhere
                                await send(m)
                            held = None
                    complete = message["type"] == "http.response.body" and not message.get("more_body", False)
                    done = streaming and message.get("body", b"").endswith(STREAM_END)
                return
            except asyncio.CancelledError:
                messages.cancel()
                raise
            except Exception as e:  # the replica died mid-request, or no replica could take it (backpressure)
                if complete:
                    log.info("replica lost after the whole response was sent (%r): nothing to tell the client", e)
                    return
                if done:
                    log.info("replica lost after the stream's [DONE] (%r): the response ends there", e)
                    await send({"type": "http.response.body", "body": b"", "more_body": False})
                    return
                if held is None:
                    log.warning("replica lost mid-response (%r): the stream ends with an error event", e)
                    if streaming:
                        await send({"type": "http.response.body", "body": lost_stream_events(e), "more_body": False})
                    return
                log.warning("relay to a replica failed before the response started (attempt %d of %d): %r", attempt,
                            self.attempts, e)
                if attempt < self.attempts:
                    await asyncio.sleep(0.2 * attempt)  # Serve's router learns of the death meanwhile
                    continue
                await APIError(503, f"no replica could serve the request: {type(e).__name__}", "server_error",
                               code="unavailable").response()(scope, receive, send)


STREAM_END = b"data: [DONE]\n\n"  # a stream's last event (serve/http.py events)


def lost_stream_events(e: Exception) -> bytes:
    """The end of a stream whose replica was lost: OpenAI's in-band error event, then `[DONE]`."""
    body = error_body(f"the replica serving this stream was lost ({type(e).__name__}); the output is incomplete",
                      "server_error", code="replica_lost")
    return f"data: {json.dumps(body)}\n\n".encode() + STREAM_END


# On the head node: every request passes through the ingress, so it goes where the cluster's
# control plane already is, and a lost worker node never takes it (and the requests in it) along.
@serve.deployment(max_ongoing_requests=1024, ray_actor_options={"num_cpus": 0, "resources": {"node:__internal_head__": 0.001}})
class PrefixRoutingIngress:
    """The app's HTTP ingress when prefix routing is on: reads the body (at most one byte past the
    replicas' limit, which is then theirs to refuse), finds the prompt, and relays the request to
    the SalaServer replica PrefixAffinityRouter picks; sends GET /metrics, POST /abort_request and
    POST /flush_cache to every replica and merges their answers; every `refresh_interval_s` has
    the replicas report what they hold. Not a FastAPI ingress: Serve allows one per app, and
    SalaServer is it."""

    def __init__(self, server: DeploymentHandle, max_body_bytes: int = 1 << 20, refresh_interval_s: float = 5.0):
        self.server = server.options(method_name="routed", stream=True)
        self.summaries = server.options(method_name="prefix_summary")
        self.max_body_bytes, self.refresh_interval_s = max_body_bytes, refresh_interval_s
        self.refresher: asyncio.Task | None = None

    def _router(self) -> PrefixAffinityRouter | None:
        """This process's router of the SalaServer handle, once a request has made Serve build it."""
        return routers_in_process().get((self.server.app_name, self.server.deployment_name))

    async def refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(self.refresh_interval_s)
            try:
                if (router := self._router()) is not None:
                    await self.refresh(router)
            except Exception:  # the loop must outlive one bad round
                log.exception("refreshing the router's view of the replicas failed")

    async def refresh(self, router: PrefixAffinityRouter) -> None:
        """Every replica says which blocks it holds; the router forgets the rest."""
        async def ask(replica: str) -> None:
            asked_at = time.monotonic()
            try:
                answered, held = await self.summaries.remote(SummaryRequest(replica, router.options.block_chars))
            except Exception as e:  # a replica going away; the next round asks again
                log.warning("prefix summary of replica %s failed: %r", replica, e)
                return
            router.report(answered, set(held), asked_at)

        await asyncio.gather(*(own_request(ask(r)) for r in router.replica_ids()))

    async def __call__(self, request: Request) -> Response:
        if self.refresher is None and self.refresh_interval_s:
            self.refresher = own_request(self.refresh_forever())
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                break
        scope = request.scope
        path, root = scope["path"], scope.get("root_path", "")
        endpoint = path[len(root) :] if root and path.startswith(root) else path  # the app's own path, under any route_prefix
        routed = RoutedRequest({k: scope[k] for k in SCOPE_KEYS if k in scope}, body, prompt_key(endpoint, body))
        if (scope["method"], endpoint) == ("GET", "/metrics"):
            return merged_metrics(await self.fan_out(routed), self._router())
        if (scope["method"], endpoint) == ("POST", "/abort_request"):
            return merged_json(await self.fan_out(routed), lambda bodies: {"aborted": sum((b["aborted"] for b in bodies), [])})
        if (scope["method"], endpoint) == ("POST", "/flush_cache"):
            return merged_json(await self.fan_out(routed), lambda bodies: {"flushed_pages": sum(b["flushed_pages"] for b in bodies)})
        return RelayedResponse(lambda: self.server.remote(routed))

    async def fan_out(self, routed: RoutedRequest) -> dict[str, Answer]:
        """The request sent to every replica at once: their answers by replica. Before this
        process's router exists (no request has gone through the handle yet), the first copy
        goes to any replica, and the router then names the rest."""
        answers: dict[str, Answer] = {}
        if (router := self._router()) is None:
            answer = await self.answer(routed)
            if answer.replica is not None:
                answers[answer.replica] = answer
            if (router := self._router()) is None:
                return answers
        todo = [r for r in router.replica_ids() if r not in answers]
        for answer in await asyncio.gather(*(own_request(self.answer(replace(routed, replica=r))) for r in todo)):
            if answer.replica is not None:  # a replica that died on the way is left out
                answers.setdefault(answer.replica, answer)
        return answers

    async def answer(self, routed: RoutedRequest) -> Answer:
        """One replica's whole response to `routed`."""
        status, headers, body = 503, [], b""
        try:
            async for message in self.server.remote(routed):
                if message["type"] == "http.response.start":
                    status, headers = message["status"], message.get("headers", [])
                elif message["type"] == "http.response.body":
                    body += message.get("body", b"")
        except Exception as e:  # the replica died, or none could take it
            log.warning("fan-out to a replica failed: %r", e)
            return Answer(None, 503, {}, b"")
        named = {bytes(k).lower(): bytes(v) for k, v in headers}
        replica = named.get(REPLICA_HEADER)
        return Answer(replica.decode() if replica else None, status, named, body)


def own_request(coro) -> asyncio.Task:
    """coro as a task in an empty context: Serve keys a handle call's pending request by the
    request id it inherits from its caller's context, so copies of one HTTP request (or calls
    from a task it started) sharing that id get crossed; in a fresh context each call gets its own."""
    return asyncio.create_task(coro, context=contextvars.Context())


@dataclass
class Answer:
    """A replica's response, whole: who sent it (None: no replica answered), status, headers, body."""
    replica: str | None
    status: int
    headers: dict[bytes, bytes]
    body: bytes


def unavailable() -> JSONResponse:
    return APIError(503, "no replica answered", "server_error", code="unavailable").response()


def merged_metrics(answers: dict[str, Answer], router: PrefixAffinityRouter | None) -> Response:
    """One Prometheus exposition of every replica's: each family once, its samples from each
    replica with `replica` added to their labels. Not summed: a sum of counters goes backwards
    when a replica restarts, and `sum without (replica)` in PromQL is the total. Then the router's
    own view: the prompt blocks it believes each replica caches."""
    families: dict[str, Metric] = {}
    if router is not None:
        view = families["sala_router_prefix_blocks"] = Metric(
            "sala_router_prefix_blocks", "Prompt blocks the prefix-aware router believes the replica caches", "gauge")
        for replica, n in sorted(router.blocks_held().items()):
            view.add_sample("sala_router_prefix_blocks", {"replica": replica}, n)
    for replica in sorted(answers):
        a = answers[replica]
        if a.status != 200:
            continue
        for f in text_string_to_metric_families(a.body.decode()):
            merged = families.setdefault(f.name, Metric(f.name, f.documentation, f.type, f.unit))
            for s in f.samples:
                merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
    if not any(a.status == 200 for a in answers.values()):
        return unavailable()
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Families(list(families.values())))
    return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)


class Families:
    """A collector yielding fixed metric families."""

    def __init__(self, families: list[Metric]):
        self.families = families

    def collect(self):
        return iter(self.families)


def merged_json(answers: dict[str, Answer], merge: Callable[[list[dict]], dict]) -> Response:
    """One JSON answer from every replica's (/abort_request: the ids any of them aborted;
    /flush_cache: the pages all flushed). A request refused (bad key, bad body) is refused alike
    by every replica: the first refusal is the answer."""
    if not answers:
        return unavailable()
    for a in answers.values():
        if a.status != 200:
            return Response(a.body, a.status, media_type=a.headers.get(b"content-type", b"application/json").decode())
    return JSONResponse(merge([json.loads(a.body) for a in answers.values()]))
