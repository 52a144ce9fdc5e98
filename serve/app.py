"""Ray Serve app: the SALA engine behind an OpenAI-compatible and an SGLang-style HTTP API.

    serve run serve/config.yaml                                   # tiny-sala on 127.0.0.1:8000
    python -m serve.app --model models:/sala@champion --port 8000  # the same, from Python, served as `sala`

One deployment holds one engine and its FastAPI ingress, so tokens go from the engine's step
thread to the HTTP stream without crossing processes. Endpoints: /v1/models,
/v1/completions, /v1/chat/completions, /generate, /tokenize, /detokenize, /abort_request,
/flush_cache, /get_model_info, /get_server_info (SGLang's), /health and /metrics (Prometheus).
With SALA_API_KEY set (or `api_key=`), every endpoint but /health and /metrics needs
`Authorization: Bearer KEY`.
The served model is named after the checkpoint (the registered model, or the directory) unless
`served_model_name` gives one or more names; a request may name any of them, or none.
A client that goes away mid-request cancels its engine requests, which frees their cache.
"""
# No `from __future__ import annotations` here: Serve's class-based routes need FastAPI to see
# the real `Request` class in their signatures, not a string.
import argparse
import asyncio
import hmac
import json
import logging
import os
import shlex
import signal
import sys
import sysconfig
import threading
import time
import uuid
from dataclasses import replace
from typing import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from jinja2 import TemplateError
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayActorError, TaskCancelledError
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import RayServeException
from starlette.exceptions import HTTPException

from registry.models import model_name, resolve_model_path
from sala.checkpoint import DeviceUnavailable, gpu_device, read_config
from sala.engine import AsyncEngine, Engine, InvalidParam, QueueFull, RequestOutput, RequestStream, SamplingParams
from sala.engine.speculation import SpeculationSettingError, parse_max_batch
from sala.kv import KVPlanError, load_plan
from sala.medusa.heads import has_medusa
from serve.protocol import (
    PARAM_NAMES,
    AbortRequest,
    APIError,
    ChatCompletionRequest,
    Choice,
    CompletionRequest,
    DetokenizeRequest,
    GenerateRequest,
    TokenizeRequest,
    TokenText,
    chat_logprobs,
    completion_logprobs,
    schema_error,
    sglang_finish_reason,
    sglang_logprobs,
    spec_stats,
    token_id_text,
    usage,
)
from serve.router import (
    REPLICA_HEADER,
    PrefixAffinityRouter,
    PrefixRoutingIngress,
    RoutedRequest,
    RoutingOptions,
    ServedPrompts,
    SummaryRequest,
)

log = logging.getLogger("sala.serve")
api = FastAPI(title="sala", docs_url=None, redoc_url=None)
MAX_N = 16
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30)


class Metrics:
    """HTTP-side counters and latency histograms, the engine's own totals read at scrape time, and
    the replica process's memory and CPU (process_resident_memory_bytes, ...)."""

    def __init__(self, engine: Engine):
        self.registry = r = CollectorRegistry()
        self.requests = Counter("sala_requests", "HTTP requests by endpoint and status", ["endpoint", "status"], registry=r)
        self.ttft = Histogram("sala_time_to_first_token_seconds", "Arrival to first token", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("sala_inter_token_latency_seconds", "Gap between consecutive tokens of a request",
                             buckets=LATENCY_BUCKETS, registry=r)
        r.register(EngineCollector(engine))
        ProcessCollector(registry=r)


class EngineCollector:
    def __init__(self, engine: Engine):
        self.engine = engine

    def collect(self):
        e = self.engine
        yield GaugeMetricFamily("sala_queue_depth", "Requests waiting for admission", value=e.scheduler.num_waiting)
        yield GaugeMetricFamily("sala_running_requests", "Requests holding cache", value=len(e.scheduler.running))
        yield CounterMetricFamily("sala_prompt_tokens", "Prompt tokens of accepted requests", value=e.num_prompt_tokens)
        yield CounterMetricFamily("sala_generation_tokens", "Tokens generated", value=e.num_generated_tokens)
        yield CounterMetricFamily("sala_preemptions", "Requests preempted when the K/V pages ran out (recomputed later)",
                                  value=e.num_preemptions)
        yield GaugeMetricFamily("sala_kv_pages_free", "Free K/V cache pages", value=len(e.cache.free_pages))
        yield GaugeMetricFamily("sala_kv_pages", "K/V cache pages in all", value=e.cache.plan.num_pages)
        if p := e.prefix:
            yield CounterMetricFamily("sala_prefix_cache_queried_tokens", "Prompt tokens looked up in the prefix cache",
                                      value=p.num_queried_tokens)
            yield CounterMetricFamily("sala_prefix_cache_hit_tokens", "Prompt tokens taken from the prefix cache "
                                      "(cached_tokens)", value=p.num_hit_tokens)
            yield GaugeMetricFamily("sala_prefix_cache_hit_rate", "Cached prompt tokens / prompt tokens looked up",
                                    value=p.hit_rate)
            yield GaugeMetricFamily("sala_prefix_cache_pages", "K/V pages held by the prefix cache and no request",
                                    value=p.num_evictable)
            yield GaugeMetricFamily("sala_prefix_snapshot_bytes", "Memory holding lightning-state snapshots",
                                    value=p.num_snapshots * p.snapshot_bytes)
            yield GaugeMetricFamily("sala_prefix_snapshot_capacity_bytes", "The snapshots' budget",
                                    value=p.max_snapshots * p.snapshot_bytes)
            yield CounterMetricFamily("sala_prefix_cache_evicted_pages", "Cached pages taken back for new requests",
                                      value=p.num_evicted_pages)
        yield GaugeMetricFamily("sala_kv_cache_bytes_per_token", "K/V bytes one token takes in all sparse layers, as the "
                                "loaded cache plan stores them", value=e.cache.plan.kv_bytes_per_token)
        yield GaugeMetricFamily("sala_state_bytes_per_sequence", "Lightning state bytes one sequence takes in all "
                                "lightning layers, as the loaded cache plan stores them", value=e.cache.plan.state_bytes_per_seq)
        per_layer = GaugeMetricFamily("sala_cache_layer_bytes", "Cache bytes of one layer: K/V a token (sparse) or "
                                      "state a sequence (lightning)", labels=["layer", "kind", "format", "per"])
        plan, config = e.kv_plan, e.model.config
        for i, b in plan.kv_bytes_per_token(config).items():
            per_layer.add_metric([str(i), "sparse", plan.kv[i], "token"], b)
        for i, b in plan.state_bytes_per_seq(config).items():
            per_layer.add_metric([str(i), "lightning", plan.state[i], "sequence"], b)
        yield per_layer
        finished = CounterMetricFamily("sala_finished_requests", "Finished requests by reason", labels=["reason"])
        for reason in ("stop", "length", "cancelled"):
            finished.add_metric([reason], e.num_finished[reason])
        yield finished
        if e.spec is not None:  # Medusa: mean accept length = 1 + accepted / verify steps (bonus included, as vLLM / SGLang)
            yield CounterMetricFamily("sala_spec_verify_steps", "Medusa tree-verify steps", value=e.spec.verify_steps)
            yield CounterMetricFamily("sala_spec_draft_tokens", "Drafted tokens verified (tree nodes below the root)",
                                      value=e.spec.draft_tokens)
            yield CounterMetricFamily("sala_spec_accepted_tokens", "Drafted tokens accepted (the bonus token not counted)",
                                      value=e.spec.accepted_tokens)
            yield GaugeMetricFamily("sala_spec_accept_length", "Tokens per verify step, bonus included",
                                    value=e.spec.accept_length)
            yield GaugeMetricFamily("sala_spec_max_batch", "Largest decode batch that verifies draft trees now "
                                    "(medusa_max_batch; above it steps decode plainly)",
                                    value=e.speculation.largest_batch(e.cache.plan.max_seqs))


@api.exception_handler(HTTPException)
async def http_error(request: Request, e: HTTPException) -> JSONResponse:
    """Routing errors (an unknown path, a wrong method) in the same JSON shape as every other error."""
    message = {404: f"no such endpoint: {request.url.path}", 405: f"{request.method} is not allowed on {request.url.path}"}
    return JSONResponse({"error": {"message": message.get(e.status_code, str(e.detail)), "type": "invalid_request_error",
                                   "param": None, "code": None}}, e.status_code, headers=getattr(e, "headers", None))


def sse(payload: dict | str) -> str:
    return f"data: {payload if isinstance(payload, str) else json.dumps(payload)}\n\n"


class EventStream(StreamingResponse):
    """An SSE response that takes Serve's word for a disconnect. Under Serve, `receive()` raises
    TaskCancelledError when the client has gone instead of returning `http.disconnect`; raised
    from starlette's disconnect listener, it would end the request with an exception that nobody
    retrieves: a "Future exception was never retrieved" traceback in the replica log for every
    client that leaves. A client leaving is normal: Serve logs its one line, the stream stops."""

    async def listen_for_disconnect(self, receive) -> None:
        try:
            await super().listen_for_disconnect(receive)
        except TaskCancelledError:
            pass


# Defined before SalaServer: Serve freezes the class's globals when it is decorated.
def served_names(served_model_name: str | list[str] | None) -> list[str]:
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name or [])
    if any(not isinstance(n, str) or not n for n in names):
        raise ValueError(f"served_model_name must be a non-empty string or a list of them, got {served_model_name!r}")
    return names


@serve.deployment(max_ongoing_requests=256, health_check_period_s=10, health_check_timeout_s=30)
@serve.ingress(api)
class SalaServer:
    def __init__(self, model: str | None = None, served_model_name: str | list[str] | None = None, api_key: str | None = None,
                 max_body_bytes: int = 1 << 20, max_tokens_limit: int = 1024, num_threads: int | None = None,
                 num_gpus: float = 0, deterministic: bool = False, engine_kwargs: dict | None = None):
        import torch

        if num_threads:
            torch.set_num_threads(num_threads)
        device = gpu_device(num_gpus)  # before the download: a replica without CUDA fails at once
        path = resolve_model_path(model)
        engine = Engine.from_pretrained(path, device=device, batch_invariant=deterministic, **(engine_kwargs or {}))
        # Most of a replica's start-up, of which Serve itself says only that the replica "has taken
        # more than 30s to initialize": say what it is and how long it takes.
        serve_log = logging.getLogger("ray.serve")
        serve_log.info("warming up the engine for %s: compiling its decode step, usually 15-60 s on CPU", path)
        start = time.perf_counter()
        engine.warmup()
        serve_log.info("engine warmed up in %.1f s", time.perf_counter() - start)
        self.engine = AsyncEngine(engine)
        self.tokenizer = self.engine.engine.tokenizer
        self.text_of = TokenText(self.tokenizer)
        # As vLLM's --served-model-name: requests may use any of the names, responses carry the one asked for.
        self.names = served_names(served_model_name) or [model_name(model, path)]
        self.api_key = api_key or None
        self.model_path, self.deterministic = str(path), deterministic
        self.max_body_bytes, self.max_tokens_limit = max_body_bytes, max_tokens_limit
        self.max_model_len = self.engine.engine.max_model_len
        self.metrics = Metrics(self.engine.engine)
        self.served = ServedPrompts()

    def check_health(self) -> None:
        if not self.engine.thread.is_alive():
            raise RuntimeError("engine step thread has stopped")

    async def routed(self, request: RoutedRequest) -> AsyncIterator[dict]:
        """An HTTP request relayed by PrefixRoutingIngress, run through this replica's FastAPI app:
        its ASGI messages, the response's headers naming this replica. Closing the generator (the
        client left) is a disconnect to the app, which cancels the engine requests."""
        messages: asyncio.Queue = asyncio.Queue()
        left = asyncio.Event()
        body = [{"type": "http.request", "body": request.body, "more_body": False}]

        async def receive() -> dict:
            if body:
                return body.pop()
            await left.wait()
            return {"type": "http.disconnect"}

        async def run():
            try:
                await self.app(request.scope, receive, messages.put)  # self.app: the FastAPI app Serve wraps us with
            finally:
                messages.put_nowait(None)

        replica = serve.get_replica_context().replica_id.unique_id.encode()
        if request.prompt_key is not None:
            self.served.begin(request.prompt_key)
        reset = ServedPrompts.relayed_key.set(request.prompt_key)
        task = asyncio.create_task(run())  # with relayed_key set: _submit records the prompt's tokens under it
        ServedPrompts.relayed_key.reset(reset)
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
                self.served.end(request.prompt_key)

    async def prefix_summary(self, request: SummaryRequest) -> tuple[str, list[int]]:
        """For the router (PrefixRoutingIngress.refresh): this replica's id and the blocks of the
        prompts relayed to it that its prefix cache still holds."""
        prefix, served, tokens = self.engine.engine.prefix, self.served, dict(self.served.tokens)

        def look_up() -> tuple[int, dict[str, int]]:  # on the step thread, whose the trie is
            if prefix is None:
                return 0, dict.fromkeys(tokens, 0)
            evicted = prefix.num_evicted_pages
            return evicted, {k: prefix.resumable_len(ids) for k, ids in served.to_look_up(tokens, evicted).items()}

        evicted, looked_up = await self.engine.between_steps(look_up)
        return serve.get_replica_context().replica_id.unique_id, served.held_blocks(looked_up, evicted, request.block_chars)

    # ---- plumbing shared by the endpoints -------------------------------------------------

    async def _handle(self, endpoint: str, request: Request, body_cls, handler: Callable) -> Response:
        body = None
        try:
            # As bytes: a header holding non-ASCII (the server sees it as latin-1) is a wrong key, not a crash.
            given = request.headers.get("authorization", "").encode("latin-1")
            if self.api_key and not hmac.compare_digest(given, f"Bearer {self.api_key}".encode()):
                raise APIError(401, "Incorrect API key provided", code="invalid_api_key")
            body = body_cls.model_validate(await self._json(request)) if body_cls else None
            response = await handler(body)
        except ValidationError as e:
            response = self._error(schema_error(e))
        except InvalidParam as e:
            param = PARAM_NAMES.get(endpoint, {}).get(e.param, e.param)
            if param == "text" and isinstance(body, GenerateRequest) and body.text is None:
                param = "input_ids"
            response = self._error(APIError(400, str(e), param=param))
        except QueueFull as e:
            response = self._error(APIError(503, f"server busy: {e}", "server_error", code="queue_full", headers={"Retry-After": "1"}))
        except APIError as e:
            response = self._error(e)
        except Exception:
            log.exception("request to %s failed", endpoint)
            response = self._error(APIError(500, "internal server error", "server_error"))
        self.metrics.requests.labels(endpoint, str(response.status_code)).inc()
        return response

    @staticmethod
    def _error(e: APIError) -> JSONResponse:
        return JSONResponse(e.body(), e.status, headers=e.headers)

    async def _json(self, request: Request):
        too_large = APIError(413, f"request body exceeds {self.max_body_bytes} bytes", code="request_too_large")
        length = request.headers.get("content-length") or "0"
        if length.isdigit() and int(length) > self.max_body_bytes:
            raise too_large
        body = b""
        async for chunk in request.stream():
            body += chunk
            if len(body) > self.max_body_bytes:
                raise too_large
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than the parser goes
            raise APIError(400, f"request body is not valid JSON: {e}", code="invalid_json") from None

    def _check_model(self, model: str | None) -> str:
        """The name to answer with: the requested one, or the first served name when none is given."""
        if model is None:
            return self.names[0]
        if model not in self.names:
            model = model.encode("utf-8", "backslashreplace").decode()  # a lone surrogate cannot go out as JSON
            raise APIError(404, f"The model `{model}` does not exist; this server serves {', '.join(f'`{n}`' for n in self.names)}",
                           param="model", code="model_not_found")
        return model

    def _max_tokens(self, requested: int | None, default: int | None, prompt_len: int, param: str = "max_tokens") -> int:
        if requested is None:
            return max(1, min(default or self.max_tokens_limit, self.max_tokens_limit, self.max_model_len - prompt_len))
        if isinstance(requested, int) and requested > self.max_tokens_limit:
            raise InvalidParam(param, f"{param}={requested} exceeds this server's limit of {self.max_tokens_limit}")
        return requested

    def _submit(self, prompts: list[str | list[int]], n: int, params_for: Callable[[list[int]], SamplingParams],
                rids: list[str] | None = None) -> list[RequestStream]:
        """Queue n requests per prompt (seeded choices get seed + j); all or none. With rids (one per
        prompt), choice j of prompt i has request id rids[i] (n = 1) or f"{rids[i]}-{j}"."""
        if not 1 <= n <= MAX_N:
            raise InvalidParam("n", f"n must be between 1 and {MAX_N}, got {n}")
        ids_of = [[rid if n == 1 else f"{rid}-{j}" for j in range(n)] for rid in rids] if rids else None
        if busy := [i for group in ids_of or [] for i in group if i in self.engine.streams]:
            raise InvalidParam("rid", f"rid {busy[0]!r} belongs to a request still running")
        streams: list[RequestStream] = []
        try:
            for k, prompt in enumerate(prompts):
                ids = self.engine.engine.encode(prompt)
                params = params_for(ids)
                for j in range(n):
                    seeded = replace(params, seed=params.seed + j) if params.seed is not None else params
                    streams.append(self.engine.submit(ids, seeded, ids_of[k][j] if ids_of else None))
                if k == 0 and (key := ServedPrompts.relayed_key.get()) is not None:  # the router's key is the first prompt's
                    self.served.add(key, ids)
        except BaseException:
            for s in streams:
                s.cancel()
            raise
        return streams

    async def _merged(self, streams: list[RequestStream], start: float) -> AsyncIterator[tuple[int, RequestOutput]]:
        """(choice index, output) from all streams as they come; records TTFT and inter-token latency."""
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream):
            try:
                async for out in s.outputs():
                    queue.put_nowait((i, out))
            except Exception as e:
                queue.put_nowait((i, e))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        last = [None] * len(streams)
        unfinished = len(streams)
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
            for s in streams:
                s.cancel()

    @staticmethod
    def _choices(streams: list[RequestStream]) -> list[Choice]:
        return [Choice(i, stop_token_ids=tuple(s.request.params.stop_token_ids)) for i, s in enumerate(streams)]

    def _stream(self, events: AsyncIterator[str]) -> StreamingResponse:
        async def body():
            try:
                async for e in events:
                    yield e
            except Exception as e:  # after the 200 has gone out: report in-band, then end the stream
                log.exception("stream failed")
                yield sse(APIError(500, str(e), "server_error").body())
            yield sse("[DONE]")

        return EventStream(body(), media_type="text/event-stream")

    # ---- endpoints --------------------------------------------------------------------------

    @api.get("/health")
    async def health(self) -> Response:
        alive = self.engine.thread.is_alive()
        return JSONResponse({"status": "ok" if alive else "engine stopped"}, 200 if alive else 503)

    @api.get("/metrics")
    async def prometheus(self) -> Response:
        return Response(generate_latest(self.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @api.get("/v1/models")
    async def models(self, request: Request) -> Response:
        async def handler(_):
            return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "sala",
                                                             "max_model_len": self.max_model_len,
                                                             "vocab_size": self.engine.engine.config.vocab_size}
                                                            for name in self.names]})

        return await self._handle("models", request, None, handler)

    @api.post("/v1/completions")
    async def completions(self, request: Request) -> Response:
        return await self._handle("completions", request, CompletionRequest, self._completions)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, request: Request) -> Response:
        return await self._handle("chat", request, ChatCompletionRequest, self._chat)

    @api.post("/generate")
    async def generate(self, request: Request) -> Response:
        return await self._handle("generate", request, GenerateRequest, self._generate)

    @api.post("/abort_request")
    async def abort_request(self, request: Request) -> Response:
        return await self._handle("abort", request, AbortRequest, self._abort)

    @api.post("/flush_cache")
    async def flush_cache(self, request: Request) -> Response:
        """SGLang's /flush_cache: drop every cached prefix page no running request holds."""
        async def handler(_):
            prefix = self.engine.engine.prefix
            return JSONResponse({"flushed_pages": await self.engine.between_steps(prefix.flush) if prefix else 0})

        return await self._handle("flush_cache", request, None, handler)

    @api.get("/get_model_info")
    async def get_model_info(self, request: Request) -> Response:
        async def handler(_):
            return JSONResponse({"model_path": self.model_path, "tokenizer_path": self.model_path, "is_generation": True,
                                 "served_model_names": self.names, "max_model_len": self.max_model_len,
                                 "vocab_size": self.engine.engine.config.vocab_size})

        return await self._handle("model_info", request, None, handler)

    @api.get("/get_server_info")
    async def get_server_info(self, request: Request) -> Response:
        async def handler(_):
            e = self.engine.engine
            plan = e.cache.plan
            return JSONResponse({
                "model_path": self.model_path, "served_model_names": self.names, "device": str(e.device),
                "max_model_len": self.max_model_len, "max_running_requests": plan.max_seqs,
                "max_total_num_tokens": plan.max_kv_tokens, "page_size": plan.page_size,
                "chunked_prefill_size": e.scheduler.max_batch_tokens, "max_queued_requests": e.scheduler.max_waiting,
                "max_tokens_limit": self.max_tokens_limit, "max_body_bytes": self.max_body_bytes, "max_n": MAX_N,
                "deterministic": self.deterministic, "compiled_decode": e.runner.fast_decode is not None,
                "api_key_required": self.api_key is not None,
                "running_requests": len(e.scheduler.running), "queued_requests": e.scheduler.num_waiting})

        return await self._handle("server_info", request, None, handler)

    async def _abort(self, body: AbortRequest) -> Response:
        if body.abort_all:
            ids = list(self.engine.streams)
        elif body.rid:
            ids = [body.rid, *(f"{body.rid}-{j}" for j in range(MAX_N))]  # and its choices, when n > 1
        else:
            raise InvalidParam("rid", "give the rid to abort, or abort_all: true")
        return JSONResponse({"aborted": [i for i in ids if self.engine.abort(i)]})

    def _log_user(self, rid: str, user: str | None) -> None:
        if user is not None:  # OpenAI's `user`: who asked, for abuse monitoring
            log.info("%s for user %r", rid, user)

    @api.post("/tokenize")
    @api.post("/v1/tokenize")
    async def tokenize(self, request: Request) -> Response:
        return await self._handle("tokenize", request, TokenizeRequest, self._tokenize)

    @api.post("/detokenize")
    @api.post("/v1/detokenize")
    async def detokenize(self, request: Request) -> Response:
        return await self._handle("detokenize", request, DetokenizeRequest, self._detokenize)

    async def _tokenize(self, body: TokenizeRequest) -> Response:
        """As vLLM and SGLang answer: {tokens, count, max_model_len} (lists of them for a list of prompts)."""
        self._check_model(body.model)
        try:
            texts, batched = body.texts(lambda m, **kw: self.tokenizer.apply_chat_template(m, tokenize=False, **kw))
        except TemplateError as e:  # as in /v1/chat/completions: a template that refuses these messages
            raise InvalidParam("messages", f"the chat template refused the messages: {e}") from None
        for t in texts:
            try:
                t.encode()
            except UnicodeEncodeError as e:  # a lone surrogate (JSON allows "\ud800"): no tokenizer takes it
                field = "prompt" if body.prompt is not None else "messages"
                raise InvalidParam(field, f"{field} is not valid Unicode: {e.reason} at character {e.start}") from None
        ids = [self.tokenizer(t, add_special_tokens=body.add_special_tokens)["input_ids"] for t in texts]
        out = {"tokens": ids, "count": [len(x) for x in ids], "max_model_len": self.max_model_len}
        if body.return_token_strs:
            out["token_strs"] = [self.tokenizer.convert_ids_to_tokens(x) for x in ids]
        return JSONResponse(out if batched else {k: v if k == "max_model_len" else v[0] for k, v in out.items()})

    async def _detokenize(self, body: DetokenizeRequest) -> Response:
        """As vLLM ({"prompt"}) and SGLang ({"text"}) answer, both keys; a list of lists gives lists."""
        self._check_model(body.model)
        batched = bool(body.tokens) and isinstance(body.tokens[0], list)
        seqs = body.tokens if batched else [body.tokens]
        vocab = self.engine.engine.config.vocab_size
        if any(not 0 <= t < vocab for seq in seqs for t in seq):
            raise InvalidParam("tokens", f"token ids must be in [0, {vocab})")
        texts = [self.tokenizer.decode(seq, skip_special_tokens=body.skip_special_tokens) for seq in seqs]
        text = texts if batched else texts[0]
        return JSONResponse({"prompt": text, "text": text})

    async def _completions(self, body: CompletionRequest) -> Response:
        start = time.perf_counter()
        name = self._check_model(body.model)
        prompts = body.prompts()
        n = body.choices_per_prompt
        with_logprobs = body.logprobs is not None
        # echo with max_tokens 0 scores the prompt alone (as vLLM): the engine samples one token, left out.
        score_only = body.echo and body.max_tokens == 0

        def params_for(ids: list[int]) -> SamplingParams:
            params = body.sampling(1 if score_only else self._max_tokens(body.max_tokens, 16, len(ids)), body.logprobs)
            return replace(params, prompt_logprobs_start=0) if body.echo and with_logprobs else params

        streams = self._submit(prompts, n, params_for)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        self._log_user(rid, body.user)
        head = {"id": rid, "object": "text_completion", "created": created, "model": name}
        choices = self._choices(streams)
        prompt_tokens = sum(s.num_prompt_tokens for s in streams[::n])  # each prompt once, whatever n (as OpenAI)
        text_of = token_id_text if body.return_tokens_as_token_ids else self.text_of
        sent = [""] * len(streams)  # each choice's text so far, echoed prompt included
        lps: list[dict | None] = [None] * len(streams)

        def piece(i: int, out: RequestOutput) -> dict:
            """Choice i's part of this output; the echoed prompt (text, logprobs) comes before its first one."""
            first = not choices[i].token_ids
            if score_only:
                out = replace(out, token_ids=[], text="", logprobs=[], finish_reason="length" if out.finished else None)
            choices[i].add(out)
            text, entries, first_token = out.text, out.logprobs, None
            if body.echo and first:
                prompt, ids = prompts[i // n], streams[i].request.prompt_ids
                text = (prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)) + text
                entries, first_token = out.prompt_logprobs + entries, ids[0]
            lp = completion_logprobs(text_of, entries, len(sent[i]), first_token) if with_logprobs else None
            sent[i] += text
            if lp is not None:
                lps[i] = lp if lps[i] is None else {k: lps[i][k] + lp[k] for k in lp}
            return {"index": i, "text": text, "logprobs": lp, "finish_reason": out.finish_reason,
                    "stop_reason": choices[i].stop_reason}

        if body.stream:
            async def events():
                for_usage = body.stream_options and body.stream_options.include_usage
                async for i, out in self._merged(streams, start):
                    yield sse({**head, "choices": [piece(i, out)]})
                if for_usage:
                    yield sse({**head, "choices": [], "usage": usage(choices, prompt_tokens, n)})

            return self._stream(events())
        async for i, out in self._merged(streams, start):
            piece(i, out)
        return JSONResponse({**head, "choices": [
            {"index": c.index, "text": sent[c.index], "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
             "logprobs": lps[c.index]}
            for c in choices], "usage": usage(choices, prompt_tokens, n)})

    async def _chat(self, body: ChatCompletionRequest) -> Response:
        start = time.perf_counter()
        name = self._check_model(body.model)
        body.refuse_not_implemented()
        top = body.top_k_logprobs()
        try:
            text = self.tokenizer.apply_chat_template([{"role": m.role, "content": m.text()} for m in body.messages],
                                                      tokenize=False, add_generation_prompt=True)
        except TemplateError as e:  # a template that refuses these messages (raise_exception), e.g. roles out of order
            raise InvalidParam("messages", f"the chat template refused the messages: {e}") from None
        requested, param = (body.max_completion_tokens, "max_completion_tokens") if body.max_completion_tokens is not None \
            else (body.max_tokens, "max_tokens")
        streams = self._submit([text], body.choices_per_prompt,
                               lambda ids: body.sampling(self._max_tokens(requested, None, len(ids), param), top))
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        self._log_user(rid, body.user)
        head = {"id": rid, "object": "chat.completion", "created": created, "model": name}
        choices = self._choices(streams)
        prompt_tokens = streams[0].num_prompt_tokens
        if body.stream:
            async def events():
                chunk = {**head, "object": "chat.completion.chunk"}
                for i in range(len(choices)):
                    yield sse({**chunk, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                     "logprobs": None, "finish_reason": None}]})
                async for i, out in self._merged(streams, start):
                    choices[i].add(out)
                    lp = chat_logprobs(self.text_of, out.logprobs) if top is not None else None
                    delta = {"content": out.text} if out.text or not out.finished else {}
                    yield sse({**chunk, "choices": [{"index": i, "delta": delta, "logprobs": lp, "finish_reason": out.finish_reason,
                                                     "stop_reason": choices[i].stop_reason}]})
                if body.stream_options and body.stream_options.include_usage:
                    yield sse({**chunk, "choices": [], "usage": usage(choices, prompt_tokens, body.n)})

            return self._stream(events())
        async for i, out in self._merged(streams, start):
            choices[i].add(out)
        return JSONResponse({**head, "choices": [
            {"index": c.index, "message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason,
             "stop_reason": c.stop_reason,
             "logprobs": chat_logprobs(self.text_of, c.logprobs) if top is not None else None}
            for c in choices], "usage": usage(choices, prompt_tokens, body.n)})

    async def _generate(self, body: GenerateRequest) -> Response:
        start = time.perf_counter()
        prompts = body.prompts()
        params = body.sampling()
        if params.max_tokens > self.max_tokens_limit:
            raise InvalidParam("max_tokens", f"max_new_tokens={params.max_tokens} exceeds this server's limit of {self.max_tokens_limit}")
        streams = self._submit(prompts, body.sampling_params.n, lambda ids: params, body.rids(len(prompts)))
        choices = self._choices(streams)
        single = len(streams) == 1

        def result(c: Choice) -> dict:
            s = streams[c.index]
            meta = {"id": s.request.request_id, "finish_reason": sglang_finish_reason(c), "prompt_tokens": c.num_prompt_tokens,
                    "completion_tokens": len(c.token_ids), "cached_tokens": c.num_cached_tokens, "e2e_latency": time.perf_counter() - start,
                    **spec_stats([c])}
            if body.return_logprob:
                with_text = body.return_text_in_logprobs
                meta["output_token_logprobs"], meta["output_top_logprobs"] = sglang_logprobs(self.text_of, c.logprobs, with_text)
                inp, inp_top = sglang_logprobs(self.text_of, c.prompt_logprobs, with_text)
                if body.logprob_start_len == 0:  # the first prompt token has no logprob
                    first = s.request.prompt_ids[0]
                    inp, inp_top = [[None, first, self.text_of(first) if with_text else None]] + inp, [None] + inp_top
                meta["input_token_logprobs"], meta["input_top_logprobs"] = inp, inp_top
            out = {"text": c.text, "output_ids": c.token_ids, "meta_info": meta}
            return out if single else {"index": c.index, **out}

        if body.stream:
            async def events():
                async for i, out in self._merged(streams, start):
                    choices[i].add(out)
                    yield sse(result(choices[i]))

            return self._stream(events())
        async for i, out in self._merged(streams, start):
            choices[i].add(out)
        return JSONResponse(result(choices[0]) if single else [result(c) for c in choices])


class MedusaOff(ValueError):
    """A Medusa setting for a model served without Medusa."""


def build_app(model: str | None = None, *, served_model_name: str | list[str] | None = None, api_key: str | None = None,
              num_cpus: float = 1.0, num_gpus: float = 0, deterministic: bool = False, num_threads: int | None = None,
              max_body_bytes: int = 1 << 20, max_tokens_limit: int = 1024, kv_plan=None, num_replicas: int = 1,
              autoscaling_config: dict | None = None, prefix_routing: bool = True, prefix_routing_options: dict | None = None,
              **engine_kwargs):
    """The Serve application for `serve.run`; api_key defaults to $SALA_API_KEY (unset: no auth).
    kv_plan (a kv_plan.json path or its dict; default: the checkpoint's own) is checked against the
    model here, so a bad plan fails before any replica starts (KVPlanError naming the problem).
    num_gpus > 0 reserves that many GPUs for the replica and runs the engine on CUDA; deterministic
    makes a request's logprobs bitwise independent of the rest of the batch (evaluation mode, slower).
    With several replicas (num_replicas > 1, or an autoscaling_config) and prefix_routing, requests
    sharing a prompt prefix go to the replica caching it (serve/router.py; prefix_routing_options are
    PrefixAffinityRouter's: block_chars, max_blocks, imbalanced_threshold, min_match_rate,
    refresh_interval_s); without
    prefix_routing Serve's power of two choices spreads them. medusa_max_batch (an engine setting)
    is checked here too: MedusaOff when the model is served without Medusa."""
    served_names(served_model_name)  # a bad value fails here, not in the replica
    if not isinstance(num_replicas, int) or num_replicas < 1:
        raise ValueError(f"num_replicas must be an integer >= 1, got {num_replicas!r}")
    if prefix_routing_options and not prefix_routing:
        raise ValueError("prefix_routing_options given with prefix_routing off: drop them or turn prefix_routing on")
    routing = RoutingOptions(**(prefix_routing_options or {}))  # a bad option fails here, not in the router
    if model is None:  # tiny-sala, built here if need be: a replica only ever resolves, never trains
        from sala.tiny import ensure_tiny_sala

        model = str(ensure_tiny_sala())
    if num_gpus < 0:
        raise ValueError(f"num_gpus must be >= 0, got {num_gpus}")
    if engine_kwargs.get("medusa_max_batch") is not None:  # checked here: a replica failing to start says it less plainly
        engine_kwargs["medusa_max_batch"] = parse_max_batch(engine_kwargs["medusa_max_batch"])
        if deterministic or engine_kwargs.get("medusa") is False or not has_medusa(resolve_model_path(model)):
            raise MedusaOff(f"medusa_max_batch={engine_kwargs['medusa_max_batch']!r} but {model} is served without "
                            "Medusa (medusa: false, deterministic, or no medusa/ heads)")
    if kv_plan is not None:  # the replica gets the checked plan itself: a path may not exist on its node
        engine_kwargs["kv_plan"] = load_plan(kv_plan, read_config(resolve_model_path(model))).to_json()
    api_key = os.environ.get("SALA_API_KEY") if api_key is None else api_key
    routed = prefix_routing and (num_replicas > 1 or autoscaling_config is not None)
    options = {"ray_actor_options": {"num_cpus": num_cpus, "num_gpus": num_gpus}}
    options |= {"autoscaling_config": autoscaling_config} if autoscaling_config is not None else {"num_replicas": num_replicas}
    if routed:
        options["request_router_config"] = RequestRouterConfig(request_router_class=PrefixAffinityRouter,
                                                                request_router_kwargs=prefix_routing_options or {})
    server = SalaServer.options(**options).bind(
        model, served_model_name=served_model_name, api_key=api_key, max_body_bytes=max_body_bytes,
        max_tokens_limit=max_tokens_limit, num_threads=num_threads, num_gpus=num_gpus, deterministic=deterministic,
        engine_kwargs=engine_kwargs)
    return (PrefixRoutingIngress.bind(server, max_body_bytes=max_body_bytes, refresh_interval_s=routing.refresh_interval_s)
            if routed else server)


def app_builder(args: dict):
    """`serve run serve/config.yaml` entry point: the YAML's `args` are build_app's keyword arguments."""
    return build_app(**args)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m serve.app", description="Serve a SALA checkpoint over HTTP")
    ap.add_argument("--model", help="checkpoint directory or models:/name@alias (default: tiny-sala)")
    ap.add_argument("--served-model-name", nargs="+", metavar="NAME",
                    help="name(s) requests may use; responses carry the one asked for, or the first "
                         "(default: the registered model's name, or the directory's)")
    ap.add_argument("--host", default="127.0.0.1", help="address to bind (default: %(default)s)")
    ap.add_argument("--port", type=int, default=8000, help="HTTP port (default: %(default)s)")
    ap.add_argument("--num-cpus", type=float, default=1.0, help="CPUs the replica reserves in Ray (default: %(default)s)")
    ap.add_argument("--num-gpus", type=float, default=0.0,
                    help="GPUs the replica reserves in Ray; > 0 runs the engine on CUDA (default: %(default)s)")
    ap.add_argument("--deterministic", action="store_true",
                    help="evaluation mode: a request's logprobs are bitwise identical whatever else is in the batch; "
                         "costs throughput")
    ap.add_argument("--no-prefix-cache", dest="prefix_cache", action="store_false",
                    help="compute every prompt in full instead of reusing cached prefixes (K/V pages, lightning-state snapshots)")
    ap.add_argument("--num-threads", type=int, help="torch threads in the replica (default: torch's choice)")
    ap.add_argument("--num-replicas", type=int, default=1, help="engine replicas (default: %(default)s)")
    ap.add_argument("--no-prefix-routing", dest="prefix_routing", action="store_false",
                    help="with several replicas, leave requests to Serve's power of two choices instead of sending "
                         "those that share a prompt prefix to the replica caching it")
    ap.add_argument("--max-tokens-limit", type=int, default=1024,
                    help="largest max_tokens a request may ask for (default: %(default)s)")
    ap.add_argument("--medusa", action=argparse.BooleanOptionalAction, default=None,
                    help="decode with the checkpoint's medusa/ heads (default: when it has them)")
    ap.add_argument("--medusa-max-batch", metavar="N|auto",
                    help="verify draft trees only while at most N requests decode, decoding plainly above that; "
                         "auto: chosen from step times measured at start-up (default: always verify)")
    ap.add_argument("--kv-plan", help="kv_plan.json for the cache: each layer's K/V format or state dtype "
                                      "(default: the checkpoint's own, if it has one)")
    args = ap.parse_args(argv)
    if args.num_gpus < 0:
        ap.error("--num-gpus must be >= 0")
    if args.num_replicas < 1:
        ap.error("--num-replicas must be >= 1")
    try:
        args.medusa_max_batch = parse_max_batch(args.medusa_max_batch)
    except SpeculationSettingError as e:
        ap.error(str(e))
    return args


def _app_running(name: str) -> bool:
    try:
        return name in serve.status().applications
    except (RayActorError, RayServeException):  # the controller is gone: `serve shutdown` stopped Serve
        return False


def main(argv: list[str] | None = None) -> int:
    import ray

    args = parse_args(argv)
    if not os.environ.get("RAY_ADDRESS"):
        # A local Ray has this machine's GPUs or none; a cluster may add GPU nodes on demand.
        try:
            gpu_device(args.num_gpus)
        except DeviceUnavailable as e:
            print(f"error: --num-gpus: {e}", file=sys.stderr)
            return 2
    try:  # before Ray starts: a bad plan is one line and exit 2
        app = build_app(args.model, served_model_name=args.served_model_name, num_cpus=args.num_cpus,
                        num_gpus=args.num_gpus, deterministic=args.deterministic, num_threads=args.num_threads,
                        max_tokens_limit=args.max_tokens_limit, kv_plan=args.kv_plan, prefix_cache=args.prefix_cache,
                        num_replicas=args.num_replicas, prefix_routing=args.prefix_routing,
                        **({} if args.medusa is None else {"medusa": args.medusa}),
                        **({} if args.medusa_max_batch is None else {"medusa_max_batch": args.medusa_max_batch}))
    except KVPlanError as e:
        print(f"error: --kv-plan: {e}", file=sys.stderr)
        return 2
    except MedusaOff as e:
        print(f"error: --medusa-max-batch: {e}", file=sys.stderr)
        return 2
    ctx = ray.init(namespace="serve")  # what serve.start would do, keeping the dashboard's address
    serve.start(http_options={"host": args.host, "port": args.port})
    serve.run(app, name="sala", route_prefix="/")
    # The serve CLI beside this interpreter, by its full path: the printed command runs from any
    # shell, whether or not this environment's bin directory is on its PATH.
    stop_cmd = f"{shlex.quote(os.path.join(sysconfig.get_path('scripts'), 'serve'))} shutdown -y"
    if ctx.dashboard_url and ctx.dashboard_url.rsplit(":", 1)[-1] != "8265":
        stop_cmd += f" --address http://{ctx.dashboard_url}"
    if os.environ.get("RAY_AUTH_MODE") == "token":  # set by ray.init when it enabled token auth
        stop_cmd = f"RAY_AUTH_MODE=token {stop_cmd}"
    print(f"serving on http://{args.host}:{args.port}; stop with Ctrl-C, or from another shell: {stop_cmd}", flush=True)
    # Ray's own SIGTERM handler dumps a stack trace and kills the process: stop cleanly instead.
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    while not stop.wait(2):
        if not _app_running("sala"):
            print("Serve was shut down; exiting", flush=True)
            return 0
    # Only this app: on a shared cluster Serve and its other apps stay (and serve.shutdown's
    # killed controller would add a raylet line about a failed, retried task).
    serve.delete("sala")
    print("stopped", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
